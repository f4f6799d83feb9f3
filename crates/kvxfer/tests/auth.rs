//! The authenticated handshake end to end: a wrong key, no key on either side, replayed
//! handshakes (a recorded proof on a new connection, a recorded answer to a new client) and
//! a keyless relay that substitutes the prefill side's `HelloAck` are each refused with a
//! clear error and counted; nothing internal (layout, compatibility hash, engine id, UCX
//! worker address, rkeys) and nothing computed with the key reaches a peer without the key.

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer::{AgentConfig, BlockLayout, ChildOutcome, ClusterKey};
use kvxfer_proto::v1;
use kvxfer_proto::Message;
use support::*;

fn layout() -> BlockLayout {
    BlockLayout::single(16, BLOCK).expect("layout")
}

fn other_key() -> ClusterKey {
    ClusterKey::from_hex("00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff").expect("key")
}

/// Pulls one child from `prefill` with `decode` and returns the failure reason.
fn failed_pull(prefill: &kvxfer::blocking::PrefillAgent, decode: &kvxfer::blocking::DecodeAgent) -> String {
    let result = prefill.lease_parent("A", vec![vec![1, 2]], 1, None).expect("lease");
    let report = decode.submit(result, vec![vec![3, 4]]).expect("submit").wait();
    match &report.children[0].outcome {
        ChildOutcome::Failed { error: reason, invalid_local_blocks } => {
            assert_eq!(invalid_local_blocks, &vec![3, 4]);
            reason.to_string()
        }
        other => panic!("the pull must fail: {other:?}"),
    }
}

/// What a refused peer must never learn.
fn assert_nothing_internal(prefill: &kvxfer::blocking::PrefillAgent, message: &str) {
    let hash = format!("{:#018x}", prefill.memory().layout().compat_hash());
    assert!(!message.contains(&hash), "compatibility hash leaked: {message}");
    assert!(!message.contains("prefill"), "agent name or engine leaked: {message}");
}

#[test]
fn keyed_agents_authenticate_and_pull() {
    let prefill = prefill(16, Duration::from_secs(30));
    let decode = decode(16);
    let result = prefill.lease_parent("K", vec![vec![1, 2]], 1, None).expect("lease");
    assert!(decode.submit(result, vec![vec![3, 4]]).expect("submit").wait().all_done());
    assert!(verify(&decode, &[1, 2], &[3, 4]));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let addr = prefill.local_addr().to_string();
    let c = rt.block_on(raw_connect(&addr, &raw_hello(&layout(), "raw"))).expect("connect");
    assert!(c.peer_hello().authenticated);
    let s = prefill.stats().server;
    assert_eq!((s.handshakes_refused, s.auth_required, s.auth_failed), (0, 0, 0));
}

#[test]
fn a_wrong_key_is_refused_on_both_sides_and_counted() {
    let prefill = prefill(16, Duration::from_secs(30));
    let decode = decode_with(AgentConfig::new("decode").cluster_key(other_key()), layout());
    let reason = failed_pull(&prefill, &decode);
    assert!(reason.to_string().contains("proof did not verify"), "{reason}");
    // The prefill side refuses the decode side's proof (before saying anything computed
    // with its key) and counts it.
    eventually("the prefill side counts the refusal", || prefill.stats().server.auth_failed >= 1);
    let s = prefill.stats();
    assert_eq!((s.server.auth_required, s.server.reads_served, s.leases.live), (0, 0, 1));
    assert!(decode.stats().auth_failures >= 1);
}

#[test]
fn a_decode_agent_without_a_key_is_refused_with_auth_required() {
    let prefill = prefill(16, Duration::from_secs(30));
    let decode = decode_unkeyed(AgentConfig::new("decode"), layout());
    let reason = failed_pull(&prefill, &decode);
    assert!(reason.to_string().contains("requires a cluster key"), "{reason}");
    assert_nothing_internal(&prefill, &reason);
    let s = prefill.stats().server;
    assert!(s.auth_required >= 1 && s.auth_failed == 0, "{s:?}");
    assert!(decode.stats().auth_failures >= 1);
}

