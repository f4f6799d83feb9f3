//! Waiting for a lease to be armed: with a two-phase lease (the scheduler process mints the
//! request id and token, the worker arms the lease at its next step), a read, pin, notify,
//! heartbeat or cancel can reach the prefill agent before the lease it names exists. Such a
//! frame waits, up to `Limits::arm_wait`, for the lease table to make a lease (woken by the
//! table's lease hook through [`ServeContext::leases_made`], not by polling), and is then
//! answered as usual: an armed lease as its outcome says, one still unknown as unknown.
//!
//! A frame waits while any lease it names is not known with its token
//! ([`kvxfer_core::LeaseTable::knows`]): an id nobody leased and a wrong token wait alike, so
//! timing does not tell a live id from an unknown one to a peer without the token. A lease
//! that already ended is on record with its token and is answered at once.

use kvxfer_proto::v1;
use tracing::debug;

use crate::context::ServeContext;
use crate::frame::Frame;
use crate::stats::bump;

/// The leases (request id, token) a frame names, if it is one that can wait for an arm.
fn named(f: &Frame) -> Vec<(&str, &[u8])> {
    match f {
        Frame::ReadRequest(r) | Frame::Pin(r) => {
            vec![(r.remote_request_id.as_str(), r.lease_token.as_slice())]
        }
        Frame::Notify(n) => vec![(n.remote_request_id.as_str(), n.lease_token.as_slice())],
        Frame::Cancel(c) => vec![(c.remote_request_id.as_str(), c.lease_token.as_slice())],
        Frame::Heartbeat(hb) => hb
            .leases
            .iter()
            .map(|l: &v1::LeaseRef| (l.remote_request_id.as_str(), l.lease_token.as_slice()))
            .collect(),
        _ => Vec::new(),
    }
}

/// About what a decoded frame holds: its wire size, 64 bytes per lease it names and 8 per
/// block range (an empty range is 2 bytes on the wire).
fn held_while_waiting(f: &Frame) -> usize {
    let ranges = match f {
        Frame::ReadRequest(r) | Frame::Pin(r) => r.ranges.len(),
        _ => 0,
    };
    f.wire_len().saturating_add(named(f).len().saturating_mul(64)).saturating_add(ranges.saturating_mul(8))
}

/// Whether some lease `f` names is not (yet) known with its token.
fn unarmed(ctx: &ServeContext, f: &Frame) -> bool {
    named(f).into_iter().any(|(id, token)| !ctx.table.knows(id, token))
}

/// Whether [`wait_for_arm`] may wait for `f` (it returns at once when not).
pub(crate) fn may_wait(ctx: &ServeContext, f: &Frame) -> bool {
    // A pin to an agent without UCX is refused (and its connection closed) without waiting.
    let refused_pin = matches!(f, Frame::Pin(_)) && !crate::pins::offers_one_sided(ctx);
    !ctx.limits.arm_wait.is_zero() && !refused_pin && unarmed(ctx, f)
}

/// Waits until every lease `f` names is known, or `Limits::arm_wait` passed (counted in
/// `arm_waits` and, when the bound ran out, `arm_wait_expired`), for a frame [`may_wait`]
/// said may wait (asked once by the caller: each look hashes every token the frame names).
pub(crate) async fn wait_for_arm(ctx: &ServeContext, f: &Frame) {
    // What the frame holds while it waits beyond a small frame's worth (each connection has
    // one frame waiting at most, so small ones are bounded by the connection count), drawn
    // from the agent's budget: a frame that does not fit is answered now, as for a lease
    // still unknown. Small frames never wait for the budget, so a peer filling it with
    // large ones cannot fail other peers' two-phase leases.
    let cost = held_while_waiting(f).saturating_sub(ctx.limits.max_small_frame_len as usize);
    let _held = if cost == 0 {
        None
    } else {
        let permit = u32::try_from(cost).ok().and_then(|n| ctx.budgets.arm_wait.try_acquire_many(n).ok());
        if permit.is_none() {
            bump(&ctx.counters.arm_wait_refused);
            debug!(frame = ?f.frame_type(), cost, "no room to wait for an arm; answering as unknown");
            return;
        }
        permit
    };
    bump(&ctx.counters.arm_waits);
    // Saturating: an `arm_wait` too large for an `Instant` waits a year.
    let deadline =
        tokio::time::Instant::from_std(crate::instant_after(std::time::Instant::now(), ctx.limits.arm_wait));
    loop {
        let made = ctx.leases_made.notified();
        tokio::pin!(made);
        // Registered before looking again, so a lease armed in between is not missed.
        made.as_mut().enable();
        if !unarmed(ctx, f) {
            return;
        }
        if tokio::time::timeout_at(deadline, made).await.is_err() {
            bump(&ctx.counters.arm_wait_expired);
            debug!(frame = ?f.frame_type(), "no lease armed within {:?}; answering as unknown", ctx.limits.arm_wait);
            return;
        }
    }
}
