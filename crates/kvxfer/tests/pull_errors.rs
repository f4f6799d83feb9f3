//! Each `PullError` variant, produced for real (the rest are produced in `engine.rs`,
//! `embed.rs` and the fault-proxy tests of kvxfer-chaos): what a decode agent reports when
//! a peer is not there, refuses, restarted, lost its lease, or misbehaves — and the advice.

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use kvxfer::{Advice, AgentConfig, BlockLayout, ChildOutcome, PullError};
use kvxfer_proto::v1;
use support::*;

const TTL: Duration = Duration::from_secs(30);

fn layout() -> BlockLayout {
    BlockLayout::single(16, BLOCK).expect("layout")
}

/// The error of child `i` of a report that must have failed.
fn error_of(report: &kvxfer::PullReport, i: usize) -> PullError {
    match &report.children[i].outcome {
        ChildOutcome::Failed { error, .. } => error.clone(),
        other => panic!("child {i} should have failed: {other:?}"),
    }
}

#[test]
fn nothing_listening_is_a_connect_error() {
    let port = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let prefill = prefill(16, TTL);
    let decode = decode(16);
    let mut wire = prefill.lease_parent("C", vec![vec![1]], 1, None).expect("lease").to_wire();
    wire.children[0].remote_port = u32::from(port);
    let report = decode.submit_wire(wire, vec![vec![1]]).expect("submit").wait();
    let e = error_of(&report, 0);
    assert!(matches!(&e, PullError::Connect { peer, .. } if peer.ends_with(&port.to_string())), "{e:?}");
    assert_eq!(e.advice(), Advice::RetryFreshHandoff);
}

#[test]
fn a_peer_over_its_connection_limit_refuses_the_handshake() {
    let mut config = AgentConfig::new("prefill").lease_ttl(TTL);
    config.limits.max_connections_per_peer = 1;
    let prefill = prefill_unkeyed(config, layout());
    // The one connection 127.0.0.1 may have.
    let mut held = TcpStream::connect(prefill.local_addr()).expect("connect");
    held.write_all(&frame_bytes(v1::FrameType::Hello, &raw_hello(&layout(), "raw"))).expect("hello");
    assert_eq!(read_raw_frame(&mut held).expect("ack").0, v1::FrameType::HelloAck as u8);
    let decode = decode_unkeyed(AgentConfig::new("decode"), layout());
    let result = prefill.lease_parent("L", vec![vec![1]], 1, None).expect("lease");
    let report = decode.submit(result, vec![vec![1]]).expect("submit").wait();
    let e = error_of(&report, 0);
    assert!(matches!(e, PullError::HandshakeRefused { .. }), "{e:?}");
    assert!(e.to_string().contains("at most 1 connections"), "{e}");
    assert!(e.is_retryable());
}

#[test]
fn a_peer_without_our_key_fails_authentication() {
    let prefill = prefill_unkeyed(AgentConfig::new("prefill").lease_ttl(TTL), layout());
    let decode = decode(16);
    let result = prefill.lease_parent("K", vec![vec![1]], 1, None).expect("lease");
    let report = decode.submit(result, vec![vec![1]]).expect("submit").wait();
    let e = error_of(&report, 0);
    assert!(matches!(e, PullError::Authentication { .. }), "{e:?}");
    assert_eq!(e.advice(), Advice::Recompute);
}

