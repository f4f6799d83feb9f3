//! The pull task: a thin driver of the core's [`PullMachine`]. It handshakes, then carries
//! out the machine's actions — reads, sibling copies, notifies, cancels, heartbeats, reports
//! — and feeds back what happened. Every decision (which read, when a child is decided,
//! what a sibling's failure means) is the machine's.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures::future::OptionFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use kvxfer_core::log;
use kvxfer_core::plan::BlockRun;
use kvxfer_core::pull::{
    Action, ChildOutcome, ControlAnswer, PullError, PullMachine, PullSummary, ReadResult,
};
use kvxfer_core::{BlockId, BlockLayout, ChildHandoff};
use kvxfer_proto::v1::{self, LeaseOutcome};
use kvxfer_tcp::ClientError;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use self::batch::{Batches, ReadDone};
use super::groups::GroupIds;
use super::peer::{pull_error, read_error, ControlOp, ControlReply};
use super::report::{add, ChildReport, DataPath, PullChannels, Totals};
use super::shared::{Inner, Peer};
use crate::TransportChoice;

mod batch;

/// The data path a pull uses with one peer (the public [`DataPath`] without UCX's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    Tcp,
    #[cfg(feature = "ucx")]
    Ucx,
}

impl Path {
    pub(crate) fn of(path: &DataPath) -> Path {
        match path {
            #[cfg(feature = "ucx")]
            DataPath::Ucx { .. } => Path::Ucx,
            _ => Path::Tcp,
        }
    }
}

/// The data path to `peer` from its handshake answer: UCX when both sides offer it (and
/// the config allows), else TCP; an error when UCX is required and unusable.
#[cfg_attr(not(feature = "ucx"), allow(clippy::unused_async))]
pub(crate) async fn choose_path(
    inner: &Inner,
    peer: &Peer,
    ack: &v1::HelloAck,
) -> Result<DataPath, PullError> {
    let want = inner.config.transport;
    if want == TransportChoice::Tcp {
        return Ok(DataPath::Tcp);
    }
    #[cfg(feature = "ucx")]
    if let Some(transports) = crate::ucx::connect(inner, peer, ack).await? {
        return Ok(DataPath::Ucx { transports });
    }
    if want == TransportChoice::Ucx {
        let detail =
            format!("UCX was requested, but {} does not offer it or this agent has no UCX", peer.addr);
        return Err(PullError::TransportUnavailable { peer: peer.addr.clone(), detail });
    }
    let _ = (peer, ack);
    Ok(DataPath::Tcp)
}

/// What one of the pull's concurrent I/O futures reports.
enum Event {
    /// A read on its own (with its notify behind it, and that notify's answer, if so).
    Read(ReadDone),
    Control(usize, ControlAnswer),
    Heartbeat(bool),
    /// Reads of a pipelined batch that it did not answer because it was stopped.
    Reads(Vec<ReadDone>),
}

type IoFuture<'a> = Pin<Box<dyn Future<Output = Event> + Send + 'a>>;

/// One pull under way.
pub(crate) struct Pull {
    inner: Arc<Inner>,
    children: Vec<ChildHandoff>,
    /// How the plan's flat block ids map to KV-cache groups.
    ids: GroupIds,
    claimed: HashSet<BlockId>,
    /// Per child, the runs it reads over the wire (from the plan, flat ids).
    wire: Vec<Vec<BlockRun>>,
    channels: PullChannels,
    started: Instant,
    /// Cleared when the peer cannot be reached at all (connect or handshake refused, or no
    /// answer within the io timeout): later notifies and cancels of this pull are skipped
    /// instead of each waiting out a timeout.
    reachable: AtomicBool,
    /// Per child: a notify went out with its read but its answer was lost, so the notify
    /// sent on its own is a retry (a "duplicate" answer then means counted).
    notify_answer_lost: Vec<AtomicBool>,
    /// One-sided reads the transport could not stop, and the blocks they hold.
    #[cfg(feature = "ucx")]
    held: Arc<crate::ucx::HeldReads>,
    /// The data path chosen at the handshake, for the children's reports.
    data_path: std::sync::OnceLock<DataPath>,
}

