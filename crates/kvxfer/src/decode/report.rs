//! What a pull tells its caller: per-child reports (a [`Stream`]), the whole pull's
//! [`PullReport`] (a [`Future`]), reclaimed blocks, and the decode agent's counters.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use kvxfer_core::log;
use kvxfer_core::pull::{ChildOutcome, PullError};
use kvxfer_core::BlockId;
use tokio::sync::{mpsc, oneshot};

/// Local blocks of children reported [`ChildOutcome::FailedBlocksHeld`] that are safe to
/// reuse again: the read that held them completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reclaimed {
    /// The parent request of the pull.
    pub parent_request_id: String,
    /// The children (indices) whose held blocks these are.
    pub children: Vec<u32>,
    /// The blocks, now free for the caller to reuse or free.
    pub local_blocks: Vec<BlockId>,
}

/// The data path a child's bytes took: what an operator checks when a pull is slower than
/// the hardware ("which transport did it use?").
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DataPath {
    /// kvxfer's TCP data path (a CRC-32C per read).
    Tcp,
    /// UCX one-sided reads over the transports its endpoint to the peer uses, as UCX names
    /// them (`"<transport>/<device>"`: `"posix/memory"`, `"cma/memory"`, `"tcp/lo"`,
    /// `"rc_mlx5/mlx5_0:1"`, `"cuda_ipc/cuda"`); empty where the loaded UCX (< 1.14) cannot
    /// say.
    Ucx {
        /// The endpoint's transports, one per lane, without repeats.
        transports: Vec<String>,
    },
}

impl std::fmt::Display for DataPath {
    /// `tcp`, `ucx` or `ucx(posix/memory,cma/memory)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataPath::Tcp => f.write_str("tcp"),
            DataPath::Ucx { transports } if transports.is_empty() => f.write_str("ucx"),
            DataPath::Ucx { transports } => write!(f, "ucx({})", transports.join(",")),
        }
    }
}

/// One child's report.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChildReport {
    /// The child index.
    pub child_index: u32,
    /// The prefill side's id for the child.
    pub remote_request_id: String,
    /// How it ended.
    pub outcome: ChildOutcome,
    /// When the pull task decided `outcome` (the child's last byte checked and its notify
    /// answered, or its failure known), stamped where it happened: for hand-off latency
    /// figures that do not depend on when the caller got round to polling the report.
    pub completed_at: Instant,
    /// The data path its bytes took (or would have: a child failed after the path was
    /// chosen keeps it); `None` when no path was chosen (the peer was not reached). For a
    /// pull from several source ranks, the path of the first source.
    pub path: Option<DataPath>,
}

/// All children's reports of one pull.
#[derive(Debug, Clone)]
pub struct PullReport {
    /// The parent request id.
    pub parent_request_id: String,
    /// One report per child, child 0 first.
    pub children: Vec<ChildReport>,
    /// Bytes that crossed the wire.
    pub wire_bytes: u64,
    /// Bytes delivered into local blocks (wire + local copies for siblings).
    pub delivered_bytes: u64,
    /// From submit to the last report.
    pub elapsed: Duration,
}

impl PullReport {
    /// Whether every child is done (a report always holds one entry per child: a child whose
    /// pull could not report, because its runtime shut down under it, is reported failed).
    pub fn all_done(&self) -> bool {
        self.children.iter().all(|c| matches!(c.outcome, ChildOutcome::Done { .. }))
    }
}

