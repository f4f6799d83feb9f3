//! The async agents on a host's tokio runtime (multi-thread and current-thread), the
//! blocking facade's refusal inside a runtime, and agents dropped inside a runtime while
//! pulls are in flight: bounded, no blocked runtime thread, every lease ends exactly once.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvxfer::{
    AgentConfig, BlockId, BlockLayout, ChildOutcome, DecodeAgent, EndKind, Error, KvMemory, PrefillAgent,
};
use kvxfer_mem::pattern;
use support::*;

fn layout(blocks: u32) -> BlockLayout {
    BlockLayout::single(blocks, BLOCK).expect("layout")
}

async fn agents(blocks: u32) -> (PrefillAgent, DecodeAgent) {
    init_tracing();
    let config = |name: &str| keyed(AgentConfig::new(name).io_timeout(Duration::from_secs(5)));
    let mem = pattern::alloc_filled(layout(blocks)).expect("patterned memory");
    let prefill = PrefillAgent::start(config("prefill"), "127.0.0.1:0", mem).await.expect("prefill");
    let decode = DecodeAgent::start(config("decode"), KvMemory::alloc(layout(blocks)).expect("alloc"))
        .await
        .expect("decode");
    (prefill, decode)
}

/// Leases n children, pulls them through the report stream, awaits the pull, and checks
/// every byte and every lease end (through the lease-end stream); then shuts both down.
async fn pull_and_shut_down(n: u32) {
    let (prefill, decode) = agents(64).await;
    let mut ends = prefill.lease_ends();
    let remote: Vec<Vec<BlockId>> = (0..n).map(|i| vec![2 * i, 2 * i + 1]).collect();
    let local: Vec<Vec<BlockId>> = (0..n).map(|i| vec![32 + 2 * i, 33 + 2 * i]).collect();
    let result = prefill.lease_parent("A", remote.clone(), 1, None).expect("lease");
    let mut pull = decode.submit(result, local.clone()).expect("submit");
    // Per-child reports as a stream: the first one, then the whole report.
    let first = pull.next().await.expect("a report");
    assert!(matches!(first.outcome, ChildOutcome::Done { acknowledged: true, .. }), "{first:?}");
    let report = pull.await;
    assert!(report.all_done(), "{report:?}");
    assert_eq!(report.children.len(), n as usize);
    for i in 0..n as usize {
        assert!(verify_async(&decode, &remote[i], &local[i]));
    }
    let mut seen = Vec::new();
    for _ in 0..n {
        let end =
            tokio::time::timeout(Duration::from_secs(10), ends.next()).await.expect("in time").expect("end");
        assert_eq!(end.kind, EndKind::Pulled);
        seen.push(end.child_index);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..n).collect::<Vec<_>>());
    decode.shutdown().await;
    prefill.shutdown().await;
    // After the shutdown the stream ends: every end was delivered.
    assert!(ends.next().await.is_none());
    assert_eq!(prefill.stats().leases.live, 0);
}

fn verify_async(decode: &DecodeAgent, remote: &[BlockId], local: &[BlockId]) -> bool {
    // SAFETY: only children whose pull has reported are verified.
    let bad = unsafe { pattern::check_blocks(decode.memory(), remote, local) }.expect("in layout");
    bad.is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_agents_on_a_multi_thread_runtime() {
    pull_and_shut_down(4).await;
}

#[tokio::test(flavor = "current_thread")]
async fn async_agents_on_a_current_thread_runtime() {
    pull_and_shut_down(4).await;
}

#[tokio::test(flavor = "current_thread")]
async fn blocking_agents_refuse_to_start_inside_a_runtime() {
    let mem = KvMemory::alloc(layout(4)).expect("alloc");
    match kvxfer::blocking::DecodeAgent::start(AgentConfig::new("decode"), mem) {
        Err(Error::InsideRuntime { call, instead }) => {
            assert!(call.contains("blocking::DecodeAgent::start") && instead.contains("DecodeAgent::start"));
        }
        other => panic!("expected InsideRuntime, got {other:?}"),
    }
    let mem = KvMemory::alloc(layout(4)).expect("alloc");
    let e = kvxfer::blocking::PrefillAgent::start(AgentConfig::new("p"), "127.0.0.1:0", mem)
        .expect_err("refused");
    assert!(e.to_string().contains("from inside a tokio runtime"), "{e}");
}

/// A ticker on the same current-thread runtime: it only advances while the runtime's one
/// thread is free, so a drop that blocked the thread would stop it.
fn ticker() -> (Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let ticks = Arc::new(AtomicU64::new(0));
    let t = ticks.clone();
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(1)).await;
            t.fetch_add(1, Ordering::Relaxed);
        }
    });
    (ticks, task)
}

