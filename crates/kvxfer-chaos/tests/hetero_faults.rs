//! Head-slice pulls (`DecodeAgent::submit_ranks`) through the fault proxy: a read stalled
//! for longer than the lease's ttl keeps its lease alive by heartbeats, and ends pulled.

use std::time::Duration;

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{AgentConfig, ChildHandoff, ChildOutcome, EndKind, KvMemory, LeaseRequest, PrefillResult};
use kvxfer_chaos::{Direction, Fault, FaultKind, FaultProxy};
use kvxfer_core::{GroupSpec, KvHeads, KvShape, KvShapeSpec, SegmentSpec, TransferPair};
use kvxfer_mem::pattern;

fn spec(block_tokens: u32, num_blocks: u32) -> KvShapeSpec {
    KvShapeSpec {
        tp_size: 1,
        tp_rank: 0,
        heads: KvHeads::Split { total: 4 },
        block_tokens,
        dtype: "bf16".into(),
        dtype_bytes: 2,
        groups: vec![GroupSpec { num_blocks, segments: vec![SegmentSpec::packed(128); 2] }],
    }
}

/// The hand-off pointing at `port` instead (the proxy).
fn via(h: &ChildHandoff, port: u16) -> ChildHandoff {
    let mut w = h.to_wire();
    w.remote_port = u32::from(port);
    ChildHandoff::from_wire(w).expect("hand-off")
}

#[test]
fn a_stalled_slice_read_is_kept_alive_by_heartbeats() {
    // Prefill blocks of 16 tokens (4 heads x 16 tokens x 128 x bf16 = 16 KiB per segment,
    // K and V: 32 KiB), decode blocks of 32 (block ratio 2): 40 remote blocks, 1.25 MiB,
    // read through the proxy, whose first
    // data connection (connection 1; 0 is the control connection) stalls for 2 s after
    // 1 MiB of payload. The lease lives 600 ms unless heartbeated.
    let ttl = Duration::from_millis(600);
    let prefill_spec = spec(16, 64);
    let prefill_shape = KvShape::new(prefill_spec.clone()).expect("shape");
    let prefill = PrefillAgent::start(
        AgentConfig::new("prefill")
            .transport(kvxfer::TransportChoice::Tcp)
            .lease_ttl(ttl)
            .kv_shape(prefill_spec),
        "127.0.0.1:0",
        pattern::alloc_filled_shape(&prefill_shape).expect("memory"),
    )
    .expect("prefill");
    let stall = Fault {
        direction: Direction::ToDecode,
        offset: 1 << 20,
        kind: FaultKind::Delay(Duration::from_secs(2)),
        connection: Some(1),
    };
    let proxy = FaultProxy::start(prefill.local_addr(), vec![stall]).expect("proxy");
    let decode_spec = spec(32, 32);
    let decode_shape = KvShape::new(decode_spec.clone()).expect("shape");
    let layout = decode_shape.block_layout(0).expect("layout").clone();
    let decode = DecodeAgent::start(
        AgentConfig::new("decode")
            .transport(kvxfer::TransportChoice::Tcp)
            .io_timeout(Duration::from_secs(10))
            .kv_shape(decode_spec),
        KvMemory::alloc(layout).expect("memory"),
    )
    .expect("decode");
    let remote: Vec<u32> = (10..50).collect();
    let local: Vec<u32> = (0..20).collect();
    let h = prefill.lease(LeaseRequest::new("S", 0, 1, remote.clone())).expect("lease");
    let result = PrefillResult::new("S", 1, vec![via(&h, proxy.addr().port())]).expect("result");
    let report = decode.submit_ranks(vec![result], vec![vec![local.clone()]]).expect("submit").wait();
    assert!(
        matches!(report.children[0].outcome, ChildOutcome::Done { acknowledged: true, .. }),
        "{report:?}"
    );
    assert_eq!(proxy.stats().faults_fired, 1, "the read stalled");
    let end = prefill.events().recv_timeout(Duration::from_secs(10)).expect("lease end");
    assert_eq!(end.kind, EndKind::Pulled, "{end:?}");
    let pair = TransferPair::new(&prefill_shape, &decode_shape).expect("pair");
    // SAFETY: the pull has reported.
    let bad =
        unsafe { pattern::check_shaped_blocks(decode.memory(), &pair, 0, &remote, &local) }.expect("layout");
    assert_eq!(bad, None);
}

