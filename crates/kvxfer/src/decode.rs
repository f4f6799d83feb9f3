//! The decode agent and its pull worker.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvxfer_core::plan::ResultPlan;
use kvxfer_core::{BlockId, BlockLayout, ChildHandoff, PrefillResult};
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1::{self, LeaseOutcome};
use kvxfer_tcp::{ClientError, Connection};
use tokio::runtime::Runtime;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, info, warn};

use crate::{AgentConfig, Error, SubmitError, TransportChoice};

/// The data path a pull uses with one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Tcp,
    #[cfg(feature = "ucx")]
    Ucx,
}

/// How one child's pull ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildOutcome {
    /// Every block is in place and the prefill side was notified.
    Done {
        /// Bytes written into this child's local blocks (wire or local copy).
        bytes_delivered: u64,
        /// Whether the prefill side counted the notification (false: its lease had already
        /// ended, e.g. expired, after the data was read under the lease).
        acknowledged: bool,
    },
    /// The pull failed; these local blocks hold no valid data and must be recomputed.
    Failed {
        /// Why.
        reason: String,
        /// The child's local blocks, now invalid.
        invalid_local_blocks: Vec<BlockId>,
    },
    /// The caller cancelled the child; its lease was released (if the cancel got through).
    Cancelled {
        /// Whether the prefill side released the lease on our cancel.
        released: bool,
        /// The child's local blocks, not valid.
        invalid_local_blocks: Vec<BlockId>,
    },
    /// The pull failed and a one-sided read into these blocks could not be stopped: the
    /// transport (UCX) may still write them. They hold no valid data and must be neither
    /// reused nor freed until [`DecodeAgent::reclaimed`] hands them back (when the read
    /// finally completes, or the agent shuts down after it did). If it never completes, they
    /// are never handed back.
    FailedBlocksHeld {
        /// Why.
        reason: String,
        /// The child's local blocks, held until reclaimed.
        held_local_blocks: Vec<BlockId>,
    },
}

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

/// One child's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildReport {
    /// The child index.
    pub child_index: u32,
    /// The prefill side's id for the child.
    pub remote_request_id: String,
    /// How it ended.
    pub outcome: ChildOutcome,
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
    /// Whether every child is done.
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
}

#[derive(Default)]
struct Counters {
    auth_failures: AtomicU64,
    control_retries: AtomicU64,
    children_blocks_held: AtomicU64,
    pulls: AtomicU64,
    children_done: AtomicU64,
    children_failed: AtomicU64,
    children_cancelled: AtomicU64,
    bytes_pulled: AtomicU64,
    bytes_delivered: AtomicU64,
    notifications_unacknowledged: AtomicU64,
    connections_opened: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A prefill agent this decode agent talks to: pooled data connections and one control
/// connection (notify / heartbeat / cancel never wait behind a large read).
struct Peer {
    addr: String,
    idle: Mutex<Vec<Connection>>,
    permits: Semaphore,
    control: tokio::sync::Mutex<Option<Connection>>,
    /// The engine id and incarnation our UCX endpoint to this address was made for (a
    /// restarted prefill at the same address gets a new endpoint).
    #[cfg(feature = "ucx")]
    ucx_engine: tokio::sync::Mutex<Option<(String, u64)>>,
}

struct Inner {
    config: AgentConfig,
    memory: Arc<KvMemory>,
    hello: v1::Hello,
    consumer_id: String,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    /// Destination blocks of pulls under way, and blocks held by reads UCX could not stop.
    busy: Arc<Mutex<HashSet<BlockId>>>,
    reclaimed_tx: Sender<Reclaimed>,
    reclaimed: Receiver<Reclaimed>,
    counters: Counters,
    #[cfg(feature = "ucx")]
    ucx: Option<kvxfer_ucx::UcxInitiator>,
}

/// A decode worker's agent: pulls prefill results into its registered KV cache.
pub struct DecodeAgent {
    inner: Arc<Inner>,
    runtime: Option<Runtime>,
}

impl std::fmt::Debug for DecodeAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeAgent").field("agent", &self.inner.config.agent_name).finish_non_exhaustive()
    }
}

/// A pull under way: receive its reports, or cancel children.
pub struct PullHandle {
    parent: String,
    count: usize,
    reports: Receiver<ChildReport>,
    cancel: Arc<watch::Sender<Vec<bool>>>,
    done: Receiver<(u64, u64, Duration)>,
}

impl std::fmt::Debug for PullHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullHandle")
            .field("parent", &self.parent)
            .field("children", &self.count)
            .finish_non_exhaustive()
    }
}

impl PullHandle {
    /// The decode side drops child `index`: its lease is released now (or as soon as reads
    /// that siblings need from it finish). Its local blocks are not written after its
    /// report arrives.
    pub fn cancel_child(&self, index: u32) {
        self.cancel.send_modify(|v| {
            if let Some(c) = v.get_mut(index as usize) {
                *c = true;
            }
        });
    }

    /// Children this pull covers.
    pub fn children(&self) -> usize {
        self.count
    }

    /// The next child report, as children finish.
    pub fn next_report(&self, timeout: Duration) -> Option<ChildReport> {
        self.reports.recv_timeout(timeout).ok()
    }

    /// Waits for every child's report.
    pub fn wait(self) -> PullReport {
        self.wait_timed().0
    }

