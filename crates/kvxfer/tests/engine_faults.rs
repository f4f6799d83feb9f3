//! Failures over TCP on 127.0.0.1: silent or dying peers, agents dropped mid-pull,
//! malformed frames. Every child ends in a bounded time with a clear outcome; every lease
//! ends exactly once; the agents keep serving.

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvxfer::{AgentConfig, BlockId, BlockLayout, ChildOutcome, EndKind, Error, PrefillResult, SubmitError};
use kvxfer_proto::v1;
use kvxfer_proto::Message;
use support::*;

/// A hand-off naming a peer at `port` (for scripted fake prefill peers).
fn fake_result(port: u16, engine: &str, children: &[Vec<BlockId>]) -> PrefillResult {
    let n = children.len() as u32;
    let wire = v1::PrefillResult {
        parent_request_id: "F".into(),
        n,
        children: (0..n)
            .map(|i| v1::ChildHandoff {
                parent_request_id: "F".into(),
                child_index: i,
                n,
                remote_request_id: format!("{i}_F"),
                lease_token: vec![7; 16],
                remote_block_ids: children[i as usize].clone(),
                remote_engine_id: engine.into(),
                remote_host: "127.0.0.1".into(),
                remote_port: u32::from(port),
                expected_consumers: 1,
                lease_ttl_ms: 30_000,
                tp_size: 1,
                incarnation: 0,
            })
            .collect(),
    };
    PrefillResult::from_wire(wire).expect("valid result")
}

fn read_frame(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h).ok()?;
    let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let mut body = vec![0u8; len - 1];
    s.read_exact(&mut body).ok()?;
    Some((h[4], body))
}

fn write_frame(s: &mut TcpStream, ty: v1::FrameType, body: &impl Message) {
    let _ = s.write_all(&frame_bytes(ty, body));
}

/// A scripted prefill peer: answers hellos as `engine` with `layout`, then on each read
/// request sends the header and `fraction` of the payload and closes the connection.
fn dying_prefill(
    layout: BlockLayout,
    engine: &'static str,
    fraction: f64,
) -> (u16, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let t = std::thread::spawn(move || {
        listener.set_nonblocking(false).expect("blocking");
        let deadline = Instant::now() + Duration::from_secs(10);
        for stream in listener.incoming() {
            if Instant::now() > deadline {
                return;
            }
            let Ok(mut s) = stream else { return };
            let layout = layout.clone();
            std::thread::spawn(move || {
                let Some((_, _hello)) = read_frame(&mut s) else { return };
                let ack = v1::HelloAck {
                    protocol_version: 1,
                    engine_id: engine.into(),
                    agent_name: "dying".into(),
                    compat_hash: layout.compat_hash(),
                    layout: Some(layout.to_wire()),
                    transports: vec![],
                    ..Default::default()
                };
                write_frame(&mut s, v1::FrameType::HelloAck, &ack);
                while let Some((ty, body)) = read_frame(&mut s) {
                    if ty == v1::FrameType::ReadRequest as u8 {
                        let req = v1::ReadRequest::decode(&body[..]).expect("read request");
                        let blocks: u64 = req.ranges.iter().map(|r| u64::from(r.count)).sum();
                        let payload = blocks * layout.block_bytes();
                        write_frame(
                            &mut s,
                            v1::FrameType::ReadResponse,
                            &v1::ReadResponse { seq: req.seq, payload_len: payload },
                        );
                        let _ = s.write_all(&vec![0xab; (payload as f64 * fraction) as usize]);
                        return; // dies mid-payload
                    }
                    // Heartbeats, notifies and cancels go unanswered: the peer is dying.
                }
            });
        }
    });
    (port, t)
}

