//! Heterogeneous layouts through the engine, on 127.0.0.1: caches of several KV-cache
//! groups (each its own segments, block size and block ids) pulled group by group, every
//! byte verified against the per-group pattern, every lease ended once; ids checked
//! against their own group by the server.

mod support;

use std::time::Duration;

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{
    AgentConfig, BlockId, BlockLayout, ChildOutcome, EndKind, Error, KvMemory, LeaseRequest, PrefillResult,
    Segment, SubmitError,
};
use kvxfer_core::plan::BlockRun;
use kvxfer_mem::pattern;
use kvxfer_proto::v1::ErrorCode;
use support::*;

const TTL: Duration = Duration::from_secs(30);

/// Group 0: full attention, two segments (one strided), 24 blocks here; group 1: sliding
/// window, one smaller segment, `g1_blocks` blocks. Block sizes differ between the groups,
/// so a block read from or into the wrong group is caught by length as well as bytes.
fn group_layouts(g0_blocks: u32, g1_blocks: u32) -> Vec<BlockLayout> {
    vec![
        BlockLayout::new(
            g0_blocks,
            vec![Segment::packed(2048), Segment { block_len: 1024, stride: 1536 }],
            "bf16",
            16,
        )
        .expect("group 0"),
        BlockLayout::new(g1_blocks, vec![Segment::packed(512)], "bf16", 16).expect("group 1"),
    ]
}

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
