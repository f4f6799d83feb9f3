//! A real etcd for tests and demos (not for production): Debian's `etcd` binary (package
//! `etcd-server`) with its own data directory, on free 127.0.0.1 ports by default or on a
//! given address (optionally started through a wrapper such as `ip netns exec NAME`), killed
//! and its directory removed when dropped (also on panic).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::etcd::EtcdConfig;

/// How long etcd may take to become healthy (it takes ~1 s here).
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Where and how to start etcd.
#[derive(Debug, Clone)]
pub struct EtcdLaunch {
    /// The address etcd listens on (client and peer URLs). Default 127.0.0.1.
    pub ip: IpAddr,
    /// Client and peer ports; `None`: free ports of 127.0.0.1, picked by binding and
    /// releasing them (retried a few times should another process take one meanwhile).
    pub ports: Option<(u16, u16)>,
    /// A program and its arguments that run `etcd` (e.g. `["ip", "netns", "exec", "ns1"]`:
    /// it must exec etcd so that killing the child kills etcd).
    pub wrapper: Vec<String>,
    /// More etcd options (e.g. `--grpc-keepalive-min-time=100ms`).
    pub args: Vec<String>,
    /// The directory etcd's own temporary directory is made in (default: the system's
    /// temporary directory). A script that may kill the process before it cleans up gives
    /// one it removes itself.
    pub data_root: Option<PathBuf>,
}

impl Default for EtcdLaunch {
    /// 127.0.0.1, free ports, etcd's own defaults otherwise.
    fn default() -> Self {
        Self {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            ports: None,
            wrapper: Vec::new(),
            args: Vec::new(),
            data_root: None,
        }
    }
}

impl EtcdLaunch {
    /// 127.0.0.1, free ports, and pings allowed every 100 ms (etcd's default minimum is
    /// 5 s), so clients with [`fast_config`] notice a hung etcd within a second.
    pub fn for_tests() -> Self {
        Self { args: vec!["--grpc-keepalive-min-time=100ms".into()], ..Self::default() }
    }
}

/// A running etcd.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    launch: EtcdLaunch,
    client_port: u16,
    peer_port: u16,
    starts: u32,
}

/// The `etcd` binary: `$ETCD_BIN`, else the first `etcd` on `PATH`.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ETCD_BIN") {
        return Some(PathBuf::from(path));
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join("etcd")).find(|p| p.is_file()))
}

/// Two distinct free ports of 127.0.0.1 (both held while the second is picked).
fn free_ports() -> Result<(u16, u16), String> {
    let bind = || TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("bind 127.0.0.1:0: {e}"));
    let (a, b) = (bind()?, bind()?);
    let port = |l: &TcpListener| l.local_addr().map(|a| a.port()).map_err(|e| e.to_string());
    Ok((port(&a)?, port(&b)?))
}

impl EtcdServer {
    /// Starts a fresh single-member etcd as [`EtcdLaunch::for_tests`] says and waits until
    /// it is healthy.
    ///
    /// # Panics
    /// When etcd is not installed or does not start (what failed, with etcd's log).
    pub fn start() -> Self {
        Self::launch(EtcdLaunch::for_tests()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts a fresh single-member etcd as `launch` says and waits until it is healthy.
    pub fn launch(launch: EtcdLaunch) -> Result<Self, String> {
        if etcd_binary().is_none() {
            return Err("the etcd binary was not found on PATH: install Debian's etcd-server package \
                        (apt-get install etcd-server; scripts/test-all.sh does) or set ETCD_BIN"
                .into());
        }
        let mut builder = tempfile::Builder::new();
        builder.prefix("kvxfer-etcd-");
        let dir = match &launch.data_root {
            Some(root) => builder.tempdir_in(root),
            None => builder.tempdir(),
        }
        .map_err(|e| format!("temp dir: {e}"))?;
        let fixed = launch.ports;
        let mut server = Self { child: None, dir, launch, client_port: 0, peer_port: 0, starts: 0 };
        let mut last = String::new();
        for _ in 0..if fixed.is_some() { 1 } else { 5 } {
            (server.client_port, server.peer_port) = match fixed {
                Some(ports) => ports,
                None => free_ports()?,
            };
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                Err(e) => last = e,
            }
        }
        Err(format!("etcd did not start: {last}"))
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        format!("http://{}", SocketAddr::new(self.launch.ip, self.client_port))
    }

    /// Settings with short timeouts and backoff, so tests see recovery within a second.
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
        let peer = format!("http://{}", SocketAddr::new(self.launch.ip, self.peer_port));
        let client = self.endpoint();
        let etcd = etcd_binary().ok_or("etcd not found")?;
        let mut command = match self.launch.wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&etcd);
                c
            }
            None => Command::new(&etcd),
        };
        let child = command
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
            .args(&self.launch.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err_log))
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", etcd.display()))?;
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
        let addr = SocketAddr::new(self.launch.ip, self.client_port);
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: etcd\r\n\r\n").is_err() {
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
    ///
    /// # Panics
    /// When etcd is not running or `kill` fails.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused etcd (SIGCONT).
    ///
    /// # Panics
    /// When etcd is not running or `kill` fails.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid =
            self.child.as_ref().map(|c| c.id().to_string()).unwrap_or_else(|| panic!("etcd not running"));
        let status = Command::new("kill").args([signal, &pid]).status();
        assert!(status.as_ref().is_ok_and(|s| s.success()), "kill {signal} {pid}: {status:?}");
    }

    /// Starts etcd again on the same ports and data directory.
    ///
    /// # Panics
    /// When it does not come back.
    pub fn restart(&mut self) {
        self.kill();
        if let Err(e) = self.spawn_and_wait() {
            panic!("etcd did not restart: {e}");
        }
    }

    /// Starts an empty etcd on the same ports: its data is gone (leases, keys, revisions).
    ///
    /// # Panics
    /// When the data cannot be removed or etcd does not come back.
    pub fn restart_empty(&mut self) {
        self.kill();
        if let Err(e) = std::fs::remove_dir_all(self.data_dir()) {
            panic!("remove etcd data: {e}");
        }
        if let Err(e) = self.spawn_and_wait() {
            panic!("etcd did not restart: {e}");
        }
    }

    /// A raw client, for writing what agents would not.
    ///
    /// # Panics
    /// When the client cannot be made.
    pub async fn client(&self) -> etcd_client::Client {
        match etcd_client::Client::connect([self.endpoint()], None).await {
            Ok(c) => c,
            Err(e) => panic!("etcd client: {e}"),
        }
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

/// Short timeouts and backoff for `endpoint`: tests see recovery within a second. Its
/// 500 ms pings need an etcd that allows them ([`EtcdLaunch::for_tests`]).
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

/// The etcd client crate, for tests that write what agents would not (leases, raw values).
pub use etcd_client;
