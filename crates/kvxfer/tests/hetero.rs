//! Heterogeneous layouts through the engine, on 127.0.0.1: caches of several KV-cache
//! groups (each its own segments, block size and block ids) pulled group by group, every
//! byte verified against the per-group pattern, every lease ended once; ids checked
//! against their own group by the server.

mod support;

use std::time::Duration;

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{
    AgentConfig, BlockId, BlockLayout, ChildOutcome, EndKind, Error, KvMemory, LeaseRequest, PrefillResult,
    SubmitError,
};
use kvxfer_core::plan::BlockRun;
use kvxfer_mem::pattern;
use kvxfer_proto::v1::ErrorCode;
use support::*;

const TTL: Duration = Duration::from_secs(30);

fn grouped_prefill(t: Transport, layouts: Vec<BlockLayout>) -> PrefillAgent {
    init_tracing();
    let config =
        keyed(t.config(AgentConfig::new("prefill").lease_ttl(TTL).io_timeout(Duration::from_secs(5))));
    let mem = pattern::alloc_filled_groups(layouts).expect("patterned groups");
    PrefillAgent::start(config, "127.0.0.1:0", mem).expect("prefill agent")
}

fn grouped_decode(t: Transport, mut layouts: Vec<BlockLayout>) -> DecodeAgent {
    init_tracing();
    let config = keyed(t.config(AgentConfig::new("decode").io_timeout(Duration::from_secs(5))));
    let first = KvMemory::alloc(layouts.remove(0)).expect("alloc");
    let others = layouts.into_iter().map(|l| KvMemory::alloc(l).expect("alloc")).collect();
    DecodeAgent::start(config, first.with_groups(others)).expect("decode agent")
}

fn group_ok(decode: &DecodeAgent, group: usize, remote: &[BlockId], local: &[BlockId]) -> bool {
    // SAFETY: called only once the pull of these blocks has reported.
    unsafe { pattern::check_group_blocks(decode.memory(), group, remote, local) }
        .expect("in layout")
        .is_none()
}

/// Two children, two groups, shuffled ids, the children sharing their first blocks of
/// each group (a shared prompt): each group's shared blocks cross the wire once and are
/// copied for the sibling within their group.
fn two_groups_pulled_group_by_group(t: Transport) {
    let prefill = grouped_prefill(t, group_layouts(24, 12));
    // The decode side has more blocks (other strides are its own business).
    let decode = grouped_decode(t, group_layouts(40, 20));
    // remote[child][group], local[child][group]
    let remote: Vec<Vec<Vec<BlockId>>> =
        vec![vec![vec![5, 6, 7, 20, 2], vec![3, 4, 11]], vec![vec![5, 6, 9, 1], vec![3, 0]]];
    let local: Vec<Vec<Vec<BlockId>>> =
        vec![vec![vec![30, 31, 32, 0, 17], vec![19, 2, 3]], vec![vec![8, 9, 10, 11], vec![5, 6]]];
    let handoffs: Vec<_> = (0..2u32)
        .map(|i| prefill.lease(LeaseRequest::grouped("G", i, 2, remote[i as usize].clone())).expect("lease"))
        .collect();
    assert_eq!(handoffs[0].num_groups(), 2);
    let result = PrefillResult::new("G", 2, handoffs).expect("result");
    // Through the wire form and vLLM's dict too: the nested lists survive both.
    let result = PrefillResult::from_wire(result.to_wire()).expect("wire");
    for c in result.children() {
        let params = kvxfer::KvTransferParams::from_handoff(c);
        assert_eq!(&params.to_handoff().expect("params"), c);
    }

    let report = decode.submit_groups(result, local.clone()).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    for c in 0..2 {
        for g in 0..2 {
            assert!(group_ok(&decode, g, &remote[c][g], &local[c][g]), "child {c} group {g}");
        }
    }
    let ends = wait_ends(&prefill, 2, Duration::from_secs(10));
    for e in &ends {
        assert_eq!(e.kind, EndKind::Pulled, "{e:?}");
        let c = e.child_index as usize;
        assert_eq!(&*e.blocks, &remote[c][0][..]);
        assert_eq!(&*e.other_groups, &remote[c][1..]);
    }
    // Distinct remote blocks per group cross the wire once: group 0 {5,6,7,20,2,9,1} of
    // 3072 bytes, group 1 {3,4,11,0} of 512.
    let wire = 7 * 3072 + 4 * 512;
    let delivered = (5 + 4) * 3072 + (3 + 2) * 512;
    eventually("served bytes counted", || prefill.stats().server.bytes_served == wire);
    let d = decode.stats();
    assert_eq!((report.wire_bytes, report.delivered_bytes), (wire, delivered));
    assert_eq!((d.bytes_pulled, d.bytes_delivered, d.children_done), (wire, delivered, 2));
    let p = prefill.stats();
    assert_eq!((p.leases.leased, p.leases.pulled, p.leases.live), (2, 2, 0));
    assert_no_more_ends(&prefill, Duration::from_millis(50));
}

