//! The handshake every connection starts with: who the peers are, whether they speak the
//! same protocol and block layout, and — with a [`ClusterKey`] — a mutual HMAC-SHA256
//! challenge-response before anything internal is said.
//!
//! ```text
//! decode (connecting)                         prefill (accepting)
//! Hello{id, nonce_d, authenticated}     ---->
//!                                       <---- HelloChallenge{nonce_p, mac_p}
//! HelloProof{mac_d}                     ---->
//!                                       <---- HelloAck (layout, transports, rkeys) or Error
//! ```
//!
//! `mac_p = HMAC(key, "kvxfer/v2 handshake/accepting" ‖ nonce_d ‖ nonce_p ‖ id)` and
//! `mac_d = HMAC(key, "kvxfer/v2 handshake/connecting" ‖ nonce_d ‖ nonce_p ‖ id)`, where `id`
//! is the hello's protocol version, engine id, agent name and compatibility hash, each field
//! length-prefixed. Both nonces are 32 fresh random bytes, so a recorded challenge fails
//! against a new `nonce_d` and a recorded proof against a new `nonce_p`; the role label
//! keeps one side's MAC from being reflected as the other's. MACs are compared in constant
//! time. Only after the proof verified does the accepting side compare versions and
//! compatibility hashes (naming both values) or send its `HelloAck`; a peer without the key
//! hears `AUTH_REQUIRED` or `AUTH_FAILED` and nothing else.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hmac::{KeyInit, Mac};
use kvxfer_proto::v1::{self, ErrorCode};
use tokio::net::TcpStream;
use tracing::{debug, warn};
use zeroize::Zeroizing;

use crate::client::{ClientError, Connection};
use crate::frame::{self, Frame, FrameError};
use crate::server::ServeContext;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Bytes of each side's handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// Shortest cluster key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 16;
/// Environment variable holding the cluster key as hex (at least 32 hex digits).
pub const CLUSTER_KEY_ENV: &str = "KVXFER_CLUSTER_KEY";
/// Environment variable naming a file that holds the cluster key as hex (whitespace ignored).
pub const CLUSTER_KEY_FILE_ENV: &str = "KVXFER_CLUSTER_KEY_FILE";

/// The secret every agent of one cluster shares; peers prove they hold it in the handshake.
/// Never printed (its `Debug` shows no byte of it), wiped from memory when the last clone
/// is dropped.
#[derive(Clone)]
pub struct ClusterKey(Arc<Zeroizing<Vec<u8>>>);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(<redacted>)")
    }
}

