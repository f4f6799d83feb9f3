//! `kill -9` of either side mid-pull, with real processes (`kvxfer-node`). A fault proxy
//! between them stalls the payload so the kill lands mid-pull every time. And the other
//! ends of a node: SIGTERM, or its stdin closing, after a pull over UCX.

use std::time::{Duration, Instant};

use kvxfer_chaos::{Direction, Fault, FaultKind, FaultProxy};
use serde_json::{json, Value};

mod node;
use node::Node;

const N: u64 = 4;
/// 16 blocks of 64 KiB: a 1 MiB payload per child.
const BPC: u64 = 16;

fn prefill_node(ttl_ms: u64) -> (Node, String) {
    let ttl = ttl_ms.to_string();
    let node = Node::start(&["prefill", "--ttl-ms", &ttl, "--io-timeout-ms", "1500"]);
    let addr = node.wait_event("listening", Duration::from_secs(30), &mut Vec::new())["addr"]
        .as_str()
        .expect("addr")
        .to_owned();
    (node, addr)
}

/// A decode node, once its agent is up (so leases are not spent waiting for it to start).
fn decode_node(args: &[&str]) -> Node {
    let node = Node::start(&[&["decode"][..], args].concat());
    node.wait_event("ready", Duration::from_secs(30), &mut Vec::new());
    node
}

fn lease(prefill: &mut Node, parent: &str) -> String {
    lease_sized(prefill, parent, N, BPC)
}

/// Leases parent `parent` of `n` children of `bpc` blocks each; returns its hex result.
fn lease_sized(prefill: &mut Node, parent: &str, n: u64, bpc: u64) -> String {
    prefill.send(json!({"cmd": "lease", "parent": parent, "n": n, "blocks_per_child": bpc}));
    prefill.wait_event("result", Duration::from_secs(10), &mut Vec::new())["result"]
        .as_str()
        .expect("result")
        .to_owned()
}

fn stats(prefill: &mut Node) -> Value {
    prefill.send(json!({"cmd": "stats"}));
    prefill.wait_event("stats", Duration::from_secs(10), &mut Vec::new())
}