    /// Waits for every child's report, and says when each one arrived (same order as
    /// `PullReport::children`): for hand-off latency figures.
    pub fn wait_timed(self) -> (PullReport, Vec<Instant>) {
        let mut children: Vec<(ChildReport, Instant)> =
            self.reports.iter().take(self.count).map(|r| (r, Instant::now())).collect();
        children.sort_by_key(|c| c.0.child_index);
        let (wire_bytes, delivered_bytes, elapsed) = self.done.recv().unwrap_or_default();
        let (children, arrived) = children.into_iter().unzip();
        (
            PullReport { parent_request_id: self.parent, children, wire_bytes, delivered_bytes, elapsed },
            arrived,
        )
    }
}

impl DecodeAgent {
    /// Starts an agent that pulls into `memory`.
    pub fn start(config: AgentConfig, memory: KvMemory) -> Result<Self, Error> {
        let runtime = crate::runtime::build(&config.agent_name, config.worker_threads)?;
        let memory = Arc::new(memory);
        config.check_transport()?;
        #[cfg_attr(not(feature = "ucx"), allow(unused_mut))]
        let mut transports = vec![crate::tcp_offer()];
        #[cfg(feature = "ucx")]
        let ucx = crate::ucx::start_if_wanted(&config, |c| crate::ucx::start_initiator(c, &memory))?;
        #[cfg(feature = "ucx")]
        if ucx.is_some() {
            // A decode agent only reads: its offer carries no connection info.
            transports.insert(
                0,
                v1::TransportOffer { transport: v1::Transport::Ucx as i32, connection_info: vec![] },
            );
        }
        let layout = memory.layout();
        let hello = v1::Hello {
            protocol_version: config.protocol_version,
            engine_id: config.engine_id.clone(),
            agent_name: config.agent_name.clone(),
            compat_hash: layout.compat_hash(),
            layout: Some(layout.to_wire()),
            transports,
            // Set per connection by the handshake.
            nonce: Vec::new(),
            authenticated: false,
        };
        if config.cluster_key.is_none() {
            crate::warn_unauthenticated("decode", &config.agent_name);
        }
        let (reclaimed_tx, reclaimed) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            consumer_id: config.effective_consumer_id(),
            config,
            memory,
            #[cfg(feature = "ucx")]
            ucx,
            hello,
            peers: Mutex::new(HashMap::new()),
            busy: Arc::new(Mutex::new(HashSet::new())),
            reclaimed_tx,
            reclaimed,
            counters: Counters::default(),
        });
        Ok(DecodeAgent { inner, runtime: Some(runtime) })
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

    /// Blocks of [`ChildOutcome::FailedBlocksHeld`] children, once the read that held them
    /// completed: only then may the caller reuse or free them. Fed from the transport's
    /// thread, also while the agent shuts down.
    pub fn reclaimed(&self) -> &Receiver<Reclaimed> {
        &self.inner.reclaimed
    }

    /// Pulls every child of `result` into `local_blocks[i]` (one list per child, same
    /// length as the child's remote blocks). Refused before any I/O when the lists do not
    /// fit, the children span several engines, or a local block is already the
    /// destination of another pull.
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
        let parent = result.parent_request_id().to_owned();
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
        let engines: HashSet<(&str, String, u64)> = children
            .iter()
            .map(|c| (c.engine().engine_id.as_str(), c.engine().addr(), c.engine().incarnation))
            .collect();
        if engines.len() > 1 {
            let engines =
                engines.iter().map(|(id, a, inc)| format!("{id}@{a} incarnation {inc:#x}")).collect();
            return Err(SubmitError::MixedEngines { parent, engines }.into());
        }
        let pairs: Vec<(&[BlockId], &[BlockId])> =
            children.iter().zip(&local).map(|(c, l)| (c.remote_block_ids(), l.as_slice())).collect();
        let local_num = self.inner.memory.layout().num_blocks();
        let plan = ResultPlan::build(&pairs, u32::MAX, local_num)
            .map_err(|source| SubmitError::Plan { parent: parent.clone(), source })?;
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
        add(&self.inner.counters.pulls, 1);
        let count = children.len();
        let (report_tx, reports) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::bounded(1);
        let (cancel, cancel_rx) = watch::channel(vec![false; n as usize]);
        let pull = Pull {
            inner: self.inner.clone(),
            children,
            local,
            plan,
            reports: report_tx,
            cancel: cancel_rx,
            started: Instant::now(),
            claimed,
            reachable: AtomicBool::new(true),
            held: Arc::new(HeldReads::new(self.inner.busy.clone(), self.inner.reclaimed_tx.clone())),
        };
        if let Some(rt) = self.runtime.as_ref() {
            rt.spawn(pull.run(done_tx));
        }
        Ok(PullHandle { parent, count, reports, cancel: Arc::new(cancel), done })
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
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DecodeStats {
            pulls: l(&c.pulls),
            children_done: l(&c.children_done),
            children_failed: l(&c.children_failed),
            children_cancelled: l(&c.children_cancelled),
            bytes_pulled: l(&c.bytes_pulled),
            bytes_delivered: l(&c.bytes_delivered),
            notifications_unacknowledged: l(&c.notifications_unacknowledged),
            connections_opened: l(&c.connections_opened),
            auth_failures: l(&c.auth_failures),
            control_retries: l(&c.control_retries),
            children_blocks_held: l(&c.children_blocks_held),
            peers: self.inner.peers.lock().unwrap_or_else(|p| p.into_inner()).len() as u64,
        }
    }
}

impl Drop for DecodeAgent {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            crate::runtime::shutdown(rt);
        }
    }
}

