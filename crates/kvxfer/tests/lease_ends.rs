//! Lease ends in a burst, moved from the lease table to the owner by the prefill agent's
//! event task (woken by the table's end hook, so ends keep arriving while it runs).
//! Thousands of ends from two threads at once reach the async stream and the blocking
//! receiver each exactly once, in each thread's order, with the parent tracker updated
//! before the owner sees them, and before the shutdown; the shutdown delivers the rest.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvxfer::{AgentConfig, BlockLayout, ChildState, EndKind, LeaseEnd, PrefillAgent};
use kvxfer_mem::pattern;
use support::*;

/// Threads cancelling leases at once, and leases each cancels.
const THREADS: usize = 2;
const PER_THREAD: usize = 2000;

/// What a consumer checks of one end of a child 0 (cancelled; child 1 stays live until the
/// shutdown) as it receives it: the parent's status already shows the end (the tracker was
/// updated first). Returns (child, thread, index), thread and index from the parent name.
fn check(prefill: &PrefillAgent, end: &LeaseEnd) -> (u32, usize, usize) {
    assert_eq!(end.kind, EndKind::Released);
    let parent: &str = &end.parent_request_id;
    if end.child_index == 0 {
        let status = prefill.parent_status(parent).expect("the parent is tracked");
        assert_eq!(
            status.children,
            vec![ChildState::Released, ChildState::Pending],
            "{parent}: tracker not updated before the end was seen"
        );
    }
    let (t, i) = parent.split_once('-').expect("name t-i");
    (end.child_index, t.parse().expect("thread"), i.parse().expect("index"))
}

/// Each consumer's ends of each cancelling thread arrive in that thread's order.
fn assert_in_order(seen: &[(u32, usize, usize)], who: &str) {
    let mut last = [None::<usize>; THREADS];
    for &(_, t, i) in seen.iter().filter(|e| e.0 == 0) {
        assert!(last[t].is_none_or(|l| l < i), "{who}: thread {t}'s end {i} after {:?}", last[t]);
        last[t] = Some(i);
    }
}

#[test]
fn a_burst_of_ends_from_two_threads_reaches_the_stream_and_the_receiver_once_each_in_order() {
    init_tracing();
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let mem = pattern::alloc_filled(BlockLayout::single(64, BLOCK).expect("layout")).expect("memory");
    let config = keyed(AgentConfig::new("prefill").io_timeout(Duration::from_secs(5)));
    let prefill = Arc::new(rt.block_on(PrefillAgent::start(config, "127.0.0.1:0", mem)).expect("prefill"));
    let total = THREADS * PER_THREAD;
    let leases: Vec<Vec<_>> = (0..THREADS)
        .map(|t| {
            (0..PER_THREAD)
                .map(|i| {
                    let block = (i % 64) as u32;
                    let r =
                        prefill.lease_parent(&format!("{t}-{i}"), vec![vec![block], vec![block]], 1, None);
                    r.expect("lease").children()[0].clone()
                })
                .collect()
        })
        .collect();
    let received = Arc::new(AtomicUsize::new(0));

    // The async stream, on a task of the agent's runtime.
    let mut stream = prefill.lease_ends();
    let (p, r) = (prefill.clone(), received.clone());
    let streamed = rt.spawn(async move {
        let mut seen = Vec::new();
        while let Some(end) = stream.next().await {
            seen.push(check(&p, &end));
            r.fetch_add(1, Ordering::SeqCst);
        }
        seen
    });
    // The blocking receiver, on a thread of its own.
    let events = prefill.events().clone();
    let (p, r) = (prefill.clone(), received.clone());
    let blocking = std::thread::spawn(move || {
        let mut seen = Vec::new();
        while let Ok(end) = events.recv() {
            seen.push(check(&p, &end));
            r.fetch_add(1, Ordering::SeqCst);
        }
        seen
    });

    // Two threads end their leases at once, while the event task forwards earlier ends.
    let start = Arc::new(std::sync::Barrier::new(THREADS));
    let cancellers: Vec<_> = leases
        .into_iter()
        .map(|handoffs| {
            let (p, start) = (prefill.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                for h in &handoffs {
                    assert_eq!(p.cancel(h), kvxfer_core::CancelOutcome::Released);
                }
            })
        })
        .collect();
    for c in cancellers {
        c.join().expect("canceller");
    }
    // Every cancelled child's end arrives before the shutdown (none waits for it); bounded so that a lost
    // wake-up fails instead of hanging.
    let mut waited_ms = 0u32;
    while received.load(Ordering::SeqCst) < total {
        waited_ms += 1;
        assert!(waited_ms < 60_000, "{} of {total} ends delivered", received.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(1));
    }
    // The shutdown releases every child 1 and delivers those ends too.
    rt.block_on(prefill.shutdown());
    let streamed = rt.block_on(streamed).expect("stream task");
    let blocking = blocking.join().expect("receiver thread");

    assert_eq!(streamed.len() + blocking.len(), 2 * total, "each end once");
    let all: HashSet<_> = streamed.iter().chain(&blocking).collect();
    assert_eq!(all.len(), 2 * total, "no end twice");
    assert_in_order(&streamed, "stream");
    assert_in_order(&blocking, "receiver");
    drop(prefill);
    rt.shutdown_timeout(Duration::from_secs(5));
}
