//! Lease table outcomes, driven with a fake clock (`t0 + offsets`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::plan::BlockRange;
use kvxfer_core::{
    CancelOutcome, ChildState, EndKind, EngineInfo, HeartbeatOutcome, LeaseConfig, LeaseEnd, LeaseError,
    LeaseRequest, LeaseTable, NotifyOutcome, ParentTracker, ReadRefused,
};

const TTL: Duration = Duration::from_secs(30);

fn engine() -> EngineInfo {
    EngineInfo {
        engine_id: "prefill-0".into(),
        host: "127.0.0.1".into(),
        port: 5559,
        tp_size: 1,
        incarnation: 0,
    }
}

fn table() -> Arc<LeaseTable> {
    Arc::new(LeaseTable::new(LeaseConfig::new(engine(), 1024), [42; 32]))
}

fn ended(t: &LeaseTable) -> Vec<LeaseEnd> {
    t.ended().try_iter().collect()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn notify_pulls_and_hands_blocks_back_once() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![3, 4]), t0).expect("lease");
    assert_eq!(h.remote_request_id(), "R");
    assert_eq!(t.notify("R", h.token().as_bytes(), "d0", t0), NotifyOutcome::Pulled);
    let e = ended(&t);
    assert_eq!(e.len(), 1);
    assert_eq!((e[0].kind, &*e[0].blocks, e[0].consumers_seen), (EndKind::Pulled, &[3, 4][..], 1));
    // A retried notification (its first answer lost) is answered from the ended-lease
    // record: already pulled, this consumer counted; no second hand-back.
    assert_eq!(
        t.notify("R", h.token().as_bytes(), "d0", t0),
        NotifyOutcome::AlreadyEnded { kind: EndKind::Pulled, counted: true }
    );
    assert!(ended(&t).is_empty());
    let s = t.stats();
    assert_eq!((s.leased, s.pulled, s.live, s.unrecognized, s.already_ended), (1, 1, 0, 0, 1));
}

#[test]
fn expected_consumers_count_down_and_duplicates_change_nothing() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 1, 2, vec![1]).consumers(3), t0).expect("lease");
    let tok = h.token().as_bytes();
    assert_eq!(t.notify("1_R", tok, "rank0", t0), NotifyOutcome::Counted { remaining: 2 });
    assert_eq!(t.notify("1_R", tok, "rank0", t0), NotifyOutcome::Duplicate);
    assert_eq!(t.notify("1_R", tok, "rank1", t0), NotifyOutcome::Counted { remaining: 1 });
    assert!(ended(&t).is_empty());
    assert_eq!(t.notify("1_R", tok, "rank2", t0), NotifyOutcome::Pulled);
    let e = ended(&t);
    assert_eq!((e[0].consumers_seen, e[0].expected_consumers), (3, 3));
    assert_eq!(t.stats().duplicate, 1);
}

#[test]
fn wrong_token_and_unknown_id_change_nothing() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]), t0).expect("lease");
    let mut bad = *h.token().as_bytes();
    bad[0] ^= 0xff;
    assert_eq!(t.notify("R", &bad, "d", t0), NotifyOutcome::BadToken);
    assert_eq!(t.notify("R", &bad[..3], "d", t0), NotifyOutcome::BadToken);
    assert_eq!(t.heartbeat("R", &bad, t0), HeartbeatOutcome::BadToken);
    assert_eq!(t.cancel("R", &bad, t0), CancelOutcome::BadToken);
    assert_eq!(t.notify("nope", &bad, "d", t0), NotifyOutcome::Unrecognized);
    assert_eq!(t.cancel("nope", &bad, t0), CancelOutcome::Unrecognized);
    assert_eq!(t.heartbeat("nope", &bad, t0), HeartbeatOutcome::Unrecognized);
    assert!(ended(&t).is_empty());
    let s = t.stats();
    assert_eq!((s.live, s.bad_token, s.unrecognized), (1, 4, 3));
}

#[test]
fn cancel_releases_at_once() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![9]), t0).expect("lease");
    assert_eq!(t.cancel("R", h.token().as_bytes(), t0), CancelOutcome::Released);
    assert_eq!(ended(&t)[0].kind, EndKind::Released);
    assert_eq!(t.cancel("R", h.token().as_bytes(), t0), CancelOutcome::AlreadyEnded(EndKind::Released));
    assert!(ended(&t).is_empty());
    assert_eq!(t.poll_timeout(), None);
}

