//! SIGTERM of a registered prefill process (`kvxfer-node`, real etcd): its key must go at
//! once — not when its lease runs out — so a decode agent's pull of one of its hand-offs
//! fails as `EngineNotRegistered`, not at a refused connection.
#![cfg(feature = "cluster")]

use std::io::Write;
use std::time::{Duration, Instant};

use kvxfer_cluster::testing::EtcdServer;
use serde_json::{json, Value};

mod node;
use node::Node;

/// The registration's lease TTL: far longer than the bound the test allows for the key to go.
const TTL_S: &str = "60";
/// How soon after SIGTERM the decode side must see the engine leave.
const GONE_WITHIN: Duration = Duration::from_secs(5);

#[test]
fn sigterm_deregisters_a_prefill_node_at_once() {
    let etcd = EtcdServer::start();
    let url = etcd.endpoint();
    let cluster = ["--etcd", &url, "--namespace", "sigterm-test", "--blocks", "64", "--block-bytes", "4096"];
    let engine = "sigterm-prefill";
    let mut prefill = Node::start(
        &[
            &["prefill", "--engine-id", engine, "--registration-ttl-s", TTL_S, "--ttl-ms", "30000"][..],
            &cluster[..],
        ]
        .concat(),
    );
    prefill.event("listening", Duration::from_secs(30));
    let registered = prefill.event("registered", Duration::from_secs(30));
    assert_eq!(registered["ok"], true, "{registered}");

    let mut decode = Node::start(&[&["decode", "--metrics", "127.0.0.1:0"][..], &cluster[..]].concat());
    decode.event("ready", Duration::from_secs(30));
    let metrics = decode.event("metrics", Duration::from_secs(10))["addr"].as_str().expect("addr").to_owned();
    decode.wait("the prefill engine in the directory", Duration::from_secs(15), |v| {
        v["event"] == "directory" && v["engine"] == engine && (v["kind"] == "present" || v["kind"] == "added")
    });

    prefill.send(json!({"cmd": "lease", "parent": "P", "n": 2, "blocks_per_child": 4}));
    let result =
        prefill.event("result", Duration::from_secs(10))["result"].as_str().expect("result").to_owned();

    let sent = Instant::now();
    prefill.signal("TERM");

    // The key goes at once (revoked), not when its 60 s lease runs out.
    decode.wait("the prefill engine removed", GONE_WITHIN, |v| {
        v["event"] == "directory" && v["engine"] == engine && v["kind"] == "removed"
    });
    let gone_after = sent.elapsed();

    // The prefill process releases its live leases, says so and exits cleanly.
    let shutdown = prefill.event("shutdown", Duration::from_secs(15));
    assert_eq!(shutdown["signal"], "SIGTERM", "{shutdown}");
    let released: Vec<&Value> = prefill.seen.iter().filter(|v| v["event"] == "lease_end").collect();
    assert_eq!(released.len(), 2, "both leases end before the shutdown line: {:?}", prefill.seen);
    assert!(released.iter().all(|v| v["kind"] == "Released"), "{released:?}");
    let status = prefill.child.wait().expect("wait");
    assert!(status.success(), "kvxfer-node exits with status 0 after SIGTERM: {status}");

    // A pull of its hand-off fails as EngineNotRegistered (not a refused connection).
    decode.send(json!({"cmd": "pull", "result": result}));
    for _ in 0..2 {
        let child = decode.event("child", Duration::from_secs(15));
        assert_eq!(child["outcome"], "failed", "{child}");
        assert_eq!(child["error_kind"], "EngineNotRegistered", "{child}");
        assert_eq!(child["advice"], "RetryFreshHandoff", "{child}");
    }
    decode.event("pull_done", Duration::from_secs(15));
    // The decode side counts the failures by kind.
    let text = scrape(&metrics);
    assert!(
        text.lines()
            .any(|l| l == r#"kvxfer_children_total{outcome="failed",kind="engine_not_registered"} 2"#),
        "{text}"
    );
    eprintln!("key gone {gone_after:?} after SIGTERM (TTL {TTL_S} s)");
}

/// `GET /metrics` (the Prometheus text format: no Accept header).
fn scrape(addr: &str) -> String {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("response");
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or(text)
}
