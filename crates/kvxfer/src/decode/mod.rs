//! The decode agent: submits pulls of prefill results into its registered KV cache.
//!
//! - [`report`]: what a pull tells its caller (per-child reports, the pull's report).
//! - [`peer`]: pooled connections to prefill agents and typed connection errors.
//! - [`pull`]: the pull task, a thin driver of the core's [`kvxfer_core::pull::PullMachine`].

mod groups;
pub(crate) mod peer;
mod pull;
mod ranks;
pub(crate) mod report;
pub(crate) mod shared;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use kvxfer_core::log;
use kvxfer_core::plan::ResultPlan;
use kvxfer_core::pull::{PullChild, PullConfig, PullMachine};
use kvxfer_core::{BlockId, ChildHandoff, PrefillResult};
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1::{self, ErrorCode, LeaseOutcome};
use kvxfer_tcp::ClientError;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use peer::{ControlOp, ControlReply};
use report::{add, Counters};
pub use report::{ChildReport, DataPath, DecodeStats, PullCanceller, PullHandle, PullReport, Reclaimed};
use shared::Inner;

use crate::{AgentConfig, Error, SubmitError};

/// A decode worker's agent: pulls prefill results into its registered KV cache. Runs on
/// the tokio runtime it was started on (it starts no threads of its own except UCX's
/// progress thread); [`crate::blocking::DecodeAgent`] is the same agent with a runtime of
/// its own, for callers without one.
pub struct DecodeAgent {
    inner: Arc<Inner>,
    handle: Handle,
    tasks: TaskTracker,
    /// Set at shutdown; a pull is spawned under this lock, so none starts after the shutdown
    /// began waiting for the pulls.
    closed: std::sync::Mutex<bool>,
    reclaimed: Receiver<Reclaimed>,
}

impl std::fmt::Debug for DecodeAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeAgent").field("agent", &self.inner.config.agent_name).finish_non_exhaustive()
    }
}

impl DecodeAgent {
    /// Starts an agent that pulls into `memory`, on the current tokio runtime.
    ///
    /// # Panics
    /// Outside a tokio runtime (use [`Self::start_on`] or [`crate::blocking::DecodeAgent`]).
    pub async fn start(config: AgentConfig, memory: KvMemory) -> Result<Self, Error> {
        Self::start_on(Handle::current(), config, memory).await
    }

    /// Starts an agent that pulls into `memory`, on the runtime of `handle`.
    pub async fn start_on(handle: Handle, config: AgentConfig, memory: KvMemory) -> Result<Self, Error> {
        let config = config.for_memory(&memory)?;
        let memory = Arc::new(memory);
        #[cfg(feature = "ucx")]
        let ucx = {
            let m = memory.clone();
            crate::ucx::start_off_runtime(&handle, &config, move |u| crate::ucx::start_initiator(u, &m))
                .await?
        };
        Self::build(
            handle,
            config,
            memory,
            #[cfg(feature = "ucx")]
            ucx,
        )
    }

    /// Starts an agent on `handle` from a thread that may block (the blocking facade).
    pub(crate) fn start_blocking(
        handle: Handle,
        config: AgentConfig,
        memory: KvMemory,
    ) -> Result<Self, Error> {
        let config = config.for_memory(&memory)?;
        let memory = Arc::new(memory);
        #[cfg(feature = "ucx")]
        let ucx = crate::ucx::start_if_wanted(&config, |u| crate::ucx::start_initiator(u, &memory))?;
        Self::build(
            handle,
            config,
            memory,
            #[cfg(feature = "ucx")]
            ucx,
        )
    }