/// Counters of a decode agent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Pulls submitted.
    pub pulls: u64,
    /// Children done.
    pub children_done: u64,
    /// Children failed.
    pub children_failed: u64,
    /// Children cancelled.
    pub children_cancelled: u64,
    /// Bytes on the wire.
    pub bytes_pulled: u64,
    /// Bytes delivered into local blocks (wire + local copies).
    pub bytes_delivered: u64,
    /// Notifications the prefill side did not count (unrecognized / bad token).
    pub notifications_unacknowledged: u64,
    /// Connections opened.
    pub connections_opened: u64,
    /// Prefill peers this agent keeps connections (or a pool) for; peers that closed every
    /// connection and no pull uses are forgotten when a new peer is added.
    pub peers: u64,
    /// Handshakes that failed authentication (no key on one side, another key, a replayed
    /// challenge), whichever side refused.
    pub auth_failures: u64,
    /// Control exchanges (notify, cancel, heartbeat) retried on a fresh connection after one
    /// failed midway.
    pub control_retries: u64,
    /// Children reported [`ChildOutcome::FailedBlocksHeld`].
    pub children_blocks_held: u64,
    /// The part of `bytes_pulled` read one-sided over UCX (the rest went over TCP).
    pub bytes_pulled_ucx: u64,
    /// Reads whose payload failed its integrity check (CRC-32C, length, or an answer to
    /// another read); nothing of them was used.
    pub integrity_failures: u64,
    /// The part of `integrity_failures` of one-sided (UCX) reads.
    pub integrity_failures_ucx: u64,
    /// The part of `bytes_pulled` read over TCP (counted on its own: per-transport counts
    /// only ever grow).
    pub bytes_pulled_tcp: u64,
    /// The part of `integrity_failures` of TCP reads.
    pub integrity_failures_tcp: u64,
    /// Peers whose pooled connections were dropped because discovery saw their engine leave
    /// etcd or change (the `cluster` feature).
    pub peers_invalidated: u64,
    /// TCP reads made again on a fresh connection because their pooled connection was closed
    /// by the peer before any answer arrived (its idle close racing the request).
    pub read_retries: u64,
    /// Leases `DecodeAgent::release` released (the prefill side said released, or already
    /// released by an earlier attempt whose answer was lost).
    pub leases_released: u64,
    /// Releases the prefill side did not apply: the lease had already been pulled or had
    /// expired, it did not know the lease (or token), or it could not be reached.
    pub releases_refused: u64,
    /// TCP reads that carried their child's notify behind the read request
    /// (`AgentConfig::notify_with_read`: one round trip for that hand-off).
    pub notifies_with_read: u64,
    /// Pipelined TCP batches: two or more reads of one pull written together on one data
    /// connection and answered in order (ARCHITECTURE.md, "Pipelined reads"); counted once
    /// a connection was checked out for the batch, whether or not its write went through.
    pub read_batches: u64,
    /// The reads those batches carried.
    pub reads_batched: u64,
    /// Reads made again, each alone on a connection of its own, because the connection of
    /// their batch broke after earlier answers (nothing of them had arrived).
    pub reads_after_broken_batch: u64,
    /// UCX endpoints the agent holds open (a gauge): one per peer read over UCX that it has
    /// not forgotten, plus any still wiring up or closing. 0 without UCX.
    pub ucx_endpoints: u64,
}

/// The live counters behind [`DecodeStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) auth_failures: AtomicU64,
    pub(crate) control_retries: AtomicU64,
    pub(crate) children_blocks_held: AtomicU64,
    pub(crate) pulls: AtomicU64,
    pub(crate) children_done: AtomicU64,
    pub(crate) children_failed: AtomicU64,
    pub(crate) children_cancelled: AtomicU64,
    pub(crate) bytes_pulled: AtomicU64,
    pub(crate) bytes_delivered: AtomicU64,
    pub(crate) notifications_unacknowledged: AtomicU64,
    pub(crate) connections_opened: AtomicU64,
    pub(crate) bytes_pulled_ucx: AtomicU64,
    pub(crate) integrity_failures: AtomicU64,
    pub(crate) integrity_failures_ucx: AtomicU64,
    pub(crate) bytes_pulled_tcp: AtomicU64,
    pub(crate) integrity_failures_tcp: AtomicU64,
    pub(crate) peers_invalidated: AtomicU64,
    pub(crate) read_retries: AtomicU64,
    pub(crate) leases_released: AtomicU64,
    pub(crate) releases_refused: AtomicU64,
    pub(crate) notifies_with_read: AtomicU64,
    pub(crate) read_batches: AtomicU64,
    pub(crate) reads_batched: AtomicU64,
    pub(crate) reads_after_broken_batch: AtomicU64,
}

