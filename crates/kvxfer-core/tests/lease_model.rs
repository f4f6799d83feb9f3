//! Model-based property test: random lease / notify / heartbeat / cancel / retract / expire /
//! read-guard sequences against a simple model of what must happen, including the answers
//! given from the ended-lease record and the maximum lease lifetime.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::plan::BlockRange;
use kvxfer_core::{
    CancelOutcome, ChildHandoff, EndKind, EngineInfo, HeartbeatOutcome, LeaseConfig, LeaseRequest,
    LeaseTable, NotifyOutcome, ReadGuard, RetractOutcome,
};

/// The table's maximum lease lifetime in this model.
const MAX_LIFETIME: Duration = Duration::from_millis(300);
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Lease { id: u8, consumers: u32, ttl_ms: u64 },
    Notify { id: u8, consumer: u8, good_token: bool },
    Heartbeat { id: u8 },
    Cancel { id: u8, good_token: bool },
    BeginRead { id: u8, empty: bool },
    Retract { id: u8 },
    EndRead { which: usize },
    Advance { ms: u64 },
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..6, 1u32..4, 1u64..200).prop_map(|(id, consumers, ttl_ms)| Op::Lease { id, consumers, ttl_ms }),
        (0u8..7, 0u8..4, proptest::bool::weighted(0.85)).prop_map(|(id, consumer, good_token)| Op::Notify {
            id,
            consumer,
            good_token
        }),
        (0u8..6).prop_map(|id| Op::Heartbeat { id }),
        (0u8..7, proptest::bool::weighted(0.85)).prop_map(|(id, good_token)| Op::Cancel { id, good_token }),
        (0u8..6, proptest::bool::weighted(0.1)).prop_map(|(id, empty)| Op::BeginRead { id, empty }),
        (0u8..6).prop_map(|id| Op::Retract { id }),
        (0usize..8).prop_map(|which| Op::EndRead { which }),
        (0u64..120).prop_map(|ms| Op::Advance { ms }),
        Just(Op::Expire),
    ]
}

#[derive(Debug)]
struct ModelLease {
    blocks: Vec<u32>,
    expected: u32,
    ttl: Duration,
    deadline: Instant,
    max_deadline: Instant,
    seen: Vec<u8>,
    ended: Option<EndKind>,
    readers: usize,
    handed_back: bool,
}

