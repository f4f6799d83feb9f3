//! A fault-injecting TCP proxy.
//!
//! Every accepted connection is forwarded to `upstream` (the prefill agent). Offsets count
//! the bytes of one direction of one connection; a [`Fault`] fires when its direction of a
//! matching connection reaches its offset, once per connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Which way bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the decode agent (the proxy's client) to the prefill agent.
    ToPrefill,
    /// From the prefill agent to the decode agent (read payloads flow this way).
    ToDecode,
}

/// What happens at a fault's offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Stop forwarding this direction for a while, then go on.
    Delay(Duration),
    /// Close both connections cleanly (FIN both ways).
    Cut,
    /// Reset both connections (RST: `SO_LINGER` 0).
    Reset,
    /// End this direction with a FIN (the other direction stays open).
    Truncate,
    /// XOR the byte at the offset with this mask (non-zero) and go on.
    Corrupt(u8),
    /// Stop forwarding both directions and stop reading, but keep both connections open:
    /// a peer gone silent without a FIN (half-open).
    Blackhole,
}

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The direction whose byte count triggers it.
    pub direction: Direction,
    /// Bytes of that direction forwarded before it fires.
    pub offset: u64,
    /// What happens.
    pub kind: FaultKind,
    /// Only the connection accepted at this index (0-based); `None`: every connection.
    pub connection: Option<u64>,
}

impl Fault {
    /// A fault on every connection.
    pub fn new(direction: Direction, offset: u64, kind: FaultKind) -> Self {
        Fault { direction, offset, kind, connection: None }
    }
}

/// What the proxy did so far.
#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    faults_fired: AtomicU64,
    to_prefill: AtomicU64,
    to_decode: AtomicU64,
}

/// A snapshot of what the proxy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyStats {
    /// Connections accepted.
    pub connections: u64,
    /// Faults that fired.
    pub faults_fired: u64,
    /// Bytes forwarded to the prefill side.
    pub to_prefill: u64,
    /// Bytes forwarded to the decode side.
    pub to_decode: u64,
}

/// A running proxy on 127.0.0.1 with its own thread and runtime; dropping it closes every
/// connection it holds.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    counters: Arc<Counters>,
    shutdown: Option<watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Starts a proxy on a free port of 127.0.0.1 forwarding to `upstream`, applying
    /// `faults`.
    pub fn start(upstream: SocketAddr, faults: Vec<Fault>) -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let counters = Arc::new(Counters::default());
        let (tx, rx) = watch::channel(false);
        let c = counters.clone();
        let thread = std::thread::Builder::new().name("fault-proxy".into()).spawn(move || {
            rt.block_on(accept_loop(listener, upstream, Arc::new(faults), c, rx));
        })?;
        Ok(FaultProxy { addr, counters, shutdown: Some(tx), thread: Some(thread) })
    }

    /// The address decode agents connect to (`127.0.0.1:port`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the proxy did so far.
    pub fn stats(&self) -> ProxyStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.counters;
        ProxyStats {
            connections: l(&c.connections),
            faults_fired: l(&c.faults_fired),
            to_prefill: l(&c.to_prefill),
            to_decode: l(&c.to_decode),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    faults: Arc<Vec<Fault>>,
    counters: Arc<Counters>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                let index = counters.connections.fetch_add(1, Ordering::Relaxed);
                let mine: Vec<Fault> =
                    faults.iter().filter(|f| f.connection.is_none_or(|c| c == index)).copied().collect();
                tasks.spawn(proxy_connection(client, upstream, mine, counters.clone(), shutdown.clone()));
            }
            _ = shutdown.changed() => break,
        }
    }
    // Dropping the tasks drops (closes) every socket they hold.
    tasks.shutdown().await;
}

/// How one direction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Its source closed or failed: pass the FIN on.
    Eof,
    /// A fault closed both directions (cleanly or with a reset).
    Closed,
    /// A fault truncated this direction only.
    Truncated,
    /// A fault black-holed the connection: hold the sockets until the proxy stops.
    Hold,
}