#[test]
fn expiry_reports_consumers_seen_and_poll_timeout_tracks_deadlines() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]).consumers(2).ttl(ms(100)), t0).expect("lease");
    t.lease(LeaseRequest::new("S", 0, 1, vec![2]).ttl(ms(500)), t0).expect("lease");
    assert_eq!(t.poll_timeout(), Some(t0 + ms(100)));
    t.notify("R", h.token().as_bytes(), "rank0", t0);
    assert_eq!(t.expire(t0 + ms(99)), 0);
    assert_eq!(t.expire(t0 + ms(100)), 1);
    let e = ended(&t);
    assert_eq!((e[0].kind, e[0].consumers_seen, e[0].expected_consumers), (EndKind::Expired, 1, 2));
    assert_eq!(t.poll_timeout(), Some(t0 + ms(500)));
    assert_eq!(t.stats().expired, 1);
}

#[test]
fn heartbeat_extends_to_two_thirds_ttl_and_never_shortens() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]).ttl(ms(300)), t0).expect("lease");
    let tok = h.token().as_bytes();
    // now + 200ms = 210 < deadline 300: unchanged.
    assert_eq!(t.heartbeat("R", tok, t0 + ms(10)), HeartbeatOutcome::Extended { deadline: t0 + ms(300) });
    assert_eq!(t.heartbeat("R", tok, t0 + ms(250)), HeartbeatOutcome::Extended { deadline: t0 + ms(450) });
    assert_eq!(t.expire(t0 + ms(400)), 0);
    assert_eq!(t.expire(t0 + ms(450)), 1);
}

#[test]
fn a_heartbeated_old_lease_does_not_hold_back_younger_ones() {
    let t = table();
    let t0 = Instant::now();
    let old = t.lease(LeaseRequest::new("old", 0, 1, vec![1]).ttl(ms(100)), t0).expect("lease");
    t.lease(LeaseRequest::new("young", 0, 1, vec![2]).ttl(ms(100)), t0 + ms(10)).expect("lease");
    t.heartbeat("old", old.token().as_bytes(), t0 + ms(90)); // old now ends at 90 + 66 = 156
    assert_eq!(t.expire(t0 + ms(120)), 1);
    assert_eq!(&*ended(&t)[0].remote_request_id, "young");
}

#[test]
fn operations_after_the_deadline_see_an_expired_lease() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]).ttl(ms(100)), t0).expect("lease");
    // The driver has not called expire yet; the notify still must not resurrect the lease.
    assert_eq!(
        t.notify("R", h.token().as_bytes(), "d", t0 + ms(100)),
        NotifyOutcome::AlreadyEnded { kind: EndKind::Expired, counted: false }
    );
    let e = ended(&t);
    assert_eq!((e.len(), e[0].kind), (1, EndKind::Expired));
    assert_eq!(t.expire(t0 + ms(1000)), 0);
}

#[test]
fn leases_are_refused_when_malformed() {
    let t = table();
    let t0 = Instant::now();
    assert!(matches!(
        t.lease(LeaseRequest::new("R", 0, 1, vec![1, 5000, 7000]), t0),
        Err(LeaseError::BlocksOutOfRange { ids, num_blocks: 1024, .. }) if ids == vec![5000, 7000]
    ));
    assert!(matches!(t.lease(LeaseRequest::new("R", 0, 1, vec![]), t0), Err(LeaseError::NoBlocks(_))));
    assert!(matches!(
        t.lease(LeaseRequest::new("R", 3, 3, vec![1]), t0),
        Err(LeaseError::BadChildIndex { .. })
    ));
    assert!(matches!(
        t.lease(LeaseRequest::new("R", 0, 1, vec![1]).consumers(0), t0),
        Err(LeaseError::NoConsumers(_))
    ));
    t.lease(LeaseRequest::new("R", 0, 1, vec![1]), t0).expect("lease");
    assert!(matches!(t.lease(LeaseRequest::new("R", 0, 1, vec![2]), t0), Err(LeaseError::AlreadyLeased(_))));
    assert_eq!(t.stats().leased, 1);
}

