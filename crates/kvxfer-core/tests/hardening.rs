//! Regression tests of the hardening review (issue 10, part A): ranges that name no
//! blocks, the ended-lease record, idempotent endings, retraction, bounded fan-out and the
//! maximum lease lifetime. Each one failed before its fix.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::plan::BlockRange;
use kvxfer_core::{
    CancelOutcome, ChildState, EndKind, EngineInfo, HeartbeatOutcome, LeaseConfig, LeaseError, LeaseRequest,
    LeaseTable, NotifyOutcome, ParentTracker, ReadRefused, RetractOutcome,
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
    assert_eq!(t.retract("A", &[0; 16], t0), RetractOutcome::BadToken);
    assert_eq!(t.retract("nope", a.token().as_bytes(), t0), RetractOutcome::Unrecognized);
    // Past its deadline but not yet expired by the driver: still retracted.
    assert_eq!(t.retract("A", a.token().as_bytes(), t0), RetractOutcome::Retracted);
    assert_eq!(t.retract("A", a.token().as_bytes(), t0), RetractOutcome::Unrecognized);
    assert_eq!(t.expire(t0 + ms(1000)), 0);
    assert_eq!(t.ended().try_iter().count(), 0);
    // No record: the id is unknown, and may be leased again at once.
    assert_eq!(t.notify("A", a.token().as_bytes(), "c", t0), NotifyOutcome::Unrecognized);
    t.lease(LeaseRequest::new("A", 0, 1, vec![1]), t0).expect("leased again");
    // Already ended: left alone, its end delivered once as usual.
    let b = t.lease(LeaseRequest::new("B", 0, 1, vec![2]).ttl(ms(10)), t0).expect("lease");
    assert_eq!(t.expire(t0 + ms(10)), 1);
    assert_eq!(t.retract("B", b.token().as_bytes(), t0), RetractOutcome::AlreadyEnded(EndKind::Expired));
    // A read in flight means the token escaped: released instead, ending after the read.
    let c = t.lease(LeaseRequest::new("C", 0, 1, vec![3]), t0).expect("lease");
    let g = t.begin_read("C", c.token().as_bytes(), &[BlockRange { start: 3, count: 1 }], t0).expect("read");
    assert_eq!(t.retract("C", c.token().as_bytes(), t0), RetractOutcome::Released);
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

// ---- Part B (review of the hardening, findings 5, 6, 11) ----

/// Review finding 5: ended-lease records were bounded by count only (256 per shard), so
/// under load a notify retried a few seconds after its lost reply found no record. Now a
/// record lives at least its retention unless the table-wide hard cap is reached.
#[test]
fn a_retried_notify_finds_its_record_after_a_burst_of_other_endings() {
    let t = table_with(|_| {});
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]), t0).expect("lease");
    assert_eq!(t.notify("R", h.token().as_bytes(), "c", t0), NotifyOutcome::Pulled);
    // 20 000 other leases end within the next second (20 000 ends/s).
    for i in 0..20_000u32 {
        let now = t0 + Duration::from_micros(u64::from(i) * 50);
        let o = t.lease(LeaseRequest::new(format!("B{i}"), 0, 1, vec![2]), now).expect("lease");
        t.cancel(o.remote_request_id(), o.token().as_bytes(), now);
    }
    // The reply was lost; the retry comes 10 s later.
    assert_eq!(
        t.notify("R", h.token().as_bytes(), "c", t0 + Duration::from_secs(10)),
        NotifyOutcome::AlreadyEnded { kind: EndKind::Pulled, counted: true }
    );
}

