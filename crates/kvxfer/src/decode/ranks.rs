//! Pulls from a prefill engine of another tensor-parallel size or block size
//! ([`DecodeAgent::submit_ranks`]): the core's [`TransferPair`] plans, per child, which
//! prefill ranks this decode rank reads (and which heads of their blocks) and which it only
//! notifies; the reads ask for head slices (`ReadRequest.head_slice`) and scatter every
//! slice straight into place in the local blocks (token slot by token slot at a block ratio
//! above 1).
//!
//! How a result names several ranks: every prefill rank is its own agent and leases its
//! own blocks, so each returns its own [`PrefillResult`] (same parent and children; its own
//! lease ids, tokens and address). The decode rank is given all of them, in prefill rank
//! order (`results[r]` from rank `r`; the hand-offs' `tp_size` says how many), and uses the
//! ones its plan names. Each prefill rank leases with [`kvxfer_core::expected_consumers`]
//! consumers, so a lease ends once every decode rank that reads or notifies it has.
//!
//! Over TCP each source and group is one read whose payload scatters into place; over UCX
//! one pin (a read guard, with the CRC of the slices when payloads are verified) and one
//! get per contiguous copy, merged where contiguous on both sides. Its decisions are simple
//! enough to live here: every child's
//! reads run concurrently; a child whose reads all succeeded notifies every rank of its
//! plan; one with a failed read releases every rank's lease (one whose local lists do not
//! fit the block ratio fails as the caller's error and leaves the shared leases alone).
//! Reading children's leases are heartbeated on every source rank (as `submit` does); a
//! child cancelled through the handle stops its TCP reads and releases every source rank's
//! lease (a UCX get cannot be stopped: that child finishes and reports what became of it).
//! Reads, notifies, cancels and heartbeats are futures polled side by side, so a frozen rank
//! holds up only its own exchanges; each rank has one reachable flag for the whole pull.
//! Siblings' shared blocks are not deduplicated.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use kvxfer_core::log;
use kvxfer_core::plan::BlockRange;
use kvxfer_core::pull::{ChildOutcome, PullError};
use kvxfer_core::xfer::{Piece, RankPlan};
use kvxfer_core::{BlockId, ChildHandoff, KvShape, KvShapeSpec, PrefillResult, RankPlanError, TransferPair};
use kvxfer_mem::{Chunk, KvMemory};
use kvxfer_proto::v1::LeaseOutcome;
use kvxfer_tcp::SliceSpec;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::groups::GroupIds;
use super::peer::{pull_error, read_error, ControlOp, ControlReply};
use super::pull::Path;
use super::report::{add, ChildReport, PullChannels, PullHandle};
use super::shared::{Inner, Peer};
use super::DecodeAgent;
use crate::{Error, SubmitError};

