//! The decode-side pull state machine against a simulated peer and a fake clock: no
//! sockets, no threads. A proptest drives random read results, cancels, lost or refused
//! control answers, heartbeats and shutdowns, and checks the machine's promises: every child
//! is reported exactly once, every lease gets exactly one notify-or-cancel while the peer is
//! reachable, no report hands back blocks a read or copy still touches, and a child reported
//! done holds exactly its remote blocks' bytes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kvxfer_core::plan::ResultPlan;
use kvxfer_core::pull::{
    Action, Advice, ChildOutcome, ControlAnswer, PullChild, PullConfig, PullError, PullMachine, ReadResult,
};
use kvxfer_core::BlockId;
use proptest::prelude::*;

const EVERY: Duration = Duration::from_secs(5);
const BLOCK_BYTES: u64 = 4096;

fn timeout(peer: &str) -> PullError {
    PullError::Timeout { peer: peer.into(), detail: format!("connection to {peer}: timed out") }
}

/// One pull under test: the machine, a fake clock, and a model of the local blocks.
struct Sim {
    m: PullMachine,
    now: Instant,
    remote: Vec<Vec<BlockId>>,
    local: Vec<Vec<BlockId>>,
    /// What each local block holds: the remote block last written into it.
    blocks: HashMap<BlockId, BlockId>,
    in_flight: BTreeSet<usize>,
    abort_asked: BTreeSet<usize>,
    abortable: bool,
    /// Held reads the transport still writes (never completes in the simulation).
    held_reads: BTreeSet<usize>,
    pending_control: BTreeMap<usize, &'static str>,
    heartbeat_pending: bool,
    reports: Vec<Option<ChildOutcome>>,
    controls: Vec<u32>,
    /// Local blocks handed back to the caller by a report.
    handed_back: BTreeSet<BlockId>,
    /// Children decided while the peer was known to be unreachable.
    unreachable_seen: bool,
    decided_unreachable: BTreeSet<usize>,
    copies_done: BTreeSet<usize>,
    heartbeats: Vec<(Instant, Vec<usize>)>,
    finished: u32,
    log: Vec<String>,
    /// Reads send their child's notify along when the machine allows it (`notify_with_read`).
    with_read: bool,
    /// Children whose notify went with their read and was answered.
    notified_with_read: BTreeSet<usize>,
}

impl Sim {
    fn new(remote: Vec<Vec<BlockId>>, local: Vec<Vec<BlockId>>, abortable: bool) -> Option<Self> {
        let pairs: Vec<(&[BlockId], &[BlockId])> =
            remote.iter().zip(&local).map(|(r, l)| (r.as_slice(), l.as_slice())).collect();
        let plan = ResultPlan::build(&pairs, 64, 64).ok()?;
        let children = (0u32..)
            .zip(&local)
            .map(|(i, l)| PullChild { child_index: i, local_blocks: l.clone() })
            .collect();
        let n = remote.len();
        let m =
            PullMachine::new(plan, children, PullConfig { heartbeat_every: EVERY, block_bytes: BLOCK_BYTES });
        Some(Sim {
            m,
            now: Instant::now(),
            remote,
            local,
            blocks: HashMap::new(),
            in_flight: BTreeSet::new(),
            abort_asked: BTreeSet::new(),
            abortable,
            held_reads: BTreeSet::new(),
            pending_control: BTreeMap::new(),
            heartbeat_pending: false,
            reports: vec![None; n],
            controls: vec![0; n],
            handed_back: BTreeSet::new(),
            unreachable_seen: false,
            decided_unreachable: BTreeSet::new(),
            copies_done: BTreeSet::new(),
            heartbeats: Vec::new(),
            finished: 0,
            log: Vec::new(),
            with_read: false,
            notified_with_read: BTreeSet::new(),
        })
    }

    fn wire_blocks(&self, k: usize) -> Vec<BlockId> {
        self.m.plan().children[k]
            .wire
            .iter()
            .flat_map(|r| (0..r.count).map(move |j| r.local_start + j))
            .collect()
    }

