//! The prefill side of one connection.

use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvxfer_core::plan::BlockRange;
use std::collections::HashMap;

use kvxfer_core::{
    CancelOutcome, EndKind, HeartbeatOutcome, LeaseTable, NotifyOutcome, ReadGuard, ReadRefused,
};
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1::{self, ErrorCode, LeaseOutcome};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::{debug, info, warn};

use crate::frame::{self, Frame, FrameError};
use crate::Limits;

/// Counters of a prefill agent's connections.
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Payload bytes written for reads.
    pub bytes_served: AtomicU64,
    /// Reads served.
    pub reads_served: AtomicU64,
    /// Reads refused (unknown or ended lease, bad token, blocks outside layout or lease).
    pub reads_refused: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Handshakes refused: version or compatibility mismatch, no hello first, or an
    /// authentication refusal (also counted in `auth_required` / `auth_failed`).
    pub handshakes_refused: AtomicU64,
    /// Authenticated handshakes the peer abandoned after our challenge: it closed, went
    /// silent for `Limits::io_timeout` or sent an error instead of its proof (a peer
    /// without the key probing, or a broken one).
    pub handshakes_abandoned: AtomicU64,
    /// Connections closed for a protocol violation (oversized, unknown or malformed frame).
    pub protocol_errors: AtomicU64,
    /// Ranges pinned for one-sided reads (UCX, RDMA).
    pub pins: AtomicU64,
    /// Pins not yet released (by unpin or by their connection closing).
    pub pins_open: AtomicU64,
    /// Connections refused because `Limits::max_connections` were open.
    pub connections_refused: AtomicU64,
    /// Pins refused because `Limits::max_inflight_reads` were open on their connection.
    pub pins_refused: AtomicU64,
    /// Pins dropped by the server after `Limits::pin_timeout`.
    pub pins_expired: AtomicU64,
    /// Connections closed because a frame stalled midway for `Limits::io_timeout`.
    pub stalled_frames: AtomicU64,
    /// Handshakes refused because the peer has no cluster key while this agent requires one
    /// (`AUTH_REQUIRED`; also counted in `handshakes_refused`).
    pub auth_required: AtomicU64,
    /// Authenticated handshakes that failed: a proof that did not verify (another key, or a
    /// replayed handshake), a peer that refused our challenge, or a peer requiring a key this
    /// agent does not have (`AUTH_FAILED`; also counted in `handshakes_refused`).
    pub auth_failed: AtomicU64,
    /// Connections refused because their peer had `Limits::max_connections_per_peer` open.
    pub peer_connections_refused: AtomicU64,
    /// Connections closed after `Limits::idle_timeout` without a frame or a pin.
    pub idle_closed: AtomicU64,
    /// Connections closed because a read's payload did not move within its overall
    /// deadline (`Limits::transfer_deadline`).
    pub slow_transfers: AtomicU64,
    /// Rate limit of the warnings peers can trigger at will.
    pub warnings: WarnBudget,
}

/// Most warnings a second about what peers did (refused requests, bad frames); the rest
/// are counted and reported with the next warning, so a flood cannot flood the log too.
pub const WARNINGS_PER_SECOND: u32 = 20;

/// Rate limit of peer-triggered warnings: at most [`WARNINGS_PER_SECOND`].
#[derive(Debug, Default)]
pub struct WarnBudget {
    /// Start of the current second, warnings in it, warnings suppressed since the last one
    /// logged.
    state: std::sync::Mutex<(Option<Instant>, u32, u64)>,
}

impl WarnBudget {
    /// `Some(suppressed)` when a warning may be logged now (with how many were suppressed
    /// before it), `None` when this one is suppressed.
    pub fn allow(&self) -> Option<u64> {
        let now = Instant::now();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (start, used, suppressed) = &mut *st;
        if start.is_none_or(|s| now.duration_since(s).as_secs() >= 1) {
            *start = Some(now);
            *used = 0;
        }
        if *used >= WARNINGS_PER_SECOND {
            *suppressed += 1;
            return None;
        }
        *used += 1;
        Some(std::mem::take(suppressed))
    }
}