async fn wait_ticks(ticks: &AtomicU64, from: u64, more: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while ticks.load(Ordering::Relaxed) < from + more {
        assert!(tokio::time::Instant::now() < deadline, "the runtime made no progress");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Drops the decode agent, then the prefill agent, each while pulls are in flight, on a
/// current-thread runtime: the drops return at once, the runtime keeps running another task,
/// and every lease still ends exactly once.
#[tokio::test(flavor = "current_thread")]
async fn agents_dropped_inside_a_runtime_mid_pull_end_every_lease_once() {
    let blocks = 2048u32; // 8 MiB per child
    let (prefill, decode) = agents(8 * blocks).await;
    let events = prefill.events().clone();
    let (ticks, ticker) = ticker();
    let remote: Vec<Vec<BlockId>> = (0..4).map(|i| (i * blocks..(i + 1) * blocks).collect()).collect();
    let result = prefill.lease_parent("D", remote.clone(), 1, None).expect("lease");
    let pull = decode.submit(result, remote.clone()).expect("submit");
    tokio::task::yield_now().await;
    let before = ticks.load(Ordering::Relaxed);
    drop(decode);
    wait_ticks(&ticks, before, 5).await;
    // The pull goes on (or is ended by the shutdown): every child is reported.
    let report = tokio::time::timeout(Duration::from_secs(20), pull).await.expect("bounded");
    assert_eq!(report.children.len(), 4, "{report:?}");

    // Now leases with nobody pulling them: dropping the prefill agent releases them.
    let more =
        prefill.lease_parent("E", vec![vec![4 * blocks], vec![4 * blocks + 1]], 1, None).expect("lease");
    let _ = more;
    let before = ticks.load(Ordering::Relaxed);
    drop(prefill);
    wait_ticks(&ticks, before, 5).await;
    // Every lease ends exactly once, and the channel disconnects after the last one.
    let mut ends = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match events.try_recv() {
            Ok(e) => ends.push(e),
            Err(crossbeam_channel::TryRecvError::Empty) => {
                assert!(tokio::time::Instant::now() < deadline, "only {} ends so far", ends.len());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err(crossbeam_channel::TryRecvError::Disconnected) => break,
        }
    }
    ticker.abort();
    let mut ids: Vec<&str> = ends.iter().map(|e| &*e.remote_request_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["0_D", "0_E", "1_D", "1_E", "2_D", "3_D"]);
    for e in &ends {
        if &*e.parent_request_id == "E" {
            assert_eq!(e.kind, EndKind::Released, "released by the shutdown: {}", e.remote_request_id);
        }
    }
}

/// The decode agent's graceful shutdown ends a pull stuck in its handshake with
/// `PullError::Shutdown` once the grace is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_a_stuck_pull_with_shutdown_errors() {
    // A peer that accepts and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let config = AgentConfig::new("decode")
        .io_timeout(Duration::from_secs(60))
        .shutdown_grace(Duration::from_millis(100));
    let decode =
        DecodeAgent::start(keyed(config), KvMemory::alloc(layout(16)).expect("alloc")).await.expect("decode");
    let (prefill, _) = agents(16).await;
    let mut wire = prefill.lease_parent("S", vec![vec![1], vec![2]], 1, None).expect("lease").to_wire();
    for c in &mut wire.children {
        c.remote_port = u32::from(port);
    }
    let pull = decode.submit_wire(wire, vec![vec![1], vec![2]]).expect("submit");
    tokio::time::sleep(Duration::from_millis(50)).await;
    tokio::time::timeout(Duration::from_secs(10), decode.shutdown()).await.expect("bounded by the grace");
    let report = pull.await;
    for c in &report.children {
        let ChildOutcome::Failed { error, .. } = &c.outcome else { panic!("{report:?}") };
        assert_eq!(error, &kvxfer::PullError::Shutdown);
        assert_eq!(error.advice(), kvxfer::Advice::FailRequest);
    }
    match decode.submit(prefill.lease_parent("T", vec![vec![3]], 1, None).expect("lease"), vec![vec![3]]) {
        Err(Error::Submit(kvxfer::SubmitError::ShuttingDown { .. })) => {}
        other => panic!("expected ShuttingDown, got {other:?}"),
    }
    drop(silent);
    prefill.shutdown().await;
}

/// `DecodeAgent::release` on the host's runtime: a child is released without being pulled
/// while its sibling is pulled; the lease-end stream says so.
#[tokio::test(flavor = "current_thread")]
async fn a_child_released_without_pulling_it_on_a_current_thread_runtime() {
    let (prefill, decode) = agents(16).await;
    let mut ends = prefill.lease_ends();
    let result = prefill.lease_parent("Q", vec![vec![1, 2], vec![3, 4]], 1, None).expect("lease");
    assert!(decode.release(&result.children()[0]).await);
    let report = decode.submit_subset(&result, vec![(1, vec![3, 4])]).expect("submit").await;
    assert!(report.all_done(), "{report:?}");
    let mut kinds = Vec::new();
    for _ in 0..2 {
        let end =
            tokio::time::timeout(Duration::from_secs(10), ends.next()).await.expect("in time").expect("end");
        kinds.push((end.child_index, end.kind));
    }
    kinds.sort_unstable_by_key(|k| k.0);
    assert_eq!(kinds, [(0, EndKind::Released), (1, EndKind::Pulled)]);
    assert_eq!(decode.stats().leases_released, 1);
    decode.shutdown().await;
    prefill.shutdown().await;
}

/// No lease is made once the prefill agent shut down (its ends could never be delivered):
/// `lease` and `lease_parent` are refused, and the lease-end stream has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_lease_is_made_after_the_prefill_agent_shut_down() {
    let (prefill, decode) = agents(16).await;
    let mut ends = prefill.lease_ends();
    prefill.shutdown().await;
    match prefill.lease_parent("Z", vec![vec![1]], 1, None) {
        Err(Error::Core(kvxfer_core::Error::Lease(kvxfer_core::LeaseError::Closed(id)))) => {
            assert!(id.contains('Z'), "{id}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(ends.next().await.is_none());
    assert_eq!(prefill.stats().leases.live, 0);
    decode.shutdown().await;
}

/// A pull whose runtime shuts down under it (the task is dropped, not finished) still gives
/// one report per child: failed, the agent shut down — never a short report that says
/// "all done".
#[test]
fn a_pull_dropped_with_its_runtime_reports_every_child_failed() {
    let host =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    let test_rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    // A peer that accepts and never answers: the pull stays in its handshake.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let (prefill, pull) = host.block_on(async {
        let (prefill, decode) = agents(16).await;
        let mut wire = prefill.lease_parent("V", vec![vec![1], vec![2]], 1, None).expect("lease").to_wire();
        for c in &mut wire.children {
            c.remote_port = u32::from(port);
        }
        let pull = decode.submit_wire(wire, vec![vec![5], vec![6]]).expect("submit");
        tokio::time::sleep(Duration::from_millis(50)).await;
        std::mem::forget(decode);
        (prefill, pull)
    });
    host.shutdown_background();
    let report =
        test_rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), pull).await.expect("ends") });
    assert!(!report.all_done(), "{report:?}");
    assert_eq!(report.children.len(), 2, "{report:?}");
    for (c, local) in report.children.iter().zip([5, 6]) {
        let ChildOutcome::Failed { error, invalid_local_blocks } = &c.outcome else { panic!("{report:?}") };
        assert_eq!(error, &kvxfer::PullError::Shutdown);
        assert_eq!(invalid_local_blocks, &vec![local]);
    }
    std::mem::forget(prefill);
    drop(silent);
}