impl DecodeAgent {
    /// Pulls every child of a prefill engine whose tensor-parallel size or block size may
    /// differ from this one's: `results[r]` is prefill rank `r`'s result (every rank, in
    /// rank order), `local_blocks[i][g]` child `i`'s local blocks of KV-cache group `g` —
    /// `ceil(remote / block_ratio)` of them per group. Needs this agent's
    /// [`AgentConfig::kv_shape`](crate::AgentConfig::kv_shape); the prefill ranks' shapes come
    /// from their handshakes. Refused before any I/O when the results do not fit together
    /// or a local block is busy. Block ids in the reports are flat ids (as in
    /// [`Self::submit_groups`]).
    pub fn submit_ranks(
        &self,
        results: Vec<PrefillResult>,
        local_blocks: Vec<Vec<Vec<BlockId>>>,
    ) -> Result<PullHandle, Error> {
        let Some(first) = results.first() else {
            return Err(SubmitError::Unfit { parent: String::new(), detail: "no results".into() }.into());
        };
        let parent = first.parent_request_id().to_owned();
        let bad = |detail: String| Error::from(SubmitError::Unfit { parent: parent.clone(), detail });
        if self.is_closed() {
            return Err(SubmitError::ShuttingDown { parent }.into());
        }
        if self.inner.shape.is_none() {
            return Err(bad("this agent has no KV-cache shape (AgentConfig::kv_shape)".into()));
        }
        let n = first.n();
        let tp = first.children()[0].engine().tp_size;
        if results.len() != tp as usize {
            return Err(bad(format!("{} results given, the prefill engine has tp_size {tp}", results.len())));
        }
        let decode_tp = self.inner.shape.as_ref().map_or(1, KvShape::tp_size);
        let consumers = kvxfer_core::expected_consumers(tp, decode_tp).map_err(|e| bad(e.to_string()))?;
        let engine_id = &first.children()[0].engine().engine_id;
        for (r, res) in results.iter().enumerate() {
            if res.parent_request_id() != parent || res.n() != n {
                return Err(bad(format!("result {r} is of another parent or n")));
            }
            if res.children().iter().any(|c| c.engine().tp_size != tp) {
                return Err(bad(format!("result {r} states another tp_size")));
            }
            // One prefill engine: every rank states its id; each rank's result is one agent
            // (its address and incarnation), which `connect` reaches through child 0's.
            let engine = res.children()[0].engine();
            if engine.engine_id != *engine_id {
                return Err(bad(format!(
                    "result {r} is of engine {}, result 0 of engine {engine_id}",
                    engine.engine_id
                )));
            }
            if res.children().iter().any(|c| c.engine() != engine) {
                return Err(bad(format!("result {r}'s children name different agents")));
            }
            // A lease ends after its expected consumers: too few and a sibling decode rank
            // finds it ended, too many and it never ends pulled.
            if let Some(c) = res.children().iter().find(|c| c.expected_consumers() != consumers) {
                return Err(bad(format!(
                    "result {r}, child {}: leased for {} consumer(s), prefill TP {tp} to decode TP \
                     {decode_tp} needs {consumers}",
                    c.child_index(),
                    c.expected_consumers()
                )));
            }
        }
        if let Some(c) = results.iter().flat_map(|r| r.children()).find(|c| !c.engine().names_address()) {
            if !self.inner.resolves_engine_ids() {
                return Err(SubmitError::NoAddress { parent, engine: c.engine().engine_id.clone() }.into());
            }
        }
        if local_blocks.len() != n as usize {
            return Err(SubmitError::LocalBlockLists { parent, n, given: local_blocks.len() }.into());
        }
        let memory = &self.inner.memory;
        let groups = memory.num_groups();
        for (i, l) in local_blocks.iter().enumerate() {
            let c = &first.children()[i];
            if c.num_groups() != groups || l.len() != groups {
                let (child, handoff, given) = (c.child_index(), c.num_groups(), l.len());
                return Err(SubmitError::GroupCount { parent, child, handoff, given, local: groups }.into());
            }
        }
        let refs: Vec<&ChildHandoff> = first.children().iter().collect();
        let ids = GroupIds::new(memory, &refs).ok_or_else(|| bad("too many blocks for block ids".into()))?;
        // Claim the destination blocks (flat ids): no other pull, and no two children of
        // this one, write the same local block.
        let mut claimed: HashSet<BlockId> = HashSet::new();
        for (i, l) in local_blocks.iter().enumerate() {
            for (g, list) in l.iter().enumerate() {
                let num_blocks = memory.group(g).map_or(0, |m| m.layout().num_blocks());
                // ceil(remote / k) for a block ratio k >= 1: at most as many as the remote
                // blocks, and none only for none (the exact count needs the prefill rank's
                // block size, known after the handshake).
                let remote = first.children()[i].group_block_ids(g).map_or(0, <[BlockId]>::len);
                if list.len() > remote || (list.is_empty() != (remote == 0)) {
                    return Err(bad(format!(
                        "child {i}, group {g}: {} local block(s) for {remote} remote block(s)",
                        list.len()
                    )));
                }
                if let Some(&b) = list.iter().find(|&&b| b >= num_blocks) {
                    return Err(bad(format!(
                        "local block {b} of group {g} is outside its {num_blocks} blocks"
                    )));
                }
                for b in ids.local_flat(g, list) {
                    if !claimed.insert(b) {
                        return Err(bad(format!("local block {b} (flat) is listed twice")));
                    }
                }
            }
        }
        {
            let mut busy = self.inner.busy.lock().unwrap_or_else(|p| p.into_inner());
            let taken: Vec<BlockId> = claimed.iter().copied().filter(|b| busy.contains(b)).take(16).collect();
            if !taken.is_empty() {
                return Err(SubmitError::LocalBlocksBusy { parent, blocks: taken }.into());
            }
            busy.extend(claimed.iter().copied());
        }
        // What the handle reports for a child if the pull task vanishes with its runtime.
        let expected = first
            .children()
            .iter()
            .zip(&local_blocks)
            .map(|(c, l)| {
                let flat = l.iter().enumerate().flat_map(|(g, list)| ids.local_flat(g, list)).collect();
                (c.child_index(), c.remote_request_id().to_owned(), flat)
            })
            .collect();
        let (handle, channels) = PullHandle::new(parent.clone(), expected);
        let pull = RankPull {
            #[cfg(feature = "ucx")]
            held: Arc::new(crate::ucx::HeldReads::new(
                self.inner.busy.clone(),
                self.inner.reclaimed_tx.clone(),
            )),
            abandoned: std::sync::Mutex::new(HashSet::new()),
            reachable: (0..results.len()).map(|_| AtomicBool::new(true)).collect(),
            data_path: std::sync::OnceLock::new(),
            inner: self.inner.clone(),
            results,
            local: local_blocks,
            ids,
            claimed,
        };
        let closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        if *closed {
            // The shutdown began after the check above: hand the blocks back, pull nothing.
            let mut busy = self.inner.busy.lock().unwrap_or_else(|p| p.into_inner());
            for b in &pull.claimed {
                busy.remove(b);
            }
            return Err(SubmitError::ShuttingDown { parent }.into());
        }
        self.tasks.spawn_on(pull.run(channels, Instant::now()), &self.handle);
        drop(closed);
        add(&self.inner.counters.pulls, 1);
        Ok(handle)
    }
}