impl Inner {
    fn peer(&self, addr: &str) -> Arc<Peer> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if !peers.contains_key(addr) {
            // Prefill workers come and go (restarts, scale-down): forget peers no pull uses
            // whose connections their side has closed, so neither entries nor sockets pile up.
            peers.retain(|_, p| Arc::strong_count(p) > 1 || !p.is_gone());
        }
        peers
            .entry(addr.to_owned())
            .or_insert_with(|| {
                Arc::new(Peer {
                    addr: addr.to_owned(),
                    idle: Mutex::new(Vec::new()),
                    permits: Semaphore::new(self.config.connections_per_peer.max(1)),
                    control: tokio::sync::Mutex::new(None),
                    #[cfg(feature = "ucx")]
                    ucx_engine: tokio::sync::Mutex::new(None),
                })
            })
            .clone()
    }

    async fn connect(&self, addr: &str) -> Result<Connection, ClientError> {
        let key = self.config.cluster_key.as_ref();
        let c = match Connection::connect_with_key(addr, &self.hello, key, self.config.limits).await {
            Ok(c) => c,
            Err(e) => {
                if let ClientError::Auth { reason, .. } = &e {
                    add(&self.counters.auth_failures, 1);
                    warn!(peer = %addr, %reason, "handshake failed authentication");
                }
                return Err(e);
            }
        };
        add(&self.counters.connections_opened, 1);
        Ok(c)
    }
}

impl Peer {
    /// A data connection for one request: waits for one of the peer's permits, then reuses an
    /// idle connection or opens a new one.
    async fn checkout(
        &self,
        inner: &Inner,
    ) -> Result<(tokio::sync::SemaphorePermit<'_>, Connection), String> {
        let permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
        // Skip pooled connections the peer closed meanwhile (it restarted, or timed them out).
        let idle = {
            let mut pool = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            std::iter::from_fn(|| pool.pop()).find(|c| !c.closed_by_peer())
        };
        let conn = match idle {
            Some(c) => c,
            None => inner.connect(&self.addr).await.map_err(|e| e.to_string())?,
        };
        Ok((permit, conn))
    }

