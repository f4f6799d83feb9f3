//! The prefill agents a decode agent talks to: pooled data connections, one control
//! connection per peer (notify / heartbeat / cancel never wait behind a large read), and the
//! mapping of connection errors to typed [`PullError`]s.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::report::add;
use super::Inner;
use kvxfer_core::pull::{MismatchField, PullError};
use kvxfer_proto::v1::{self, ErrorCode, LeaseOutcome};
use kvxfer_tcp::{ClientError, Connection, FrameError};
use tokio::sync::Semaphore;
use tracing::debug;

/// Attempts a control exchange (notify, cancel, heartbeat) makes at most: the first, and
/// retries on fresh connections after one failed midway.
const CONTROL_ATTEMPTS: u32 = 3;

/// A connection waiting in a pool, and since when.
struct Pooled {
    conn: Connection,
    since: Instant,
}

impl Pooled {
    fn new(conn: Connection) -> Self {
        Pooled { conn, since: Instant::now() }
    }

    /// Whether it may be reused: the peer did not close it, and it has been idle for less
    /// than `max_idle` (the prefill side closes connections idle for its `idle_timeout`; a
    /// request racing that close would fail).
    fn reusable(&self, max_idle: Duration) -> bool {
        self.since.elapsed() < max_idle && !self.conn.closed_by_peer()
    }
}

/// A prefill agent this decode agent talks to.
pub(crate) struct Peer {
    pub(crate) addr: String,
    idle: Mutex<Vec<Pooled>>,
    permits: Semaphore,
    control: tokio::sync::Mutex<Option<Pooled>>,
    /// Longest a pooled connection may have been idle to be reused: half the agent's
    /// `Limits::idle_timeout`.
    max_idle: Duration,
    /// The engine id and incarnation our UCX endpoint to this address was made for (a
    /// restarted prefill at the same address gets a new endpoint).
    #[cfg(feature = "ucx")]
    pub(crate) ucx_engine: tokio::sync::Mutex<Option<(String, u64)>>,
    /// The name of this peer's UCX endpoint in the initiator: the address and a number
    /// unique to this `Peer`, so a peer forgotten (or invalidated) while a pull still holds
    /// it closes its own endpoint, never that of a newer `Peer` for the same address.
    #[cfg(feature = "ucx")]
    pub(crate) ucx_endpoint: String,
    /// Closes the UCX endpoint when the peer is dropped (`None` without UCX).
    #[cfg(feature = "ucx")]
    ucx_disconnector: Option<kvxfer_ucx::Disconnector>,
}

/// Closes the peer's UCX endpoint (and so unmaps the prefill side's shared memory its rkeys
/// attached, see `kvxfer_ucx::UcxBuffer`) once nothing uses the peer any more: it was
/// forgotten (`Inner::peer`), invalidated by discovery, or the agent is dropped. Reads in
/// flight on it finish first.
#[cfg(feature = "ucx")]
impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(d) = &self.ucx_disconnector {
            d.disconnect(&self.ucx_endpoint);
        }
    }
}

impl Peer {
    /// A peer at `addr` with `connections` data connections at most, whose pooled connections
    /// are reused while idle for less than half of `idle_timeout`.
    pub(crate) fn new(addr: &str, connections: usize, idle_timeout: Duration) -> Self {
        Peer {
            addr: addr.to_owned(),
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(connections.max(1)),
            control: tokio::sync::Mutex::new(None),
            max_idle: idle_timeout / 2,
            #[cfg(feature = "ucx")]
            ucx_engine: tokio::sync::Mutex::new(None),
            #[cfg(feature = "ucx")]
            ucx_endpoint: {
                static PEERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                format!("{addr}#{}", PEERS.fetch_add(1, Ordering::Relaxed))
            },
            #[cfg(feature = "ucx")]
            ucx_disconnector: None,
        }
    }

    /// The peer, closing its UCX endpoint with `disconnector` when dropped.
    #[cfg(feature = "ucx")]
    pub(crate) fn with_ucx(mut self, disconnector: Option<kvxfer_ucx::Disconnector>) -> Self {
        self.ucx_disconnector = disconnector;
        self
    }

    /// A data connection for one request: waits for one of the peer's permits, then reuses an
    /// idle connection or opens a new one. The flag says whether it was reused.
    pub(crate) async fn checkout(
        &self,
        inner: &Inner,
    ) -> Result<(tokio::sync::SemaphorePermit<'_>, Connection, bool), PullError> {
        // The semaphore is never closed.
        let permit = self.permits.acquire().await.map_err(|_| PullError::Shutdown)?;
        // Skip pooled connections the peer closed meanwhile (it restarted, or timed them out)
        // or that sat idle long enough for the peer to be about to.
        let idle = {
            let mut pool = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            std::iter::from_fn(|| pool.pop()).find(|p| p.reusable(self.max_idle))
        };
        let (conn, reused) = match idle {
            Some(p) => (p.conn, true),
            None => (self.connect(inner).await?, false),
        };
        Ok((permit, conn, reused))
    }