/// One pull from several prefill ranks under way.
struct RankPull {
    inner: Arc<Inner>,
    results: Vec<PrefillResult>,
    local: Vec<Vec<Vec<BlockId>>>,
    ids: GroupIds,
    claimed: HashSet<BlockId>,
    /// One-sided reads UCX could not stop, and the blocks they hold.
    #[cfg(feature = "ucx")]
    held: Arc<crate::ucx::HeldReads>,
    /// Children with such a read: their blocks stay held until it completes.
    abandoned: std::sync::Mutex<HashSet<usize>>,
    /// Per prefill rank: cleared once it proved unreachable in this pull (its later control
    /// exchanges are skipped).
    reachable: Vec<AtomicBool>,
    /// The data path to the first source rank, for the children's reports.
    data_path: std::sync::OnceLock<super::report::DataPath>,
}

/// A source rank: its rank, its peer, and the data path to it.
type Source = (u32, Arc<Peer>, Path);

/// What one of a pull's futures ended with.
enum Step {
    /// Child `i`'s reads ended: the plan and bytes, or why not (`None`: cancelled).
    Read(usize, Result<(RankPlan, u64), Option<PullError>>),
    /// Child `i`'s leases were told: its outcome, to report.
    Told(usize, ChildOutcome),
    /// A heartbeat of this source rank was answered (or given up).
    Beat(u32),
}

/// A future of a pull's [`Step`]s.
type StepFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Step> + Send + 'a>>;

/// The source ranks of a decode rank, from the TP sizes alone (what
/// [`TransferPair::source_ranks`] says, known before any shape arrives).
fn source_ranks(prefill_tp: u32, decode: &KvShape) -> std::ops::Range<u32> {
    let (d, rank) = (decode.tp_size(), decode.tp_rank());
    if d >= prefill_tp {
        let first = rank / (d / prefill_tp).max(1);
        first..first + 1
    } else {
        let r = prefill_tp / d;
        rank * r..(rank + 1) * r
    }
}

impl RankPull {
    fn child(&self, rank: u32, i: usize) -> &ChildHandoff {
        &self.results[rank as usize].children()[i]
    }

    /// Handshakes with every source rank and checks its shape: the pair to plan with and
    /// each rank's peer, or why none can be made.
    async fn connect(&self, decode: &KvShape) -> Result<(TransferPair, Vec<Source>), PullError> {
        let tp = self.results.len() as u32;
        kvxfer_core::expected_consumers(tp, decode.tp_size())
            .map_err(|e| PullError::Protocol { peer: String::new(), detail: e.to_string() })?;
        let mut pair: Option<(TransferPair, KvShapeSpec)> = None;
        let mut peers = Vec::new();
        for rank in source_ranks(tp, decode) {
            let engine = self.child(rank, 0).engine();
            let addr = self.inner.resolve_rank(engine, rank)?;
            let peer = self.inner.peer(&addr);
            // A rank whose handshake fails (or that is another process now) is not told
            // to release its leases afterwards.
            let unreachable = |e: PullError| {
                self.reachable[rank as usize].store(false, Ordering::Relaxed);
                e
            };
            let ack = peer.hello(&self.inner).await.map_err(|e| unreachable(pull_error(&e, &self.inner)))?;
            let protocol = |detail: String| PullError::Protocol { peer: addr.clone(), detail };
            if ack.engine_id != engine.engine_id
                || (engine.incarnation != 0 && ack.incarnation != engine.incarnation)
            {
                return Err(unreachable(PullError::PeerRestarted {
                    peer: addr.clone(),
                    expected_engine: engine.engine_id.clone(),
                    expected_incarnation: engine.incarnation,
                    found_engine: ack.engine_id.clone(),
                    found_incarnation: ack.incarnation,
                }));
            }
            let wire = ack
                .kv_shape
                .as_ref()
                .ok_or_else(|| protocol("the prefill rank states no KV-cache shape".into()))?;
            let spec = KvShapeSpec::from_wire(wire);
            let shape = KvShape::new(spec.clone()).map_err(|e| protocol(e.to_string()))?;
            if shape.tp_rank() != rank || shape.tp_size() != tp {
                return Err(protocol(format!(
                    "result {rank} came from rank {} of {} (give the results in prefill rank order)",
                    shape.tp_rank(),
                    shape.tp_size()
                )));
            }
            match &pair {
                None => {
                    let p = TransferPair::new(&shape, decode).map_err(|e| protocol(e.to_string()))?;
                    pair = Some((p, spec));
                }
                // The plan (and, over UCX, every rank's strides) is made from the first
                // source rank's shape: every other rank's must be the same but for its rank.
                Some((_, first)) => {
                    if (KvShapeSpec { tp_rank: first.tp_rank, ..spec }) != *first {
                        return Err(protocol(format!(
                            "prefill rank {rank}'s KV-cache shape differs from rank {}'s in more than \
                             its tp_rank",
                            first.tp_rank
                        )));
                    }
                }
            }
            let data_path = super::pull::choose_path(&self.inner, &peer, &ack).await?;
            let path = Path::of(&data_path);
            if peers.is_empty() {
                let _ = self.data_path.set(data_path);
            }
            peers.push((rank, peer, path));
        }
        let (pair, _) =
            pair.ok_or_else(|| PullError::Protocol { peer: String::new(), detail: "no source rank".into() })?;
        Ok((pair, peers))
    }