    /// Forgets every connection to the peer (it is no longer the engine they were made to).
    async fn reset(&self) {
        *self.control.lock().await = None;
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Whether the peer closed every connection this agent holds to it (or there are none).
    /// A pull in progress may hold the control lock: then it is not gone.
    fn is_gone(&self) -> bool {
        let Ok(control) = self.control.try_lock() else { return false };
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        control.as_ref().is_none_or(Connection::closed_by_peer) && idle.iter().all(Connection::closed_by_peer)
    }

    /// Returns a connection to the pool after a request ended with `r`, unless the error
    /// left it unusable (it is dropped then).
    fn checkin<T>(&self, conn: Connection, r: &Result<T, ClientError>) {
        if r.as_ref().err().is_none_or(ClientError::connection_usable) {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
        }
    }

    /// Runs `op` on the control connection, connecting (again) if needed. The connection
    /// is out of its slot while `op` runs and goes back only when `op` finished with it
    /// usable: an exchange cut short (its future dropped, e.g. a heartbeat when the reads
    /// end) or failed drops the connection, so no later exchange reads its stale reply.
    async fn control(&self, inner: &Inner, op: &ControlOp) -> Result<ControlReply, ClientError> {
        let mut slot = self.control.lock().await;
        let mut conn = match slot.take().filter(|c| !c.closed_by_peer()) {
            Some(c) => c,
            None => inner.connect(&self.addr).await?,
        };
        let r = op.run(&mut conn).await;
        if r.as_ref().err().is_none_or(ClientError::connection_usable) {
            *slot = Some(conn);
        }
        r
    }
}

/// One exchange on a peer's control connection.
#[derive(Debug)]
enum ControlOp {
    /// The handshake answer the connection got (no exchange: connects if needed).
    Hello,
    Notify {
        id: String,
        token: Vec<u8>,
        consumer: String,
    },
    Cancel {
        id: String,
        token: Vec<u8>,
    },
    Heartbeat(Vec<v1::LeaseRef>),
}

/// The answer to a [`ControlOp`], variant for variant.
#[derive(Debug)]
enum ControlReply {
    Hello(Box<v1::HelloAck>),
    Notify(v1::NotifyAck),
    Cancel(LeaseOutcome),
    Heartbeat(Vec<LeaseOutcome>),
}

impl ControlOp {
    async fn run(&self, c: &mut Connection) -> Result<ControlReply, ClientError> {
        Ok(match self {
            ControlOp::Hello => ControlReply::Hello(Box::new(c.peer_hello().clone())),
            ControlOp::Notify { id, token, consumer } => {
                ControlReply::Notify(c.notify(id, token, consumer).await?)
            }
            ControlOp::Cancel { id, token } => ControlReply::Cancel(c.cancel(id, token).await?),
            ControlOp::Heartbeat(leases) => ControlReply::Heartbeat(c.heartbeat(leases.clone()).await?),
        })
    }
}

#[derive(Debug, Clone)]
enum ReadState {
    Ok(u64),
    Failed(String),
    /// Failed, and the transport may still write the destination blocks.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    InFlight(String),
    Cancelled,
}

/// One-sided reads of a pull that the transport could not stop, and the blocks they hold:
/// released (and announced on [`DecodeAgent::reclaimed`]) when the last of them completes
/// and the pull has reported. Completions arrive on the transport's thread.
struct HeldReads {
    busy: Arc<Mutex<HashSet<BlockId>>>,
    reclaimed: Sender<Reclaimed>,
    state: Mutex<HeldState>,
}

#[derive(Default)]
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
struct HeldState {
    /// Reads abandoned by the pull and not yet completed.
    outstanding: usize,
    /// Children (pull positions) whose read was abandoned.
    children: HashSet<usize>,
    /// Set once the pull reported: what to release and announce when `outstanding` is 0.
    release: Option<(HashSet<BlockId>, Reclaimed)>,
}

/// What became of one one-sided read: completed, or abandoned by its pull first.
#[derive(Debug, Default)]
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
enum ReadFate {
    #[default]
    Waiting,
    Completed,
    Abandoned,
}

#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
impl HeldReads {
    fn new(busy: Arc<Mutex<HashSet<BlockId>>>, reclaimed: Sender<Reclaimed>) -> Self {
        HeldReads { busy, reclaimed, state: Mutex::new(HeldState::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HeldState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The read of child `i` with `fate` is given up while UCX may still write: true if it
    /// is now held, false if it completed meanwhile.
    fn abandon(&self, i: usize, fate: &Mutex<ReadFate>) -> bool {
        let mut fate = fate.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*fate, ReadFate::Completed) {
            return false;
        }
        *fate = ReadFate::Abandoned;
        let mut st = self.lock();
        st.outstanding += 1;
        st.children.insert(i);
        true
    }

    /// The transport finished the read with `fate` (on its own thread).
    fn completed(&self, fate: &Mutex<ReadFate>) {
        let mut fate = fate.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*fate, ReadFate::Abandoned) {
            let mut st = self.lock();
            st.outstanding -= 1;
            self.release_if_done(&mut st);
        }
        *fate = ReadFate::Completed;
    }

    fn holds(&self, i: usize) -> bool {
        self.lock().children.contains(&i)
    }

    /// The pull reported: release `blocks` (announcing `reclaimed`) once no abandoned read
    /// is outstanding — now, if none is.
    fn finish(&self, blocks: HashSet<BlockId>, reclaimed: Reclaimed) {
        let mut st = self.lock();
        st.release = Some((blocks, reclaimed));
        self.release_if_done(&mut st);
    }

    fn release_if_done(&self, st: &mut HeldState) {
        if st.outstanding > 0 {
            return;
        }
        let Some((blocks, reclaimed)) = st.release.take() else { return };
        {
            let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
            for b in &blocks {
                busy.remove(b);
            }
        }
        info!(parent = %reclaimed.parent_request_id, blocks = blocks.len(), "held blocks reclaimed: the stuck read completed");
        // The agent (and every receiver) may be gone: then nobody needs telling.
        let _ = self.reclaimed.send(reclaimed);
    }
}

/// How long, at most, a failed control exchange (notify, cancel, heartbeat) is retried on
/// fresh connections: the io timeout, and at most this many attempts.
const CONTROL_ATTEMPTS: u32 = 3;

struct Pull {
    inner: Arc<Inner>,
    children: Vec<ChildHandoff>,
    local: Vec<Vec<BlockId>>,
    plan: ResultPlan,
    reports: Sender<ChildReport>,
    cancel: watch::Receiver<Vec<bool>>,
    started: Instant,
    claimed: HashSet<BlockId>,
    /// Cleared when the peer cannot be reached at all (connect or handshake refused): later
    /// notifies and cancels of this pull are skipped instead of each waiting out a timeout.
    reachable: AtomicBool,
    /// One-sided reads the transport could not stop, and the blocks they hold.
    held: Arc<HeldReads>,
}

/// Whether a failed control exchange means the peer cannot be reached at all (no point in
/// retrying), rather than that one exchange broke.
fn unreachable_peer(e: &ClientError) -> bool {
    matches!(e, ClientError::Connect { .. } | ClientError::Handshake { .. } | ClientError::Auth { .. })
}

impl Pull {
    /// Runs `op` on the peer's control connection unless the peer was found unreachable.
    /// An exchange that fails midway (connection reset, lost or garbled reply) is retried
    /// on a fresh connection while the io timeout allows; the second value is the number of
    /// attempts made (a retried notify may find its first attempt counted).
    async fn control(&self, peer: &Peer, op: ControlOp) -> Option<(Result<ControlReply, ClientError>, u32)> {
        if !self.reachable.load(Ordering::Relaxed) {
            return None;
        }
        let mut attempt = 1;
        let mut r = peer.control(&self.inner, &op).await;
        let deadline = tokio::time::Instant::now() + self.inner.config.limits.io_timeout;
        loop {
            match &r {
                Err(e) if unreachable_peer(e) => {
                    self.reachable.store(false, Ordering::Relaxed);
                    break;
                }
                Err(e) if !e.connection_usable() && attempt < CONTROL_ATTEMPTS => {
                    debug!(peer = %peer.addr, error = %e, attempt, "control exchange failed; retrying on a fresh connection");
                    add(&self.inner.counters.control_retries, 1);
                    attempt += 1;
                    match tokio::time::timeout_at(deadline, peer.control(&self.inner, &op)).await {
                        Ok(next) => r = next,
                        Err(_) => break,
                    }
                }
                _ => break,
            }
        }
        Some((r, attempt))
    }

    /// Whether the caller cancelled the `i`-th child of this pull.
    fn is_cancelled(&self, i: usize) -> bool {
        let index = self.children[i].child_index() as usize;
        self.cancel.borrow().get(index).copied().unwrap_or(false)
    }