/// A decode agent of one group and a prefill agent of two: the handshake refuses them (the
/// compatibility hash covers every group), naming the hash; the lease is still released.
fn one_group_against_two_is_refused(t: Transport) {
    let prefill = grouped_prefill(t, group_layouts(8, 8));
    let decode = grouped_decode(t, group_layouts(8, 8)[..1].to_vec());
    let h = prefill.lease(LeaseRequest::grouped("M", 0, 1, vec![vec![1], vec![2]])).expect("lease");
    let result = PrefillResult::new("M", 1, vec![h]).expect("result");
    // Submitting two groups' hand-offs into a one-group memory is refused before any I/O.
    match decode.submit(result.clone(), vec![vec![1]]) {
        Err(Error::Submit(SubmitError::GroupCount { handoff: 2, local: 1, .. })) => {}
        other => panic!("expected GroupCount, got {other:?}"),
    }
    // And a two-group decode agent with the wrong group sizes is refused by the handshake.
    let other =
        grouped_decode(t, vec![group_layouts(8, 8)[0].clone(), BlockLayout::single(8, 256).expect("l")]);
    let report = other.submit_groups(result, vec![vec![vec![1], vec![2]]]).expect("submit").wait();
    match &report.children[0].outcome {
        ChildOutcome::Failed { error, .. } => {
            let msg = error.to_string();
            assert!(msg.contains("compat"), "{msg}");
        }
        o => panic!("expected a refused handshake, got {o:?}"),
    }
    drop(prefill);
}

/// The server checks a read's ids against the group it names, not the flat id space:
/// block 9 of group 0 (8 blocks) would be group 1's block 1 as a flat id, and that block is
/// leased — still refused, naming group 0's size. A group the layout lacks is refused too.
fn reads_are_checked_against_their_own_group(t: Transport) {
    let layouts = group_layouts(8, 8);
    let prefill = grouped_prefill(t, layouts.clone());
    let h = prefill.lease(LeaseRequest::grouped("B", 0, 1, vec![vec![1], vec![1, 2]])).expect("lease");
    let dest = KvMemory::alloc(group_layouts(16, 16).remove(0)).expect("alloc");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let hello = kvxfer_proto::v1::Hello {
            protocol_version: kvxfer_proto::PROTOCOL_VERSION,
            engine_id: "raw".into(),
            agent_name: "raw-test-client".into(),
            compat_hash: kvxfer_core::groups_compat_hash(&layouts),
            layout: Some(layouts[0].to_wire()),
            other_group_layouts: vec![layouts[1].to_wire()],
            ..Default::default()
        };
        let mut c = raw_connect(&prefill.local_addr().to_string(), &hello).await.expect("connect");
        let tok = h.token().as_bytes();
        let id = h.remote_request_id();
        let run = |start| [BlockRun { remote_start: start, local_start: 0, count: 1 }];
        for (group, start, code, what) in [
            (0u32, 9u32, ErrorCode::BlockOutOfRange, "8 blocks"),
            (2, 1, ErrorCode::BlockOutOfRange, "group 2"),
            (0, 2, ErrorCode::BlockOutOfRange, "not part of its lease"),
        ] {
            // SAFETY: `dest` is this test's own memory, and block 0 is in it.
            let r = unsafe { c.read_group_into(id, tok, group, &run(start), &dest) }.await;
            match r {
                Err(kvxfer_tcp::ClientError::Refused { code: got, message, .. }) => {
                    assert_eq!(got, code, "{message}");
                    assert!(message.contains(what), "group {group} block {start}: {message}");
                }
                other => panic!("group {group} block {start}: expected a refusal, got {other:?}"),
            }
        }
        // The leased block of group 0 reads fine on the same connection.
        // SAFETY: as above.
        let got = unsafe { c.read_group_into(id, tok, 0, &run(1), &dest) }.await.expect("read");
        assert_eq!(got, 3072);
    });
    assert_eq!(prefill.cancel(&h), kvxfer_core::CancelOutcome::Released);
}

per_transport!(two_groups_pulled_group_by_group, one_group_against_two_is_refused);

#[test]
fn tcp_reads_are_checked_against_their_own_group() {
    reads_are_checked_against_their_own_group(Transport::Tcp);
}

// ---- Tensor-parallel sizes and block sizes (head-slice reads, scattered in place) ----

use kvxfer_core::{GroupSpec, KvHeads, KvShape, KvShapeSpec, SegmentSpec, TransferPair};

/// One rank's shape: `heads` KV heads in all, head dim 64, bf16, two segments (K and V)
/// per group, `blocks[g]` blocks in group `g`.
fn spec(tp_size: u32, tp_rank: u32, heads: KvHeads, block_tokens: u32, blocks: &[u32]) -> KvShapeSpec {
    KvShapeSpec {
        tp_size,
        tp_rank,
        heads,
        block_tokens,
        dtype: "bf16".into(),
        dtype_bytes: 2,
        groups: blocks
            .iter()
            .map(|&num_blocks| GroupSpec { num_blocks, segments: vec![SegmentSpec::packed(64); 2] })
            .collect(),
    }
}

/// A prefill rank over its [`pattern::alloc_filled_shape`] cache.
fn shaped_prefill(t: Transport, spec: KvShapeSpec) -> PrefillAgent {
    init_tracing();
    let shape = KvShape::new(spec.clone()).expect("shape");
    // The ranks of one prefill engine share its engine id.
    let config = keyed(
        t.config(
            AgentConfig::new("prefill")
                .engine_id("shaped-prefill")
                .lease_ttl(TTL)
                .io_timeout(Duration::from_secs(5)),
        ),
    )
    .kv_shape(spec);
    PrefillAgent::start(config, "127.0.0.1:0", pattern::alloc_filled_shape(&shape).expect("memory"))
        .expect("prefill agent")
}

