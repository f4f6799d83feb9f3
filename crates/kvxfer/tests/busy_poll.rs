//! `AgentConfig::busy_poll`: a decode agent that polls its sockets for an answer before
//! parking still reports every child exactly once and ends every lease exactly once (pulled
//! when read, released when its read failed), with and without the notify sent with the
//! read. (An answer slower than the poll — a read waiting for its lease to be armed — is in
//! `arm.rs`.)

mod support;

use std::time::Duration;

use kvxfer::{AgentConfig, BlockLayout, ChildOutcome, EndKind, PullError, MAX_BUSY_POLL};
use support::*;

const TTL: Duration = Duration::from_secs(30);

fn layout() -> BlockLayout {
    BlockLayout::single(64, BLOCK).expect("layout")
}

fn polling_decode(notify_with_read: bool) -> kvxfer::blocking::DecodeAgent {
    let config = AgentConfig::new("decode")
        .transport(kvxfer::TransportChoice::Tcp)
        .io_timeout(Duration::from_secs(5))
        .notify_with_read(notify_with_read)
        .busy_poll(MAX_BUSY_POLL);
    decode_with(config, layout())
}

#[test]
fn busy_poll_is_capped() {
    let c = AgentConfig::new("decode").busy_poll(Duration::from_secs(1));
    assert_eq!(c.busy_poll, MAX_BUSY_POLL);
    assert_eq!(AgentConfig::new("decode").busy_poll, Duration::ZERO, "off by default");
}

/// Parents of three children (0 and 1 share remote block 1: one read, then a copy; 2 stands
/// alone), pulled one after another over the same pooled, polled connections.
#[test]
fn polled_pulls_report_every_child_once_and_end_every_lease_once() {
    for notify_with_read in [true, false] {
        let prefill = prefill(64, TTL);
        let decode = polling_decode(notify_with_read);
        let parents = 12;
        for p in 0..parents {
            let parent = format!("P{p}");
            let remote = [vec![1, 2], vec![1, 3], vec![9, 10]];
            let result = prefill.lease_parent(&parent, remote.to_vec(), 1, None).expect("lease");
            let local = vec![vec![20, 21], vec![22, 23], vec![24, 25]];
            let report = decode.submit(result, local).expect("submit").wait();
            assert_eq!(report.children.len(), 3, "{report:?}");
            for (i, c) in report.children.iter().enumerate() {
                assert_eq!(c.child_index, i as u32, "one report per child: {report:?}");
                assert!(matches!(c.outcome, ChildOutcome::Done { acknowledged: true, .. }), "{report:?}");
            }
            assert!(verify(&decode, &[1, 2, 1, 3, 9, 10], &[20, 21, 22, 23, 24, 25]), "parent {p}");
        }
        let ends = wait_ends(&prefill, 3 * parents, Duration::from_secs(10));
        assert!(ends.iter().all(|e| e.kind == EndKind::Pulled), "{ends:?}");
        assert_no_more_ends(&prefill, Duration::from_millis(200));
        let stats = prefill.stats();
        assert_eq!(stats.leases.pulled, 3 * parents as u64, "{stats:?}");
        assert_eq!(decode.stats().control_retries, 0, "no notify was sent twice");
    }
}

/// A read the prefill side refuses (blocks outside the lease) while the decode side polls:
/// the child fails once, and its lease is released once (the notify behind the read, when
/// sent with it, is not counted).
#[test]
fn a_polled_read_refused_fails_its_child_and_releases_its_lease_once() {
    for notify_with_read in [true, false] {
        let prefill = prefill(64, TTL);
        let decode = polling_decode(notify_with_read);
        let mut wire = prefill.lease_parent("W", vec![vec![1, 2], vec![3]], 1, None).expect("lease").to_wire();
        wire.children[0].remote_block_ids = vec![1, 9];
        let report = decode.submit_wire(wire, vec![vec![5, 6], vec![7]]).expect("submit").wait();
        assert_eq!(report.children.len(), 2, "{report:?}");
        match &report.children[0].outcome {
            ChildOutcome::Failed { error: PullError::Refused { .. }, .. } => {}
            other => panic!("child 0: {other:?}"),
        }
        assert!(matches!(report.children[1].outcome, ChildOutcome::Done { acknowledged: true, .. }));
        let ends = wait_ends(&prefill, 2, Duration::from_secs(10));
        assert_eq!((ends[0].kind, ends[1].kind), (EndKind::Released, EndKind::Pulled), "{ends:?}");
        assert_no_more_ends(&prefill, Duration::from_millis(200));
    }
}