    fn build(
        handle: Handle,
        config: AgentConfig,
        memory: Arc<KvMemory>,
        #[cfg(feature = "ucx")] ucx: Option<kvxfer_ucx::UcxInitiator>,
    ) -> Result<Self, Error> {
        #[cfg_attr(not(feature = "ucx"), allow(unused_mut))]
        let mut transports = vec![crate::hello::tcp_offer()];
        #[cfg(feature = "ucx")]
        if ucx.is_some() {
            transports.insert(0, crate::hello::ucx_reader_offer());
        }
        let shape = config.checked_shape(&memory)?;
        let mut hello = crate::hello::hello(&config, &memory, transports);
        hello.kv_shape = shape.as_ref().map(|s| s.spec().to_wire());
        #[cfg(feature = "cluster")]
        let cluster = crate::cluster::DecodeCluster::start(
            &handle,
            &config,
            kvxfer_core::groups_compat_hash(memory.group_layouts()),
        )?;
        if config.cluster_key.is_none() {
            crate::hello::warn_unauthenticated("decode", &config.agent_name);
        }
        let (reclaimed_tx, reclaimed) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            consumer_id: config.effective_consumer_id(),
            config,
            memory,
            shape,
            #[cfg(feature = "ucx")]
            ucx: ucx.map(crate::runtime::DropOffRuntime::new),
            hello,
            peers: Mutex::new(HashMap::new()),
            refused_layouts: Mutex::new(HashSet::new()),
            busy: Arc::new(Mutex::new(HashSet::new())),
            reclaimed_tx,
            counters: Arc::new(Counters::default()),
            stop: CancellationToken::new(),
            abort: CancellationToken::new(),
            #[cfg(feature = "cluster")]
            cluster,
        });
        #[cfg(feature = "cluster")]
        if let Some(c) = &inner.cluster {
            let weak = Arc::downgrade(&inner);
            let peers: std::sync::Weak<dyn crate::cluster::DecodePeers> = weak;
            c.attach(&handle, &inner.counters, peers);
        }
        Ok(DecodeAgent {
            inner,
            handle,
            tasks: TaskTracker::new(),
            closed: std::sync::Mutex::new(false),
            reclaimed,
        })
    }

    /// Whether the agent started UCX (so it pulls over UCX from peers that offer it).
    pub fn has_ucx(&self) -> bool {
        #[cfg(feature = "ucx")]
        return self.inner.ucx().is_some();
        #[cfg(not(feature = "ucx"))]
        false
    }

    /// The registered KV cache pulls write into.
    pub fn memory(&self) -> &Arc<KvMemory> {
        &self.inner.memory
    }

    /// The consumer id this agent notifies with (`AgentConfig::consumer_id`, by default
    /// `"{engine_id}/{rank}"`).
    pub fn consumer_id(&self) -> &str {
        &self.inner.consumer_id
    }

    /// Blocks of [`kvxfer_core::pull::ChildOutcome::FailedBlocksHeld`] children, once the
    /// read that held them completed: only then may the caller reuse or free them. Fed from
    /// the transport's thread, also while the agent shuts down.
    pub fn reclaimed(&self) -> &Receiver<Reclaimed> {
        &self.reclaimed
    }

    /// Pulls every child of `result` into `local_blocks[i]` (one list per child, same
    /// length as the child's remote blocks). Refused before any I/O when the lists do not
    /// fit, the children span several engines, or a local block is already the
    /// destination of another pull. The pull runs as a task of the agent's runtime; the
    /// handle streams its reports.
    pub fn submit(
        &self,
        result: PrefillResult,
        local_blocks: Vec<Vec<BlockId>>,
    ) -> Result<PullHandle, Error> {
        if local_blocks.len() != result.n() as usize {
            let (parent, n, given) = (result.parent_request_id().to_owned(), result.n(), local_blocks.len());
            return Err(SubmitError::LocalBlockLists { parent, n, given }.into());
        }
        let selection = (0u32..).zip(local_blocks).collect();
        self.submit_subset(&result, selection)
    }

    /// Pulls only the children `(index, local blocks)` of a complete `result` — for parents
    /// whose children are spread over several decode workers. The other children are
    /// another worker's to pull or cancel; if nobody does, their leases expire (loudly).
    pub fn submit_subset(
        &self,
        result: &PrefillResult,
        selection: Vec<(u32, Vec<BlockId>)>,
    ) -> Result<PullHandle, Error> {
        self.submit_groups_subset(
            result,
            selection.into_iter().map(|(i, blocks)| (i, vec![blocks])).collect(),
        )
    }

    /// [`Self::submit`] for a cache of several KV-cache groups: `local_blocks[i][g]` are
    /// child `i`'s local blocks of group `g` (same length as the hand-off's group `g`).
    /// Every hand-off must list one block list per group of this agent's memory. Block ids
    /// in the reports (invalid or held blocks) are *flat* ids: group `g`'s block `b` is
    /// reported as `b` plus the blocks of the groups before `g`.
    pub fn submit_groups(
        &self,
        result: PrefillResult,
        local_blocks: Vec<Vec<Vec<BlockId>>>,
    ) -> Result<PullHandle, Error> {
        if local_blocks.len() != result.n() as usize {
            let (parent, n, given) = (result.parent_request_id().to_owned(), result.n(), local_blocks.len());
            return Err(SubmitError::LocalBlockLists { parent, n, given }.into());
        }
        let selection = (0u32..).zip(local_blocks).collect();
        self.submit_groups_subset(&result, selection)
    }

    /// [`Self::submit_subset`] for a cache of several KV-cache groups (see
    /// [`Self::submit_groups`]): `(index, local blocks per group)`.
    pub fn submit_groups_subset(
        &self,
        result: &PrefillResult,
        selection: Vec<(u32, Vec<Vec<BlockId>>)>,
    ) -> Result<PullHandle, Error> {
        let parent = result.parent_request_id().to_owned();
        if self.is_closed() {
            return Err(SubmitError::ShuttingDown { parent }.into());
        }
        let n = result.n();
        let mut seen = HashSet::new();
        let mut children = Vec::with_capacity(selection.len());
        let mut local = Vec::with_capacity(selection.len());
        for (index, blocks) in selection {
            let Some(child) = result.children().get(index as usize).filter(|_| seen.insert(index)) else {
                return Err(SubmitError::BadChild { parent, n, index }.into());
            };
            children.push(child.clone());
            local.push(blocks);
        }
        if children.is_empty() {
            return Err(SubmitError::NothingSelected { parent }.into());
        }
        if let Some(c) = children.iter().find(|c| !c.engine().names_address()) {
            if !self.inner.resolves_engine_ids() {
                return Err(SubmitError::NoAddress { parent, engine: c.engine().engine_id.clone() }.into());
            }
        }
        let engines: HashSet<(&str, String, u64)> = children
            .iter()
            .map(|c| (c.engine().engine_id.as_str(), c.engine().addr(), c.engine().incarnation))
            .collect();
        if engines.len() > 1 {
            let engines = engines
                .iter()
                .map(|(id, a, inc)| format!("{id}@{a} incarnation {}", log::Incarnation(*inc)))
                .collect();
            return Err(SubmitError::MixedEngines { parent, engines }.into());
        }
        // Every group's blocks in one flat id space per side (the identity for one group).
        let memory = &self.inner.memory;
        let groups = memory.num_groups();
        for (c, l) in children.iter().zip(&local) {
            if c.num_groups() != groups || l.len() != groups {
                let (child, handoff, given) = (c.child_index(), c.num_groups(), l.len());
                return Err(SubmitError::GroupCount { parent, child, handoff, given, local: groups }.into());
            }
        }
        let refs: Vec<&ChildHandoff> = children.iter().collect();
        let Some(ids) = groups::GroupIds::new(memory, &refs) else {
            let detail = "the KV-cache groups' blocks together do not fit block ids".into();
            return Err(SubmitError::Unfit { parent, detail }.into());
        };
        let plan_err = |source| Error::from(SubmitError::Plan { parent: parent.clone(), source });
        let mut flat_remote: Vec<Vec<BlockId>> = Vec::with_capacity(children.len());
        let mut flat_local: Vec<Vec<BlockId>> = Vec::with_capacity(children.len());
        for (c, l) in children.iter().zip(&local) {
            let (mut r, mut f) = (Vec::new(), Vec::new());
            for (g, l) in l.iter().enumerate() {
                let remote = c.group_block_ids(g).unwrap_or(&[]);
                let num_blocks = memory.group(g).map_or(0, |m| m.layout().num_blocks());
                // Checked per group: a flat id past its group would name another group's block.
                kvxfer_core::plan::coalesce(remote, l, u32::MAX, num_blocks).map_err(plan_err)?;
                r.extend(ids.remote_flat(g, remote));
                f.extend(ids.local_flat(g, l));
            }
            flat_remote.push(r);
            flat_local.push(f);
        }
        let local: Vec<Vec<BlockId>> = flat_local;
        let pairs: Vec<(&[BlockId], &[BlockId])> =
            flat_remote.iter().zip(&local).map(|(r, l)| (r.as_slice(), l.as_slice())).collect();
        let local_num = memory.group_layouts().map(|l| l.num_blocks()).fold(0u32, u32::saturating_add);
        // Device memory has no CPU copies: a block shared by siblings is read per local block.
        let plan = if memory.is_device() {
            ResultPlan::build_without_copies(&pairs, u32::MAX, local_num)
        } else {
            ResultPlan::build(&pairs, u32::MAX, local_num)
        }
        .map_err(plan_err)?;
        // Claim the destination blocks: no two pulls write the same local block.
        let claimed: HashSet<BlockId> = local.iter().flatten().copied().collect();
        {
            let mut busy = self.inner.busy.lock().unwrap_or_else(|p| p.into_inner());
            let taken: Vec<BlockId> = claimed.iter().copied().filter(|b| busy.contains(b)).take(16).collect();
            if !taken.is_empty() {
                return Err(SubmitError::LocalBlocksBusy { parent, blocks: taken }.into());
            }
            busy.extend(claimed.iter().copied());
        }
        let min_ttl = children.iter().map(|c| c.ttl()).min().unwrap_or(Duration::from_secs(30));
        let heartbeat_every = heartbeat_interval(self.inner.config.heartbeat_interval, min_ttl);
        let machine = PullMachine::new(
            plan,
            children
                .iter()
                .zip(&local)
                .map(|(c, l)| PullChild { child_index: c.child_index(), local_blocks: l.clone() })
                .collect(),
            PullConfig { heartbeat_every, block_bytes: memory.layout().block_bytes() },
        )
        .with_child_bytes(
            local
                .iter()
                .map(|l| {
                    l.iter()
                        .map(|&b| {
                            let (g, _) = ids.split_local(b);
                            memory.group(g).map_or(0, |m| m.layout().block_bytes())
                        })
                        .sum()
                })
                .collect(),
        );
        let expected = children
            .iter()
            .zip(&local)
            .map(|(c, l)| (c.child_index(), c.remote_request_id().to_owned(), l.clone()))
            .collect();
        let (handle, channels) = PullHandle::new(parent.clone(), expected);
        let closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        if *closed {
            // The shutdown began after the check above: hand the blocks back, pull nothing.
            let mut busy = self.inner.busy.lock().unwrap_or_else(|p| p.into_inner());
            for b in &claimed {
                busy.remove(b);
            }
            return Err(SubmitError::ShuttingDown { parent }.into());
        }
        let pull = pull::Pull::new(self.inner.clone(), children, ids, claimed, channels, Instant::now());
        self.tasks.spawn_on(pull.run(machine), &self.handle);
        drop(closed);
        add(&self.inner.counters.pulls, 1);
        Ok(handle)
    }

    /// Releases the lease of a child this agent will not pull — a request aborted while it
    /// still waited in the decode queue (vLLM aborts those), or a child of a result this
    /// worker takes only part of — without reading anything: a cancel goes over a control
    /// connection to the peer (retried on a fresh connection like a pull's, bounded by the io
    /// timeout), so the prefill side frees the blocks now rather than at the lease's expiry.
    /// A hand-off naming another incarnation than the one answering at its address (asked
    /// on a new connection before it counts) is not sent: its lease went with its process.
    ///
    /// Returns whether the prefill side released the lease (also when an earlier release had,
    /// and its answer was lost); false when the lease had been pulled or had expired, was
    /// unknown there (wrong token, or a restarted prefill process), or the peer could not be
    /// reached — then it ends by expiry, if it has not ended. Counted in
    /// `DecodeStats::leases_released` / `releases_refused`.
    ///
    /// Unlike [`PullHandle::cancel_child`], nothing races: the child is not being pulled. Do
    /// not release a child a pull of this agent is reading (its read then fails as a lease
    /// that ended); cancel it through its handle.
    pub async fn release(&self, child: &ChildHandoff) -> bool {
        // Resolved like a pull's: an engine-only hand-off through discovery, and nothing
        // sent to an incarnation discovery knows is gone (its leases went with it).
        let addr = match self.inner.resolve(child.engine()) {
            Ok(addr) => addr,
            Err(e) => return self.release_refused(child, &e),
        };
        let id = child.remote_request_id().to_owned();
        let op = ControlOp::Cancel { id, token: child.token().as_bytes().to_vec() };
        if self.inner.layouts_refused_at(&addr) {
            let answer = self.release_control_only(&addr, child, &op).await;
            return self.count_release(child, answer);
        }
        let peer = self.inner.peer(&addr);
        let want = child.engine();
        // A pooled connection may predate a restart (a crash sends no FIN): another
        // process answering is asked again on a new connection before it counts.
        let same =
            |ack: &v1::HelloAck| ack.engine_id == want.engine_id && ack.incarnation == want.incarnation;
        let ack = match peer.hello(&self.inner).await {
            Ok(ack) if want.incarnation != 0 && !same(&ack) => peer.fresh_hello(&self.inner).await,
            other => other,
        };
        let answer = match ack {
            Err(ClientError::Incompatible { code: ErrorCode::CompatMismatch, .. }) => {
                // This cache can never read the hand-off (block size, shapes): the lease is
                // given back on a connection that only cancels, whose layouts go unchecked
                // (and so are the next releases to this address).
                self.inner.remember_layouts_refused(&addr);
                self.release_control_only(&addr, child, &op).await
            }
            // A lease of another incarnation than the one answering at the address went
            // with that process: nothing is sent (the prefill side would hold the cancel of
            // a lease it does not know for its arm wait).
            Ok(ack) if want.incarnation != 0 && !same(&ack) => {
                return self.release_refused(child, &another_incarnation(&addr, &ack, want))
            }
            Err(e) if want.incarnation != 0 => return self.release_refused(child, &e),
            _ => peer.exchange(&self.inner, &op, &AtomicBool::new(true)).await.map(|(r, _)| r),
        };
        self.count_release(child, answer)
    }

    /// Counts and logs the answer to a release; whether the prefill side released the lease.
    fn count_release(&self, child: &ChildHandoff, answer: Option<Result<ControlReply, ClientError>>) -> bool {
        let released = matches!(
            answer,
            Some(Ok(ControlReply::Cancel(LeaseOutcome::Released | LeaseOutcome::AlreadyReleased)))
        );
        if released {
            add(&self.inner.counters.leases_released, 1);
            info!(remote_request_id = %log::Peer(&child.remote_request_id()), "lease released without pulling it");
        } else {
            add(&self.inner.counters.releases_refused, 1);
            info!(remote_request_id = %log::Peer(&child.remote_request_id()), answer = %log::Peer(format_args!("{answer:?}")), "release not applied");
        }
        released
    }

    /// [`DecodeAgent::release`] for a prefill agent whose layouts this one's cannot serve:
    /// `op` (a cancel) on a control-only connection of its own (never pooled), within the
    /// io timeout, to the incarnation the hand-off names. `None` when it could not be sent.
    async fn release_control_only(
        &self,
        addr: &str,
        child: &ChildHandoff,
        op: &ControlOp,
    ) -> Option<Result<ControlReply, ClientError>> {
        let want = child.engine();
        let io = self.inner.config.limits.io_timeout;
        let exchange = async {
            let mut conn = match self.inner.connect_control_only(addr).await {
                // Refused at a connection limit: the peer is there and busy; one retry after
                // a jittered pause, as a control exchange does.
                Err(ClientError::Busy { .. }) => {
                    let pause = std::time::Duration::from_millis(20 + rand::random::<u64>() % 80);
                    tokio::time::sleep(pause).await;
                    self.inner.connect_control_only(addr).await?
                }
                other => other?,
            };
            let ack = conn.peer_hello();
            if want.incarnation != 0
                && (ack.engine_id != want.engine_id || ack.incarnation != want.incarnation)
            {
                return Err(ClientError::Handshake {
                    peer: addr.to_owned(),
                    message: another_incarnation(addr, ack, want),
                });
            }
            op.run(&mut conn).await
        };
        // The connect and the cancel are each bounded by the io timeout.
        tokio::time::timeout(io.saturating_mul(2), exchange).await.ok()
    }

    /// Counts and logs a release that was not sent; false.
    fn release_refused(&self, child: &ChildHandoff, why: &dyn std::fmt::Display) -> bool {
        add(&self.inner.counters.releases_refused, 1);
        info!(remote_request_id = %log::Peer(&child.remote_request_id()), reason = %log::Peer(why), "release not applied");
        false
    }

    /// Parses a wire prefill result (refusing incomplete ones, naming the missing children)
    /// and submits it.
    pub fn submit_wire(
        &self,
        result: v1::PrefillResult,
        local_blocks: Vec<Vec<BlockId>>,
    ) -> Result<PullHandle, Error> {
        let result = PrefillResult::from_wire(result).map_err(SubmitError::from)?;
        self.submit(result, local_blocks)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DecodeStats {
        #[allow(unused_mut)]
        let mut stats = self.inner.counters.snapshot(self.inner.peer_count());
        #[cfg(feature = "ucx")]
        {
            stats.ucx_endpoints = self.inner.ucx().map_or(0, |u| u.open_endpoints() as u64);
        }
        stats
    }

    /// The engine directory pulls resolve through, when discovery is configured: its
    /// [`subscribe`](crate::cluster::EngineDirectory::subscribe) sees what the agent reacts to.
    #[cfg(feature = "cluster")]
    pub fn directory(&self) -> Option<&Arc<crate::cluster::EngineDirectory>> {
        self.inner.cluster.as_ref().and_then(crate::cluster::DecodeCluster::directory)
    }

    /// The address `/metrics` is served on, when configured.
    #[cfg(feature = "cluster")]
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.cluster.as_ref().and_then(crate::cluster::DecodeCluster::metrics_addr)
    }

    /// The metrics registry the agent feeds, when configured.
    #[cfg(feature = "cluster")]
    pub fn metrics(&self) -> Option<&Arc<crate::cluster::Metrics>> {
        self.inner.cluster.as_ref().and_then(crate::cluster::DecodeCluster::metrics)
    }

    /// Shuts the agent down gracefully: takes no new pulls, lets pulls under way read for up
    /// to `AgentConfig::shutdown_grace`, then aborts their reads; every child of every pull
    /// is reported (children not read fail with `PullError::Shutdown`) and every lease is
    /// notified or cancelled (bounded by the I/O timeout). Returns when every pull task has
    /// ended. Later calls return at once.
    pub async fn shutdown(&self) {
        self.begin_shutdown();
        let grace = self.inner.config.shutdown_grace;
        if tokio::time::timeout(grace, self.tasks.wait()).await.is_err() {
            self.inner.abort.cancel();
            self.tasks.wait().await;
        }
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.inner.cluster {
            c.stop().await;
        }
    }

    fn is_closed(&self) -> bool {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops taking pulls and tells the pulls under way to stop starting reads.
    fn begin_shutdown(&self) {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.tasks.close();
        self.inner.stop.cancel();
    }
}