/// Review finding 11: `max_lifetime = Duration::MAX` ("no maximum") and huge ttls made every
/// lease panic with an `Instant` overflow.
#[test]
fn an_unbounded_lifetime_and_huge_ttls_never_panic() {
    let t = table_with(|c| {
        c.max_lifetime = Duration::MAX;
        c.default_ttl = Duration::MAX;
    });
    let t0 = Instant::now();
    let a = t.lease(LeaseRequest::new("A", 0, 1, vec![1]), t0).expect("lease");
    let b = t.lease(LeaseRequest::new("B", 0, 1, vec![2]).ttl(Duration::MAX), t0).expect("lease");
    let c = t.lease(LeaseRequest::new("C", 0, 1, vec![3]).ttl(ms(100)), t0).expect("lease");
    for h in [&a, &b, &c] {
        assert!(matches!(
            t.heartbeat(h.remote_request_id(), h.token().as_bytes(), t0 + ms(50)),
            HeartbeatOutcome::Extended { .. }
        ));
    }
    assert!(t.poll_timeout().is_some());
    assert_eq!(t.expire(t0 + Duration::from_secs(3600)), 1, "only the 100 ms lease expires");
    let guard =
        t.begin_read("A", a.token().as_bytes(), &[BlockRange { start: 1, count: 1 }], t0).expect("read");
    drop(guard);
    assert_eq!(t.cancel("B", b.token().as_bytes(), t0), CancelOutcome::Released);
}

/// Review finding 6 (b): lease ends reach the tracker asynchronously, so an earlier lease's
/// end can arrive after the child was leased again; it must not mark the new lease ended
/// (nor complete and forget the parent under it). Ends carry their lease's generation.
#[test]
fn a_late_end_of_an_earlier_lease_does_not_end_the_re_leased_child() {
    let t = table_with(|_| {});
    let t0 = Instant::now();
    let mut tracker = ParentTracker::new();
    let lease = |tracker: &mut ParentTracker, child| {
        tracker.admit("Q", 2, t0).expect("same n");
        let (h, generation) =
            t.lease_with_generation(LeaseRequest::new("Q", child, 2, vec![1]), t0).expect("lease");
        assert!(tracker.leased("Q", 2, child, generation, t0));
        h
    };
    let first = lease(&mut tracker, 0);
    let sibling = lease(&mut tracker, 1);
    assert_eq!(
        t.notify(sibling.remote_request_id(), sibling.token().as_bytes(), "c", t0),
        NotifyOutcome::Pulled
    );
    assert_eq!(tracker.on_end(&t.ended().try_recv().expect("sibling's end"), t0), None);
    // Child 0 is cancelled and at once leased again, before the first end was applied.
    assert_eq!(t.cancel(first.remote_request_id(), first.token().as_bytes(), t0), CancelOutcome::Released);
    let late = t.ended().try_recv().expect("first lease's end");
    let second = lease(&mut tracker, 0);
    assert_eq!(tracker.on_end(&late, t0), None, "a stale end completes nothing");
    assert_eq!(
        tracker.status("Q").map(|s| s.children.clone()),
        Some(vec![ChildState::Pending, ChildState::Pulled])
    );
    assert_eq!(t.cancel(second.remote_request_id(), second.token().as_bytes(), t0), CancelOutcome::Released);
    let done = tracker.on_end(&t.ended().try_recv().expect("second lease's end"), t0).expect("complete now");
    assert_eq!(done.children, vec![ChildState::Released, ChildState::Pulled]);
    assert!(tracker.is_empty());
}