/// One rank of a GQA prefill engine of TP 4 (2 KV heads: ranks 0 and 1 hold head 0).
fn gqa_spec(tp_size: u32, tp_rank: u32, num_blocks: u32) -> KvShapeSpec {
    KvShapeSpec { tp_size, tp_rank, heads: KvHeads::Split { total: 2 }, ..spec(16, num_blocks) }
}

/// Prefill TP 4 → decode TP 2 with GQA: decode rank 0 reads head 0 from one prefill rank
/// and only notifies the other, whose host freezes after the handshake (every later
/// connection black-holed). Its heartbeats and notify wait out their timeouts beside the
/// read, never in its way: the read rank's lease (ttl 1 s, its read held up 2.5 s by the
/// proxy) stays heartbeated and the read completes; the frozen rank is found unreachable
/// once, and the notify to it is skipped (not acknowledged). Fails when a control exchange
/// holds up the pull's other work (the read rank's lease then expires before its read).
#[test]
fn a_frozen_notify_only_rank_holds_up_no_read() {
    let ttl = Duration::from_secs(1);
    let prefill_blocks = 32;
    let prefills: Vec<PrefillAgent> = (0..4)
        .map(|r| {
            let s = gqa_spec(4, r, prefill_blocks);
            let shape = KvShape::new(s.clone()).expect("shape");
            PrefillAgent::start(
                AgentConfig::new("prefill")
                    .engine_id("gqa-prefill")
                    .transport(kvxfer::TransportChoice::Tcp)
                    .lease_ttl(ttl)
                    .kv_shape(s),
                "127.0.0.1:0",
                pattern::alloc_filled_shape(&shape).expect("memory"),
            )
            .expect("prefill")
        })
        .collect();
    let decode_spec = gqa_spec(2, 0, 16);
    let decode_shape = KvShape::new(decode_spec.clone()).expect("shape");
    let prefill_shape = KvShape::new(gqa_spec(4, 0, prefill_blocks)).expect("shape");
    let pair = TransferPair::new(&prefill_shape, &decode_shape).expect("pair");
    let remote: Vec<u32> = (4..8).collect();
    let local: Vec<u32> = (0..4).collect();
    let plan = pair.plan(&[(&remote, &local)]).expect("plan");
    let read_rank = plan.reads()[0].source_rank();
    assert_eq!(plan.reads().len(), 1, "one read: the head is replicated");
    let frozen_rank = 1 - read_rank;
    assert!(plan.notify_ranks().contains(&frozen_rank), "the other rank is notified");
    // Every control exchange opens a fresh connection (pooled ones count as stale at once):
    // the frozen rank's connection 0 is the handshake, every later one is black-holed.
    // The read rank's connection 1 is its data connection, held up 2.5 s.
    let frozen =
        Fault { direction: Direction::ToPrefill, offset: 0, kind: FaultKind::Blackhole, connection: None };
    let read_proxy = FaultProxy::start(
        prefills[read_rank as usize].local_addr(),
        vec![Fault {
            direction: Direction::ToDecode,
            offset: 0,
            kind: FaultKind::Delay(Duration::from_millis(2500)),
            connection: Some(1),
        }],
    )
    .expect("proxy");
    let frozen_proxy = FaultProxy::start(
        prefills[frozen_rank as usize].local_addr(),
        (1..16).map(|c| Fault { connection: Some(c), ..frozen }).collect(),
    )
    .expect("proxy");
    let results: Vec<PrefillResult> = prefills
        .iter()
        .enumerate()
        .map(|(r, p)| {
            let h = p.lease(LeaseRequest::new("G", 0, 1, remote.clone())).expect("lease");
            let h = match r as u32 {
                r if r == read_rank => via(&h, read_proxy.addr().port()),
                r if r == frozen_rank => via(&h, frozen_proxy.addr().port()),
                _ => h,
            };
            PrefillResult::new("G", 1, vec![h]).expect("result")
        })
        .collect();
    let layout = decode_shape.block_layout(0).expect("layout").clone();
    let mut config = AgentConfig::new("decode")
        .transport(kvxfer::TransportChoice::Tcp)
        .io_timeout(Duration::from_secs(4))
        .kv_shape(decode_spec);
    config.heartbeat_interval = Some(Duration::from_millis(100));
    config.limits.idle_timeout = Duration::from_millis(2);
    let decode = DecodeAgent::start(config, KvMemory::alloc(layout).expect("memory")).expect("decode");
    let report = decode.submit_ranks(results, vec![vec![local.clone()]]).expect("submit").wait();
    assert!(
        matches!(report.children[0].outcome, ChildOutcome::Done { acknowledged: false, .. }),
        "{report:?}"
    );
    assert!(read_proxy.stats().faults_fired >= 1, "the read was held up");
    assert!(
        frozen_proxy.stats().faults_fired >= 1,
        "the frozen rank was asked something after its handshake"
    );
    // SAFETY: the pull has reported.
    let bad =
        unsafe { pattern::check_shaped_blocks(decode.memory(), &pair, 0, &remote, &local) }.expect("layout");
    assert_eq!(bad, None);
    let end = prefills[read_rank as usize].events().recv_timeout(Duration::from_secs(10)).expect("lease end");
    assert_eq!(end.kind, EndKind::Pulled, "{end:?}");
    decode.shutdown();
}