#[test]
fn prefill_dying_mid_payload_fails_children_with_their_invalid_blocks() {
    let layout = BlockLayout::single(64, BLOCK).expect("layout");
    let (port, _t) = dying_prefill(layout.clone(), "dying-engine", 0.5);
    let decode = decode_with(AgentConfig::new("decode").io_timeout(Duration::from_secs(2)), layout);
    let result = fake_result(port, "dying-engine", &[vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
    let started = Instant::now();
    let report =
        decode.submit(result, vec![vec![10, 11, 12, 13], vec![20, 21, 22, 23]]).expect("submit").wait();
    assert!(started.elapsed() < Duration::from_secs(8), "bounded: {:?}", started.elapsed());
    for (c, local) in report.children.iter().zip([vec![10, 11, 12, 13], vec![20, 21, 22, 23]]) {
        match &c.outcome {
            ChildOutcome::Failed { reason, invalid_local_blocks } => {
                assert_eq!(invalid_local_blocks, &local);
                assert!(!reason.is_empty());
            }
            other => panic!("child {} should have failed: {other:?}", c.child_index),
        }
    }
    assert_eq!(decode.stats().children_failed, 2);
}

#[test]
fn silent_prefill_is_detected_by_timeout_and_its_blocks_are_free_again() {
    // Accepts connections and never answers (a half-open or hung peer).
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let layout = BlockLayout::single(64, BLOCK).expect("layout");
    let decode = decode_with(AgentConfig::new("decode").io_timeout(Duration::from_millis(500)), layout);
    let result = fake_result(port, "silent", &[vec![1, 2]]);
    let started = Instant::now();
    let handle = decode.submit(result.clone(), vec![vec![5, 6]]).expect("submit");
    // While that pull may still write 5 and 6, no other pull may target them.
    match decode.submit(result.clone(), vec![vec![6, 7]]) {
        Err(Error::Submit(SubmitError::LocalBlocksBusy { blocks, .. })) => assert_eq!(blocks, vec![6]),
        other => panic!("expected busy blocks, got {other:?}"),
    }
    let report = handle.wait();
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    let ChildOutcome::Failed { reason, .. } = &report.children[0].outcome else { panic!("{report:?}") };
    assert!(reason.contains("timed out"), "{reason}");
    // Its destination blocks are free for the next pull once it reported.
    let again = decode.submit(result, vec![vec![5, 6]]).expect("blocks released after the report");
    drop(listener);
    let _ = again.wait();
}

fn prefill_agent_dropped_mid_pull_ends_every_child_in_bounded_time_and_a_new_prefill_works(t: Transport) {
    let blocks = 4096u32; // 16 MiB per child at 4 KiB blocks
    let prefill = t.prefill(2 * blocks, Duration::from_secs(30));
    // Room past the pulled blocks: a one-sided read that cannot be stopped keeps its
    // destination blocks reserved, so the second pull goes elsewhere.
    let decode = decode_with(
        t.config(AgentConfig::new("decode").io_timeout(Duration::from_secs(2)).connections_per_peer(1)),
        BlockLayout::single(2 * blocks + 16, BLOCK).expect("layout"),
    );
    let remote: Vec<Vec<BlockId>> = vec![(0..blocks).collect(), (blocks..2 * blocks).collect()];
    let result = prefill.lease_parent("D", remote.clone(), 1, None).expect("lease");
    let started = Instant::now();
    let handle = decode.submit(result, remote.clone()).expect("submit");
    std::thread::sleep(Duration::from_millis(5));
    drop(prefill);
    let report = handle.wait();
    assert!(started.elapsed() < Duration::from_secs(10), "no hang: {:?}", started.elapsed());
    for (c, local) in report.children.iter().zip(&remote) {
        match &c.outcome {
            ChildOutcome::Done { .. } => {
                assert!(verify(&decode, local, local), "a child reported done must verify")
            }
            ChildOutcome::Failed { invalid_local_blocks, .. } => assert_eq!(invalid_local_blocks, local),
            other => panic!("unexpected {other:?}"),
        }
    }
    // A new prefill process (agent) at a new address: the same decode agent pulls from it.
    let fresh = t.prefill(64, Duration::from_secs(30));
    let r = fresh.lease_parent("D2", vec![vec![1, 2, 3]], 1, None).expect("lease");
    let fresh_local: Vec<BlockId> = (2 * blocks..2 * blocks + 3).collect();
    let report = decode.submit(r, vec![fresh_local.clone()]).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    assert!(verify(&decode, &[1, 2, 3], &fresh_local));
}

fn decode_agent_dropped_mid_pull_leases_end_by_expiry_never_leak(t: Transport) {
    let ttl = Duration::from_millis(700);
    let blocks = 4096u32;
    let prefill = t.prefill(4 * blocks, ttl);
    let remote: Vec<Vec<BlockId>> = (0..4).map(|i| (i * blocks..(i + 1) * blocks).collect()).collect();
    let result = prefill.lease_parent("X", remote.clone(), 1, None).expect("lease");
    {
        let decode = decode_with(
            t.config(AgentConfig::new("decode").connections_per_peer(1)),
            BlockLayout::single(4 * blocks, BLOCK).expect("layout"),
        );
        let _handle = decode.submit(result, remote).expect("submit");
        std::thread::sleep(Duration::from_millis(5));
    } // decode agent dropped: its runtime and connections go away mid-pull
    let ends = wait_ends(&prefill, 4, ttl + Duration::from_secs(5));
    for e in &ends {
        assert!(matches!(e.kind, EndKind::Pulled | EndKind::Expired | EndKind::Released), "{e:?}");
    }
    assert_no_more_ends(&prefill, Duration::from_millis(200));
    let s = prefill.stats().leases;
    assert_eq!((s.live, s.draining), (0, 0));
    assert_eq!(s.leased, s.pulled + s.released + s.expired);
    // A child whose pull was cut expires; with UCX the in-flight reads may all land before
    // the agent is gone (a UCX get is not cut short), and then every lease is pulled.
    assert_eq!(s.pulled + s.expired + s.released, 4, "{s:?}");
}

fn expect_error_frame(s: &mut TcpStream, code: v1::ErrorCode) {
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let (ty, body) = read_frame(s).expect("an error frame before the close");
    assert_eq!(ty, v1::FrameType::Error as u8);
    let e = v1::Error::decode(&body[..]).expect("error body");
    assert_eq!(e.code, code as i32, "{}", e.message);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "connection closed after the error frame");
}

fn hello(layout: &BlockLayout) -> v1::Hello {
    raw_hello(layout, "raw")
}

#[test]
fn malformed_frames_close_only_their_connection() {
    let prefill = prefill(64, Duration::from_secs(30));
    let addr = prefill.local_addr();
    let layout = prefill.memory().layout().clone();
    // Holds a connection open throughout: the agent must keep serving others meanwhile.
    let mut idle = TcpStream::connect(addr).expect("connect");
    write_frame(&mut idle, v1::FrameType::Hello, &hello(&layout));
    assert_eq!(read_frame(&mut idle).expect("ack").0, v1::FrameType::HelloAck as u8);

    // Oversized length prefix: refused before allocating 4 GiB.
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(&[0xff, 0xff, 0xff, 0xff, 1]).expect("write");
    expect_error_frame(&mut s, v1::ErrorCode::FrameTooLarge);

    // Garbage after a good handshake: unknown frame type.
    let mut s = TcpStream::connect(addr).expect("connect");
    write_frame(&mut s, v1::FrameType::Hello, &hello(&layout));
    read_frame(&mut s).expect("ack");
    s.write_all(&[0, 0, 0, 3, 200, 1, 2]).expect("write");
    expect_error_frame(&mut s, v1::ErrorCode::UnknownFrameType);

    // A body that is not the message its type says.
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(&[0, 0, 0, 4, v1::FrameType::Hello as u8, 0xff, 0xff, 0xff]).expect("write");
    expect_error_frame(&mut s, v1::ErrorCode::Malformed);

    // Something other than a hello first.
    let mut s = TcpStream::connect(addr).expect("connect");
    write_frame(&mut s, v1::FrameType::Notify, &v1::Notify::default());
    expect_error_frame(&mut s, v1::ErrorCode::HandshakeRequired);

    // A truncated frame and a close: nothing to answer, nothing breaks.
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(&[0, 0, 0, 100, 1, 2, 3]).expect("write");
    drop(s);

    // Random garbage of every length.
    for len in [1usize, 4, 5, 17, 300] {
        let mut s = TcpStream::connect(addr).expect("connect");
        let junk: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
        let _ = s.write_all(&junk);
    }

    // The agent still serves a real pull, and the idle connection still works.
    let decode = decode(64);
    let r = prefill.lease_parent("OK", vec![vec![1, 2, 3]], 1, None).expect("lease");
    assert!(decode.submit(r, vec![vec![4, 5, 6]]).expect("submit").wait().all_done());
    assert!(verify(&decode, &[1, 2, 3], &[4, 5, 6]));
    write_frame(&mut idle, v1::FrameType::Heartbeat, &v1::Heartbeat::default());
    assert_eq!(read_frame(&mut idle).expect("ack").0, v1::FrameType::HeartbeatAck as u8);
    let s = prefill.stats().server;
    assert!(s.protocol_errors >= 3, "{s:?}");
    assert_eq!(s.handshakes_refused, 1);
}

per_transport!(
    prefill_agent_dropped_mid_pull_ends_every_child_in_bounded_time_and_a_new_prefill_works,
    decode_agent_dropped_mid_pull_leases_end_by_expiry_never_leak,
);

/// A prefill worker restarts on the same address (new engine id, same port). The decode
/// agent's pooled connections to the old one are dead; the next pull must not use them
/// (nor the old one's handshake) and must succeed against the new one.
#[test]
fn prefill_restarted_on_the_same_address_is_pulled_from_again() {
    let layout = BlockLayout::single(64, BLOCK).expect("layout");
    let config =
        || AgentConfig::new("prefill").lease_ttl(Duration::from_secs(30)).io_timeout(Duration::from_secs(2));
    let first = prefill_with(config(), layout.clone());
    let addr = first.local_addr();
    let decode = decode_with(AgentConfig::new("decode").io_timeout(Duration::from_secs(2)), layout.clone());
    let remote = vec![vec![1, 2], vec![3, 4]];
    let result = first.lease_parent("A", remote.clone(), 1, None).expect("lease");
    assert!(decode.submit(result, remote.clone()).expect("submit").wait().all_done());
    drop(first);

    let mem = kvxfer_mem::pattern::alloc_filled(layout).expect("patterned memory");
    let second =
        kvxfer::PrefillAgent::start(config(), &addr.to_string(), mem).expect("restart on the same port");
    for round in 0..2 {
        let local = vec![vec![10, 11], vec![12, 13]];
        let result = second.lease_parent(&format!("B{round}"), remote.clone(), 1, None).expect("lease");
        let report = decode.submit(result, local.clone()).expect("submit").wait();
        assert!(report.all_done(), "round {round}: {report:?}");
        for (r, l) in remote.iter().zip(&local) {
            assert!(verify(&decode, r, l));
        }
    }
}

/// Prefill workers that restart on new ports, again and again: the decode agent forgets the
/// gone ones (entries and sockets) instead of keeping every peer it ever pulled from.
#[test]
fn peers_that_went_away_are_forgotten() {
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let decode = decode_with(AgentConfig::new("decode").io_timeout(Duration::from_secs(2)), layout.clone());
    for round in 0..6 {
        let prefill = prefill_with(AgentConfig::new("prefill"), layout.clone());
        let result =
            prefill.lease_parent(&format!("R{round}"), vec![vec![1], vec![2]], 1, None).expect("lease");
        assert!(decode.submit(result, vec![vec![3], vec![4]]).expect("submit").wait().all_done());
        drop(prefill);
        // The one just used, plus at most the previous one (its sockets may still be closing).
        assert!(decode.stats().peers <= 2, "round {round}: {:?}", decode.stats());
    }
}