/// Why a cluster key could not be loaded. Messages never contain key material.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// Fewer than [`MIN_KEY_LEN`] bytes.
    #[error("a cluster key needs at least {MIN_KEY_LEN} bytes ({} hex digits); this one has {len}", MIN_KEY_LEN * 2)]
    TooShort {
        /// Bytes given.
        len: usize,
    },
    /// Not an even number of hex digits.
    #[error("the cluster key from {source_name} is not hex")]
    NotHex {
        /// Where it came from (an environment variable or a file path).
        source_name: String,
    },
    /// Both [`CLUSTER_KEY_ENV`] and [`CLUSTER_KEY_FILE_ENV`] are set.
    #[error("both {CLUSTER_KEY_ENV} and {CLUSTER_KEY_FILE_ENV} are set; set one")]
    BothSet,
    /// The key file could not be read.
    #[error("reading the cluster key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl ClusterKey {
    /// A key of these bytes (at least [`MIN_KEY_LEN`]).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        let bytes = Zeroizing::new(bytes.into());
        if bytes.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort { len: bytes.len() });
        }
        Ok(ClusterKey(Arc::new(bytes)))
    }

    /// A key from hex text (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Self, KeyError> {
        Self::from_hex_named(text, "hex text")
    }

    fn from_hex_named(text: &str, source_name: &str) -> Result<Self, KeyError> {
        let bytes = Zeroizing::new(
            hex::decode(text.trim()).map_err(|_| KeyError::NotHex { source_name: source_name.to_owned() })?,
        );
        Self::from_bytes(bytes.to_vec())
    }

    /// A key from a file holding it as hex.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self, KeyError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let text = Zeroizing::new(
            std::fs::read_to_string(path).map_err(|source| KeyError::Read { path: name.clone(), source })?,
        );
        Self::from_hex_named(&text, &name)
    }

    /// The key configured in the environment: hex in [`CLUSTER_KEY_ENV`], or a file named by
    /// [`CLUSTER_KEY_FILE_ENV`]; `None` when neither is set (the agent then runs without
    /// authentication).
    pub fn from_env() -> Result<Option<Self>, KeyError> {
        let inline = std::env::var_os(CLUSTER_KEY_ENV).filter(|v| !v.is_empty());
        let file = std::env::var_os(CLUSTER_KEY_FILE_ENV).filter(|v| !v.is_empty());
        match (inline, file) {
            (Some(_), Some(_)) => Err(KeyError::BothSet),
            (Some(v), None) => {
                let text = Zeroizing::new(
                    v.into_string()
                        .map_err(|_| KeyError::NotHex { source_name: CLUSTER_KEY_ENV.to_owned() })?,
                );
                Self::from_hex_named(&text, CLUSTER_KEY_ENV).map(Some)
            }
            (None, Some(path)) => Self::from_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// A fresh random 32-byte key (for processes that run every agent of their cluster
    /// themselves, such as the loopback example).
    pub fn generate() -> Self {
        let mut bytes = Zeroizing::new(vec![0u8; 32]);
        rand::fill(&mut bytes[..]);
        ClusterKey(Arc::new(bytes))
    }

    fn mac(&self, role: Role, nonce_d: &[u8], nonce_p: &[u8], id: HandshakeId<'_>) -> HmacSha256 {
        // HMAC takes keys of any length; the length is checked at construction anyway.
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.0)
            .unwrap_or_else(|_| <HmacSha256 as KeyInit>::new(&Default::default()));
        let mut field = |bytes: &[u8]| {
            mac.update(&(bytes.len() as u64).to_be_bytes());
            mac.update(bytes);
        };
        field(role.label());
        field(nonce_d);
        field(nonce_p);
        field(&id.protocol_version.to_be_bytes());
        field(id.engine_id.as_bytes());
        field(id.agent_name.as_bytes());
        field(&id.compat_hash.to_be_bytes());
        mac
    }

    /// The MAC `role` sends for a handshake with these nonces over the connecting side's
    /// hello identity.
    pub fn handshake_mac(&self, role: Role, nonce_d: &[u8], nonce_p: &[u8], id: HandshakeId<'_>) -> Vec<u8> {
        self.mac(role, nonce_d, nonce_p, id).finalize().into_bytes().to_vec()
    }

    /// Whether `tag` is `role`'s MAC for these nonces and identity (constant-time compare).
    pub fn verify_handshake_mac(
        &self,
        role: Role,
        nonce_d: &[u8],
        nonce_p: &[u8],
        id: HandshakeId<'_>,
        tag: &[u8],
    ) -> bool {
        self.mac(role, nonce_d, nonce_p, id).verify_slice(tag).is_ok()
    }
}

/// Which side of the handshake a MAC is from (domain separation: neither side's MAC is
/// ever valid as the other's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The accepting (prefill) side: its challenge.
    Accepting,
    /// The connecting (decode) side: its proof.
    Connecting,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Accepting => b"kvxfer/v2 handshake/accepting",
            Role::Connecting => b"kvxfer/v2 handshake/connecting",
        }
    }
}

/// Fresh random handshake nonce.
pub fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_LEN];
    rand::fill(&mut n[..]);
    n
}

/// What a handshake compares: who a side is and what it speaks. Both `Hello` and
/// `HelloAck` carry it.
#[derive(Debug, Clone, Copy)]
pub struct HandshakeId<'a> {
    /// Protocol version.
    pub protocol_version: u32,
    /// Engine id.
    pub engine_id: &'a str,
    /// Agent name.
    pub agent_name: &'a str,
    /// Compatibility hash of the block layout.
    pub compat_hash: u64,
}

impl<'a> From<&'a v1::Hello> for HandshakeId<'a> {
    fn from(h: &'a v1::Hello) -> Self {
        HandshakeId {
            protocol_version: h.protocol_version,
            engine_id: &h.engine_id,
            agent_name: &h.agent_name,
            compat_hash: h.compat_hash,
        }
    }
}

impl<'a> From<&'a v1::HelloAck> for HandshakeId<'a> {
    fn from(h: &'a v1::HelloAck) -> Self {
        HandshakeId {
            protocol_version: h.protocol_version,
            engine_id: &h.engine_id,
            agent_name: &h.agent_name,
            compat_hash: h.compat_hash,
        }
    }
}

