//! Why a decode-side connection failed ([`ClientError`], re-exported by `client`) and why its
//! authentication did ([`AuthError`], re-exported by `handshake`): below both `client` and
//! `handshake` (whose connecting side fails with them), which import it.

use kvxfer_proto::v1::ErrorCode;

use crate::frame::FrameError;

/// Why a client operation failed. The connection is unusable after any error except
/// [`ClientError::Refused`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The connection broke, timed out, or carried a bad frame.
    #[error("connection to {peer}: {source}")]
    Frame {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        #[source]
        source: FrameError,
    },
    /// The peer refused the handshake (version or compatibility mismatch).
    #[error("handshake with {peer} refused: {message}")]
    Handshake {
        /// The peer's address.
        peer: String,
        /// The peer's message, naming both values.
        message: String,
    },
    /// The peer refused the handshake at one of its connection limits (`LIMIT_EXCEEDED`:
    /// `Limits::max_connections`, `max_handshakes` or their per-peer caps): it is there and
    /// busy; a later attempt may be taken.
    #[error("handshake with {peer} refused: {message}")]
    Busy {
        /// The peer's address.
        peer: String,
        /// The peer's message, naming the limit.
        message: String,
    },
    /// The two sides are not compatible: protocol versions or layout compatibility hashes
    /// differ (refused by the peer, or found in its `HelloAck`).
    #[error("handshake with {peer} refused: {message}")]
    Incompatible {
        /// The peer's address.
        peer: String,
        /// `VersionMismatch` or `CompatMismatch`.
        code: ErrorCode,
        /// The message, naming both sides' values.
        message: String,
        /// The peer's value (protocol version or compatibility hash) when known: from its
        /// `HelloAck`; a refusal by the peer states it only in `message`.
        remote: Option<u64>,
    },
    /// The peer refused a request; the connection stays usable.
    #[error("{peer} refused the request ({code:?}): {message}")]
    Refused {
        /// The peer's address.
        peer: String,
        /// The error code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// The peer answered with something the protocol does not allow here.
    #[error("protocol violation by {peer}: {message}")]
    Protocol {
        /// The peer's address.
        peer: String,
        /// What was wrong.
        message: String,
    },
    /// A payload failed its integrity check: its length or CRC-32C differs from what the
    /// peer announced. Nothing of it may be used.
    #[error("read {seq} from {peer}: payload failed its integrity check ({detail})")]
    Integrity {
        /// The peer's address.
        peer: String,
        /// The read's sequence number.
        seq: u64,
        /// What differed.
        detail: String,
    },
    /// The authenticated handshake failed or was refused (no key, another key, a replayed
    /// handshake); the connection is closed.
    #[error("handshake with {peer} refused: {reason}")]
    Auth {
        /// The peer's address.
        peer: String,
        /// What failed.
        reason: AuthError,
    },
    /// Could not connect.
    #[error("connecting to {peer}: {source}")]
    Connect {
        /// The address.
        peer: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl ClientError {
    /// Whether the connection can still be used.
    pub fn connection_usable(&self) -> bool {
        matches!(self, ClientError::Refused { .. })
    }

    /// Whether it is a timeout: no answer (or no progress) within the I/O timeout, or a
    /// connect that timed out.
    pub fn is_timeout(&self) -> bool {
        match self {
            ClientError::Frame { source: FrameError::Timeout, .. } => true,
            ClientError::Connect { source, .. } => source.kind() == std::io::ErrorKind::TimedOut,
            _ => false,
        }
    }
}

/// Why the authenticated handshake failed, as the connecting side saw it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The peer serves only key holders and this agent has no cluster key.
    #[error("the peer requires a cluster key and this agent has none ({message})")]
    KeyRequired {
        /// The peer's message.
        message: String,
    },
    /// This agent has a key and the peer answered without the challenge-response.
    #[error("the peer did not prove the cluster key (it has none); refusing an unauthenticated peer")]
    PeerUnauthenticated,
    /// The peer's `HelloAck` did not come with a valid MAC: the peer does not hold the key,
    /// or a party in between altered or replayed the answer.
    #[error(
        "the peer's handshake answer did not verify (it does not hold the cluster key, or a relay altered or replayed it)"
    )]
    BadAck,
    /// The peer refused this agent's proof (a different key), or cannot authenticate.
    #[error("the peer refused the handshake: {message}")]
    Refused {
        /// The peer's message.
        message: String,
    },
    /// The challenge was not well formed.
    #[error("malformed challenge: {detail}")]
    Malformed {
        /// What was wrong.
        detail: String,
    },
}