#[test]
fn a_prefill_agent_without_a_key_refuses_a_keyed_decode_agent() {
    let prefill = prefill_unkeyed(AgentConfig::new("prefill"), layout());
    let decode = decode(16);
    let reason = failed_pull(&prefill, &decode);
    assert!(reason.to_string().contains("no cluster key"), "{reason}");
    let s = prefill.stats().server;
    assert!(s.auth_failed >= 1, "{s:?}");
    assert!(decode.stats().auth_failures >= 1);
}

#[test]
fn unauthenticated_hellos_learn_nothing_internal() {
    let prefill = prefill(16, Duration::from_secs(30));
    // A plain hello, and one with a version and a layout this agent would refuse naming
    // both values: both get AUTH_REQUIRED and nothing else.
    let mut wrong = raw_hello(&BlockLayout::single(16, 2 * BLOCK).expect("layout"), "raw");
    wrong.protocol_version = 9;
    for hello in [raw_hello(&layout(), "raw"), wrong] {
        let mut s = TcpStream::connect(prefill.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(&frame_bytes(v1::FrameType::Hello, &hello)).expect("hello");
        let (ty, body) = read_raw_frame(&mut s).expect("an answer");
        assert_eq!(ty, v1::FrameType::Error as u8);
        let e = v1::Error::decode(&body[..]).expect("error");
        assert_eq!(e.code, v1::ErrorCode::AuthRequired as i32, "{}", e.message);
        assert_nothing_internal(&prefill, &e.message);
        let ours = format!("v{}", kvxfer_proto::PROTOCOL_VERSION);
        assert!(!e.message.contains(&ours) && !e.message.contains("v9"), "{}", e.message);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty(), "closed after the refusal");
    }
    let s = prefill.stats().server;
    assert_eq!((s.auth_required, s.handshakes_refused), (2, 2));
    // A key holder's handshake by hand succeeds.
    let mut s = TcpStream::connect(prefill.local_addr()).expect("connect");
    let (ty, _) = raw_handshake(&mut s, &layout(), &test_key()).expect("answer");
    assert_eq!(ty, v1::FrameType::HelloAck as u8);
}

/// A relay between one client and `upstream` that records both directions.
struct Recording {
    addr: std::net::SocketAddr,
    to_prefill: Arc<Mutex<Vec<u8>>>,
    to_decode: Arc<Mutex<Vec<u8>>>,
}

fn recording_relay(upstream: std::net::SocketAddr) -> Recording {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (to_prefill, to_decode) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let (tp, td) = (to_prefill.clone(), to_decode.clone());
    std::thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else { return };
        let Ok(server) = TcpStream::connect(upstream) else { return };
        let pump = |mut from: TcpStream, mut to: TcpStream, log: Arc<Mutex<Vec<u8>>>| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = from.read(&mut buf) {
                    // Logged before it is passed on: whoever has read it finds it in the log.
                    log.lock().expect("log").extend_from_slice(&buf[..n]);
                    if n == 0 || to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(std::net::Shutdown::Write);
            })
        };
        let a = pump(client.try_clone().expect("clone"), server.try_clone().expect("clone"), tp);
        let b = pump(server, client, td);
        let _ = (a.join(), b.join());
    });
    Recording { addr, to_prefill, to_decode }
}