/// A snapshot of [`ServerCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct ServerStats {
    pub bytes_served: u64,
    pub reads_served: u64,
    pub reads_refused: u64,
    pub connections: u64,
    pub handshakes_refused: u64,
    pub handshakes_abandoned: u64,
    pub protocol_errors: u64,
    pub pins: u64,
    pub pins_open: u64,
    pub connections_refused: u64,
    pub pins_refused: u64,
    pub pins_expired: u64,
    pub stalled_frames: u64,
    pub auth_required: u64,
    pub auth_failed: u64,
    pub peer_connections_refused: u64,
    pub idle_closed: u64,
    pub slow_transfers: u64,
}

impl ServerCounters {
    /// A snapshot.
    pub fn snapshot(&self) -> ServerStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerStats {
            bytes_served: l(&self.bytes_served),
            reads_served: l(&self.reads_served),
            reads_refused: l(&self.reads_refused),
            connections: l(&self.connections),
            handshakes_refused: l(&self.handshakes_refused),
            handshakes_abandoned: l(&self.handshakes_abandoned),
            protocol_errors: l(&self.protocol_errors),
            pins: l(&self.pins),
            pins_open: l(&self.pins_open),
            connections_refused: l(&self.connections_refused),
            pins_refused: l(&self.pins_refused),
            pins_expired: l(&self.pins_expired),
            stalled_frames: l(&self.stalled_frames),
            auth_required: l(&self.auth_required),
            auth_failed: l(&self.auth_failed),
            peer_connections_refused: l(&self.peer_connections_refused),
            idle_closed: l(&self.idle_closed),
            slow_transfers: l(&self.slow_transfers),
        }
    }
}

/// Everything a connection of a prefill agent needs.
#[derive(Debug)]
pub struct ServeContext {
    /// The lease table.
    pub table: Arc<LeaseTable>,
    /// The registered KV cache reads are served from.
    pub memory: Arc<KvMemory>,
    /// What this agent answers a compatible hello with.
    pub hello_ack: v1::HelloAck,
    /// The cluster key peers must prove they hold; `None`: peers are not authenticated.
    pub cluster_key: Option<crate::handshake::ClusterKey>,
    /// Limits and timeouts.
    pub limits: Limits,
    /// Counters.
    pub counters: Arc<ServerCounters>,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What a refused read is told: its code and message. An unknown id and a wrong token get
/// the same answer, so a peer without the token cannot tell unknown, live and ended ids
/// apart (the prefill side's counters and log still tell them apart; "ended" is said only
/// with the right token).
fn refusal_answer(r: &ReadRefused, id: &str) -> (ErrorCode, String) {
    match r {
        ReadRefused::Unknown(_) | ReadRefused::BadToken(_) => {
            (ErrorCode::UnknownLease, format!("no lease for request {id} with this token"))
        }
        ReadRefused::Ended(_) => (ErrorCode::LeaseEnded, r.to_string()),
        ReadRefused::OutOfRange { .. }
        | ReadRefused::NotLeased { .. }
        | ReadRefused::BadSize { .. }
        | ReadRefused::EmptyRange { .. } => (ErrorCode::BlockOutOfRange, r.to_string()),
        _ => (ErrorCode::Internal, r.to_string()),
    }
}

/// The wire outcome of a lease that had already ended.
fn already(kind: EndKind) -> LeaseOutcome {
    match kind {
        EndKind::Pulled => LeaseOutcome::AlreadyPulled,
        EndKind::Released => LeaseOutcome::AlreadyReleased,
        EndKind::Expired => LeaseOutcome::AlreadyExpired,
    }
}

/// Why [`refuse_connection`] turns a connection away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `Limits::max_connections` are open.
    TooManyConnections,
    /// The peer has `Limits::max_connections_per_peer` open.
    TooManyFromPeer,
}

/// Serves one accepted connection until the peer closes it or breaks the protocol.
pub async fn serve_connection(mut stream: TcpStream, ctx: Arc<ServeContext>) {
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    bump(&ctx.counters.connections);
    crate::tune_stream(&stream, ctx.limits.io_timeout);
    match serve_inner(&mut stream, &ctx, &peer).await {
        Ok(()) => debug!(%peer, "connection closed"),
        Err(e) => debug!(%peer, error = %e, "connection ended"),
    }
}

