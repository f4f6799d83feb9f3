//! kvxfer's TCP data path.
//!
//! - [`frame`]: the length-prefixed frame codec of `proto/kvxfer/v1/kvxfer.proto`.
//! - [`server`]: one accepted connection of a prefill agent: handshake, then reads served
//!   straight from registered memory with vectored writes, and notify / heartbeat / cancel
//!   applied to the lease table.
//! - [`client`]: one connection of a decode agent: handshake, reads straight into the
//!   destination blocks, and the small request/response messages.

pub mod client;
pub mod frame;
pub mod server;

pub use client::{ClientError, Connection};
pub use frame::{Frame, FrameError};
pub use server::{
    check_hello, refuse_connection, serve_connection, HandshakeId, ServeContext, ServerCounters, ServerStats,
};

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
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_frame_len: 1 << 20, io_timeout: Duration::from_secs(10), max_connections: 1024 }
    }
}