    /// Child `i`'s plan: its groups' remote lists (the same on every source rank) and local
    /// lists. Local lists of the wrong length are the caller's error
    /// ([`PullError::LocalBlocks`]).
    fn plan(&self, pair: &TransferPair, peers: &[Source], i: usize) -> Result<RankPlan, PullError> {
        let (rank0, peer0, _) = &peers[0];
        let remote = self.child(*rank0, i);
        for (rank, peer, _) in &peers[1..] {
            if !self.child(*rank, i).groups().eq(remote.groups()) {
                return Err(PullError::Protocol {
                    peer: peer.addr.clone(),
                    detail: format!("child {i}: prefill ranks {rank0} and {rank} list different blocks"),
                });
            }
        }
        let lists: Vec<(&[BlockId], &[BlockId])> =
            remote.groups().zip(&self.local[i]).map(|(r, l)| (r, l.as_slice())).collect();
        pair.plan(&lists).map_err(|e| match e {
            RankPlanError::BlockCount { .. } => PullError::LocalBlocks {
                detail: format!("child {i}: {e} (block ratio {})", pair.block_ratio()),
            },
            e => PullError::Protocol { peer: peer0.addr.clone(), detail: e.to_string() },
        })
    }

    /// Reads everything `plan` takes from source `rank` for child `i`: one head-slice read
    /// per group, scattered into place. Returns the payload bytes.
    async fn read_source(
        &self,
        (rank, peer, path): (u32, &Peer, Path),
        pair: &TransferPair,
        plan: &RankPlan,
        i: usize,
    ) -> Result<u64, PullError> {
        let Some(read) = plan.reads().iter().find(|r| r.source_rank() == rank) else { return Ok(0) };
        let child = self.child(rank, i);
        let prefill = pair.prefill();
        let rank_first = prefill.heads_of_rank(rank).map_or(0, |h| h.first);
        let heads = read.heads();
        // The whole of the rank's heads: plain block reads (as between equal ranks).
        let slice =
            (heads.count != prefill.heads_per_rank()).then_some((heads.first - rank_first, heads.count));
        let mut total = 0;
        for (g, runs) in plan.runs().iter().enumerate() {
            if runs.is_empty() {
                continue;
            }
            let Some(dest) = self.inner.memory.group(g) else { continue };
            let ranges: Vec<BlockRange> =
                runs.iter().map(|r| BlockRange { start: r.remote_start, count: r.count }).collect();
            let chunks = chunks(dest, plan.pieces().filter(|p| p.source_rank == rank && p.group == g));
            let id = child.remote_request_id();
            #[cfg(feature = "ucx")]
            if path == Path::Ucx {
                let what = (rank, g as u32, slice);
                total += self.read_source_ucx((peer, child, i), pair, plan, what, dest, chunks).await?;
                continue;
            }
            let _ = path;
            let (_permit, mut conn, _) = peer.checkout(&self.inner).await?;
            // SAFETY: the chunks lie in local blocks this pull claimed in `submit_ranks` (no
            // other pull writes them; the caller does not touch them until their report,
            // sent only after this read ended), checked against their group's layout there
            // and by the plan; the plan writes every destination byte once, so no two
            // chunks overlap (the property tests of kvxfer-core's xfer model).
            #[allow(unsafe_code)]
            let r = unsafe {
                conn.read_scatter(
                    id,
                    child.token().as_bytes(),
                    SliceSpec { group: g as u32, head_slice: slice, ranges: &ranges },
                    dest,
                    &chunks,
                )
            }
            .await;
            peer.checkin(conn, &r);
            debug!(remote_request_id = %log::Peer(&id), rank, group = g, result = ?r, "slice read");
            total += r.map_err(|e| read_error(&e, &self.inner, id))?;
        }
        Ok(total)
    }

