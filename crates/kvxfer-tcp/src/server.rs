//! The prefill side of one connection: the handshake, then a loop that takes one frame at a
//! time from its buffered reader (one read of the socket for all frames that have arrived;
//! their answers leave together) and hands it to `dispatch`: reads served from registered memory (`read.rs`), pins
//! for one-sided reads (`pins.rs`), and notify / heartbeat / cancel applied to the lease
//! table (`control.rs`). What those handlers share, [`ServeContext`] and the bounded write of
//! a reply, is `context.rs`, below them all.

use std::sync::Arc;
use std::time::Instant;

use kvxfer_core::log::Peer;
use kvxfer_proto::v1::{self, ErrorCode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::{debug, warn};

use crate::context::{write_bytes, write_reply};
use crate::frame::{self, Frame, FrameError};
use crate::pins::Pins;
use crate::stats::bump;

pub use crate::context::{ServeBudgets, ServeContext};
pub use crate::stats::{ServerCounters, ServerStats, WarnBudget, WARNINGS_PER_SECOND};

/// Why a connection is turned away: by [`refuse_connection`] before its handshake, or in
/// place of its `HelloAck` when its [`Admit`] refuses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// `Limits::max_connections` are open.
    TooManyConnections,
    /// The peer has `Limits::max_connections_per_peer` open.
    TooManyFromPeer,
    /// `Limits::max_handshakes` are under way.
    TooManyHandshakes,
    /// The peer has `Limits::max_handshakes_per_peer` under way.
    TooManyHandshakesFromPeer,
}

impl Refusal {
    /// Counts the refusal and says what the peer is told.
    pub(crate) fn count_and_explain(self, ctx: &ServeContext) -> String {
        let (counter, what) = match self {
            Refusal::TooManyConnections => (
                &ctx.counters.connections_refused,
                format!("at most {} connections at once", ctx.limits.max_connections),
            ),
            Refusal::TooManyFromPeer => (
                &ctx.counters.peer_connections_refused,
                format!(
                    "at most {} connections at once from one peer address",
                    ctx.limits.max_connections_per_peer
                ),
            ),
            Refusal::TooManyHandshakes => (
                &ctx.counters.preauth_refused,
                format!("at most {} handshakes at once", ctx.limits.max_handshakes),
            ),
            Refusal::TooManyHandshakesFromPeer => (
                &ctx.counters.preauth_refused,
                format!(
                    "at most {} handshakes at once from one peer address",
                    ctx.limits.max_handshakes_per_peer
                ),
            ),
        };
        bump(counter);
        format!("this agent serves {what}")
    }
}

/// Takes a connection's place among those served (`Limits::max_connections`,
/// `Limits::max_connections_per_peer`) once its handshake verified, and gives back what it
/// held before (its place among the handshakes under way). What it returns is held until
/// the connection ends; a refusal is answered with a LIMIT_EXCEEDED error in place of the
/// `HelloAck`. Dropped uncalled when the handshake fails.
pub type Admit = Box<dyn FnOnce() -> Result<Box<dyn Send>, Refusal> + Send>;

/// An [`Admit`] that admits every connection (a server that counts nothing).
pub fn admit_any() -> Admit {
    Box::new(|| Ok(Box::new(())))
}

/// Serves one accepted connection until the peer closes it or breaks the protocol;
/// `admit` is asked once its handshake verified. ([`handshake_connection`] and
/// [`serve_admitted`] are the same in two halves, for a server that runs them apart.)
pub async fn serve_connection(mut stream: TcpStream, ctx: Arc<ServeContext>, admit: Admit) {
    if let Some(admitted) = handshake_connection(&mut stream, &ctx, admit).await {
        serve_admitted(stream, ctx, admitted).await;
    }
}

/// A connection whose handshake verified and that its [`Admit`] admitted: what
/// [`serve_admitted`] goes on with.
pub struct Admitted {
    /// The peer's address, for logs.
    peer: String,
    /// Bytes the peer sent after its handshake, already read.
    reader: frame::FrameReader,
    /// The connection's place among those served, held until it ends.
    _place: Box<dyn Send>,
    /// The peer asked for a control-only connection (`Hello::control_only`): cancels only.
    control_only: bool,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted").field("peer", &self.peer).finish_non_exhaustive()
    }
}

