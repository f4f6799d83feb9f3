//! `AgentConfig::notify_with_read` against a real prefill agent, many hand-offs over the same
//! pooled connections: the prefill side sees each notify waiting behind its read and sends
//! the end of the payload together with the notify's answer. Every child is still reported
//! exactly once, every lease ends exactly once (pulled when read, released when its read was
//! refused), and every byte is right.

mod support;

use std::time::Duration;

use kvxfer::{AgentConfig, BlockLayout, ChildOutcome, EndKind, PullError};
use support::*;

const TTL: Duration = Duration::from_secs(30);

fn decode_notifying_with_reads() -> kvxfer::blocking::DecodeAgent {
    let config = AgentConfig::new("decode")
        .transport(kvxfer::TransportChoice::Tcp)
        .io_timeout(Duration::from_secs(5))
        .notify_with_read(true);
    decode_with(config, BlockLayout::single(64, BLOCK).expect("layout"))
}

/// Parents of three children (0 and 1 share remote block 1: one read, then a copy, notified
/// on the control connection; 2 stands alone and notifies with its read), one after another,
/// then lone one-block children (the one-block hand-off).
#[test]
fn every_child_is_reported_once_and_every_lease_ends_once() {
    let prefill = prefill(64, TTL);
    let decode = decode_notifying_with_reads();
    let parents = 10;
    for p in 0..parents {
        let remote = vec![vec![1, 2], vec![1, 3], vec![9, 10]];
        let result = prefill.lease_parent(&format!("P{p}"), remote, 1, None).expect("lease");
        let report =
            decode.submit(result, vec![vec![20, 21], vec![22, 23], vec![24, 25]]).expect("submit").wait();
        assert_eq!(report.children.len(), 3, "{report:?}");
        for (i, c) in report.children.iter().enumerate() {
            assert_eq!(c.child_index, i as u32, "one report per child: {report:?}");
            assert!(matches!(c.outcome, ChildOutcome::Done { acknowledged: true, .. }), "{report:?}");
        }
        assert!(verify(&decode, &[1, 2, 1, 3, 9, 10], &[20, 21, 22, 23, 24, 25]), "parent {p}");
    }
    let lone = 20;
    for k in 0..lone {
        let block = 30 + k % 4;
        let result = prefill.lease_parent(&format!("L{k}"), vec![vec![block]], 1, None).expect("lease");
        let report = decode.submit(result, vec![vec![40]]).expect("submit").wait();
        assert!(report.all_done(), "{report:?}");
        assert!(verify(&decode, &[block], &[40]), "lone child {k}");
    }
    let leases = 3 * parents + lone;
    let ends = wait_ends(&prefill, leases as usize, Duration::from_secs(10));
    assert!(ends.iter().all(|e| e.kind == EndKind::Pulled), "{ends:?}");
    assert_no_more_ends(&prefill, Duration::from_millis(200));
    assert_eq!(prefill.stats().leases.pulled, u64::from(leases));
    assert_eq!(decode.stats().control_retries, 0, "no notify was sent twice");
    // Children 0 and 1 share block 1 (a copy settles one of them): of each parent only
    // child 2's notify rides behind its read, and every lone child's does.
    assert_eq!(decode.stats().notifies_with_read, u64::from(parents + lone));
}

/// A read the prefill side refuses (blocks outside the lease), beside a sibling read that
/// is served: the refused child fails once and its lease is released once (the notify behind
/// it is not counted); the sibling is pulled.
#[test]
fn a_refused_read_beside_a_served_one_ends_each_lease_once() {
    let prefill = prefill(64, TTL);
    let decode = decode_notifying_with_reads();
    let mut wire = prefill.lease_parent("W", vec![vec![1, 2], vec![3]], 1, None).expect("lease").to_wire();
    wire.children[0].remote_block_ids = vec![1, 9];
    let report = decode.submit_wire(wire, vec![vec![5, 6], vec![7]]).expect("submit").wait();
    assert_eq!(report.children.len(), 2, "{report:?}");
    assert!(
        matches!(&report.children[0].outcome, ChildOutcome::Failed { error: PullError::Refused { .. }, .. }),
        "{report:?}"
    );
    assert!(
        matches!(report.children[1].outcome, ChildOutcome::Done { acknowledged: true, .. }),
        "{report:?}"
    );
    assert!(verify(&decode, &[3], &[7]));
    let ends = wait_ends(&prefill, 2, Duration::from_secs(10));
    assert_eq!((ends[0].kind, ends[1].kind), (EndKind::Released, EndKind::Pulled), "{ends:?}");
    assert_no_more_ends(&prefill, Duration::from_millis(200));
}