    /// [`Self::read_source`]'s part for one group over UCX: a pin of the group's remote
    /// blocks (and, verifying, the CRC of the slices), one get per contiguous copy.
    #[cfg(feature = "ucx")]
    async fn read_source_ucx(
        &self,
        (peer, child, i): (&Peer, &ChildHandoff, usize),
        pair: &TransferPair,
        plan: &RankPlan,
        (rank, group, slice): (u32, u32, Option<(u32, u32)>),
        dest: &KvMemory,
        chunks: Vec<Chunk>,
    ) -> Result<u64, PullError> {
        use kvxfer_core::pull::ReadResult;
        let g = group as usize;
        let prefill = pair.prefill();
        let remote_strides: Vec<u64> = prefill.segments(g).iter().map(|s| s.stride()).collect();
        let region_base = crate::ucx::region_base(&self.inner.memory, g);
        let pieces = crate::ucx::slice_gets(
            dest,
            &remote_strides,
            region_base,
            plan.pieces().filter(|p| p.source_rank == rank && p.group == g),
        );
        let runs: Vec<kvxfer_core::plan::BlockRun> = plan.runs()[g]
            .iter()
            .map(|r| kvxfer_core::plan::BlockRun {
                remote_start: r.remote_start,
                local_start: r.local_start,
                count: r.count,
            })
            .collect();
        let bytes = chunks.iter().map(|c| c.len as u64).sum();
        let Some(layout) = prefill.block_layout(g) else {
            return Err(PullError::Protocol { peer: peer.addr.clone(), detail: format!("no group {g}") });
        };
        let gets = crate::ucx::SliceGets { head_slice: slice, pieces, chunks, bytes };
        let r = crate::ucx::read_child(
            &self.inner,
            peer,
            child,
            (group, dest, &runs),
            layout,
            Some(gets),
            (&self.held, i),
        );
        match r.await {
            ReadResult::Ok { bytes } => {
                add(&self.inner.counters.bytes_pulled_ucx, bytes);
                Ok(bytes)
            }
            ReadResult::Failed(e) => Err(e),
            ReadResult::Abandoned(e) => {
                self.abandoned.lock().unwrap_or_else(|p| p.into_inner()).insert(i);
                Err(e)
            }
            ReadResult::Aborted => Err(PullError::Shutdown),
        }
    }

    /// Resolves once the pull should stop waiting for control exchanges: the I/O timeout
    /// after the shutdown's abort (so a shutdown stays bounded whatever the peers do).
    async fn give_up(&self) {
        self.inner.abort.cancelled().await;
        tokio::time::sleep(self.inner.config.limits.io_timeout).await;
    }

    /// Runs `op` on `rank`'s control connection unless the rank was found unreachable in
    /// this pull (one flag per rank for the whole pull: an unreachable rank costs its
    /// timeouts once, not once per exchange). An exchange outlasting [`Self::give_up`]
    /// is cut short and marks the rank unreachable.
    async fn control(
        &self,
        peer: &Peer,
        rank: u32,
        op: &ControlOp,
    ) -> Option<(Result<ControlReply, kvxfer_tcp::ClientError>, u32)> {
        let reachable = &self.reachable[rank as usize];
        tokio::select! {
            answer = peer.exchange(&self.inner, op, reachable) => answer,
            () = self.give_up() => {
                reachable.store(false, Ordering::Relaxed);
                None
            }
        }
    }

