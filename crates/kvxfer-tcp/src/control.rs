//! The lease-control answers of a prefill-side connection: `Notify`, `Heartbeat` and
//! `Cancel` applied to the lease table and answered with the wire outcome. A wrong token is
//! answered like an unknown id; a lease that already ended is answered from its record.

use std::time::Instant;

use kvxfer_core::log::Peer;
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
                    remote_request_id = %Peer(&n.remote_request_id), consumer = %Peer(&n.consumer_id), suppressed,
                    "notification for unrecognized request; nothing changed"
                )
            }
        }
        NotifyOutcome::BadToken => {
            if let Some(suppressed) = loud() {
                warn!(
                    remote_request_id = %Peer(&n.remote_request_id), consumer = %Peer(&n.consumer_id), suppressed,
                    "notification with a wrong lease token; nothing changed"
                )
            }
        }
        NotifyOutcome::Duplicate => {
            if let Some(suppressed) = loud() {
                info!(
                    remote_request_id = %Peer(&n.remote_request_id), consumer = %Peer(&n.consumer_id), suppressed,
                    "duplicate notification; nothing changed"
                )
            }
        }
        NotifyOutcome::AlreadyEnded { kind, counted } => {
            if let Some(suppressed) = loud() {
                info!(
                    remote_request_id = %Peer(&n.remote_request_id), consumer = %Peer(&n.consumer_id), ?kind,
                    counted, suppressed,
                    "notification of a lease that already ended (a retry?); answered from its record"
                )
            }
        }
        _ => {
            debug!(remote_request_id = %Peer(&n.remote_request_id), consumer = %Peer(&n.consumer_id), ?out, "notified")
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
            debug!(remote_request_id = %Peer(&l.remote_request_id), ?out, "heartbeat");
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
    // Any peer can send cancels (of unknown ids too): the line shares the warning budget.
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        info!(remote_request_id = %Peer(&c.remote_request_id), ?out, suppressed, "cancel");
    }
    Frame::CancelAck(v1::CancelAck { outcome: o as i32 })
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use kvxfer_core::log::MAX_PEER_CHARS;
    use kvxfer_core::LeaseRequest;
    use kvxfer_proto::v1;

    use crate::handshake::tests::ctx;
    use crate::stats::WARNINGS_PER_SECOND;

    /// A log sink: every line the subscriber writes, in one buffer.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("sink").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The log lines `f` writes at any level.
    fn logged(f: impl FnOnce()) -> Vec<String> {
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let bytes = sink.0.lock().expect("sink").clone();
        String::from_utf8(bytes).expect("utf-8").lines().map(str::to_owned).collect()
    }

    /// Hostile-peer review: a notify's request id went into the log as it came, so a 1 MiB id
    /// made a 1 MiB line and a newline in it forged a second line.
    #[test]
    fn a_huge_request_id_with_newlines_makes_one_bounded_log_line() {
        let ctx = ctx(None);
        let id = format!("x\n2026-01-01T00:00:00Z  INFO forged: lease ended\n{}", "y".repeat(1 << 20));
        let n = v1::Notify {
            remote_request_id: id.clone(),
            lease_token: vec![7; 16],
            consumer_id: "c\nd".into(),
        };
        let lines = logged(|| {
            super::notify(&ctx, &n, Instant::now());
        });
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line = &lines[0];
        assert!(line.len() < 2 * MAX_PEER_CHARS + 300, "{} bytes", line.len());
        assert!(line.contains("x\\n2026-01-01T00:00:00Z  INFO forged"), "{line}");
        assert!(line.contains(&format!("…({} bytes)", id.len())), "{line}");
        assert!(line.contains("c\\nd"), "{line}");
    }

    /// Hostile-peer review: duplicate notifies and cancels were each logged at info without
    /// a budget, so a peer repeating them flooded the log.
    #[test]
    fn repeated_notifies_and_cancels_share_the_warning_budget() {
        let ctx = ctx(None);
        let now = Instant::now();
        let lease = ctx.table.lease(LeaseRequest::new("R", 0, 1, vec![1]).consumers(2), now).expect("lease");
        let n = v1::Notify {
            remote_request_id: lease.remote_request_id().into(),
            lease_token: lease.token().as_bytes().to_vec(),
            consumer_id: "d/0".into(),
        };
        let c = v1::Cancel { remote_request_id: "unknown".into(), lease_token: vec![7; 16] };
        let lines = logged(|| {
            for _ in 0..200 {
                super::notify(&ctx, &n, now);
                super::cancel(&ctx, &c, now);
            }
        });
        // One second may roll over during the loop: two seconds' worth at most.
        let bound = 2 * WARNINGS_PER_SECOND as usize + 1;
        assert!(lines.len() <= bound, "{} lines: {:?}", lines.len(), &lines[..5]);
    }
}