/// Prefill TP 1 → decode TP 2: decode rank 0's reads break (every data connection through
/// its proxy is cut after the handshake) while rank 1 reads directly. Rank 0's child fails
/// and releases the shared lease (the request cannot complete without its heads); rank 1
/// either read first (done; its notify acknowledged or not) or finds the lease ended —
/// never a hang, and the lease ends exactly once, released.
#[test]
fn one_failing_decode_rank_of_two_releases_the_shared_lease_once() {
    let prefill_spec = spec(16, 32);
    let prefill_shape = KvShape::new(prefill_spec.clone()).expect("shape");
    let prefill = PrefillAgent::start(
        AgentConfig::new("prefill").transport(kvxfer::TransportChoice::Tcp).kv_shape(prefill_spec),
        "127.0.0.1:0",
        pattern::alloc_filled_shape(&prefill_shape).expect("memory"),
    )
    .expect("prefill");
    // Connection 0 is rank 0's handshake (control); every later one is a data connection
    // (or a control retry) and is cut once the prefill side has sent 64 bytes.
    let cuts = (1..16)
        .map(|c| Fault { connection: Some(c), ..Fault::new(Direction::ToDecode, 64, FaultKind::Cut) })
        .collect();
    let proxy = FaultProxy::start(prefill.local_addr(), cuts).expect("proxy");
    let decodes: Vec<DecodeAgent> = (0..2)
        .map(|r| {
            let s = KvShapeSpec { tp_size: 2, tp_rank: r, ..spec(16, 16) };
            let layout = KvShape::new(s.clone()).expect("shape").block_layout(0).expect("layout").clone();
            DecodeAgent::start(
                AgentConfig::new("decode").transport(kvxfer::TransportChoice::Tcp).rank(r).kv_shape(s),
                KvMemory::alloc(layout).expect("memory"),
            )
            .expect("decode")
        })
        .collect();
    let h = prefill.lease(LeaseRequest::new("F", 0, 1, (4..12).collect()).consumers(2)).expect("lease");
    let direct = PrefillResult::new("F", 1, vec![h.clone()]).expect("result");
    let proxied = PrefillResult::new("F", 1, vec![via(&h, proxy.addr().port())]).expect("result");
    let local: Vec<u32> = (0..8).collect();
    let h0 = decodes[0].submit_ranks(vec![proxied], vec![vec![local.clone()]]).expect("submit");
    let h1 = decodes[1].submit_ranks(vec![direct], vec![vec![local]]).expect("submit");
    let (r0, r1) = (h0.wait(), h1.wait());
    assert!(matches!(r0.children[0].outcome, ChildOutcome::Failed { .. }), "rank 0: {r0:?}");
    match &r1.children[0].outcome {
        // Read before the release (its notify acknowledged, or finding the lease released).
        ChildOutcome::Done { .. } => {}
        ChildOutcome::Failed {
            error: kvxfer::PullError::LeaseEnded { .. } | kvxfer::PullError::LeaseUnknown { .. },
            ..
        } => {}
        o => panic!("rank 1: {o:?}"),
    }
    assert!(proxy.stats().faults_fired >= 1, "rank 0's read was cut");
    let end = prefill.events().recv_timeout(Duration::from_secs(10)).expect("lease end");
    assert_eq!(end.kind, EndKind::Released, "{end:?}");
    assert!(prefill.events().recv_timeout(Duration::from_millis(100)).is_err(), "one end only");
}