    /// Heartbeats the leases of the `reading` children on `rank`.
    async fn heartbeat(&self, peer: &Peer, rank: u32, reading: Vec<usize>) -> Step {
        let refs = reading
            .iter()
            .map(|&i| {
                let c = self.child(rank, i);
                kvxfer_proto::v1::LeaseRef {
                    remote_request_id: c.remote_request_id().to_owned(),
                    lease_token: c.token().as_bytes().to_vec(),
                }
            })
            .collect();
        // No grace after the abort: a heartbeat then serves nobody.
        let op = ControlOp::Heartbeat(refs);
        let answer = tokio::select! {
            a = self.control(peer, rank, &op) => a,
            () = self.inner.abort.cancelled() => None,
        };
        match &answer {
            Some((Ok(ControlReply::Heartbeat(outcomes)), _)) => {
                for (&i, o) in reading.iter().zip(outcomes) {
                    if *o != LeaseOutcome::Extended {
                        debug!(remote_request_id = %log::Peer(&self.child(rank, i).remote_request_id()), rank, outcome = ?o, "heartbeat not extended");
                    }
                }
            }
            other => {
                debug!(rank, answer = ?other.as_ref().map(|(r, _)| r.as_ref().map(|_| ()).map_err(ToString::to_string)), "heartbeat failed")
            }
        }
        Step::Beat(rank)
    }

    /// Notifies (or, `release`, cancels) child `i`'s lease on `rank`: whether it was
    /// acknowledged.
    async fn tell(&self, peer: &Peer, rank: u32, i: usize, release: bool) -> bool {
        let child = self.child(rank, i);
        let (id, token) = (child.remote_request_id().to_owned(), child.token().as_bytes().to_vec());
        let op = if release {
            ControlOp::Cancel { id, token }
        } else {
            ControlOp::Notify { id, token, consumer: self.inner.consumer_id.clone() }
        };
        let answer = self.control(peer, rank, &op).await;
        let ok = match &answer {
            Some((Ok(ControlReply::Notify(ack)), attempts)) => match LeaseOutcome::try_from(ack.outcome) {
                Ok(LeaseOutcome::Pulled | LeaseOutcome::Counted | LeaseOutcome::AlreadyPulled) => true,
                // Our consumer id was counted by an earlier attempt of this notify.
                Ok(LeaseOutcome::Duplicate) => *attempts > 1,
                _ => false,
            },
            Some((Ok(ControlReply::Cancel(LeaseOutcome::Released | LeaseOutcome::AlreadyReleased)), _)) => {
                true
            }
            _ => false,
        };
        if !ok {
            warn!(remote_request_id = %log::Peer(&child.remote_request_id()), rank, release, answer = %log::Peer(format_args!("{answer:?}")), "lease not acknowledged");
        }
        ok
    }

    /// Tells every rank of `ranks` about child `i` at once (each rank's exchanges run on
    /// control connections of their own): whether all acknowledged.
    async fn tell_all(&self, ranks: Vec<(u32, &Peer)>, i: usize, release: bool) -> bool {
        let told = ranks.into_iter().map(|(rank, peer)| self.tell(peer, rank, i, release));
        futures::future::join_all(told).await.into_iter().all(|ok| ok)
    }

    async fn run(self, channels: PullChannels, started: Instant) {
        let PullChannels { reports, cancels, done } = channels;
        let n = self.local.len();
        let mut invalid: Vec<Vec<BlockId>> = Vec::with_capacity(n);
        for l in &self.local {
            invalid.push(l.iter().enumerate().flat_map(|(g, list)| self.ids.local_flat(g, list)).collect());
        }
        let decode = self.inner.shape.clone();
        let connected = match &decode {
            Some(d) => tokio::select! {
                r = self.connect(d) => r,
                () = self.inner.abort.cancelled() => Err(PullError::Shutdown),
            },
            None => Err(PullError::Protocol { peer: String::new(), detail: "no KV-cache shape".into() }),
        };
        let (mut wire, mut delivered) = (0u64, 0u64);
        match connected {
            Err(error) => {
                // Release this decode rank's source ranks' leases (the ones it would have
                // read or notified) where they can be reached: nobody reads them now.
                let tp = self.results.len() as u32;
                let sources = decode.as_ref().map_or(0..0, |d| source_ranks(tp, d));
                let mut peers: Vec<(u32, Arc<Peer>)> = Vec::new();
                for rank in sources.filter(|&r| r < tp) {
                    if let Ok(addr) = self.inner.resolve_rank(self.child(rank, 0).engine(), rank) {
                        peers.push((rank, self.inner.peer(&addr)));
                    }
                }
                let releases = (0..n).map(|i| {
                    let ranks = peers.iter().map(|(r, p)| (*r, &**p)).collect();
                    self.tell_all(ranks, i, true)
                });
                futures::future::join_all(releases).await;
                for (i, invalid) in invalid.iter().enumerate() {
                    self.report(
                        &reports,
                        i,
                        ChildOutcome::Failed { error: error.clone(), invalid_local_blocks: invalid.clone() },
                    );
                }
            }
            Ok((pair, peers)) => {
                let (w, d) = self.run_connected(&pair, &peers, &invalid, &reports, cancels).await;
                (wire, delivered) = (w, d);
            }
        }
        let c = &self.inner.counters;
        add(&c.bytes_pulled, wire);
        // Blocks of children whose UCX read could not be stopped stay held until it completes.
        let abandoned = std::mem::take(&mut *self.abandoned.lock().unwrap_or_else(|p| p.into_inner()));
        let held: HashSet<BlockId> = abandoned.iter().flat_map(|&i| invalid[i].iter().copied()).collect();
        {
            let mut busy = self.inner.busy.lock().unwrap_or_else(|p| p.into_inner());
            for b in self.claimed.iter().filter(|b| !held.contains(b)) {
                busy.remove(b);
            }
        }
        #[cfg(feature = "ucx")]
        if !held.is_empty() {
            let mut local_blocks: Vec<BlockId> = held.iter().copied().collect();
            local_blocks.sort_unstable();
            let reclaimed = super::report::Reclaimed {
                parent_request_id: self.results[0].parent_request_id().to_owned(),
                children: abandoned.iter().map(|&i| self.results[0].children()[i].child_index()).collect(),
                local_blocks,
            };
            self.held.finish(held, reclaimed);
        }
        let _ = done.send((wire, delivered, started.elapsed()));
    }