    /// A new data connection (for a read retried after its pooled connection broke).
    pub(crate) async fn connect(&self, inner: &Inner) -> Result<Connection, PullError> {
        inner.connect(&self.addr).await.map_err(|e| pull_error(&e, inner))
    }

    /// Forgets every connection to the peer (it is no longer the engine they were made to).
    pub(crate) async fn reset(&self) {
        *self.control.lock().await = None;
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Whether the peer closed every connection this agent holds to it (or there are none).
    /// A pull in progress may hold the control lock: then it is not gone.
    pub(crate) fn is_gone(&self) -> bool {
        let Ok(control) = self.control.try_lock() else { return false };
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        control.as_ref().is_none_or(|p| p.conn.closed_by_peer())
            && idle.iter().all(|p| p.conn.closed_by_peer())
    }

    /// Returns a connection to the pool after a request ended with `r`, unless the error
    /// left it unusable (it is dropped then).
    pub(crate) fn checkin<T>(&self, conn: Connection, r: &Result<T, ClientError>) {
        if r.as_ref().err().is_none_or(ClientError::connection_usable) {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(Pooled::new(conn));
        }
    }

    /// The peer's handshake answer, from the control connection (connecting if needed).
    pub(crate) async fn hello(&self, inner: &Inner) -> Result<v1::HelloAck, ClientError> {
        let mut slot = self.control.lock().await;
        let conn = match slot.take().filter(|p| p.reusable(self.max_idle)) {
            Some(p) => p.conn,
            None => inner.connect(&self.addr).await?,
        };
        let ack = conn.peer_hello().clone();
        *slot = Some(Pooled::new(conn));
        Ok(ack)
    }

    /// Runs `op` on the peer's control connection, unless `reachable` is cleared (`None`):
    /// waits for exchanges ahead of it, then connects (again) if needed.
    ///
    /// The connection is out of its slot while `op` runs and goes back only when `op`
    /// finished with it usable: an exchange cut short (its future dropped, e.g. a heartbeat
    /// when a notify needs the connection) or failed drops the connection, so no later
    /// exchange reads its stale reply.
    ///
    /// An attempt that fails midway (reset, closed, garbled) is retried on a fresh connection
    /// (at most [`CONTROL_ATTEMPTS`] in all, counted in `DecodeStats::control_retries`; the
    /// second value returned is the number of attempts, since a retried notify may find its
    /// first attempt counted). Each attempt has `Limits::io_timeout`, and all of them twice
    /// that. A peer that cannot be reached — refused or failed handshakes, a fresh connection
    /// (or a retry) unanswered within its time, the whole budget spent — clears `reachable`
    /// (`None`): the pull's later exchanges are skipped rather than each waiting out the
    /// timeouts again (a partitioned or frozen prefill host).
    pub(crate) async fn exchange(
        &self,
        inner: &Inner,
        op: &ControlOp,
        reachable: &AtomicBool,
    ) -> Option<(Result<ControlReply, ClientError>, u32)> {
        let mut slot = self.control.lock().await;
        if !reachable.load(Ordering::Relaxed) {
            return None;
        }
        let io = inner.config.limits.io_timeout;
        let started = std::time::Instant::now();
        let budget =
            tokio::time::Instant::from_std(crate::runtime::instant_after(started, io.saturating_mul(2)));
        let mut attempt = 1;
        loop {
            let pooled = slot.take().filter(|p| p.reusable(self.max_idle)).map(|p| p.conn);
            let reused = pooled.is_some();
            let deadline =
                tokio::time::Instant::from_std(crate::runtime::instant_after(std::time::Instant::now(), io))
                    .min(budget);
            let once = async {
                let mut conn = match pooled {
                    Some(c) => c,
                    None => inner.connect(&self.addr).await?,
                };
                let r = op.run(&mut conn).await;
                if r.as_ref().err().is_none_or(ClientError::connection_usable) {
                    *slot = Some(Pooled::new(conn));
                }
                r
            };
            let r = tokio::time::timeout_at(deadline, once).await;
            let timed_out = match &r {
                Err(_) => true,
                Ok(Err(e)) => is_timeout(e),
                Ok(Ok(_)) => false,
            };
            // Unanswered on a fresh connection, or out of time: the peer cannot answer.
            // (A pooled connection may just have gone stale: one fresh attempt is made.)
            let out_of_time = tokio::time::Instant::now() >= budget;
            if timed_out && (!reused || attempt >= CONTROL_ATTEMPTS || out_of_time) {
                debug!(peer = %self.addr, attempt, "control exchange unanswered; the peer counts as unreachable");
                reachable.store(false, Ordering::Relaxed);
                return None;
            }
            let r = match r {
                Ok(r) => r,
                Err(_) => Err(ClientError::Frame { peer: self.addr.clone(), source: FrameError::Timeout }),
            };
            match &r {
                Err(e) if unreachable_peer(e) => {
                    reachable.store(false, Ordering::Relaxed);
                    return None;
                }
                Err(e) if !e.connection_usable() && attempt < CONTROL_ATTEMPTS && !out_of_time => {
                    debug!(peer = %self.addr, error = %e, attempt, "control exchange failed; retrying on a fresh connection");
                    add(&inner.counters.control_retries, 1);
                    attempt += 1;
                }
                _ => return Some((r, attempt)),
            }
        }
    }
}

/// Whether a connection error is a timeout: no answer (or no progress) within the io timeout.
fn is_timeout(e: &ClientError) -> bool {
    match e {
        ClientError::Frame { source: FrameError::Timeout, .. } => true,
        ClientError::Connect { source, .. } => source.kind() == std::io::ErrorKind::TimedOut,
        _ => false,
    }
}

/// One exchange on a peer's control connection.
#[derive(Debug)]
pub(crate) enum ControlOp {
    Notify { id: String, token: Vec<u8>, consumer: String },
    Cancel { id: String, token: Vec<u8> },
    Heartbeat(Vec<v1::LeaseRef>),
}

/// The answer to a [`ControlOp`], variant for variant.
#[derive(Debug)]
pub(crate) enum ControlReply {
    Notify(v1::NotifyAck),
    Cancel(LeaseOutcome),
    Heartbeat(Vec<LeaseOutcome>),
}

impl ControlOp {
    async fn run(&self, c: &mut Connection) -> Result<ControlReply, ClientError> {
        Ok(match self {
            ControlOp::Notify { id, token, consumer } => {
                ControlReply::Notify(c.notify(id, token, consumer).await?)
            }
            ControlOp::Cancel { id, token } => ControlReply::Cancel(c.cancel(id, token).await?),
            ControlOp::Heartbeat(leases) => ControlReply::Heartbeat(c.heartbeat(leases.clone()).await?),
        })
    }
}

/// Whether a failed control exchange means the peer cannot be reached at all (no point in
/// retrying), rather than that one exchange broke.
pub(crate) fn unreachable_peer(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Connect { .. }
            | ClientError::Handshake { .. }
            | ClientError::Incompatible { .. }
            | ClientError::Auth { .. }
    )
}

