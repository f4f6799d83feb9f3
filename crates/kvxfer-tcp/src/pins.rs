//! Pinned ranges of one prefill-side connection: the read guards that one-sided reads (UCX,
//! RDMA) hold between a `Pin` and its `Unpin`, how long each is held, and the sweep that
//! drops the ones whose holder neither unpinned nor closed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::log::Peer;
use kvxfer_core::plan::BlockRange;
use kvxfer_core::ReadGuard;
use kvxfer_proto::v1::{self, ErrorCode};
use tracing::{debug, warn};

use crate::context::ServeContext;
use crate::frame::Frame;
use crate::read::{begin, guard_deadline, ranges_of};
use crate::stats::{bump, ServerCounters};

/// A pinned range: its read guard, its payload bytes, how long it is held and until when,
/// and the open-pin gauge it holds.
struct Pinned {
    guard: ReadGuard,
    bytes: u64,
    hold: Duration,
    deadline: Instant,
    counters: Arc<ServerCounters>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.counters.pins_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The pins of one connection, by pin sequence number; dropped (and their read guards with
/// them) with the connection.
#[derive(Default)]
pub(crate) struct Pins {
    by_seq: HashMap<u64, Pinned>,
}

impl Pins {
    /// No pin is open.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_seq.is_empty()
    }

    /// The earliest deadline of the open pins.
    pub(crate) fn earliest_deadline(&self) -> Option<Instant> {
        self.by_seq.values().map(|p| p.deadline).min()
    }

    /// Drops the pins whose deadline passed (loudly: the peer neither unpinned nor closed).
    pub(crate) fn expire(&mut self, ctx: &ServeContext, now: Instant) {
        self.by_seq.retain(|seq, p| {
            let keep = p.deadline > now;
            if !keep {
                bump(&ctx.counters.pins_expired);
                if let Some(suppressed) = ctx.counters.warnings.allow() {
                    warn!(
                        remote_request_id = %Peer(&p.guard.request_id()), seq, suppressed,
                        "pin dropped after {:?} without an unpin", p.hold
                    );
                }
            }
            keep
        });
    }

    /// Answers a `Pin`: the read guard is taken and held (for `Limits::pin_hold` of its
    /// bytes, at most until the lease's maximum lifetime plus the io timeout) and a `PinAck`
    /// answered, or the request is refused — past
    /// `Limits::max_inflight_reads`, for a sequence number in use, or as a read would be.
    pub(crate) fn pin(&mut self, ctx: &ServeContext, req: &v1::ReadRequest, now: Instant) -> Frame {
        if self.by_seq.len() >= ctx.limits.max_inflight_reads || self.by_seq.contains_key(&req.seq) {
            bump(&ctx.counters.pins_refused);
            let msg = format!(
                "pin {} refused: {} pins open on this connection (at most {}) or the sequence number is in use",
                req.seq,
                self.by_seq.len(),
                ctx.limits.max_inflight_reads
            );
            return Frame::error(ErrorCode::LimitExceeded, msg, req.seq);
        }
        match begin(ctx, req) {
            Ok((guard, bytes, slices)) => {
                let payload_crc32c = match crate::read::group_memory(ctx, req) {
                    Ok(mem) if req.pin_crc32c => payload_crc(mem, &guard, &ranges_of(req), &slices),
                    Ok(_) => 0,
                    Err(e) => return Frame::Error(e),
                };
                bump(&ctx.counters.pins);
                bump(&ctx.counters.pins_open);
                // Held longer for larger pins, so a big one-sided read has time to finish,
                // but never past the lease's maximum lifetime (plus the io timeout); the
                // holder is told how long.
                let deadline = guard_deadline(ctx, &guard, now, ctx.limits.pin_hold(bytes));
                let hold = deadline.saturating_duration_since(now);
                debug!(remote_request_id = %Peer(&req.remote_request_id), seq = req.seq, bytes, ?hold, "pinned");
                self.by_seq
                    .insert(req.seq, Pinned { guard, bytes, hold, deadline, counters: ctx.counters.clone() });
                let held_for_ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
                Frame::PinAck(v1::PinAck { seq: req.seq, payload_crc32c, held_for_ms })
            }
            Err(e) => Frame::Error(e),
        }
    }

    /// Answers an `Unpin`: releases the pin (a completed read is counted as served) and
    /// says whether it was still held.
    pub(crate) fn unpin(&mut self, ctx: &ServeContext, u: &v1::Unpin) -> Frame {
        let pin = self.by_seq.remove(&u.seq);
        let held = pin.is_some();
        if let Some(pin) = pin {
            if u.completed {
                ctx.counters.bytes_served.fetch_add(pin.bytes, Ordering::Relaxed);
                ctx.counters.bytes_served_one_sided.fetch_add(pin.bytes, Ordering::Relaxed);
                bump(&ctx.counters.reads_served);
            }
            debug!(remote_request_id = %Peer(&pin.guard.request_id()), seq = u.seq, completed = u.completed, "unpinned");
        }
        Frame::UnpinAck(v1::UnpinAck { seq: u.seq, held })
    }
}

/// CRC-32C of the blocks of `ranges`, which `guard` keeps leased.
fn payload_crc(
    mem: &kvxfer_mem::KvMemory,
    guard: &ReadGuard,
    ranges: &[BlockRange],
    slices: &crate::read::BlockSlices,
) -> u32 {
    let _ = guard;
    crate::read::payload_chunks(mem, ranges, slices).fold(0, |crc, c| {
        // SAFETY: `guard` pins the lease and `begin_group_read` checked every block of
        // `ranges` against it and against `mem`'s group (a head slice lies inside each
        // block); the owner does not write leased blocks (kvxfer-mem's access contract).
        kvxfer_mem::crc32c_append(crc, unsafe { mem.chunk(c) })
    })
}