/// Refuses a connection accepted past `Limits::max_connections` or
/// `Limits::max_connections_per_peer`: one error frame (bounded by the I/O timeout), then
/// close.
pub async fn refuse_connection(mut stream: TcpStream, ctx: Arc<ServeContext>, why: Refusal) {
    let msg = match why {
        Refusal::TooManyConnections => {
            bump(&ctx.counters.connections_refused);
            format!("this agent serves at most {} connections at once", ctx.limits.max_connections)
        }
        Refusal::TooManyFromPeer => {
            bump(&ctx.counters.peer_connections_refused);
            format!(
                "this agent serves at most {} connections at once from one peer address",
                ctx.limits.max_connections_per_peer
            )
        }
    };
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        warn!(peer = ?stream.peer_addr().ok(), suppressed, "connection refused: {msg}");
    }
    let _ =
        tokio::time::timeout(ctx.limits.io_timeout, refuse(&mut stream, ErrorCode::LimitExceeded, msg, 0))
            .await;
}

/// Sends an error frame and reports the connection as finished.
pub(crate) async fn refuse(
    stream: &mut TcpStream,
    code: ErrorCode,
    msg: String,
    seq: u64,
) -> Result<(), FrameError> {
    let mut scratch = Vec::new();
    frame::write_frame(stream, &Frame::error(code, msg, seq), &mut scratch).await?;
    let _ = stream.shutdown().await;
    Ok(())
}

