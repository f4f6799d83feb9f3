//! The engine end to end on 127.0.0.1, once per data path (TCP; with the `ucx` feature
//! also UCX over tcp and over shared memory): every child pulled, released or expired
//! exactly once, every byte verified, bad input refused.

mod support;

use std::time::{Duration, Instant};

use kvxfer::{
    AgentConfig, BlockId, BlockLayout, ChildOutcome, EndKind, Error, LeaseRequest, PrefillResult, Segment,
    SubmitError,
};
use kvxfer_core::HandoffError;
use support::*;

const TTL: Duration = Duration::from_secs(30);

/// n children with distinct, shuffled, non-contiguous blocks, leased in random order.
fn pull_n(t: Transport, n: u32, seed: u64) {
    let bpc = 6u32;
    let prefill = t.prefill(n * bpc * 2, TTL);
    let decode = t.decode(n * bpc * 2);
    let mut remote_pool: Vec<BlockId> = (0..n * bpc * 2).collect();
    let mut local_pool: Vec<BlockId> = (0..n * bpc * 2).collect();
    shuffle(&mut remote_pool, seed);
    shuffle(&mut local_pool, seed.wrapping_mul(31));
    let remote: Vec<Vec<BlockId>> =
        (0..n as usize).map(|i| remote_pool[i * bpc as usize..][..bpc as usize].to_vec()).collect();
    let local: Vec<Vec<BlockId>> =
        (0..n as usize).map(|i| local_pool[i * bpc as usize..][..bpc as usize].to_vec()).collect();

    let mut order: Vec<u32> = (0..n).collect();
    shuffle(&mut order, seed ^ 0x55);
    let mut handoffs: Vec<_> = order
        .iter()
        .map(|&i| prefill.lease(LeaseRequest::new("R", i, n, remote[i as usize].clone())).expect("lease"))
        .collect();
    shuffle(&mut handoffs, seed ^ 0xaa);
    let result = PrefillResult::new("R", n, handoffs).expect("complete result");

    let submitted = Instant::now();
    let (report, arrived) = decode.submit(result, local.clone()).expect("submit").wait_timed();
    assert!(report.all_done(), "{report:?}");
    // Each child's completion is stamped by the pull, after the submit and before its
    // report reached this thread.
    for (c, at) in report.children.iter().zip(&arrived) {
        assert!(
            submitted <= c.completed_at && c.completed_at <= *at,
            "child {} stamped out of order",
            c.child_index
        );
    }
    for i in 0..n as usize {
        assert!(verify(&decode, &remote[i], &local[i]), "child {i} bytes");
    }
    let ends = wait_ends(&prefill, n as usize, Duration::from_secs(10));
    assert!(ends.iter().all(|e| e.kind == EndKind::Pulled && e.consumers_seen == 1), "{ends:?}");
    for e in &ends {
        assert_eq!(&*e.blocks, &remote[e.child_index as usize][..]);
    }
    let bytes = u64::from(n * bpc) * BLOCK;
    eventually("served bytes counted", || prefill.stats().server.bytes_served == bytes);
    let p = prefill.stats();
    let d = decode.stats();
    assert_eq!((p.leases.leased, p.leases.pulled, p.leases.live), (u64::from(n), u64::from(n), 0));
    assert_eq!(p.leases.leased, p.leases.pulled + p.leases.released + p.leases.expired + p.leases.live);
    assert_eq!((p.leases.unrecognized, p.leases.bad_token), (0, 0));
    assert_eq!((p.server.bytes_served, d.bytes_pulled, d.bytes_delivered), (bytes, bytes, bytes));
    assert_eq!((d.children_done, d.children_failed), (u64::from(n), 0));
    // Per data path: every byte over UCX or none.
    let one_sided = if t == Transport::Tcp { 0 } else { bytes };
    assert_eq!((d.bytes_pulled_ucx, p.server.bytes_served_one_sided), (one_sided, one_sided));
    assert_eq!(d.integrity_failures, 0);
    assert_no_more_ends(&prefill, Duration::from_millis(50));
}

fn n1_pulled_and_verified(t: Transport) {
    pull_n(t, 1, 1);
}
fn n2_pulled_and_verified(t: Transport) {
    pull_n(t, 2, 2);
}
fn n3_pulled_and_verified(t: Transport) {
    pull_n(t, 3, 3);
}
fn n8_pulled_and_verified(t: Transport) {
    pull_n(t, 8, 8);
}

fn siblings_sharing_prompt_blocks_cross_the_wire_once(t: Transport) {
    let prefill = t.prefill(16, TTL);
    let decode = t.decode(64);
    let prompt: Vec<BlockId> = vec![3, 4, 5, 9, 10];
    let result = prefill.lease_parent("S", vec![prompt.clone(); 4], 1, None).expect("lease");
    let local: Vec<Vec<BlockId>> = (0..4).map(|i| (i * 8..i * 8 + 5).collect()).collect();
    let report = decode.submit(result, local.clone()).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    let one_child = prompt.len() as u64 * BLOCK;
    assert_eq!(report.wire_bytes, one_child);
    assert_eq!(report.delivered_bytes, 4 * one_child);
    for l in &local {
        assert!(verify(&decode, &prompt, l));
    }
    let ends = wait_ends(&prefill, 4, Duration::from_secs(10));
    assert!(ends.iter().all(|e| e.kind == EndKind::Pulled));
    eventually("served bytes counted", || prefill.stats().server.bytes_served == one_child);
    assert_eq!(decode.stats().bytes_pulled, one_child);
}

