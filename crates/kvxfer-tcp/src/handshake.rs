//! The handshake every connection starts with: who the peers are, whether they speak the
//! same protocol and block layout, and — with a [`ClusterKey`] — a mutual HMAC-SHA256
//! authentication in which the connecting side proves the key first.
//!
//! ```text
//! decode (connecting)                        prefill (accepting)
//! Hello{identity, nonce_d, authenticated} ---->
//!                                         <---- HelloChallenge{nonce_p}         (no MAC)
//! HelloProof{mac_d}                       ---->
//!                                         <---- HelloAck{layout, transports, rkeys, ...}
//!                                         <---- HelloProof{mac_p}
//! ```
//!
//! With `T = nonce_d, nonce_p, hello` (`hello`: the exact bytes of the `Hello` body as sent
//! and received, so the connecting side's whole identity — version, engine id, agent name,
//! compatibility hash, layout, transports — is covered):
//!
//! - `mac_d = HMAC(key, "kvxfer/v3 handshake/connecting" ‖ T)`
//! - `mac_p = HMAC(key, "kvxfer/v3 handshake/accepting" ‖ T ‖ mac_d ‖ ack)`, where `ack` is
//!   the exact bytes of the `HelloAck` body the accepting side sent (the raw bytes, not a
//!   re-encoding: a decoder drops unknown fields, so a re-encoding would not cover them).
//!
//! Every field is length-prefixed (8 bytes, big-endian) and the role labels differ, so no
//! MAC is valid as another. Both nonces are 32 fresh random bytes: a recorded proof fails
//! against a new `nonce_p`, a recorded `mac_p` against a new `nonce_d`. MACs are compared in
//! constant time.
//!
//! What each side learns, and when:
//! - The accepting side computes nothing with the key before the proof verified: its
//!   challenge is a bare nonce. A peer without the key hears `AUTH_REQUIRED` or
//!   `AUTH_FAILED` and nothing else; it cannot obtain a MAC by asking. Versions and
//!   compatibility hashes are compared (naming both values) only after the proof verified.
//! - The connecting side accepts the `HelloAck` (layout, transports, UCX worker address
//!   and rkeys) only with a valid `mac_p`: a party without the key can neither forge nor
//!   alter one, also when it relays a real accepting side's challenge and the proof.
//! - The connecting side's `Hello` (its identity, which is not secret) goes first and in
//!   clear, to whatever it dialed: it proves first, so it cannot wait for the other side's
//!   proof without another round trip.
//!
//! What it does not do: a relay the connecting side dialed can forward the whole handshake
//! to a real accepting side and then sits on-path: it reads the `HelloAck` (with UCX: the
//! worker address and rkeys) and everything after it, which is neither encrypted nor MACed
//! (see "Trust model" in ARCHITECTURE.md).
//!
//! Before the accepting side has authenticated its peer, the frames it reads are capped at
//! `Limits::max_hello_len` (8 KiB by default, never above [`MAX_HANDSHAKE_FRAME_LEN`], the
//! connecting side's cap for the `HelloAck`; not `Limits::max_frame_len`); while it awaits the
//! proof it holds the hello's bytes and nonce, not the decoded hello; and a peer that goes
//! away or silent after the challenge is counted (`ServerCounters::handshakes_abandoned`).
//!
//! Both sides are generic over `AsyncRead + AsyncWrite`, so they run over
//! `tokio::io::duplex` in property tests and in the `handshake` fuzz target.

use std::time::Duration;

use hmac::{KeyInit, Mac};
use kvxfer_core::log::Peer;
use kvxfer_proto::v1::{self, ErrorCode};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tracing::{debug, warn};

use crate::context::ServeContext;
use crate::error::ClientError;
use crate::frame::{Frame, FrameError, FrameReader, HEADER_LEN};
use crate::stats::bump;
use crate::Limits;

pub use crate::error::AuthError;
pub use crate::key::{ClusterKey, KeyError, CLUSTER_KEY_ENV, CLUSTER_KEY_FILE_ENV, MIN_KEY_LEN};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Bytes of each side's handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// Largest frame (type byte and body) read before the peer is authenticated: the accepting
/// side's `Hello` and `HelloProof`, the connecting side's trailing `HelloProof`. A hello
/// with a layout of about a thousand segments fits.
pub const MAX_HANDSHAKE_FRAME_LEN: u32 = 16 << 10;

/// The handshake's MACs under the key (loading and keeping the key is `key.rs`).
impl ClusterKey {
    /// HMAC-SHA256 under this key over `role`'s label and `fields`, each length-prefixed.
    fn mac(&self, role: Role, fields: &[&[u8]]) -> HmacSha256 {
        // HMAC takes keys of any length; the length is checked at construction anyway.
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.0)
            .unwrap_or_else(|_| <HmacSha256 as KeyInit>::new(&Default::default()));
        for field in std::iter::once(role.label()).chain(fields.iter().copied()) {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac
    }

    /// The connecting side's proof: `mac_d` over the transcript so far.
    pub fn proof_mac(&self, t: &Transcript<'_>) -> Vec<u8> {
        self.mac(Role::Connecting, &[t.nonce_d, t.nonce_p, t.hello]).finalize().into_bytes().to_vec()
    }

    /// Whether `tag` is the connecting side's proof for `t` (constant-time compare).
    pub fn verify_proof_mac(&self, t: &Transcript<'_>, tag: &[u8]) -> bool {
        self.mac(Role::Connecting, &[t.nonce_d, t.nonce_p, t.hello]).verify_slice(tag).is_ok()
    }