/// The lease-end stream ends when the agent's runtime goes away under it, instead of
/// waiting for ever.
#[test]
fn lease_ends_end_when_the_agents_runtime_is_gone() {
    let host =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    let test_rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let (prefill, mut ends) = host.block_on(async {
        let (prefill, decode) = agents(16).await;
        let ends = prefill.lease_ends();
        std::mem::forget(decode);
        (prefill, ends)
    });
    host.shutdown_background();
    let next = test_rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), ends.next()).await });
    assert!(matches!(next, Ok(None)), "the stream should have ended");
    std::mem::forget(prefill);
}

/// A blocking agent dropped inside a tokio runtime (an async task owned it) still runs its
/// graceful shutdown: its live lease ends Released and the end is delivered.
#[test]
fn a_blocking_agent_dropped_inside_a_runtime_still_shuts_down_gracefully() {
    let host =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    let prefill = support::prefill(16, Duration::from_secs(30));
    prefill.lease_parent("B", vec![vec![1]], 1, None).expect("lease");
    let events = prefill.events().clone();
    host.block_on(async move { drop(prefill) });
    let end = events.recv_timeout(Duration::from_secs(10)).expect("the lease's end is delivered");
    assert_eq!(end.kind, EndKind::Released);
}

/// Waiting "for ever" through the blocking facade does not overflow `Instant`.
#[test]
fn a_blocking_wait_of_duration_max_does_not_panic() {
    let prefill = support::prefill(16, Duration::from_secs(30));
    let decode = support::decode(16);
    let result = prefill.lease_parent("M", vec![vec![1]], 1, None).expect("lease");
    let pull = decode.submit(result, vec![vec![2]]).expect("submit");
    let report = pull.next_report(Duration::MAX).expect("a report");
    assert!(matches!(report.outcome, ChildOutcome::Done { .. }), "{report:?}");
    assert!(pull.next_report(Duration::MAX).is_none());
}