/// The reason a peer is refused, or `None` when it is compatible with `ours`. The message
/// names both sides' values; it is sent only to authenticated peers (or when neither side
/// has a key).
pub fn check_hello(peer: HandshakeId<'_>, ours: HandshakeId<'_>) -> Option<(ErrorCode, String)> {
    if peer.protocol_version != ours.protocol_version {
        return Some((
            ErrorCode::VersionMismatch,
            format!(
                "protocol version mismatch: peer {} ({}) speaks v{}, {} ({}) speaks v{}",
                peer.agent_name,
                peer.engine_id,
                peer.protocol_version,
                ours.agent_name,
                ours.engine_id,
                ours.protocol_version
            ),
        ));
    }
    if peer.compat_hash != ours.compat_hash {
        return Some((
            ErrorCode::CompatMismatch,
            format!(
                "compatibility hash mismatch: peer {} ({}) has {:#018x}, {} ({}) has {:#018x} \
                 (block size, segments, dtype or tokens per block differ)",
                peer.agent_name,
                peer.engine_id,
                peer.compat_hash,
                ours.agent_name,
                ours.engine_id,
                ours.compat_hash
            ),
        ));
    }
    None
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What the accepting side tells a peer that does not hold the key (nothing internal).
const NEED_KEY: &str = "this agent serves only peers that prove the cluster key";
const BAD_PROOF: &str = "handshake proof did not verify";
const NO_KEY_HERE: &str = "this agent has no cluster key and cannot authenticate itself";

/// Refuses an unauthenticated peer: counted, warned (rate-limited), one error frame.
async fn refuse_auth(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    peer: &str,
    code: ErrorCode,
    message: &'static str,
    why: &str,
) -> Result<(), FrameError> {
    bump(&ctx.counters.handshakes_refused);
    bump(if code == ErrorCode::AuthRequired {
        &ctx.counters.auth_required
    } else {
        &ctx.counters.auth_failed
    });
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        warn!(%peer, suppressed, "handshake refused: {why}");
    }
    crate::server::refuse(stream, code, message.to_owned(), 0).await
}