    /// The accepting side's MAC sent after its `HelloAck`: `mac_p` over the transcript, the
    /// proof it verified, and `ack`, the exact bytes of the `HelloAck` body it sent.
    pub fn ack_mac(&self, t: &Transcript<'_>, proof: &[u8], ack: &[u8]) -> Vec<u8> {
        self.mac(Role::Accepting, &[t.nonce_d, t.nonce_p, t.hello, proof, ack])
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Whether `tag` is the accepting side's MAC for `t`, `proof` and the `HelloAck` body
    /// bytes `ack` as received (constant-time compare).
    pub fn verify_ack_mac(&self, t: &Transcript<'_>, proof: &[u8], ack: &[u8], tag: &[u8]) -> bool {
        self.mac(Role::Accepting, &[t.nonce_d, t.nonce_p, t.hello, proof, ack]).verify_slice(tag).is_ok()
    }
}

/// What both MACs of a handshake cover: both nonces and the exact bytes of the `Hello`
/// body (the connecting side's identity) as sent and received.
#[derive(Debug, Clone, Copy)]
pub struct Transcript<'a> {
    /// The connecting side's nonce.
    pub nonce_d: &'a [u8],
    /// The accepting side's nonce.
    pub nonce_p: &'a [u8],
    /// The `Hello` frame's body, byte for byte.
    pub hello: &'a [u8],
}

/// Which side of the handshake a MAC is from (domain separation: neither side's MAC is
/// ever valid as the other's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The accepting (prefill) side: its MAC after the `HelloAck`.
    Accepting,
    /// The connecting (decode) side: its proof.
    Connecting,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Accepting => b"kvxfer/v3 handshake/accepting",
            Role::Connecting => b"kvxfer/v3 handshake/connecting",
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
    /// The side's KV-cache shape, when it states one.
    pub kv_shape: Option<&'a v1::KvShape>,
    /// Whether this is the prefill (accepting, `HelloAck`) side.
    pub prefill: bool,
    /// The connecting side asked for a control-only connection (`Hello::control_only`):
    /// only the protocol version is compared.
    pub control_only: bool,
}

impl<'a> From<&'a v1::Hello> for HandshakeId<'a> {
    fn from(h: &'a v1::Hello) -> Self {
        HandshakeId {
            protocol_version: h.protocol_version,
            engine_id: &h.engine_id,
            agent_name: &h.agent_name,
            compat_hash: h.compat_hash,
            kv_shape: h.kv_shape.as_ref(),
            prefill: false,
            control_only: h.control_only,
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
            kv_shape: h.kv_shape.as_ref(),
            prefill: true,
            control_only: false,
        }
    }
}

