//! Regression tests of the hardening review (issue 10, part A): ranges that name no
//! blocks, the ended-lease record, idempotent endings, retraction, bounded fan-out and the
//! maximum lease lifetime. Each one failed before its fix.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::plan::BlockRange;
use kvxfer_core::{
    CancelOutcome, EndKind, EngineInfo, HeartbeatOutcome, LeaseConfig, LeaseError, LeaseRequest, LeaseTable,
    NotifyOutcome, ReadRefused, RetractOutcome,
};

fn engine() -> EngineInfo {
    EngineInfo {
        engine_id: "prefill-0".into(),
        host: "127.0.0.1".into(),
        port: 5559,
        tp_size: 1,
        incarnation: 0,
    }
}

fn table_with(config: impl FnOnce(&mut LeaseConfig)) -> Arc<LeaseTable> {
    let mut c = LeaseConfig::new(engine(), 64);
    config(&mut c);
    Arc::new(LeaseTable::new(c, [9; 32]))
}

/// Bug 1: a zero-count range skipped every check, so a range starting far outside the
/// layout reached the memory layer (which then panicked the connection task).
#[test]
fn ranges_naming_no_blocks_or_starting_outside_the_layout_are_refused() {
    let t = table_with(|_| {});
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1, 2]), t0).expect("lease");
    let tok = h.token().as_bytes();
    let r =
        |v: &[(u32, u32)]| v.iter().map(|&(start, count)| BlockRange { start, count }).collect::<Vec<_>>();
    for ranges in
        [r(&[(1, 1), (1000, 0)]), r(&[(1, 1), (2, 0)]), r(&[(1000, 0), (1, 2)]), r(&[(u32::MAX, 0), (1, 1)])]
    {
        let refused = t.begin_read("R", tok, &ranges, t0).expect_err("a range naming no blocks is refused");
        assert!(
            matches!(refused, ReadRefused::OutOfRange { .. } | ReadRefused::EmptyRange { .. }),
            "{ranges:?}: {refused:?}"
        );
    }
    // The lease itself is untouched: a well-formed read still works.
    drop(t.begin_read("R", tok, &r(&[(1, 2)]), t0).expect("read"));
}

/// A stale `recent_order` entry left by a re-leased id used to evict the newer tombstone of
/// that id, so a late read of its second lease was told "unknown" instead of "ended".
#[test]
fn a_stale_order_entry_of_a_re_leased_id_does_not_evict_its_newer_tombstone() {
    let t = table_with(|c| c.shards = 1);
    let t0 = Instant::now();
    let first = t.lease(LeaseRequest::new("X", 0, 1, vec![1]), t0).expect("lease");
    t.cancel("X", first.token().as_bytes(), t0);
    let second = t.lease(LeaseRequest::new("X", 0, 1, vec![2]), t0).expect("re-lease");
    t.cancel("X", second.token().as_bytes(), t0);
    // 255 more ended leases: the record holds 256 per shard, so the oldest entry (the
    // first lease of X) is evicted, and the second one must stay.
    for i in 0..255 {
        let h = t.lease(LeaseRequest::new(format!("F{i}"), 0, 1, vec![3]), t0).expect("lease");
        t.cancel(h.remote_request_id(), h.token().as_bytes(), t0);
    }
    let read = [BlockRange { start: 2, count: 1 }];
    assert_eq!(
        t.begin_read("X", second.token().as_bytes(), &read, t0).err(),
        Some(ReadRefused::Ended("X".into()))
    );
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Endings survive a lost reply: a retried notify, heartbeat or cancel with the lease's token
/// is answered from the ended-lease record, changes nothing, and is counted.
#[test]
fn retried_requests_of_an_ended_lease_are_answered_from_its_record() {
    let t = table_with(|_| {});
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]).consumers(2), t0).expect("lease");
    let tok = h.token().as_bytes();
    assert_eq!(t.notify("R", tok, "rank0", t0), NotifyOutcome::Counted { remaining: 1 });
    assert_eq!(t.notify("R", tok, "rank1", t0), NotifyOutcome::Pulled);
    assert_eq!(t.ended().try_iter().count(), 1);
    let pulled = |counted| NotifyOutcome::AlreadyEnded { kind: EndKind::Pulled, counted };
    assert_eq!(t.notify("R", tok, "rank1", t0), pulled(true));
    assert_eq!(t.notify("R", tok, "rank0", t0), pulled(true));
    assert_eq!(t.notify("R", tok, "rank7", t0), pulled(false));
    assert_eq!(t.heartbeat("R", tok, t0), HeartbeatOutcome::AlreadyEnded(EndKind::Pulled));
    assert_eq!(t.cancel("R", tok, t0), CancelOutcome::AlreadyEnded(EndKind::Pulled));
    assert_eq!(
        t.begin_read("R", tok, &[BlockRange { start: 1, count: 1 }], t0).err(),
        Some(ReadRefused::Ended("R".into()))
    );
    assert_eq!(t.ended().try_iter().count(), 0, "nothing ends twice");
    let s = t.stats();
    assert_eq!((s.pulled, s.already_ended, s.unrecognized, s.bad_token), (1, 5, 0, 0));
}

