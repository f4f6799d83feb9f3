//! kvxfer's TCP data path.
//!
//! - [`frame`]: the length-prefixed frame codec of `proto/kvxfer/v1/kvxfer.proto`.
//! - [`handshake`]: the first exchange of every connection, with the optional mutual
//!   HMAC-SHA256 challenge-response over a [`ClusterKey`].
//! - [`server`]: one accepted connection of a prefill agent: handshake, then reads served
//!   straight from registered memory with vectored writes, and notify / heartbeat / cancel
//!   applied to the lease table.
//! - [`client`]: one connection of a decode agent: handshake, reads straight into the
//!   destination blocks, and the small request/response messages.

pub mod client;
pub mod frame;
pub mod handshake;
pub mod server;

pub use client::{check_crc, ClientError, Connection};
pub use frame::{Frame, FrameError};
pub use handshake::{check_hello, AuthError, ClusterKey, HandshakeId, KeyError};
pub use server::{refuse_connection, serve_connection, ServeContext, ServerCounters, ServerStats};

use std::time::Duration;

/// Limits and timeouts of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest frame accepted (type byte + body), checked before anything is allocated.
    pub max_frame_len: u32,
    /// A read or write that makes no progress for this long fails the connection.
    pub io_timeout: Duration,
    /// Connections a prefill agent serves at once; more are refused with an error frame.
    pub max_connections: usize,
    /// One-sided reads (pins) one connection may have in flight at once; more are refused
    /// with LIMIT_EXCEEDED. (TCP reads on a connection are served one at a time: requests
    /// sent ahead wait in the socket buffer, not in the agent's memory.)
    pub max_inflight_reads: usize,
    /// Longest a pin may stay open. A peer that neither unpins nor closes (stuck, or
    /// half-open behind a middlebox) loses its pins after this; its late one-sided read then
    /// fails the payload check instead of reading blocks the owner reused unnoticed.
    pub pin_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_len: 1 << 20,
            io_timeout: Duration::from_secs(10),
            max_connections: 1024,
            max_inflight_reads: 256,
            pin_timeout: Duration::from_secs(60),
        }
    }
}

/// Sets what every kvxfer TCP connection uses: no Nagle delay, and TCP keepalive probes
/// after `idle` without traffic (then every second, three times) so a peer that vanished
/// without a FIN is noticed by the kernel even on an idle pooled connection.
pub fn tune_stream(stream: &tokio::net::TcpStream, idle: Duration) {
    let _ = stream.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(idle.max(Duration::from_secs(1)))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "could not enable TCP keepalive");
    }
}