fn siblings_sharing_local_blocks_too(t: Transport) {
    // Prefix caching on both sides: the same local prompt blocks for every child.
    let prefill = t.prefill(16, TTL);
    let decode = t.decode(16);
    let result = prefill
        .lease_parent("S", vec![vec![0, 1, 2, 7], vec![0, 1, 2, 8], vec![0, 1, 2, 9]], 1, None)
        .expect("lease");
    let local = vec![vec![4, 5, 6, 0], vec![4, 5, 6, 1], vec![4, 5, 6, 2]];
    let report = decode.submit(result, local.clone()).expect("submit").wait();
    assert!(report.all_done());
    assert_eq!(report.wire_bytes, 6 * BLOCK);
    assert!(verify(&decode, &[0, 1, 2, 7, 8, 9], &[4, 5, 6, 0, 1, 2]));
    assert_eq!(
        wait_ends(&prefill, 3, Duration::from_secs(10)).iter().filter(|e| e.kind == EndKind::Pulled).count(),
        3
    );
}

fn dropped_child_is_released_at_once_and_skipped_child_expires(t: Transport) {
    let ttl = Duration::from_millis(600);
    let prefill = t.prefill(64, ttl);
    let decode = t.decode(64);
    let remote: Vec<Vec<BlockId>> = (0..4).map(|i| (i * 8..i * 8 + 8).collect()).collect();
    let started = Instant::now();
    let result = prefill.lease_parent("C", remote.clone(), 1, None).expect("lease");
    // Child 2 is this worker's but is dropped before its pull (its request was aborted): it
    // is released, not pulled. (A `cancel_child` right after `submit` races a fast pull and
    // now and then lost to it here — 3 of 20 runs over shared memory — the child then done;
    // mid-pull cancels are tested against scripted peers in engine_faults.rs.) Child 3 is
    // assigned to a worker that never pulls.
    assert!(decode.release(&result.children()[2]));
    let selection = (0..2).map(|i| (i, remote[i as usize].clone())).collect();
    let report = decode.submit_subset(&result, selection).expect("submit").wait();
    assert_eq!(report.children.len(), 2, "{report:?}");
    for (child, blocks) in report.children.iter().zip(&remote) {
        assert!(matches!(child.outcome, ChildOutcome::Done { acknowledged: true, .. }));
        assert!(verify(&decode, blocks, blocks));
    }
    // Pulled and released arrive before the lease could have run out.
    let first = wait_ends(&prefill, 3, Duration::from_secs(5));
    assert!(started.elapsed() < ttl, "released at once, not at expiry");
    assert_eq!(
        first.iter().map(|e| e.kind).collect::<Vec<_>>(),
        vec![EndKind::Pulled, EndKind::Pulled, EndKind::Released]
    );
    let status = prefill.parent_status("C").expect("child 3 still pending");
    assert_eq!(status.pending(), vec![3]);
    // The never-pulled child expires, loudly, with 0 consumers; nothing else changes.
    let last = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!((last[0].child_index, last[0].kind, last[0].consumers_seen), (3, EndKind::Expired, 0));
    assert!(started.elapsed() >= ttl);
    assert!(prefill.parent_status("C").is_none(), "parent complete");
    let s = prefill.stats().leases;
    assert_eq!((s.pulled, s.released, s.expired, s.live), (2, 1, 1, 0));
}

#[test]
fn stray_and_wrong_token_notifications_change_nothing() {
    let prefill = prefill(16, TTL);
    let h = prefill.lease(LeaseRequest::new("R", 0, 2, vec![1, 2])).expect("lease");
    let addr = prefill.local_addr().to_string();
    let layout = prefill.memory().layout().clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let mut c = raw_connection(&addr, &layout, kvxfer_proto::PROTOCOL_VERSION).await.expect("connect");
        let ack = c.notify("7_R", h.token().as_bytes(), "d").await.expect("ack");
        assert_eq!(ack.outcome, kvxfer_proto::v1::LeaseOutcome::Unrecognized as i32);
        // On the wire a wrong token is told what an unknown id is told; the prefill side's
        // counters still tell them apart.
        let ack = c.notify("0_R", &[0u8; 16], "d").await.expect("ack");
        assert_eq!(ack.outcome, kvxfer_proto::v1::LeaseOutcome::Unrecognized as i32);
        let out = c.cancel("0_R", &[1u8; 16]).await.expect("cancel ack");
        assert_eq!(out, kvxfer_proto::v1::LeaseOutcome::Unrecognized);
    });
    assert_no_more_ends(&prefill, Duration::from_millis(100));
    let s = prefill.stats().leases;
    assert_eq!((s.unrecognized, s.bad_token, s.live, s.pulled), (1, 2, 1, 0));
}

