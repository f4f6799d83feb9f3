//! Pulls under steady load while one member of a three-member etcd cluster is killed
//! (`kill -9`) or frozen (SIGSTOP): a prefill agent registered through all three endpoints,
//! a decode agent resolving through discovery, pulling continuously; after the kill a second
//! prefill agent starts with the dead member listed first and is pulled from too. No pull may
//! fail, and the first engine's key keeps its lease.
//!
//! Each scenario (a follower killed, the leader killed, a follower frozen) loads for 10 s by
//! default; the figures of a longer run (pulls done and failed, the time from the kill to the
//! registration's and the directory's reconnection) are printed. The 60 s run:
//!
//! ```sh
//! KVXFER_ETCD_HA_SECS=60 cargo test -p kvxfer --features cluster --test etcd_ha -- --nocapture --test-threads=1
//! ```
#![cfg(feature = "cluster")]

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::cluster::{DirectoryEvent, DiscoveryConfig, EtcdConfig, EtcdState, EtcdStatus};
use kvxfer::{AgentConfig, BlockId, BlockLayout};
use kvxfer_cluster::testing::EtcdCluster;
use support::*;

const NS: &str = "kvxfer-etcd-ha";
const ENGINE: &str = "engine-ha";
const SECOND: &str = "engine-ha-2";
/// The registration's lease TTL: the kill must be survived well within it. 6 s, as the
/// cluster guide advises for an HA etcd (at least 5 s): a frozen member is noticed by an
/// unanswered keep-alive (about 2 s), then the registration reconnects to a live member and
/// keeps the lease alive there — with 4 s, a fully loaded CI machine once took longer and
/// the lease expired (re-granted, no pull failed).
const TTL: Duration = Duration::from_secs(6);

fn load_time() -> Duration {
    let secs = std::env::var("KVXFER_ETCD_HA_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    Duration::from_secs(secs)
}

fn layout() -> BlockLayout {
    BlockLayout::single(64, BLOCK).expect("layout")
}

/// Which member dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    /// A follower, the member both agents connect to (listed first).
    Follower,
    /// The raft leader, the member both agents connect to (listed first).
    Leader,
    /// A follower both agents connect to, frozen (SIGSTOP) instead of killed: its
    /// connections stay open and nothing answers.
    Frozen,
}

/// What a run came to.
#[derive(Debug)]
struct Figures {
    victim: Victim,
    pulls_done: u64,
    pulls_failed: u64,
    failures: Vec<String>,
    events: Vec<String>,
    registration_back: Option<Duration>,
    directory_back: Option<Duration>,
    registration_after: Option<EtcdStatus>,
    /// How long the second engine took to register with the dead member listed first.
    second_registered: Duration,
    /// The second engine's registration at the end of the load.
    second_status: Option<EtcdStatus>,
    /// The key's lease before the kill and after the load.
    leases: (i64, i64),
}

