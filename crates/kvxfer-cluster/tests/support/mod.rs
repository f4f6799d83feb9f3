//! Helpers of the discovery tests; the etcd they run is `kvxfer_cluster::testing`'s.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use kvxfer_cluster::{
    AdvertiseAddr, AgentName, DirectoryEvent, DirectoryEvents, EngineId, EngineKey, EngineRecord, Namespace,
    TransportName,
};

/// Logs to the test's output (`RUST_LOG=kvxfer_cluster=debug` for more).
pub fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("kvxfer_cluster=info"));
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter(filter).try_init();
}

pub use kvxfer_cluster::testing::EtcdServer;

/// A real etcd on free 127.0.0.1 ports (`kvxfer_cluster::testing`), with the test's logs on.
pub fn start_etcd() -> EtcdServer {
    init_logs();
    EtcdServer::start()
}

pub const LAYOUT_HASH: u64 = 0x5eed_1a70_0000_0001;

pub fn namespace() -> Namespace {
    Namespace::new("kvxfer-test").expect("namespace")
}

pub fn key(engine: &str, rank: u32) -> EngineKey {
    EngineKey::new(namespace(), EngineId::new(engine).expect("engine id"), rank)
}

pub fn record(port: u16, incarnation: u64) -> EngineRecord {
    EngineRecord {
        addr: AdvertiseAddr::from_socket_addr(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).expect("addr"),
        transports: vec![TransportName::tcp(), TransportName::ucx()],
        compat_hash: LAYOUT_HASH,
        protocol_version: 2,
        incarnation,
        agent: AgentName::new("test-agent").expect("agent"),
        draining: false,
    }
}

/// The next directory event, or a panic naming what was awaited.
pub async fn next_event(events: &mut DirectoryEvents, what: &str) -> DirectoryEvent {
    match tokio::time::timeout(Duration::from_secs(15), events.recv()).await {
        Ok(Some(e)) => e,
        Ok(None) => panic!("directory gone while waiting for {what}"),
        Err(_) => panic!("no directory event within 15 s while waiting for {what}"),
    }
}

/// Waits until each of `engines` was added (other events are skipped).
pub async fn wait_added(events: &mut DirectoryEvents, engines: &[&str]) {
    let mut missing: Vec<&str> = engines.to_vec();
    while !missing.is_empty() {
        let e = next_event(events, &format!("Added {missing:?}")).await;
        missing.retain(|m| !is_added(&e, m));
    }
}

/// Skips events until one satisfies `want`.
pub async fn wait_event(
    events: &mut DirectoryEvents,
    what: &str,
    want: impl Fn(&DirectoryEvent) -> bool,
) -> DirectoryEvent {
    loop {
        let e = next_event(events, what).await;
        if want(&e) {
            return e;
        }
    }
}

pub fn is_added(e: &DirectoryEvent, engine: &str) -> bool {
    matches!(e, DirectoryEvent::Added(x) if x.key.engine_id.as_str() == engine)
}

pub fn is_removed(e: &DirectoryEvent, engine: &str) -> bool {
    matches!(e, DirectoryEvent::Removed(x) if x.key.engine_id.as_str() == engine)
}

/// A TCP proxy on 127.0.0.1 in front of etcd that can cut one client off: while cut, its
/// connections are closed and new ones closed at once (what a long stall or a partition
/// looks like to that client), while other clients reach etcd directly.
pub struct CuttableProxy {
    addr: SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    generation: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl CuttableProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (generation, _) = tokio::sync::watch::channel(0u64);
        let (c, g) = (cut.clone(), generation.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else { continue };
                if c.load(std::sync::atomic::Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                let mut cut_off = g.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut_off.changed() => {}
                    }
                });
            }
        });
        Self { addr, cut, generation, task }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Closes every connection and refuses new ones until [`Self::restore`].
    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