/// With both sides' shapes: `Err` naming what no transfer plan can serve (the field that
/// differs and both values), `Ok(true)` when the peers are homogeneous (same TP size and
/// block size: the compatibility hash must then match too, as without shapes), `Ok(false)`
/// when a heterogeneous plan serves them. `None` without both shapes.
fn check_shapes(a: HandshakeId<'_>, b: HandshakeId<'_>) -> Option<Result<bool, String>> {
    use kvxfer_core::{KvShape, KvShapeSpec, TransferPair};
    let (prefill, decode) = if a.prefill { (a, b) } else { (b, a) };
    let (p, d) = (prefill.kv_shape?, decode.kv_shape?);
    let parse = |w: &v1::KvShape, side: &str| {
        KvShape::new(KvShapeSpec::from_wire(w)).map_err(|e| format!("the {side} side's KV-cache shape: {e}"))
    };
    Some((|| {
        let (p, d) = (parse(p, "prefill")?, parse(d, "decode")?);
        let pair = TransferPair::new(&p, &d).map_err(|e| e.to_string())?;
        Ok(p.tp_size() == d.tp_size() && pair.block_ratio() == 1)
    })())
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
    if peer.control_only || ours.control_only {
        // Nothing is read on the connection: layouts and shapes need not agree.
        return None;
    }
    let hash_needed = match check_shapes(peer, ours) {
        None | Some(Ok(true)) => true,
        Some(Ok(false)) => false,
        Some(Err(why)) => {
            return Some((
                ErrorCode::CompatMismatch,
                format!(
                    "KV-cache shapes of {} ({}) and {} ({}) cannot be served by any transfer plan: {why}",
                    peer.agent_name, peer.engine_id, ours.agent_name, ours.engine_id
                ),
            ))
        }
    };
    if hash_needed && peer.compat_hash != ours.compat_hash {
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

/// What the accepting side tells a peer that does not hold the key (nothing internal).
const NEED_KEY: &str = "this agent serves only peers that prove the cluster key";
const BAD_PROOF: &str = "handshake proof did not verify";
const NO_KEY_HERE: &str = "this agent has no cluster key and cannot authenticate itself";

/// Reads one frame of at most `max` bytes within `io` through `reader`; with `body`, its
/// body as received is copied there.
async fn read_within<S: AsyncRead + Unpin>(
    stream: &mut S,
    max: u32,
    io: Duration,
    reader: &mut FrameReader,
    body: Option<&mut Vec<u8>>,
) -> Result<Frame, FrameError> {
    let read = async {
        match body {
            Some(body) => reader.read_frame_and_body(stream, max, body).await,
            None => reader.read_frame(stream, max).await,
        }
    };
    tokio::time::timeout(io, read).await.map_err(|_| FrameError::Timeout)?
}

/// Writes `bytes` within `io`.
async fn write_within<S: AsyncWrite + Unpin>(
    stream: &mut S,
    bytes: &[u8],
    io: Duration,
) -> Result<(), FrameError> {
    match tokio::time::timeout(io, stream.write_all(bytes)).await {
        Ok(written) => written.map_err(FrameError::from),
        Err(_) => Err(FrameError::Timeout),
    }
}

/// Sends one error frame and closes the sending direction (both within `io`).
async fn send_error<S: AsyncWrite + Unpin>(
    stream: &mut S,
    io: Duration,
    code: ErrorCode,
    message: String,
) -> Result<(), FrameError> {
    let mut out = Vec::new();
    Frame::error(code, message, 0).encode(&mut out);
    write_within(stream, &out, io).await?;
    let _ = tokio::time::timeout(io, stream.shutdown()).await;
    Ok(())
}

/// Refuses an unauthenticated peer: counted, warned (rate-limited), one error frame.
async fn refuse_auth<S: AsyncWrite + Unpin>(
    stream: &mut S,
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
    send_error(stream, ctx.limits.io_timeout, code, message.to_owned()).await
}

/// Answers a frame that could not be read: an error frame for a bad frame (counted as a
/// protocol error), nothing for a peer that is gone or silent (the error is returned).
async fn frame_error<S: AsyncWrite + Unpin>(
    stream: &mut S,
    ctx: &ServeContext,
    e: FrameError,
) -> Result<(), FrameError> {
    let Some(code) = e.answer_code() else { return Err(e) };
    bump(&ctx.counters.protocol_errors);
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        warn!(error = %Peer(&e), suppressed, "closing connection after a protocol error in the handshake");
    }
    send_error(stream, ctx.limits.io_timeout, code, e.to_string()).await
}

/// The accepting side: reads the hello, runs the challenge-response when either side has a
/// key, checks compatibility and answers with the `HelloAck` (followed, when authenticated,
/// by its MAC in a `HelloProof`) — or refuses (counted) and closes. `Some(hello)` when the
/// connection may go on. `buf` and `scratch` are working buffers.
///
/// `buf` is not used (kept for callers of the earlier signature); bytes the peer sent past
/// the handshake are dropped (the serving loop uses [`accept_buffered`], which keeps them).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ctx: &ServeContext,
    peer: &str,
    buf: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Result<Option<v1::Hello>, FrameError> {
    let _ = buf;
    let accepted =
        accept_buffered(stream, ctx, peer, &mut FrameReader::new(), scratch, crate::admit_any()).await?;
    Ok(accepted.map(|(hello, _)| hello))
}

/// [`accept`] reading through `reader`, which keeps what the peer sent after the
/// handshake for the frames that follow, and asking `admit` for the connection's place
/// once the handshake verified, before the `HelloAck` (a refusal is answered with a
/// LIMIT_EXCEEDED error instead). With the hello, what `admit` returned: the connection
/// holds it until it ends.
pub async fn accept_buffered<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ctx: &ServeContext,
    peer: &str,
    reader: &mut FrameReader,
    scratch: &mut Vec<u8>,
    admit: crate::Admit,
) -> Result<Option<(v1::Hello, Box<dyn Send>)>, FrameError> {
    let mut hello_body = Vec::new();
    let io = ctx.limits.io_timeout;
    // Before the peer proved anything its frames are capped at `Limits::max_hello_len`.
    let small = ctx.limits.max_hello_len.min(MAX_HANDSHAKE_FRAME_LEN).min(ctx.limits.max_frame_len);
    let mut hello = match read_within(stream, small, io, reader, Some(&mut hello_body)).await {
        Ok(Frame::Hello(hello)) => hello,
        Ok(other) => {
            bump(&ctx.counters.handshakes_refused);
            let msg = format!("expected a hello first, got {:?}", other.frame_type());
            send_error(stream, io, ErrorCode::HandshakeRequired, msg).await?;
            return Ok(None);
        }
        Err(e) => {
            frame_error(stream, ctx, e).await?;
            return Ok(None);
        }
    };
    // `hello_body`, the hello's body as received, is what both MACs cover.
    // With a key: the key, our nonce and the verified proof.
    let proven = match (&ctx.cluster_key, hello.authenticated) {
        (None, false) => None,
        (Some(_), false) => {
            let why = "the peer has no cluster key";
            refuse_auth(stream, ctx, peer, ErrorCode::AuthRequired, NEED_KEY, why).await?;
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
            // While the proof is awaited only the hello's bytes (at most `max_hello_len`) and
            // its nonce are held: the decoded hello (repeated fields decode to many times
            // their wire size) is dropped, and decoded again once the proof verified.
            let nonce_d = std::mem::take(&mut hello.nonce);
            drop(std::mem::take(&mut hello));
            hello_body.shrink_to_fit();
            // The challenge is a bare nonce: nothing computed with the key before the peer
            // proved it holds it.
            let nonce_p = nonce();
            scratch.clear();
            Frame::HelloChallenge(v1::HelloChallenge { nonce: nonce_p.clone(), mac: Vec::new() })
                .encode(scratch);
            write_within(stream, scratch, io).await?;
            let t = Transcript { nonce_d: &nonce_d, nonce_p: &nonce_p, hello: &hello_body };
            match read_within(stream, small, io, reader, None).await {
                Ok(Frame::HelloProof(p)) if key.verify_proof_mac(&t, &p.mac) => {
                    // The same bytes decoded once already.
                    let Ok(Frame::Hello(h)) = Frame::decode(v1::FrameType::Hello as u8, &hello_body) else {
                        let msg = "the hello could not be decoded again".to_owned();
                        send_error(stream, io, ErrorCode::Internal, msg).await?;
                        return Ok(None);
                    };
                    hello = h;
                    Some((key, nonce_p, p.mac))
                }
                Ok(Frame::HelloProof(_)) => {
                    let why = "the proof did not verify (a different cluster key, or a replayed handshake)";
                    refuse_auth(stream, ctx, peer, ErrorCode::AuthFailed, BAD_PROOF, why).await?;
                    return Ok(None);
                }
                Ok(Frame::Error(e)) => {
                    // The peer gave up (it found our challenge malformed).
                    bump(&ctx.counters.handshakes_abandoned);
                    debug!(%peer, peer_message = %Peer(&e.message), "handshake abandoned by the peer after the challenge");
                    return Ok(None);
                }
                Ok(other) => {
                    let why = format!("a {:?} frame instead of the proof", other.frame_type());
                    refuse_auth(stream, ctx, peer, ErrorCode::AuthFailed, BAD_PROOF, &why).await?;
                    return Ok(None);
                }
                Err(
                    e @ (FrameError::Closed | FrameError::Io(_) | FrameError::Timeout | FrameError::Idle),
                ) => {
                    bump(&ctx.counters.handshakes_abandoned);
                    debug!(%peer, error = %Peer(&e), "handshake abandoned after the challenge");
                    return Err(e);
                }
                Err(e) => {
                    frame_error(stream, ctx, e).await?;
                    return Ok(None);
                }
            }
        }
    };
    // Authenticated (or neither side has a key): now the internal values may be compared.
    if let Some((code, msg)) = check_hello((&hello).into(), (&ctx.hello_ack).into()) {
        bump(&ctx.counters.handshakes_refused);
        if let Some(suppressed) = ctx.counters.warnings.allow() {
            warn!(peer_engine = %Peer(&hello.engine_id), suppressed, "handshake refused: {}", Peer(&msg));
        }
        send_error(stream, io, code, msg).await?;
        return Ok(None);
    }
    let admitted = match admit() {
        Ok(admitted) => admitted,
        Err(why) => {
            let msg = why.count_and_explain(ctx);
            if let Some(suppressed) = ctx.counters.warnings.allow() {
                warn!(%peer, suppressed, "connection refused after its handshake: {msg}");
            }
            send_error(stream, io, ErrorCode::LimitExceeded, msg).await?;
            return Ok(None);
        }
    };
    let authenticated = proven.is_some();
    debug!(%peer, peer_engine = %Peer(&hello.engine_id), peer_agent = %Peer(&hello.agent_name), authenticated, "handshake ok");
    scratch.clear();
    let ack = if hello.control_only {
        // A connection that only cancels is told nothing about the data paths (UCX worker
        // addresses, memory keys) it may not use.
        v1::HelloAck { authenticated, transports: Vec::new(), ..ctx.hello_ack.clone() }
    } else {
        v1::HelloAck { authenticated, ..ctx.hello_ack.clone() }
    };
    Frame::HelloAck(ack).encode(scratch);
    if let Some((key, nonce_p, proof)) = proven {
        // Over the exact bytes of the HelloAck body just encoded.
        let t = Transcript { nonce_d: &hello.nonce, nonce_p: &nonce_p, hello: &hello_body };
        let mac = key.ack_mac(&t, &proof, &scratch[HEADER_LEN..]);
        Frame::HelloProof(v1::HelloProof { mac }).encode(scratch);
    }
    write_within(stream, scratch, io).await?;
    Ok(Some((hello, admitted)))
}

