//! Pipelined reads. Small TCP reads a pull starts together (the children of one parent,
//! typically) go to the peer in one write on one data connection, and their answers come
//! back in request order: one round trip for all of them instead of one per read, and one
//! wake-up of the prefill side's connection instead of one per child. Each read's result is
//! fed to the machine as soon as its payload (and the notify's answer sent with it) is in.
//!
//! A batch holds at most [`BATCH_READS`] reads, [`BATCH_PAYLOAD`] bytes of payload and
//! [`BATCH_REQUEST_BYTES`] of requests. A read past either byte limit goes alone, so a large
//! transfer still spreads over the peer's data connections.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use kvxfer_core::log;
use kvxfer_core::pull::{ControlAnswer, PullError, PullMachine, ReadResult};
use kvxfer_tcp::{BatchRead, ClientError};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::{closed_before_answer, Event, Pull};
use crate::decode::peer::read_error;
use crate::decode::report::add;
use crate::decode::shared::Peer;

/// Most payload bytes in one batch; a read of more goes alone.
pub(super) const BATCH_PAYLOAD: u64 = 1 << 20;

/// Most reads in one batch.
pub(super) const BATCH_READS: usize = 16;

/// Most bytes of requests in one batch (a read's request is a few dozen bytes plus its
/// ranges): they are written before any answer is read, so together they must fit the
/// peer's receive buffer. A read whose request is larger goes alone.
pub(super) const BATCH_REQUEST_BYTES: usize = 16 << 10;

/// An upper bound of the bytes a read's request (and its notify, sent behind it with the
/// consumer id `consumer`) take on the wire, from its lease id, token and number of block
/// ranges, for [`split`].
pub(super) fn request_bytes(id: &str, token: &[u8], ranges: usize, consumer: usize) -> usize {
    // Frame headers, tags, lengths and varints: 64 bytes is more than a request and a
    // notify use besides their strings; a range is two varints of at most 5 bytes, tagged,
    // in a length-delimited field.
    2 * (64 + id.len() + token.len()) + 14 * ranges + consumer
}

/// One read, ended (alone or in a batch).
#[derive(Debug)]
pub(super) struct ReadDone {
    /// The child (its position in the pull).
    pub(super) child: usize,
    /// How its read ended.
    pub(super) result: ReadResult,
    /// Whether its notify went out with the read.
    pub(super) with_notify: bool,
    /// That notify's answer, if it came.
    pub(super) notify: Option<ControlAnswer>,
}

impl ReadDone {
    /// Child `i`'s read, without a notify, ended with `result`.
    pub(super) fn alone(child: usize, result: ReadResult) -> Self {
        ReadDone { child, result, with_notify: false, notify: None }
    }

    /// Tells `machine`.
    pub(super) fn feed(self, machine: &mut PullMachine, now: Instant) {
        if self.with_notify {
            machine.read_finished_notified(self.child, now, self.result, self.notify);
        } else {
            machine.read_finished(self.child, now, self.result);
        }
    }
}

/// Splits reads started together (`(child, with_notify)`, in order; `size` gives a read's
/// payload bytes and its request's [`request_bytes`]) into batches: at most [`BATCH_READS`]
/// reads, [`BATCH_PAYLOAD`] bytes of payload and [`BATCH_REQUEST_BYTES`] of requests
/// together; a read past either byte limit alone.
pub(super) fn split(
    reads: Vec<(usize, bool)>,
    size: impl Fn(usize) -> (u64, usize),
) -> Vec<Vec<(usize, bool)>> {
    let mut out: Vec<Vec<(usize, bool)>> = Vec::new();
    let (mut open, mut open_bytes, mut open_requests): (Vec<(usize, bool)>, u64, usize) = (Vec::new(), 0, 0);
    for read in reads {
        let (b, r) = size(read.0);
        if b > BATCH_PAYLOAD || r > BATCH_REQUEST_BYTES {
            out.push(vec![read]);
            continue;
        }
        if open.len() == BATCH_READS
            || open_bytes + b > BATCH_PAYLOAD
            || open_requests + r > BATCH_REQUEST_BYTES
        {
            out.push(std::mem::take(&mut open));
            (open_bytes, open_requests) = (0, 0);
        }
        open.push(read);
        open_bytes += b;
        open_requests += r;
    }
    if !open.is_empty() {
        out.push(open);
    }
    out
}