/// Waits until the proxy stalled a payload: the decode side is mid-pull.
fn wait_mid_pull(proxy: &FaultProxy) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while proxy.stats().faults_fired == 0 {
        assert!(Instant::now() < deadline, "the pull never reached the stall: {:?}", proxy.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A prefill node (lease ttl `ttl_ms`) and a decode node pulling N children from it through
/// a proxy that stalls the payload for `stall`; returns once the stall has begun.
fn stalled_pull(ttl_ms: u64, stall: Duration) -> (Node, FaultProxy, Node) {
    let (mut prefill, addr) = prefill_node(ttl_ms);
    let fault = Fault::new(Direction::ToDecode, 200_000, FaultKind::Delay(stall));
    let proxy = FaultProxy::start(addr.parse().expect("addr"), vec![fault]).expect("proxy");
    let mut decode = decode_node(&["--io-timeout-ms", "1500"]);
    let result = lease(&mut prefill, "P");
    decode.send(json!({"cmd": "pull", "result": result, "peer": proxy.addr().to_string()}));
    wait_mid_pull(&proxy);
    (prefill, proxy, decode)
}

#[test]
fn decode_killed_mid_pull_leases_expire_and_the_owner_is_told() {
    let (mut prefill, _proxy, mut decode) = stalled_pull(1500, Duration::from_secs(60));
    decode.kill9();
    let killed = Instant::now();

    // Every lease ends once, by expiry (heartbeats stopped with the process), and the
    // owner hears of each.
    let (ends, _) = prefill.wait_events("lease_end", N as usize, Duration::from_secs(15));
    let took = killed.elapsed();
    let mut children: Vec<u64> = ends.iter().map(|e| e["child"].as_u64().expect("child")).collect();
    children.sort_unstable();
    assert_eq!(children, (0..N).collect::<Vec<_>>());
    assert!(ends.iter().all(|e| e["kind"] == "Expired"), "{ends:?}");
    let s = stats(&mut prefill);
    assert_eq!(
        (s["leased"].as_u64(), s["expired"].as_u64(), s["live"].as_u64()),
        (Some(N), Some(N), Some(0)),
        "{s}"
    );
    assert_eq!(s["pins_open"], 0);
    eprintln!(
        "decode killed mid-pull: {N} leases expired and reported {:.2} s after the kill",
        took.as_secs_f64()
    );
    // Nothing more ends later (no double end).
    let more = prefill.next_line(Duration::from_millis(300));
    assert!(!matches!(&more, Ok(v) if v["event"] == "lease_end"), "{more:?}");
}

#[test]
fn prefill_killed_mid_pull_fails_children_and_a_new_prefill_serves_the_retry() {
    let (mut prefill, proxy, mut decode) = stalled_pull(10_000, Duration::from_millis(1500));
    prefill.kill9();
    let killed = Instant::now();

    let (children, _) = decode.wait_events("child", N as usize, Duration::from_secs(20));
    let took = killed.elapsed();
    decode.wait_event("pull_done", Duration::from_secs(5), &mut Vec::new());
    // Every child that was not already complete failed, naming its local blocks.
    let failed: Vec<&Value> = children.iter().filter(|c| c["outcome"] == "failed").collect();
    assert!(!failed.is_empty(), "{children:?}");
    for c in &children {
        match c["outcome"].as_str() {
            Some("failed") => {
                assert_eq!(c["invalid_local_blocks"].as_array().map(Vec::len), Some(BPC as usize), "{c}");
                assert!(!c["reason"].as_str().unwrap_or("").is_empty());
                assert_eq!(c["advice"], "RetryFreshHandoff", "{c}");
            }
            Some("done") => assert_eq!(c["verified"], true, "{c}"),
            other => panic!("unexpected outcome {other:?}: {c}"),
        }
    }
    eprintln!(
        "prefill killed mid-pull: {} of {N} children failed with their blocks named, {:.2} s after the kill",
        failed.len(),
        took.as_secs_f64()
    );
    assert!(took < Duration::from_secs(15), "bounded: {took:?}");

    // A new prefill process; the same decode process pulls from it, every byte verified.
    let (mut prefill2, addr2) = prefill_node(10_000);
    let result = lease(&mut prefill2, "P2");
    decode.send(json!({"cmd": "pull", "result": result, "peer": addr2}));
    let (children, _) = decode.wait_events("child", N as usize, Duration::from_secs(20));
    assert!(children.iter().all(|c| c["outcome"] == "done" && c["verified"] == true), "{children:?}");
    let (ends, _) = prefill2.wait_events("lease_end", N as usize, Duration::from_secs(10));
    assert!(ends.iter().all(|e| e["kind"] == "Pulled"), "{ends:?}");
    drop(proxy);
}

/// A prefill and a decode node over UCX (tcp transport, peer-failure handling on) with 1 MiB
/// blocks, the decode one pulling N children of 64 MiB; returns once the prefill side holds
/// a pin — a one-sided read is under way (those reads do not pass a proxy, so that is how a
/// kill is timed mid-pull).
#[cfg(feature = "ucx")]
fn ucx_pull_under_way(ttl_ms: u64) -> (Node, Node) {
    let ucx = ["--transport", "ucx", "--ucx-tls", "tcp", "--ucx-peer-failure", "--io-timeout-ms", "1500"];
    let big = ["--blocks", "256", "--block-bytes", "1048576"];
    let ttl = ttl_ms.to_string();
    let mut prefill = Node::start(&[&["prefill", "--ttl-ms", &ttl][..], &ucx, &big].concat());
    prefill.wait_event("listening", Duration::from_secs(30), &mut Vec::new());
    let mut decode = decode_node(&[&ucx[..], &big].concat());
    // A first pull wires the UCX endpoints up. (A peer killed while UCX 1.13 is still wiring
    // an endpoint up over tcp can make the survivor abort inside UCX — assertion "got REP
    // message" in ucp_request.c — whatever kvxfer does; see ARCHITECTURE.md, UCX notes.)
    let warm = lease_sized(&mut prefill, "W", 1, 1);
    decode.send(json!({"cmd": "pull", "result": warm}));
    decode.wait_event("pull_done", Duration::from_secs(30), &mut Vec::new());
    prefill.wait_event("lease_end", Duration::from_secs(10), &mut Vec::new());
    let result = lease_sized(&mut prefill, "U", N, 64);
    decode.send(json!({"cmd": "pull", "result": result}));
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats(&mut prefill)["pins_open"].as_u64().unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "no read under way");
        std::thread::sleep(Duration::from_millis(2));
    }
    (prefill, decode)
}