/// A decode rank over zeroed memory of its shape.
fn shaped_decode(t: Transport, spec: KvShapeSpec) -> DecodeAgent {
    init_tracing();
    let shape = KvShape::new(spec.clone()).expect("shape");
    let mut layouts: Vec<BlockLayout> =
        (0..shape.num_groups()).map(|g| shape.block_layout(g).expect("group").clone()).collect();
    let first = KvMemory::alloc(layouts.remove(0)).expect("alloc");
    let others = layouts.into_iter().map(|l| KvMemory::alloc(l).expect("alloc")).collect();
    let config = keyed(t.config(AgentConfig::new("decode").io_timeout(Duration::from_secs(5))))
        .rank(spec.tp_rank)
        .kv_shape(spec);
    DecodeAgent::start(config, first.with_groups(others)).expect("decode agent")
}

/// Prefill TP `tp_p` (block tokens `bt_p`) → decode TP `tp_d` (block tokens `bt_d`), `n`
/// children, every group: each prefill rank leases the same blocks for
/// `expected_consumers` decode ranks, every decode rank pulls with all the results, checks
/// its heads of every block against the pattern, and every lease ends pulled exactly once
/// after exactly its expected consumers.
fn tp_pull(t: Transport, p: (u32, u32), d: (u32, u32), heads: KvHeads, groups: usize) {
    tp_pull_with(t, p, d, heads, groups, false);
}

/// Whether every byte of `memory` that none of `plans`' pieces writes is still zero: a pull
/// writes nothing it was not asked for (the unfilled token slots of a last local block at
/// a block ratio above 1, other ranks' heads, blocks of no child).
fn unwritten_bytes_zero(memory: &KvMemory, plans: &[kvxfer_core::xfer::RankPlan]) -> bool {
    for g in 0..memory.num_groups() {
        let mem = memory.group(g).expect("group");
        for (seg, region) in mem.regions().iter().enumerate() {
            let stride = mem.layout().segments()[seg].stride;
            let mut written: Vec<(usize, usize)> = plans
                .iter()
                .flat_map(|p| p.pieces())
                .filter(|p| p.group == g && p.segment == seg)
                .flat_map(|p| {
                    (0..u64::from(p.blocks)).map(move |b| {
                        (((u64::from(p.local_block) + b) * stride + p.local_offset) as usize, p.len as usize)
                    })
                })
                .collect();
            written.sort_unstable();
            // SAFETY: called only once every pull into this memory has reported.
            let bytes = unsafe { region.slice(0, region.len()) };
            let mut at = 0;
            for (offset, len) in written.into_iter().chain(std::iter::once((bytes.len(), 0))) {
                if bytes[at.min(offset)..offset].iter().any(|&b| b != 0) {
                    return false;
                }
                at = at.max(offset + len);
            }
        }
    }
    true
}