/// A pull's batches as its driver sees them: a batch is stopped once each of its reads was
/// either answered or asked to stop, and at least one was asked to stop — a read asked to
/// stop alone goes on while a sibling behind it in the batch is still wanted (it then
/// reports its real result, which the machine takes as well as "aborted").
pub(super) struct Batches {
    /// Per batch: its abort token, its reads not settled yet, whether one was asked to stop.
    batches: Vec<(CancellationToken, usize, bool)>,
    /// Per child: its batch, if its read is in one.
    of: Vec<Option<usize>>,
    /// Per child: whether its read was answered or asked to stop.
    settled: Vec<bool>,
}

impl Batches {
    /// No batches yet, for a pull of `children`.
    pub(super) fn new(children: usize) -> Self {
        Batches { batches: Vec::new(), of: vec![None; children], settled: vec![false; children] }
    }

    /// Registers a batch of these reads; returns the token that stops it.
    pub(super) fn open(&mut self, reads: &[(usize, bool)]) -> CancellationToken {
        let token = CancellationToken::new();
        for &(i, _) in reads {
            self.of[i] = Some(self.batches.len());
        }
        self.batches.push((token.clone(), reads.len(), false));
        token
    }

    /// Child `i`'s read was answered (`stopped` false) or asked to stop (true); a read
    /// outside any batch, or settled already, is ignored.
    pub(super) fn settle(&mut self, i: usize, stopped: bool) {
        let Some(b) = self.of.get(i).copied().flatten() else { return };
        if std::mem::replace(&mut self.settled[i], true) {
            return;
        }
        let (token, unsettled, any_stopped) = &mut self.batches[b];
        *unsettled -= 1;
        *any_stopped |= stopped;
        if *unsettled == 0 && *any_stopped {
            token.cancel();
        }
    }
}

impl Pull {
    /// What child `i`'s answered read `r` (and, with `with_notify`, its notify's answer
    /// `notified`) means for the machine.
    fn answer(
        &self,
        i: usize,
        with_notify: bool,
        r: Result<u64, ClientError>,
        notified: Option<Result<kvxfer_proto::v1::NotifyAck, ClientError>>,
    ) -> (ReadResult, Option<ControlAnswer>) {
        if with_notify {
            return self.settle_notified(i, r, notified);
        }
        debug!(remote_request_id = %log::Peer(&self.children[i].remote_request_id()), result = ?r, "child read");
        (self.read_result(i, r), None)
    }