/// The decode side never heartbeats a pull's leases more often than this, whatever the
/// hand-offs' ttls (a prefill peer, or a `kv_transfer_params` from a request body, may state
/// a ttl of 1 ms) or `AgentConfig::heartbeat_interval` say: a lease whose ttl is below about
/// twice this cannot be kept alive by heartbeats, and is not worth spinning for.
pub(crate) const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(100);

/// How often a pull heartbeats: the configured interval, else a sixth of the shortest ttl of
/// its hand-offs; never more often than [`MIN_HEARTBEAT_INTERVAL`].
fn heartbeat_interval(configured: Option<Duration>, min_ttl: Duration) -> Duration {
    configured.unwrap_or(min_ttl / 6).max(MIN_HEARTBEAT_INTERVAL)
}

impl DecodeAgent {
    /// Starts the shutdown without waiting: the bounded drain (grace, then aborted reads)
    /// runs as a task that keeps the agent's memory alive until its pulls ended.
    pub(crate) fn begin_shutdown_detached(&self) {
        if self.inner.abort.is_cancelled() || (self.tasks.is_closed() && self.tasks.is_empty()) {
            return;
        }
        self.begin_shutdown();
        let (tasks, inner) = (self.tasks.clone(), self.inner.clone());
        let grace = inner.config.shutdown_grace;
        // If the runtime is gone, its tasks (the pulls) were dropped with it.
        self.handle.spawn(async move {
            if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
                inner.abort.cancel();
            }
        });
    }
}

impl Drop for DecodeAgent {
    /// Never blocks: signals shutdown and leaves the bounded drain to a task.
    fn drop(&mut self) {
        self.begin_shutdown_detached();
    }
}

/// Why a release is not sent: another process answers at the hand-off's address.
fn another_incarnation(addr: &str, ack: &v1::HelloAck, want: &kvxfer_core::EngineInfo) -> String {
    format!(
        "{} is {} incarnation {} now, not {} incarnation {}: the lease ended with the process that made it",
        addr,
        log::Peer(&ack.engine_id),
        log::Incarnation(ack.incarnation),
        log::Peer(&want.engine_id),
        log::Incarnation(want.incarnation)
    )
}