/// A child whose block list names a block twice was leased, and its end then listed the
/// block twice (an owner freeing the list would free it twice). Refused now, naming the
/// block; siblings sharing a block (a shared prefix) stay legal, and so does the same id
/// in two KV-cache groups (two different blocks).
#[test]
fn a_child_naming_a_block_twice_is_refused_but_siblings_may_share_blocks() {
    let t = table();
    let t0 = Instant::now();
    assert_eq!(
        t.lease(LeaseRequest::new("G", 0, 1, vec![1, 1]), t0).map(drop),
        Err(LeaseError::DuplicateBlock { request: "G".into(), group: 0, block: 1 })
    );
    assert_eq!(
        t.lease(LeaseRequest::new("H", 1, 2, vec![9, 3, 5, 3]), t0).map(drop),
        Err(LeaseError::DuplicateBlock { request: "1_H".into(), group: 0, block: 3 })
    );
    assert_eq!(t.stats().leased, 0, "nothing was leased");
    assert!(ended(&t).is_empty());
    // Two children of one parent sharing block 7: both leased, each end lists it once.
    let a = t.lease(LeaseRequest::new("S", 0, 2, vec![7, 8]), t0).expect("lease child 0");
    let b = t.lease(LeaseRequest::new("S", 1, 2, vec![7, 9]), t0).expect("lease child 1");
    assert_eq!(t.notify(a.remote_request_id(), a.token().as_bytes(), "d", t0), NotifyOutcome::Pulled);
    assert_eq!(t.notify(b.remote_request_id(), b.token().as_bytes(), "d", t0), NotifyOutcome::Pulled);
    let mut blocks: Vec<Vec<u32>> = ended(&t).iter().map(|e| e.blocks.to_vec()).collect();
    blocks.sort();
    assert_eq!(blocks, vec![vec![7, 8], vec![7, 9]]);
}

/// The duplicate check is per KV-cache group: id 1 in group 0 and in group 1 are two
/// blocks; id 1 twice in group 1 is refused, naming the group.
#[test]
fn a_duplicate_block_is_named_with_its_group() {
    let mut config = LeaseConfig::new(engine(), 16);
    config.other_group_blocks = vec![8];
    let t = LeaseTable::new(config, [7; 32]);
    let t0 = Instant::now();
    t.lease(LeaseRequest::grouped("A", 0, 1, vec![vec![1, 2], vec![1, 2]]), t0)
        .expect("same ids, two groups");
    assert_eq!(
        t.lease(LeaseRequest::grouped("B", 0, 1, vec![vec![3], vec![4, 5, 4]]), t0).map(drop),
        Err(LeaseError::DuplicateBlock { request: "B".into(), group: 1, block: 4 })
    );
}

#[test]
fn overlapping_block_sets_are_normal_and_each_hands_back_its_own_list() {
    let t = table();
    let t0 = Instant::now();
    let hs: Vec<_> = (0..3)
        .map(|i| t.lease(LeaseRequest::new("R", i, 3, vec![0, 1, 2, 10 + i]), t0).expect("lease"))
        .collect();
    for h in &hs {
        assert_eq!(t.notify(h.remote_request_id(), h.token().as_bytes(), "d", t0), NotifyOutcome::Pulled);
    }
    let mut e = ended(&t);
    e.sort_by_key(|e| e.child_index);
    assert_eq!(
        e.iter().map(|e| e.blocks.to_vec()).collect::<Vec<_>>(),
        vec![vec![0, 1, 2, 10], vec![0, 1, 2, 11], vec![0, 1, 2, 12]]
    );
}

#[test]
fn read_guards_pin_blocks_past_the_end_of_the_lease() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![7, 8, 9]), t0).expect("lease");
    let tok = h.token().as_bytes();
    let all = [BlockRange { start: 7, count: 3 }];
    let g1 = t.begin_read("R", tok, &all, t0).expect("read");
    let g2 = t.begin_read("R", tok, &[BlockRange { start: 8, count: 1 }], t0).expect("read");
    assert_eq!(t.cancel("R", tok, t0), CancelOutcome::Released);
    assert!(ended(&t).is_empty(), "blocks must not be handed back while reads are in flight");
    assert_eq!(t.stats().draining, 1);
    // A new read of an ended lease is refused; so is a re-lease of the same id.
    assert_eq!(t.begin_read("R", tok, &all, t0).err(), Some(ReadRefused::Ended("R".into())));
    assert!(matches!(t.lease(LeaseRequest::new("R", 0, 1, vec![1]), t0), Err(LeaseError::AlreadyLeased(_))));
    drop(g1);
    assert!(ended(&t).is_empty());
    drop(g2);
    let e = ended(&t);
    assert_eq!((e.len(), e[0].kind), (1, EndKind::Released));
    assert_eq!(t.stats().draining, 0);
}