/// Review finding 6 (a): a parent some of whose children are never leased (aborted before
/// prefill finished) was never forgotten. It is now, once it has no live lease and the
/// maximum lease lifetime has passed since its last lease; counted.
#[test]
fn a_parent_whose_other_children_are_never_leased_is_forgotten_after_the_lifetime_bound() {
    let life = Duration::from_secs(600);
    let t = table_with(|c| c.max_lifetime = life);
    let t0 = Instant::now();
    let mut tracker = ParentTracker::with_forget_after(life);
    for (parent, child) in [("A", 0), ("A", 1), ("B", 0)] {
        let (h, generation) =
            t.lease_with_generation(LeaseRequest::new(parent, child, 4, vec![1]), t0).expect("lease");
        assert!(tracker.leased(parent, 4, child, generation, t0));
        if parent == "A" {
            assert_eq!(
                t.notify(h.remote_request_id(), h.token().as_bytes(), "c", t0 + ms(10)),
                NotifyOutcome::Pulled
            );
        }
    }
    for end in t.ended().try_iter() {
        assert_eq!(tracker.on_end(&end, t0 + ms(10)), None, "children 2 and 3 are never leased");
    }
    // A has no live lease; B's lease is live (a heartbeating peer) until its maximum lifetime.
    assert_eq!(tracker.admit("X", 1, t0 + life - ms(1)), Ok(()));
    assert_eq!((tracker.len(), tracker.forgotten()), (2, 0));
    assert_eq!(tracker.admit("X", 1, t0 + life), Ok(()));
    assert!(tracker.status("A").is_none(), "A is forgotten");
    assert_eq!((tracker.len(), tracker.forgotten()), (1, 1));
    // B is forgotten only once its live lease ended, at once since the bound has passed.
    assert_eq!(t.expire(t0 + life), 1);
    assert_eq!(tracker.on_end(&t.ended().try_recv().expect("B's end"), t0 + life + ms(1)), None);
    assert_eq!((tracker.len(), tracker.forgotten()), (0, 2));
    // A re-lease before the bound keeps a parent.
    let (_, g) = t.lease_with_generation(LeaseRequest::new("C", 0, 2, vec![1]), t0).expect("lease");
    tracker.leased("C", 2, 0, g, t0);
    assert_eq!(t.expire(t0 + life), 1);
    assert_eq!(tracker.on_end(&t.ended().try_recv().expect("C's end"), t0 + life - ms(5)), None);
    let (_, g) =
        t.lease_with_generation(LeaseRequest::new("C", 0, 2, vec![1]), t0 + life - ms(2)).expect("lease");
    tracker.leased("C", 2, 0, g, t0 + life - ms(2));
    assert_eq!(tracker.admit("X", 1, t0 + life + ms(100)), Ok(()));
    assert!(tracker.status("C").is_some(), "leased again since: kept");
}

/// Review finding 6 (c): a child leased with another `n` than its parent's tracked leases
/// was silently untracked; it is refused now, naming both values.
#[test]
fn a_lease_naming_another_n_than_its_tracked_siblings_is_refused() {
    let t0 = Instant::now();
    let mut tracker = ParentTracker::new();
    assert!(tracker.leased("P", 2, 0, 0, t0));
    let e = tracker.admit("P", 3, t0).expect_err("another n");
    assert_eq!(e, LeaseError::ChildCountMismatch { parent: "P".into(), n: 3, tracked: 2 });
    assert!(e.to_string().contains("n = 3") && e.to_string().contains("n = 2"), "{e}");
    assert!(!tracker.leased("P", 3, 1, 1, t0), "not recorded either");
    assert_eq!(tracker.admit("P", 2, t0), Ok(()));
}

/// Review findings 4 and 11: a read guard tells the lease's hard deadline (for capping a
/// pin's hold); with no maximum lifetime there is none.
#[test]
fn a_read_guard_tells_the_lease_hard_deadline() {
    let t0 = Instant::now();
    let range = [BlockRange { start: 1, count: 1 }];
    let t = table_with(|c| c.max_lifetime = ms(1000));
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]).ttl(ms(100)), t0).expect("lease");
    let later = t0 + ms(50);
    assert!(matches!(t.heartbeat("R", h.token().as_bytes(), later), HeartbeatOutcome::Extended { .. }));
    let g = t.begin_read("R", h.token().as_bytes(), &range, later).expect("read");
    assert_eq!(g.expires_no_later_than(), Some(t0 + ms(1000)));
    let t = table_with(|c| c.max_lifetime = Duration::MAX);
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]), t0).expect("lease");
    let g = t.begin_read("R", h.token().as_bytes(), &range, t0).expect("read");
    assert_eq!(g.expires_no_later_than(), None);
}