/// The accepting side: reads the hello, runs the challenge-response when either side has a
/// key, checks compatibility and answers with the `HelloAck` — or refuses (counted) and
/// closes. `Some(hello)` when the connection may go on.
pub(crate) async fn accept(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    peer: &str,
    buf: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Result<Option<v1::Hello>, FrameError> {
    let max = ctx.limits.max_frame_len;
    let io = ctx.limits.io_timeout;
    let first = tokio::time::timeout(io, frame::read_frame(stream, max, buf))
        .await
        .map_err(|_| FrameError::Timeout)?;
    let hello = match first {
        Ok(Frame::Hello(hello)) => hello,
        Ok(other) => {
            bump(&ctx.counters.handshakes_refused);
            let msg = format!("expected a hello first, got {:?}", other.frame_type());
            crate::server::refuse(stream, ErrorCode::HandshakeRequired, msg, 0).await?;
            return Ok(None);
        }
        Err(e) => {
            crate::server::protocol_error(stream, ctx, e).await?;
            return Ok(None);
        }
    };
    let authenticated = match (&ctx.cluster_key, hello.authenticated) {
        (None, false) => false,
        (Some(_), false) => {
            refuse_auth(stream, ctx, peer, ErrorCode::AuthRequired, NEED_KEY, "the peer has no cluster key")
                .await?;
            return Ok(None);
        }
        (None, true) => {
            let why = "the peer requires a cluster key and this agent has none";
            refuse_auth(stream, ctx, peer, ErrorCode::AuthFailed, NO_KEY_HERE, why).await?;
            return Ok(None);
        }
        (Some(key), true) => {
            if hello.nonce.len() != NONCE_LEN {
                let why = format!("a nonce of {} bytes instead of {NONCE_LEN}", hello.nonce.len());
                refuse_auth(stream, ctx, peer, ErrorCode::AuthFailed, BAD_PROOF, &why).await?;
                return Ok(None);
            }
            let nonce_p = nonce();
            let id = HandshakeId::from(&hello);
            let mac = key.handshake_mac(Role::Accepting, &hello.nonce, &nonce_p, id);
            let challenge = Frame::HelloChallenge(v1::HelloChallenge { nonce: nonce_p.clone(), mac });
            frame::write_frame(stream, &challenge, scratch).await?;
            let answer = tokio::time::timeout(io, frame::read_frame(stream, max, buf))
                .await
                .map_err(|_| FrameError::Timeout)?;
            match answer {
                Ok(Frame::HelloProof(p)) => {
                    let id = HandshakeId::from(&hello);
                    if !key.verify_handshake_mac(Role::Connecting, &hello.nonce, &nonce_p, id, &p.mac) {
                        let why =
                            "the proof did not verify (a different cluster key, or a replayed handshake)";
                        refuse_auth(stream, ctx, peer, ErrorCode::AuthFailed, BAD_PROOF, why).await?;
                        return Ok(None);
                    }
                }
                Ok(Frame::Error(e)) => {
                    // The peer refused our challenge: it holds another key (or none).
                    bump(&ctx.counters.handshakes_refused);
                    bump(&ctx.counters.auth_failed);
                    if let Some(suppressed) = ctx.counters.warnings.allow() {
                        warn!(%peer, suppressed, peer_message = %e.message, "handshake refused by the peer: our challenge did not verify there");
                    }
                    return Ok(None);
                }
                Ok(other) => {
                    let why = format!("a {:?} frame instead of the proof", other.frame_type());
                    refuse_auth(stream, ctx, peer, ErrorCode::AuthFailed, BAD_PROOF, &why).await?;
                    return Ok(None);
                }
                Err(e) => {
                    crate::server::protocol_error(stream, ctx, e).await?;
                    return Ok(None);
                }
            }
            true
        }
    };
    // Authenticated (or neither side has a key): now the internal values may be compared.
    if let Some((code, msg)) = check_hello((&hello).into(), (&ctx.hello_ack).into()) {
        bump(&ctx.counters.handshakes_refused);
        if let Some(suppressed) = ctx.counters.warnings.allow() {
            warn!(peer_engine = %hello.engine_id, suppressed, "handshake refused: {msg}");
        }
        crate::server::refuse(stream, code, msg, 0).await?;
        return Ok(None);
    }
    debug!(%peer, peer_engine = %hello.engine_id, peer_agent = %hello.agent_name, authenticated, "handshake ok");
    let ack = v1::HelloAck { authenticated, ..ctx.hello_ack.clone() };
    frame::write_frame(stream, &Frame::HelloAck(ack), scratch).await?;
    Ok(Some(hello))
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
    /// This agent has a key and the peer answered without proving it.
    #[error("the peer did not prove the cluster key (it has none); refusing an unauthenticated peer")]
    PeerUnauthenticated,
    /// The peer's challenge did not verify: it holds another key, or replayed a recorded
    /// challenge.
    #[error("the peer's challenge did not verify (a different cluster key, or a replayed handshake)")]
    BadChallenge,
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

/// The connecting side: sends `hello` (with a fresh nonce when `key` is set), answers the
/// challenge, and returns the peer's checked `HelloAck`.
pub(crate) async fn initiate(
    c: &mut Connection,
    hello: &v1::Hello,
    key: Option<&ClusterKey>,
) -> Result<v1::HelloAck, ClientError> {
    let mut hello = hello.clone();
    hello.authenticated = key.is_some();
    hello.nonce = if key.is_some() { nonce() } else { Vec::new() };
    c.send(&Frame::Hello(hello.clone())).await?;
    let auth = |c: &Connection, reason: AuthError| ClientError::Auth { peer: c.peer().to_owned(), reason };
    let mut reply = c.recv().await?;
    if let (Some(key), Frame::HelloChallenge(ch)) = (key, &reply) {
        if ch.nonce.len() != NONCE_LEN {
            let detail = format!("a nonce of {} bytes instead of {NONCE_LEN}", ch.nonce.len());
            return Err(auth(c, AuthError::Malformed { detail }));
        }
        if !key.verify_handshake_mac(Role::Accepting, &hello.nonce, &ch.nonce, (&hello).into(), &ch.mac) {
            // Tell the peer why we hang up; nothing more.
            let _ = c.send(&Frame::error(ErrorCode::AuthFailed, "challenge did not verify", 0)).await;
            return Err(auth(c, AuthError::BadChallenge));
        }
        let mac = key.handshake_mac(Role::Connecting, &hello.nonce, &ch.nonce, (&hello).into());
        c.send(&Frame::HelloProof(v1::HelloProof { mac })).await?;
        reply = c.recv().await?;
    } else if key.is_some() && matches!(reply, Frame::HelloAck(_)) {
        return Err(auth(c, AuthError::PeerUnauthenticated));
    }
    match reply {
        Frame::HelloAck(ack) => {
            // Check the answer too: a peer must not accept what we would refuse.
            if let Some((code, message)) = check_hello((&ack).into(), (&hello).into()) {
                let remote = Some(match code {
                    ErrorCode::VersionMismatch => u64::from(ack.protocol_version),
                    _ => ack.compat_hash,
                });
                return Err(ClientError::Incompatible { peer: c.peer().to_owned(), code, message, remote });
            }
            Ok(ack)
        }
        Frame::Error(e) => {
            let reason = match ErrorCode::try_from(e.code) {
                Ok(ErrorCode::AuthRequired) => AuthError::KeyRequired { message: e.message },
                Ok(ErrorCode::AuthFailed) => AuthError::Refused { message: e.message },
                Ok(code @ (ErrorCode::VersionMismatch | ErrorCode::CompatMismatch)) => {
                    let peer = c.peer().to_owned();
                    return Err(ClientError::Incompatible { peer, code, message: e.message, remote: None });
                }
                _ => return Err(ClientError::Handshake { peer: c.peer().to_owned(), message: e.message }),
            };
            Err(auth(c, reason))
        }
        Frame::HelloChallenge(_) => {
            Err(auth(c, AuthError::KeyRequired { message: "the peer sent a challenge".into() }))
        }
        other => Err(ClientError::Protocol {
            peer: c.peer().to_owned(),
            message: format!("unexpected {:?} frame in the handshake", other.frame_type()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> HandshakeId<'static> {
        HandshakeId { protocol_version: 2, engine_id: "e", agent_name: "a", compat_hash: 7 }
    }

    #[test]
    fn macs_are_bound_to_role_nonces_and_identity() {
        let key = ClusterKey::from_bytes(vec![1u8; 32]).expect("key");
        let (d, p) = (vec![2u8; NONCE_LEN], vec![3u8; NONCE_LEN]);
        let mac = key.handshake_mac(Role::Accepting, &d, &p, id());
        assert_eq!(mac.len(), MAC_LEN);
        assert!(key.verify_handshake_mac(Role::Accepting, &d, &p, id(), &mac));
        assert!(!key.verify_handshake_mac(Role::Connecting, &d, &p, id(), &mac), "role");
        assert!(!key.verify_handshake_mac(Role::Accepting, &p, &d, id(), &mac), "nonce order");
        assert!(!key.verify_handshake_mac(Role::Accepting, &d, &[4u8; NONCE_LEN], id(), &mac), "nonce");
        let other = HandshakeId { engine_id: "f", ..id() };
        assert!(!key.verify_handshake_mac(Role::Accepting, &d, &p, other, &mac), "identity");
        let wrong = ClusterKey::from_bytes(vec![9u8; 32]).expect("key");
        assert!(!wrong.verify_handshake_mac(Role::Accepting, &d, &p, id(), &mac), "key");
        assert!(!key.verify_handshake_mac(Role::Accepting, &d, &p, id(), &mac[..16]), "truncated");
    }

    #[test]
    fn keys_are_checked_and_never_printed() {
        assert!(matches!(ClusterKey::from_bytes(vec![0u8; 15]), Err(KeyError::TooShort { len: 15 })));
        assert!(matches!(ClusterKey::from_hex("zz"), Err(KeyError::NotHex { .. })));
        let key = ClusterKey::from_hex(" 00112233445566778899aabbccddeeff\n").expect("key");
        let shown = format!("{key:?}");
        assert!(!shown.contains("00112233") && !shown.contains("aabb"), "{shown}");
        let dir = std::env::temp_dir().join(format!("kvxfer-key-test-{}", std::process::id()));
        std::fs::write(&dir, "ffeeddccbbaa99887766554433221100").expect("write");
        assert!(ClusterKey::from_file(&dir).is_ok());
        let _ = std::fs::remove_file(&dir);
        assert!(matches!(ClusterKey::from_file(&dir), Err(KeyError::Read { .. })));
    }
}
