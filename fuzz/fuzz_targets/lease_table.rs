//! The lease table driven by an arbitrary sequence of operations on a fake clock, with its
//! private bookkeeping checked after every step (through `kvxfer_core::fuzzing`, present
//! only in `cfg(fuzzing)` builds), and every lease ending exactly once — except the ones
//! retracted, which never end.
#![no_main]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvxfer_core::plan::BlockRange;
use kvxfer_core::{fuzzing, EngineInfo, LeaseConfig, LeaseRequest, LeaseTable, RetractOutcome};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let engine = EngineInfo { engine_id: "e".into(), host: "127.0.0.1".into(), port: 1, tp_size: 1, incarnation: 0 };
    let mut config = LeaseConfig::new(engine, 64);
    config.shards = 2;
    config.max_lifetime = Duration::from_millis(2000);
    config.max_children = 3;
    let table = std::sync::Arc::new(LeaseTable::new(config, [7; 32]));
    let start = Instant::now();
    let mut now = start;
    let mut handoffs = Vec::new();
    let mut guards = Vec::new();
    let mut ends: HashMap<String, u32> = HashMap::new();
    let mut retracted: HashMap<String, u32> = HashMap::new();
    for op in data.chunks(3) {
        let (a, b, c) = (op[0], op.get(1).copied().unwrap_or(0), op.get(2).copied().unwrap_or(0));
        let pick = |v: &Vec<kvxfer_core::ChildHandoff>| v.get(b as usize % v.len().max(1)).cloned();
        match a % 9 {
            0 => {
                let n = u32::from(c % 4) + 1;
                let req = LeaseRequest::new(
                    format!("p{b}"),
                    u32::from(c) % n,
                    n,
                    vec![u32::from(b % 70), u32::from(c % 64)],
                )
                .consumers(u32::from(a >> 6) + 1)
                .ttl(Duration::from_millis(u64::from(c) * 10 + 1));
                if let Ok(h) = table.lease(req, now) {
                    handoffs.push(h);
                }
            }
            1 => {
                if let Some(h) = pick(&handoffs) {
                    let _ = table.notify(
                        h.remote_request_id(),
                        h.token().as_bytes(),
                        &format!("c{}", c % 3),
                        now,
                    );
                }
            }
            2 => {
                if let Some(h) = pick(&handoffs) {
                    let _ = table.heartbeat(h.remote_request_id(), h.token().as_bytes(), now);
                }
            }
            3 => {
                if let Some(h) = pick(&handoffs) {
                    let token = if c & 1 == 0 { h.token().as_bytes().to_vec() } else { vec![c; 16] };
                    let _ = table.cancel(h.remote_request_id(), &token, now);
                }
            }
            4 => {
                if let Some(h) = pick(&handoffs) {
                    // Mostly small ranges, some starting anywhere (empty ones included).
                    let start = if c >= 250 { u32::MAX - u32::from(c - 250) } else { u32::from(c % 70) };
                    let range = BlockRange { start, count: u32::from(b % 3) };
                    if let Ok(g) =
                        table.begin_read(h.remote_request_id(), h.token().as_bytes(), &[range], now)
                    {
                        guards.push(g);
                    }
                }
            }
            5 => {
                if !guards.is_empty() {
                    let i = c as usize % guards.len();
                    drop(guards.swap_remove(i));
                }
            }
            6 => {
                now += Duration::from_millis(u64::from(c) * 4);
                let _ = table.expire(now);
            }
            7 => {
                let _ = table.notify(&format!("{b}_bogus"), &[c; 16], "x", now);
            }
            _ => {
                if let Some(h) = pick(&handoffs) {
                    if table.retract(h.remote_request_id(), h.token().as_bytes(), now) == RetractOutcome::Retracted {
                        *retracted.entry(h.remote_request_id().to_owned()).or_default() += 1;
                    }
                }
            }
        }
        fuzzing::check_lease_table(&table).expect("bookkeeping consistent");
        while let Ok(e) = table.ended().try_recv() {
            *ends.entry(e.remote_request_id.to_string()).or_default() += 1;
        }
    }
    guards.clear();
    now += Duration::from_secs(3600);
    table.expire(now);
    while let Ok(e) = table.ended().try_recv() {
        *ends.entry(e.remote_request_id.to_string()).or_default() += 1;
    }
    fuzzing::check_lease_table(&table).expect("bookkeeping consistent");
    let s = table.stats();
    assert_eq!((s.live, s.draining), (0, 0), "{s:?}");
    // An id may be leased again once its lease ended or was retracted: count leases per id.
    let mut leased: HashMap<String, u32> = HashMap::new();
    for h in &handoffs {
        *leased.entry(h.remote_request_id().to_owned()).or_default() += 1;
    }
    for (id, n) in &retracted {
        let l = leased.get_mut(id).expect("retracted leases were made");
        *l -= n;
        if *l == 0 {
            leased.remove(id);
        }
    }
    assert_eq!(ends, leased, "every lease not retracted ended exactly once");
    assert_eq!(s.retracted, retracted.values().map(|&n| u64::from(n)).sum::<u64>());
});
