//! kvxfer's wire protocol and TCP data path.
//!
//! The wire protocol (every transport's control messages travel over it):
//! - [`frame`]: the length-prefixed frame codec of `proto/kvxfer/v1/kvxfer.proto`, and
//!   the buffered [`frame::FrameReader`] both sides read frames through.
//! - [`handshake`]: the first exchange of every connection, with the optional mutual
//!   HMAC-SHA256 authentication over a [`ClusterKey`] (the connecting side proves first;
//!   the accepting side MACs the whole transcript, its `HelloAck` included). The key itself
//!   (loading it, keeping it secret) is `key`, below the handshake.
//!
//! The prefill side of a connection:
//! - [`server`]: one accepted connection of a prefill agent: handshake, then a loop that
//!   reads a frame and `dispatch`es it to one of the modules below.
//! - `read`: TCP reads served straight from registered memory with vectored writes.
//! - `pins`: ranges pinned for one-sided reads (UCX, RDMA), how long each is held, and the
//!   sweep that drops expired ones.
//! - `control`: notify / heartbeat / cancel applied to the lease table.
//! - `arm`: a frame naming a lease not armed yet (a two-phase lease) waits for it, bounded by
//!   `Limits::arm_wait`.
//! - `context`: what all of the above share, below them all: [`ServeContext`] and the write of
//!   a reply bounded by `Limits::io_timeout`.
//! - [`stats`]: the counters every connection bumps, and the rate limit of the warnings
//!   peers can trigger.
//!
//! The decode side:
//! - [`client`]: one connection of a decode agent: handshake, reads straight into the
//!   destination blocks, and the small request/response messages.
//! - `error`: [`ClientError`], how a decode-side connection (or its handshake) fails.
//!
//! `unsafe` here: the blocks reading or writing registered memory under a lease (the
//! payload of a TCP read in `read`, the pin-time CRC in `pins`, the block CRCs computed at
//! lease time in `crcs`, the destination writes of [`Connection::read_into`] and
//! [`Connection::read_batch_into`] and of [`Connection::read_scatter`]), each with its
//! `// SAFETY:` comment.

mod arm;
pub mod client;
mod context;
mod control;
mod crcs;
mod error;
pub mod frame;
pub mod handshake;
mod key;
mod pins;
mod read;
pub mod server;
pub mod stats;

pub use client::PinGrant;
pub use client::{check_crc, BatchEnd, BatchRead, ClientError, Connection, SliceSpec};
pub use crcs::compute_block_crcs;
pub use frame::{Frame, FrameError};
pub use handshake::{check_hello, AuthError, ClusterKey, HandshakeId, KeyError, Transcript};
pub use server::{
    admit_any, handshake_connection, refuse_connection, serve_admitted, serve_connection, Admit, Admitted,
    Refusal, ServeBudgets, ServeContext,
};
pub use stats::{ServerCounters, ServerStats};

use std::time::Duration;