/// A node ended by SIGTERM or by its stdin closing drops its agent before it exits, once
/// the agent's UCX objects are torn down: a process exiting with a UCX worker alive can
/// crash in UCX's exit handlers (a prefill node once died of SIGSEGV there). Before this,
/// a decode node exited on SIGTERM with its UCX initiator alive, and either node on stdin
/// closing with its whole agent alive.
#[cfg(feature = "ucx")]
#[test]
fn nodes_drop_their_ucx_agents_before_they_exit() {
    let ucx = ["--transport", "ucx", "--ucx-tls", "tcp", "--ucx-peer-failure"];
    let mut prefill = Node::start(&[&["prefill", "--ttl-ms", "30000"][..], &ucx].concat());
    prefill.wait_event("listening", Duration::from_secs(30), &mut Vec::new());
    let mut decode = decode_node(&ucx);
    let result = lease_sized(&mut prefill, "E", 2, 2);
    decode.send(json!({"cmd": "pull", "result": result}));
    let (children, _) = decode.wait_events("child", 2, Duration::from_secs(30));
    assert!(children.iter().all(|c| c["outcome"] == "done" && c["verified"] == true), "{children:?}");
    decode.wait_event("pull_done", Duration::from_secs(10), &mut Vec::new());
    decode.send(json!({"cmd": "stats"}));
    let s = decode.wait_event("stats", Duration::from_secs(10), &mut Vec::new());
    assert!(s["bytes_pulled_ucx"].as_u64().unwrap_or(0) > 0, "the pull went over UCX: {s}");

    decode.signal("TERM");
    let down = decode.wait_event("shutdown", Duration::from_secs(30), &mut Vec::new());
    assert_eq!((&down["signal"], &down["agent_dropped"]), (&json!("SIGTERM"), &json!(true)), "{down}");
    let status = decode.child.wait().expect("wait");
    assert!(status.success(), "the decode node exits with status 0 after SIGTERM: {status}");

    prefill.close_stdin();
    let down = prefill.wait_event("shutdown", Duration::from_secs(30), &mut Vec::new());
    assert_eq!((&down["signal"], &down["agent_dropped"]), (&Value::Null, &json!(true)), "{down}");
    let status = prefill.child.wait().expect("wait");
    assert!(status.success(), "the prefill node exits with status 0 when stdin closes: {status}");
}

#[cfg(feature = "ucx")]
#[test]
fn prefill_killed_mid_ucx_pull_fails_children_in_bounded_time() {
    let (mut prefill, decode) = ucx_pull_under_way(10_000);
    prefill.kill9();
    let killed = Instant::now();
    let (children, _) = decode.wait_events("child", N as usize, Duration::from_secs(60));
    let took = killed.elapsed();
    for c in &children {
        match c["outcome"].as_str() {
            Some("failed") => assert_eq!(c["invalid_local_blocks"].as_array().map(Vec::len), Some(64), "{c}"),
            Some("done") => assert_eq!(c["verified"], true, "{c}"),
            other => panic!("unexpected outcome {other:?}: {c}"),
        }
    }
    let failed = children.iter().filter(|c| c["outcome"] == "failed").count();
    eprintln!(
        "prefill killed mid-UCX-pull: {failed} of {N} children failed, {:.2} s after the kill",
        took.as_secs_f64()
    );
    assert!(failed > 0, "{children:?}");
}

/// The decode process dies during one-sided reads: its pins go with its connection, and
/// every lease ends once, by expiry.
#[cfg(feature = "ucx")]
#[test]
fn decode_killed_mid_ucx_pull_drops_its_pins_and_leases_expire() {
    let (mut prefill, mut decode) = ucx_pull_under_way(3000);
    decode.kill9();
    let killed = Instant::now();
    let (ends, _) = prefill.wait_events("lease_end", N as usize, Duration::from_secs(20));
    let took = killed.elapsed();
    eprintln!("decode killed mid-UCX-pull: {N} leases ended {:.2} s after the kill", took.as_secs_f64());
    // They were alive at the kill (heartbeated), so they end by expiry after it.
    assert!(took > Duration::from_millis(500), "ended before the kill: {took:?}");
    assert!(ends.iter().all(|e| e["kind"] == "Expired"), "{ends:?}");
    let s = stats(&mut prefill);
    assert_eq!((s["live"].as_u64(), s["pins_open"].as_u64()), (Some(0), Some(0)), "{s}");
}

