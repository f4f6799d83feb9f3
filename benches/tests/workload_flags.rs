//! The open-loop workload's flags: rates it cannot keep are refused, and leases taken ahead
//! of need are used before their ttl runs out.

mod support;

use std::process::Command;

use support::{json_lines, BIN};

/// `--rate inf` (whose gaps are zero: an overflow), 0 and negative rates are refused with a
/// clear error instead of being run as something else.
#[test]
fn rates_that_are_not_finite_and_positive_are_refused() {
    for rate in ["inf", "0", "-2", "NaN"] {
        let out = Command::new(BIN)
            .args([
                "--transport",
                "tcp",
                "--block-bytes",
                "16K",
                &format!("--rate={rate}"),
                "--duration",
                "0.1",
            ])
            .output()
            .expect("run kvxfer-bench");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--rate {rate} ran: {}", String::from_utf8_lossy(&out.stdout));
        assert!(
            stderr.contains("--rate") && stderr.contains("parents per second"),
            "--rate {rate}: {stderr}"
        );
    }
}

/// An open loop slow enough that its look-ahead once spanned the whole window: 10 parents/s
/// for 2.5 s with 1 s leases took all 25 leases at the start, and those used after 1 s had
/// expired (the run aborted). Batches are now at most rate × ttl / 4 parents.
#[test]
fn a_slow_open_loop_uses_its_leases_before_they_expire() {
    let rows = json_lines(Command::new(BIN).args([
        "--transport",
        "tcp",
        "--block-bytes",
        "16K",
        "--n",
        "1",
        "--blocks-per-child",
        "1",
        "--rate",
        "10",
        "--max-in-flight",
        "64",
        "--lease-batch",
        "64",
        "--lease-ttl",
        "1",
        "--duration",
        "2.5",
        "--warmup-secs",
        "0",
        "--json",
    ]));
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["lease_ttl_s"], 1.0, "{r}");
    assert!(r["requests"].as_u64().is_some_and(|n| n > 0), "{r}");
}