/// [`tp_pull`], with `contiguous` remote ids and ascending local ids (runs of several
/// blocks, merged reads and gets) instead of shuffled, gapped ones.
fn tp_pull_with(
    t: Transport,
    (tp_p, bt_p): (u32, u32),
    (tp_d, bt_d): (u32, u32),
    heads: KvHeads,
    groups: usize,
    contiguous: bool,
) {
    let k = bt_d / bt_p;
    let n = 2u32;
    let prefill_blocks = vec![40u32; groups];
    let decode_blocks = vec![24u32; groups];
    let prefills: Vec<PrefillAgent> =
        (0..tp_p).map(|r| shaped_prefill(t, spec(tp_p, r, heads, bt_p, &prefill_blocks))).collect();
    let consumers = kvxfer_core::expected_consumers(tp_p, tp_d).expect("divisible");
    // remote[child][group]: 5 remote blocks (not a multiple of k = 2 or 4: the last local
    // block is partly filled), shuffled; local: ceil(5 / k) blocks.
    let remote: Vec<Vec<Vec<BlockId>>> = (0..n)
        .map(|i| {
            (0..groups as u32)
                .map(|g| {
                    if contiguous {
                        return (0..5).map(|b| 3 + i * 11 + g * 2 + b).collect();
                    }
                    let mut v: Vec<BlockId> = (0..5).map(|b| 3 + i * 11 + g * 2 + b * 2).collect();
                    shuffle(&mut v, u64::from(i * 7 + g + 1));
                    v
                })
                .collect()
        })
        .collect();
    let per_local = 5usize.div_ceil(k as usize) as u32;
    let local: Vec<Vec<Vec<BlockId>>> = (0..n)
        .map(|i| {
            (0..groups as u32)
                .map(|g| {
                    if contiguous {
                        (0..per_local).map(|b| 1 + i * 8 + b).collect()
                    } else {
                        (0..per_local).map(|b| 20 - i * 8 - b - g).collect()
                    }
                })
                .collect()
        })
        .collect();
    let results: Vec<PrefillResult> = prefills
        .iter()
        .map(|p| {
            let handoffs = (0..n)
                .map(|i| {
                    let req =
                        LeaseRequest::grouped("T", i, n, remote[i as usize].clone()).consumers(consumers);
                    p.lease(req).expect("lease")
                })
                .collect();
            PrefillResult::new("T", n, handoffs).expect("result")
        })
        .collect();
    let decodes: Vec<DecodeAgent> =
        (0..tp_d).map(|r| shaped_decode(t, spec(tp_d, r, heads, bt_d, &decode_blocks))).collect();
    let handles: Vec<_> =
        decodes.iter().map(|d| d.submit_ranks(results.clone(), local.clone()).expect("submit")).collect();
    let prefill_shape = KvShape::new(spec(tp_p, 0, heads, bt_p, &prefill_blocks)).expect("shape");
    let mut pulled = 0;
    for (r, (d, h)) in decodes.iter().zip(handles).enumerate() {
        let report = h.wait();
        assert!(report.all_done(), "decode rank {r}: {report:?}");
        let decode_shape = KvShape::new(spec(tp_d, r as u32, heads, bt_d, &decode_blocks)).expect("shape");
        let pair = TransferPair::new(&prefill_shape, &decode_shape).expect("pair");
        assert_eq!(pair.block_ratio(), k);
        for i in 0..n as usize {
            for g in 0..groups {
                // SAFETY: the pull has reported.
                let bad = unsafe {
                    pattern::check_shaped_blocks(d.memory(), &pair, g, &remote[i][g], &local[i][g])
                        .expect("layout")
                };
                assert_eq!(bad, None, "decode rank {r}, child {i}, group {g}");
            }
        }
        let plans: Vec<_> = (0..n as usize)
            .map(|i| {
                let lists: Vec<(&[BlockId], &[BlockId])> =
                    (0..groups).map(|g| (remote[i][g].as_slice(), local[i][g].as_slice())).collect();
                pair.plan(&lists).expect("plan")
            })
            .collect();
        assert!(unwritten_bytes_zero(d.memory(), &plans), "decode rank {r}: bytes written unasked");
        // Every destination byte once: the bytes pulled are the decode rank's heads of
        // every remote block.
        let per_block: u64 = (0..groups)
            .map(|g| decode_shape.segments(g).iter().map(|s| s.head_bytes() / u64::from(k)).sum::<u64>())
            .sum::<u64>()
            / groups as u64;
        let expected =
            u64::from(n) * 5 * groups as u64 * per_block * u64::from(decode_shape.heads_per_rank());
        assert_eq!(report.wire_bytes, expected, "decode rank {r}");
        pulled += expected;
    }
    // Every byte over the data path asked for: one-sided (pinned) reads over UCX.
    let one_sided = if t == Transport::Tcp { 0 } else { pulled };
    eventually("bytes served counted", || {
        let served: u64 = prefills.iter().map(|p| p.stats().server.bytes_served).sum();
        let ucx: u64 = prefills.iter().map(|p| p.stats().server.bytes_served_one_sided).sum();
        (served, ucx) == (pulled, one_sided)
    });
    for (r, p) in prefills.iter().enumerate() {
        let ends = wait_ends(p, n as usize, Duration::from_secs(10));
        for e in &ends {
            assert_eq!(e.kind, EndKind::Pulled, "prefill rank {r}: {e:?}");
            assert_eq!((e.consumers_seen, e.expected_consumers), (consumers, consumers), "prefill rank {r}");
        }
        let s = p.stats();
        assert_eq!((s.leases.leased, s.leases.pulled, s.leases.live), (u64::from(n), u64::from(n), 0));
        assert_no_more_ends(p, Duration::from_millis(50));
    }
}

fn tp1_to_tp2_each_decode_rank_reads_its_head_slice(t: Transport) {
    tp_pull(t, (1, 16), (2, 16), KvHeads::Split { total: 4 }, 1);
}
fn tp2_to_tp1_assembles_blocks_from_both_ranks(t: Transport) {
    tp_pull(t, (2, 16), (1, 16), KvHeads::Split { total: 4 }, 1);
}
fn tp2_to_tp1_with_two_groups(t: Transport) {
    tp_pull(t, (2, 16), (1, 16), KvHeads::Split { total: 4 }, 2);
}
fn tp4_to_tp2_replicated_gqa_heads_read_once_and_the_rest_notified(t: Transport) {
    // 2 KV heads over 4 prefill ranks: each head on two ranks; decode rank d reads its
    // head from one of them and only notifies the other.
    tp_pull(t, (4, 16), (2, 16), KvHeads::Split { total: 2 }, 1);
}
fn mla_tp1_to_tp2(t: Transport) {
    tp_pull(t, (1, 16), (2, 16), KvHeads::Latent, 1);
}
fn block_ratio_2(t: Transport) {
    tp_pull(t, (1, 16), (1, 32), KvHeads::Split { total: 4 }, 1);
}
fn block_ratio_4(t: Transport) {
    tp_pull(t, (1, 16), (1, 64), KvHeads::Split { total: 4 }, 1);
}
fn block_ratio_2_with_tp1_to_tp2_and_two_groups(t: Transport) {
    tp_pull(t, (1, 16), (2, 32), KvHeads::Split { total: 4 }, 2);
}
fn tp2_to_tp1_in_contiguous_runs(t: Transport) {
    tp_pull_with(t, (2, 16), (1, 16), KvHeads::Split { total: 4 }, 2, true);
}
fn block_ratio_4_with_tp1_to_tp2_in_contiguous_runs(t: Transport) {
    tp_pull_with(t, (1, 16), (2, 64), KvHeads::Split { total: 4 }, 1, true);
}

/// The TP and block-ratio pulls once per data path (TCP; UCX over tcp and over shared
/// memory with the `ucx` feature).
mod tp {
    use super::*;
    per_transport!(
        tp1_to_tp2_each_decode_rank_reads_its_head_slice,
        tp2_to_tp1_assembles_blocks_from_both_ranks,
        tp2_to_tp1_with_two_groups,
        tp4_to_tp2_replicated_gqa_heads_read_once_and_the_rest_notified,
        mla_tp1_to_tp2,
        block_ratio_2,
        block_ratio_4,
        block_ratio_2_with_tp1_to_tp2_and_two_groups,
        tp2_to_tp1_in_contiguous_runs,
        block_ratio_4_with_tp1_to_tp2_in_contiguous_runs,
    );
}