    /// Carries out every queued action, checking each against what came before.
    fn drain(&mut self) {
        while let Some(a) = self.m.poll_action() {
            self.log.push(format!("{a:?}"));
            assert_eq!(self.finished, 0, "an action after Finished: {a:?}\n{:#?}", self.log);
            match a {
                Action::StartRead(k) => {
                    assert!(self.in_flight.insert(k), "read {k} started twice");
                    for b in self.wire_blocks(k) {
                        assert!(!self.handed_back.contains(&b), "read {k} writes block {b} after its report");
                    }
                }
                Action::AbortRead(k) => {
                    assert!(self.abortable, "abort asked of a transport that cannot abort");
                    assert!(self.in_flight.contains(&k), "abort of read {k} not in flight");
                    self.abort_asked.insert(k);
                }
                Action::Copy { child, copies } => {
                    assert!(self.copies_done.insert(child), "copies of {child} made twice");
                    for (src, dst) in copies {
                        assert!(
                            !self.handed_back.contains(&src) && !self.handed_back.contains(&dst),
                            "copy {src}->{dst} after a report handed one of them back\n{:#?}",
                            self.log
                        );
                        let v = *self.blocks.get(&src).expect("copy source was read");
                        self.blocks.insert(dst, v);
                    }
                }
                Action::Notify(i) | Action::CancelLease(i) => {
                    self.controls[i] += 1;
                    assert!(self.pending_control.insert(i, "control").is_none());
                }
                Action::Heartbeat(leases) => {
                    assert!(!self.heartbeat_pending, "a heartbeat while one is outstanding");
                    self.heartbeat_pending = true;
                    for &i in &leases {
                        assert!(self.reports[i].is_none(), "heartbeat of reported child {i}");
                    }
                    self.heartbeats.push((self.now, leases));
                }
                Action::Report { child, outcome } => {
                    assert!(self.reports[child].is_none(), "child {child} reported twice");
                    if self.unreachable_seen && self.controls[child] == 0 {
                        self.decided_unreachable.insert(child);
                    }
                    let mine: BTreeSet<BlockId> = self.local[child].iter().copied().collect();
                    match &outcome {
                        ChildOutcome::FailedBlocksHeld { held_local_blocks, .. } => {
                            assert_eq!(held_local_blocks, &self.local[child]);
                            assert!(
                                self.held_reads
                                    .iter()
                                    .any(|&k| self.wire_blocks(k).iter().any(|b| mine.contains(b))),
                                "held without a held read into its blocks"
                            );
                        }
                        other => {
                            for &k in self.in_flight.iter().chain(&self.held_reads) {
                                for b in self.wire_blocks(k) {
                                    assert!(
                                        !mine.contains(&b),
                                        "child {child} reported {other:?} while read {k} still writes block {b}\n{:#?}",
                                        self.log
                                    );
                                }
                            }
                            self.handed_back.extend(mine);
                        }
                    }
                    if let ChildOutcome::Done { bytes_delivered, .. } = &outcome {
                        assert_eq!(*bytes_delivered, self.local[child].len() as u64 * BLOCK_BYTES);
                        for (r, l) in self.remote[child].iter().zip(&self.local[child]) {
                            assert_eq!(
                                self.blocks.get(l),
                                Some(r),
                                "child {child} done but block {l} lacks remote {r}"
                            );
                        }
                    }
                    self.reports[child] = Some(outcome);
                }
                Action::Finished(summary) => {
                    self.finished += 1;
                    assert!(self.reports.iter().all(Option::is_some), "finished before every report");
                    let held: Vec<usize> = (0..self.reports.len())
                        .filter(|&i| matches!(self.reports[i], Some(ChildOutcome::FailedBlocksHeld { .. })))
                        .collect();
                    assert_eq!(summary.held_children, held);
                }
            }
        }
    }

    fn finish_read(&mut self, k: usize, result: ReadResult) {
        self.finish_read_with(k, result, Some(ControlAnswer::Acknowledged));
    }

    /// Ends read `k`; with `with_read` and a child the machine lets notify with its read, the
    /// notify sent along was answered with `answer` (`None`: lost). Aborted and abandoned
    /// reads never carry an answer (their connection is dropped mid-read).
    fn finish_read_with(&mut self, k: usize, result: ReadResult, answer: Option<ControlAnswer>) {
        assert!(self.in_flight.remove(&k));
        let carried = self.with_read
            && self.m.notify_with_read(k)
            && matches!(result, ReadResult::Ok { .. } | ReadResult::Failed(_));
        if let ReadResult::Ok { .. } = result {
            for run in &self.m.plan().children[k].wire.clone() {
                for j in 0..run.count {
                    self.blocks.insert(run.local_start + j, run.remote_start + j);
                }
            }
        }
        if let ReadResult::Abandoned(_) = result {
            self.held_reads.insert(k);
        }
        if carried {
            if answer.is_some() {
                self.notified_with_read.insert(k);
            }
            self.m.read_finished_notified(k, self.now, result, answer);
        } else {
            self.m.read_finished(k, self.now, result);
        }
        self.drain();
    }