/// The typed pull error of a connection error. Messages are the connection error's own.
pub(crate) fn pull_error(e: &ClientError, inner: &Inner) -> PullError {
    let detail = e.to_string();
    match e {
        ClientError::Connect { peer, .. } => PullError::Connect { peer: peer.clone(), detail },
        ClientError::Auth { peer, .. } => PullError::Authentication { peer: peer.clone(), detail },
        ClientError::Incompatible { peer, code, message, remote } => {
            let (field, local) = match code {
                ErrorCode::VersionMismatch => {
                    (MismatchField::ProtocolVersion, u64::from(inner.config.protocol_version))
                }
                _ => {
                    (MismatchField::CompatHash, kvxfer_core::groups_compat_hash(inner.memory.group_layouts()))
                }
            };
            PullError::Incompatible {
                peer: peer.clone(),
                field,
                local,
                remote: *remote,
                message: message.clone(),
            }
        }
        ClientError::Handshake { peer, message } => {
            PullError::HandshakeRefused { peer: peer.clone(), message: message.clone() }
        }
        ClientError::Frame { peer, source: FrameError::Timeout } => {
            PullError::Timeout { peer: peer.clone(), detail }
        }
        ClientError::Frame { peer, source: FrameError::Io(_) | FrameError::Closed } => {
            PullError::ConnectionLost { peer: peer.clone(), detail }
        }
        ClientError::Frame { peer, .. } | ClientError::Protocol { peer, .. } => {
            PullError::Protocol { peer: peer.clone(), detail }
        }
        ClientError::Integrity { peer, .. } => PullError::Integrity { peer: peer.clone(), detail },
        ClientError::Refused { peer, code, message } => match code {
            ErrorCode::UnknownLease | ErrorCode::BadToken => {
                let remote_request_id = String::new();
                PullError::LeaseUnknown { peer: peer.clone(), remote_request_id, message: message.clone() }
            }
            ErrorCode::LeaseEnded => {
                let remote_request_id = String::new();
                PullError::LeaseEnded { peer: peer.clone(), remote_request_id, message: message.clone() }
            }
            _ => PullError::Refused { peer: peer.clone(), detail },
        },
        _ => PullError::ConnectionLost { peer: String::new(), detail },
    }
}

/// [`pull_error`] of a read of lease `id`: lease refusals name it.
pub(crate) fn read_error(e: &ClientError, inner: &Inner, id: &str) -> PullError {
    match pull_error(e, inner) {
        PullError::LeaseUnknown { peer, message, .. } => {
            PullError::LeaseUnknown { peer, remote_request_id: id.to_owned(), message }
        }
        PullError::LeaseEnded { peer, message, .. } => {
            PullError::LeaseEnded { peer, remote_request_id: id.to_owned(), message }
        }
        other => other,
    }
}