/// The handshake refuses what no plan can serve, naming the field: another head dim, TP
/// sizes that do not divide, a smaller decode block. Identical shapes still need equal
/// layouts (the compatibility hash), and pull block for block as before.
#[test]
fn tcp_shapes_no_plan_can_serve_are_refused_naming_the_field() {
    let t = Transport::Tcp;
    let heads = KvHeads::Split { total: 4 };
    let prefill = shaped_prefill(t, spec(2, 0, heads, 16, &[16]));
    let other_head_dim = {
        let mut s = spec(1, 0, heads, 16, &[16]);
        s.groups[0].segments[1].head_dim = 128;
        s
    };
    for (decode_spec, names) in [
        (other_head_dim, "head_dim"),
        (spec(3, 0, KvHeads::Split { total: 6 }, 16, &[16]), "tp_size"),
        (spec(1, 0, KvHeads::Split { total: 8 }, 16, &[16]), "total_kv_heads"),
        (spec(1, 0, KvHeads::Latent, 16, &[16]), "attention"),
        (spec(1, 0, heads, 8, &[16]), "block_tokens"),
    ] {
        let decode = shaped_decode(t, decode_spec);
        let h = prefill.lease(LeaseRequest::new("C", 0, 1, vec![1])).expect("lease");
        let result = PrefillResult::new("C", 1, vec![h.clone()]).expect("result");
        // One prefill rank's result stands for both here (the pull fails at the handshake;
        // TP sizes that do not divide are refused at once, as no lease can be counted).
        let report = match decode.submit_ranks(vec![result.clone(), result], vec![vec![vec![1]]]) {
            Ok(handle) => handle.wait(),
            Err(Error::Submit(SubmitError::Unfit { detail, .. })) if names == "tp_size" => {
                assert!(detail.contains(names), "{detail}");
                let _ = prefill.cancel(&h);
                continue;
            }
            Err(e) => panic!("{names}: {e}"),
        };
        match &report.children[0].outcome {
            ChildOutcome::Failed { error, .. } => {
                let msg = error.to_string();
                assert!(msg.contains(names), "{names}: {msg}");
            }
            o => panic!("{names}: expected a refusal, got {o:?}"),
        }
        let _ = prefill.cancel(&h);
    }
    // The same shape (TP 2 both sides, rank 1 pulling from rank 1's peer: here rank 0's
    // agent stands for it) pulls whole blocks with plain `submit`.
    let same = shaped_decode(t, spec(2, 0, heads, 16, &[16]));
    let h = prefill.lease(LeaseRequest::new("S", 0, 1, vec![3, 4])).expect("lease");
    let report = same
        .submit(PrefillResult::new("S", 1, vec![h]).expect("result"), vec![vec![7, 8]])
        .expect("submit")
        .wait();
    assert!(report.all_done(), "{report:?}");
    // Rank 1 of the same TP holds other heads: plain `submit` refuses it, naming tp_rank.
    let other_rank = shaped_decode(t, spec(2, 1, heads, 16, &[16]));
    let h = prefill.lease(LeaseRequest::new("R", 0, 1, vec![5, 6])).expect("lease");
    let report = other_rank
        .submit(PrefillResult::new("R", 1, vec![h]).expect("result"), vec![vec![7, 8]])
        .expect("submit")
        .wait();
    match &report.children[0].outcome {
        ChildOutcome::Failed { error, .. } => assert!(error.to_string().contains("tp_rank"), "{error}"),
        o => panic!("another rank's heads: expected a refusal, got {o:?}"),
    }
}

/// Every source rank's shape must be rank 0's but for its rank (the plan, and over UCX
/// every rank's strides, come from rank 0's): a rank 1 of other block strides is refused
/// before anything is read, and its lease released.
#[test]
fn tcp_source_ranks_of_different_shapes_are_refused() {
    let heads = KvHeads::Split { total: 4 };
    let strided = {
        let mut s = spec(2, 1, heads, 16, &[16]);
        s.groups[0].segments[1].stride = Some(8192);
        s
    };
    let prefills = [
        shaped_prefill(Transport::Tcp, spec(2, 0, heads, 16, &[16])),
        shaped_prefill(Transport::Tcp, strided),
    ];
    let decode = shaped_decode(Transport::Tcp, spec(1, 0, heads, 16, &[16]));
    let results: Vec<PrefillResult> = prefills
        .iter()
        .map(|p| {
            let h = p.lease(LeaseRequest::new("D", 0, 1, vec![1, 2])).expect("lease");
            PrefillResult::new("D", 1, vec![h]).expect("result")
        })
        .collect();
    let report = decode.submit_ranks(results, vec![vec![vec![3, 4]]]).expect("submit").wait();
    match &report.children[0].outcome {
        ChildOutcome::Failed { error, .. } => {
            assert!(error.to_string().contains("differs from rank 0"), "{error}")
        }
        o => panic!("expected a refusal, got {o:?}"),
    }
    for p in &prefills {
        let ends = wait_ends(p, 1, Duration::from_secs(10));
        assert_eq!(ends[0].kind, EndKind::Released, "{ends:?}");
        assert_eq!(p.stats().server.bytes_served, 0);
    }
}

