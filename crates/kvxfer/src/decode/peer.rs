//! The prefill agents a decode agent talks to: pooled data connections, pooled control
//! connections of their own (notify / heartbeat / cancel never wait behind a large read, nor
//! behind each other), and the
//! mapping of connection errors to typed [`PullError`]s. A peer's pool itself ([`Peer`]) is
//! the agent's shared state ([`super::shared`]).

use std::sync::atomic::{AtomicBool, Ordering};

use super::report::add;
use super::shared::{Inner, Peer, Pooled};
use kvxfer_core::log;
use kvxfer_core::pull::{MismatchField, PullError};
use kvxfer_proto::v1::{self, ErrorCode, LeaseOutcome};
use kvxfer_tcp::{ClientError, Connection, FrameError};
use tracing::debug;

/// Attempts a control exchange (notify, cancel, heartbeat) makes at most: the first, and
/// retries on fresh connections after one failed midway.
const CONTROL_ATTEMPTS: u32 = 3;

impl Peer {
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

    /// The peer's handshake answer: an idle control connection's, or a new connection's
    /// (then pooled). It waits behind no exchange under way, only for a control permit when
    /// no connection is idle and [`super::shared::CONTROL_CONNECTIONS_PER_PEER`] are in use;
    /// a burst of pulls shares the connections the first ones opened.
    pub(crate) async fn hello(&self, inner: &Inner) -> Result<v1::HelloAck, ClientError> {
        let idle_ack = || {
            let (pooled, generation) = self.checkout_control();
            pooled.map(|p| {
                let ack = p.conn.peer_hello().clone();
                // Nothing was sent: it keeps its idle time.
                self.checkin_control(p, generation);
                ack
            })
        };
        if let Some(ack) = idle_ack() {
            return Ok(ack);
        }
        // The semaphore is never closed.
        let _permit = self.control_permits.acquire().await.ok();
        // Another hello may have pooled a connection while this one waited.
        if let Some(ack) = idle_ack() {
            return Ok(ack);
        }
        self.fresh_hello(inner).await
    }

    /// The handshake answer of a new control connection (then pooled): what answers at the
    /// address now, whatever the pooled connections say. The caller holds a control permit,
    /// or accepts one connection more.
    pub(crate) async fn fresh_hello(&self, inner: &Inner) -> Result<v1::HelloAck, ClientError> {
        let generation = self.lock_control().generation;
        let conn = inner.connect(&self.addr).await?;
        let ack = conn.peer_hello().clone();
        self.checkin_control(Pooled::new(conn), generation);
        Ok(ack)
    }

    /// Runs `op` on a control connection of the peer's of its own (an idle one, or a new
    /// one), unless `reachable` is cleared (`None`). Exchanges run side by side, up to
    /// [`super::shared::CONTROL_CONNECTIONS_PER_PEER`] at once: one the prefill side holds for its arm wait
    /// (a cancel of a lease it does not know) delays no other.
    ///
    /// The connection is out of the pool while `op` runs and goes back only when `op`
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
        let io = inner.config.limits.io_timeout;
        let started = std::time::Instant::now();
        let budget =
            tokio::time::Instant::from_std(crate::runtime::instant_after(started, io.saturating_mul(2)));
        // The wait for a control permit counts against the budget: every one held past it
        // by exchanges the peer does not answer means the peer cannot answer this one either.
        // (The semaphore is never closed.)
        let Ok(_permit) = tokio::time::timeout_at(budget, self.control_permits.acquire()).await else {
            debug!(peer = %self.addr, "every control connection stayed busy for the exchange's whole time; the peer counts as unreachable");
            reachable.store(false, Ordering::Relaxed);
            return None;
        };
        if !reachable.load(Ordering::Relaxed) {
            return None;
        }
        let mut attempt = 1;
        loop {
            let (pooled, generation) = self.checkout_control();
            let pooled = pooled.map(|p| p.conn);
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
                    self.checkin_control(Pooled::new(conn), generation);
                }
                r
            };
            let r = tokio::time::timeout_at(deadline, once).await;
            let timed_out = match &r {
                Err(_) => true,
                Ok(Err(e)) => e.is_timeout(),
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
                    debug!(peer = %self.addr, error = %log::Peer(&e), attempt, "control exchange failed; retrying on a fresh connection");
                    add(&inner.counters.control_retries, 1);
                    attempt += 1;
                    // Refused at a connection limit: the peer is there and busy; the retry
                    // waits a little (jittered, within the budget) for a place to free up.
                    if matches!(e, ClientError::Busy { .. }) {
                        let pause = std::time::Duration::from_millis(20 + rand::random::<u64>() % 80);
                        tokio::time::sleep_until((tokio::time::Instant::now() + pause).min(budget)).await;
                    }
                }
                _ => return Some((r, attempt)),
            }
        }
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
    pub(crate) async fn run(&self, c: &mut Connection) -> Result<ControlReply, ClientError> {
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
/// retrying), rather than that one exchange broke. A handshake refused at a connection limit
/// (`ClientError::Busy`) is not: the peer is there, and the exchange is retried.
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
        ClientError::Handshake { peer, message } | ClientError::Busy { peer, message } => {
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
