//! etcd failing under a live registration and directory (real etcd processes): a dead
//! endpoint listed beside a live one, and an etcd that stalls for less than the lease TTL.

mod support;

use std::time::{Duration, Instant};

use kvxfer_cluster::testing::dead_endpoint;
use kvxfer_cluster::{
    DirectoryEvent, DirectoryEvents, DirectoryOptions, EngineDirectory, EtcdConfig, EtcdState, Registration,
    RegistrationConfig,
};
use support::{key, namespace, record, start_etcd, wait_added, LAYOUT_HASH};
use tokio::runtime::Handle;

const WAIT: Duration = Duration::from_secs(15);

fn register(etcd: EtcdConfig, engine: &str, incarnation: u64, ttl: Duration) -> Registration {
    let config = RegistrationConfig { key: key(engine, 0), record: record(7000, incarnation), ttl };
    Registration::start(&Handle::current(), etcd, config).expect("start registration")
}

async fn registered(reg: &Registration) {
    if let Err(status) = reg.wait_registered(WAIT).await {
        panic!("not registered: {status:?}");
    }
}

async fn directory(etcd: EtcdConfig) -> EngineDirectory {
    let options = DirectoryOptions { expected_compat_hash: Some(LAYOUT_HASH), ..Default::default() };
    let dir =
        EngineDirectory::start(&Handle::current(), etcd, namespace(), options).expect("start directory");
    dir.wait_synced(WAIT).await.expect("directory synced");
    dir
}

/// The creation revision of engine-s's key (0: absent).
async fn created_revision(etcd: &support::EtcdServer) -> i64 {
    let got = etcd.client().await.get(key("engine-s", 0).to_key(), None).await.expect("get");
    got.kvs().first().map_or(0, |kv| kv.create_revision())
}

/// Every event queued now.
fn drain(events: &mut DirectoryEvents) -> Vec<DirectoryEvent> {
    std::iter::from_fn(|| events.try_recv()).collect()
}

/// The issue's `--etcd http://ALIVE --etcd http://DEAD`: a member that is down, listed
/// before or after the live one, costs neither lease nor key — the registration keeps its
/// one lease alive on the live member, and a directory listing both never sees the engine
/// leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_listed_beside_a_live_one_costs_no_lease() {
    let etcd = start_etcd();
    let dead = dead_endpoint();
    // The default settings, as `--etcd A --etcd B` gives them.
    let with = |endpoints: [&str; 2]| EtcdConfig::new(endpoints);
    let alive = etcd.endpoint();
    let ttl = Duration::from_secs(2);
    let dir = directory(with([&dead, &alive])).await;
    let mut events = dir.subscribe();
    let first = register(with([&alive, &dead]), "engine-a", 0xa1, ttl);
    let second = register(with([&dead, &alive]), "engine-b", 0xb1, ttl);
    registered(&first).await;
    registered(&second).await;
    wait_added(&mut events, &["engine-a", "engine-b"]).await;

    // Four TTLs: a lease not kept alive would have expired (and been granted again).
    tokio::time::sleep(4 * ttl).await;
    for reg in [&first, &second] {
        let (stats, status) = (reg.stats(), reg.status());
        assert_eq!((stats.grants, stats.leases_lost), (1, 0), "{}: {stats:?} {status:?}", reg.key());
        assert_eq!(status.failures, 0, "the dead member broke the registration: {status:?}");
        assert!(stats.keepalives >= 6, "{stats:?}");
        assert_eq!(status.state, EtcdState::Connected, "{status:?}");
        assert_eq!(status.endpoint.as_deref(), Some(alive.as_str()), "{status:?}");
    }
    assert_eq!(drain(&mut events), [], "the directory saw an engine leave or change");
    assert_eq!((dir.status().state, dir.status().failures), (EtcdState::Connected, 0), "{:?}", dir.status());
    assert_eq!(dir.status().endpoint.as_deref(), Some(alive.as_str()));
    first.shutdown().await.expect("shutdown");
    second.shutdown().await.expect("shutdown");
    dir.shutdown().await;
}

/// etcd frozen (SIGSTOP) for less than the lease TTL, beginning most of a keep-alive
/// interval of the TTL/3 schedule after the last answer: the lease outlives the stall, so the
/// directory sees no `Removed`/`Added` of the live engine (no pooled connection dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_stall_shorter_than_the_ttl_does_not_flap_a_live_engine() {
    let etcd = start_etcd();
    let ttl = Duration::from_secs(6);
    let stall = Duration::from_millis(3500);
    let dir = directory(etcd.config()).await;
    let mut events = dir.subscribe();
    let reg = register(etcd.config(), "engine-s", 0x51, ttl);
    registered(&reg).await;
    wait_added(&mut events, &["engine-s"]).await;
    let lease = reg.lease_id();
    let created = created_revision(&etcd).await;

    // Right after a keep-alive answer, then 1.8 s on: keep-alives every TTL/3 = 2 s
    // leave the lease 4.2 s then, so a 3.5 s stall ends 0.7 s before it expires — time for
    // the registration to reach etcd again on a loaded machine (a 4 s stall, 0.2 s before
    // expiry, showed the same before and after the change but leaves CI no slack).
    let answered = reg.stats().keepalives;
    let deadline = Instant::now() + WAIT;
    while reg.stats().keepalives == answered {
        assert!(Instant::now() < deadline, "no keep-alive answered: {:?}", reg.status());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(1800)).await;
    etcd.pause();
    let paused = Instant::now();
    tokio::time::sleep(stall).await;
    etcd.resume();
    let resumed = paused.elapsed();

    // Registration and directory back; no event about the engine meanwhile or after.
    let mut watch = reg.status_watch();
    watch.wait_until(WAIT, |s| s.state == EtcdState::Connected).await.expect("registration back");
    dir.wait_synced(WAIT).await.expect("directory back");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stats = reg.stats();
    assert_eq!(
        drain(&mut events),
        [],
        "the engine flapped after a {resumed:?} stall (TTL {ttl:?}): {stats:?} {:?}",
        reg.status()
    );
    assert_eq!((stats.grants, stats.leases_lost), (1, 0), "{stats:?}");
    assert_eq!(reg.lease_id(), lease, "the same lease throughout");
    // Deleted and put again (what a directory connected meanwhile sees as Removed, Added)
    // would show as a new creation revision.
    assert_eq!(created_revision(&etcd).await, created, "the key was deleted and put again");
    assert!(dir.resolve("engine-s", 0).is_some());
    reg.shutdown().await.expect("shutdown");
    dir.shutdown().await;
}