/// Without the token an ended lease looks like a live one with a wrong token: "ended" is
/// said only to a holder of the token (the record keeps its SHA-256, never the token).
#[test]
fn without_the_token_an_ended_lease_is_never_reported_as_ended() {
    let t = table_with(|_| {});
    let t0 = Instant::now();
    let live = t.lease(LeaseRequest::new("L", 0, 1, vec![1]), t0).expect("lease");
    let ended = t.lease(LeaseRequest::new("E", 0, 1, vec![2]), t0).expect("lease");
    t.cancel("E", ended.token().as_bytes(), t0);
    // A lease that ended while a read was in flight (draining) too.
    let draining = t.lease(LeaseRequest::new("D", 0, 1, vec![3]), t0).expect("lease");
    let guard = t
        .begin_read("D", draining.token().as_bytes(), &[BlockRange { start: 3, count: 1 }], t0)
        .expect("read");
    t.cancel("D", draining.token().as_bytes(), t0);
    let wrong = [0x5a; 16];
    let read = [BlockRange { start: 1, count: 1 }];
    for id in ["L", "E", "D"] {
        assert_eq!(t.begin_read(id, &wrong, &read, t0).err(), Some(ReadRefused::BadToken(id.into())), "{id}");
        assert_eq!(t.notify(id, &wrong, "c", t0), NotifyOutcome::BadToken, "{id}");
        assert_eq!(t.heartbeat(id, &wrong, t0), HeartbeatOutcome::BadToken, "{id}");
        assert_eq!(t.cancel(id, &wrong, t0), CancelOutcome::BadToken, "{id}");
    }
    assert_eq!(
        t.begin_read("D", draining.token().as_bytes(), &read, t0).err(),
        Some(ReadRefused::Ended("D".into()))
    );
    drop(guard);
    let s = t.stats();
    assert_eq!((s.live, s.bad_token, s.already_ended), (1, 12, 0));
    let _ = live;
}

