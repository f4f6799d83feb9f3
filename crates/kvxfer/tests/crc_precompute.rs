//! The CRC-32C precompute (`AgentConfig::precompute_crcs`) end to end over TCP on
//! 127.0.0.1: leases made by `lease`, `lease_parent` and per KV-cache group have their
//! blocks' CRCs computed at lease time, reads combine them (every byte still verified, the
//! decode side's check passing), reads racing the precompute fall back to checksumming
//! what is not stored yet, and a `lease_parent` that fails still retracts its leases.

mod support;

use std::time::Duration;

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{
    AgentConfig, BlockId, BlockLayout, EndKind, Error, KvMemory, LeaseRequest, PrefillResult, Segment,
};
use kvxfer_mem::pattern;
use support::*;

const TTL: Duration = Duration::from_secs(30);

fn config(name: &str) -> AgentConfig {
    Transport::Tcp.config(AgentConfig::new(name).lease_ttl(TTL).io_timeout(Duration::from_secs(5)))
}

fn grouped_prefill(layouts: Vec<BlockLayout>) -> PrefillAgent {
    init_tracing();
    let mem = pattern::alloc_filled_groups(layouts).expect("patterned groups");
    PrefillAgent::start(keyed(config("prefill").precompute_crcs(true)), "127.0.0.1:0", mem).expect("prefill")
}

fn grouped_decode(mut layouts: Vec<BlockLayout>) -> DecodeAgent {
    init_tracing();
    let first = KvMemory::alloc(layouts.remove(0)).expect("alloc");
    let others = layouts.into_iter().map(|l| KvMemory::alloc(l).expect("alloc")).collect();
    DecodeAgent::start(keyed(config("decode")), first.with_groups(others)).expect("decode agent")
}

/// Two children over two KV-cache groups, leased one by one, pulled once their CRCs were
/// computed: the whole payload's CRC comes from the stored values, and every byte of every
/// group arrives as it was.
#[test]
fn pulls_of_two_groups_with_precomputed_crcs_verify_byte_for_byte() {
    let prefill = grouped_prefill(group_layouts(24, 12));
    let decode = grouped_decode(group_layouts(40, 20));
    let remote: Vec<Vec<Vec<BlockId>>> =
        vec![vec![vec![5, 6, 7, 20, 2], vec![3, 4, 11]], vec![vec![8, 9, 1], vec![0]]];
    let local: Vec<Vec<Vec<BlockId>>> =
        vec![vec![vec![30, 31, 32, 0, 17], vec![19, 2, 3]], vec![vec![8, 9, 10], vec![5]]];
    let handoffs: Vec<_> = (0..2u32)
        .map(|i| prefill.lease(LeaseRequest::grouped("G", i, 2, remote[i as usize].clone())).expect("lease"))
        .collect();
    // Group 0 blocks 2048 + 1024 bytes, group 1 blocks 512.
    let leased = 8 * 3072 + 4 * 512;
    eventually("the leases' CRCs computed", || prefill.stats().server.crc_bytes_at_lease == leased);
    let result = PrefillResult::new("G", 2, handoffs).expect("result");
    let report = decode.submit_groups(result, local.clone()).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    for c in 0..2 {
        for g in 0..2 {
            // SAFETY: the pull of these blocks has reported.
            let bad = unsafe { pattern::check_group_blocks(decode.memory(), g, &remote[c][g], &local[c][g]) };
            assert!(bad.expect("in layout").is_none(), "child {c} group {g}");
        }
    }
    let ends = wait_ends(&prefill, 2, Duration::from_secs(10));
    assert!(ends.iter().all(|e| e.kind == EndKind::Pulled), "{ends:?}");
    let s = prefill.stats().server;
    assert_eq!((s.bytes_served_tcp, s.crc_bytes_precomputed), (leased, leased));
    assert_eq!(decode.stats().integrity_failures, 0);
    assert_eq!(prefill.stats().leases.draining, 0);
}

/// `lease_parent` (whose precomputes start once all its children are leased), pulled again
/// and again right after leasing: reads that come before the precompute reached their
/// blocks checksum those while sending. Whatever the interleaving, every pull verifies and
/// every lease ends pulled (the precompute's hold on the blocks never outlives it).
#[test]
fn pulls_racing_the_precompute_fall_back_and_verify() {
    init_tracing();
    let layout = BlockLayout::new(
        64,
        vec![Segment::packed(BLOCK), Segment { block_len: 1024, stride: 3000 }],
        "u8",
        16,
    )
    .expect("layout");
    let prefill = prefill_with(config("prefill").precompute_crcs(true), layout.clone());
    let decode = decode_with(config("decode"), layout);
    let per_block = BLOCK + 1024;
    let rounds = 8u32;
    for round in 0..rounds {
        let remote: Vec<Vec<BlockId>> = vec![(0..24).collect(), (40..64).rev().collect()];
        let local: Vec<Vec<BlockId>> = vec![(24..48).collect(), (0..24).collect()];
        let result = prefill.lease_parent(&format!("R{round}"), remote.clone(), 1, None).expect("lease");
        let report = decode.submit(result, local.clone()).expect("submit").wait();
        assert!(report.all_done(), "round {round}: {report:?}");
        for (r, l) in remote.iter().zip(&local) {
            assert!(verify(&decode, r, l), "round {round}");
        }
        let ends = wait_ends(&prefill, 2, Duration::from_secs(10));
        assert!(ends.iter().all(|e| e.kind == EndKind::Pulled), "{ends:?}");
    }
    let s = prefill.stats();
    assert_eq!(s.server.bytes_served_tcp, u64::from(rounds) * 48 * per_block);
    assert!(s.server.crc_bytes_precomputed <= s.server.bytes_served_tcp, "{:?}", s.server);
    assert_eq!((s.leases.pulled, s.leases.draining), (u64::from(2 * rounds), 0));
    assert_eq!(decode.stats().integrity_failures, 0);
}

/// A `lease_parent` whose second child cannot be leased retracts the first as without the
/// precompute (a lease held by its precompute could not be retracted, only released): no
/// end is delivered for it.
#[test]
fn a_failed_lease_parent_still_retracts_its_leases() {
    let prefill =
        prefill_with(config("prefill").precompute_crcs(true), BlockLayout::single(8, BLOCK).expect("layout"));
    let taken = prefill.lease(LeaseRequest::new("X", 1, 2, vec![5])).expect("lease");
    let err = prefill.lease_parent("X", vec![vec![0, 1], vec![2]], 1, None).expect_err("child 1 is leased");
    assert!(matches!(err, Error::Core(_)), "{err:?}");
    assert_eq!(prefill.stats().leases.retracted, 1);
    assert_no_more_ends(&prefill, Duration::from_millis(100));
    prefill.cancel(&taken);
    let ends = wait_ends(&prefill, 1, Duration::from_secs(10));
    assert_eq!(ends[0].child_index, 1);
}
