//! A few seconds of the soak run in the default suite, so the binary and its books are
//! exercised on every run (the long soak is `kvxfer-soak --seconds N`, documented in the
//! README).

use std::process::Command;

#[test]
fn a_short_soak_balances_its_books() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-soak"))
        .args([
            "--seconds",
            "4",
            "--restart-every-ms",
            "1000",
            "--drivers",
            "2",
            "--blocks",
            "1024",
            "--json",
        ])
        .output()
        .expect("run kvxfer-soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "soak failed:\n{stdout}\n{stderr}");
    let books: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(books["ok"], true, "{books}");
    assert_eq!(books["balanced"], true, "{books}");
    assert!(books["parents"].as_u64().unwrap_or(0) > 0, "{books}");
    assert_eq!(books["unrecognized_notifications"], 0, "{books}");
    assert_eq!(books["duplicate_ends"], 0, "{books}");
}