#[test]
fn reads_are_refused_for_bad_ids_tokens_and_blocks() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![5, 3, 4]), t0).expect("lease");
    let tok = h.token().as_bytes();
    let r = |start, count| [BlockRange { start, count }];
    assert_eq!(t.begin_read("X", tok, &r(3, 1), t0).err(), Some(ReadRefused::Unknown("X".into())));
    assert_eq!(t.begin_read("R", &[0; 16], &r(3, 1), t0).err(), Some(ReadRefused::BadToken("R".into())));
    assert!(matches!(
        t.begin_read("R", tok, &r(1023, 2), t0),
        Err(ReadRefused::OutOfRange { ids, .. }) if ids == vec![1024]
    ));
    assert!(matches!(t.begin_read("R", tok, &r(u32::MAX, 1), t0), Err(ReadRefused::OutOfRange { .. })));
    assert!(matches!(
        t.begin_read("R", tok, &r(2, 2), t0),
        Err(ReadRefused::NotLeased { ids, .. }) if ids == vec![2]
    ));
    assert!(matches!(
        t.begin_read("R", tok, &r(3, 0), t0),
        Err(ReadRefused::EmptyRange { index: 0, start: 3, .. })
    ));
    assert!(matches!(t.begin_read("R", tok, &r(0, u32::MAX), t0), Err(ReadRefused::BadSize { .. })));
    // Unsorted lease blocks are still found.
    drop(t.begin_read("R", tok, &r(3, 3), t0).expect("read of leased blocks"));
    assert_eq!(t.stats().reads_refused, 7);
}

/// The bug kvxfer exists to end: n = 3, the decode side notifies only child 1.
#[test]
fn motivating_scenario_n3_only_child_1_notified() {
    let t = table();
    let mut tracker = ParentTracker::new();
    let t0 = Instant::now();
    let hs: Vec<_> = (0..3)
        .map(|i| {
            let req = LeaseRequest::new("R", i, 3, vec![10 * i, 10 * i + 1]);
            let (h, generation) = t.lease_with_generation(req, t0).expect("lease");
            assert!(tracker.leased("R", 3, i, generation, t0));
            h
        })
        .collect();
    assert_eq!(hs[1].remote_request_id(), "1_R");
    assert_eq!(t.notify("1_R", hs[1].token().as_bytes(), "decode-0", t0 + ms(5)), NotifyOutcome::Pulled);
    for e in t.ended().try_iter() {
        tracker.on_end(&e, t0 + ms(5));
    }
    let status = tracker.status("R").expect("parent still tracked");
    assert_eq!(status.indices(ChildState::Pulled), vec![1]);
    // Known at once, not after the lease runs out.
    assert_eq!(status.pending(), vec![0, 2]);
    // A notification for an id that was never leased: unrecognized, nothing changes.
    let before = t.stats();
    assert_eq!(
        t.notify("3_R", hs[1].token().as_bytes(), "decode-0", t0 + ms(6)),
        NotifyOutcome::Unrecognized
    );
    let after = t.stats();
    assert_eq!(
        (after.live, after.pulled, after.unrecognized),
        (before.live, before.pulled, before.unrecognized + 1)
    );
    assert!(t.ended().try_recv().is_err());
    // The others end loudly at the deadline, and the parent completes.
    assert_eq!(t.expire(t0 + TTL), 2);
    let mut last = None;
    for e in t.ended().try_iter() {
        assert_eq!((e.kind, e.consumers_seen), (EndKind::Expired, 0));
        last = tracker.on_end(&e, t0 + TTL).or(last);
    }
    let done = last.expect("parent completed");
    assert_eq!(done.indices(ChildState::Expired), vec![0, 2]);
    assert!(tracker.is_empty());
}

#[test]
fn an_end_says_when_its_lease_was_made_and_when_it_ended() {
    let t = table();
    let t0 = Instant::now();
    let h = t.lease(LeaseRequest::new("R", 0, 1, vec![1]), t0).expect("lease");
    let _ = t.lease(LeaseRequest::new("S", 0, 1, vec![2]).ttl(ms(500)), t0 + ms(10)).expect("lease");
    assert_eq!(t.notify("R", h.token().as_bytes(), "d0", t0 + ms(250)), NotifyOutcome::Pulled);
    assert_eq!(t.expire(t0 + ms(900)), 1);
    let e = ended(&t);
    let times: Vec<(EndKind, Duration, Duration)> =
        e.iter().map(|e| (e.kind, e.leased_at - t0, e.ended_at - t0)).collect();
    // The expired one ended at the expiry call's `now`, not at its deadline.
    assert_eq!(times, [(EndKind::Pulled, ms(0), ms(250)), (EndKind::Expired, ms(10), ms(900))]);
}

