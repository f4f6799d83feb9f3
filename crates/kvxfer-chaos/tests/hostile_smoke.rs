//! `kvxfer-hostile` with tiny settings: it runs, its JSON report parses, and the legitimate
//! decode agent's pulls went through while every attack ran (counts only, no timing).

#![cfg(target_os = "linux")]

use std::process::Command;

use serde_json::Value;

#[test]
fn the_hostile_load_generator_reports_pulls_that_went_through_under_attack() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-hostile"))
        .args(["--conns", "32", "--addrs", "4", "--baseline-secs", "1", "--duration", "2"])
        .args(["--settle-secs", "0.2", "--blocks", "64", "--json"])
        .output()
        .expect("kvxfer-hostile runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvxfer-hostile failed: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("a JSON report on stdout");
    let phases = report["phases"].as_array().expect("phases");
    assert_eq!(phases.len(), 2, "a baseline and an attack phase: {report}");
    let (baseline, attack) = (&phases[0], &phases[1]);
    assert!(baseline["pulls"]["ok"].as_u64() > Some(0), "{baseline}");
    assert!(attack["pulls"]["ok"].as_u64() > Some(0), "no legitimate pull went through: {attack}");
    // Every attack that uses connections connected at least once.
    let hostile = attack["hostile"].as_object().expect("hostile");
    assert_eq!(hostile.len(), 9, "{hostile:?}");
    for (name, stats) in hostile {
        if name != "own-stale-release" {
            assert!(stats["connects"].as_u64() > Some(0), "{name}: {stats}");
        }
    }
    // A legitimate peer's new connections were tried during the attack.
    assert!(attack["new_connections"]["count"].as_u64() > Some(0), "{attack}");
    // The prefill's counters and resources were read.
    assert!(attack["counters"]["server"]["connections"].as_u64() > Some(0), "{attack}");
    assert!(attack["prefill"]["rss_peak_mib"].as_f64() > Some(0.0), "{attack}");
}