/// What an answer other than the expected one means for the connecting side: the peer's
/// refusal, or a protocol violation.
fn unexpected(peer: &str, f: Frame) -> ClientError {
    match f {
        Frame::Error(e) => {
            let reason = match ErrorCode::try_from(e.code) {
                Ok(ErrorCode::AuthRequired) => AuthError::KeyRequired { message: e.message },
                Ok(ErrorCode::AuthFailed) => AuthError::Refused { message: e.message },
                Ok(code @ (ErrorCode::VersionMismatch | ErrorCode::CompatMismatch)) => {
                    let peer = peer.to_owned();
                    return ClientError::Incompatible { peer, code, message: e.message, remote: None };
                }
                Ok(ErrorCode::LimitExceeded) => {
                    return ClientError::Busy { peer: peer.to_owned(), message: e.message }
                }
                _ => return ClientError::Handshake { peer: peer.to_owned(), message: e.message },
            };
            ClientError::Auth { peer: peer.to_owned(), reason }
        }
        other => ClientError::Protocol {
            peer: peer.to_owned(),
            message: format!("unexpected {:?} frame in the handshake", other.frame_type()),
        },
    }
}

/// The connecting side over `stream` to `peer`: sends `hello` (with a fresh nonce when
/// `key` is set), proves the key when challenged, checks the accepting side's MAC over the
/// exact `HelloAck` bytes it received, and returns the peer's checked `HelloAck`. Each frame
/// is bounded by `limits.io_timeout`.
///
/// Bytes the peer sent past the handshake are dropped: a [`crate::Connection`] uses
/// [`initiate_buffered`], which keeps them.
pub async fn initiate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: &str,
    hello: &v1::Hello,
    key: Option<&ClusterKey>,
    limits: &Limits,
) -> Result<v1::HelloAck, ClientError> {
    initiate_buffered(stream, &mut FrameReader::new(), peer, hello, key, limits).await
}