/// Limits and timeouts of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest frame accepted (type byte + body), checked before anything is allocated.
    pub max_frame_len: u32,
    /// A read or write that makes no progress for this long fails the connection (on the
    /// prefill side every reply is written within it, or the connection is reset).
    pub io_timeout: Duration,
    /// Connections a prefill agent serves at once, counted from their handshake on; more are
    /// refused in place of the `HelloAck` with an error frame. A connection takes its place
    /// only once its handshake verified (authenticated, when a cluster key is set): until
    /// then it holds one of `max_handshakes`.
    pub max_connections: usize,
    /// Connections one peer may have open at a prefill agent at once (counted from their
    /// handshake on); more are refused with an error frame, so one peer cannot take every slot. A peer is one IPv4 address, or one
    /// IPv6 /64 (a host is routinely given a whole /64; an IPv4-mapped address counts as its
    /// IPv4 address). Decode ranks behind one NAT share a cap: raise it for such deployments.
    pub max_connections_per_peer: usize,
    /// A prefill-side connection with no pin open that receives no frame for this long is
    /// closed. A decode agent does not reuse a pooled connection idle for half its own
    /// `idle_timeout` or more (both sides default to the same value), and retries a read once
    /// on a fresh connection when a pooled one was closed before any answer arrived.
    pub idle_timeout: Duration,
    /// Slowest transfer accepted, in bytes per second. A read's payload must move within
    /// `io_timeout + bytes / min_transfer_rate` overall (not just make some progress every
    /// `io_timeout`), on both sides; and the prefill side holds a pin for
    /// `pin_timeout + bytes / min_transfer_rate`, so a large one-sided read gets the time it
    /// needs. On the prefill side neither goes past the lease's maximum lifetime plus
    /// `io_timeout`.
    pub min_transfer_rate: u64,
    /// One-sided reads (pins) one connection may have in flight at once; more are refused
    /// with LIMIT_EXCEEDED. (TCP reads on a connection are served one at a time: requests
    /// sent ahead wait in the socket buffer, not in the agent's memory.)
    pub max_inflight_reads: usize,
    /// Longest a pin of no bytes may stay open (a pin of `b` bytes: this plus
    /// `b / min_transfer_rate`; the holder is told in `PinAck.held_for_ms`). A peer that
    /// neither unpins nor closes (stuck, or half-open behind a middlebox) loses its pins
    /// after this; its late one-sided read is then refused by its unpin's `held` answer.
    pub pin_timeout: Duration,
    /// Longest a read, pin, notify, heartbeat or cancel naming a lease the table does not
    /// know (yet) waits for it to be armed before it is answered as unknown: with a
    /// two-phase lease (vLLM's scheduler mints id and token, the worker arms the lease at
    /// its next step) a decode peer can be faster than the arm. Default 5 s: longer than a
    /// worker step, shorter than the decode side's `io_timeout` (10 s) that bounds its wait
    /// for the answer. Zero answers at once. The wait is woken by the lease table's lease
    /// hook, not by polling; a lease that already ended is answered at once.
    pub arm_wait: Duration,
    /// Most leases one frame may name (a `Heartbeat`'s `LeaseRef`s; the other frames name
    /// one). A frame naming more is refused right after it is decoded — before it waits for
    /// an arm or looks anything up — with LIMIT_EXCEEDED, and its connection is closed
    /// (counted in `protocol_errors`): a 1 MiB heartbeat decodes to ~26 MiB of ids and tokens,
    /// which would otherwise be held for `arm_wait`. Default 4096; a decode agent's own
    /// heartbeats name at most 1024 leases per frame.
    pub max_leases_per_frame: usize,
    /// Largest first frame (the `Hello`) and handshake frame a prefill agent accepts before
    /// the peer proved anything, checked at the header (FRAME_TOO_LARGE, counted in
    /// `protocol_errors`); never above `handshake::MAX_HANDSHAKE_FRAME_LEN` (16 KiB) nor
    /// `max_frame_len`. Repeated fields decode to many times their wire size, so a 16 KiB
    /// hello could cost ~480 KiB; while the proof is awaited only the hello's bytes and its
    /// nonce are held, not the decoded hello. Default 8 KiB (a hello names its layout and
    /// shape: a few bytes per segment and group).
    pub max_hello_len: u32,
    /// Connections a prefill agent holds before their handshake verified (the hello not yet
    /// read, or the proof awaited: each read, and each write, within `io_timeout`); more are
    /// refused at once with an error frame (counted in `preauth_refused`). Separate from `max_connections`:
    /// connections that never say anything cannot take the places of authenticated ones.
    /// Each holds a read window and a hello (`max_hello_len`) at most. Default 1024.
    pub max_handshakes: usize,
    /// Of `max_handshakes`, those one peer (an IPv4 address or an IPv6 /64, as for
    /// `max_connections_per_peer`) may hold at once. Default 32: 16 silent addresses hold
    /// 512 at most, half the default budget, and 32 addresses fill it; a decode agent opens
    /// at most 8 control and `AgentConfig::connections_per_peer` data connections to one
    /// prefill agent at once; decode agents behind one NAT share the cap (raise it there).
    /// Without a cluster key anyone completes a handshake: these places protect only
    /// `max_connections` of keyed agents.
    pub max_handshakes_per_peer: usize,
    /// Largest `Notify`, `Cancel` or `Unpin` frame — and any frame a decode peer has no
    /// business sending after its handshake — a prefill agent accepts, checked at the header
    /// (FRAME_TOO_LARGE, then close; counted in `protocol_errors`). Only `ReadRequest`, `Pin`
    /// and `Heartbeat` frames may reach `max_frame_len`. Default 16 KiB: a request id and a
    /// token, or a consumer id, are a few hundred bytes.
    pub max_small_frame_len: u32,
    /// Bytes the connections of a prefill agent may hold between them in frames larger
    /// than a read window (8 KiB) while they arrive: a connection whose next frame is
    /// larger waits for its share (within `io_timeout`, else the connection is closed as
    /// stalled), so a thousand peers each trickling a 1 MiB frame hold this, not a
    /// gigabyte. Raised to `max_frame_len` when below it. Default 16 MiB (a decode agent's
    /// frames pass 8 KiB only for reads of over ~1,000 block runs or heartbeats of over ~80
    /// leases).
    pub max_buffered_frame_bytes: usize,
    /// Bytes large frames hold beyond a small frame's worth (`max_small_frame_len`) while
    /// they wait for their leases to be armed (`arm_wait`), all connections together (a
    /// frame holds about its wire size, plus 64 per lease named and 8 per block range); a
    /// large frame that does not fit is answered at once, as for a lease still unknown
    /// (counted in `arm_wait_refused`). Small frames are not charged — a connection has one
    /// frame waiting at most — so a peer filling the budget cannot fail other peers'
    /// two-phase leases. Default 8 MiB.
    pub max_arm_wait_bytes: usize,
}