async fn serve_inner(stream: &mut TcpStream, ctx: &ServeContext, peer: &str) -> Result<(), FrameError> {
    let max = ctx.limits.max_frame_len;
    let mut buf = Vec::new();
    let mut scratch = Vec::new();

    // Handshake (authenticated when either side has a cluster key): nothing else is read
    // or said before it succeeded.
    if crate::handshake::accept(stream, ctx, peer, &mut buf, &mut scratch).await?.is_none() {
        return Ok(());
    }

    // Read guards of one-sided reads, by pin sequence number; dropped with the connection.
    let mut pins: HashMap<u64, Pinned> = HashMap::new();
    let mut last_frame = Instant::now();
    loop {
        // Pins are swept on every iteration, not only when the socket is quiet: a peer that
        // always has a frame queued must not keep its pins past their deadline.
        let now = Instant::now();
        expire_pins(&mut pins, ctx, now);
        // Idle between frames is fine (pooled connections) up to `idle_timeout` without
        // pins, and with pins until the earliest pin deadline.
        let wake = pins
            .values()
            .map(|p| p.deadline)
            .min()
            .unwrap_or_else(|| crate::instant_after(last_frame, ctx.limits.idle_timeout));
        let idle = Some(wake.saturating_duration_since(now));
        let f = match frame::read_frame_timed(stream, max, &mut buf, idle, ctx.limits.io_timeout).await {
            Ok(f) => f,
            Err(FrameError::Closed) => return Ok(()),
            Err(FrameError::Idle) => {
                let now = Instant::now();
                if pins.is_empty() && now.saturating_duration_since(last_frame) >= ctx.limits.idle_timeout {
                    bump(&ctx.counters.idle_closed);
                    debug!("closing a connection idle for {:?}", ctx.limits.idle_timeout);
                    let _ = stream.shutdown().await;
                    return Ok(());
                }
                continue;
            }
            Err(FrameError::Timeout) => {
                bump(&ctx.counters.stalled_frames);
                if let Some(suppressed) = ctx.counters.warnings.allow() {
                    warn!(
                        suppressed,
                        "closing connection: a frame stalled midway for {:?}", ctx.limits.io_timeout
                    );
                }
                return Err(FrameError::Timeout);
            }
            Err(e) => return protocol_error(stream, ctx, e).await,
        };
        let now = Instant::now();
        last_frame = now;
        let reply = match f {
            Frame::ReadRequest(req) => {
                serve_read(stream, ctx, req, &mut scratch).await?;
                continue;
            }
            Frame::Pin(req) => {
                if pins.len() >= ctx.limits.max_inflight_reads || pins.contains_key(&req.seq) {
                    bump(&ctx.counters.pins_refused);
                    let msg = format!(
                        "pin {} refused: {} pins open on this connection (at most {}) or the sequence number is in use",
                        req.seq,
                        pins.len(),
                        ctx.limits.max_inflight_reads
                    );
                    Frame::error(ErrorCode::LimitExceeded, msg, req.seq)
                } else {
                    match begin(ctx, &req) {
                        Ok((guard, bytes)) => {
                            let payload_crc32c =
                                if req.pin_crc32c { payload_crc(ctx, &guard, &ranges_of(&req)) } else { 0 };
                            bump(&ctx.counters.pins);
                            bump(&ctx.counters.pins_open);
                            // Held longer for larger pins, so a big one-sided read has time
                            // to finish; the holder is told how long.
                            let hold = ctx.limits.pin_hold(bytes);
                            debug!(remote_request_id = %req.remote_request_id, seq = req.seq, bytes, ?hold, "pinned");
                            let deadline = crate::instant_after(now, hold);
                            pins.insert(
                                req.seq,
                                Pinned { guard, bytes, hold, deadline, counters: ctx.counters.clone() },
                            );
                            let held_for_ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
                            Frame::PinAck(v1::PinAck { seq: req.seq, payload_crc32c, held_for_ms })
                        }
                        Err(e) => Frame::Error(e),
                    }
                }
            }
            Frame::Unpin(u) => {
                let pin = pins.remove(&u.seq);
                let held = pin.is_some();
                if let Some(pin) = pin {
                    if u.completed {
                        ctx.counters.bytes_served.fetch_add(pin.bytes, Ordering::Relaxed);
                        bump(&ctx.counters.reads_served);
                    }
                    debug!(remote_request_id = %pin.guard.request_id(), seq = u.seq, completed = u.completed, "unpinned");
                }
                Frame::UnpinAck(v1::UnpinAck { seq: u.seq, held })
            }
            Frame::Notify(n) => {
                let out = ctx.table.notify(&n.remote_request_id, &n.lease_token, &n.consumer_id, now);
                // A wrong token is answered like an unknown id (see `refusal_answer`).
                let (outcome, remaining) = match out {
                    NotifyOutcome::Counted { remaining } => (LeaseOutcome::Counted, remaining),
                    NotifyOutcome::Pulled => (LeaseOutcome::Pulled, 0),
                    NotifyOutcome::Duplicate => (LeaseOutcome::Duplicate, 0),
                    NotifyOutcome::Unrecognized | NotifyOutcome::BadToken => (LeaseOutcome::Unrecognized, 0),
                    NotifyOutcome::AlreadyEnded { kind, .. } => (already(kind), 0),
                };
                let loud = || ctx.counters.warnings.allow();
                match out {
                    NotifyOutcome::Unrecognized => {
                        if let Some(suppressed) = loud() {
                            warn!(
                                remote_request_id = %n.remote_request_id, consumer = %n.consumer_id, suppressed,
                                "notification for unrecognized request; nothing changed"
                            )
                        }
                    }
                    NotifyOutcome::BadToken => {
                        if let Some(suppressed) = loud() {
                            warn!(
                                remote_request_id = %n.remote_request_id, consumer = %n.consumer_id, suppressed,
                                "notification with a wrong lease token; nothing changed"
                            )
                        }
                    }
                    NotifyOutcome::Duplicate => info!(
                        remote_request_id = %n.remote_request_id, consumer = %n.consumer_id,
                        "duplicate notification; nothing changed"
                    ),
                    NotifyOutcome::AlreadyEnded { kind, counted } => info!(
                        remote_request_id = %n.remote_request_id, consumer = %n.consumer_id, ?kind, counted,
                        "notification of a lease that already ended (a retry?); answered from its record"
                    ),
                    _ => {
                        debug!(remote_request_id = %n.remote_request_id, consumer = %n.consumer_id, ?out, "notified")
                    }
                }
                Frame::NotifyAck(v1::NotifyAck { outcome: outcome as i32, remaining })
            }
            Frame::Heartbeat(hb) => {
                let outcomes = hb
                    .leases
                    .iter()
                    .map(|l| {
                        let out = ctx.table.heartbeat(&l.remote_request_id, &l.lease_token, now);
                        let o = match out {
                            HeartbeatOutcome::Extended { .. } => LeaseOutcome::Extended,
                            HeartbeatOutcome::Unrecognized | HeartbeatOutcome::BadToken => {
                                LeaseOutcome::Unrecognized
                            }
                            HeartbeatOutcome::AlreadyEnded(kind) => already(kind),
                        };
                        debug!(remote_request_id = %l.remote_request_id, ?out, "heartbeat");
                        o as i32
                    })
                    .collect();
                Frame::HeartbeatAck(v1::HeartbeatAck { outcomes })
            }
            Frame::Cancel(c) => {
                let out = ctx.table.cancel(&c.remote_request_id, &c.lease_token, now);
                let o = match out {
                    CancelOutcome::Released => LeaseOutcome::Released,
                    CancelOutcome::Unrecognized | CancelOutcome::BadToken => LeaseOutcome::Unrecognized,
                    CancelOutcome::AlreadyEnded(kind) => already(kind),
                };
                info!(remote_request_id = %c.remote_request_id, ?out, "cancel");
                Frame::CancelAck(v1::CancelAck { outcome: o as i32 })
            }
            other => {
                bump(&ctx.counters.protocol_errors);
                let msg = format!("unexpected {:?} frame from a decode peer", other.frame_type());
                return refuse(stream, ErrorCode::Malformed, msg, 0).await;
            }
        };
        frame::write_frame(stream, &reply, &mut scratch).await?;
    }
}