#[test]
fn reads_of_bad_leases_tokens_and_blocks_get_specific_errors() {
    use kvxfer_core::plan::BlockRun;
    use kvxfer_proto::v1::ErrorCode;
    let prefill = prefill(16, TTL);
    let h = prefill.lease(LeaseRequest::new("R", 0, 1, vec![1, 2])).expect("lease");
    let ended = prefill.lease(LeaseRequest::new("E", 0, 1, vec![3])).expect("lease");
    prefill.cancel(&ended);
    let dest = kvxfer::KvMemory::alloc(BlockLayout::single(16, BLOCK).expect("layout")).expect("alloc");
    let addr = prefill.local_addr().to_string();
    let layout = prefill.memory().layout().clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let mut c = raw_connection(&addr, &layout, kvxfer_proto::PROTOCOL_VERSION).await.expect("connect");
        let run = |start, count| [BlockRun { remote_start: start, local_start: 0, count }];
        let code = |e: kvxfer_tcp::ClientError| match e {
            kvxfer_tcp::ClientError::Refused { code, .. } => code,
            other => panic!("expected a refusal, got {other}"),
        };
        let tok = h.token().as_bytes();
        // SAFETY: `dest` is this test's own memory, untouched by anyone else.
        unsafe {
            assert_eq!(
                code(c.read_into("X", tok, &run(1, 1), &dest).await.expect_err("refused")),
                ErrorCode::UnknownLease
            );
            assert_eq!(
                code(c.read_into("R", &[9; 16], &run(1, 1), &dest).await.expect_err("refused")),
                ErrorCode::UnknownLease
            );
            assert_eq!(
                code(
                    c.read_into("E", ended.token().as_bytes(), &run(3, 1), &dest).await.expect_err("refused")
                ),
                ErrorCode::LeaseEnded
            );
            assert_eq!(
                code(c.read_into("R", tok, &run(15, 2), &dest).await.expect_err("refused")),
                ErrorCode::BlockOutOfRange
            );
            assert_eq!(
                code(c.read_into("R", tok, &run(5, 1), &dest).await.expect_err("refused")),
                ErrorCode::BlockOutOfRange
            );
            // The connection survives refusals and still serves a good read.
            assert_eq!(c.read_into("R", tok, &run(1, 2), &dest).await.expect("read"), 2 * BLOCK);
        }
    });
    eventually("the served read is counted", || prefill.stats().server.reads_served == 1);
    let s = prefill.stats();
    assert_eq!((s.server.reads_refused, s.server.reads_served), (5, 1));
    assert_eq!(s.leases.live, 1, "refused reads change no lease");
}

fn incomplete_prefill_result_is_refused_before_any_io(t: Transport) {
    let prefill = t.prefill(16, TTL);
    let decode = t.decode(16);
    let result = prefill.lease_parent("R", vec![vec![1], vec![2], vec![3]], 1, None).expect("lease");
    let mut wire = result.to_wire();
    wire.children.remove(1);
    let err = decode.submit_wire(wire, vec![vec![0], vec![2]]).expect_err("incomplete");
    match &err {
        Error::Submit(SubmitError::Result(HandoffError::IncompleteResult { missing, .. })) => {
            assert_eq!(missing, &vec![1])
        }
        other => panic!("wrong error: {other}"),
    }
    assert!(err.to_string().contains("missing children [1]"), "{err}");
    // Local lists that do not fit are refused too, before any I/O.
    assert!(matches!(
        decode.submit(result.clone(), vec![vec![0], vec![1]]),
        Err(Error::Submit(SubmitError::LocalBlockLists { .. }))
    ));
    assert!(matches!(
        decode.submit(result, vec![vec![0], vec![1, 2], vec![3]]),
        Err(Error::Submit(SubmitError::Plan { .. }))
    ));
    assert_eq!(decode.stats().connections_opened, 0);
    assert_eq!(prefill.stats().server.connections, 0);
}

fn mismatch_pull(t: Transport, decode_config: AgentConfig, decode_layout: BlockLayout, needles: &[&str]) {
    let version = decode_config.protocol_version;
    let prefill = t.prefill(16, TTL);
    let decode = decode_with(t.config(decode_config), decode_layout);
    let result = prefill.lease_parent("M", vec![vec![1]], 1, None).expect("lease");
    let report = decode.submit(result, vec![vec![1]]).expect("submit").wait();
    let ChildOutcome::Failed { error: reason, invalid_local_blocks } = &report.children[0].outcome else {
        panic!("expected failure: {report:?}")
    };
    for n in needles {
        assert!(reason.to_string().contains(n), "{reason:?} should contain {n:?}");
    }
    // Typed: incompatible, with this side's value; the refusal's message names both.
    let kvxfer::PullError::Incompatible { field, local, .. } = reason else { panic!("{reason:?}") };
    let ours = match field {
        kvxfer::MismatchField::ProtocolVersion => u64::from(version),
        _ => decode.memory().layout().compat_hash(),
    };
    assert_eq!(*local, ours);
    assert_eq!(reason.advice(), kvxfer::Advice::Recompute);
    assert_eq!(invalid_local_blocks, &vec![1]);
    assert_eq!(prefill.stats().server.handshakes_refused, 1);
    assert_eq!(prefill.stats().leases.pulled, 0);
}