/// [`initiate`] reading through `reader`, which keeps what the peer sent after the
/// handshake for the frames that follow.
pub async fn initiate_buffered<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    reader: &mut FrameReader,
    peer: &str,
    hello: &v1::Hello,
    key: Option<&ClusterKey>,
    limits: &Limits,
) -> Result<v1::HelloAck, ClientError> {
    let io = limits.io_timeout;
    let broken = |source| ClientError::Frame { peer: peer.to_owned(), source };
    let auth = |reason| ClientError::Auth { peer: peer.to_owned(), reason };
    let checked = |ack: v1::HelloAck, hello: &v1::Hello| match check_hello((&ack).into(), hello.into()) {
        // A peer must not accept what we would refuse.
        Some((code, message)) => {
            let remote = Some(match code {
                ErrorCode::VersionMismatch => u64::from(ack.protocol_version),
                _ => ack.compat_hash,
            });
            Err(ClientError::Incompatible { peer: peer.to_owned(), code, message, remote })
        }
        None => Ok(ack),
    };
    let mut hello = hello.clone();
    hello.authenticated = key.is_some();
    hello.nonce = if key.is_some() { nonce() } else { Vec::new() };
    let mut out = Vec::new();
    Frame::Hello(hello.clone()).encode(&mut out);
    let hello_body = out[HEADER_LEN..].to_vec();
    write_within(stream, &out, io).await.map_err(broken)?;
    let first = read_within(stream, limits.max_frame_len, io, reader, None).await.map_err(broken)?;
    let Some(key) = key else {
        return match first {
            Frame::HelloAck(ack) => checked(ack, &hello),
            Frame::HelloChallenge(_) => {
                Err(auth(AuthError::KeyRequired { message: "the peer sent a challenge".into() }))
            }
            other => Err(unexpected(peer, other)),
        };
    };
    let challenge = match first {
        Frame::HelloChallenge(ch) => ch,
        Frame::HelloAck(_) => return Err(auth(AuthError::PeerUnauthenticated)),
        other => return Err(unexpected(peer, other)),
    };
    let malformed = if challenge.nonce.len() != NONCE_LEN {
        Some(format!("a nonce of {} bytes instead of {NONCE_LEN}", challenge.nonce.len()))
    } else if !challenge.mac.is_empty() {
        Some("the challenge carries a MAC (the peer speaks an older handshake)".to_owned())
    } else {
        None
    };
    if let Some(detail) = malformed {
        // Tell the peer why we hang up; nothing more.
        let _ = send_error(stream, io, ErrorCode::AuthFailed, "malformed challenge".into()).await;
        return Err(auth(AuthError::Malformed { detail }));
    }
    let t = Transcript { nonce_d: &hello.nonce, nonce_p: &challenge.nonce, hello: &hello_body };
    let proof = key.proof_mac(&t);
    out.clear();
    Frame::HelloProof(v1::HelloProof { mac: proof.clone() }).encode(&mut out);
    write_within(stream, &out, io).await.map_err(broken)?;
    // The HelloAck body as received: what the peer's MAC must cover.
    let mut ack_body = Vec::new();
    let ack = match read_within(stream, limits.max_frame_len, io, reader, Some(&mut ack_body))
        .await
        .map_err(broken)?
    {
        Frame::HelloAck(ack) => ack,
        other => return Err(unexpected(peer, other)),
    };
    let small = MAX_HANDSHAKE_FRAME_LEN.min(limits.max_frame_len);
    let verified = match read_within(stream, small, io, reader, None).await {
        Ok(Frame::HelloProof(p)) => key.verify_ack_mac(&t, &proof, &ack_body, &p.mac),
        Ok(_) | Err(FrameError::Closed) => false,
        Err(e) => return Err(broken(e)),
    };
    if !verified {
        let _ = send_error(stream, io, ErrorCode::AuthFailed, "handshake answer did not verify".into()).await;
        return Err(auth(AuthError::BadAck));
    }
    checked(ack, &hello)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::stats::ServerCounters;
    use kvxfer_core::{BlockLayout, EngineInfo, LeaseConfig, LeaseTable};
    use kvxfer_mem::KvMemory;
    use kvxfer_proto::PROTOCOL_VERSION;
    use proptest::prelude::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, DuplexStream};

    /// Shapes replace the hash check only where a heterogeneous plan serves the peers;
    /// equal TP and block sizes still need equal hashes, and what no plan serves is refused
    /// naming the field.
    #[test]
    fn shapes_relax_the_hash_check_only_for_heterogeneous_peers() {
        use kvxfer_core::{GroupSpec, KvHeads, KvShapeSpec, SegmentSpec};
        let shape = |tp_size, block_tokens, total| {
            KvShapeSpec {
                tp_size,
                tp_rank: 0,
                heads: KvHeads::Split { total },
                block_tokens,
                dtype: "bf16".into(),
                dtype_bytes: 2,
                groups: vec![GroupSpec { num_blocks: 4, segments: vec![SegmentSpec::packed(64)] }],
            }
            .to_wire()
        };
        let check = |p: v1::KvShape, d: v1::KvShape, p_hash: u64, d_hash: u64| {
            let ack = v1::HelloAck { compat_hash: p_hash, kv_shape: Some(p), ..Default::default() };
            let hello = v1::Hello { compat_hash: d_hash, kv_shape: Some(d), ..Default::default() };
            check_hello((&hello).into(), (&ack).into())
        };
        assert_eq!(check(shape(1, 16, 4), shape(2, 16, 4), 1, 2), None, "TP 1 -> 2");
        assert_eq!(check(shape(1, 16, 4), shape(1, 32, 4), 1, 2), None, "block ratio 2");
        let same = check(shape(2, 16, 4), shape(2, 16, 4), 1, 2).expect("equal shapes, other layouts");
        assert!(same.1.contains("compatibility hash"), "{}", same.1);
        assert_eq!(check(shape(2, 16, 4), shape(2, 16, 4), 7, 7), None);
        let heads = check(shape(1, 16, 4), shape(2, 16, 8), 1, 2).expect("other heads");
        assert_eq!(heads.0, ErrorCode::CompatMismatch);
        assert!(heads.1.contains("total_kv_heads"), "{}", heads.1);
        let smaller = check(shape(1, 32, 4), shape(1, 16, 4), 1, 2).expect("smaller decode blocks");
        assert!(smaller.1.contains("block_tokens"), "{}", smaller.1);
        // One side without a shape: the hash decides, as before.
        let ack = v1::HelloAck { compat_hash: 1, kv_shape: Some(shape(1, 16, 4)), ..Default::default() };
        let hello = v1::Hello { compat_hash: 2, ..Default::default() };
        assert!(check_hello((&hello).into(), (&ack).into()).is_some());
    }

    fn layout() -> BlockLayout {
        BlockLayout::single(4, 64).expect("layout")
    }

    fn key(byte: u8) -> ClusterKey {
        ClusterKey::from_bytes(vec![byte; 32]).expect("key")
    }

    /// An accepting side's context over a small layout.
    pub(crate) fn ctx(key: Option<ClusterKey>) -> ServeContext {
        let engine = EngineInfo {
            engine_id: "prefill".into(),
            host: "127.0.0.1".into(),
            port: 1,
            tp_size: 1,
            incarnation: 7,
        };
        ServeContext {
            table: Arc::new(LeaseTable::new(LeaseConfig::new(engine, 4), [1; 32])),
            memory: Arc::new(KvMemory::alloc(layout()).expect("memory")),
            shape: None,
            hello_ack: v1::HelloAck {
                protocol_version: PROTOCOL_VERSION,
                engine_id: "prefill".into(),
                agent_name: "p".into(),
                compat_hash: layout().compat_hash(),
                layout: Some(layout().to_wire()),
                transports: vec![v1::TransportOffer {
                    transport: v1::Transport::Ucx as i32,
                    connection_info: vec![9; 40],
                }],
                incarnation: 7,
                authenticated: false,
                other_group_layouts: vec![],
                kv_shape: None,
            },
            cluster_key: key,
            limits: Limits::default(),
            counters: Arc::new(ServerCounters::default()),
            leases_made: Arc::new(tokio::sync::Notify::new()),
            budgets: crate::ServeBudgets::new(&Limits::default()),
        }
    }

    /// A decode side's hello matching [`ctx`].
    pub(crate) fn hello() -> v1::Hello {
        v1::Hello {
            protocol_version: PROTOCOL_VERSION,
            engine_id: "decode".into(),
            agent_name: "d".into(),
            compat_hash: layout().compat_hash(),
            layout: Some(layout().to_wire()),
            ..Default::default()
        }
    }

    /// A runtime whose clock jumps ahead whenever every task waits, so a side waiting for
    /// bytes that never come times out at once instead of stalling the test.
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime")
    }

    /// Copies `from` to `to`, XOR-ing the byte at offset `flip.0` with `flip.1`; returns
    /// whether that byte passed through.
    async fn pump(
        mut from: tokio::io::ReadHalf<DuplexStream>,
        mut to: tokio::io::WriteHalf<DuplexStream>,
        flip: Option<(usize, u8)>,
    ) -> bool {
        let (mut at, mut flipped, mut buf) = (0usize, false, [0u8; 4096]);
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some((i, x)) = flip {
                if (at..at + n).contains(&i) {
                    buf[i - at] ^= x;
                    flipped = true;
                }
            }
            at += n;
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
        flipped
    }

    type Outcome = (Result<v1::HelloAck, ClientError>, Result<Option<v1::Hello>, FrameError>, bool);

    /// One handshake between `initiate` (with `client_key`) and `accept` over `ctx`, through
    /// a relay that alters one byte going to the accepting side (`to_accepting`) or coming
    /// from it.
    fn handshake(
        ctx: &ServeContext,
        client_key: Option<&ClusterKey>,
        flip: Option<(bool, usize, u8)>,
    ) -> Outcome {
        runtime().block_on(async {
            let (client, client_relay) = tokio::io::duplex(1 << 16);
            let (server_relay, server) = tokio::io::duplex(1 << 16);
            let (cr_read, cr_write) = tokio::io::split(client_relay);
            let (sr_read, sr_write) = tokio::io::split(server_relay);
            let up = flip.filter(|f| f.0).map(|f| (f.1, f.2));
            let down = flip.filter(|f| !f.0).map(|f| (f.1, f.2));
            let hello = hello();
            let (c, s, f_up, f_down) = tokio::join!(
                async move {
                    let mut client = client;
                    initiate(&mut client, "prefill", &hello, client_key, &Limits::default()).await
                },
                async move {
                    let mut server = server;
                    accept(&mut server, ctx, "decode", &mut Vec::new(), &mut Vec::new()).await
                },
                pump(cr_read, sr_write, up),
                pump(sr_read, cr_write, down),
            );
            (c, s, f_up || f_down)
        })
    }

    #[test]
    fn every_key_combination_ends_as_it_should() {
        let (k, other) = (key(1), key(2));
        // (accepting side's key, connecting side's key, succeeds)
        let cases = [
            (None, None, true),
            (Some(k.clone()), Some(&k), true),
            (Some(k.clone()), Some(&other), false),
            (Some(k.clone()), None, false),
            (None, Some(&k), false),
        ];
        for (i, (server_key, client_key, ok)) in cases.into_iter().enumerate() {
            let ctx = ctx(server_key);
            let (c, s, _) = handshake(&ctx, client_key, None);
            assert_eq!(c.is_ok(), ok, "case {i}: {c:?}");
            assert_eq!(matches!(s, Ok(Some(_))), ok, "case {i}: {s:?}");
            if let Ok(ack) = c {
                assert_eq!(ack.authenticated, client_key.is_some());
                assert_eq!((ack.engine_id.as_str(), ack.incarnation), ("prefill", 7));
            }
        }
    }

    #[test]
    fn a_wrong_key_is_caught_by_the_accepting_side_before_it_says_anything() {
        let ctx = ctx(Some(key(1)));
        let (c, s, _) = handshake(&ctx, Some(&key(2)), None);
        let Err(ClientError::Auth { reason: AuthError::Refused { message }, .. }) = c else {
            panic!("{c:?}")
        };
        assert_eq!(message, BAD_PROOF);
        assert!(matches!(s, Ok(None)), "{s:?}");
        let stats = ctx.counters.snapshot();
        assert_eq!((stats.auth_failed, stats.handshakes_refused, stats.handshakes_abandoned), (1, 1, 0));
    }

    /// Review finding 1: before the peer's proof verified, the accepting side sends one
    /// `HelloChallenge` holding its nonce and nothing else; a peer that then hangs up gets
    /// nothing more, and is counted as an abandoned handshake.
    #[test]
    fn a_challenge_is_a_bare_nonce_and_an_abandoned_handshake_is_counted() {
        let ctx = ctx(Some(key(1)));
        runtime().block_on(async {
            let (mut peer, mut server) = tokio::io::duplex(1 << 16);
            let mut h = hello();
            h.authenticated = true;
            h.nonce = vec![5; NONCE_LEN];
            let mut out = Vec::new();
            Frame::Hello(h).encode(&mut out);
            peer.write_all(&out).await.expect("hello");
            let (served, wire) = tokio::join!(
                async {
                    let r = accept(&mut server, &ctx, "peer", &mut Vec::new(), &mut Vec::new()).await;
                    drop(server);
                    r
                },
                async {
                    let mut header = [0u8; HEADER_LEN];
                    peer.read_exact(&mut header).await.expect("challenge header");
                    let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
                    let mut body = vec![0u8; len - 1];
                    peer.read_exact(&mut body).await.expect("challenge body");
                    // Hang up without a proof, and collect whatever else arrives.
                    peer.shutdown().await.expect("shutdown");
                    let mut rest = Vec::new();
                    peer.read_to_end(&mut rest).await.expect("rest");
                    (header[4], body, rest)
                }
            );
            let (ty, body, rest) = wire;
            assert_eq!(ty, v1::FrameType::HelloChallenge as u8);
            let ch = <v1::HelloChallenge as prost::Message>::decode(&body[..]).expect("challenge");
            assert_eq!((ch.nonce.len(), ch.mac.len(), body.len()), (NONCE_LEN, 0, 2 + NONCE_LEN));
            assert!(rest.is_empty(), "sent after the challenge: {rest:?}");
            assert!(matches!(served, Err(FrameError::Closed)), "{served:?}");
        });
        let stats = ctx.counters.snapshot();
        assert_eq!((stats.handshakes_abandoned, stats.auth_failed, stats.handshakes_refused), (1, 0, 0));
    }

    /// `bytes` sent by a peer that has proved nothing are answered FRAME_TOO_LARGE at the
    /// header, the connection ends without a handshake, and one protocol error is counted.
    fn assert_refused_as_too_large(ctx: &ServeContext, bytes: &[u8]) {
        let answer = runtime().block_on(async {
            let (mut peer, mut server) = tokio::io::duplex(1 << 16);
            peer.write_all(bytes).await.expect("first frame");
            let served = accept(&mut server, ctx, "peer", &mut Vec::new(), &mut Vec::new()).await;
            assert!(matches!(served, Ok(None)), "{served:?}");
            crate::frame::read_frame(&mut peer, 1 << 20, &mut Vec::new()).await.expect("an answer")
        });
        let Frame::Error(e) = answer else { panic!("{answer:?}") };
        assert_eq!(e.code, ErrorCode::FrameTooLarge as i32, "{}", e.message);
        assert_eq!(ctx.counters.snapshot().protocol_errors, 1);
    }

    /// Review finding 7: before authentication a frame may announce at most
    /// `MAX_HANDSHAKE_FRAME_LEN` bytes, whatever `max_frame_len` allows afterwards; more is
    /// refused at its header.
    #[test]
    fn frames_before_authentication_are_capped_at_the_handshake_limit() {
        for server_key in [None, Some(key(1))] {
            let ctx = ctx(server_key);
            let mut header = (MAX_HANDSHAKE_FRAME_LEN + 1).to_be_bytes().to_vec();
            header.push(v1::FrameType::Hello as u8);
            assert_refused_as_too_large(&ctx, &header);
        }
    }

    /// Hostile-peer review: before authentication a `Hello` of up to 16 KiB was accepted —
    /// of empty repeated messages, 2 bytes each on the wire, it decoded to ~480 KiB, held
    /// per connection while the proof was awaited. The first frame is capped at
    /// `Limits::max_hello_len` (8 KiB) now, refused at its header.
    #[test]
    fn an_oversized_pre_auth_hello_is_refused() {
        for server_key in [None, Some(key(1))] {
            let ctx = ctx(server_key);
            let mut h = hello();
            h.authenticated = ctx.cluster_key.is_some();
            h.nonce = vec![1; NONCE_LEN];
            h.other_group_layouts = vec![v1::BlockLayout::default(); 5000];
            let mut out = Vec::new();
            Frame::Hello(h).encode(&mut out);
            assert!(
                out.len() > (ctx.limits.max_hello_len as usize)
                    && out.len() < MAX_HANDSHAKE_FRAME_LEN as usize
            );
            assert_refused_as_too_large(&ctx, &out);
        }
    }

    #[test]
    fn macs_are_bound_to_role_nonces_hello_proof_and_ack_bytes() {
        let k = key(1);
        let (d, p, h) = (vec![2u8; NONCE_LEN], vec![3u8; NONCE_LEN], b"hello bytes".to_vec());
        let t = Transcript { nonce_d: &d, nonce_p: &p, hello: &h };
        let proof = k.proof_mac(&t);
        assert_eq!(proof.len(), MAC_LEN);
        assert!(k.verify_proof_mac(&t, &proof));
        let ack = k.ack_mac(&t, &proof, b"ack bytes");
        assert!(k.verify_ack_mac(&t, &proof, b"ack bytes", &ack));
        assert_ne!(proof, ack);
        // Neither MAC is valid as the other (role labels), nor under another transcript.
        assert!(!k.verify_proof_mac(&t, &ack), "role");
        let swapped = Transcript { nonce_d: &p, nonce_p: &d, hello: &h };
        assert!(!k.verify_proof_mac(&swapped, &proof), "nonce order");
        let other_hello = Transcript { hello: b"hello bytez", ..t };
        assert!(!k.verify_proof_mac(&other_hello, &proof), "hello bytes");
        assert!(!k.verify_ack_mac(&t, &proof, b"ack bytes\0", &ack), "ack bytes");
        assert!(!k.verify_ack_mac(&t, &ack, b"ack bytes", &ack), "proof");
        // Length prefixes: moving a byte from one field to the next changes the MAC.
        let shifted = Transcript { nonce_d: &d[..31], nonce_p: &[&d[31..], &p[..]].concat(), hello: &h };
        assert!(!k.verify_proof_mac(&shifted, &proof), "field boundaries");
        assert!(!key(9).verify_proof_mac(&t, &proof), "key");
        assert!(!k.verify_proof_mac(&t, &proof[..16]), "truncated");
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

    /// Runs `accept` (with `server_key`) against a peer that sends `bytes` and then closes
    /// its sending direction; what the accepting side sends is left unread.
    fn accept_arbitrary(
        server_key: Option<ClusterKey>,
        bytes: &[u8],
    ) -> (crate::stats::ServerStats, Result<Option<v1::Hello>, FrameError>) {
        let ctx = ctx(server_key);
        let served = runtime().block_on(async {
            let (mut peer, mut server) = tokio::io::duplex(1 << 20);
            peer.write_all(bytes).await.expect("bytes");
            peer.shutdown().await.expect("shutdown");
            let served = accept(&mut server, &ctx, "peer", &mut Vec::new(), &mut Vec::new()).await;
            drop(peer);
            served
        });
        (ctx.counters.snapshot(), served)
    }

    /// Runs `initiate` (with `client_key`) against a peer that sends `bytes` and then closes.
    fn initiate_arbitrary(
        client_key: Option<&ClusterKey>,
        bytes: &[u8],
    ) -> Result<v1::HelloAck, ClientError> {
        runtime().block_on(async {
            let (mut peer, mut client) = tokio::io::duplex(1 << 20);
            peer.write_all(bytes).await.expect("bytes");
            peer.shutdown().await.expect("shutdown");
            let r = initiate(&mut client, "peer", &hello(), client_key, &Limits::default()).await;
            drop(peer);
            r
        })
    }

    /// Frames, mostly well formed handshake frames with arbitrary fields, sometimes raw
    /// bytes: what an arbitrary peer may send.
    fn peer_bytes() -> impl Strategy<Value = Vec<u8>> {
        let bytes = || proptest::collection::vec(any::<u8>(), 0..48);
        let frame = prop_oneof![
            2 => (
                prop_oneof![proptest::collection::vec(any::<u8>(), NONCE_LEN), bytes()],
                any::<bool>(),
                any::<u32>()
            )
                .prop_map(|(nonce, authenticated, v)| {
                    let mut h = hello();
                    (h.nonce, h.authenticated) = (nonce, authenticated);
                    if v % 4 == 0 {
                        h.protocol_version = v;
                    }
                    Frame::Hello(h)
                }),
            1 => (bytes(), bytes())
                .prop_map(|(nonce, mac)| Frame::HelloChallenge(v1::HelloChallenge { nonce, mac })),
            3 => prop_oneof![proptest::collection::vec(any::<u8>(), MAC_LEN), bytes()]
                .prop_map(|mac| Frame::HelloProof(v1::HelloProof { mac })),
            1 => (any::<u64>(), any::<bool>()).prop_map(|(compat_hash, authenticated)| {
                Frame::HelloAck(v1::HelloAck { compat_hash, authenticated, ..ctx(None).hello_ack })
            }),
            1 => (any::<i32>(), ".{0,20}").prop_map(|(code, message)| Frame::Error(v1::Error {
                code,
                message,
                seq: 0
            })),
        ];
        let piece = prop_oneof![
            4 => frame.prop_map(|f| {
                let mut out = Vec::new();
                f.encode(&mut out);
                out
            }),
            1 => proptest::collection::vec(any::<u8>(), 0..64),
        ];
        // Half the time a keyed hello first, so what follows is read as the proof.
        let keyed_hello = {
            let mut h = hello();
            (h.nonce, h.authenticated) = (vec![5; NONCE_LEN], true);
            let mut out = Vec::new();
            Frame::Hello(h).encode(&mut out);
            out
        };
        (any::<bool>(), proptest::collection::vec(piece, 0..4)).prop_map(move |(lead, pieces)| {
            let lead = if lead { keyed_hello.clone() } else { Vec::new() };
            [lead, pieces.concat()].concat()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// Any single byte altered in either direction of a keyed handshake fails it: the
        /// connecting side never accepts an altered answer (or an answer to an altered
        /// hello), and the accepting side never accepts an altered hello or proof.
        #[test]
        fn any_altered_byte_fails_a_keyed_handshake(to_accepting: bool, at in 0usize..400, xor in 1u8..=255) {
            let k = key(1);
            let ctx = ctx(Some(k.clone()));
            let (c, s, flipped) = handshake(&ctx, Some(&k), Some((to_accepting, at, xor)));
            if flipped {
                prop_assert!(c.is_err(), "accepted after byte {at} {} was altered: {c:?}", if to_accepting { "up" } else { "down" });
                if to_accepting {
                    prop_assert!(!matches!(s, Ok(Some(_))), "accepting side accepted an altered byte {at}: {s:?}");
                }
            } else {
                prop_assert!(c.is_ok() && matches!(s, Ok(Some(_))), "{c:?} {s:?}");
            }
        }

        /// Arbitrary bytes from the peer never panic either side, and never authenticate:
        /// a keyed accepting side never lets the peer in, a keyed connecting side never
        /// accepts the answer (the peer cannot know the nonce it must MAC).
        #[test]
        fn arbitrary_peer_bytes_never_authenticate(bytes in peer_bytes(), keyed: bool) {
            let k = key(1);
            let (stats, served) = accept_arbitrary(keyed.then(|| k.clone()), &bytes);
            if keyed {
                prop_assert!(!matches!(served, Ok(Some(_))), "{served:?} {stats:?}");
            }
            let answered = initiate_arbitrary(keyed.then_some(&k), &bytes);
            if keyed {
                prop_assert!(answered.is_err(), "{answered:?}");
            }
        }
    }
}