pub(crate) async fn protocol_error(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    e: FrameError,
) -> Result<(), FrameError> {
    let code = match &e {
        FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
        FrameError::UnknownType(_) => ErrorCode::UnknownFrameType,
        FrameError::Malformed { .. } | FrameError::Empty => ErrorCode::Malformed,
        // The peer is gone or silent: nobody to tell.
        FrameError::Closed | FrameError::Io(_) | FrameError::Timeout | FrameError::Idle => return Err(e),
    };
    bump(&ctx.counters.protocol_errors);
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        warn!(error = %e, suppressed, "closing connection after a protocol error");
    }
    refuse(stream, code, e.to_string(), 0).await
}

/// A pinned range: its read guard, its payload bytes, how long it is held and until when,
/// and the open-pin gauge it holds.
struct Pinned {
    guard: ReadGuard,
    bytes: u64,
    hold: std::time::Duration,
    deadline: Instant,
    counters: Arc<ServerCounters>,
}

/// Drops the pins whose deadline passed (loudly: the peer neither unpinned nor closed).
fn expire_pins(pins: &mut HashMap<u64, Pinned>, ctx: &ServeContext, now: Instant) {
    pins.retain(|seq, p| {
        let keep = p.deadline > now;
        if !keep {
            bump(&ctx.counters.pins_expired);
            if let Some(suppressed) = ctx.counters.warnings.allow() {
                warn!(
                    remote_request_id = %p.guard.request_id(), seq, suppressed,
                    "pin dropped after {:?} without an unpin", p.hold
                );
            }
        }
        keep
    });
}

/// CRC-32C of the blocks of `ranges`, which `guard` keeps leased.
fn payload_crc(ctx: &ServeContext, guard: &ReadGuard, ranges: &[BlockRange]) -> u32 {
    let _ = guard;
    // SAFETY: `guard` pins the lease and `begin_read` checked every block of `ranges`
    // against it; the owner does not write leased blocks (kvxfer-mem's access contract).
    unsafe { ctx.memory.crc32c(ranges.iter().map(|r| (r.start, r.count))) }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.counters.pins_open.fetch_sub(1, Ordering::Relaxed);
    }
}

fn ranges_of(req: &v1::ReadRequest) -> Vec<BlockRange> {
    req.ranges.iter().map(|r| BlockRange { start: r.start, count: r.count }).collect()
}

/// Takes a read guard for a read or pin request: the guard and the payload bytes, or the
/// error to answer with.
fn begin(ctx: &ServeContext, req: &v1::ReadRequest) -> Result<(ReadGuard, u64), v1::Error> {
    let ranges = ranges_of(req);
    match ctx.table.begin_read(&req.remote_request_id, &req.lease_token, &ranges, Instant::now()) {
        Ok(g) => {
            let bytes = ranges.iter().map(|r| u64::from(r.count) * ctx.memory.layout().block_bytes()).sum();
            Ok((g, bytes))
        }
        Err(refused) => {
            bump(&ctx.counters.reads_refused);
            if let Some(suppressed) = ctx.counters.warnings.allow() {
                warn!(remote_request_id = %req.remote_request_id, suppressed, "read refused: {refused}");
            }
            let (code, message) = refusal_answer(&refused, &req.remote_request_id);
            Err(v1::Error { code: code as i32, message, seq: req.seq })
        }
    }
}