fn protocol_version_mismatch_fails_on_both_sides_naming_both_versions(t: Transport) {
    let mut config = AgentConfig::new("decode-v9");
    config.protocol_version = 9;
    let ours = format!("v{}", kvxfer_proto::PROTOCOL_VERSION);
    mismatch_pull(
        t,
        config,
        BlockLayout::single(16, BLOCK).expect("layout"),
        &["v9", &ours, "decode-v9", "prefill"],
    );
}

fn compatibility_hash_mismatch_fails_on_both_sides_naming_both_hashes(t: Transport) {
    let prefill_hash = BlockLayout::single(16, BLOCK).expect("layout").compat_hash();
    let other = BlockLayout::new(16, vec![Segment::packed(BLOCK)], "bf16", 32).expect("layout");
    let decode_hash = format!("{:#018x}", other.compat_hash());
    mismatch_pull(t, AgentConfig::new("decode"), other, &[&format!("{prefill_hash:#018x}"), &decode_hash]);
}

fn a_decode_that_can_never_pull_still_releases_the_lease(t: Transport) {
    // Other tokens per block: no pull can read this prefill's blocks (the handshake refuses
    // the layout), but the lease is given back at once over a control-only connection
    // instead of being held until it expires.
    let prefill = t.prefill(16, TTL);
    let other = BlockLayout::new(16, vec![Segment::packed(BLOCK)], "bf16", 32).expect("layout");
    let decode = decode_with(t.config(AgentConfig::new("decode")), other);
    let result = prefill.lease_parent("NP", vec![vec![1], vec![2]], 1, None).expect("lease");
    let started = Instant::now();
    assert!(decode.release(&result.children()[0]), "the release was refused: {:?}", decode.stats());
    let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!((ends[0].child_index, ends[0].kind), (0, EndKind::Released));
    assert!(started.elapsed() < TTL);
    assert_eq!(decode.stats().leases_released, 1);
    // A second release of it is answered (already released), nothing else moves; it goes
    // straight to a control-only connection (no second refused handshake).
    assert!(decode.release(&result.children()[0]));
    let s = prefill.stats();
    assert_eq!((s.leases.released, s.leases.pulled, s.leases.live), (1, 0, 1));
    assert_eq!(s.server.handshakes_refused, 1);
    // The pull of the other child is still refused, as before.
    let report = decode.submit_subset(&result, vec![(1, vec![2])]).expect("submit").wait();
    assert!(
        matches!(
            &report.children[0].outcome,
            ChildOutcome::Failed { error: kvxfer::PullError::Incompatible { .. }, .. }
        ),
        "{report:?}"
    );
    assert_eq!(prefill.stats().server.reads_served, 0);
}

fn expected_consumers_two_frees_only_after_both_decode_agents_notified(t: Transport) {
    let prefill = t.prefill(16, TTL);
    let rank0 = t.decode(16);
    let rank1 = t.decode(16);
    let result = prefill.lease_parent("TP", vec![vec![1, 2, 3]], 2, None).expect("lease");
    assert!(rank0.submit(result.clone(), vec![vec![0, 1, 2]]).expect("submit").wait().all_done());
    assert_no_more_ends(&prefill, Duration::from_millis(100));
    assert_eq!(prefill.stats().leases.live, 1);
    assert!(rank1.submit(result, vec![vec![5, 6, 7]]).expect("submit").wait().all_done());
    let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!((ends[0].kind, ends[0].consumers_seen, ends[0].expected_consumers), (EndKind::Pulled, 2, 2));
    assert!(verify(&rank0, &[1, 2, 3], &[0, 1, 2]) && verify(&rank1, &[1, 2, 3], &[5, 6, 7]));
}

fn multi_segment_layouts_with_strides_round_trip(t: Transport) {
    // Two layers, K and V each: four segments, one of them strided on the decode side only.
    let seg = |len, stride| Segment { block_len: len, stride };
    let p_layout =
        BlockLayout::new(32, vec![seg(256, 256), seg(256, 256), seg(512, 512), seg(128, 128)], "bf16", 16)
            .expect("layout");
    let d_layout =
        BlockLayout::new(40, vec![seg(256, 256), seg(256, 1024), seg(512, 512), seg(128, 4096)], "bf16", 16)
            .expect("layout");
    let prefill = prefill_with(t.config(AgentConfig::new("prefill")), p_layout);
    let decode = decode_with(t.config(AgentConfig::new("decode")), d_layout);
    let remote = vec![vec![0, 1, 2, 3, 20, 21], vec![4, 5, 30, 31, 6, 7]];
    let local = vec![vec![10, 11, 12, 13, 14, 15], vec![39, 38, 37, 36, 0, 1]];
    let result = prefill.lease_parent("L", remote.clone(), 1, None).expect("lease");
    let report = decode.submit(result, local.clone()).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    for (i, (r, l)) in remote.iter().zip(&local).enumerate() {
        assert!(verify(&decode, r, l), "child {i}");
    }
}