/// A one-sided read the decode side cannot stop: UCX over tcp without peer-failure handling
/// (an endpoint abort cannot cancel its reads) from a prefill process that is frozen
/// (SIGSTOP) mid-read. The child fails as `failed_blocks_held` — its blocks must not be
/// reused, UCX may still write them — and once the process thaws and the read completes,
/// the decode agent hands them back (`reclaimed`).
#[cfg(feature = "ucx")]
#[test]
fn a_ucx_read_that_cannot_be_stopped_holds_its_blocks_until_it_completes() {
    let ucx = ["--transport", "ucx", "--ucx-tls", "tcp", "--io-timeout-ms", "1000"];
    let big = ["--blocks", "256", "--block-bytes", "1048576"];
    let mut prefill = Node::start(&[&["prefill", "--ttl-ms", "60000"][..], &ucx, &big].concat());
    prefill.wait_event("listening", Duration::from_secs(30), &mut Vec::new());
    let mut decode = decode_node(&[&ucx[..], &big].concat());
    let result = lease_sized(&mut prefill, "H", N, 64);
    decode.send(json!({"cmd": "pull", "result": result}));
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats(&mut prefill)["pins_open"].as_u64().unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "no read under way");
        std::thread::sleep(Duration::from_millis(1));
    }
    prefill.signal("STOP");
    let (children, _) = decode.wait_events("child", N as usize, Duration::from_secs(60));
    let held: Vec<u64> = children
        .iter()
        .filter(|c| c["outcome"] == "failed_blocks_held")
        .map(|c| c["child"].as_u64().expect("child"))
        .collect();
    for c in &children {
        match c["outcome"].as_str() {
            Some("failed_blocks_held") => {
                assert_eq!(c["held_local_blocks"].as_array().map(Vec::len), Some(64), "{c}");
                // Typed: the UCX read that did not stop, and a fresh hand-off is worth trying.
                assert_eq!(c["error_kind"], "UcxRead", "{c}");
                assert_eq!(c["advice"], "RetryFreshHandoff", "{c}");
            }
            Some("failed") => assert_eq!(c["invalid_local_blocks"].as_array().map(Vec::len), Some(64), "{c}"),
            Some("done") => assert_eq!(c["verified"], true, "{c}"),
            other => panic!("unexpected outcome {other:?}: {c}"),
        }
    }
    assert!(!held.is_empty(), "a read in flight at the freeze is held: {children:?}");
    prefill.signal("CONT");
    let reclaimed = decode.wait_event("reclaimed", Duration::from_secs(60), &mut Vec::new());
    let mut back: Vec<u64> =
        reclaimed["children"].as_array().expect("children").iter().filter_map(Value::as_u64).collect();
    back.sort_unstable();
    assert_eq!(back, held, "{reclaimed}");
    assert_eq!(reclaimed["local_blocks"].as_array().map(Vec::len), Some(64 * held.len()), "{reclaimed}");
    eprintln!("{} of {N} children held their blocks until UCX completed the read", held.len());
}

/// Review 10 finding 10: the UCX initiator refused every new endpoint to a peer while any
/// read to it was in flight, so one read that never completes disabled UCX to that address
/// for good (with `--transport ucx`, every later pull from it failed). Here the prefill
/// process is frozen mid-read (the read is held, as above) and then killed: the held read
/// never completes. A new prefill process on the same address must still be pulled from over
/// UCX.
#[cfg(feature = "ucx")]
#[test]
fn a_ucx_read_that_never_completes_does_not_block_a_new_endpoint_to_the_same_address() {
    let ucx = ["--transport", "ucx", "--ucx-tls", "tcp", "--io-timeout-ms", "1000"];
    // The decode side's local blocks are the remote ids: room for the new process's blocks
    // past the ones the held read keeps.
    let big = ["--blocks", "512", "--block-bytes", "1048576"];
    let mut prefill = Node::start(&[&["prefill", "--ttl-ms", "60000"][..], &ucx, &big].concat());
    let addr = prefill.wait_event("listening", Duration::from_secs(30), &mut Vec::new())["addr"]
        .as_str()
        .expect("addr")
        .to_owned();
    let mut decode = decode_node(&[&ucx[..], &big].concat());
    let result = lease_sized(&mut prefill, "H", N, 64);
    decode.send(json!({"cmd": "pull", "result": result}));
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats(&mut prefill)["pins_open"].as_u64().unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "no read under way");
        std::thread::sleep(Duration::from_millis(1));
    }
    prefill.signal("STOP");
    let (children, _) = decode.wait_events("child", N as usize, Duration::from_secs(60));
    let held = children.iter().filter(|c| c["outcome"] == "failed_blocks_held").count();
    assert!(held > 0, "a read in flight at the freeze is held: {children:?}");
    // The frozen process dies: its held read never completes.
    prefill.kill9();
    let mut fresh =
        Node::start(&[&["prefill", "--ttl-ms", "60000", "--listen", addr.as_str()][..], &ucx, &big].concat());
    fresh.wait_event("listening", Duration::from_secs(30), &mut Vec::new());
    // Blocks 0..256 may be held: a lease nobody pulls takes them, the next one 256..272.
    fresh.send(json!({"cmd": "lease", "parent": "skip", "n": 4, "blocks_per_child": 64}));
    fresh.wait_event("result", Duration::from_secs(10), &mut Vec::new());
    let result = lease_sized(&mut fresh, "B", 1, 16);
    decode.send(json!({"cmd": "pull", "result": result}));
    let child = decode.wait_event("child", Duration::from_secs(60), &mut Vec::new());
    assert_eq!((&child["outcome"], &child["verified"]), (&json!("done"), &json!(true)), "{child}");
    // (`--transport ucx`: no fallback to TCP; before, this failed as `TransportUnavailable`.)
    eprintln!("{held} held read(s) to the dead process; the new one at {addr} was pulled over UCX");
}