async fn proxy_connection(
    client: TcpStream,
    upstream: SocketAddr,
    faults: Vec<Fault>,
    counters: Arc<Counters>,
    mut shutdown: watch::Receiver<bool>,
) {
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // Set when a fault ends or freezes the whole connection.
    let (stop_tx, stop_rx) = watch::channel(None::<Ending>);
    let pick = |d| faults.iter().filter(|f| f.direction == d).copied().collect::<Vec<_>>();
    let up =
        pump(cr, sw, pick(Direction::ToPrefill), Direction::ToPrefill, &counters, &stop_tx, stop_rx.clone());
    let down = pump(sr, cw, pick(Direction::ToDecode), Direction::ToDecode, &counters, &stop_tx, stop_rx);
    let (a, b) = tokio::join!(up, down);
    if a.0 == Ending::Hold || b.0 == Ending::Hold {
        // Keep both sockets open and silent until the proxy shuts down.
        let _held = (a, b);
        let _ = shutdown.changed().await;
    }
}

/// Forwards `from` to `to`, applying `faults` (all of this direction). Returns how it ended
/// and the halves, so a black-holed connection can keep them open.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut faults: Vec<Fault>,
    dir: Direction,
    counters: &Counters,
    stop_tx: &watch::Sender<Option<Ending>>,
    mut stop_rx: watch::Receiver<Option<Ending>>,
) -> (Ending, OwnedReadHalf, OwnedWriteHalf) {
    faults.sort_by_key(|f| f.offset);
    let mut faults = std::collections::VecDeque::from(faults);
    let total = match dir {
        Direction::ToPrefill => &counters.to_prefill,
        Direction::ToDecode => &counters.to_decode,
    };
    let mut buf = vec![0u8; 64 * 1024];
    let mut pos: u64 = 0;
    let ending = 'conn: loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => break 'conn Ending::Eof,
                Ok(n) => n,
            },
            _ = stop_rx.changed() => break 'conn stop_rx.borrow().unwrap_or(Ending::Closed),
        };
        let mut chunk = &mut buf[..n];
        loop {
            let fault = faults.front().copied().filter(|f| f.offset < pos + chunk.len() as u64);
            let Some(f) = fault else { break };
            faults.pop_front();
            counters.faults_fired.fetch_add(1, Ordering::Relaxed);
            let at = (f.offset.saturating_sub(pos)) as usize;
            if let FaultKind::Corrupt(mask) = f.kind {
                chunk[at] ^= mask;
                continue;
            }
            // Everything before the offset goes through first.
            if to.write_all(&chunk[..at]).await.is_err() {
                break 'conn Ending::Eof;
            }
            pos += at as u64;
            total.fetch_add(at as u64, Ordering::Relaxed);
            chunk = &mut chunk[at..];
            match f.kind {
                FaultKind::Delay(d) => tokio::time::sleep(d).await,
                FaultKind::Corrupt(_) => {}
                FaultKind::Cut => {
                    let _ = stop_tx.send(Some(Ending::Closed));
                    break 'conn Ending::Closed;
                }
                FaultKind::Reset => {
                    reset_on_close(from.as_ref());
                    reset_on_close(to.as_ref());
                    let _ = stop_tx.send(Some(Ending::Closed));
                    break 'conn Ending::Closed;
                }
                FaultKind::Truncate => break 'conn Ending::Truncated,
                FaultKind::Blackhole => {
                    let _ = stop_tx.send(Some(Ending::Hold));
                    break 'conn Ending::Hold;
                }
            }
        }
        if to.write_all(chunk).await.is_err() {
            break 'conn Ending::Eof;
        }
        pos += chunk.len() as u64;
        total.fetch_add(chunk.len() as u64, Ordering::Relaxed);
    };
    if matches!(ending, Ending::Eof | Ending::Truncated) {
        let _ = to.shutdown().await;
    }
    (ending, from, to)
}

/// Makes closing `s` send a RST instead of a FIN.
fn reset_on_close(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}