async fn raw_connection(
    addr: &str,
    layout: &BlockLayout,
    version: u32,
) -> Result<kvxfer_tcp::Connection, kvxfer_tcp::ClientError> {
    let hello = kvxfer_proto::v1::Hello { protocol_version: version, ..raw_hello(layout, "raw") };
    raw_connect(addr, &hello).await
}

/// A control-only connection (`Hello::control_only`) skips the layout check and may only
/// cancel: a heartbeat on it is refused and the connection closed, a read names nothing it
/// may serve, and the protocol version is still checked.
#[test]
fn a_control_only_connection_only_cancels() {
    let prefill = prefill(16, TTL);
    let h = prefill.lease(LeaseRequest::new("CO", 0, 1, vec![3])).expect("lease");
    let addr = prefill.local_addr().to_string();
    let other = BlockLayout::new(16, vec![Segment::packed(BLOCK)], "bf16", 32).expect("layout");
    let hello = kvxfer_proto::v1::Hello { control_only: true, ..raw_hello(&other, "raw") };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        // Without the flag this layout is refused at the handshake.
        let refused = raw_connect(&addr, &raw_hello(&other, "raw")).await;
        assert!(matches!(refused, Err(kvxfer_tcp::ClientError::Incompatible { .. })), "{refused:?}");
        let mut c = raw_connect(&addr, &hello).await.expect("a control-only connection is accepted");
        assert!(c.peer_hello().transports.is_empty(), "a control-only peer is told no data path");
        let lease = kvxfer_proto::v1::LeaseRef {
            remote_request_id: "CO".into(),
            lease_token: h.token().as_bytes().to_vec(),
        };
        let e = c.heartbeat(vec![lease]).await.expect_err("a heartbeat on a control-only connection");
        assert!(e.to_string().contains("control-only"), "{e}");
        let mut c = raw_connect(&addr, &hello).await.expect("connect again");
        let wrong = c.cancel("CO", &[0; 16]).await.expect("answered");
        assert_eq!(wrong, kvxfer_proto::v1::LeaseOutcome::Unrecognized, "a wrong token learns nothing");
        assert_eq!(
            c.cancel("CO", h.token().as_bytes()).await.expect("answered"),
            kvxfer_proto::v1::LeaseOutcome::Released
        );
        let old = kvxfer_proto::v1::Hello { protocol_version: 9, ..hello.clone() };
        let refused = raw_connect(&addr, &old).await;
        assert!(matches!(refused, Err(kvxfer_tcp::ClientError::Incompatible { .. })), "{refused:?}");
    });
    let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!(ends[0].kind, EndKind::Released);
    assert_eq!(prefill.stats().server.reads_served, 0);
}

#[test]
fn heartbeats_keep_a_slow_pull_alive_past_its_ttl() {
    let ttl = Duration::from_millis(300);
    let prefill = prefill(16, ttl);
    let h = prefill.lease(LeaseRequest::new("H", 0, 1, vec![1])).expect("lease");
    let addr = prefill.local_addr().to_string();
    let layout = prefill.memory().layout().clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let started = Instant::now();
    rt.block_on(async {
        let mut c = raw_connection(&addr, &layout, kvxfer_proto::PROTOCOL_VERSION).await.expect("connect");
        let lease = kvxfer_proto::v1::LeaseRef {
            remote_request_id: "H".into(),
            lease_token: h.token().as_bytes().to_vec(),
        };
        // Heartbeat every ttl/6 for three ttls.
        while started.elapsed() < ttl * 3 {
            let out = c.heartbeat(vec![lease.clone()]).await.expect("heartbeat");
            assert_eq!(out, vec![kvxfer_proto::v1::LeaseOutcome::Extended]);
            tokio::time::sleep(ttl / 6).await;
        }
        let ack = c.notify("H", h.token().as_bytes(), "slow-decode").await.expect("notify");
        assert_eq!(ack.outcome, kvxfer_proto::v1::LeaseOutcome::Pulled as i32);
    });
    let ends = wait_ends(&prefill, 1, Duration::from_secs(2));
    assert_eq!(ends[0].kind, EndKind::Pulled);
    assert_eq!(prefill.stats().leases.expired, 0);
}

fn wrong_token_fails_the_child_and_changes_no_lease(t: Transport) {
    let prefill = t.prefill(16, TTL);
    let decode = t.decode(16);
    let result = prefill.lease_parent("W", vec![vec![1, 2], vec![3, 4]], 1, None).expect("lease");
    let mut wire = result.to_wire();
    wire.children[1].lease_token = vec![0xee; 16];
    let report = decode.submit_wire(wire, vec![vec![5, 6], vec![7, 8]]).expect("submit").wait();
    assert!(matches!(report.children[0].outcome, ChildOutcome::Done { .. }), "{report:?}");
    let ChildOutcome::Failed { error: reason, invalid_local_blocks } = &report.children[1].outcome else {
        panic!("{report:?}")
    };
    // On the wire a wrong token is told what an unknown id is told.
    assert!(reason.to_string().contains("no lease for request 1_W with this token"), "{reason}");
    let kvxfer::PullError::LeaseUnknown { remote_request_id, .. } = reason else { panic!("{reason:?}") };
    assert_eq!(remote_request_id, "1_W");
    assert!(reason.is_retryable());
    assert_eq!(invalid_local_blocks, &vec![7, 8]);
    assert!(verify(&decode, &[1, 2], &[5, 6]));
    let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!((ends[0].child_index, ends[0].kind), (0, EndKind::Pulled));
    let s = prefill.stats().leases;
    assert_eq!(s.live, 1, "child 1's lease is untouched by the bad token");
    assert!(s.bad_token >= 1);
}