    /// Reads the wire runs of `items` (`(child, with_notify)`; TCP, one KV-cache group) as
    /// one pipelined batch on one data connection. Each read's result goes to `done` as soon
    /// as it is in. A pooled connection closed before the first answer is replaced once, as
    /// for a single read. Reads left unanswered because the connection broke after earlier
    /// answers are then made each alone, side by side (their notify, if it went with the
    /// batch, may have been counted) — unless the peer stopped answering in time, and then
    /// they fail as timed out. When `abort` is
    /// cancelled the connection is dropped and the reads not answered yet are returned as
    /// aborted.
    pub(super) async fn read_batch(
        &self,
        peer: &Peer,
        items: Vec<(usize, bool)>,
        abort: CancellationToken,
        done: UnboundedSender<ReadDone>,
    ) -> Event {
        let answered: Vec<AtomicBool> = items.iter().map(|_| AtomicBool::new(false)).collect();
        let send = |k: usize, (result, notify): (ReadResult, Option<ControlAnswer>)| {
            answered[k].store(true, Ordering::Relaxed);
            let (child, with_notify) = items[k];
            // The driver holds the receiver for as long as this future runs.
            let _ = done.send(ReadDone { child, result, with_notify, notify });
        };
        let read = async {
            let fail = |ks: std::ops::Range<usize>, e: &dyn Fn(&str) -> PullError| {
                for k in ks {
                    send(k, (ReadResult::Failed(e(self.children[items[k].0].remote_request_id())), None));
                }
            };
            let Some(dest) = self.inner.memory.group(0) else {
                let detail = "no local memory for KV-cache group 0".to_owned();
                let e = PullError::Protocol { peer: peer.addr.clone(), detail };
                return fail(0..items.len(), &|_| e.clone());
            };
            let (permit, mut conn, mut reused) = match peer.checkout(&self.inner).await {
                Ok(c) => c,
                Err(e) => return fail(0..items.len(), &|_| e.clone()),
            };
            add(&self.inner.counters.read_batches, 1);
            add(&self.inner.counters.reads_batched, items.len() as u64);
            let reads: Vec<BatchRead<'_>> = items
                .iter()
                .map(|&(i, notify)| BatchRead {
                    id: self.children[i].remote_request_id(),
                    token: self.children[i].token().as_bytes(),
                    runs: &self.wire[i],
                    notify,
                })
                .collect();
            let end = loop {
                let answered = |k: usize, r, notified| {
                    let (i, with_notify) = items[k];
                    send(k, self.answer(i, with_notify, r, notified));
                };
                // SAFETY: the local blocks of every child's runs were claimed by this pull in
                // `submit` (no other pull writes them; the caller does not touch them until
                // their reports, which the machine sends only after these reads ended) and
                // checked against the layout there; the plan gives each local block one
                // wire read, so no two reads of the batch write the same block.
                #[allow(unsafe_code)]
                let end =
                    unsafe { conn.read_batch_into(&reads, dest, &self.inner.consumer_id, answered) }.await;
                // A pooled connection the peer closed before answering (its idle close racing
                // the batch): nothing reached the blocks, so the batch is made once more on a
                // fresh connection.
                if end.answered == 0 && end.error.as_ref().is_some_and(closed_before_answer) && reused {
                    debug!(
                        reads = reads.len(),
                        "pooled connection closed before the answer; retrying the batch"
                    );
                    add(&self.inner.counters.read_retries, 1);
                    conn = match peer.connect(&self.inner).await {
                        Ok(c) => c,
                        Err(e) => return fail(0..items.len(), &|_| e.clone()),
                    };
                    reused = false;
                    continue;
                }
                break end;
            };
            if end.in_step {
                peer.checkin::<()>(conn, &Ok(()));
            } else {
                drop(conn);
            }
            // The reads made alone below check out connections of their own.
            drop(permit);
            let rest = end.answered..items.len();
            match &end.error {
                // Nothing answered on this connection: the reads fail as one read alone would.
                Some(e) if end.answered == 0 => fail(rest, &|id| read_error(e, &self.inner, id)),
                // The peer stopped answering: it will not answer the reads behind either.
                _ if end.timed_out => {
                    let detail =
                        "an earlier read pipelined on its connection got no answer in time".to_owned();
                    let e = PullError::Timeout { peer: peer.addr.clone(), detail };
                    fail(rest, &|_| e.clone());
                }
                // The connection broke after some answers: nothing reached these reads'
                // blocks, so each is made again on its own, side by side (as many at once
                // as the peer's data connections allow).
                _ => {
                    let items_ref = &items;
                    let mut alone: FuturesUnordered<_> = rest
                        .map(|k| async move {
                            let (i, with_notify) = items_ref[k];
                            debug!(remote_request_id = %log::Peer(&self.children[i].remote_request_id()), "read left unanswered by a broken batch; reading it alone");
                            if with_notify {
                                // The prefill side may have taken the notify sent with the
                                // batch (a lease of several consumers then answers its retry
                                // "duplicate": counted).
                                self.notify_answer_lost[i].store(true, Ordering::Relaxed);
                            }
                            let by_group = self.ids.split_runs(&self.wire[i]);
                            add(&self.inner.counters.reads_after_broken_batch, 1);
                            (k, self.tcp_read(peer, i, &by_group, with_notify).await)
                        })
                        .collect();
                    while let Some((k, result)) = alone.next().await {
                        send(k, result);
                    }
                }
            }
        };
        tokio::select! {
            // A batch stopped before it started writes nothing.
            biased;
            () = abort.cancelled() => Event::Reads(
                items
                    .iter()
                    .zip(&answered)
                    .filter(|(_, a)| !a.load(Ordering::Relaxed))
                    .map(|(&(child, _), _)| ReadDone::alone(child, ReadResult::Aborted))
                    .collect(),
            ),
            // Dropping the batch (above) drops its connection mid-transfer: never reused.
            () = read => Event::Reads(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_reads_share_a_batch_and_a_large_one_goes_alone() {
        let kib = |k: u64| k << 10;
        let sizes = [kib(128), kib(128), kib(2048), kib(512), kib(512), kib(128)];
        let reads: Vec<(usize, bool)> = (0..sizes.len()).map(|i| (i, i % 2 == 0)).collect();
        let batches = split(reads, |i| (sizes[i], 100));
        let children: Vec<Vec<usize>> = batches.iter().map(|b| b.iter().map(|r| r.0).collect()).collect();
        // The large read goes alone; the small ones around it batch up to the byte cap.
        assert_eq!(children, vec![vec![2], vec![0, 1, 3], vec![4, 5]]);
        // The notify flags travel with their reads.
        assert!(batches.iter().flatten().all(|&(i, n)| n == (i % 2 == 0)));
    }

    #[test]
    fn a_batch_holds_at_most_batch_reads_reads() {
        let batches = split((0..2 * BATCH_READS + 1).map(|i| (i, false)).collect(), |_| (1, 100));
        let lens: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(lens, vec![BATCH_READS, BATCH_READS, 1]);
    }

    #[test]
    fn requests_of_many_ranges_fill_a_batch_by_their_bytes_and_a_huge_one_goes_alone() {
        // 6 KiB of requests each: two fit in a batch, not three.
        let r = BATCH_REQUEST_BYTES * 3 / 8;
        let sizes = [r, r, r, BATCH_REQUEST_BYTES + 1, 10];
        let batches = split((0..sizes.len()).map(|i| (i, false)).collect(), |i| (1, sizes[i]));
        let children: Vec<Vec<usize>> = batches.iter().map(|b| b.iter().map(|r| r.0).collect()).collect();
        assert_eq!(children, vec![vec![0, 1], vec![3], vec![2, 4]]);
        // A request's estimate grows with its ranges.
        assert!(request_bytes("id", &[0; 32], 1000, 0) > 14_000);
    }

    #[test]
    fn a_batch_stops_only_once_every_read_is_answered_or_stopped_and_one_stopped() {
        let mut b = Batches::new(4);
        let token = b.open(&[(0, false), (1, false), (2, true)]);
        b.settle(1, true);
        assert!(!token.is_cancelled(), "siblings still want the batch");
        b.settle(1, true); // settled already: ignored
        b.settle(0, false);
        assert!(!token.is_cancelled());
        b.settle(3, true); // in no batch: ignored
        b.settle(2, false);
        assert!(token.is_cancelled(), "the read asked to stop is all that is left");

        let mut b = Batches::new(2);
        let token = b.open(&[(0, false), (1, false)]);
        b.settle(0, false);
        b.settle(1, false);
        assert!(!token.is_cancelled(), "every read answered: nothing to stop");
    }
}