    fn answer(&mut self, i: usize, a: ControlAnswer) {
        assert!(self.pending_control.remove(&i).is_some());
        if a == ControlAnswer::Unreachable {
            self.unreachable_seen = true;
        }
        self.m.control_answered(i, self.now, a);
        self.drain();
    }

    /// Lets everything still pending complete successfully; the pull must finish.
    fn settle(&mut self) {
        for _ in 0..1000 {
            if self.finished > 0 {
                return;
            }
            if let Some(&k) = self.in_flight.iter().next() {
                let r = if self.abort_asked.contains(&k) {
                    ReadResult::Aborted
                } else {
                    ReadResult::Ok { bytes: self.wire_blocks(k).len() as u64 * BLOCK_BYTES }
                };
                self.finish_read(k, r);
            } else if let Some(&i) = self.pending_control.keys().next() {
                self.answer(i, ControlAnswer::Acknowledged);
            } else if self.heartbeat_pending {
                self.heartbeat_pending = false;
                self.m.heartbeat_answered(self.now, true);
                self.drain();
            } else {
                panic!("the pull is stuck: nothing pending and not finished\n{:#?}", self.log);
            }
        }
        panic!("the pull did not finish\n{:#?}", self.log);
    }

    fn check_books(&self) {
        assert_eq!(self.finished, 1);
        for (i, r) in self.reports.iter().enumerate() {
            assert!(r.is_some(), "child {i} never reported");
            let c = self.controls[i];
            let done = matches!(r, Some(ChildOutcome::Done { .. }));
            if self.notified_with_read.contains(&i) && done {
                // Its notify went with its read: no exchange on its own.
                assert_eq!(
                    c, 0,
                    "child {i}: {c} notifies/cancels after the one with its read\n{:#?}",
                    self.log
                );
            } else if self.decided_unreachable.contains(&i) {
                assert_eq!(c, 0, "child {i}: control sent to an unreachable peer");
            } else {
                assert_eq!(c, 1, "child {i}: {c} notifies/cancels\n{:#?}", self.log);
            }
        }
    }
}

#[test]
fn heartbeats_follow_the_fake_clock_while_reads_are_under_way() {
    let mut s = Sim::new(vec![vec![1, 2], vec![3]], vec![vec![10, 11], vec![12]], true).expect("plan");
    let t0 = s.now;
    assert_eq!(s.m.poll_timeout(), None, "no heartbeat before the handshake");
    s.m.connected(t0, true);
    s.drain();
    assert_eq!(s.m.poll_timeout(), Some(t0 + EVERY));
    s.m.handle_timeout(t0 + EVERY - Duration::from_millis(1));
    s.drain();
    assert!(s.heartbeats.is_empty(), "not due yet");
    s.now = t0 + EVERY;
    s.m.handle_timeout(s.now);
    s.drain();
    assert_eq!(s.heartbeats, vec![(t0 + EVERY, vec![0, 1])]);
    assert_eq!(s.m.poll_timeout(), None, "one heartbeat at a time");
    s.heartbeat_pending = false;
    s.m.heartbeat_answered(s.now, true);
    assert_eq!(s.m.poll_timeout(), Some(t0 + 2 * EVERY));
    // Child 1's read ends: it is notified and reported at once, not after child 0.
    s.finish_read(1, ReadResult::Ok { bytes: BLOCK_BYTES });
    s.answer(1, ControlAnswer::Acknowledged);
    assert!(matches!(s.reports[1], Some(ChildOutcome::Done { acknowledged: true, .. })));
    assert!(s.reports[0].is_none());
    s.now = t0 + 2 * EVERY;
    s.m.handle_timeout(s.now);
    s.drain();
    assert_eq!(s.heartbeats.last(), Some(&(t0 + 2 * EVERY, vec![0])), "only undecided leases");
    s.settle();
    s.check_books();
    assert_eq!(s.m.poll_timeout(), None);
}