#[test]
fn replayed_handshakes_are_refused_on_both_sides_and_counted() {
    let prefill = prefill(16, Duration::from_secs(30));
    let relay = recording_relay(prefill.local_addr());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    // One real, successful handshake through the relay, recorded.
    let c = rt.block_on(raw_connect(&relay.addr.to_string(), &raw_hello(&layout(), "raw"))).expect("connect");
    drop(c);
    let recorded_hello_and_proof = relay.to_prefill.lock().expect("log").clone();
    let recorded_challenge_and_ack = relay.to_decode.lock().expect("log").clone();
    assert!(!recorded_hello_and_proof.is_empty() && !recorded_challenge_and_ack.is_empty());

    // 1. The recorded hello and proof replayed on a new connection: the prefill side's
    // challenge has a new nonce, so the old proof fails.
    let mut s = TcpStream::connect(prefill.local_addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s.write_all(&recorded_hello_and_proof).expect("replay");
    let (ty, _) = read_raw_frame(&mut s).expect("a challenge");
    assert_eq!(ty, v1::FrameType::HelloChallenge as u8);
    let (ty, body) = read_raw_frame(&mut s).expect("a refusal");
    assert_eq!(ty, v1::FrameType::Error as u8);
    let e = v1::Error::decode(&body[..]).expect("error");
    assert_eq!(e.code, v1::ErrorCode::AuthFailed as i32, "{}", e.message);
    assert_nothing_internal(&prefill, &e.message);
    eventually("the replayed proof is counted", || prefill.stats().server.auth_failed == 1);

    // 2. The recorded challenge, HelloAck and MAC replayed to a new client by an impostor
    // without the key: the client's nonce is new, so the recorded MAC fails there.
    let impostor = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = impostor.local_addr().expect("addr").port();
    let seen = std::thread::spawn(move || {
        let (mut s, _) = impostor.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        read_raw_frame(&mut s).expect("a hello");
        s.write_all(&recorded_challenge_and_ack).expect("replay");
        // The client proves first (it risks nothing by it), then tells why it hangs up.
        let (ty, _) = read_raw_frame(&mut s).expect("the client's proof");
        assert_eq!(ty, v1::FrameType::HelloProof as u8);
        read_raw_frame(&mut s)
    });
    let decode = decode(16);
    let mut wire = prefill.lease_parent("R", vec![vec![1]], 1, None).expect("lease").to_wire();
    wire.children[0].remote_port = u32::from(port);
    let report = decode.submit_wire(wire, vec![vec![2]]).expect("submit").wait();
    let ChildOutcome::Failed { error: reason, .. } = &report.children[0].outcome else {
        panic!("{report:?}")
    };
    assert!(reason.to_string().contains("did not verify"), "{reason}");
    assert_eq!(decode.stats().auth_failures, 1);
    let (ty, body) = seen.join().expect("impostor").expect("the client's error frame");
    assert_eq!(ty, v1::FrameType::Error as u8);
    assert_eq!(v1::Error::decode(&body[..]).expect("error").code, v1::ErrorCode::AuthFailed as i32);
    // The real lease is untouched; nothing was read.
    assert_eq!(prefill.stats().server.reads_served, 0);
    assert_no_more_ends(&prefill, Duration::from_millis(50));
}

/// A relay without the key between decode agents and `upstream`: it forwards every byte
/// both ways, except that the first `HelloAck` going to the decode side (and only its body)
/// is replaced by `rewrite(body)`. Everything after that `HelloAck` is copied unchanged.
fn tampering_relay(
    upstream: std::net::SocketAddr,
    rewrite: impl Fn(Vec<u8>) -> Vec<u8> + Send + Sync + 'static,
) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let rewrite = Arc::new(rewrite);
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(upstream) else { return };
            let rewrite = rewrite.clone();
            let (mut c_read, mut s_write) =
                (client.try_clone().expect("clone"), server.try_clone().expect("clone"));
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_read, &mut s_write);
                let _ = s_write.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let (mut s_read, mut c_write) = (server, client);
                while let Some((ty, body)) = read_raw_frame(&mut s_read) {
                    let is_ack = ty == v1::FrameType::HelloAck as u8;
                    let body = if is_ack { rewrite(body) } else { body };
                    let mut out = ((body.len() + 1) as u32).to_be_bytes().to_vec();
                    out.push(ty);
                    out.extend_from_slice(&body);
                    if c_write.write_all(&out).is_err() {
                        return;
                    }
                    if is_ack {
                        break;
                    }
                }
                let _ = std::io::copy(&mut s_read, &mut c_write);
                let _ = c_write.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    addr
}

