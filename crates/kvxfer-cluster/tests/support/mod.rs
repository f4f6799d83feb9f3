//! A real etcd for tests: Debian's `etcd` binary (package `etcd-server`) on 127.0.0.1 free
//! ports with its own data directory, killed and removed when dropped (also on panic).
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer_cluster::{
    AdvertiseAddr, AgentName, DirectoryEvent, DirectoryEvents, EngineId, EngineKey, EngineRecord, EtcdConfig,
    Namespace, TransportName,
};

/// How long etcd may take to become healthy (it takes ~1 s here).
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running etcd.
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    starts: u32,
}

fn etcd_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("ETCD_BIN") {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|p| p.join("etcd")).find(|p| p.is_file()))
        .unwrap_or_default();
    found.unwrap_or_else(|| {
        panic!(
            "the etcd binary was not found on PATH: these tests run a real etcd. Install Debian's \
             etcd-server package (apt-get install etcd-server; scripts/test-all.sh does) or set ETCD_BIN"
        )
    })
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// Logs to the test's output (`RUST_LOG=kvxfer_cluster=debug` for more).
pub fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("kvxfer_cluster=info"));
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter(filter).try_init();
}

impl EtcdServer {
    /// Starts a fresh single-member etcd and waits until it is healthy.
    pub fn start() -> Self {
        init_logs();
        let dir = tempfile::Builder::new().prefix("kvxfer-etcd-").tempdir().expect("temp dir");
        let mut server = Self { child: None, dir, client_port: 0, peer_port: 0, starts: 0 };
        // Free ports are picked by binding and releasing them; another process may take
        // one meanwhile, so try a few pairs.
        let mut last = String::new();
        for _ in 0..3 {
            server.client_port = free_port();
            server.peer_port = free_port();
            match server.spawn_and_wait() {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("etcd did not start: {last}");
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Etcd settings for tests: short timeouts and backoff so recovery is quick.
    pub fn config(&self) -> EtcdConfig {
        fast_config(&self.endpoint())
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("etcd-{}.log", self.starts))
    }

    fn spawn_and_wait(&mut self) -> Result<(), String> {
        self.starts += 1;
        let log = std::fs::File::create(self.log_path()).map_err(|e| e.to_string())?;
        let err_log = log.try_clone().map_err(|e| e.to_string())?;
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let client = self.endpoint();
        let child = Command::new(etcd_binary())
            .arg("--name=kvxfer-test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=kvxfer-test={peer}"))
            .arg("--initial-cluster-state=new")
            .arg(format!("--initial-cluster-token=kvxfer-test-{}", std::process::id()))
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err_log))
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", etcd_binary().display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!("etcd exited with {status}: {}", tail(&self.log_path())));
                }
            }
            if self.healthy() {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(format!("etcd not healthy after {START_TIMEOUT:?}: {}", tail(&self.log_path())));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `GET /health` answers `"health":"true"`.
    fn healthy(&self) -> bool {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.client_port));
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains(r#""health":"true""#)
    }

    /// Kills etcd (SIGKILL) and waits for it to exit. The data directory stays.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes etcd (SIGSTOP): its connections stay open and nothing answers, as when
    /// etcd hangs or the network drops packets.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused etcd (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("etcd running").id().to_string();
        let status = Command::new("kill").args([signal, &pid]).status().expect("run kill");
        assert!(status.success(), "kill {signal} {pid}: {status}");
    }

    /// Starts etcd again on the same ports and data directory.
    pub fn restart(&mut self) {
        self.kill();
        if let Err(e) = self.spawn_and_wait() {
            panic!("etcd did not restart: {e}");
        }
    }

    /// Starts an empty etcd on the same ports: its data is gone (leases, keys, revisions).
    pub fn restart_empty(&mut self) {
        self.kill();
        std::fs::remove_dir_all(self.data_dir()).expect("remove etcd data");
        if let Err(e) = self.spawn_and_wait() {
            panic!("etcd did not restart: {e}");
        }
    }

    /// A raw client, for writing what agents would not.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], None).await.expect("etcd client")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too.
        self.kill();
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Short timeouts and backoff: tests see recovery within a second.
pub fn fast_config(endpoint: &str) -> EtcdConfig {
    let mut c = EtcdConfig::new([endpoint]);
    c.connect_timeout = Duration::from_millis(500);
    c.request_timeout = Duration::from_secs(1);
    c.keepalive_interval = Duration::from_millis(500);
    c.keepalive_timeout = Duration::from_millis(500);
    c.backoff_initial = Duration::from_millis(50);
    c.backoff_max = Duration::from_millis(500);
    c
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