/// Review finding 5: records are bounded by time as well as count. A record older than its
/// retention is dropped as other leases end; under the hard cap the oldest goes first, and
/// dropping one younger than the retention is counted.
#[test]
fn ended_records_are_kept_for_their_retention_under_a_hard_cap() {
    let retention = Duration::from_secs(60);
    let t = table_with(|c| {
        c.shards = 1;
        c.ended_record_retention = retention;
        c.max_ended_records = 100;
    });
    let t0 = Instant::now();
    let end_one = |id: &str, now| {
        let h = t.lease(LeaseRequest::new(id, 0, 1, vec![1]), now).expect("lease");
        assert_eq!(t.cancel(id, h.token().as_bytes(), now), CancelOutcome::Released);
        h
    };
    let old = end_one("old", t0);
    let ended = CancelOutcome::AlreadyEnded(EndKind::Released);
    assert_eq!(t.cancel("old", old.token().as_bytes(), t0 + retention - ms(1)), ended);
    // Past its retention the record goes when the next lease ends (or the driver runs).
    end_one("next", t0 + retention);
    assert_eq!(t.cancel("old", old.token().as_bytes(), t0 + retention), CancelOutcome::Unrecognized);
    let fresh = end_one("fresh", t0 + retention);
    assert_eq!(t.expire(t0 + 2 * retention), 0);
    assert_eq!(t.cancel("fresh", fresh.token().as_bytes(), t0 + 2 * retention), CancelOutcome::Unrecognized);
    assert_eq!(t.stats().ended_records_evicted, 0);
    // 150 ends within the retention: the cap of 100 keeps the newest, counting the 50 evictions.
    let now = t0 + 3 * retention;
    let first = end_one("burst0", now);
    for i in 1..150 {
        end_one(&format!("burst{i}"), now);
    }
    assert_eq!(t.cancel("burst0", first.token().as_bytes(), now), CancelOutcome::Unrecognized);
    assert_eq!(t.stats().ended_records_evicted, 50);
    // A re-leased id's record is replaced, not left behind to use up a slot.
    let again = end_one("burst149", now);
    assert_eq!(t.cancel("burst149", again.token().as_bytes(), now), ended);
    assert_eq!(t.stats().ended_records_evicted, 50);
}

/// Hostile-peer review: shards were chosen by an unkeyed FNV-1a of the request id, so a peer
/// could pick ids that all land in the shard of another lease and, ending enough of them,
/// evict that lease's ended record early (a retried cancel or notify was then answered
/// `Unrecognized`). Ids that all collide under the old hash no longer crowd one shard.
#[test]
fn ids_colliding_under_an_unkeyed_hash_do_not_evict_another_leases_record() {
    fn old_fnv1a(bytes: &[u8]) -> u64 {
        bytes
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
    }
    let t = table_with(|c| {
        c.shards = 16;
        c.max_ended_records = 16 * 64;
    });
    let now = Instant::now();
    let end_one = |id: &str| {
        let h = t.lease(LeaseRequest::new(id, 0, 1, vec![1]), now).expect("lease");
        assert_eq!(t.cancel(id, h.token().as_bytes(), now), CancelOutcome::Released);
        h
    };
    let victim = end_one("victim");
    let target = old_fnv1a(b"victim") & 15;
    let crafted: Vec<String> = (0u64..)
        .map(|i| format!("crafted-{i}"))
        .filter(|id| old_fnv1a(id.as_bytes()) & 15 == target)
        .take(80)
        .collect();
    for id in &crafted {
        end_one(id);
    }
    assert_eq!(
        t.cancel("victim", victim.token().as_bytes(), now),
        CancelOutcome::AlreadyEnded(EndKind::Released),
        "80 ids aimed at the victim's shard (64 records each) evicted its record"
    );
    assert_eq!(t.stats().ended_records_evicted, 0);
}