/// Waits up to 20 s for `cond`.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The time from `since` until `status` says connected to another endpoint than `dead`
/// (polled every 10 ms for up to 20 s).
fn reconnected(
    since: Instant,
    dead: &str,
    mut status: impl FnMut() -> Option<EtcdStatus>,
) -> Option<Duration> {
    while since.elapsed() < Duration::from_secs(20) {
        if let Some(s) = status() {
            if s.state == EtcdState::Connected && s.endpoint.as_deref().is_some_and(|e| e != dead) {
                return Some(since.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

fn run(victim: Victim) -> Figures {
    let mut cluster = EtcdCluster::start(3);
    let leader = {
        let mut leader = None;
        wait_for("a leader", || {
            leader = cluster.leader();
            leader.is_some()
        });
        leader.expect("a leader")
    };
    let target = match victim {
        Victim::Leader => leader,
        Victim::Follower | Victim::Frozen => (leader + 1) % cluster.size(),
    };
    // `--etcd T --etcd X --etcd Y` with the default timeouts and backoff: the victim
    // first, so both agents connect to it.
    let mut endpoints = cluster.endpoints();
    endpoints.rotate_left(target);
    let etcd = EtcdConfig::new(endpoints);
    let dead = cluster.endpoint(target);
    let discovery = DiscoveryConfig { etcd, namespace: NS.into(), registration_ttl: TTL };

    let prefill = prefill_with(
        AgentConfig::new("prefill")
            .engine_id(ENGINE)
            .io_timeout(Duration::from_secs(5))
            .discovery(discovery.clone()),
        layout(),
    );
    if let Err(status) = prefill.wait_registered(Duration::from_secs(20)) {
        panic!("not registered: {status:?}");
    }
    let decode = decode_with(
        AgentConfig::new("decode").io_timeout(Duration::from_secs(5)).discovery(discovery.clone()),
        layout(),
    );
    let dir = decode.directory().expect("a directory").clone();
    wait_for("the engine in the directory", || {
        dir.resolve(ENGINE, 0).is_some_and(|e| e.record.incarnation == prefill.incarnation())
    });
    assert_eq!(prefill.registration_status().and_then(|s| s.endpoint).as_deref(), Some(dead.as_str()));
    assert_eq!(dir.status().endpoint.as_deref(), Some(dead.as_str()));
    let mut events = dir.subscribe();
    let lease_before = lease_of(&cluster, (target + 1) % cluster.size());

    let load = load_time();
    let stop = Arc::new(AtomicBool::new(false));
    let puller = {
        let stop = stop.clone();
        let (prefill, decode) = (Arc::new(prefill), Arc::new(decode));
        let p = prefill.clone();
        let d = decode.clone();
        let handle = std::thread::spawn(move || pull_until(&p, &d, 0, &stop));
        (handle, prefill, decode)
    };
    std::thread::sleep(load / 3);
    let killed = Instant::now();
    match victim {
        Victim::Frozen => cluster.pause(target),
        _ => cluster.kill(target),
    }
    let prefill = &puller.1;
    let registration_back = reconnected(killed, &dead, || prefill.registration_status());
    let directory_back = reconnected(killed, &dead, || Some(dir.status()));
    // A second engine starts with the dead member listed first (`--etcd DEAD --etcd B
    // --etcd C`): it registers, keeps its lease, and is pulled from too.
    let second = Arc::new(prefill_with(
        AgentConfig::new("prefill-2")
            .engine_id(SECOND)
            .io_timeout(Duration::from_secs(5))
            .discovery(discovery),
        layout(),
    ));
    let started = Instant::now();
    if let Err(status) = second.wait_registered(Duration::from_secs(20)) {
        panic!("{SECOND} not registered with {dead} down: {status:?}");
    }
    let second_registered = started.elapsed();
    wait_for("the second engine in the directory", || {
        dir.resolve(SECOND, 0).is_some_and(|e| e.record.incarnation == second.incarnation())
    });
    let second_puller = {
        let (stop, p, d) = (stop.clone(), second.clone(), puller.2.clone());
        std::thread::spawn(move || pull_until(&p, &d, 32, &stop))
    };
    std::thread::sleep(load.saturating_sub(killed.elapsed() + load / 3).max(load / 3));
    let second_status = second.registration_status();
    stop.store(true, Ordering::SeqCst);
    let (mut pulls_done, mut pulls_failed, mut failures) = puller.0.join().expect("puller");
    let (done, failed, more) = second_puller.join().expect("puller");
    pulls_done += done;
    pulls_failed += failed;
    failures.extend(more);
    let events: Vec<String> = std::iter::from_fn(|| events.try_recv())
        .map(|e| match e {
            DirectoryEvent::Added(e) => format!("added {}", e.key),
            DirectoryEvent::Updated { new, .. } => format!("updated {}", new.key),
            DirectoryEvent::Removed(e) => format!("removed {}", e.key),
        })
        .collect();
    // The second engine's arrival is the one event expected.
    let events = events.into_iter().filter(|e| *e != format!("added /{NS}/v1/engines/{SECOND}/0")).collect();
    let registration_after = prefill.registration_status();
    let lease_after = lease_of(&cluster, (target + 1) % cluster.size());
    puller.1.shutdown();
    second.shutdown();
    Figures {
        second_registered,
        second_status,
        victim,
        pulls_done,
        pulls_failed,
        failures,
        events,
        registration_back,
        directory_back,
        registration_after,
        leases: (lease_before, lease_after),
    }
}

/// The lease the engine's key is on, read from member `i`.
fn lease_of(cluster: &EtcdCluster, i: usize) -> i64 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let key = format!("/{NS}/v1/engines/{ENGINE}/0");
        let got = cluster.client(i).await.get(key, None).await.expect("get");
        got.kvs().first().map_or(0, |kv| kv.lease())
    })
}

fn blocks(i: u64) -> Vec<Vec<BlockId>> {
    let first = (i % 8) as u32 * 4;
    vec![vec![first, first + 1], vec![first + 2, first + 3]]
}

/// Pulls one hand-off after another (every other one naming only the engine id, resolved
/// through the directory) into local blocks from `base` on until `stop`; returns (done,
/// failed, the first failures).
fn pull_until(
    prefill: &PrefillAgent,
    decode: &DecodeAgent,
    base: u32,
    stop: &AtomicBool,
) -> (u64, u64, Vec<String>) {
    let (mut done, mut failed, mut failures) = (0u64, 0u64, Vec::new());
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let remote = blocks(i);
        let result = prefill.lease_parent(&format!("P{i}"), remote.clone(), 1, None).expect("lease");
        let result = if i.is_multiple_of(2) { result } else { result.engine_only() };
        let local: Vec<Vec<BlockId>> = remote.iter().map(|b| b.iter().map(|x| x + base).collect()).collect();
        let report = decode.submit(result, local.clone()).expect("submit").wait();
        if report.all_done() && remote.iter().zip(&local).all(|(r, l)| verify(decode, r, l)) {
            done += 1;
        } else {
            failed += 1;
            if failures.len() < 5 {
                failures.push(format!("{report:?}"));
            }
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    (done, failed, failures)
}

fn check(f: &Figures) {
    eprintln!(
        "etcd member killed ({:?}), {:?} of load: {} pulls done, {} failed; registration back on a live member \
         after {:?}, directory after {:?}; a second engine registered in {:?} with the dead member listed \
         first; registration {:?}; second {:?}",
        f.victim,
        load_time(),
        f.pulls_done,
        f.pulls_failed,
        f.registration_back,
        f.directory_back,
        f.second_registered,
        f.registration_after,
        f.second_status
    );
    assert_eq!(f.pulls_failed, 0, "{:#?}", f.failures);
    assert_ne!(f.leases.0, 0, "registered");
    assert_eq!(f.leases.0, f.leases.1, "the key kept its lease");
    assert!(f.pulls_done > 10, "{f:?}");
    assert_eq!(f.events, Vec::<String>::new(), "the engine left or changed in the directory");
    // A generous bound: the lease is what must survive (checked above), and a new leader
    // extends every lease, so an election may take longer than the TTL without cost.
    let back = f.registration_back.expect("the registration reconnected to a live member");
    assert!(back < Duration::from_secs(15), "{back:?}");
    assert!(f.directory_back.is_some(), "the directory reconnected to a live member");
    for after in [&f.registration_after, &f.second_status] {
        let after = after.as_ref().expect("registered");
        assert_eq!(after.state, EtcdState::Connected, "{after:?}");
    }
    let second = f.second_status.as_ref().expect("registered");
    assert_eq!(second.failures, 0, "the dead member broke the second registration: {second:?}");
}

/// The member both agents use is killed under load: first a follower, then (a fresh
/// cluster) the leader — a failover and an election at once — then a follower is frozen
/// (SIGSTOP: nothing resets the connections, the agents must notice the silence). One test, the scenarios one
/// after the other: a second cluster started while the first one's agents were loading the
/// machine had members exit at start (see `EtcdCluster::launch`).
#[test]
fn a_killed_etcd_member_of_three_fails_no_pull() {
    for victim in [Victim::Follower, Victim::Leader, Victim::Frozen] {
        check(&run(victim));
    }
}