fn out_of_range_remote_blocks_fail_before_any_read(t: Transport) {
    let prefill = t.prefill(16, TTL);
    let decode = t.decode(64);
    let result = prefill.lease_parent("O", vec![vec![1, 2]], 1, None).expect("lease");
    let mut wire = result.to_wire();
    wire.children[0].remote_block_ids = vec![1, 40];
    let report = decode.submit_wire(wire, vec![vec![5, 6]]).expect("submit").wait();
    let ChildOutcome::Failed { error: reason, .. } = &report.children[0].outcome else {
        panic!("{report:?}")
    };
    assert!(reason.to_string().contains("[40]") && reason.to_string().contains("16 blocks"), "{reason}");
    assert_eq!(reason, &kvxfer::PullError::RemoteBlocksOutOfRange { ids: vec![40], num_blocks: 16 });
    assert_eq!(reason.advice(), kvxfer::Advice::Recompute);
    assert_eq!(prefill.stats().server.reads_served, 0);
    assert_eq!(prefill.stats().server.pins, 0);
}

per_transport!(
    n1_pulled_and_verified,
    n2_pulled_and_verified,
    n3_pulled_and_verified,
    n8_pulled_and_verified,
    siblings_sharing_prompt_blocks_cross_the_wire_once,
    siblings_sharing_local_blocks_too,
    dropped_child_is_released_at_once_and_skipped_child_expires,
    incomplete_prefill_result_is_refused_before_any_io,
    protocol_version_mismatch_fails_on_both_sides_naming_both_versions,
    compatibility_hash_mismatch_fails_on_both_sides_naming_both_hashes,
    a_decode_that_can_never_pull_still_releases_the_lease,
    expected_consumers_two_frees_only_after_both_decode_agents_notified,
    multi_segment_layouts_with_strides_round_trip,
    wrong_token_fails_the_child_and_changes_no_lease,
    out_of_range_remote_blocks_fail_before_any_read,
);

/// A pull from a prefill agent listening on `[::1]`: the hand-off names host `::1`, the
/// decode side connects to `[::1]:port`, and a hand-off that travelled as
/// `kv_transfer_params` with the host in brackets (as some proxies write it) pulls too.
#[test]
fn pull_over_ipv6_loopback() {
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let mem = kvxfer_mem::pattern::alloc_filled(layout).expect("patterned memory");
    let config = keyed(AgentConfig::new("prefill-v6").io_timeout(Duration::from_secs(5)));
    let prefill = match kvxfer::blocking::PrefillAgent::start(config, "[::1]:0", mem) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("skipped: cannot listen on [::1] here ({e})");
            return;
        }
    };
    assert_eq!(prefill.advertised_host(), "::1");
    let decode = decode(16);
    let result = prefill.lease_parent("V6", vec![vec![1, 2], vec![3]], 1, None).expect("lease");
    let mut params = kvxfer::KvTransferParams::from_handoff(&result.children()[1]);
    assert_eq!(params.remote_host.as_deref(), Some("::1"));
    params.remote_host = Some("[::1]".into());
    let child1 = kvxfer::KvTransferParams::from_json(&params.to_json())
        .expect("params")
        .to_handoff()
        .expect("hand-off");
    let result = PrefillResult::new("V6", 2, vec![result.children()[0].clone(), child1]).expect("result");
    let report = decode.submit(result, vec![vec![5, 6], vec![7]]).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    assert!(verify(&decode, &[1, 2], &[5, 6]) && verify(&decode, &[3], &[7]));
    let ends = wait_ends(&prefill, 2, Duration::from_secs(5));
    assert!(ends.iter().all(|e| e.kind == EndKind::Pulled), "{ends:?}");
}

/// A one-sided read that outlives its pin is not used: the prefill side drops pins at once
/// here (`pin_timeout` ~0), so by the unpin the pin is gone and the child fails, naming
/// why, instead of trusting blocks that may no longer have been leased.
#[cfg(feature = "ucx")]
fn one_sided_read_outliving_its_pin_is_refused(t: Transport) {
    let mut config = t.config(AgentConfig::new("prefill").lease_ttl(TTL).io_timeout(Duration::from_secs(5)));
    config.limits.pin_timeout = Duration::from_nanos(1);
    // Pins are held longer the larger they are; here they must not grow.
    config.limits.min_transfer_rate = u64::MAX;
    // 16 MiB: the read takes several milliseconds, longer than the server's timer tick.
    let layout = BlockLayout::single(256, 64 * 1024).expect("layout");
    let prefill = prefill_with(config, layout.clone());
    let decode = decode_with(t.config(AgentConfig::new("decode").io_timeout(Duration::from_secs(5))), layout);
    let blocks: Vec<BlockId> = (0..256).collect();
    let result = prefill.lease_parent("X", vec![blocks.clone()], 1, None).expect("lease");
    let report = decode.submit(result, vec![blocks]).expect("submit").wait();
    let ChildOutcome::Failed { error: reason, .. } = &report.children[0].outcome else {
        panic!("{report:?}")
    };
    assert!(reason.to_string().contains("dropped pin"), "{reason}");
    assert!(matches!(reason, kvxfer::PullError::PinNotHeld { .. }), "{reason:?}");
    let ends = wait_ends(&prefill, 1, Duration::from_secs(10));
    assert_eq!(ends[0].kind, EndKind::Released);
    assert!(prefill.stats().server.pins_expired >= 1);
}

