//! SIGTERM (and SIGINT) of `kvxfer-register`: the key goes at once (the lease is revoked),
//! not when its TTL runs out.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer_cluster::{DirectoryEvent, DirectoryOptions, EngineDirectory};
use support::{namespace, next_event, start_etcd, wait_added, LAYOUT_HASH};
use tokio::runtime::Handle;

/// Far longer than the bound the test allows for the key to go.
const TTL_SECS: &str = "60";
const GONE_WITHIN: Duration = Duration::from_secs(5);

async fn signal_deregisters(signal: &str) {
    let etcd = start_etcd();
    let engine = format!("registered-{}", signal.to_ascii_lowercase());
    let dir =
        EngineDirectory::start(&Handle::current(), etcd.config(), namespace(), DirectoryOptions::default())
            .expect("directory");
    let mut events = dir.subscribe();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvxfer-register"))
        .args(["--etcd", &etcd.endpoint(), "--namespace", namespace().as_str(), "--engine-id", &engine])
        .args(["--addr", "127.0.0.1:7200", "--ttl-secs", TTL_SECS])
        .args(["--compat-hash", &format!("{LAYOUT_HASH:016x}")])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvxfer-register");
    let mut stderr = child.stderr.take().expect("stderr");
    let log = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(serde_json::from_str(&line).expect("a JSON line"));
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).expect("registered line");
    assert_eq!(line["event"], "registered", "{line}");
    wait_added(&mut events, &[&engine]).await;

    let sent = Instant::now();
    let ok =
        Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status().expect("kill");
    assert!(ok.success());
    let event =
        tokio::time::timeout(GONE_WITHIN, next_event(&mut events, "the key's removal")).await.unwrap_or_else(
            |_| panic!("the key is still there {GONE_WITHIN:?} after {signal} (TTL {TTL_SECS} s)"),
        );
    assert!(matches!(&event, DirectoryEvent::Removed(e) if e.key.engine_id.as_str() == engine), "{event:?}");
    let elapsed = sent.elapsed();
    let line = rx.recv_timeout(Duration::from_secs(10)).expect("revoked line");
    assert_eq!(line["event"], "revoked", "{line}");
    let status = child.wait().expect("wait");
    assert!(status.success(), "exits with status 0 after {signal}: {status}");
    eprintln!("key gone {elapsed:?} after {signal}");
    // The log (a pipe) has no colour codes, and names the key one way: the full key.
    let log = log.join().expect("stderr reader");
    assert!(!log.contains('\u{1b}'), "colour codes in a piped log:\n{log:?}");
    let full = format!("key={}", support::key(&engine, 0).to_key());
    for what in ["registered in etcd", "etcd registration revoked"] {
        let line =
            log.lines().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no {what:?} line:\n{log}"));
        assert!(line.contains(&full), "{what:?} does not name the key as {full}: {line}");
    }
    dir.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_revokes_the_registration_at_once() {
    signal_deregisters("TERM").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_revokes_the_registration_at_once() {
    signal_deregisters("INT").await;
}
