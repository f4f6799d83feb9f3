//! What `kvxfer-node` writes: logs without colour codes when stderr is not a terminal, and
//! JSON lines whose values are plain fields (no Rust `Debug` dumps).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer-node");

/// A node's stderr (a pipe, not a terminal) holds no ANSI escape sequences: they wrote
/// `\x1b[2m...\x1b[0m` into every log file.
#[test]
fn logs_have_no_colour_codes_when_stderr_is_not_a_terminal() {
    let mut child = Command::new(BIN)
        .args(["prefill", "--blocks", "16", "--block-bytes", "4096"])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .env_remove(kvxfer::CLUSTER_KEY_ENV)
        .env_remove(kvxfer::CLUSTER_KEY_FILE_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvxfer-node");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("listening line");
    // A live lease: the shutdown when stdin closes releases it and logs so (at info).
    writeln!(stdin, r#"{{"cmd":"lease","parent":"P","n":1,"blocks_per_child":2}}"#).expect("lease");
    line.clear();
    stdout.read_line(&mut line).expect("result line");
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("stdout");
    let mut stderr = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("stderr");
    assert!(child.wait().expect("wait").success());
    assert!(stderr.contains("INFO"), "some log lines to look at:\n{stderr}");
    assert!(!stderr.contains('\u{1b}'), "colour codes in a piped log:\n{stderr:?}");
}

/// A prefill node that could not register says where its registration stands as fields
/// (`state`, `last_error`, `failures`): it printed `"status": "Some(EtcdStatus { state:
/// Connecting, since: Instant { .. }, .. })"`.
#[cfg(feature = "cluster")]
#[test]
fn an_unregistered_node_reports_its_etcd_state_as_fields() {
    use serde_json::Value;
    use std::time::Duration;
    // Nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let mut child = Command::new(BIN)
        .args(["prefill", "--blocks", "16", "--block-bytes", "4096", "--registration-wait-s", "1"])
        .args(["--etcd", &format!("http://127.0.0.1:{port}"), "--engine-id", "nowhere"])
        .env_remove(kvxfer::CLUSTER_KEY_ENV)
        .env_remove(kvxfer::CLUSTER_KEY_FILE_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvxfer-node");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let registered = loop {
        let l = rx.recv_timeout(Duration::from_secs(30)).expect("a registered line");
        let v: Value = serde_json::from_str(&l).expect("JSON");
        if v["event"] == "registered" {
            break v;
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(registered["ok"], false, "{registered}");
    assert!(registered.get("status").is_none(), "a Debug dump: {registered}");
    let state = registered["state"].as_str().expect("state");
    assert!(["connecting", "degraded"].contains(&state), "{registered}");
    assert!(registered["failures"].is_u64(), "{registered}");
    assert!(registered["last_error"].is_string() || registered["last_error"].is_null(), "{registered}");
    // (last_error is the etcd client's message, whatever it writes.)
    for (k, v) in registered.as_object().expect("object").iter().filter(|(k, _)| *k != "last_error") {
        let text = v.to_string();
        assert!(!text.contains("Some(") && !text.contains(" { "), "{k} looks like a Debug dump: {text}");
    }
}