/// A parent's children are read pipelined on one data connection — one write of every
/// request, one round trip — though the agent may open eight: the prefill agent accepts the
/// hand-off's control connection and one data connection. Every child is done with the
/// right bytes and its notify went with its read.
#[test]
fn a_parents_small_reads_share_one_data_connection() {
    let prefill = prefill(64, TTL);
    let config = AgentConfig::new("decode")
        .transport(kvxfer::TransportChoice::Tcp)
        .connections_per_peer(8)
        .notify_with_read(true);
    let decode = decode_with(config, BlockLayout::single(64, BLOCK).expect("layout"));
    let remote: Vec<Vec<BlockId>> = (0..8).map(|i| vec![2 * i, 2 * i + 1]).collect();
    let local: Vec<Vec<BlockId>> = (0..8).map(|i| vec![20 + 2 * i, 21 + 2 * i]).collect();
    let result = prefill.lease_parent("P", remote.clone(), 1, None).expect("lease");
    let report = decode.submit(result, local.clone()).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    for (r, l) in remote.iter().zip(&local) {
        assert!(verify(&decode, r, l), "{r:?} -> {l:?}");
    }
    assert_eq!(prefill.stats().server.connections, 2, "one control and one data connection");
    assert_eq!(prefill.stats().server.reads_served, 8);
    let s = decode.stats();
    assert_eq!(s.notifies_with_read, 8);
    assert_eq!((s.read_batches, s.reads_batched, s.reads_after_broken_batch), (1, 8, 0), "{s:?}");
    let ends = wait_ends(&prefill, 8, Duration::from_secs(10));
    assert!(ends.iter().all(|e| e.kind == EndKind::Pulled), "{ends:?}");
}

#[cfg(feature = "ucx")]
mod pins {
    use super::*;

    #[test]
    fn ucx_tcp_one_sided_read_outliving_its_pin_is_refused() {
        one_sided_read_outliving_its_pin_is_refused(Transport::UcxTcp)
    }

    #[test]
    fn ucx_shm_one_sided_read_outliving_its_pin_is_refused() {
        one_sided_read_outliving_its_pin_is_refused(Transport::UcxShm)
    }
}

/// `DecodeAgent::release`: a decode worker drops children it will not pull (vLLM aborts
/// requests still waiting in its queue) and pulls the others. The dropped child's lease ends
/// released at once, deterministically — a `cancel_child` right after `submit` races the pull
/// and may lose to it (the child is then done). Releasing again is answered "already
/// released" (true); releasing a pulled lease, or through a peer that is gone, is refused.
#[test]
fn children_released_without_pulling_them_end_released_the_others_pulled() {
    let prefill = prefill(64, TTL);
    let decode = decode(64);
    let remote: Vec<Vec<BlockId>> = (0..3).map(|i| (i * 4..i * 4 + 4).collect()).collect();
    let result = prefill.lease_parent("R", remote.clone(), 1, None).expect("lease");
    assert!(decode.release(&result.children()[1]), "released");
    let others = vec![(0, remote[0].clone()), (2, remote[2].clone())];
    let report = decode.submit_subset(&result, others).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    assert!(verify(&decode, &remote[0], &remote[0]) && verify(&decode, &remote[2], &remote[2]));
    let ends = wait_ends(&prefill, 3, Duration::from_secs(5));
    let kinds: Vec<EndKind> = ends.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [EndKind::Pulled, EndKind::Released, EndKind::Pulled]);
    assert!(decode.release(&result.children()[1]), "already released: still released");
    assert!(!decode.release(&result.children()[0]), "a pulled lease is not released");
    let s = decode.stats();
    assert_eq!((s.leases_released, s.releases_refused), (2, 1), "{s:?}");
    // The prefill worker is gone: the release cannot get through.
    let late = prefill.lease_parent("G", vec![vec![20]], 1, None).expect("lease");
    drop(prefill);
    assert!(!decode.release(&late.children()[0]));
    assert_eq!(decode.stats().releases_refused, 2);
}