/// The exact contract of `retract`: a never-published lease goes away with no end and no
/// record, counted so the books balance; anything else is left to end as usual.
#[test]
fn retract_removes_a_never_published_lease_without_an_end() {
    let t = table_with(|_| {});
    let t0 = Instant::now();
    let a = t.lease(LeaseRequest::new("A", 0, 1, vec![1]).ttl(ms(10)), t0).expect("lease");
    assert_eq!(t.retract("A", &[0; 16]), RetractOutcome::BadToken);
    assert_eq!(t.retract("nope", a.token().as_bytes()), RetractOutcome::Unrecognized);
    // Past its deadline but not yet expired by the driver: still retracted.
    assert_eq!(t.retract("A", a.token().as_bytes()), RetractOutcome::Retracted);
    assert_eq!(t.retract("A", a.token().as_bytes()), RetractOutcome::Unrecognized);
    assert_eq!(t.expire(t0 + ms(1000)), 0);
    assert_eq!(t.ended().try_iter().count(), 0);
    // No record: the id is unknown, and may be leased again at once.
    assert_eq!(t.notify("A", a.token().as_bytes(), "c", t0), NotifyOutcome::Unrecognized);
    t.lease(LeaseRequest::new("A", 0, 1, vec![1]), t0).expect("leased again");
    // Already ended: left alone, its end delivered once as usual.
    let b = t.lease(LeaseRequest::new("B", 0, 1, vec![2]).ttl(ms(10)), t0).expect("lease");
    assert_eq!(t.expire(t0 + ms(10)), 1);
    assert_eq!(t.retract("B", b.token().as_bytes()), RetractOutcome::AlreadyEnded(EndKind::Expired));
    // A read in flight means the token escaped: released instead, ending after the read.
    let c = t.lease(LeaseRequest::new("C", 0, 1, vec![3]), t0).expect("lease");
    let g = t.begin_read("C", c.token().as_bytes(), &[BlockRange { start: 3, count: 1 }], t0).expect("read");
    assert_eq!(t.retract("C", c.token().as_bytes()), RetractOutcome::Released);
    drop(g);
    let ends: Vec<_> = t.ended().try_iter().map(|e| (e.remote_request_id.to_string(), e.kind)).collect();
    assert_eq!(ends, vec![("B".into(), EndKind::Expired), ("C".into(), EndKind::Released)]);
    let s = t.stats();
    assert_eq!((s.leased, s.retracted, s.expired, s.released, s.live), (4, 1, 1, 1, 1));
    assert_eq!(s.leased, s.pulled + s.released + s.expired + s.retracted + s.live);
}

#[test]
fn n_is_bounded_by_max_children() {
    let t = table_with(|c| c.max_children = 8);
    let t0 = Instant::now();
    t.lease(LeaseRequest::new("P", 7, 8, vec![1]), t0).expect("n = max is fine");
    let e = t.lease(LeaseRequest::new("Q", 0, 9, vec![1]), t0).expect_err("n above max");
    assert_eq!(e, LeaseError::TooManyChildren { request: "0_Q".into(), n: 9, max: 8 });
    assert!(e.to_string().contains("max_children"), "{e}");
    let t = table_with(|_| {});
    assert!(matches!(
        t.lease(LeaseRequest::new("Q", 0, u32::MAX, vec![1]), t0),
        Err(LeaseError::TooManyChildren { max: 1024, .. })
    ));
}

/// Heartbeats extend a lease, but never past `max_lifetime` after it was made; a ttl above
/// it is clamped (and the hand-off says so).
#[test]
fn heartbeats_cannot_extend_a_lease_past_its_maximum_lifetime() {
    let t = table_with(|c| c.max_lifetime = ms(1000));
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]).ttl(ms(300)), t0).expect("lease");
    let tok = h.token().as_bytes();
    let mut now = t0;
    while now < t0 + ms(900) {
        now += ms(100);
        assert!(matches!(t.heartbeat("R", tok, now), HeartbeatOutcome::Extended { .. }));
    }
    assert_eq!(t.heartbeat("R", tok, now), HeartbeatOutcome::Extended { deadline: t0 + ms(1000) });
    assert_eq!(t.expire(t0 + ms(999)), 0);
    assert_eq!(t.expire(t0 + ms(1000)), 1);
    let long =
        t.lease(LeaseRequest::new("S", 0, 1, vec![1]).ttl(Duration::from_secs(3600)), t0).expect("lease");
    assert_eq!(long.ttl(), ms(1000));
    assert_eq!(t.poll_timeout(), Some(t0 + ms(1000)));
}