    fn report(&self, i: usize, outcome: ChildOutcome) {
        let c = &self.inner.counters;
        match &outcome {
            ChildOutcome::Done { bytes_delivered, .. } => {
                add(&c.children_done, 1);
                add(&c.bytes_delivered, *bytes_delivered);
            }
            ChildOutcome::Failed { reason, .. } => {
                add(&c.children_failed, 1);
                warn!(remote_request_id = %self.children[i].remote_request_id(), %reason, "child pull failed");
            }
            ChildOutcome::Cancelled { .. } => add(&c.children_cancelled, 1),
            ChildOutcome::FailedBlocksHeld { reason, .. } => {
                add(&c.children_failed, 1);
                add(&c.children_blocks_held, 1);
                warn!(remote_request_id = %self.children[i].remote_request_id(), %reason, "child pull failed; its blocks stay held");
            }
        }
        // The handle may have been dropped: the pull still completes and releases leases.
        let _ = self.reports.send(ChildReport {
            child_index: self.children[i].child_index(),
            remote_request_id: self.children[i].remote_request_id().to_owned(),
            outcome,
        });
    }

    async fn run(self, done: Sender<(u64, u64, Duration)>) {
        let n = self.children.len();
        let addr = self.children[0].engine().addr();
        let peer = self.inner.peer(&addr);
        let states = self.pull_all(&peer).await;

        // Local blocks that a read the transport could not stop may still write; every child
        // with one of them among its blocks is held with it.
        let held_blocks: HashSet<BlockId> = (0..n)
            .filter(|&d| matches!(states[d], ReadState::InFlight(_)))
            .flat_map(|d| self.plan.children[d].wire.iter())
            .flat_map(|r| (0..r.count).map(move |k| r.local_start + k))
            .collect();
        let held: Vec<bool> = self.local.iter().map(|l| l.iter().any(|b| held_blocks.contains(b))).collect();
        // Why a child's blocks are invalid, from the reads it depends on (None: all read).
        let failed_dep: Vec<Option<String>> = (0..n)
            .map(|i| {
                self.plan.children[i].depends_on.iter().find_map(|&d| match &states[d] {
                    ReadState::Ok(_) => None,
                    ReadState::Failed(r) | ReadState::InFlight(r) => Some(if d == i {
                        r.clone()
                    } else {
                        format!("shared blocks were read for sibling {d}, which failed: {r}")
                    }),
                    ReadState::Cancelled => {
                        Some(format!("shared blocks were to be read for sibling {d}, which was cancelled"))
                    }
                })
            })
            .collect();

        // Every sibling copy is made before any report: a report hands the child's blocks
        // back to the caller, who may reuse them at once (vLLM frees an aborted request's
        // blocks), and they may be the source of a sibling's copy.
        for i in (0..n).filter(|&i| failed_dep[i].is_none() && !held[i]) {
            for &(src, dst) in &self.plan.children[i].copies {
                // SAFETY: `src` and `dst` are destination blocks claimed by this pull (no
                // other pull writes them and the caller does not touch them until their
                // report, and no report has been sent yet), and every wire read has finished.
                #[allow(unsafe_code)]
                let r = unsafe { self.inner.memory.copy_block(src, dst) };
                if let Err(e) = r {
                    warn!(error = %e, "local copy failed");
                }
            }
        }

        // Heartbeats stopped with the reads; notifications follow at once.
        let mut wire_bytes = 0;
        let mut delivered = 0;
        let mut held_children = Vec::new();
        let mut held_release: HashSet<BlockId> = HashSet::new();
        for (i, child) in self.children.iter().enumerate() {
            let local = &self.local[i];
            let bpb = self.inner.memory.layout().block_bytes();
            if let ReadState::Ok(b) = states[i] {
                wire_bytes += b;
            }
            if held[i] {
                let reason = failed_dep[i].clone().unwrap_or_else(|| {
                    "its local blocks are also the destination of a read that could not be stopped".into()
                });
                self.cancel_lease(&peer, child).await;
                held_children.push(child.child_index());
                held_release.extend(local.iter().copied());
                self.report(i, ChildOutcome::FailedBlocksHeld { reason, held_local_blocks: local.clone() });
                continue;
            }
            if self.is_cancelled(i) || matches!(states[i], ReadState::Cancelled) {
                let released = self.cancel_lease(&peer, child).await;
                self.report(i, ChildOutcome::Cancelled { released, invalid_local_blocks: local.clone() });
                continue;
            }
            if let Some(reason) = failed_dep[i].clone() {
                // Best effort: release the lease now rather than at expiry (skipped once the
                // peer is known unreachable).
                self.cancel_lease(&peer, child).await;
                self.report(i, ChildOutcome::Failed { reason, invalid_local_blocks: local.clone() });
                continue;
            }
            let acknowledged = self.notify(&peer, child).await;
            let bytes = local.len() as u64 * bpb;
            delivered += bytes;
            self.report(i, ChildOutcome::Done { bytes_delivered: bytes, acknowledged });
        }
        add(&self.inner.counters.bytes_pulled, wire_bytes);
        {
            let mut busy = self.inner.busy.lock().unwrap_or_else(|p| p.into_inner());
            for b in self.claimed.iter().filter(|b| !held_release.contains(b)) {
                busy.remove(b);
            }
        }
        if !held_release.is_empty() {
            warn!(
                blocks = held_release.len(),
                "destination blocks stay held until the read that could not be stopped completes"
            );
            let mut local_blocks: Vec<BlockId> = held_release.iter().copied().collect();
            local_blocks.sort_unstable();
            let parent_request_id = self.children[0].parent_request_id().to_owned();
            let reclaimed = Reclaimed { parent_request_id, children: held_children, local_blocks };
            self.held.finish(held_release, reclaimed);
        }
        debug!(children = n, wire_bytes, delivered, "pull finished");
        let _ = done.send((wire_bytes, delivered, self.started.elapsed()));
    }