#[test]
fn a_hand_off_of_a_restarted_prefill_is_stale() {
    let config = || AgentConfig::new("prefill").engine_id("stable-engine").lease_ttl(TTL);
    let first = prefill_with(config(), layout());
    let addr = first.local_addr();
    let result = first.lease_parent("R", vec![vec![1]], 1, None).expect("lease");
    let old_incarnation = first.incarnation();
    drop(first);
    let mem = kvxfer_mem::pattern::alloc_filled(layout()).expect("memory");
    let second =
        kvxfer::blocking::PrefillAgent::start(keyed(config()), &addr.to_string(), mem).expect("restart");
    let decode = decode(16);
    let report = decode.submit(result, vec![vec![1]]).expect("submit").wait();
    let e = error_of(&report, 0);
    let PullError::PeerRestarted { expected_incarnation, found_incarnation, found_engine, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!((*expected_incarnation, *found_incarnation), (old_incarnation, second.incarnation()));
    assert_eq!(found_engine, "stable-engine");
    assert!(e.to_string().contains("restarted"), "{e}");
    assert!(e.is_retryable());
}

#[test]
fn a_lease_that_expired_before_its_read_has_ended() {
    let prefill = prefill(16, Duration::from_millis(50));
    let decode = decode(16);
    let result = prefill.lease_parent("E", vec![vec![1, 2]], 1, None).expect("lease");
    wait_ends(&prefill, 1, Duration::from_secs(5));
    let report = decode.submit(result, vec![vec![3, 4]]).expect("submit").wait();
    let e = error_of(&report, 0);
    let PullError::LeaseEnded { remote_request_id, .. } = &e else { panic!("{e:?}") };
    assert_eq!(remote_request_id, "E", "a single child keeps the parent's id");
    assert!(e.to_string().contains("has ended"), "{e}");
    assert!(e.is_retryable());
}

#[test]
fn a_siblings_failed_read_fails_the_children_sharing_its_blocks() {
    let prefill = prefill(16, TTL);
    let decode = decode(16);
    // Child 0 reads the shared prompt block 1; its lease is gone before the pull.
    let result = prefill.lease_parent("S", vec![vec![1, 2], vec![1, 3]], 1, None).expect("lease");
    assert_eq!(prefill.cancel(&result.children()[0]), kvxfer_core::CancelOutcome::Released);
    let report = decode.submit(result, vec![vec![5, 6], vec![7, 8]]).expect("submit").wait();
    let e = error_of(&report, 1);
    let PullError::SiblingFailed { sibling: 0, cause } = &e else { panic!("{e:?}") };
    assert!(matches!(**cause, PullError::LeaseEnded { .. }), "{cause:?}");
    assert!(e.to_string().contains("shared blocks were read for sibling 0, which failed"), "{e}");
    assert!(matches!(e.root_cause(), PullError::LeaseEnded { .. }));
}

#[test]
fn a_read_of_blocks_outside_the_lease_is_refused() {
    let prefill = prefill(16, TTL);
    let decode = decode(16);
    let mut wire = prefill.lease_parent("N", vec![vec![1, 2]], 1, None).expect("lease").to_wire();
    wire.children[0].remote_block_ids = vec![1, 9];
    let report = decode.submit_wire(wire, vec![vec![5, 6]]).expect("submit").wait();
    let e = error_of(&report, 0);
    assert!(matches!(e, PullError::Refused { .. }), "{e:?}");
    assert!(e.to_string().contains("BlockOutOfRange"), "{e}");
}

/// A notify sent with its read (`notify_with_read`) whose read is refused is not counted:
/// nothing was sent, so the lease is released by the decode side's cancel, not ended
/// pulled.
#[test]
fn a_notify_behind_a_refused_read_is_not_counted() {
    let prefill = prefill(16, TTL);
    let config = AgentConfig::new("decode").transport(kvxfer::TransportChoice::Tcp).notify_with_read(true);
    let decode = decode_with(config, layout());
    let mut wire = prefill.lease_parent("W", vec![vec![1, 2]], 1, None).expect("lease").to_wire();
    wire.children[0].remote_block_ids = vec![1, 9];
    let report = decode.submit_wire(wire, vec![vec![5, 6]]).expect("submit").wait();
    let e = error_of(&report, 0);
    assert!(matches!(e, PullError::Refused { .. }), "{e:?}");
    let ends = wait_ends(&prefill, 1, Duration::from_secs(10));
    assert_eq!(ends[0].kind, kvxfer::EndKind::Released, "{ends:?}");
    assert_eq!(prefill.stats().leases.pulled, 0);
}

#[test]
fn a_peer_answering_out_of_protocol_is_a_protocol_error() {
    // A fake prefill (no key): a good handshake, then a notify ack where a read answer belongs.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let t = std::thread::spawn(move || {
        for _ in 0..2 {
            let Ok((mut s, _)) = listener.accept() else { return };
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
                let _hello = read_raw_frame(&mut s);
                let ack = v1::HelloAck {
                    protocol_version: kvxfer_proto::PROTOCOL_VERSION,
                    engine_id: "odd".into(),
                    agent_name: "odd".into(),
                    compat_hash: layout().compat_hash(),
                    layout: Some(layout().to_wire()),
                    ..Default::default()
                };
                let _ = s.write_all(&frame_bytes(v1::FrameType::HelloAck, &ack));
                while let Some((ty, _)) = read_raw_frame(&mut s) {
                    let reply = v1::NotifyAck { outcome: v1::LeaseOutcome::Pulled as i32, remaining: 0 };
                    if ty == v1::FrameType::ReadRequest as u8 {
                        let _ = s.write_all(&frame_bytes(v1::FrameType::NotifyAck, &reply));
                    } else if ty == v1::FrameType::Cancel as u8 {
                        let c = v1::CancelAck { outcome: v1::LeaseOutcome::Released as i32 };
                        let _ = s.write_all(&frame_bytes(v1::FrameType::CancelAck, &c));
                    }
                }
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
            });
        }
    });
    let decode = decode_unkeyed(AgentConfig::new("decode").io_timeout(Duration::from_secs(5)), layout());
    let wire = v1::PrefillResult {
        parent_request_id: "P".into(),
        n: 1,
        children: vec![v1::ChildHandoff {
            parent_request_id: "P".into(),
            child_index: 0,
            n: 1,
            remote_request_id: "0_P".into(),
            lease_token: vec![7; 16],
            remote_block_ids: vec![1],
            remote_engine_id: "odd".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: u32::from(port),
            expected_consumers: 1,
            lease_ttl_ms: 30_000,
            tp_size: 1,
            incarnation: 0,
            other_group_block_ids: vec![],
        }],
    };
    let report = decode.submit_wire(wire, vec![vec![1]]).expect("submit").wait();
    let e = error_of(&report, 0);
    assert!(matches!(e, PullError::Protocol { .. }), "{e:?}");
    assert!(e.to_string().contains("unexpected"), "{e}");
    assert_eq!(e.advice(), Advice::Recompute);
    drop(decode);
    let _ = t.join();
}

/// UCX required by the decode side, not offered by the prefill side.
#[cfg(feature = "ucx")]
#[test]
fn ucx_required_but_not_offered_is_a_transport_error() {
    let prefill = prefill_with(AgentConfig::new("prefill").transport(kvxfer::TransportChoice::Tcp), layout());
    let decode = decode_with(Transport::UcxShm.config(AgentConfig::new("decode")), layout());
    let result = prefill.lease_parent("U", vec![vec![1]], 1, None).expect("lease");
    let report = decode.submit(result, vec![vec![1]]).expect("submit").wait();
    let e = error_of(&report, 0);
    assert!(matches!(e, PullError::TransportUnavailable { .. }), "{e:?}");
    assert_eq!(e.advice(), Advice::Recompute);
    // The prefill side answered as the right engine: the lease is released at once, not
    // left to expire.
    let ends = wait_ends(&prefill, 1, Duration::from_secs(10));
    assert_eq!(ends[0].kind, kvxfer::EndKind::Released, "{ends:?}");
}