impl ModelLease {
    /// What the table must do first on any operation at `now`: expire a lease past its deadline.
    fn touch(&mut self, now: Instant) {
        if self.ended.is_none() && now >= self.deadline {
            self.ended = Some(EndKind::Expired);
        }
    }
    fn live(&self) -> bool {
        self.ended.is_none()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn every_lease_ends_exactly_once(ops in proptest::collection::vec(op(), 1..120)) {
        let engine = EngineInfo { engine_id: "e".into(), host: "127.0.0.1".into(), port: 1, tp_size: 1, incarnation: 0 };
        let mut config = LeaseConfig::new(engine, 64);
        config.max_lifetime = MAX_LIFETIME;
        let table = Arc::new(LeaseTable::new(config, [3; 32]));
        let mut now = Instant::now();
        // One model entry per lease ever made, keyed by (request id, generation).
        let mut model: BTreeMap<(String, u32), ModelLease> = BTreeMap::new();
        let mut current: HashMap<String, (u32, ChildHandoff)> = HashMap::new();
        let mut generation = 0u32;
        let mut guards: Vec<(String, u32, ReadGuard)> = Vec::new();
        let mut leased = 0u64;
        let mut retracted = 0u64;

        for op in ops {
            match op {
                Op::Lease { id, consumers, ttl_ms } => {
                    let parent = format!("P{id}");
                    let blocks = vec![u32::from(id) * 4, u32::from(id) * 4 + 1];
                    let ttl = Duration::from_millis(ttl_ms).min(MAX_LIFETIME);
                    let req = LeaseRequest::new(parent.clone(), 0, 1, blocks.clone()).consumers(consumers).ttl(ttl);
                    let occupied = current.get(&parent).is_some_and(|(g, _)| !model[&(parent.clone(), *g)].handed_back);
                    let res = table.lease(req, now);
                    prop_assert_eq!(res.is_ok(), !occupied, "lease of {} while occupied={}", parent, occupied);
                    if let Ok(h) = res {
                        generation += 1;
                        leased += 1;
                        model.insert((parent.clone(), generation), ModelLease {
                            blocks, expected: consumers, ttl, deadline: now + ttl,
                            max_deadline: now + MAX_LIFETIME, seen: vec![],
                            ended: None, readers: 0, handed_back: false,
                        });
                        current.insert(parent, (generation, h));
                    }
                }
                Op::Notify { id, consumer, good_token } => {
                    let parent = format!("P{id}");
                    let Some((g, h)) = current.get(&parent) else {
                        prop_assert_eq!(table.notify(&parent, &[0; 16], "c", now), NotifyOutcome::Unrecognized);
                        continue;
                    };
                    let m = model.get_mut(&(parent.clone(), *g)).expect("model");
                    let token = if good_token { *h.token().as_bytes() } else { [0xee; 16] };
                    let out = table.notify(&parent, &token, &format!("c{consumer}"), now);
                    let expect = if !good_token {
                        NotifyOutcome::BadToken
                    } else {
                        m.touch(now);
                        if let Some(kind) = m.ended {
                            NotifyOutcome::AlreadyEnded { kind, counted: m.seen.contains(&consumer) }
                        } else if m.seen.contains(&consumer) {
                            NotifyOutcome::Duplicate
                        } else {
                            m.seen.push(consumer);
                            let remaining = m.expected.saturating_sub(m.seen.len() as u32);
                            if remaining == 0 || m.expected == 1 {
                                m.ended = Some(EndKind::Pulled);
                                NotifyOutcome::Pulled
                            } else {
                                NotifyOutcome::Counted { remaining }
                            }
                        }
                    };
                    prop_assert_eq!(out, expect);
                }
                Op::Heartbeat { id } => {
                    let parent = format!("P{id}");
                    let Some((g, h)) = current.get(&parent) else { continue };
                    let out = table.heartbeat(&parent, h.token().as_bytes(), now);
                    let m = model.get_mut(&(parent.clone(), *g)).expect("model");
                    m.touch(now);
                    if let Some(kind) = m.ended {
                        prop_assert_eq!(out, HeartbeatOutcome::AlreadyEnded(kind));
                    } else {
                        m.deadline = m.deadline.max((now + m.ttl * 2 / 3).min(m.max_deadline));
                        prop_assert_eq!(out, HeartbeatOutcome::Extended { deadline: m.deadline });
                    }
                }
                Op::Cancel { id, good_token } => {
                    let parent = format!("P{id}");
                    let Some((g, h)) = current.get(&parent) else { continue };
                    let token = if good_token { *h.token().as_bytes() } else { [0xee; 16] };
                    let out = table.cancel(&parent, &token, now);
                    let m = model.get_mut(&(parent.clone(), *g)).expect("model");
                    let expect = if !good_token {
                        CancelOutcome::BadToken
                    } else {
                        m.touch(now);
                        match m.ended {
                            Some(kind) => CancelOutcome::AlreadyEnded(kind),
                            None => { m.ended = Some(EndKind::Released); CancelOutcome::Released }
                        }
                    };
                    prop_assert_eq!(out, expect);
                }
                Op::BeginRead { id, empty } => {
                    let parent = format!("P{id}");
                    let Some((g, h)) = current.get(&parent) else { continue };
                    let m = model.get_mut(&(parent.clone(), *g)).expect("model");
                    // An empty range (anywhere, even far outside the layout) is always refused.
                    let r = if empty {
                        vec![BlockRange { start: m.blocks[0], count: 1 }, BlockRange { start: 1000, count: 0 }]
                    } else {
                        vec![BlockRange { start: m.blocks[0], count: 2 }]
                    };
                    let res = table.begin_read(&parent, h.token().as_bytes(), &r, now);
                    m.touch(now);
                    prop_assert_eq!(res.is_ok(), m.live() && !empty);
                    if let Ok(guard) = res {
                        m.readers += 1;
                        guards.push((parent, *g, guard));
                    }
                }
                Op::Retract { id } => {
                    let parent = format!("P{id}");
                    let Some((g, h)) = current.get(&parent) else { continue };
                    let g = *g;
                    let out = table.retract(&parent, h.token().as_bytes(), now);
                    let m = model.get_mut(&(parent.clone(), g)).expect("model");
                    // The deadline is not consulted: only an ending the table already made counts.
                    let expect = match m.ended {
                        Some(kind) => RetractOutcome::AlreadyEnded(kind),
                        None if m.readers > 0 => { m.ended = Some(EndKind::Released); RetractOutcome::Released }
                        None => RetractOutcome::Retracted,
                    };
                    prop_assert_eq!(out, expect);
                    if out == RetractOutcome::Retracted {
                        // Gone without an end or a record: as if never leased.
                        model.remove(&(parent.clone(), g));
                        current.remove(&parent);
                        retracted += 1;
                    }
                }
                Op::EndRead { which } => {
                    if !guards.is_empty() {
                        let (parent, g, guard) = guards.remove(which % guards.len());
                        drop(guard);
                        model.get_mut(&(parent, g)).expect("model").readers -= 1;
                    }
                }
                Op::Advance { ms } => now += Duration::from_millis(ms),
                Op::Expire => {
                    let expected = model.values_mut().filter(|m| m.live() && m.deadline <= now).map(|m| m.touch(now)).count();
                    prop_assert_eq!(table.expire(now), expected);
                }
            }
            // Reconcile: every ending the table reports is the first for its lease, of the
            // model's kind, and comes only once no read is in flight.
            for e in table.ended().try_iter() {
                let (g, _) = current.get(&*e.remote_request_id).expect("ended lease was made");
                let m = model.get_mut(&(e.remote_request_id.to_string(), *g)).expect("model");
                prop_assert!(!m.handed_back, "handed back twice");
                prop_assert_eq!(m.readers, 0, "handed back while a read was in flight");
                prop_assert_eq!(Some(e.kind), m.ended);
                prop_assert_eq!(&*e.blocks, &m.blocks[..]);
                m.handed_back = true;
            }
            for m in model.values() {
                prop_assert_eq!(m.handed_back, m.ended.is_some() && m.readers == 0, "{:?}", m);
            }
            let s = table.stats();
            prop_assert_eq!(s.leased, leased);
            prop_assert_eq!(s.retracted, retracted);
            prop_assert_eq!(s.leased, s.pulled + s.released + s.expired + s.retracted + s.live);
            let live = model.values().filter(|m| m.live()).count() as u64;
            prop_assert_eq!(s.live, live);
            prop_assert_eq!(table.poll_timeout(), model.values().filter(|m| m.live()).map(|m| m.deadline).min());
        }
        // Finish: drop every guard, expire everything; every lease ends exactly once.
        guards.clear();
        table.expire(now + Duration::from_secs(3600));
        for e in table.ended().try_iter() {
            let (g, _) = current.get(&*e.remote_request_id).expect("known");
            let m = model.get_mut(&(e.remote_request_id.to_string(), *g)).expect("model");
            prop_assert!(!m.handed_back);
            m.handed_back = true;
        }
        prop_assert!(model.values().all(|m| m.handed_back));
        let s = table.stats();
        prop_assert_eq!((s.live, s.draining), (0, 0));
        prop_assert_eq!(s.leased, s.pulled + s.released + s.expired + s.retracted);
    }
}
