//! The prefill agents a decode agent talks to: pooled data connections, one control
//! connection per peer (notify / heartbeat / cancel never wait behind a large read), and the
//! mapping of connection errors to typed [`PullError`]s.

use std::sync::Mutex;

use super::Inner;
use kvxfer_core::pull::{MismatchField, PullError};
use kvxfer_proto::v1::{self, ErrorCode, LeaseOutcome};
use kvxfer_tcp::{ClientError, Connection, FrameError};
use tokio::sync::Semaphore;

/// A prefill agent this decode agent talks to.
pub(crate) struct Peer {
    pub(crate) addr: String,
    idle: Mutex<Vec<Connection>>,
    permits: Semaphore,
    control: tokio::sync::Mutex<Option<Connection>>,
    /// The engine id and incarnation our UCX endpoint to this address was made for (a
    /// restarted prefill at the same address gets a new endpoint).
    #[cfg(feature = "ucx")]
    pub(crate) ucx_engine: tokio::sync::Mutex<Option<(String, u64)>>,
}

impl Peer {
    /// A peer at `addr` with `connections` data connections at most.
    pub(crate) fn new(addr: &str, connections: usize) -> Self {
        Peer {
            addr: addr.to_owned(),
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(connections.max(1)),
            control: tokio::sync::Mutex::new(None),
            #[cfg(feature = "ucx")]
            ucx_engine: tokio::sync::Mutex::new(None),
        }
    }

    /// A data connection for one request: waits for one of the peer's permits, then reuses an
    /// idle connection or opens a new one.
    pub(crate) async fn checkout(
        &self,
        inner: &Inner,
    ) -> Result<(tokio::sync::SemaphorePermit<'_>, Connection), PullError> {
        // The semaphore is never closed.
        let permit = self.permits.acquire().await.map_err(|_| PullError::Shutdown)?;
        // Skip pooled connections the peer closed meanwhile (it restarted, or timed them out).
        let idle = {
            let mut pool = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            std::iter::from_fn(|| pool.pop()).find(|c| !c.closed_by_peer())
        };
        let conn = match idle {
            Some(c) => c,
            None => inner.connect(&self.addr).await.map_err(|e| pull_error(&e, inner))?,
        };
        Ok((permit, conn))
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
        control.as_ref().is_none_or(Connection::closed_by_peer) && idle.iter().all(Connection::closed_by_peer)
    }

    /// Returns a connection to the pool after a request ended with `r`, unless the error
    /// left it unusable (it is dropped then).
    pub(crate) fn checkin<T>(&self, conn: Connection, r: &Result<T, ClientError>) {
        if r.as_ref().err().is_none_or(ClientError::connection_usable) {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
        }
    }

    /// Runs `op` on the control connection, connecting (again) if needed. The connection
    /// is out of its slot while `op` runs and goes back only when `op` finished with it
    /// usable: an exchange cut short (its future dropped, e.g. a heartbeat when the pull
    /// ends) or failed drops the connection, so no later exchange reads its stale reply.
    pub(crate) async fn control(&self, inner: &Inner, op: &ControlOp) -> Result<ControlReply, ClientError> {
        let mut slot = self.control.lock().await;
        let mut conn = match slot.take().filter(|c| !c.closed_by_peer()) {
            Some(c) => c,
            None => inner.connect(&self.addr).await?,
        };
        let r = op.run(&mut conn).await;
        if r.as_ref().err().is_none_or(ClientError::connection_usable) {
            *slot = Some(conn);
        }
        r
    }
}

/// One exchange on a peer's control connection.
#[derive(Debug)]
pub(crate) enum ControlOp {
    /// The handshake answer the connection got (no exchange: connects if needed).
    Hello,
    Notify {
        id: String,
        token: Vec<u8>,
        consumer: String,
    },
    Cancel {
        id: String,
        token: Vec<u8>,
    },
    Heartbeat(Vec<v1::LeaseRef>),
}

/// The answer to a [`ControlOp`], variant for variant.
#[derive(Debug)]
pub(crate) enum ControlReply {
    Hello(Box<v1::HelloAck>),
    Notify(v1::NotifyAck),
    Cancel(LeaseOutcome),
    Heartbeat(Vec<LeaseOutcome>),
}

impl ControlOp {
    async fn run(&self, c: &mut Connection) -> Result<ControlReply, ClientError> {
        Ok(match self {
            ControlOp::Hello => ControlReply::Hello(Box::new(c.peer_hello().clone())),
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
                _ => (MismatchField::CompatHash, inner.memory.layout().compat_hash()),
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