    /// Reads every child's wire runs concurrently over the peer's pooled connections,
    /// heartbeating the leases meanwhile.
    async fn pull_all(&self, peer: &Arc<Peer>) -> Vec<ReadState> {
        let n = self.children.len();
        // Handshake (once per peer connection) and check the remote ids against its layout.
        let (remote_layout, path) = match self.handshake(peer).await {
            Ok(l) => l,
            Err(reason) => {
                self.reachable.store(false, Ordering::Relaxed);
                return vec![ReadState::Failed(reason); n];
            }
        };
        let out_of_range: Vec<BlockId> = self
            .children
            .iter()
            .flat_map(|c| remote_layout.out_of_range(c.remote_block_ids().iter().copied()))
            .take(16)
            .collect();
        if !out_of_range.is_empty() {
            let reason = format!(
                "remote block ids {out_of_range:?} are outside the prefill layout of {} blocks",
                remote_layout.num_blocks()
            );
            return vec![ReadState::Failed(reason); n];
        }

        let heartbeat = self.heartbeat_loop(peer.clone());
        let reads = async {
            let mut futs = Vec::with_capacity(n);
            for i in 0..n {
                futs.push(self.read_child(peer, i, &remote_layout, path));
            }
            join_all(futs).await
        };
        tokio::select! {
            states = reads => states,
            _ = heartbeat => unreachable!("the heartbeat loop never returns"),
        }
    }

    /// Handshakes with the peer (once per connection), checks it is the engine process the
    /// hand-offs name (engine id, and incarnation when stated), and picks the data path: the
    /// best one both sides offer, unless the config forces one.
    async fn handshake(&self, peer: &Peer) -> Result<(BlockLayout, Path), String> {
        let hello = async || match peer.control(&self.inner, &ControlOp::Hello).await {
            Ok(ControlReply::Hello(ack)) => Ok(*ack),
            Ok(other) => Err(format!("unexpected {other:?}")),
            Err(e) => Err(e.to_string()),
        };
        let want = self.children[0].engine();
        let stale = |ack: &v1::HelloAck| {
            ack.engine_id != want.engine_id || (want.incarnation != 0 && ack.incarnation != want.incarnation)
        };
        let mut ack = hello().await?;
        if stale(&ack) {
            // Our connections may predate a restart of the worker at this address: start
            // over once with fresh ones before calling the hand-off stale.
            debug!(peer = %peer.addr, had = %ack.engine_id, had_incarnation = ack.incarnation, want = %want.engine_id, want_incarnation = want.incarnation, "engine changed; reconnecting");
            peer.reset().await;
            ack = hello().await?;
        }
        if stale(&ack) {
            let stated = if want.incarnation == 0 {
                "not stated".to_owned()
            } else {
                format!("{:#x}", want.incarnation)
            };
            return Err(format!(
                "stale hand-off: {} is engine {} incarnation {:#x}, but the hand-off names engine {} \
                 incarnation {stated} (the prefill worker restarted; its leases are gone)",
                peer.addr, ack.engine_id, ack.incarnation, want.engine_id
            ));
        }
        let wire = ack.layout.as_ref().ok_or("the prefill agent sent no block layout")?;
        let layout = BlockLayout::from_wire(wire)
            .map_err(|e| format!("the prefill agent's layout is malformed: {e}"))?;
        let path = self.choose_path(peer, &ack).await?;
        Ok((layout, path))
    }

    #[cfg_attr(not(feature = "ucx"), allow(clippy::unused_async))]
    async fn choose_path(&self, peer: &Peer, ack: &v1::HelloAck) -> Result<Path, String> {
        let want = self.inner.config.transport;
        if want == TransportChoice::Tcp {
            return Ok(Path::Tcp);
        }
        #[cfg(feature = "ucx")]
        if let Some(init) = &self.inner.ucx {
            match crate::ucx::parse_offer(&ack.transports) {
                Some(Ok(info)) => {
                    let engine = (ack.engine_id.clone(), ack.incarnation);
                    let mut connected = peer.ucx_engine.lock().await;
                    if connected.as_ref() == Some(&engine) {
                        return Ok(Path::Ucx);
                    }
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    init.connect(&peer.addr, info, Box::new(move |r| drop(tx.send(r))));
                    match rx.await {
                        Ok(Ok(())) => {
                            *connected = Some(engine);
                            debug!(peer = %peer.addr, "UCX endpoint ready");
                            return Ok(Path::Ucx);
                        }
                        Ok(Err(e)) if want == TransportChoice::Ucx => {
                            return Err(format!("UCX to {}: {e}", peer.addr))
                        }
                        Ok(Err(e)) => {
                            warn!(peer = %peer.addr, error = %e, "UCX endpoint failed; pulling over TCP")
                        }
                        Err(_) => return Err("the UCX thread stopped".into()),
                    }
                }
                Some(Err(e)) if want == TransportChoice::Ucx => return Err(e),
                Some(Err(e)) => warn!(peer = %peer.addr, error = %e, "ignoring the peer's UCX offer"),
                None => {}
            }
        }
        if want == TransportChoice::Ucx {
            return Err(format!(
                "UCX was requested, but {} does not offer it or this agent has no UCX",
                peer.addr
            ));
        }
        let _ = (peer, ack);
        Ok(Path::Tcp)
    }