/// A head slice past the serving rank's heads (or overflowing) is refused before anything
/// is read, and so is one asked of an agent without a shape.
#[test]
fn tcp_head_slices_are_checked_by_the_server() {
    let heads = KvHeads::Split { total: 8 };
    let sp = spec(2, 1, heads, 16, &[8]);
    let shape = KvShape::new(sp.clone()).expect("shape");
    let layout = shape.block_layout(0).expect("layout").clone();
    let prefill = shaped_prefill(Transport::Tcp, sp);
    let plain = grouped_prefill(Transport::Tcp, vec![layout.clone()]);
    let dest = KvMemory::alloc(layout.clone()).expect("alloc");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    for (agent, cases) in [
        (
            &prefill,
            vec![
                ((3u32, 2u32), "outside this rank's 4 heads"),
                ((u32::MAX, 2), "outside"),
                ((1, 0), "outside"),
            ],
        ),
        (&plain, vec![((0, 1), "no KV-cache shape")]),
    ] {
        let h = agent.lease(LeaseRequest::new("H", 0, 1, vec![2])).expect("lease");
        rt.block_on(async {
            let mut c = raw_connect(&agent.local_addr().to_string(), &raw_hello(&layout, "raw"))
                .await
                .expect("connect");
            let ranges = [kvxfer_core::plan::BlockRange { start: 2, count: 1 }];
            for (slice, what) in cases {
                let chunks = [kvxfer_mem::Chunk { region: 0, offset: 0, len: 64 }];
                // SAFETY: `dest` is this test's own memory; the chunk is inside region 0.
                let r = unsafe {
                    c.read_scatter(
                        h.remote_request_id(),
                        h.token().as_bytes(),
                        kvxfer_tcp::SliceSpec { group: 0, head_slice: Some(slice), ranges: &ranges },
                        &dest,
                        &chunks,
                    )
                }
                .await;
                match r {
                    Err(kvxfer_tcp::ClientError::Refused { code, message, .. }) => {
                        assert_eq!(code, ErrorCode::BlockOutOfRange, "{message}");
                        assert!(message.contains(what), "{slice:?}: {message}");
                    }
                    other => panic!("{slice:?}: expected a refusal, got {other:?}"),
                }
            }
            // A bad slice with a wrong token is refused for the token (checked first).
            let chunks = [kvxfer_mem::Chunk { region: 0, offset: 0, len: 64 }];
            // SAFETY: as above.
            let r = unsafe {
                c.read_scatter(
                    h.remote_request_id(),
                    &[0; 16],
                    kvxfer_tcp::SliceSpec { group: 0, head_slice: Some((9, 9)), ranges: &ranges },
                    &dest,
                    &chunks,
                )
            }
            .await;
            match r {
                Err(kvxfer_tcp::ClientError::Refused { code, .. }) => {
                    assert!(matches!(code, ErrorCode::UnknownLease | ErrorCode::BadToken), "{code:?}")
                }
                other => panic!("wrong token: expected a refusal, got {other:?}"),
            }
            // A slice in range reads its heads: 2 heads x 2 segments x 2 KiB.
            if agent.local_addr() == prefill.local_addr() {
                let chunks = [kvxfer_mem::Chunk { region: 0, offset: 0, len: 2 * 2 * 2048 }];
                // SAFETY: as above.
                let got = unsafe {
                    c.read_scatter(
                        h.remote_request_id(),
                        h.token().as_bytes(),
                        kvxfer_tcp::SliceSpec { group: 0, head_slice: Some((2, 2)), ranges: &ranges },
                        &dest,
                        &chunks,
                    )
                }
                .await
                .expect("slice read");
                assert_eq!(got, 8192);
            }
        });
        let served = if agent.local_addr() == prefill.local_addr() { 8192 } else { 0 };
        eventually("served bytes counted", || agent.stats().server.bytes_served == served);
        // Every refusal is counted, head slices' included.
        let refusals = if agent.local_addr() == prefill.local_addr() { 4 } else { 2 };
        assert_eq!(agent.stats().server.reads_refused, refusals);
        let _ = agent.cancel(&h);
    }
}

/// A child cancelled through the handle right after `submit_ranks`: cancelled with its
/// lease released on every source rank, or — when the cancel lost the race to the child's
/// reads — done and pulled; never anything in between. Its sibling is pulled either way.
#[test]
fn tcp_a_cancelled_slice_child_releases_every_source_lease_or_completes() {
    let heads = KvHeads::Split { total: 4 };
    let prefills: Vec<PrefillAgent> =
        (0..2).map(|r| shaped_prefill(Transport::Tcp, spec(2, r, heads, 16, &[32]))).collect();
    let decode = shaped_decode(Transport::Tcp, spec(1, 0, heads, 16, &[32]));
    let results: Vec<PrefillResult> = prefills
        .iter()
        .map(|p| {
            let hs = (0..2)
                .map(|i| p.lease(LeaseRequest::new("X", i, 2, vec![i * 10, i * 10 + 1])).expect("lease"))
                .collect();
            PrefillResult::new("X", 2, hs).expect("result")
        })
        .collect();
    let h = decode.submit_ranks(results, vec![vec![vec![3, 4]], vec![vec![5, 6]]]).expect("submit");
    h.cancel_child(0);
    let report = h.wait();
    let cancelled = match &report.children[0].outcome {
        ChildOutcome::Cancelled { released: true, .. } => true,
        ChildOutcome::Done { acknowledged: true, .. } => false,
        o => panic!("child 0: {o:?}"),
    };
    eprintln!("child 0 {}", if cancelled { "cancelled" } else { "completed before the cancel" });
    assert!(
        matches!(report.children[1].outcome, ChildOutcome::Done { acknowledged: true, .. }),
        "{report:?}"
    );
    for p in &prefills {
        let ends = wait_ends(p, 2, Duration::from_secs(10));
        let want = if cancelled { EndKind::Released } else { EndKind::Pulled };
        assert_eq!((ends[0].kind, ends[1].kind), (want, EndKind::Pulled), "{ends:?}");
        assert_no_more_ends(p, Duration::from_millis(50));
    }
}

