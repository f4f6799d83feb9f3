//! The lease-control answers of a prefill-side connection: `Notify`, `Heartbeat` and
//! `Cancel` applied to the lease table and answered with the wire outcome. A wrong token is
//! answered like an unknown id; a lease that already ended is answered from its record.

use std::time::Instant;

use kvxfer_core::{CancelOutcome, EndKind, HeartbeatOutcome, NotifyOutcome};
use kvxfer_proto::v1::{self, LeaseOutcome};
use tracing::{debug, info, warn};

use crate::context::ServeContext;
use crate::frame::Frame;

/// The wire outcome of a lease that had already ended.
fn already(kind: EndKind) -> LeaseOutcome {
    match kind {
        EndKind::Pulled => LeaseOutcome::AlreadyPulled,
        EndKind::Released => LeaseOutcome::AlreadyReleased,
        EndKind::Expired => LeaseOutcome::AlreadyExpired,
    }
}

/// Applies a `Notify` and answers it with a `NotifyAck`.
pub(crate) fn notify(ctx: &ServeContext, n: &v1::Notify, now: Instant) -> Frame {
    let out = ctx.table.notify(&n.remote_request_id, &n.lease_token, &n.consumer_id, now);
    // A wrong token is answered like an unknown id (see `read::refusal_answer`).
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

/// Extends every lease a `Heartbeat` names and answers with a `HeartbeatAck`.
pub(crate) fn heartbeat(ctx: &ServeContext, hb: &v1::Heartbeat, now: Instant) -> Frame {
    let outcomes = hb
        .leases
        .iter()
        .map(|l| {
            let out = ctx.table.heartbeat(&l.remote_request_id, &l.lease_token, now);
            let o = match out {
                HeartbeatOutcome::Extended { .. } => LeaseOutcome::Extended,
                HeartbeatOutcome::Unrecognized | HeartbeatOutcome::BadToken => LeaseOutcome::Unrecognized,
                HeartbeatOutcome::AlreadyEnded(kind) => already(kind),
            };
            debug!(remote_request_id = %l.remote_request_id, ?out, "heartbeat");
            o as i32
        })
        .collect();
    Frame::HeartbeatAck(v1::HeartbeatAck { outcomes })
}

/// Applies a `Cancel` (the lease is released) and answers it with a `CancelAck`.
pub(crate) fn cancel(ctx: &ServeContext, c: &v1::Cancel, now: Instant) -> Frame {
    let out = ctx.table.cancel(&c.remote_request_id, &c.lease_token, now);
    let o = match out {
        CancelOutcome::Released => LeaseOutcome::Released,
        CancelOutcome::Unrecognized | CancelOutcome::BadToken => LeaseOutcome::Unrecognized,
        CancelOutcome::AlreadyEnded(kind) => already(kind),
    };
    info!(remote_request_id = %c.remote_request_id, ?out, "cancel");
    Frame::CancelAck(v1::CancelAck { outcome: o as i32 })
}