    async fn read_child(&self, peer: &Peer, i: usize, remote: &BlockLayout, path: Path) -> ReadState {
        let runs = &self.plan.children[i].wire;
        if runs.is_empty() {
            return ReadState::Ok(0);
        }
        let has_dependents =
            self.plan.children.iter().enumerate().any(|(j, c)| j != i && c.depends_on.contains(&i));
        #[cfg(feature = "ucx")]
        if path == Path::Ucx {
            // A UCX get cannot be cut short (UCX keeps writing after its future is dropped),
            // so a cancel only stops a read that has not started.
            if self.is_cancelled(i) && !has_dependents {
                return ReadState::Cancelled;
            }
            return match self.read_ucx(peer, i, remote).await {
                Ok(b) => ReadState::Ok(b),
                Err(e) if self.held.holds(i) => ReadState::InFlight(e),
                Err(e) => ReadState::Failed(e),
            };
        }
        let _ = (remote, path);
        let mut cancel = self.cancel.clone();
        let index = self.children[i].child_index() as usize;
        let cancelled = async move {
            if has_dependents {
                // Siblings need these blocks: finish the read, then release the lease.
                std::future::pending::<()>().await;
            }
            if cancel.wait_for(|v| v.get(index).copied().unwrap_or(false)).await.is_err() {
                // The handle is gone: nobody can cancel any more.
                std::future::pending::<()>().await;
            }
        };
        let child = &self.children[i];
        let read = async {
            let (_permit, mut conn) = peer.checkout(&self.inner).await?;
            let id = child.remote_request_id();
            // SAFETY: the local blocks of `runs` were claimed by this pull in `submit` (no
            // other pull writes them; the caller does not touch them until their report),
            // and `ResultPlan::build` checked them against the local layout.
            #[allow(unsafe_code)]
            let r = unsafe { conn.read_into(id, child.token().as_bytes(), runs, &self.inner.memory) }.await;
            peer.checkin(conn, &r);
            debug!(remote_request_id = %id, result = ?r, "child read");
            r.map_err(|e| e.to_string())
        };
        tokio::select! {
            r = read => match r {
                Ok(b) => ReadState::Ok(b),
                Err(e) => ReadState::Failed(e),
            },
            // Dropping the read drops its connection mid-transfer: it is never reused.
            _ = cancelled => ReadState::Cancelled,
        }
    }

