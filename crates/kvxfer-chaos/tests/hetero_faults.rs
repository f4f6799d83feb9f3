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
