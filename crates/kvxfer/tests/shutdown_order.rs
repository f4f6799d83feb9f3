//! A registered prefill agent deregisters before it stops accepting, whether it is shut
//! down or dropped: decode agents see its key go while its listener is still open, so their
//! pulls fail as `EngineNotRegistered` rather than at a refused connection.
#![cfg(feature = "cluster")]

use std::time::{Duration, Instant};

use kvxfer::cluster::DiscoveryConfig;
use kvxfer::{AgentConfig, BlockLayout, KvMemory, PrefillAgent};
use kvxfer_cluster::testing::EtcdServer;

async fn registered_prefill(etcd: &EtcdServer, name: &str) -> PrefillAgent {
    let discovery = DiscoveryConfig {
        etcd: etcd.config(),
        namespace: "shutdown-order".into(),
        registration_ttl: Duration::from_secs(60),
    };
    let config = AgentConfig::new(name).engine_id(name).discovery(discovery);
    let memory = KvMemory::alloc(BlockLayout::single(16, 4096).expect("layout")).expect("memory");
    let agent = PrefillAgent::start(config, "127.0.0.1:0", memory).await.expect("start");
    agent.wait_registered(Duration::from_secs(15)).await.expect("registered");
    agent
}

/// Whether a TCP connection to `addr` is accepted (the listener is open).
async fn accepts(addr: std::net::SocketAddr) -> bool {
    tokio::net::TcpStream::connect(addr).await.is_ok()
}

/// With etcd stalled, the revoke waits (up to the request timeout): a dropped agent's
/// listener must stay open meanwhile — it closed at once, before the key could go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_agent_keeps_accepting_until_it_deregistered() {
    let etcd = EtcdServer::start();
    let agent = registered_prefill(&etcd, "dropped-prefill").await;
    let addr = agent.local_addr();
    assert!(accepts(addr).await);
    etcd.pause();
    drop(agent);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let open_while_deregistering = accepts(addr).await;
    etcd.resume();
    assert!(open_while_deregistering, "the listener closed before the deregistration");
    // Then it stops accepting (bounded by the revoke's request timeout and the grace).
    let deadline = Instant::now() + Duration::from_secs(15);
    while accepts(addr).await {
        assert!(Instant::now() < deadline, "still accepting 15 s after the drop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The same through `shutdown()`: the key is gone when it returns, and the listener
/// stayed open until the deregistration was done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_deregisters_before_it_stops_accepting() {
    let etcd = EtcdServer::start();
    let agent = std::sync::Arc::new(registered_prefill(&etcd, "stopped-prefill").await);
    let addr = agent.local_addr();
    etcd.pause();
    let stopping = agent.clone();
    let shutdown = tokio::spawn(async move { stopping.shutdown().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let open_while_deregistering = accepts(addr).await;
    etcd.resume();
    shutdown.await.expect("shutdown");
    assert!(open_while_deregistering, "the listener closed before the deregistration");
    assert!(!accepts(addr).await, "closed after shutdown");
    assert!(agent.registration_status().is_none(), "deregistered");
}