/// The first half of [`serve_connection`]: counts the connection, tunes its socket and runs
/// the handshake (authenticated when either side has a cluster key; nothing else is read or
/// said before it succeeded). `None` when it failed or was refused (the peer was told, when
/// there was someone to tell). A server may run this on a thread of its own, so peers that
/// have proved nothing compete with served connections at a lower priority, and move the
/// stream on (`into_std`, then `from_std` on the serving runtime).
pub async fn handshake_connection(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    admit: Admit,
) -> Option<Admitted> {
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    bump(&ctx.counters.connections);
    crate::tune_stream(stream, ctx.limits.io_timeout);
    let mut reader = frame::FrameReader::with_budget(ctx.budgets.frames.clone());
    let mut scratch = Vec::new();
    match crate::handshake::accept_buffered(stream, ctx, &peer, &mut reader, &mut scratch, admit).await {
        Ok(Some((hello, place))) => {
            Some(Admitted { peer, reader, _place: place, control_only: hello.control_only })
        }
        Ok(None) => {
            debug!(%peer, "connection closed at its handshake");
            None
        }
        Err(e) => {
            debug!(%peer, error = %Peer(&e), "connection ended at its handshake");
            None
        }
    }
}

/// The second half of [`serve_connection`]: serves an admitted connection until the peer
/// closes it or breaks the protocol.
pub async fn serve_admitted(mut stream: TcpStream, ctx: Arc<ServeContext>, admitted: Admitted) {
    let Admitted { peer, mut reader, _place, control_only } = admitted;
    match serve_frames(&mut stream, &ctx, &mut reader, control_only).await {
        Ok(()) => debug!(%peer, "connection closed"),
        Err(e) => debug!(%peer, error = %Peer(&e), "connection ended"),
    }
}

/// Refuses a connection before its handshake (`Limits::max_handshakes`,
/// `Limits::max_handshakes_per_peer`): one error frame (bounded by the I/O timeout), then
/// close.
pub async fn refuse_connection(mut stream: TcpStream, ctx: Arc<ServeContext>, why: Refusal) {
    let msg = why.count_and_explain(&ctx);
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        warn!(peer = ?stream.peer_addr().ok(), suppressed, "connection refused: {msg}");
    }
    let _ = refuse(&mut stream, &ctx, ErrorCode::LimitExceeded, msg, 0).await;
}

/// Sends an error frame and reports the connection as finished (the write and the close
/// bounded by `Limits::io_timeout`).
pub(crate) async fn refuse(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    code: ErrorCode,
    msg: String,
    seq: u64,
) -> Result<(), FrameError> {
    let mut scratch = Vec::new();
    write_reply(stream, ctx, &Frame::error(code, msg, seq), &mut scratch).await?;
    let _ = tokio::time::timeout(ctx.limits.io_timeout, stream.shutdown()).await;
    Ok(())
}

/// Answers held back to leave in one write with the answers to the frames behind them are
/// written at this size at the latest.
const BATCH_BYTES: usize = 16 * 1024;

/// Writes the answers held back in `batch` (if any) and empties it.
async fn flush(stream: &mut TcpStream, ctx: &ServeContext, batch: &mut Vec<u8>) -> Result<(), FrameError> {
    if batch.is_empty() {
        return Ok(());
    }
    let written = write_bytes(stream, ctx, batch).await;
    batch.clear();
    written
}