#[test]
fn a_siblings_failure_fails_the_children_that_share_its_blocks() {
    // Child 1 shares remote block 1 with child 0 (read by child 0 into local 10, copied to 20).
    let mut s = Sim::new(vec![vec![1, 2], vec![1, 3]], vec![vec![10, 11], vec![20, 21]], true).expect("plan");
    s.m.connected(s.now, true);
    s.drain();
    s.finish_read(1, ReadResult::Ok { bytes: BLOCK_BYTES });
    assert!(s.pending_control.is_empty(), "child 1 waits for the read it depends on");
    s.finish_read(0, ReadResult::Failed(timeout("p:1")));
    s.settle();
    s.check_books();
    let Some(ChildOutcome::Failed { error, .. }) = &s.reports[1] else { panic!("{:?}", s.reports) };
    assert!(matches!(error, PullError::SiblingFailed { sibling: 0, .. }), "{error:?}");
    assert_eq!(error.root_cause(), &timeout("p:1"));
    assert_eq!(error.advice(), Advice::RetryFreshHandoff);
    assert!(error.to_string().contains("sibling 0, which failed: no progress from the peer: connection to p:1: timed out (kind=timeout) (kind=sibling_failed)"), "{error}");
}

#[test]
fn a_cancelled_child_that_siblings_depend_on_finishes_its_read_then_is_released() {
    let mut s = Sim::new(vec![vec![1], vec![1]], vec![vec![10], vec![20]], true).expect("plan");
    s.m.cancel(0, s.now);
    s.m.connected(s.now, true);
    s.drain();
    assert!(s.in_flight.contains(&0), "child 1 needs child 0's read");
    s.finish_read(0, ReadResult::Ok { bytes: BLOCK_BYTES });
    s.settle();
    s.check_books();
    assert!(matches!(s.reports[0], Some(ChildOutcome::Cancelled { released: true, .. })));
    assert!(matches!(s.reports[1], Some(ChildOutcome::Done { .. })));
    // Once nobody needs it, a read in flight is aborted.
    let mut s = Sim::new(vec![vec![1], vec![1]], vec![vec![10], vec![20]], true).expect("plan");
    s.m.connected(s.now, true);
    s.drain();
    s.m.cancel(1, s.now);
    s.m.cancel(0, s.now);
    s.drain();
    assert!(s.abort_asked.contains(&0));
    s.settle();
    s.check_books();
    assert!(s.reports.iter().all(|r| matches!(r, Some(ChildOutcome::Cancelled { .. }))));
}

#[test]
fn a_read_that_cannot_be_stopped_holds_every_child_with_blocks_under_it() {
    // Children 0 and 1 share local block 10 (same remote block): both are held with it.
    let mut s = Sim::new(vec![vec![1, 2], vec![1], vec![5]], vec![vec![10, 11], vec![10], vec![12]], false)
        .expect("plan");
    s.m.connected(s.now, false);
    s.drain();
    let e = PullError::UcxRead { peer: "p:1".into(), detail: "no progress".into() };
    s.finish_read(0, ReadResult::Abandoned(e));
    s.settle();
    s.check_books();
    assert!(matches!(s.reports[0], Some(ChildOutcome::FailedBlocksHeld { .. })));
    assert!(matches!(s.reports[1], Some(ChildOutcome::FailedBlocksHeld { .. })));
    assert!(matches!(s.reports[2], Some(ChildOutcome::Done { .. })));
}

#[test]
fn an_unreachable_peer_fails_every_child_without_control_exchanges() {
    let mut s = Sim::new(vec![vec![1], vec![2]], vec![vec![10], vec![11]], true).expect("plan");
    let e = PullError::Connect { peer: "p:1".into(), detail: "connecting to p:1: refused".into() };
    s.unreachable_seen = true;
    s.m.connect_failed(s.now, e.clone(), false);
    s.drain();
    s.check_books();
    for r in &s.reports {
        assert_eq!(r, &Some(ChildOutcome::Failed { error: e.clone(), invalid_local_blocks: r_blocks(r) }));
    }
}

fn r_blocks(r: &Option<ChildOutcome>) -> Vec<BlockId> {
    match r {
        Some(ChildOutcome::Failed { invalid_local_blocks, .. }) => invalid_local_blocks.clone(),
        _ => vec![],
    }
}