/// `submit_ranks` refuses before any I/O what cannot fit: fewer results than the prefill
/// TP size, a local block listed twice, no shape here.
#[test]
fn tcp_submit_ranks_refuses_results_that_do_not_fit() {
    let heads = KvHeads::Split { total: 4 };
    let prefills: Vec<PrefillAgent> =
        (0..2).map(|r| shaped_prefill(Transport::Tcp, spec(2, r, heads, 16, &[32]))).collect();
    let results: Vec<PrefillResult> = prefills
        .iter()
        .map(|p| {
            let h = p.lease(LeaseRequest::new("F", 0, 1, vec![1, 2])).expect("lease");
            PrefillResult::new("F", 1, vec![h]).expect("result")
        })
        .collect();
    let decode = shaped_decode(Transport::Tcp, spec(1, 0, heads, 16, &[32]));
    let unfit = |r: Result<kvxfer::blocking::PullHandle, Error>, what: &str| match r {
        Err(Error::Submit(SubmitError::Unfit { detail, .. })) => assert!(detail.contains(what), "{detail}"),
        Err(other) => panic!("{what}: {other}"),
        Ok(_) => panic!("{what}: accepted"),
    };
    unfit(decode.submit_ranks(results[..1].to_vec(), vec![vec![vec![1, 2]]]), "tp_size 2");
    unfit(decode.submit_ranks(results.clone(), vec![vec![vec![3, 3]]]), "listed twice");
    let plain = grouped_decode(
        Transport::Tcp,
        vec![KvShape::new(spec(1, 0, heads, 16, &[32])).expect("s").block_layout(0).expect("l").clone()],
    );
    unfit(plain.submit_ranks(results.clone(), vec![vec![vec![1, 2]]]), "no KV-cache shape");
    // Nothing was claimed by the refusals: the same blocks pull fine.
    let report = decode.submit_ranks(results, vec![vec![vec![3, 4]]]).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
}

/// `submit_ranks` refuses before any I/O leases counted for the wrong number of decode
/// ranks (prefill TP 1 to decode TP 2 needs 2: with 1, the first decode rank's notify would
/// end the lease under the second), results of different engines, and a result whose
/// children name different agents.
#[test]
fn tcp_submit_ranks_refuses_wrong_consumer_counts_and_mixed_engines() {
    let heads = KvHeads::Split { total: 4 };
    let unfit = |r: Result<kvxfer::blocking::PullHandle, Error>, what: &str| match r {
        Err(Error::Submit(SubmitError::Unfit { detail, .. })) => assert!(detail.contains(what), "{detail}"),
        Err(other) => panic!("{what}: {other}"),
        Ok(_) => panic!("{what}: accepted"),
    };
    let prefill = shaped_prefill(Transport::Tcp, spec(1, 0, heads, 16, &[32]));
    let decode = shaped_decode(Transport::Tcp, spec(2, 0, heads, 16, &[32]));
    for consumers in [1, 3] {
        let id = format!("W{consumers}");
        let h = prefill.lease(LeaseRequest::new(&id, 0, 1, vec![1, 2]).consumers(consumers)).expect("lease");
        let result = PrefillResult::new(&id, 1, vec![h]).expect("result");
        unfit(decode.submit_ranks(vec![result], vec![vec![vec![1, 2]]]), "needs 2");
    }
    // Prefill TP 2 (two ranks of engine "shaped-prefill") and a rank of another engine.
    let ranks: Vec<PrefillAgent> =
        (0..2).map(|r| shaped_prefill(Transport::Tcp, spec(2, r, heads, 16, &[32]))).collect();
    let stranger = PrefillAgent::start(
        keyed(AgentConfig::new("stranger").engine_id("other-engine").kv_shape(spec(2, 1, heads, 16, &[32]))),
        "127.0.0.1:0",
        pattern::alloc_filled_shape(&KvShape::new(spec(2, 1, heads, 16, &[32])).expect("shape"))
            .expect("memory"),
    )
    .expect("prefill");
    let tp1 = shaped_decode(Transport::Tcp, spec(1, 0, heads, 16, &[32]));
    let lease = |p: &PrefillAgent, i: u32| p.lease(LeaseRequest::new("M", i, 2, vec![i + 1])).expect("lease");
    let result = |hs: Vec<kvxfer::ChildHandoff>| PrefillResult::new("M", 2, hs).expect("result");
    let r0 = result(vec![lease(&ranks[0], 0), lease(&ranks[0], 1)]);
    let other = result(vec![lease(&stranger, 0), lease(&stranger, 1)]);
    unfit(tp1.submit_ranks(vec![r0.clone(), other], vec![vec![vec![1]], vec![vec![2]]]), "of engine");
    // Rank 1's children: one from rank 1, one from another agent of the same engine id.
    let twin = shaped_prefill(Transport::Tcp, spec(2, 1, heads, 16, &[32]));
    let mixed = result(vec![lease(&ranks[1], 0), lease(&twin, 1)]);
    unfit(tp1.submit_ranks(vec![r0, mixed], vec![vec![vec![1]], vec![vec![2]]]), "different agents");
}