impl Counters {
    /// Counts one child's report (and logs a failure, naming the child's lease).
    pub(crate) fn count_report(&self, remote_request_id: &str, outcome: &ChildOutcome) {
        match outcome {
            ChildOutcome::Done { bytes_delivered, acknowledged } => {
                add(&self.children_done, 1);
                add(&self.bytes_delivered, *bytes_delivered);
                if !acknowledged {
                    add(&self.notifications_unacknowledged, 1);
                }
            }
            ChildOutcome::Failed { error, .. } => {
                add(&self.children_failed, 1);
                tracing::warn!(remote_request_id = %log::Peer(remote_request_id), error = %log::Peer(&error), advice = ?error.advice(), "child pull failed");
            }
            ChildOutcome::Cancelled { .. } => add(&self.children_cancelled, 1),
            ChildOutcome::FailedBlocksHeld { error, .. } => {
                add(&self.children_failed, 1);
                add(&self.children_blocks_held, 1);
                tracing::warn!(remote_request_id = %log::Peer(remote_request_id), error = %log::Peer(&error), "child pull failed; its blocks stay held");
            }
        }
    }

    pub(crate) fn snapshot(&self, peers: u64) -> DecodeStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DecodeStats {
            pulls: l(&self.pulls),
            children_done: l(&self.children_done),
            children_failed: l(&self.children_failed),
            children_cancelled: l(&self.children_cancelled),
            bytes_pulled: l(&self.bytes_pulled),
            bytes_delivered: l(&self.bytes_delivered),
            notifications_unacknowledged: l(&self.notifications_unacknowledged),
            connections_opened: l(&self.connections_opened),
            auth_failures: l(&self.auth_failures),
            control_retries: l(&self.control_retries),
            children_blocks_held: l(&self.children_blocks_held),
            bytes_pulled_ucx: l(&self.bytes_pulled_ucx),
            integrity_failures: l(&self.integrity_failures),
            integrity_failures_ucx: l(&self.integrity_failures_ucx),
            bytes_pulled_tcp: l(&self.bytes_pulled_tcp),
            integrity_failures_tcp: l(&self.integrity_failures_tcp),
            peers_invalidated: l(&self.peers_invalidated),
            read_retries: l(&self.read_retries),
            leases_released: l(&self.leases_released),
            releases_refused: l(&self.releases_refused),
            notifies_with_read: l(&self.notifies_with_read),
            read_batches: l(&self.read_batches),
            reads_batched: l(&self.reads_batched),
            reads_after_broken_batch: l(&self.reads_after_broken_batch),
            ucx_endpoints: 0,
            peers,
        }
    }
}

/// Adds `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Totals a pull sends when it finished: wire bytes, delivered bytes, elapsed.
pub(crate) type Totals = (u64, u64, Duration);

/// Cancels children of a pull; cheap to clone and usable after the [`PullHandle`] is
/// consumed (e.g. while awaiting it).
#[derive(Debug, Clone)]
pub struct PullCanceller {
    cancels: mpsc::UnboundedSender<u32>,
}

impl PullCanceller {
    /// The decode side drops child `index` of a pull under way: its read is stopped (TCP;
    /// a one-sided UCX read runs to its end), and its lease released now (or as soon as reads
    /// that siblings need from it finish). Its local blocks are not written after its report
    /// arrives.
    ///
    /// A cancel races the pull: one that arrives after the child's blocks were all read
    /// (its notify sent, or its report made) is ignored, and the child is reported
    /// [`ChildOutcome::Done`] (its lease pulled) — the caller still owns valid blocks and
    /// frees them itself. So a cancel right after `submit` may well lose to a fast pull. To
    /// drop a child for certain, do not pull it: submit the others
    /// (`DecodeAgent::submit_subset`) and release its lease with `DecodeAgent::release`.
    pub fn cancel_child(&self, index: u32) {
        let _ = self.cancels.send(index);
    }
}