/// Review finding 1: a keyless party that a decode agent dials relays a real keyed prefill
/// agent's handshake and substitutes the `HelloAck` (here: another agent name, or the same
/// contents with an unknown field appended, which a re-encoding would drop). The decode agent
/// must refuse it: the accepting side's MAC covers the exact `HelloAck` bytes it sent.
#[test]
fn a_keyless_relay_cannot_get_a_forged_hello_ack_accepted() {
    let prefill = prefill(16, Duration::from_secs(30));
    type Rewrite = Box<dyn Fn(Vec<u8>) -> Vec<u8> + Send + Sync>;
    let rewrites: Vec<Rewrite> = vec![
        Box::new(|body: Vec<u8>| {
            let mut ack = v1::HelloAck::decode(&body[..]).expect("ack");
            ack.agent_name = "impostor".into();
            ack.encode_to_vec()
        }),
        Box::new(|mut body: Vec<u8>| {
            // Field 127, varint 1: unknown to prost, skipped when decoding.
            body.extend_from_slice(&[0xf8, 0x07, 0x01]);
            body
        }),
    ];
    for (i, rewrite) in rewrites.into_iter().enumerate() {
        let relay = tampering_relay(prefill.local_addr(), rewrite);
        let decode = decode(16);
        let mut wire =
            prefill.lease_parent(&format!("F{i}"), vec![vec![1]], 1, None).expect("lease").to_wire();
        wire.children[0].remote_port = u32::from(relay.port());
        let report = decode.submit_wire(wire, vec![vec![2]]).expect("submit").wait();
        let ChildOutcome::Failed { error: reason, .. } = &report.children[0].outcome else {
            panic!("a forged HelloAck was accepted: {report:?}")
        };
        assert!(reason.to_string().contains("did not verify"), "{reason}");
        assert!(decode.stats().auth_failures >= 1);
    }
    assert_eq!(prefill.stats().server.reads_served, 0);
}

/// Review finding 1: the accepting side answers a hello with a challenge that holds only its
/// nonce (nothing computed with the key), and a peer that never proves the key gets nothing
/// more: the bytes on the wire are exactly one `HelloChallenge{nonce}` frame.
#[test]
fn a_peer_that_never_proves_the_key_receives_nothing_key_derived() {
    let prefill = prefill(16, Duration::from_secs(30));
    let mut s = TcpStream::connect(prefill.local_addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut hello = raw_hello(&layout(), "raw");
    hello.authenticated = true;
    hello.nonce = vec![7; 32];
    s.write_all(&frame_bytes(v1::FrameType::Hello, &hello)).expect("hello");
    let (ty, body) = read_raw_frame(&mut s).expect("a challenge");
    assert_eq!(ty, v1::FrameType::HelloChallenge as u8);
    let challenge = v1::HelloChallenge::decode(&body[..]).expect("challenge");
    assert_eq!(challenge.nonce.len(), 32);
    assert!(challenge.mac.is_empty(), "the challenge carries a MAC");
    assert_eq!(body.len(), 2 + 32, "the challenge body is its nonce field and nothing else");
    // Hang up without a proof: the server says nothing more.
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "sent after the challenge: {rest:?}");
    eventually("the abandoned handshake is counted", || prefill.stats().server.handshakes_abandoned == 1);
    let s = prefill.stats().server;
    assert_eq!((s.auth_failed, s.auth_required, s.handshakes_refused), (0, 0, 0));
}

/// Review finding 7: before a peer authenticated, frames are capped at a small constant
/// (16 KiB), not at `max_frame_len` (1 MiB): an oversized hello is refused at its header,
/// before its body is read.
#[test]
fn an_oversized_frame_before_authentication_is_refused_at_its_header() {
    let prefill = prefill(16, Duration::from_secs(30));
    let mut s = TcpStream::connect(prefill.local_addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let len = (16u32 << 10) + 2;
    let mut header = len.to_be_bytes().to_vec();
    header.push(v1::FrameType::Hello as u8);
    s.write_all(&header).expect("header");
    let (ty, body) = read_raw_frame(&mut s).expect("a refusal at once, without the body");
    assert_eq!(ty, v1::FrameType::Error as u8);
    let e = v1::Error::decode(&body[..]).expect("error");
    assert_eq!(e.code, v1::ErrorCode::FrameTooLarge as i32, "{}", e.message);
}
