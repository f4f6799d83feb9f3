//! What every part of a prefill connection shares: the agent's [`ServeContext`] and the
//! write of a reply bounded by `Limits::io_timeout`. The handlers (`handshake`, `read`,
//! `pins`, `control`, `arm`) and the connection loop (`server`) import this module; it imports
//! none of them.

use std::sync::Arc;

use kvxfer_core::LeaseTable;
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::warn;

use crate::frame::{Frame, FrameError};
use crate::stats::{bump, ServerCounters};
use crate::Limits;

/// Everything a connection of a prefill agent needs.
#[derive(Debug)]
pub struct ServeContext {
    /// The lease table.
    pub table: Arc<LeaseTable>,
    /// The registered KV cache reads are served from.
    pub memory: Arc<KvMemory>,
    /// This rank's KV-cache shape, when the agent was given one: what head-slice reads are
    /// checked against (without one they are refused).
    pub shape: Option<kvxfer_core::KvShape>,
    /// What this agent answers a compatible hello with.
    pub hello_ack: v1::HelloAck,
    /// The cluster key peers must prove they hold; `None`: peers are not authenticated.
    pub cluster_key: Option<crate::key::ClusterKey>,
    /// Limits and timeouts.
    pub limits: Limits,
    /// Counters.
    pub counters: Arc<ServerCounters>,
    /// Notified (`notify_waiters`) whenever the lease table makes a lease: wakes frames
    /// waiting for their lease to be armed (`Limits::arm_wait`). The owner of the table
    /// connects it with [`LeaseTable::set_lease_hook`].
    pub leases_made: Arc<tokio::sync::Notify>,
    /// The agent-wide byte budgets its connections share.
    pub budgets: ServeBudgets,
}

/// Byte budgets every connection of one prefill agent draws from (one semaphore permit per
/// byte).
#[derive(Debug, Clone)]
pub struct ServeBudgets {
    /// Frames larger than a read window while they arrive (`Limits::max_buffered_frame_bytes`).
    pub frames: Arc<tokio::sync::Semaphore>,
    /// Frames waiting for an arm (`Limits::max_arm_wait_bytes`).
    pub arm_wait: Arc<tokio::sync::Semaphore>,
}

impl ServeBudgets {
    /// Budgets sized by `limits` (the frame budget never below `max_frame_len`, so the
    /// largest frame allowed can always be read).
    pub fn new(limits: &Limits) -> Self {
        let cap = |n: usize| n.min(tokio::sync::Semaphore::MAX_PERMITS);
        let frames =
            limits.max_buffered_frame_bytes.max(limits.max_frame_len as usize + crate::frame::HEADER_LEN);
        ServeBudgets {
            frames: Arc::new(tokio::sync::Semaphore::new(cap(frames))),
            arm_wait: Arc::new(tokio::sync::Semaphore::new(cap(limits.max_arm_wait_bytes))),
        }
    }
}

/// Writes one frame to the peer within `Limits::io_timeout`. A peer that sends frames but
/// never reads their answers fills both socket buffers, and an unbounded write would then
/// block its connection task for ever: its pins never swept, their leases' blocks never
/// handed back, its slot never freed. On expiry the connection is reset (what is queued is
/// dropped, not trickled out) and counted in `slow_transfers`.
pub(crate) async fn write_reply(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    reply: &Frame,
    scratch: &mut Vec<u8>,
) -> Result<(), FrameError> {
    scratch.clear();
    reply.encode(scratch);
    write_bytes(stream, ctx, scratch).await
}

/// Writes encoded frames as [`write_reply`] does (within `Limits::io_timeout`, else reset).
pub(crate) async fn write_bytes(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    bytes: &[u8],
) -> Result<(), FrameError> {
    let io = ctx.limits.io_timeout;
    match tokio::time::timeout(io, stream.write_all(bytes)).await {
        Ok(r) => Ok(r?),
        Err(_) => {
            let _ = socket2::SockRef::from(&*stream).set_linger(Some(std::time::Duration::ZERO));
            bump(&ctx.counters.slow_transfers);
            if let Some(suppressed) = ctx.counters.warnings.allow() {
                warn!(suppressed, "closing connection: the peer did not take a reply within {io:?}");
            }
            Err(FrameError::Timeout)
        }
    }
}