/// A pull under way. Its per-child reports are a [`Stream`] (as children finish, each
/// once); awaiting it (or [`PullHandle::finished`]) gives the whole [`PullReport`].
/// Dropping it does not stop the pull: every child still ends, and every lease with it.
pub struct PullHandle {
    parent: String,
    count: usize,
    /// Each child's index, remote id and local blocks: what a report of a child whose pull
    /// task vanished without reporting (its runtime shut down under it) says.
    expected: Vec<(u32, String, Vec<BlockId>)>,
    reports: mpsc::UnboundedReceiver<ChildReport>,
    canceller: PullCanceller,
    done: oneshot::Receiver<Totals>,
    /// Reports already received, with when they arrived.
    seen: Vec<(ChildReport, Instant)>,
}

impl std::fmt::Debug for PullHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullHandle")
            .field("parent", &self.parent)
            .field("children", &self.count)
            .finish_non_exhaustive()
    }
}

/// The pull task's ends of a [`PullHandle`]'s channels.
pub(crate) struct PullChannels {
    pub(crate) reports: mpsc::UnboundedSender<ChildReport>,
    pub(crate) cancels: mpsc::UnboundedReceiver<u32>,
    pub(crate) done: oneshot::Sender<Totals>,
}

impl PullHandle {
    /// A handle for a pull of the `expected` children (index, remote id, local blocks) of
    /// `parent`, and the pull task's ends.
    pub(crate) fn new(parent: String, expected: Vec<(u32, String, Vec<BlockId>)>) -> (Self, PullChannels) {
        let count = expected.len();
        let (report_tx, reports) = mpsc::unbounded_channel();
        let (cancel_tx, cancels) = mpsc::unbounded_channel();
        let (done_tx, done) = oneshot::channel();
        let handle = PullHandle {
            parent,
            count,
            expected,
            reports,
            canceller: PullCanceller { cancels: cancel_tx },
            done,
            seen: Vec::new(),
        };
        (handle, PullChannels { reports: report_tx, cancels, done: done_tx })
    }

    /// Cancels child `index` (see [`PullCanceller::cancel_child`]).
    pub fn cancel_child(&self, index: u32) {
        self.canceller.cancel_child(index);
    }

    /// A canceller that outlives this handle.
    pub fn canceller(&self) -> PullCanceller {
        self.canceller.clone()
    }

    /// Children this pull covers.
    pub fn children(&self) -> usize {
        self.count
    }

    /// The parent request id.
    pub fn parent_request_id(&self) -> &str {
        &self.parent
    }

    /// Waits for every child's report (those the stream already gave included).
    pub async fn finished(self) -> PullReport {
        self.finished_timed().await.0
    }

    /// Waits for every child's report, and says when each one reached this caller (same
    /// order as `PullReport::children`; the reports a stream gave when it gave them, the rest
    /// when the whole pull ended; `ChildReport::completed_at` says when each child ended in
    /// the agent): for hand-off latency figures.
    pub async fn finished_timed(mut self) -> (PullReport, Vec<Instant>) {
        // The pull task sends every child's report before its totals: waiting for the totals
        // first wakes the caller once per pull, not once per child (a blocking caller's
        // thread is woken each time), and the reports are then all in the channel. Totals
        // that never come (the task vanished with its runtime) end the wait as well.
        let totals = (&mut self.done).await;
        while self.seen.len() < self.count {
            let r = match self.reports.recv().await {
                Some(r) => r,
                None => match self.vanished() {
                    Some(r) => r,
                    None => break,
                },
            };
            self.seen.push((r, Instant::now()));
        }
        let mut children = std::mem::take(&mut self.seen);
        children.sort_by_key(|c| c.0.child_index);
        let (wire_bytes, delivered_bytes, elapsed) = totals.unwrap_or_default();
        let (children, arrived) = children.into_iter().unzip();
        let report =
            PullReport { parent_request_id: self.parent, children, wire_bytes, delivered_bytes, elapsed };
        (report, arrived)
    }
}