/// Local lists that cannot fit any block ratio are refused before any I/O; ones that fit
/// another ratio than the prefill rank's fail that decode rank's child as the caller's
/// error ([`PullError::LocalBlocks`]) without releasing the shared lease: the other decode
/// rank of a prefill TP 1 to decode TP 2 pull still reads it.
#[test]
fn tcp_local_lists_that_do_not_fit_fail_only_the_caller() {
    let heads = KvHeads::Split { total: 4 };
    let prefill = shaped_prefill(Transport::Tcp, spec(1, 0, heads, 16, &[32]));
    let decodes: Vec<DecodeAgent> =
        (0..2).map(|r| shaped_decode(Transport::Tcp, spec(2, r, heads, 16, &[32]))).collect();
    let h = prefill.lease(LeaseRequest::new("L", 0, 1, vec![1, 2, 3, 4]).consumers(2)).expect("lease");
    let results = vec![PrefillResult::new("L", 1, vec![h]).expect("result")];
    match decodes[0].submit_ranks(results.clone(), vec![vec![vec![0, 1, 2, 3, 4]]]) {
        Err(Error::Submit(SubmitError::Unfit { detail, .. })) => {
            assert!(detail.contains("5 local"), "{detail}")
        }
        other => panic!("more local than remote blocks: {other:?}"),
    }
    // Block ratio 1: 4 local blocks are needed, 2 (ratio 2's count) are given.
    let report = decodes[0].submit_ranks(results.clone(), vec![vec![vec![5, 6]]]).expect("submit").wait();
    match &report.children[0].outcome {
        ChildOutcome::Failed { error: kvxfer::PullError::LocalBlocks { detail }, .. } => {
            assert!(detail.contains("block ratio 1"), "{detail}")
        }
        o => panic!("expected the caller's error, got {o:?}"),
    }
    let report = decodes[1].submit_ranks(results, vec![vec![vec![5, 6, 7, 8]]]).expect("submit").wait();
    assert!(report.all_done(), "the sibling decode rank: {report:?}");
    // The lease was neither released nor ended: one of its two consumers notified.
    assert_no_more_ends(&prefill, Duration::from_millis(100));
    assert_eq!(prefill.stats().leases.live, 1);
}

/// Hand-offs naming only the engine id, from a prefill engine of TP 2 whose layout differs
/// from the decode rank's: each prefill rank's hand-offs resolve to that rank's registration
/// (not the decode rank's `rank % tp`), and a decode agent with a shape keeps records of
/// other layouts in its directory.
#[cfg(feature = "cluster")]
#[test]
fn tcp_engine_only_handoffs_resolve_each_prefill_rank_through_discovery() {
    use kvxfer::cluster::DiscoveryConfig;
    use kvxfer_cluster::testing::EtcdServer;
    let etcd = EtcdServer::start();
    let discovery = DiscoveryConfig {
        etcd: etcd.config(),
        namespace: "kvxfer-hetero-test".into(),
        registration_ttl: Duration::from_secs(2),
    };
    let heads = KvHeads::Split { total: 4 };
    let prefills: Vec<PrefillAgent> = (0..2)
        .map(|r| {
            let sp = spec(2, r, heads, 16, &[32]);
            let shape = KvShape::new(sp.clone()).expect("shape");
            let config =
                keyed(AgentConfig::new("prefill").engine_id("hetero-engine").discovery(discovery.clone()))
                    .kv_shape(sp);
            let p = PrefillAgent::start(
                config,
                "127.0.0.1:0",
                pattern::alloc_filled_shape(&shape).expect("memory"),
            )
            .expect("prefill");
            p.wait_registered(Duration::from_secs(15)).expect("registered");
            p
        })
        .collect();
    let dsp = spec(1, 0, heads, 16, &[32]);
    let dshape = KvShape::new(dsp.clone()).expect("shape");
    let decode = DecodeAgent::start(
        keyed(AgentConfig::new("decode").discovery(discovery)).kv_shape(dsp),
        KvMemory::alloc(dshape.block_layout(0).expect("layout").clone()).expect("memory"),
    )
    .expect("decode");
    let dir = decode.directory().expect("a directory").clone();
    eventually("both prefill ranks in the directory", || {
        (0..2).all(|r| dir.resolve("hetero-engine", r).is_some())
    });
    let remote = vec![4, 5, 6];
    let results: Vec<PrefillResult> = prefills
        .iter()
        .map(|p| {
            let h = p.lease(LeaseRequest::new("D", 0, 1, remote.clone())).expect("lease");
            PrefillResult::new("D", 1, vec![h]).expect("result").engine_only()
        })
        .collect();
    let report = decode.submit_ranks(results, vec![vec![vec![7, 8, 9]]]).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    let pair = TransferPair::new(&KvShape::new(spec(2, 0, heads, 16, &[32])).expect("shape"), &dshape)
        .expect("pair");
    // SAFETY: the pull has reported.
    let bad = unsafe { pattern::check_shaped_blocks(decode.memory(), &pair, 0, &remote, &[7, 8, 9]) }
        .expect("layout");
    assert_eq!(bad, None);
    for p in &prefills {
        let ends = wait_ends(p, 1, Duration::from_secs(10));
        assert_eq!(ends[0].kind, EndKind::Pulled, "{ends:?}");
    }
}