/// The connection loop after the handshake (`control_only`: a connection whose layouts
/// were not checked, which may only cancel leases).
async fn serve_frames(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    reader: &mut frame::FrameReader,
    control_only: bool,
) -> Result<(), FrameError> {
    let max = ctx.limits.serve_caps();
    let mut scratch = Vec::new();

    // Read guards of one-sided reads; dropped with the connection.
    let mut pins = Pins::default();
    let mut last_frame = Instant::now();
    // The lease id of a read refused by the frame just before (see `dispatch`).
    let mut refused_read: Option<String> = None;
    // Answers not written yet: while whole frames are buffered behind them, answers wait to
    // leave together (one write for a batch of pipelined frames); written before anything
    // that may wait.
    let mut batch: Vec<u8> = Vec::new();
    loop {
        // One unit of the task's scheduling budget per frame: a peer that pipelines
        // thousands of frames (they are decoded from the buffer without touching the
        // socket) yields its worker after tokio's budget, instead of holding it for all of
        // them while other connections wait.
        tokio::task::coop::consume_budget().await;
        if !reader.holds_frame(max) {
            flush(stream, ctx, &mut batch).await?;
        }
        // Pins are swept on every iteration, not only when the socket is quiet: a peer that
        // always has a frame queued must not keep its pins past their deadline.
        let now = Instant::now();
        pins.expire(ctx, now);
        // Idle between frames is fine (pooled connections) up to `idle_timeout` without
        // pins, and with pins until the earliest pin deadline.
        let wake = pins
            .earliest_deadline()
            .unwrap_or_else(|| crate::instant_after(last_frame, ctx.limits.idle_timeout));
        let idle = Some(wake.saturating_duration_since(now));
        let read = reader.read_frame_timed(stream, max, idle, ctx.limits.io_timeout).await;
        if read.is_err() {
            // The answers to the frames before go out before the connection ends.
            flush(stream, ctx, &mut batch).await?;
        }
        let f = match read {
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
        if control_only && !matches!(f, Frame::Cancel(_)) {
            bump(&ctx.counters.protocol_errors);
            flush(stream, ctx, &mut batch).await?;
            let message = format!(
                "a {:?} frame on a control-only connection (its layouts were not checked: it may only cancel leases)",
                f.frame_type()
            );
            return refuse(stream, ctx, ErrorCode::CompatMismatch, message, 0).await;
        }
        // A frame naming a lease that is not armed yet waits (bounded) for it: the answers
        // before it do not.
        if crate::arm::may_wait(ctx, &f) {
            flush(stream, ctx, &mut batch).await?;
            crate::arm::wait_for_arm(ctx, &f).await;
        }
        let now = Instant::now();
        last_frame = now;
        let after_refused = refused_read.take();
        match dispatch(ctx, &mut pins, f, now, after_refused.as_deref()) {
            Action::Reply(reply) => {
                reply.encode(&mut batch);
                if batch.len() >= BATCH_BYTES {
                    flush(stream, ctx, &mut batch).await?;
                }
            }
            Action::Pin(req) => {
                if req.pin_crc32c {
                    flush(stream, ctx, &mut batch).await?;
                }
                pins.pin(ctx, &req, now).await.encode(&mut batch);
                if batch.len() >= BATCH_BYTES {
                    flush(stream, ctx, &mut batch).await?;
                }
            }
            Action::Read(req) => {
                flush(stream, ctx, &mut batch).await?;
                let answer_follows = crate::read::notify_follows(
                    stream,
                    reader,
                    &req.remote_request_id,
                    &req.lease_token,
                    max,
                );
                if let crate::read::ReadServed::Refused(id) =
                    crate::read::serve_read(stream, ctx, req, &mut scratch, answer_follows).await?
                {
                    refused_read = Some(id);
                }
            }
            Action::Close { code, message, seq } => {
                flush(stream, ctx, &mut batch).await?;
                return refuse(stream, ctx, code, message, seq).await;
            }
        }
    }
}

/// What the connection does with one frame from its peer.
enum Action {
    /// Answer with this frame.
    Reply(Frame),
    /// Serve this read (its answer is a header, the payload and a trailer, or an error).
    Read(v1::ReadRequest),
    /// Pin these ranges (its CRC, when asked for, runs off the runtime: the answers before
    /// it leave first).
    Pin(v1::ReadRequest),
    /// Send this error and close: the peer broke the protocol.
    Close {
        /// The error code.
        code: ErrorCode,
        /// What the peer is told.
        message: String,
        /// The sequence number of the request refused (0: none).
        seq: u64,
    },
}

/// One frame from the peer in, what to do about it out: every decision of the connection
/// loop that needs no I/O (lease-table changes, pins, counters and logs included).
/// `after_refused` is the lease id of a read the frame just before asked for and was
/// refused: a notify of that lease right behind it (a decode agent sending its notify with
/// its read, `AgentConfig::notify_with_read`) is not counted — nothing was sent — and is
/// answered unrecognized; the decode side then cancels the lease as for any failed read.
fn dispatch(
    ctx: &ServeContext,
    pins: &mut Pins,
    f: Frame,
    now: Instant,
    after_refused: Option<&str>,
) -> Action {
    let reply = match f {
        Frame::ReadRequest(req) => return Action::Read(req),
        Frame::Notify(n) if after_refused == Some(n.remote_request_id.as_str()) => {
            debug!(remote_request_id = %Peer(&n.remote_request_id), "notification behind a refused read; not counted");
            Frame::NotifyAck(v1::NotifyAck { outcome: v1::LeaseOutcome::Unrecognized as i32, remaining: 0 })
        }
        Frame::Pin(req) if !crate::pins::offers_one_sided(ctx) => {
            let (code, message) = crate::pins::refuse_pin(ctx, &req);
            return Action::Close { code, message, seq: req.seq };
        }
        Frame::Pin(req) => return Action::Pin(req),
        Frame::Unpin(u) => pins.unpin(ctx, &u),
        Frame::Notify(n) => crate::control::notify(ctx, &n, now),
        Frame::Heartbeat(hb) => crate::control::heartbeat(ctx, &hb, now),
        Frame::Cancel(c) => crate::control::cancel(ctx, &c, now),
        other => {
            bump(&ctx.counters.protocol_errors);
            let message = format!("unexpected {:?} frame from a decode peer", other.frame_type());
            return Action::Close { code: ErrorCode::Malformed, message, seq: 0 };
        }
    };
    Action::Reply(reply)
}

/// Answers a frame that broke the protocol with its error code and closes; a peer that is
/// gone or silent is not answered.
pub(crate) async fn protocol_error(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    e: FrameError,
) -> Result<(), FrameError> {
    // A peer that is gone or silent: nobody to tell.
    let Some(code) = e.answer_code() else { return Err(e) };
    bump(&ctx.counters.protocol_errors);
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        warn!(error = %Peer(&e), suppressed, "closing connection after a protocol error");
    }
    refuse(stream, ctx, code, e.to_string(), 0).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::FrameReader;
    use crate::handshake::tests::{ctx, hello};
    use tokio::net::TcpListener;

    /// Serves `connections` connections to the returned address, one after another.
    async fn serve_in_turn(
        ctx: Arc<ServeContext>,
        connections: usize,
    ) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let serving = tokio::spawn(async move {
            for _ in 0..connections {
                let (s, _) = listener.accept().await.expect("accept");
                serve_connection(s, ctx.clone(), admit_any()).await;
            }
        });
        (addr, serving)
    }

    /// Frames sent in one write are all answered, in order, and the answers to those before
    /// a bad frame reach the peer before its error and the close — whether the answers left
    /// batched or one by one. A notify behind a refused read of its lease is answered
    /// unrecognized (the read and its notify came in one read of the socket).
    #[tokio::test]
    async fn pipelined_frames_are_answered_in_order_before_a_bad_frame_closes() {
        let mut ctx = ctx(None);
        ctx.limits.arm_wait = std::time::Duration::ZERO;
        let ctx = Arc::new(ctx);
        let (addr, serving) = serve_in_turn(ctx.clone(), 1).await;
        let (mut client, mut reader) = connected(addr).await;

        let token = vec![3u8; 16];
        let mut out = Vec::new();
        let hb = Frame::Heartbeat(v1::Heartbeat { leases: Vec::new() });
        hb.encode(&mut out);
        hb.encode(&mut out);
        Frame::ReadRequest(v1::ReadRequest {
            seq: 4,
            remote_request_id: "x".into(),
            lease_token: token.clone(),
            ranges: vec![v1::BlockRange { start: 0, count: 1 }],
            ..Default::default()
        })
        .encode(&mut out);
        Frame::Notify(v1::Notify {
            remote_request_id: "x".into(),
            lease_token: token,
            consumer_id: "d".into(),
        })
        .encode(&mut out);
        hb.encode(&mut out);
        // A frame type nobody knows: the connection's end.
        out.extend_from_slice(&[0, 0, 0, 1, 200]);
        client.write_all(&out).await.expect("write");

        let mut answers = Vec::new();
        loop {
            match reader.read_frame(&mut client, 1 << 20).await {
                Ok(f) => answers.push(f),
                Err(FrameError::Closed) => break,
                Err(e) => panic!("reading answers: {e}"),
            }
        }
        let kinds: Vec<_> = answers.iter().map(Frame::frame_type).collect();
        use kvxfer_proto::v1::FrameType as T;
        assert_eq!(
            kinds,
            [T::HeartbeatAck, T::HeartbeatAck, T::Error, T::NotifyAck, T::HeartbeatAck, T::Error],
            "{answers:?}"
        );
        assert!(
            matches!(&answers[2], Frame::Error(e) if e.seq == 4 && e.code == ErrorCode::UnknownLease as i32)
        );
        let unrecognized = v1::LeaseOutcome::Unrecognized as i32;
        assert!(matches!(&answers[3], Frame::NotifyAck(a) if a.outcome == unrecognized));
        assert!(matches!(&answers[5], Frame::Error(e) if e.code == ErrorCode::UnknownFrameType as i32));
        serving.await.expect("served");
        assert_eq!(ctx.counters.protocol_errors.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// Hostile-peer review: nothing bounded how many leases one frame named, so a 1 MiB
    /// heartbeat decoded to ~26 MiB held for `arm_wait`, every lease then looked up. A frame
    /// over `Limits::max_leases_per_frame` is refused before the table sees any of it; one at
    /// the limit is answered.
    #[tokio::test]
    async fn a_frame_naming_too_many_leases_is_refused_without_touching_the_table() {
        let mut ctx = ctx(None);
        ctx.limits.arm_wait = std::time::Duration::ZERO;
        ctx.limits.max_leases_per_frame = 4;
        let ctx = Arc::new(ctx);
        let (addr, serving) = serve_in_turn(ctx.clone(), 2).await;
        let heartbeat = |n: usize| {
            let leases = (0..n)
                .map(|i| v1::LeaseRef { remote_request_id: format!("unknown-{i}"), lease_token: vec![5; 16] })
                .collect();
            let mut out = Vec::new();
            Frame::Heartbeat(v1::Heartbeat { leases }).encode(&mut out);
            out
        };
        for (n, refused) in [(4, false), (5, true)] {
            let (mut client, mut reader) = connected(addr).await;
            client.write_all(&heartbeat(n)).await.expect("write");
            let answer = reader.read_frame(&mut client, 1 << 20).await.expect("answer");
            if refused {
                let Frame::Error(e) = &answer else { panic!("not refused: {answer:?}") };
                assert_eq!(e.code, ErrorCode::LimitExceeded as i32, "{e:?}");
                assert!(e.message.contains("5 leases") && e.message.contains("at most 4"), "{e:?}");
                assert!(matches!(reader.read_frame(&mut client, 1 << 20).await, Err(FrameError::Closed)));
            } else {
                assert!(matches!(&answer, Frame::HeartbeatAck(a) if a.outcomes.len() == 4), "{answer:?}");
            }
        }
        serving.await.expect("served");
        // Only the four leases of the frame at the limit were looked up.
        assert_eq!(ctx.table.stats().unrecognized, 4);
        assert_eq!(ctx.counters.protocol_errors.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// Serves every connection to the returned address at once, until the test ends.
    async fn serve_all(ctx: Arc<ServeContext>) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(serve_connection(s, ctx.clone(), admit_any()));
            }
        });
        addr
    }

    /// A connection past its handshake, with the reader of its answers.
    async fn connected(addr: std::net::SocketAddr) -> (TcpStream, FrameReader) {
        let mut client = TcpStream::connect(addr).await.expect("connect");
        let mut reader = FrameReader::new();
        let limits = crate::Limits::default();
        crate::handshake::initiate_buffered(&mut client, &mut reader, "prefill", &hello(), None, &limits)
            .await
            .expect("handshake");
        (client, reader)
    }

    /// Waits (bounded) until `counter` reaches `n`.
    async fn until_counted(counter: &std::sync::atomic::AtomicU64, n: u64) {
        for _ in 0..3000 {
            if counter.load(std::sync::atomic::Ordering::Relaxed) >= n {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the counter never reached {n}");
    }

    /// Hostile-peer review: a notify of an unknown lease with a 1 MiB id was buffered,
    /// decoded and held for `arm_wait` on every connection (1,024 of them: +1.5 GiB). A
    /// notify over `Limits::max_small_frame_len` is refused at its header — here before its
    /// body was even sent — and the connection closed.
    #[tokio::test]
    async fn a_large_notify_is_refused_at_its_header() {
        let ctx = Arc::new(ctx(None));
        let addr = serve_all(ctx.clone()).await;
        let (mut client, mut reader) = connected(addr).await;
        let mut header = (1u32 << 20).to_be_bytes().to_vec();
        header.push(v1::FrameType::Notify as u8);
        client.write_all(&header).await.expect("write");
        let answer = reader.read_frame(&mut client, 1 << 20).await.expect("an answer before the body");
        let Frame::Error(e) = &answer else { panic!("not refused: {answer:?}") };
        assert_eq!(e.code, ErrorCode::FrameTooLarge as i32, "{e:?}");
        assert!(matches!(reader.read_frame(&mut client, 1 << 20).await, Err(FrameError::Closed)));
        assert_eq!(ctx.counters.protocol_errors.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// Hostile-peer review: frames naming unknown leases were each held for `arm_wait`,
    /// however many and however large. What large frames hold beyond a small frame's worth
    /// is now drawn from `Limits::max_arm_wait_bytes`, all connections together: a large
    /// frame that does not fit in what is left is answered at once, as unknown, while the
    /// one that fit still waits — and a small frame still waits for its arm, so filling the
    /// budget does not fail other peers' two-phase leases.
    #[tokio::test]
    async fn frames_waiting_for_an_arm_hold_at_most_their_budget() {
        let mut ctx = ctx(None);
        ctx.limits.arm_wait = std::time::Duration::from_secs(3600);
        ctx.limits.max_small_frame_len = 256;
        ctx.limits.max_arm_wait_bytes = 1000;
        ctx.budgets = ServeBudgets::new(&ctx.limits);
        let ctx = Arc::new(ctx);
        let addr = serve_all(ctx.clone()).await;
        let encode = |f: Frame| {
            let mut out = Vec::new();
            f.encode(&mut out);
            out
        };
        // ~700 bytes on the wire (+ 4 x 64 decoded): ~700 over the small frame's 256.
        let heartbeat = |tag: char| {
            let leases = (0..4)
                .map(|i| v1::LeaseRef {
                    remote_request_id: format!("{tag}{i}").repeat(75),
                    lease_token: vec![1; 16],
                })
                .collect();
            encode(Frame::Heartbeat(v1::Heartbeat { leases }))
        };
        let (mut waiting, _waiting_reader) = connected(addr).await;
        waiting.write_all(&heartbeat('a')).await.expect("write");
        until_counted(&ctx.counters.arm_waits, 1).await;

        let (mut late, mut late_reader) = connected(addr).await;
        late.write_all(&heartbeat('b')).await.expect("write");
        // (Without the budget it would wait the hour: the bound only turns a hang into a failure.)
        let answer = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            late_reader.read_frame(&mut late, 1 << 20),
        )
        .await
        .expect("answered without waiting for an arm")
        .expect("an answer");
        let unknown = v1::LeaseOutcome::Unrecognized as i32;
        assert!(matches!(&answer, Frame::HeartbeatAck(a) if a.outcomes == [unknown; 4]), "{answer:?}");
        let c = ctx.counters.snapshot();
        assert_eq!((c.arm_waits, c.arm_wait_refused, c.arm_wait_expired), (1, 1, 0), "{c:?}");

        // A small notify is not charged: it waits for its arm although the budget is short.
        let (mut small, _small_reader) = connected(addr).await;
        let notify = v1::Notify {
            remote_request_id: "n".repeat(50),
            lease_token: vec![1; 16],
            consumer_id: "d".into(),
        };
        small.write_all(&encode(Frame::Notify(notify))).await.expect("write");
        until_counted(&ctx.counters.arm_waits, 2).await;
        assert_eq!(ctx.counters.snapshot().arm_wait_refused, 1);
    }

    /// A decode side's heartbeat of more leases than one frame may name goes out in frames of
    /// at most `HEARTBEAT_LEASES_PER_FRAME`, each accepted; every lease gets its outcome.
    #[tokio::test]
    async fn a_heartbeat_of_many_leases_is_sent_in_frames_under_the_limit() {
        let mut ctx = ctx(None);
        ctx.limits.arm_wait = std::time::Duration::ZERO;
        let n = ctx.limits.max_leases_per_frame + 1;
        let ctx = Arc::new(ctx);
        let (addr, serving) = serve_in_turn(ctx.clone(), 1).await;
        let mut c = crate::Connection::connect(&addr.to_string(), &hello(), crate::Limits::default())
            .await
            .expect("connect");
        let leases = (0..n)
            .map(|i| v1::LeaseRef { remote_request_id: format!("unknown-{i}"), lease_token: vec![5; 16] })
            .collect();
        let outcomes = c.heartbeat(leases).await.expect("heartbeat");
        assert_eq!(outcomes.len(), n);
        assert!(outcomes.iter().all(|&o| o == v1::LeaseOutcome::Unrecognized));
        drop(c);
        serving.await.expect("served");
        assert_eq!(ctx.table.stats().unrecognized, n as u64);
        assert_eq!(ctx.counters.protocol_errors.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}