#[test]
fn shutdown_stops_reads_and_fails_the_children_still_reading() {
    let mut s = Sim::new(vec![vec![1], vec![2]], vec![vec![10], vec![11]], true).expect("plan");
    s.m.connected(s.now, true);
    s.drain();
    s.finish_read(0, ReadResult::Ok { bytes: BLOCK_BYTES });
    s.m.begin_shutdown(s.now);
    s.m.abort_reads(s.now);
    s.drain();
    assert!(s.abort_asked.contains(&1));
    s.settle();
    s.check_books();
    assert!(matches!(s.reports[0], Some(ChildOutcome::Done { .. })), "read before the shutdown");
    let Some(ChildOutcome::Failed { error, .. }) = &s.reports[1] else { panic!("{:?}", s.reports) };
    assert_eq!(error, &PullError::Shutdown);
    assert_eq!(error.advice(), Advice::FailRequest);
}

/// Builds local block lists for `remote`: per block, either the block shared by every
/// sibling with that remote block or a fresh one, as `share` says.
fn locals(remote: &[Vec<BlockId>], share: &[bool]) -> Vec<Vec<BlockId>> {
    let mut shared: HashMap<BlockId, BlockId> = HashMap::new();
    let mut next = 20;
    let mut k = 0;
    remote
        .iter()
        .map(|r| {
            r.iter()
                .map(|&b| {
                    k += 1;
                    if share[k % share.len()] {
                        *shared.entry(b).or_insert_with(|| {
                            next += 1;
                            next
                        })
                    } else {
                        next += 1;
                        next
                    }
                })
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_child_is_reported_once_and_every_lease_ends_once(
        remote in prop::collection::vec(prop::collection::btree_set(0u32..8, 1..4), 1..6),
        share in prop::collection::vec(any::<bool>(), 1..8),
        abortable in any::<bool>(),
        with_read in any::<bool>(),
        connect in 0u8..6,
        ops in prop::collection::vec((0u8..8, any::<u8>(), any::<u8>()), 0..60),
    ) {
        let remote: Vec<Vec<BlockId>> = remote.into_iter().map(|s| s.into_iter().collect()).collect();
        let local = locals(&remote, &share);
        let Some(mut s) = Sim::new(remote, local, abortable) else { return Ok(()) };
        s.with_read = with_read;
        let n = s.reports.len();
        match connect {
            0 => {
                s.unreachable_seen = true;
                s.m.connect_failed(s.now, PullError::Connect { peer: "p".into(), detail: "refused".into() }, false);
            }
            1 => s.m.connect_failed(s.now, PullError::RemoteBlocksOutOfRange { ids: vec![9], num_blocks: 8 }, true),
            _ => s.m.connected(s.now, abortable),
        }
        s.drain();
        for (op, a, b) in ops {
            match op {
                0 | 1 => {
                    let flying: Vec<usize> = s.in_flight.iter().copied().collect();
                    if flying.is_empty() { continue; }
                    let k = flying[a as usize % flying.len()];
                    let r = if s.abort_asked.contains(&k) && b % 2 == 0 {
                        ReadResult::Aborted
                    } else {
                        match b % 4 {
                            0 | 1 => ReadResult::Ok { bytes: s.wire_blocks(k).len() as u64 * BLOCK_BYTES },
                            2 => ReadResult::Failed(timeout("p")),
                            _ if !abortable => ReadResult::Abandoned(PullError::UcxRead { peer: "p".into(), detail: "stuck".into() }),
                            _ => ReadResult::Failed(PullError::Integrity { peer: "p".into(), detail: "crc".into() }),
                        }
                    };
                    let answer = [Some(ControlAnswer::Acknowledged), Some(ControlAnswer::NotAcknowledged), None][a as usize / 7 % 3];
                    s.finish_read_with(k, r, answer);
                }
                2 => { s.m.cancel(a as usize % n, s.now); s.drain(); }
                3 => {
                    let pending: Vec<usize> = s.pending_control.keys().copied().collect();
                    if pending.is_empty() { continue; }
                    let i = pending[a as usize % pending.len()];
                    let answer = [ControlAnswer::Acknowledged, ControlAnswer::NotAcknowledged, ControlAnswer::Unreachable][b as usize % 3];
                    s.answer(i, answer);
                }
                4 => { s.now += EVERY; s.m.handle_timeout(s.now); s.drain(); }
                5 => {
                    if s.heartbeat_pending {
                        s.heartbeat_pending = false;
                        let reachable = b % 4 != 0;
                        if !reachable { s.unreachable_seen = true; }
                        s.m.heartbeat_answered(s.now, reachable);
                        s.drain();
                    }
                }
                6 => { s.m.begin_shutdown(s.now); s.drain(); }
                _ => { if a % 4 == 0 { s.m.abort_reads(s.now); s.drain(); } }
            }
        }
        s.settle();
        s.check_books();
        // Held children are exactly those whose blocks lie under a held read.
        for i in 0..n {
            let under = s.held_reads.iter().any(|&k| s.wire_blocks(k).iter().any(|b| s.local[i].contains(b)));
            prop_assert_eq!(under, matches!(s.reports[i], Some(ChildOutcome::FailedBlocksHeld { .. })));
        }
    }
}

/// A machine over `remote`/`local` children, connected, with its first actions drained.
fn connected(remote: &[Vec<BlockId>], local: &[Vec<BlockId>]) -> (PullMachine, Vec<Action>, Instant) {
    let pairs: Vec<(&[BlockId], &[BlockId])> =
        remote.iter().zip(local).map(|(r, l)| (r.as_slice(), l.as_slice())).collect();
    let plan = ResultPlan::build(&pairs, 64, 64).expect("plan");
    let children =
        (0u32..).zip(local).map(|(i, l)| PullChild { child_index: i, local_blocks: l.clone() }).collect();
    let mut m =
        PullMachine::new(plan, children, PullConfig { heartbeat_every: EVERY, block_bytes: BLOCK_BYTES });
    let now = Instant::now();
    m.connected(now, true);
    let actions = std::iter::from_fn(|| m.poll_action()).collect();
    (m, actions, now)
}

/// A child whose own read alone settles it may send its notify with that read; once the
/// read ends with the notify answered, the child is reported at once with that answer and
/// no separate notify. Children sharing blocks (a copy from a sibling's read) never qualify.
#[test]
fn a_notify_sent_with_the_read_replaces_the_separate_notify() {
    // Child 1 shares remote block 1 with child 0: one read, then a copy into child 1.
    let remote = vec![vec![1, 2], vec![1, 3], vec![7, 8]];
    let local = vec![vec![10, 11], vec![12, 13], vec![14, 15]];
    let (mut m, started, now) = connected(&remote, &local);
    assert!(m.plan().children[1].depends_on.contains(&0), "the plan shares block 1: {:?}", m.plan());
    assert!(started.contains(&Action::StartRead(2)), "{started:?}");
    assert!(!m.notify_with_read(0), "child 1 copies from child 0's blocks");
    assert!(!m.notify_with_read(1), "child 1 depends on child 0's read");
    assert!(m.notify_with_read(2));
    assert!(!m.notify_with_read(3), "no such child");

    m.read_finished_notified(
        2,
        now,
        ReadResult::Ok { bytes: 2 * BLOCK_BYTES },
        Some(ControlAnswer::Acknowledged),
    );
    let after: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert_eq!(
        after,
        vec![Action::Report {
            child: 2,
            outcome: ChildOutcome::Done { bytes_delivered: 2 * BLOCK_BYTES, acknowledged: true }
        }]
    );

    // A refused notify is an answer too: reported done, not acknowledged, nothing resent.
    let (mut m, _, now) = connected(&[vec![5]], &[vec![9]]);
    m.read_finished_notified(
        0,
        now,
        ReadResult::Ok { bytes: BLOCK_BYTES },
        Some(ControlAnswer::NotAcknowledged),
    );
    let after: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(
            after.as_slice(),
            [
                Action::Report { child: 0, outcome: ChildOutcome::Done { acknowledged: false, .. } },
                Action::Finished(_)
            ]
        ),
        "{after:?}"
    );
}

/// The answer to a notify sent with the read was lost: the notify goes out on its own. A
/// read that failed has its lease cancelled as usual, whatever its notify was answered.
#[test]
fn a_lost_answer_or_a_failed_read_falls_back_to_the_separate_control() {
    let (mut m, _, now) = connected(&[vec![5]], &[vec![9]]);
    assert!(m.notify_with_read(0));
    m.read_finished_notified(0, now, ReadResult::Ok { bytes: BLOCK_BYTES }, None);
    assert_eq!(m.poll_action(), Some(Action::Notify(0)));
    m.control_answered(0, now, ControlAnswer::Acknowledged);
    assert!(matches!(
        m.poll_action(),
        Some(Action::Report { child: 0, outcome: ChildOutcome::Done { acknowledged: true, .. } })
    ));

    let (mut m, _, now) = connected(&[vec![5]], &[vec![9]]);
    m.read_finished_notified(0, now, ReadResult::Failed(timeout("p")), Some(ControlAnswer::NotAcknowledged));
    assert_eq!(m.poll_action(), Some(Action::CancelLease(0)));
}
