//! What a prefill agent's connections count: [`ServerCounters`] (live, shared by every
//! connection), their snapshot [`ServerStats`], and the [`WarnBudget`] that rate-limits the
//! warnings peers can trigger at will.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Counters of a prefill agent's connections.
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Payload bytes written for reads (TCP) or read one-sided under a pin (counted when
    /// the unpin says the read completed).
    pub bytes_served: AtomicU64,
    /// The part of `bytes_served` read one-sided (UCX) under a pin.
    pub bytes_served_one_sided: AtomicU64,
    /// The part of `bytes_served` written for reads over TCP (its own counter, so each
    /// transport's count only ever grows, whatever order a scrape reads them in).
    pub bytes_served_tcp: AtomicU64,
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
    /// Pins refused because `Limits::max_inflight_reads` were open on their connection, or
    /// because this agent offers no one-sided transport (UCX) to pin for.
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
    /// Connections refused before their handshake because `Limits::max_handshakes` were
    /// under way, or `Limits::max_handshakes_per_peer` from their peer.
    pub preauth_refused: AtomicU64,
    /// Connections reset because a read's payload did not move within its overall deadline
    /// (`Limits::transfer_deadline`, capped at the lease's maximum lifetime plus
    /// `Limits::io_timeout`), or because the peer did not take a reply within
    /// `Limits::io_timeout` (it sends but never reads).
    pub slow_transfers: AtomicU64,
    /// Frames that named a lease not armed yet and waited for it (`Limits::arm_wait`).
    pub arm_waits: AtomicU64,
    /// Of those, frames whose lease was still unknown when `Limits::arm_wait` ran out (then
    /// answered as unknown).
    pub arm_wait_expired: AtomicU64,
    /// Frames answered at once although a lease they named was unknown, because the
    /// agent's frames waiting for an arm held `Limits::max_arm_wait_bytes` already.
    pub arm_wait_refused: AtomicU64,
    /// The part of `bytes_served_tcp` whose CRC-32C was combined from values precomputed
    /// when the lease was made (`AgentConfig::precompute_crcs`) instead of read again while
    /// sending.
    pub crc_bytes_precomputed: AtomicU64,
    /// Bytes of leased blocks the CRC-32C precompute checksummed when their leases were
    /// made (`AgentConfig::precompute_crcs`; stopped early for a lease that ended).
    pub crc_bytes_at_lease: AtomicU64,
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
    pub bytes_served_one_sided: u64,
    pub bytes_served_tcp: u64,
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
    pub preauth_refused: u64,
    pub slow_transfers: u64,
    pub arm_waits: u64,
    pub arm_wait_expired: u64,
    pub arm_wait_refused: u64,
    pub crc_bytes_precomputed: u64,
    pub crc_bytes_at_lease: u64,
}

impl ServerCounters {
    /// A snapshot.
    pub fn snapshot(&self) -> ServerStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerStats {
            bytes_served: l(&self.bytes_served),
            bytes_served_one_sided: l(&self.bytes_served_one_sided),
            bytes_served_tcp: l(&self.bytes_served_tcp),
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
            preauth_refused: l(&self.preauth_refused),
            slow_transfers: l(&self.slow_transfers),
            arm_waits: l(&self.arm_waits),
            arm_wait_expired: l(&self.arm_wait_expired),
            arm_wait_refused: l(&self.arm_wait_refused),
            crc_bytes_precomputed: l(&self.crc_bytes_precomputed),
            crc_bytes_at_lease: l(&self.crc_bytes_at_lease),
        }
    }
}

/// Adds one to a counter.
pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