impl Pull {
    pub(crate) fn new(
        inner: Arc<Inner>,
        children: Vec<ChildHandoff>,
        ids: GroupIds,
        claimed: HashSet<BlockId>,
        channels: PullChannels,
        started: Instant,
    ) -> Self {
        let children_len = children.len();
        Pull {
            #[cfg(feature = "ucx")]
            held: Arc::new(crate::ucx::HeldReads::new(inner.busy.clone(), inner.reclaimed_tx.clone())),
            inner,
            children,
            ids,
            claimed,
            wire: Vec::new(),
            channels,
            started,
            reachable: AtomicBool::new(true),
            notify_answer_lost: (0..children_len).map(|_| AtomicBool::new(false)).collect(),
            data_path: std::sync::OnceLock::new(),
        }
    }

    pub(crate) async fn run(mut self, mut machine: PullMachine) {
        // The hand-off's address, or discovery's verdict: a gone engine fails every child
        // at once, before any I/O.
        let resolved = self.inner.resolve(self.children[0].engine());
        let peer = match &resolved {
            Ok(addr) => self.inner.peer(addr),
            // Not pooled, and never connected to: the pull fails before any I/O.
            Err(_) => Arc::new(Peer::new(
                &self.children[0].engine().engine_id,
                1,
                self.inner.config.limits.idle_timeout,
            )),
        };
        let (stop, abort) = (self.inner.stop.clone(), self.inner.abort.clone());
        let mut cancels =
            std::mem::replace(&mut self.channels.cancels, tokio::sync::mpsc::unbounded_channel().1);
        let done = std::mem::replace(&mut self.channels.done, tokio::sync::oneshot::channel().0);
        self.wire = machine.plan().children.iter().map(|c| c.wire.clone()).collect();
        let path = if let Err(e) = resolved {
            self.reachable.store(false, Ordering::Relaxed);
            machine.connect_failed(Instant::now(), e, false);
            None
        } else {
            tokio::select! {
            r = self.connect(&peer) => match r {
                Ok((layout, path)) => {
                    machine.connected(Instant::now(), path == Path::Tcp);
                    Some((layout, path))
                }
                Err((e, reachable)) => {
                    self.reachable.store(reachable, Ordering::Relaxed);
                    machine.connect_failed(Instant::now(), e, reachable);
                    None
                }
            },
            () = abort.cancelled() => {
                self.reachable.store(false, Ordering::Relaxed);
                machine.connect_failed(Instant::now(), PullError::Shutdown, false);
                None
            }
            }
        };
        let used = path.as_ref().map(|(_, p)| *p);
        let this = &self;
        let mut io: FuturesUnordered<IoFuture<'_>> = FuturesUnordered::new();
        let mut heartbeat: Option<IoFuture<'_>> = None;
        let mut read_aborts: Vec<Option<CancellationToken>> = vec![None; this.children.len()];
        // Reads to pipeline, collected while the machine's actions are taken; the batches
        // made of them; the reads they answer, one by one as they come.
        let mut to_batch: Vec<(usize, bool)> = Vec::new();
        let mut batches = Batches::new(this.children.len());
        let (batch_tx, mut batch_rx) = tokio::sync::mpsc::unbounded_channel::<ReadDone>();
        let (mut stopping, mut aborting, mut cancels_open) = (false, false, true);
        loop {
            while let Some(action) = machine.poll_action() {
                match action {
                    Action::StartRead(i) => {
                        let Some((layout, path)) = &path else { continue };
                        let token = CancellationToken::new();
                        read_aborts[i] = Some(token.clone());
                        // Over TCP, when configured, a child that nothing else settles sends
                        // its notify with its read: one round trip.
                        let with_notify = this.inner.config.notify_with_read
                            && *path == Path::Tcp
                            && this.inner.memory.num_groups() == 1
                            && machine.notify_with_read(i);
                        if with_notify {
                            add(&this.inner.counters.notifies_with_read, 1);
                        }
                        // Over TCP with one KV-cache group, small reads started together are
                        // pipelined on one connection (below, once every action is taken).
                        if *path == Path::Tcp && this.inner.memory.num_groups() == 1 {
                            to_batch.push((i, with_notify));
                        } else {
                            io.push(Box::pin(this.read(&peer, i, layout, *path, token, with_notify)));
                        }
                    }
                    Action::AbortRead(i) => {
                        if let Some(t) = &read_aborts[i] {
                            t.cancel();
                        }
                        batches.settle(i, true);
                    }
                    Action::Copy { copies, .. } => this.copy(&copies),
                    Action::Notify(i) | Action::CancelLease(i) => {
                        // On a control connection of its own: a heartbeat still waiting for
                        // its answer delays it no more than a large read does.
                        let f: IoFuture<'_> = match action {
                            Action::Notify(_) => Box::pin(this.notify(&peer, i)),
                            _ => Box::pin(this.cancel_lease(&peer, i)),
                        };
                        io.push(f);
                    }
                    Action::Heartbeat(leases) => heartbeat = Some(Box::pin(this.heartbeat(&peer, leases))),
                    Action::Report { child, outcome } => this.report(child, outcome, used),
                    Action::Finished(summary) => {
                        let _ = done.send(this.finish(summary, used));
                        return;
                    }
                }
            }
            if let Some((layout, path)) = &path {
                let block_bytes = this.inner.memory.layout().block_bytes();
                let size = |i: usize| {
                    let child = &this.children[i];
                    let runs = &this.wire[i];
                    let payload = runs.iter().map(|r| u64::from(r.count) * block_bytes).sum();
                    let request = batch::request_bytes(
                        child.remote_request_id(),
                        child.token().as_bytes(),
                        runs.len(),
                        this.inner.consumer_id.len(),
                    );
                    (payload, request)
                };
                for batch in batch::split(std::mem::take(&mut to_batch), size) {
                    if let [(i, with_notify)] = batch[..] {
                        let token = read_aborts[i].clone().unwrap_or_default();
                        io.push(Box::pin(this.read(&peer, i, layout, *path, token, with_notify)));
                        continue;
                    }
                    let token = batches.open(&batch);
                    // A read asked to stop before its batch was made.
                    for &(i, _) in &batch {
                        if read_aborts[i].as_ref().is_some_and(CancellationToken::is_cancelled) {
                            batches.settle(i, true);
                        }
                    }
                    io.push(Box::pin(this.read_batch(&peer, batch, token, batch_tx.clone())));
                }
            }
            let timer = machine.poll_timeout();
            tokio::select! {
                Some(event) = io.next(), if !io.is_empty() => {
                    this.take_queued_cancels(&mut machine, &mut cancels, &mut cancels_open);
                    let now = Instant::now();
                    match event {
                        Event::Read(done) => done.feed(&mut machine, now),
                        Event::Control(i, a) => machine.control_answered(i, now, a),
                        Event::Heartbeat(reachable) => machine.heartbeat_answered(now, reachable),
                        Event::Reads(reads) => {
                            for done in reads {
                                done.feed(&mut machine, now);
                            }
                        }
                    }
                }
                Some(done) = batch_rx.recv() => {
                    this.take_queued_cancels(&mut machine, &mut cancels, &mut cancels_open);
                    batches.settle(done.child, false);
                    done.feed(&mut machine, Instant::now());
                }
                Some(event) = OptionFuture::from(heartbeat.as_mut()), if heartbeat.is_some() => {
                    heartbeat = None;
                    if let Event::Heartbeat(reachable) = event {
                        machine.heartbeat_answered(Instant::now(), reachable);
                    }
                }
                index = cancels.recv(), if cancels_open => match index {
                    Some(index) => this.cancel_child(&mut machine, index),
                    // The handle and every canceller are gone: nobody can cancel any more.
                    None => cancels_open = false,
                },
                () = sleep_until(timer), if timer.is_some() => machine.handle_timeout(Instant::now()),
                () = stop.cancelled(), if !stopping => {
                    stopping = true;
                    machine.begin_shutdown(Instant::now());
                }
                () = abort.cancelled(), if !aborting => {
                    aborting = true;
                    machine.abort_reads(Instant::now());
                }
            }
        }
    }

    /// Handshakes, checks the remote ids against the peer's layout, and picks the path. On
    /// failure: the error, and whether the peer can still be told to release the leases.
    async fn connect(&self, peer: &Peer) -> Result<(Vec<BlockLayout>, Path), (PullError, bool)> {
        let (layouts, path) = self.handshake(peer).await?;
        // Every KV-cache group's ids against that group's layout (the compatibility hash
        // made sure both sides have the same groups).
        for (g, remote_layout) in layouts.iter().enumerate() {
            let ids: Vec<BlockId> = self
                .children
                .iter()
                .flat_map(|c| remote_layout.out_of_range(c.group_block_ids(g).unwrap_or(&[]).iter().copied()))
                .take(16)
                .collect();
            if !ids.is_empty() {
                let num_blocks = remote_layout.num_blocks();
                return Err((PullError::RemoteBlocksOutOfRange { ids, num_blocks }, true));
            }
        }
        if layouts.len() != self.inner.memory.num_groups() {
            let detail = format!(
                "the prefill agent has {} KV-cache group(s), this agent {}",
                layouts.len(),
                self.inner.memory.num_groups()
            );
            return Err((PullError::Protocol { peer: peer.addr.clone(), detail }, true));
        }
        Ok((layouts, path))
    }

    /// Handshakes with the peer (once per connection), checks it is the engine process the
    /// hand-offs name (engine id, and incarnation when stated), and picks the data path: the
    /// best one both sides offer, unless the config forces one. On failure: the error, and
    /// whether the peer can still be told to release the leases — not when the hello failed
    /// or the peer is another process than the hand-offs name; yes when it answered as the
    /// right engine and only its layout or the data path was wrong.
    async fn handshake(&self, peer: &Peer) -> Result<(Vec<BlockLayout>, Path), (PullError, bool)> {
        let unreachable = |e| (e, false);
        let hello = async || {
            peer.hello(&self.inner).await.map_err(|e| pull_error(&e, &self.inner)).map_err(unreachable)
        };
        let want = self.children[0].engine();
        let stale = |ack: &v1::HelloAck| {
            ack.engine_id != want.engine_id || (want.incarnation != 0 && ack.incarnation != want.incarnation)
        };
        let mut ack = hello().await?;
        if stale(&ack) {
            // Our connections may predate a restart of the worker at this address: start
            // over once with fresh ones before calling the hand-off stale.
            debug!(peer = %peer.addr, had = %log::Peer(&ack.engine_id), had_incarnation = %log::Incarnation(ack.incarnation), want = %want.engine_id, want_incarnation = %log::Incarnation(want.incarnation), "engine changed; reconnecting");
            peer.reset();
            ack = hello().await?;
        }
        if stale(&ack) {
            return Err(unreachable(PullError::PeerRestarted {
                peer: peer.addr.clone(),
                expected_engine: want.engine_id.clone(),
                expected_incarnation: want.incarnation,
                found_engine: ack.engine_id.clone(),
                found_incarnation: ack.incarnation,
            }));
        }
        // The right engine answered: it can still be told to release the leases.
        let protocol = |detail: String| (PullError::Protocol { peer: peer.addr.clone(), detail }, true);
        // A peer of another TP or block size (accepted for its shape) cannot be pulled
        // block for block: its blocks are not ours.
        if ack.compat_hash != kvxfer_core::groups_compat_hash(self.inner.memory.group_layouts()) {
            return Err(protocol(
                "the prefill agent's KV-cache shape differs from this agent's (another TP or block size): \
                 pull its results with DecodeAgent::submit_ranks"
                    .into(),
            ));
        }
        // The hash leaves the rank out: a prefill rank of another tp_rank whose blocks hold
        // other heads than this rank's would be copied in silently.
        if let (Some(ours), Some(theirs)) = (&self.inner.shape, &ack.kv_shape) {
            let theirs = kvxfer_core::KvShape::new(kvxfer_core::KvShapeSpec::from_wire(theirs))
                .map_err(|e| protocol(format!("the prefill agent's KV-cache shape is malformed: {e}")))?;
            let (h_p, h_d) = (theirs.heads_of_rank(theirs.tp_rank()), ours.heads_of_rank(ours.tp_rank()));
            if h_p != h_d {
                return Err(protocol(format!(
                    "tp_rank: the prefill agent is rank {} (heads {h_p:?}), this agent rank {} (heads \
                     {h_d:?}): pull the result of the prefill rank holding this rank's heads",
                    theirs.tp_rank(),
                    ours.tp_rank()
                )));
            }
        }
        let wire =
            ack.layout.as_ref().ok_or_else(|| protocol("the prefill agent sent no block layout".into()))?;
        let layouts = std::iter::once(wire)
            .chain(&ack.other_group_layouts)
            .map(BlockLayout::from_wire)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| protocol(format!("the prefill agent's layout is malformed: {e}")))?;
        let data_path = choose_path(&self.inner, peer, &ack).await.map_err(|e| (e, true))?;
        let path = Path::of(&data_path);
        let _ = self.data_path.set(data_path);
        Ok((layouts, path))
    }

    /// Reads child `i`'s wire runs; a TCP read stops when `abort` is cancelled. With
    /// `with_notify` (TCP only), the child's notify goes out behind the read request.
    async fn read(
        &self,
        peer: &Peer,
        i: usize,
        remote: &[BlockLayout],
        path: Path,
        abort: CancellationToken,
        with_notify: bool,
    ) -> Event {
        let runs = &self.wire[i];
        // One read per KV-cache group (one read, of group 0, for a single-group cache).
        let by_group = self.ids.split_runs(runs);
        #[cfg(feature = "ucx")]
        if path == Path::Ucx {
            let child = &self.children[i];
            // A UCX get cannot be cut short: the machine never aborts one. One pin and get
            // per KV-cache group, in group order; the first that does not succeed ends it.
            let mut total = 0u64;
            for (group, runs) in &by_group {
                let g = *group as usize;
                let (Some(local), Some(layout)) = (self.inner.memory.group(g), remote.get(g)) else {
                    let detail = format!("no layout or memory for KV-cache group {group}");
                    let failed = ReadResult::Failed(PullError::Protocol { peer: peer.addr.clone(), detail });
                    return Event::Read(ReadDone::alone(i, failed));
                };
                let r = crate::ucx::read_child(
                    &self.inner,
                    peer,
                    child,
                    (*group, local, runs),
                    layout,
                    None,
                    (&self.held, i),
                )
                .await;
                match r {
                    ReadResult::Ok { bytes } => total += bytes,
                    other => return Event::Read(ReadDone::alone(i, other)),
                }
            }
            return Event::Read(ReadDone::alone(i, ReadResult::Ok { bytes: total }));
        }
        let _ = (remote, path);
        tokio::select! {
            (result, notify) = self.tcp_read(peer, i, &by_group, with_notify) => {
                Event::Read(ReadDone { child: i, result, with_notify, notify })
            }
            // Dropping the read drops its connection mid-transfer: it is never reused.
            () = abort.cancelled() => Event::Read(ReadDone::alone(i, ReadResult::Aborted)),
        }
    }

    /// Child `i`'s TCP read of `by_group` (its wire runs split by KV-cache group) on a pooled
    /// data connection, retried once on a fresh one when the pooled one closed before
    /// answering. With `with_notify`, the child's notify goes out behind the read (one
    /// group), and its answer comes back with the read's result.
    async fn tcp_read(
        &self,
        peer: &Peer,
        i: usize,
        by_group: &[(u32, Vec<BlockRun>)],
        with_notify: bool,
    ) -> (ReadResult, Option<ControlAnswer>) {
        let child = &self.children[i];
        let (_permit, mut conn, mut reused) = match peer.checkout(&self.inner).await {
            Ok(c) => c,
            Err(e) => return (ReadResult::Failed(e), None),
        };
        let id = child.remote_request_id();
        let mut total = 0u64;
        let mut next_group = 0usize;
        loop {
            let Some((group, runs)) = by_group.get(next_group) else {
                peer.checkin::<u64>(conn, &Ok(total));
                return (ReadResult::Ok { bytes: total }, None);
            };
            let Some(dest) = self.inner.memory.group(*group as usize) else {
                peer.checkin::<u64>(conn, &Ok(total));
                let detail = format!("no local memory for KV-cache group {group}");
                return (ReadResult::Failed(PullError::Protocol { peer: peer.addr.clone(), detail }), None);
            };
            let (token, consumer) = (child.token().as_bytes(), &self.inner.consumer_id);
            // The local blocks of `runs` were claimed by this pull in `submit` (no other
            // pull writes them; the caller does not touch them until their report, which
            // the machine sends only after this read ended), and `submit` checked them
            // against their group's layout (`dest`). The notify rides with the read only
            // for a single-group cache (checked where the read starts): group 0's read is
            // then the child's only one.
            let (r, notified) = if with_notify {
                // SAFETY: exclusive, in-layout destination blocks (above).
                #[allow(unsafe_code)]
                let r = unsafe { conn.read_into_then_notify(id, token, runs, dest, consumer) }.await;
                r
            } else {
                // SAFETY: exclusive, in-layout destination blocks (above).
                #[allow(unsafe_code)]
                let r = unsafe { conn.read_group_into(id, token, *group, runs, dest) }.await;
                (r, None)
            };
            // A pooled connection the peer closed before answering (its idle close racing
            // our request): nothing reached the blocks, so the read is made once more on a
            // fresh connection.
            if r.as_ref().is_err_and(closed_before_answer) && reused && !conn.payload_started() {
                debug!(remote_request_id = %log::Peer(&id), result = ?r, "pooled connection closed before the answer; retrying the read");
                add(&self.inner.counters.read_retries, 1);
                conn = match peer.connect(&self.inner).await {
                    Ok(c) => c,
                    Err(e) => return (ReadResult::Failed(e), None),
                };
                reused = false;
                continue;
            }
            if with_notify {
                // The connection is back in step only if the notify's answer was read too.
                match &notified {
                    Some(Err(e)) if !e.connection_usable() => drop(conn),
                    None => drop(conn),
                    _ => peer.checkin(conn, &r),
                }
                return self.settle_notified(i, r, notified);
            }
            debug!(remote_request_id = %log::Peer(&id), group, result = ?r, "child read");
            match r {
                Ok(bytes) => {
                    total += bytes;
                    next_group += 1;
                }
                Err(_) => {
                    peer.checkin(conn, &r);
                    return (self.read_result(i, r), None);
                }
            }
        }
    }

    /// The result of child `i`'s read `r` whose notify went with it and was answered with
    /// `notified` (`None`: the connection broke before that answer).
    fn settle_notified(
        &self,
        i: usize,
        r: Result<u64, ClientError>,
        notified: Option<Result<v1::NotifyAck, ClientError>>,
    ) -> (ReadResult, Option<ControlAnswer>) {
        let id = self.children[i].remote_request_id();
        debug!(remote_request_id = %log::Peer(&id), result = ?r, ?notified, "child read");
        // A notify whose answer was lost (the connection broke after the payload) is sent
        // again on its own (`None`); an answer, even a refusal, is final.
        let lost = notified.as_ref().is_some_and(|n| n.as_ref().is_err_and(|e| !e.connection_usable()));
        if lost && r.is_ok() {
            // The prefill side may have counted it: the notify on its own retries it.
            self.notify_answer_lost[i].store(true, Ordering::Relaxed);
            add(&self.inner.counters.control_retries, 1);
        }
        // An earlier notify of this lease, sent with a read that went unanswered, may have
        // been counted: a "duplicate" answer then means counted.
        let attempts = 1 + u32::from(self.notify_answer_lost[i].load(Ordering::Relaxed));
        let answer =
            notified.filter(|_| !lost).map(|n| notify_answer(&n.map(ControlReply::Notify), attempts));
        if let Some(a) = answer.filter(|a| r.is_ok() && *a != ControlAnswer::Acknowledged) {
            warn!(remote_request_id = %log::Peer(&id), answer = %log::Peer(format_args!("{a:?}")), "notification sent with the read not acknowledged");
        }
        (self.read_result(i, r), answer)
    }

    /// What child `i`'s read ending with `r` is for the machine.
    fn read_result(&self, i: usize, r: Result<u64, ClientError>) -> ReadResult {
        match r {
            Ok(bytes) => ReadResult::Ok { bytes },
            Err(e) => ReadResult::Failed(read_error(&e, &self.inner, self.children[i].remote_request_id())),
        }
    }

    fn copy(&self, copies: &[(BlockId, BlockId)]) {
        for &(src, dst) in copies {
            // Both in one group: a plan copies a block only to a block of the same remote id.
            let ((g, src), (_, dst)) = (self.ids.split_local(src), self.ids.split_local(dst));
            let Some(mem) = self.inner.memory.group(g) else { continue };
            // SAFETY: `src` and `dst` are destination blocks claimed by this pull (no other
            // pull writes them), the machine asks for a copy only once every read it depends
            // on has finished, and before any report hands `src` or `dst` back to the caller.
            #[allow(unsafe_code)]
            let r = unsafe { mem.copy_block(src, dst) };
            if let Err(e) = r {
                warn!(error = %log::Peer(&e), "local copy failed");
            }
        }
    }

    fn report(&self, i: usize, outcome: ChildOutcome, path: Option<Path>) {
        let c = &self.inner.counters;
        let id = self.children[i].remote_request_id();
        if let ChildOutcome::Failed { error: PullError::Integrity { .. }, .. }
        | ChildOutcome::FailedBlocksHeld { error: PullError::Integrity { .. }, .. } = &outcome
        {
            // A sibling failing for this read is `SiblingFailed`: each failed read counts once.
            add(&c.integrity_failures, 1);
            if path == Some(Path::Tcp) {
                add(&c.integrity_failures_tcp, 1);
            }
            #[cfg(feature = "ucx")]
            if path == Some(Path::Ucx) {
                add(&c.integrity_failures_ucx, 1);
            }
        }
        let _ = path;
        #[cfg(feature = "cluster")]
        if let Some(m) = self.inner.cluster.as_ref().and_then(crate::cluster::DecodeCluster::metrics) {
            let kind = match &outcome {
                ChildOutcome::Done { .. } => crate::cluster::ChildPullOutcome::Done,
                ChildOutcome::Cancelled { .. } => crate::cluster::ChildPullOutcome::Cancelled,
                ChildOutcome::Failed { error, .. } | ChildOutcome::FailedBlocksHeld { error, .. } => {
                    m.count_child_failure(error.kind());
                    crate::cluster::ChildPullOutcome::Failed
                }
            };
            m.observe_child_pull(kind, self.started.elapsed());
        }
        c.count_report(id, &outcome);
        // The handle may have been dropped: the pull still completes and releases leases.
        let _ = self.channels.reports.send(ChildReport {
            child_index: self.children[i].child_index(),
            remote_request_id: id.to_owned(),
            outcome,
            completed_at: std::time::Instant::now(),
            path: path.and(self.data_path.get().cloned()),
        });
    }

    /// Counts the pull's bytes, releases its destination blocks (except those held by a
    /// read that could not be stopped: released when it completes) and returns the totals.
    fn finish(&self, summary: PullSummary, path: Option<Path>) -> Totals {
        add(&self.inner.counters.bytes_pulled, summary.wire_bytes);
        if path == Some(Path::Tcp) {
            add(&self.inner.counters.bytes_pulled_tcp, summary.wire_bytes);
        }
        #[cfg(feature = "ucx")]
        if path == Some(Path::Ucx) {
            add(&self.inner.counters.bytes_pulled_ucx, summary.wire_bytes);
        }
        let _ = path;
        #[cfg(feature = "cluster")]
        if let Some(m) = self.inner.cluster.as_ref().and_then(crate::cluster::DecodeCluster::metrics) {
            m.observe_pull(self.started.elapsed());
        }
        let held: HashSet<BlockId> = summary.held_blocks.iter().copied().collect();
        {
            let mut busy = self.inner.busy.lock().unwrap_or_else(|p| p.into_inner());
            for b in self.claimed.iter().filter(|b| !held.contains(b)) {
                busy.remove(b);
            }
        }
        if !held.is_empty() {
            warn!(
                blocks = held.len(),
                "destination blocks stay held until the read that could not be stopped completes"
            );
            #[cfg(feature = "ucx")]
            {
                let reclaimed = super::report::Reclaimed {
                    parent_request_id: self.children[0].parent_request_id().to_owned(),
                    children: summary.held_children.iter().map(|&i| self.children[i].child_index()).collect(),
                    local_blocks: summary.held_blocks.clone(),
                };
                self.held.finish(held, reclaimed);
            }
        }
        debug!(
            children = self.children.len(),
            wire_bytes = summary.wire_bytes,
            delivered = summary.delivered_bytes,
            "pull finished"
        );
        (summary.wire_bytes, summary.delivered_bytes, self.started.elapsed())
    }

    /// Runs `op` on the peer's control connection ([`Peer::exchange`]: retried, bounded)
    /// unless the peer was found unreachable (`None`; this pull's later exchanges are then
    /// skipped).
    async fn control(&self, peer: &Peer, op: ControlOp) -> Option<(Result<ControlReply, ClientError>, u32)> {
        peer.exchange(&self.inner, &op, &self.reachable).await
    }

    async fn heartbeat(&self, peer: &Peer, leases: Vec<usize>) -> Event {
        let refs: Vec<v1::LeaseRef> = leases
            .iter()
            .map(|&i| v1::LeaseRef {
                remote_request_id: self.children[i].remote_request_id().to_owned(),
                lease_token: self.children[i].token().as_bytes().to_vec(),
            })
            .collect();
        match self.control(peer, ControlOp::Heartbeat(refs)).await {
            None => Event::Heartbeat(false),
            Some((Ok(ControlReply::Heartbeat(outcomes)), _)) => {
                for (&i, o) in leases.iter().zip(outcomes) {
                    if o != LeaseOutcome::Extended {
                        debug!(remote_request_id = %log::Peer(&self.children[i].remote_request_id()), outcome = ?o, "heartbeat not extended");
                    }
                }
                Event::Heartbeat(true)
            }
            Some((r, _)) => {
                debug!(result = ?r, "heartbeat failed");
                Event::Heartbeat(true)
            }
        }
    }

    async fn notify(&self, peer: &Peer, i: usize) -> Event {
        let child = &self.children[i];
        let id = child.remote_request_id().to_owned();
        let token = child.token().as_bytes().to_vec();
        let consumer = self.inner.consumer_id.clone();
        let r = self.control(peer, ControlOp::Notify { id, token, consumer }).await;
        let answer = match &r {
            None => ControlAnswer::Unreachable,
            Some((reply, attempts)) => {
                let earlier = u32::from(self.notify_answer_lost[i].load(Ordering::Relaxed));
                notify_answer(reply, attempts + earlier)
            }
        };
        if answer != ControlAnswer::Acknowledged {
            warn!(remote_request_id = %log::Peer(&child.remote_request_id()), result = %log::Peer(format_args!("{r:?}")), "notification not acknowledged");
        }
        Event::Control(i, answer)
    }

    /// Takes the cancels already queued before an I/O event is fed to `machine`: they were
    /// asked for before the event was seen, so they count first (select! picks among ready
    /// branches at random, so a cancel sent before a read's answer came back could otherwise
    /// lose to it and the child end pulled).
    fn take_queued_cancels(
        &self,
        machine: &mut PullMachine,
        cancels: &mut tokio::sync::mpsc::UnboundedReceiver<u32>,
        open: &mut bool,
    ) {
        while *open {
            match cancels.try_recv() {
                Ok(index) => self.cancel_child(machine, index),
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => *open = false,
            }
        }
    }

    /// Cancels the child with index `index` in `machine` (one this pull does not hold is
    /// ignored).
    fn cancel_child(&self, machine: &mut PullMachine, index: u32) {
        if let Some(i) = self.children.iter().position(|c| c.child_index() == index) {
            machine.cancel(i, Instant::now());
        }
    }

    async fn cancel_lease(&self, peer: &Peer, i: usize) -> Event {
        let child = &self.children[i];
        let id = child.remote_request_id().to_owned();
        let token = child.token().as_bytes().to_vec();
        let r = self.control(peer, ControlOp::Cancel { id, token }).await;
        let answer = match &r {
            None => {
                info!(remote_request_id = %log::Peer(&child.remote_request_id()), "peer unreachable: lease left to expire");
                ControlAnswer::Unreachable
            }
            // ALREADY_RELEASED: an earlier attempt (whose answer was lost) released it.
            Some((Ok(ControlReply::Cancel(LeaseOutcome::Released | LeaseOutcome::AlreadyReleased)), _)) => {
                info!(remote_request_id = %log::Peer(&child.remote_request_id()), "lease released");
                ControlAnswer::Acknowledged
            }
            Some(r) => {
                info!(remote_request_id = %log::Peer(&child.remote_request_id()), result = %log::Peer(format_args!("{r:?}")), "cancel sent");
                ControlAnswer::NotAcknowledged
            }
        };
        Event::Control(i, answer)
    }
}

/// What a notify's reply after `attempts` attempts says.
fn notify_answer(reply: &Result<ControlReply, ClientError>, attempts: u32) -> ControlAnswer {
    match reply {
        Ok(ControlReply::Notify(ack)) => match LeaseOutcome::try_from(ack.outcome) {
            // ALREADY_PULLED: an earlier attempt (whose answer was lost) ended the lease.
            Ok(LeaseOutcome::Pulled | LeaseOutcome::Counted | LeaseOutcome::AlreadyPulled) => {
                ControlAnswer::Acknowledged
            }
            // Our consumer id was counted by an earlier attempt of this notify.
            Ok(LeaseOutcome::Duplicate) if attempts > 1 => ControlAnswer::Acknowledged,
            _ => ControlAnswer::NotAcknowledged,
        },
        _ => ControlAnswer::NotAcknowledged,
    }
}

/// Whether a read failed because its connection closed or broke before the answer: the
/// peer's idle close racing a request on a pooled connection looks like this.
fn closed_before_answer(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Frame { source: kvxfer_tcp::FrameError::Closed | kvxfer_tcp::FrameError::Io(_), .. }
    )
}

/// Sleeps until `t` (for ever when `None`; the branch is disabled then).
async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}
