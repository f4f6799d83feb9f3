//! Shared by the tests of the `kvxfer-bench` binary: running it and reading its JSON lines.

use std::process::Command;

/// The `kvxfer-bench` binary under test.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_kvxfer-bench");

/// Runs `cmd` to completion and returns one JSON value per line of its stdout; panics with
/// its stderr and stdout when it fails.
pub(crate) fn json_lines(cmd: &mut Command) -> Vec<serde_json::Value> {
    let out = cmd.output().expect("run kvxfer-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "kvxfer-bench failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().map(|l| serde_json::from_str(l).expect("json line")).collect()
}