impl PullHandle {
    /// The report of a child that has none although the pull task is gone (its runtime shut
    /// down under it, so it could not report): failed, the agent shut down. `None` once every
    /// child has a report.
    fn vanished(&self) -> Option<ChildReport> {
        let (index, id, blocks) =
            self.expected.iter().find(|(i, _, _)| !self.seen.iter().any(|(r, _)| r.child_index == *i))?;
        Some(ChildReport {
            child_index: *index,
            remote_request_id: id.clone(),
            outcome: ChildOutcome::Failed {
                error: PullError::Shutdown,
                invalid_local_blocks: blocks.clone(),
            },
            completed_at: Instant::now(),
            path: None,
        })
    }
}

impl Stream for PullHandle {
    type Item = ChildReport;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ChildReport>> {
        let this = self.get_mut();
        if this.seen.len() >= this.count {
            return Poll::Ready(None);
        }
        match this.reports.poll_recv(cx) {
            Poll::Ready(r) => match r.or_else(|| this.vanished()) {
                Some(r) => {
                    this.seen.push((r.clone(), Instant::now()));
                    Poll::Ready(Some(r))
                }
                None => Poll::Ready(None),
            },
            Poll::Pending => Poll::Pending,
        }
    }
}

impl IntoFuture for PullHandle {
    type Output = PullReport;
    type IntoFuture = Pin<Box<dyn Future<Output = PullReport> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.finished())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn done_report(index: u32) -> ChildReport {
        ChildReport {
            child_index: index,
            remote_request_id: format!("p-{index}"),
            outcome: ChildOutcome::Done { bytes_delivered: 4, acknowledged: true },
            completed_at: Instant::now(),
            path: None,
        }
    }

    fn expected(n: u32) -> Vec<(u32, String, Vec<BlockId>)> {
        (0..n).map(|i| (i, format!("p-{i}"), vec![i])).collect()
    }

    /// Reports sent before the totals (the pull task's order) all reach `finished`, with the
    /// totals, child 0 first — those a stream took first included.
    #[tokio::test]
    async fn finished_gives_every_report_sent_before_the_totals() {
        let (mut handle, ch) = PullHandle::new("p".into(), expected(3));
        for i in [2, 0, 1] {
            ch.reports.send(done_report(i)).expect("send");
        }
        assert_eq!(handle.next().await.map(|r| r.child_index), Some(2));
        let streamed = Instant::now();
        ch.done.send((12, 12, Duration::from_millis(1))).expect("done");
        let (report, arrived) = handle.finished_timed().await;
        assert!(report.all_done());
        assert_eq!(report.children.iter().map(|c| c.child_index).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!((report.wire_bytes, report.delivered_bytes), (12, 12));
        // The streamed report keeps when the stream gave it; the others reached this caller
        // with the totals, after it.
        assert!(arrived[2] <= streamed && arrived[0] >= streamed && arrived[1] >= streamed, "{arrived:?}");
    }

    /// A pull task that vanished (its channels dropped, no totals) after reporting one
    /// child: `finished` still ends, the others reported failed because the agent shut down.
    #[tokio::test]
    async fn finished_ends_when_the_pull_task_vanishes_without_totals() {
        let (handle, ch) = PullHandle::new("p".into(), expected(2));
        ch.reports.send(done_report(1)).expect("send");
        drop(ch);
        let (report, arrived) = handle.finished_timed().await;
        assert_eq!(arrived.len(), 2);
        assert!(matches!(report.children[1].outcome, ChildOutcome::Done { .. }));
        assert!(matches!(
            &report.children[0].outcome,
            ChildOutcome::Failed { error: PullError::Shutdown, invalid_local_blocks } if invalid_local_blocks == &[0]
        ));
        assert_eq!(report.wire_bytes, 0);
    }

    /// Totals that came before a report (not the task's order, but not a hang either): the
    /// late report is still waited for.
    #[tokio::test]
    async fn a_report_after_the_totals_is_still_waited_for() {
        let (handle, ch) = PullHandle::new("p".into(), expected(1));
        ch.done.send((4, 4, Duration::ZERO)).expect("done");
        let late = tokio::spawn(async move {
            tokio::task::yield_now().await;
            ch.reports.send(done_report(0)).expect("send");
        });
        let report = handle.finished().await;
        late.await.expect("late");
        assert!(report.all_done());
    }
}