    /// Pins child `i`'s runs on a pooled connection, reads them with UCX straight into the
    /// local blocks, and unpins.
    #[cfg(feature = "ucx")]
    async fn read_ucx(&self, peer: &Peer, i: usize, remote: &BlockLayout) -> Result<u64, String> {
        let init = self.inner.ucx.as_ref().ok_or("this agent has no UCX")?;
        let child = &self.children[i];
        let runs = &self.plan.children[i].wire;
        let (_permit, mut conn) = peer.checkout(&self.inner).await?;
        let id = child.remote_request_id();
        let verify = self.inner.config.ucx.verify_payloads;
        let grant = match conn.pin(id, child.token().as_bytes(), runs, verify).await {
            Ok(p) => p,
            Err(e) => {
                let message = e.to_string();
                peer.checkin(conn, &Err::<(), _>(e));
                return Err(message);
            }
        };
        let pieces = crate::ucx::pieces(&self.inner.memory, remote, runs);
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Whether the pull gave up on the read before UCX completed it (then the completion
        // releases the blocks it held, from the UCX thread).
        let fate = Arc::new(Mutex::new(ReadFate::Waiting));
        let (held, done_fate) = (self.held.clone(), fate.clone());
        // SAFETY: every piece lands in local blocks of `runs`, which this pull claimed in
        // `submit` (no other pull writes them; the caller does not touch them until their
        // report) and which `ResultPlan::build` checked against the local layout, inside the
        // regions the initiator registered. The pull waits for `done` before reporting.
        #[allow(unsafe_code)]
        unsafe {
            init.get(
                &peer.addr,
                pieces,
                Box::new(move |r| {
                    drop(tx.send(r));
                    held.completed(&done_fate);
                }),
            )
        };
        // Bounded: a peer that stops answering must not hang the pull. The allowance grows
        // with the size of the read (100 MB/s is far below any working UCX transport).
        let bytes: u64 = runs.iter().map(|r| u64::from(r.count)).sum::<u64>() * remote.block_bytes();
        // Not past the time the prefill side holds the pin (it grows with the pin's size; a
        // read finishing after it is refused by the unpin anyway), but never sooner than
        // `io_timeout`, the least a read is given before it counts as stuck: aborting a UCX
        // endpoint with a get in flight can make UCX 1.13 abort the prefill process (tcp).
        let stuck = self.inner.config.limits.io_timeout + Duration::from_secs_f64(bytes as f64 / 100e6);
        let limit = stuck.min(grant.held_for.max(self.inner.config.limits.io_timeout));
        let (seq, pinned_crc) = (grant.seq, grant.payload_crc32c);
        let mut rx = rx;
        let result = match tokio::time::timeout(limit, &mut rx).await {
            Ok(Ok(r)) => r.map_err(|e| e.to_string()),
            Ok(Err(_)) => Err("the UCX thread stopped".to_owned()),
            Err(_) => {
                init.abort(&peer.addr);
                match tokio::time::timeout(self.inner.config.limits.io_timeout, rx).await {
                    Ok(_) => Err(format!("UCX read made no progress in {limit:?}; endpoint aborted")),
                    // UCX still owns the read: its destination blocks are held (reported
                    // FailedBlocksHeld) until UCX completes it.
                    Err(_) if self.held.abandon(i, &fate) => Err(format!(
                        "UCX read made no progress in {limit:?} and did not stop after the endpoint \
                         was aborted; its local blocks stay held until it completes"
                    )),
                    Err(_) => Err(format!("UCX read made no progress in {limit:?}; endpoint aborted")),
                }
            }
        };
        // With payload verification on, the read must have fetched what was pinned.
        let result = result.and_then(|b| {
            let Some(want) = pinned_crc else { return Ok(b) };
            // SAFETY: the read completed, so UCX no longer writes these blocks, and this
            // pull still holds them (see above).
            #[allow(unsafe_code)]
            let got = unsafe { self.inner.memory.crc32c(runs.iter().map(|r| (r.local_start, r.count))) };
            kvxfer_tcp::check_crc(&peer.addr, seq, want, got).map(|()| b).map_err(|e| e.to_string())
        });
        if result.is_err() {
            // The endpoint may be broken: the next pull makes a new one.
            init.disconnect(&peer.addr);
            *peer.ucx_engine.lock().await = None;
        }
        let unpinned = conn.unpin(seq, result.is_ok()).await;
        // The read counts only if the pin was held until it finished; an unpin that got no
        // answer cannot prove that either.
        let result = match (&unpinned, result) {
            (Ok(true), r) | (_, r @ Err(_)) => r,
            (Ok(false), Ok(_)) => Err(format!(
                "{} dropped pin {seq} before the read finished (its pin_timeout passed); the blocks read \
                 may no longer have been leased",
                peer.addr
            )),
            (Err(e), Ok(_)) => Err(format!("unpin {seq} failed, so the read cannot be trusted: {e}")),
        };
        peer.checkin(conn, &unpinned);
        debug!(remote_request_id = %id, ?result, "child read over UCX");
        result
    }

    async fn heartbeat_loop(&self, peer: Arc<Peer>) {
        let min_ttl = self.children.iter().map(|c| c.ttl()).min().unwrap_or(Duration::from_secs(30));
        let every =
            self.inner.config.heartbeat_interval.unwrap_or(min_ttl / 6).max(Duration::from_millis(10));
        let leases: Vec<v1::LeaseRef> = self
            .children
            .iter()
            .map(|c| v1::LeaseRef {
                remote_request_id: c.remote_request_id().to_owned(),
                lease_token: c.token().as_bytes().to_vec(),
            })
            .collect();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            match self.control(&peer, ControlOp::Heartbeat(leases.clone())).await {
                None => {}
                Some((Ok(ControlReply::Heartbeat(outcomes)), _)) => {
                    for (l, o) in self.children.iter().zip(outcomes) {
                        if o != LeaseOutcome::Extended {
                            debug!(remote_request_id = %l.remote_request_id(), outcome = ?o, "heartbeat not extended");
                        }
                    }
                }
                Some((r, _)) => debug!(result = ?r, "heartbeat failed"),
            }
        }
    }

    async fn notify(&self, peer: &Peer, child: &ChildHandoff) -> bool {
        let id = child.remote_request_id().to_owned();
        let token = child.token().as_bytes().to_vec();
        let consumer = self.inner.consumer_id.clone();
        let r = self.control(peer, ControlOp::Notify { id, token, consumer }).await;
        let ok = match &r {
            Some((Ok(ControlReply::Notify(ack)), attempts)) => match LeaseOutcome::try_from(ack.outcome) {
                // ALREADY_PULLED: an earlier attempt (whose answer was lost) ended the lease.
                Ok(LeaseOutcome::Pulled | LeaseOutcome::Counted | LeaseOutcome::AlreadyPulled) => true,
                // Our consumer id was counted by an earlier attempt of this notify.
                Ok(LeaseOutcome::Duplicate) => *attempts > 1,
                _ => false,
            },
            _ => false,
        };
        if !ok {
            add(&self.inner.counters.notifications_unacknowledged, 1);
            warn!(remote_request_id = %child.remote_request_id(), result = ?r, "notification not acknowledged");
        }
        ok
    }

    async fn cancel_lease(&self, peer: &Peer, child: &ChildHandoff) -> bool {
        let id = child.remote_request_id().to_owned();
        let token = child.token().as_bytes().to_vec();
        let r = self.control(peer, ControlOp::Cancel { id, token }).await;
        match &r {
            None => {
                info!(remote_request_id = %child.remote_request_id(), "peer unreachable: lease left to expire")
            }
            Some(r) => info!(remote_request_id = %child.remote_request_id(), result = ?r, "cancel sent"),
        }
        // ALREADY_RELEASED: an earlier attempt (whose answer was lost) released it.
        matches!(
            r,
            Some((Ok(ControlReply::Cancel(LeaseOutcome::Released | LeaseOutcome::AlreadyReleased)), _))
        )
    }
}

/// Polls futures concurrently on the current task and returns their outputs in order.
async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..futs.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futs.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}
