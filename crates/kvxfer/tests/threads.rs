//! No agent leaks a thread: both agents started, used and shut down on a multi-thread
//! runtime, on a current-thread runtime, and through the blocking facade from plain
//! threads, counting the process's threads (`/proc/self/task`) before and after (with a
//! bounded wait for exits). One test, so no other test of this binary runs meanwhile.

mod support;

use std::time::{Duration, Instant};

use kvxfer::{AgentConfig, BlockId, BlockLayout, DecodeAgent, KvMemory, PrefillAgent};
use kvxfer_mem::pattern;
use support::*;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// Waits (bounded) until the process has at most `want` threads; returns the count.
fn settle(want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = threads();
        if n <= want || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn config(name: &str) -> AgentConfig {
    keyed(AgentConfig::new(name).io_timeout(Duration::from_secs(5)).transport(kvxfer::TransportChoice::Tcp))
}

fn layout() -> BlockLayout {
    BlockLayout::single(64, BLOCK).expect("layout")
}

async fn async_round() -> usize {
    async_round_with(config).await
}

async fn async_round_with(config: impl Fn(&str) -> AgentConfig) -> usize {
    let mem = pattern::alloc_filled(layout()).expect("patterned memory");
    let prefill = PrefillAgent::start(config("prefill"), "127.0.0.1:0", mem).await.expect("prefill");
    let decode = DecodeAgent::start(config("decode"), KvMemory::alloc(layout()).expect("alloc"))
        .await
        .expect("decode");
    let remote: Vec<Vec<BlockId>> = vec![vec![1, 2], vec![3, 4], vec![5]];
    let result = prefill.lease_parent("T", remote.clone(), 1, None).expect("lease");
    let report = decode.submit(result, remote).expect("submit").await;
    assert!(report.all_done(), "{report:?}");
    // The agents started no thread of their own.
    let during = threads();
    decode.shutdown().await;
    prefill.shutdown().await;
    drop((decode, prefill));
    during
}

#[test]
fn no_agent_leaks_a_thread_in_any_mode() {
    init_tracing();
    // On a multi-thread runtime: counted inside it, so its own workers are in both counts.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let before = rt.block_on(async { threads() });
    let during = rt.block_on(async_round());
    assert_eq!(during, before, "async agents start no threads (TCP)");
    assert_eq!(settle(before), before, "threads after the multi-thread round");
    drop(rt);

    // On a current-thread runtime.
    let base = settle(threads());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let during = rt.block_on(async_round());
    assert_eq!(during, base, "async agents start no threads (TCP, current-thread)");
    drop(rt);
    assert_eq!(settle(base), base, "threads after the current-thread round");

    // The blocking facade from a plain thread: each agent's runtime workers, then none.
    let base = settle(threads());
    {
        let mem = pattern::alloc_filled(layout()).expect("patterned memory");
        let prefill =
            kvxfer::blocking::PrefillAgent::start(config("prefill").worker_threads(2), "127.0.0.1:0", mem)
                .expect("prefill");
        let decode = kvxfer::blocking::DecodeAgent::start(
            config("decode").worker_threads(2),
            KvMemory::alloc(layout()).expect("alloc"),
        )
        .expect("decode");
        let result = prefill.lease_parent("B", vec![vec![1], vec![2]], 1, None).expect("lease");
        assert!(decode.submit(result, vec![vec![1], vec![2]]).expect("submit").wait().all_done());
        eprintln!("blocking round: {base} threads before, {} with both agents", threads());
        assert_eq!(threads(), base + 4, "two runtime workers per blocking agent");
    }
    assert_eq!(settle(base), base, "threads after the blocking agents were dropped");

    // With UCX: one progress thread per agent while it lives (UCX starts on the runtime's
    // blocking pool, kept idle only briefly here), none after the shutdown.
    #[cfg(feature = "ucx")]
    {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_keep_alive(Duration::from_millis(50))
            .enable_all()
            .build()
            .expect("rt");
        let before = rt.block_on(async { threads() });
        let ucx = |name: &str| Transport::UcxShm.config(config(name));
        let during = rt.block_on(async_round_with(ucx));
        eprintln!("UCX round: {before} threads before, {during} while both agents lived");
        assert!(during >= before + 2, "a UCX progress thread per agent: {during} vs {before}");
        assert_eq!(settle(before), before, "threads after the UCX round");
    }
}
