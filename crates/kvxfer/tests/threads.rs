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

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_owned())
        .collect()
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
    // The agents started no thread of their own but the prefill's front door.
    let during = threads();
    decode.shutdown().await;
    prefill.shutdown().await;
    drop((decode, prefill));
    during
}

/// A blocking prefill agent over patterned memory and a blocking decode agent.
fn blocking_agents(
    prefill: AgentConfig,
    decode: AgentConfig,
) -> (kvxfer::blocking::PrefillAgent, kvxfer::blocking::DecodeAgent) {
    let mem = pattern::alloc_filled(layout()).expect("patterned memory");
    let prefill = kvxfer::blocking::PrefillAgent::start(prefill, "127.0.0.1:0", mem).expect("prefill");
    let decode = kvxfer::blocking::DecodeAgent::start(decode, KvMemory::alloc(layout()).expect("alloc"))
        .expect("decode");
    (prefill, decode)
}

/// The nice value of thread `tid` of this process (field 19 of its `stat`).
fn nice_of(tid: &str) -> i64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("stat");
    // Fields after the command (which may hold spaces) start after its closing parenthesis.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    after.split_whitespace().nth(16).and_then(|f| f.parse().ok()).expect("nice")
}

/// The front door runs at a nice value 10 above the process's (the default), so a flood of
/// connections that prove nothing gets the CPU the served connections leave.
fn the_front_door_runs_at_a_lowered_priority() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let mem = pattern::alloc_filled(layout()).expect("patterned memory");
    let prefill = rt.block_on(PrefillAgent::start(config("prefill"), "127.0.0.1:0", mem)).expect("prefill");
    // The thread names itself and lowers its priority as it starts: wait for it (bounded).
    let main = std::process::id().to_string();
    let want = (nice_of(&main) + 10).min(19);
    let door = || {
        std::fs::read_dir("/proc/self/task").ok()?.filter_map(Result::ok).find_map(|t| {
            let tid = t.file_name().to_string_lossy().into_owned();
            let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
            (comm.trim() == "kvxfer-accept").then(|| nice_of(&tid))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while door() != Some(want) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(door(), Some(want), "the front door's nice value");
    rt.block_on(prefill.shutdown());
}

#[test]
fn no_agent_leaks_a_thread_in_any_mode() {
    init_tracing();
    the_front_door_runs_at_a_lowered_priority();
    // That agent's front door thread ends after its shutdown returned: not in the count below.
    eventually("the first front door's thread ended", || {
        !thread_names().iter().any(|n| n == "kvxfer-accept")
    });
    // On a multi-thread runtime: counted inside it, so its own workers are in both counts.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let before = rt.block_on(async { threads() });
    let during = rt.block_on(async_round());
    assert_eq!(during, before + 1, "async agents start one thread, the prefill's front door (TCP)");
    assert_eq!(settle(before), before, "threads after the multi-thread round");
    // Without a front door, none.
    let during = rt.block_on(async_round_with(|n| config(n).front_door(None)));
    assert_eq!(during, before, "async agents without a front door start no threads");
    assert_eq!(settle(before), before, "threads after the round without a front door");
    drop(rt);

    // On a current-thread runtime.
    let base = settle(threads());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let during = rt.block_on(async_round());
    assert_eq!(during, base + 1, "async agents start only the front door (TCP, current-thread)");
    drop(rt);
    assert_eq!(settle(base), base, "threads after the current-thread round");

    // A prefill agent whose runtime is dropped without a shutdown: its front door stops too.
    let base = settle(threads());
    {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        let mem = pattern::alloc_filled(layout()).expect("patterned memory");
        let prefill =
            rt.block_on(PrefillAgent::start(config("prefill"), "127.0.0.1:0", mem)).expect("prefill");
        assert_eq!(threads(), base + 1);
        drop(rt);
        drop(prefill);
    }
    assert_eq!(settle(base), base, "the front door outlived its agent's runtime");

    // The blocking facade from a plain thread: each agent's runtime workers, then none.
    let base = settle(threads());
    {
        let (prefill, decode) =
            blocking_agents(config("prefill").worker_threads(2), config("decode").worker_threads(2));
        let result = prefill.lease_parent("B", vec![vec![1], vec![2]], 1, None).expect("lease");
        assert!(decode.submit(result, vec![vec![1], vec![2]]).expect("submit").wait().all_done());
        eprintln!("blocking round: {base} threads before, {} with both agents", threads());
        assert_eq!(
            threads(),
            base + 5,
            "two runtime workers per blocking agent, and the prefill's front door"
        );
    }
    assert_eq!(settle(base), base, "threads after the blocking agents were dropped");

    // The blocking facade with `worker_threads(0)`: one thread driving a current-thread
    // runtime per agent (and the front door), then none; the agents work the same.
    let base = settle(threads());
    {
        let (prefill, decode) = blocking_agents(
            config("prefill").worker_threads(0),
            config("decode").worker_threads(0).notify_with_read(true),
        );
        for round in 0..3 {
            let parent = format!("C{round}");
            let result = prefill.lease_parent(&parent, vec![vec![1, 2], vec![3]], 1, None).expect("lease");
            let pull = decode.submit(result, vec![vec![4, 5], vec![6]]).expect("submit");
            let first = pull.next_report(Duration::from_secs(10)).expect("a report");
            assert!(matches!(first.outcome, kvxfer::ChildOutcome::Done { .. }), "{first:?}");
            assert!(pull.wait().all_done());
        }
        // SAFETY: the pulls above finished; nothing writes the decode memory now.
        let bad = unsafe { pattern::check_blocks(decode.memory(), &[1, 2, 3], &[4, 5, 6]) };
        assert_eq!(bad.expect("checking the blocks"), None, "the pulled bytes");
        let names = thread_names();
        eprintln!(
            "current-thread blocking round: {base} threads before, {} with both agents: {names:?}",
            threads()
        );
        assert_eq!(threads(), base + 3, "one driver thread per agent, and the prefill's front door");
        for agent in ["kvxfer-prefill", "kvxfer-decode"] {
            assert_eq!(names.iter().filter(|n| *n == agent).count(), 1, "{agent}'s one driver thread");
        }
    }
    assert_eq!(settle(base), base, "threads after the current-thread blocking agents were dropped");

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

        drop(rt);
        assert!(kvxfer::wait_for_teardown(Duration::from_secs(10)), "no teardown left from the UCX round");

        // A blocking prefill agent's `shutdown` returns only once its UCX target is torn down
        // (on a thread of its own): a process that exits right after it (kvxfer-node on
        // SIGTERM) must not run UCX's exit handlers under a worker still being destroyed.
        let ucx = |name: &str| Transport::UcxShm.config(config(name));
        let (prefill, decode) = blocking_agents(ucx("prefill"), ucx("decode"));
        prefill.shutdown();
        assert!(kvxfer::wait_for_teardown(Duration::ZERO), "prefill's UCX teardown outlived its shutdown");
        drop((decode, prefill));
    }
}