/// The expiry task sleeps until the earliest deadline and is woken only by a lease that
/// would expire before it: a lease with a short ttl made after long ones — and after one
/// with an even later deadline, and one made while the task recomputes after an expiry —
/// still expires at its own deadline, not at the long leases'.
#[test]
fn a_shorter_lease_made_after_longer_ones_expires_at_its_own_deadline() {
    let prefill = Transport::Tcp.prefill(64, Duration::from_secs(600));
    let long =
        prefill.lease(LeaseRequest::new("L", 0, 1, vec![1]).ttl(Duration::from_secs(300))).expect("lease");
    let longer =
        prefill.lease(LeaseRequest::new("M", 0, 1, vec![2]).ttl(Duration::from_secs(400))).expect("lease");
    let started = Instant::now();
    for round in 0..3u32 {
        let id = format!("S{round}");
        let h = prefill
            .lease(LeaseRequest::new(&id, 0, 1, vec![3 + round]).ttl(Duration::from_millis(150)))
            .expect("lease");
        // Not a timing goal: a short lease slept past would end only after 300 s.
        let ends = wait_ends(&prefill, 1, Duration::from_secs(20));
        assert_eq!((&*ends[0].parent_request_id, ends[0].kind), (id.as_str(), EndKind::Expired), "{ends:?}");
        assert_eq!(&*ends[0].remote_request_id, h.remote_request_id());
    }
    assert!(started.elapsed() < Duration::from_secs(300));
    assert!(prefill.events().try_recv().is_err(), "the long leases are still live");
    drop((long, longer));
}

/// A prefill KV cache in memory UCX allocated (`kvxfer::ucx_region`, what lets UCX 1.13
/// serve shared-memory gets one-sided): pulled over UCX shared memory byte-exact, every
/// byte one-sided, and the agents and their memory shut down cleanly.
#[cfg(feature = "ucx")]
#[test]
fn ucx_shm_pull_from_ucx_allocated_prefill_memory() {
    let t = Transport::UcxShm;
    let config = keyed(t.config(AgentConfig::new("prefill").io_timeout(Duration::from_secs(5))));
    let ucx = config.ucx.clone();
    let layout = BlockLayout::single(96, BLOCK).expect("layout");
    let mem = kvxfer_mem::pattern::alloc_filled_in(layout, &mut |len| {
        Ok(kvxfer::ucx_region(&ucx, len).expect("UCX-allocated region"))
    })
    .expect("patterned memory");
    let prefill = kvxfer::blocking::PrefillAgent::start(config, "127.0.0.1:0", mem).expect("prefill agent");
    let decode = t.decode(96);
    let remote: Vec<Vec<BlockId>> = (0..4).map(|i| (i * 12..i * 12 + 12).rev().collect()).collect();
    let local: Vec<Vec<BlockId>> = (0..4).map(|i| (48 + i * 12..60 + i * 12).collect()).collect();
    let result = prefill.lease_parent("U", remote.clone(), 1, None).expect("lease");
    let report = decode.submit(result, local.clone()).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    for (r, l) in remote.iter().zip(&local) {
        assert!(verify(&decode, r, l), "child bytes");
    }
    let bytes = 48 * BLOCK;
    assert_eq!(decode.stats().bytes_pulled_ucx, bytes);
    eventually("served bytes counted", || prefill.stats().server.bytes_served_one_sided == bytes);
    drop(decode);
    drop(prefill);
}

/// Over shared memory the rkeys a decode agent unpacks map the prefill's KV cache into the
/// decode process: prefill agents (on UCX-allocated memory) that stop for good, one after
/// another on new ports, must not leave their endpoints — and so their pages — attached.
/// Once the decode side forgets a gone peer, it holds no UCX endpoint to it: never more
/// endpoints than peers it knows.
#[cfg(feature = "ucx")]
#[test]
fn ucx_shm_endpoints_of_forgotten_prefill_agents_are_closed() {
    let t = Transport::UcxShm;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let decode =
        decode_with(t.config(AgentConfig::new("decode").io_timeout(Duration::from_secs(5))), layout.clone());
    for round in 0..4 {
        let config = keyed(t.config(AgentConfig::new("prefill").io_timeout(Duration::from_secs(5))));
        let ucx = config.ucx.clone();
        let mem = kvxfer_mem::pattern::alloc_filled_in(layout.clone(), &mut |len| {
            Ok(kvxfer::ucx_region(&ucx, len).expect("UCX-allocated region"))
        })
        .expect("patterned memory");
        let prefill =
            kvxfer::blocking::PrefillAgent::start(config, "127.0.0.1:0", mem).expect("prefill agent");
        let result = prefill.lease_parent(&format!("F{round}"), vec![vec![1, 2]], 1, None).expect("lease");
        let report = decode.submit(result, vec![vec![3, 4]]).expect("submit").wait();
        assert!(report.all_done(), "round {round}: {report:?}");
        assert!(verify(&decode, &[1, 2], &[3, 4]));
        assert!(decode.stats().bytes_pulled_ucx > 0, "round {round}: read over UCX");
        drop(prefill);
        // The endpoints of forgotten peers close on the UCX thread, soon after.
        eventually(&format!("round {round}: no endpoint to a forgotten peer"), || {
            let s = decode.stats();
            s.ucx_endpoints <= s.peers
        });
        let s = decode.stats();
        // The one just used, plus at most the previous one (its sockets may still be closing).
        assert!(s.peers <= 2 && s.ucx_endpoints >= 1, "round {round}: {s:?}");
    }
}