/// Counts (and warns about, rate-limited) a read whose payload missed its deadline, and
/// makes the close a reset: what is still queued in the send buffer is dropped rather than
/// trickled out to the slow reader after the connection is "closed".
fn too_slow(stream: &TcpStream, ctx: &ServeContext, e: &FrameError, bytes: u64) {
    if matches!(e, FrameError::Timeout) {
        let _ = socket2::SockRef::from(stream).set_linger(Some(std::time::Duration::ZERO));
        bump(&ctx.counters.slow_transfers);
        if let Some(suppressed) = ctx.counters.warnings.allow() {
            warn!(
                bytes,
                suppressed,
                "closing connection: a read's payload did not move within {:?}",
                ctx.limits.transfer_deadline(bytes)
            );
        }
    }
}

/// Bytes of payload checksummed and written per vectored write: small enough to stay in
/// cache between the CRC and the kernel's copy.
const CRC_GROUP: usize = 256 * 1024;

/// Writes all of `slices`: each write must make progress within `timeout`, and all of them
/// finish by `deadline` (the read's overall deadline), else [`FrameError::Timeout`].
async fn write_all_vectored(
    stream: &mut TcpStream,
    slices: &mut [IoSlice<'_>],
    timeout: std::time::Duration,
    deadline: Instant,
) -> Result<(), FrameError> {
    let mut rest = slices;
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(timeout.min(left), stream.write_vectored(rest))
            .await
            .map_err(|_| FrameError::Timeout)??;
        if n == 0 {
            return Err(FrameError::Io(std::io::ErrorKind::WriteZero.into()));
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

async fn serve_read(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    req: v1::ReadRequest,
    scratch: &mut Vec<u8>,
) -> Result<(), FrameError> {
    let (guard, payload_len) = match begin(ctx, &req) {
        Ok(g) => g,
        Err(e) => {
            frame::write_frame(stream, &Frame::Error(e), scratch).await?;
            return Ok(());
        }
    };
    let ranges = ranges_of(&req);
    let mem = &ctx.memory;
    scratch.clear();
    Frame::ReadResponse(v1::ReadResponse { seq: req.seq, payload_len }).encode(scratch);
    let io_timeout = ctx.limits.io_timeout;
    // The whole payload must move by this deadline, not only make progress every
    // `io_timeout`: a peer reading a byte at a time cannot hold the read guard for ever.
    let deadline = crate::instant_after(Instant::now(), ctx.limits.transfer_deadline(payload_len));
    // Written in groups of about CRC_GROUP bytes: each group's CRC is taken just before the
    // kernel copies it, while it is in cache; the header rides with the first group and the
    // CRC trailer with the last.
    let mut crc = 0u32;
    let mut trailer = [0u8; 4];
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(16);
    slices.push(IoSlice::new(scratch));
    let mut group = 0usize;
    for r in &ranges {
        for c in mem.run_chunks(r.start, r.count) {
            // SAFETY: `guard` pins the lease, and every block of `ranges` was checked by
            // `begin_read` to belong to it; the owner does not write leased blocks (the
            // access contract of kvxfer-mem). The slices die before `guard` is dropped.
            let bytes = unsafe { mem.chunk(c) };
            for piece in bytes.chunks(CRC_GROUP) {
                crc = crc32c::crc32c_append(crc, piece);
                slices.push(IoSlice::new(piece));
                group += piece.len();
                if group >= CRC_GROUP {
                    write_all_vectored(stream, &mut slices, io_timeout, deadline)
                        .await
                        .inspect_err(|e| too_slow(stream, ctx, e, payload_len))?;
                    slices.clear();
                    group = 0;
                }
            }
        }
    }
    trailer.copy_from_slice(&crc.to_be_bytes());
    slices.push(IoSlice::new(&trailer));
    write_all_vectored(stream, &mut slices, io_timeout, deadline)
        .await
        .inspect_err(|e| too_slow(stream, ctx, e, payload_len))?;
    drop(slices);
    drop(guard);
    ctx.counters.bytes_served.fetch_add(payload_len, Ordering::Relaxed);
    bump(&ctx.counters.reads_served);
    debug!(remote_request_id = %req.remote_request_id, bytes = payload_len, "read served");
    Ok(())
}