/// A table of two KV-cache groups (16 and 8 blocks): leases need one list per group, ids
/// are checked per group, reads are checked against the group they name (block 17 of
/// group 0 is refused even though flat id 17 is group 1's leased block 1), and the end
/// hands every group's blocks back as leased.
#[test]
fn grouped_leases_check_and_read_each_group_on_its_own() {
    let engine = EngineInfo {
        engine_id: "prefill-0".into(),
        host: "127.0.0.1".into(),
        port: 5559,
        tp_size: 1,
        incarnation: 0,
    };
    let mut config = LeaseConfig::new(engine, 16);
    config.other_group_blocks = vec![8];
    assert_eq!((config.num_groups(), config.group_base(1), config.flat_blocks()), (2, Some(16), 24));
    let t = Arc::new(LeaseTable::new(config, [7; 32]));
    let t0 = Instant::now();
    match t.lease(LeaseRequest::new("One", 0, 1, vec![1]), t0) {
        Err(LeaseError::GroupCount { expected: 2, got: 1, .. }) => {}
        other => panic!("one list for two groups: {other:?}"),
    }
    match t.lease(LeaseRequest::grouped("Big", 0, 1, vec![vec![1], vec![8]]), t0) {
        Err(LeaseError::BlocksOutOfRange { ids, num_blocks: 8, .. }) => assert_eq!(ids, vec![8]),
        other => panic!("block 8 of an 8-block group: {other:?}"),
    }
    // A group may be empty for a request (a sliding window that holds nothing yet); all
    // empty is refused.
    assert!(matches!(
        t.lease(LeaseRequest::grouped("None", 0, 1, vec![vec![], vec![]]), t0),
        Err(LeaseError::NoBlocks(_))
    ));
    let h = t.lease(LeaseRequest::grouped("G", 0, 1, vec![vec![3, 4], vec![1, 2]]), t0).expect("lease");
    assert_eq!((h.group_block_ids(0), h.group_block_ids(1)), (Some(&[3, 4][..]), Some(&[1, 2][..])));
    let tok = h.token().as_bytes();
    let r = |start, count| [BlockRange { start, count }];
    assert!(matches!(
        t.begin_group_read("G", tok, 0, &r(17, 1), t0),
        Err(ReadRefused::OutOfRange { num_blocks: 16, .. })
    ));
    assert!(matches!(
        t.begin_group_read("G", tok, 2, &r(1, 1), t0),
        Err(ReadRefused::NoSuchGroup { group: 2, .. })
    ));
    // Group 1's block 3 is in range but not leased; group 0's block 1 neither.
    assert!(matches!(t.begin_group_read("G", tok, 1, &r(3, 1), t0), Err(ReadRefused::NotLeased { .. })));
    assert!(matches!(t.begin_group_read("G", tok, 0, &r(1, 1), t0), Err(ReadRefused::NotLeased { .. })));
    let g0 = t.begin_group_read("G", tok, 0, &r(3, 2), t0).expect("group 0");
    let g1 = t.begin_group_read("G", tok, 1, &r(1, 2), t0).expect("group 1");
    drop((g0, g1));
    assert_eq!(t.notify("G", tok, "d0", t0), NotifyOutcome::Pulled);
    let e = ended(&t);
    assert_eq!(e.len(), 1);
    assert_eq!((&*e[0].blocks, &*e[0].other_groups), (&[3, 4][..], &[vec![1, 2]][..]));
}

/// Groups whose blocks together do not fit block ids (the last group's base fits, its
/// blocks do not): every lease and grouped read is refused, none wraps its flat ids.
#[test]
fn groups_whose_flat_ids_overflow_are_refused() {
    let engine = EngineInfo {
        engine_id: "prefill-0".into(),
        host: "127.0.0.1".into(),
        port: 5559,
        tp_size: 1,
        incarnation: 0,
    };
    let mut config = LeaseConfig::new(engine, u32::MAX - 10);
    config.other_group_blocks = vec![100];
    assert_eq!(config.group_base(1), Some(u32::MAX - 10));
    assert!(!config.flat_ids_fit());
    let t = Arc::new(LeaseTable::new(config, [7; 32]));
    let t0 = Instant::now();
    match t.lease(LeaseRequest::grouped("O", 0, 1, vec![vec![1], vec![50]]), t0) {
        Err(LeaseError::GroupCount { .. }) => {}
        other => panic!("flat id past u32::MAX: {other:?}"),
    }
    assert!(matches!(
        t.begin_group_read("O", &[0; 16], 1, &[BlockRange { start: 50, count: 1 }], t0),
        Err(ReadRefused::NoSuchGroup { group: 1, .. })
    ));
}