impl Limits {
    /// The time `bytes` take at `min_transfer_rate` (saturating).
    pub fn transfer_allowance(&self, bytes: u64) -> Duration {
        let secs = bytes as f64 / self.min_transfer_rate.max(1) as f64;
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
    }

    /// How long a read of `bytes` may take overall: `io_timeout` plus its transfer allowance.
    pub fn transfer_deadline(&self, bytes: u64) -> Duration {
        self.io_timeout.saturating_add(self.transfer_allowance(bytes))
    }

    /// How long the prefill side holds a pin of `bytes`: `pin_timeout` plus its transfer
    /// allowance.
    pub fn pin_hold(&self, bytes: u64) -> Duration {
        self.pin_timeout.saturating_add(self.transfer_allowance(bytes))
    }

    /// The per-type caps a prefill agent reads its decode peers' frames with (after the
    /// handshake).
    pub fn serve_caps(&self) -> frame::FrameCaps {
        frame::FrameCaps {
            max: self.max_frame_len,
            small: self.max_small_frame_len,
            max_leases: u32::try_from(self.max_leases_per_frame).unwrap_or(u32::MAX),
        }
    }
}

/// `now + d`, or a year from now when that does not fit in an `Instant`.
pub(crate) fn instant_after(now: std::time::Instant, d: Duration) -> std::time::Instant {
    now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_len: 1 << 20,
            io_timeout: Duration::from_secs(10),
            max_connections: 1024,
            max_connections_per_peer: 256,
            idle_timeout: Duration::from_secs(300),
            min_transfer_rate: 1 << 20,
            max_inflight_reads: 256,
            pin_timeout: Duration::from_secs(60),
            arm_wait: Duration::from_secs(5),
            max_leases_per_frame: 4096,
            max_hello_len: 8 << 10,
            max_handshakes: 1024,
            max_handshakes_per_peer: 32,
            max_small_frame_len: 16 << 10,
            max_buffered_frame_bytes: 16 << 20,
            max_arm_wait_bytes: 8 << 20,
        }
    }
}

/// Sets what every kvxfer TCP connection uses: no Nagle delay, TCP keepalive probes after
/// `idle` without traffic (then every second, three times) so a peer that vanished without a
/// FIN is noticed by the kernel even on an idle pooled connection, and (Linux)
/// `TCP_USER_TIMEOUT` of `idle` + 3 s: data the peer leaves unacknowledged that long — or a
/// receive window it keeps shut that long — fails the connection in the kernel too (the
/// agents also bound every write themselves).
pub fn tune_stream(stream: &tokio::net::TcpStream, idle: Duration) {
    let _ = stream.set_nodelay(true);
    let idle = idle.max(Duration::from_secs(1));
    let keepalive =
        socket2::TcpKeepalive::new().with_time(idle).with_interval(Duration::from_secs(1)).with_retries(3);
    let socket = socket2::SockRef::from(stream);
    if let Err(e) = socket.set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "could not enable TCP keepalive");
    }
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
    if let Err(e) = socket.set_tcp_user_timeout(Some(idle.saturating_add(Duration::from_secs(3)))) {
        tracing::debug!(error = %e, "could not set TCP_USER_TIMEOUT");
    }
}