    /// The connected part of [`Self::run`]: every child's reads, the notifies or cancels of
    /// the children whose reads ended, and each source rank's heartbeats run side by side
    /// (a control exchange waiting on a frozen rank never holds up a read or another
    /// rank's exchange). Returns the bytes read and delivered.
    async fn run_connected(
        &self,
        pair: &TransferPair,
        peers: &[Source],
        invalid: &[Vec<BlockId>],
        reports: &tokio::sync::mpsc::UnboundedSender<ChildReport>,
        mut cancels: tokio::sync::mpsc::UnboundedReceiver<u32>,
    ) -> (u64, u64) {
        let n = self.local.len();
        let (mut wire, mut delivered) = (0u64, 0u64);
        // A UCX get cannot be cut short (its blocks would be handed back while UCX may
        // still write them): only all-TCP pulls stop at the shutdown's abort.
        let abortable = peers.iter().all(|(_, _, path)| *path == Path::Tcp);
        // Per child: cancelled through the handle (stops its TCP reads).
        let stops: Vec<CancellationToken> = (0..n).map(|_| CancellationToken::new()).collect();
        let stops = &stops;
        // The shutdown began while connecting: no read starts (every lease is released).
        let stopped = self.inner.stop.is_cancelled();
        let mut steps: FuturesUnordered<StepFuture<'_>> = FuturesUnordered::new();
        for (i, stop) in stops.iter().enumerate() {
            steps.push(Box::pin(async move {
                if stopped {
                    return Step::Read(i, Err(Some(PullError::Shutdown)));
                }
                let outcome = async {
                    let plan = self.plan(pair, peers, i)?;
                    let mut bytes = 0;
                    {
                        let plan = &plan;
                        let reads = peers
                            .iter()
                            .map(|(rank, peer, path)| self.read_source((*rank, peer, *path), pair, plan, i));
                        for r in futures::future::join_all(reads).await {
                            bytes += r?;
                        }
                    }
                    Ok::<_, PullError>((plan, bytes))
                };
                let abort = async {
                    if abortable {
                        self.inner.abort.cancelled().await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                };
                let cancel = async {
                    if abortable {
                        stop.cancelled().await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                };
                let r = tokio::select! {
                    r = outcome => r.map_err(Some),
                    () = abort => Err(Some(PullError::Shutdown)),
                    () = cancel => Err(None),
                };
                Step::Read(i, r)
            }));
        }
        // Heartbeats keep the reading children's leases alive, one exchange at a time per
        // source rank.
        let min_ttl = (0..n)
            .flat_map(|i| peers.iter().map(move |(rank, _, _)| self.child(*rank, i).ttl()))
            .min()
            .unwrap_or(std::time::Duration::from_secs(30));
        let every = super::heartbeat_interval(self.inner.config.heartbeat_interval, min_ttl);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let mut reading: HashSet<usize> = (0..n).collect();
        let mut beating: HashSet<u32> = HashSet::new();
        let mut cancels_open = true;
        loop {
            let step = tokio::select! {
                next = steps.next() => match next {
                    Some(step) => step,
                    None => break,
                },
                index = cancels.recv(), if cancels_open => {
                    match index.and_then(|x| self.results[0].children().iter().position(|c| c.child_index() == x)) {
                        // A UCX child cannot stop its get: it finishes and reports what
                        // became of it (a cancel lost to completion is Done).
                        Some(i) if reading.contains(&i) => stops[i].cancel(),
                        Some(_) => {}
                        None => cancels_open = index.is_some(),
                    }
                    continue;
                }
                _ = tick.tick(), if !reading.is_empty() => {
                    let mut leases: Vec<usize> = reading.iter().copied().collect();
                    leases.sort_unstable();
                    for (rank, peer, _) in peers {
                        if !self.reachable[*rank as usize].load(Ordering::Relaxed) || !beating.insert(*rank) {
                            continue;
                        }
                        steps.push(Box::pin(self.heartbeat(peer, *rank, leases.clone())));
                    }
                    continue;
                }
            };
            match step {
                Step::Beat(rank) => {
                    beating.remove(&rank);
                }
                Step::Read(i, r) => {
                    reading.remove(&i);
                    let all: Vec<(u32, &Peer)> = peers.iter().map(|(r, p, _)| (*r, &**p)).collect();
                    steps.push(match r {
                        Ok((plan, bytes)) => Box::pin(async move {
                            let notify = plan.notify_ranks();
                            let ranks = all.into_iter().filter(|(r, _)| notify.contains(r)).collect();
                            let acknowledged = self.tell_all(ranks, i, false).await;
                            Step::Told(i, ChildOutcome::Done { bytes_delivered: bytes, acknowledged })
                        }),
                        // The caller's lists do not fit: this rank reads nothing, and the
                        // leases stay for the other decode ranks that share them.
                        Err(Some(error @ PullError::LocalBlocks { .. })) => {
                            let outcome =
                                ChildOutcome::Failed { error, invalid_local_blocks: invalid[i].clone() };
                            Box::pin(async move { Step::Told(i, outcome) })
                        }
                        Err(None) => Box::pin(async move {
                            let released = self.tell_all(all, i, true).await;
                            let outcome = ChildOutcome::Cancelled {
                                released,
                                invalid_local_blocks: invalid[i].clone(),
                            };
                            Step::Told(i, outcome)
                        }),
                        Err(Some(error)) => Box::pin(async move {
                            self.tell_all(all, i, true).await;
                            let outcome =
                                if self.abandoned.lock().unwrap_or_else(|p| p.into_inner()).contains(&i) {
                                    ChildOutcome::FailedBlocksHeld {
                                        error,
                                        held_local_blocks: invalid[i].clone(),
                                    }
                                } else {
                                    ChildOutcome::Failed { error, invalid_local_blocks: invalid[i].clone() }
                                };
                            Step::Told(i, outcome)
                        }),
                    });
                }
                Step::Told(i, outcome) => {
                    if let ChildOutcome::Done { bytes_delivered, .. } = &outcome {
                        wire += bytes_delivered;
                        delivered += bytes_delivered;
                    }
                    self.report(reports, i, outcome);
                }
            }
        }
        (wire, delivered)
    }

    fn report(
        &self,
        reports: &tokio::sync::mpsc::UnboundedSender<ChildReport>,
        i: usize,
        outcome: ChildOutcome,
    ) {
        let child = &self.results[0].children()[i];
        // Cancelled children are counted too (they were not, before the count was shared).
        self.inner.counters.count_report(child.remote_request_id(), &outcome);
        #[cfg(feature = "cluster")]
        if let ChildOutcome::Failed { error, .. } | ChildOutcome::FailedBlocksHeld { error, .. } = &outcome {
            if let Some(m) = self.inner.cluster.as_ref().and_then(crate::cluster::DecodeCluster::metrics) {
                m.count_child_failure(error.kind());
            }
        }
        let _ = reports.send(ChildReport {
            child_index: child.child_index(),
            remote_request_id: child.remote_request_id().to_owned(),
            outcome,
            completed_at: std::time::Instant::now(),
            path: self.data_path.get().cloned(),
        });
    }
}

/// The local destinations of `pieces` (one group, one source, in plan order, which is the
/// order the server sends their bytes in: per run, per segment, per block, per slice), as
/// chunks of `dest`'s regions; neighbours adjacent in one region are merged.
fn chunks(dest: &KvMemory, pieces: impl Iterator<Item = Piece>) -> Vec<Chunk> {
    let segments = dest.layout().segments();
    let mut out: Vec<Chunk> = Vec::new();
    for p in pieces {
        let stride = segments[p.segment].stride;
        for t in 0..u64::from(p.blocks) {
            let c = Chunk {
                region: p.segment,
                offset: ((u64::from(p.local_block) + t) * stride + p.local_offset) as usize,
                len: p.len as usize,
            };
            match out.last_mut() {
                Some(last) if last.region == c.region && last.offset + last.len == c.offset => {
                    last.len += c.len
                }
                _ => out.push(c),
            }
        }
    }
    out
}
