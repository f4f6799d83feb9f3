//! `DecodeAgent` and `Pull`: non-blocking pulls of children given as `kv_transfer_params`
//! dicts (a whole parent or any subset of its children), per-child reports, cancels, and
//! heartbeats of leases whose pulls have not started yet (requests waiting in the decode
//! queue).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvxfer::{ChildOutcome, ChildReport, PullCanceller, PullReport};
use kvxfer_core::{BlockId, ChildHandoff, PrefillResult};
use kvxfer_proto::v1;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio_util::task::TaskTracker;

use crate::errors::{pull_error, raise, submit_error, to_py, AgentClosedError, ConfigError};
use crate::host::{runtime, Hosted};
use crate::keeper::Keeper;
use crate::memory::Memory;
use crate::params::{handoff_from_py, seconds, BlockLists};
use crate::prefill::{apply_shape, base_config};
use crate::shape::KvShape;

/// One child's report, kept until Python takes it.
#[derive(Clone)]
struct ReportData {
    pull: u64,
    remote_request_id: String,
    parent: String,
    /// The prefill side's child index.
    child_index: u32,
    local_blocks: LocalBlocks,
    outcome: ChildOutcome,
    /// The data path its bytes took (`None`: the peer was not reached).
    path: Option<kvxfer::DataPath>,
    /// From submit to this report.
    after: Duration,
}

impl ReportData {
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("pull", self.pull)?;
        d.set_item("remote_request_id", &self.remote_request_id)?;
        d.set_item("parent_request_id", &self.parent)?;
        d.set_item("child_index", self.child_index)?;
        match &self.local_blocks {
            LocalBlocks::Empty => d.set_item("local_blocks", Vec::<BlockId>::new())?,
            LocalBlocks::Flat(v) => d.set_item("local_blocks", v.clone())?,
            LocalBlocks::Grouped(g) => d.set_item("local_blocks", g.clone())?,
        }
        d.set_item("seconds", self.after.as_secs_f64())?;
        d.set_item("path", self.path.as_ref().map(ToString::to_string))?;
        d.set_item(
            "ucx_transports",
            match &self.path {
                Some(kvxfer::DataPath::Ucx { transports }) => Some(transports.clone()),
                _ => None,
            },
        )?;
        let (outcome, error) = match &self.outcome {
            ChildOutcome::Done { bytes_delivered, acknowledged } => {
                d.set_item("bytes_delivered", *bytes_delivered)?;
                d.set_item("acknowledged", *acknowledged)?;
                ("done", None)
            }
            ChildOutcome::Failed { error, .. } => ("failed", Some(error)),
            ChildOutcome::Cancelled { released, .. } => {
                d.set_item("released", *released)?;
                ("cancelled", None)
            }
            ChildOutcome::FailedBlocksHeld { error, .. } => ("failed_blocks_held", Some(error)),
        };
        d.set_item("outcome", outcome)?;
        match error {
            Some(e) => d.set_item("error", pull_error(py, e, &self.remote_request_id, self.child_index))?,
            None => d.set_item("error", py.None())?,
        }
        Ok(d)
    }
}

/// A child's local blocks as they were given: one list, or one per KV-cache group (its
/// reports give them back the same way).
#[derive(Clone, Default)]
enum LocalBlocks {
    #[default]
    Empty,
    Flat(Vec<BlockId>),
    Grouped(Vec<Vec<BlockId>>),
}

impl LocalBlocks {
    fn from(lists: BlockLists) -> Self {
        match lists {
            BlockLists::Flat(v) => LocalBlocks::Flat(v),
            BlockLists::Grouped(g) => LocalBlocks::Grouped(g),
        }
    }

    fn groups(&self) -> Vec<Vec<BlockId>> {
        match self {
            LocalBlocks::Empty => Vec::new(),
            LocalBlocks::Flat(v) => vec![v.clone()],
            LocalBlocks::Grouped(g) => g.clone(),
        }
    }
}

/// One child of a pull: the prefill side's child index, its remote request ids (one per
/// prefill rank it was handed off by) and its local blocks.
#[derive(Clone, Default)]
struct PullChild {
    child_index: u32,
    remote_request_ids: Vec<String>,
    local: LocalBlocks,
}

/// What a pull's forwarder task and its Python `Pull` share.
struct PullState {
    id: u64,
    parent: String,
    /// Per renumbered child j: the prefill side's child index, ids and local blocks.
    children: Vec<PullChild>,
    canceller: PullCanceller,
    submitted: Instant,
    progress: Mutex<Progress>,
    changed: Condvar,
}

#[derive(Default)]
struct Progress {
    reports: Vec<ReportData>,
    /// How many of `reports` `Pull.poll` already returned.
    polled: usize,
    /// Wire bytes, delivered bytes, elapsed — once every child reported.
    totals: Option<(u64, u64, Duration)>,
}

impl PullState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The report of renumbered child `r.child_index`, in the prefill side's terms.
    fn report(&self, r: ChildReport) -> ReportData {
        let PullChild { child_index, remote_request_ids, local } =
            self.children.get(r.child_index as usize).cloned().unwrap_or_default();
        ReportData {
            pull: self.id,
            // Prefill rank 0's id for a child handed off by several ranks.
            remote_request_id: remote_request_ids.into_iter().next().unwrap_or(r.remote_request_id),
            parent: self.parent.clone(),
            child_index,
            local_blocks: local,
            outcome: r.outcome,
            path: r.path,
            after: self.submitted.elapsed(),
        }
    }
}

/// Reports of every pull, for `DecodeAgent.poll_reports` (when the agent queues them).
#[derive(Default)]
struct Queue {
    reports: Mutex<VecDeque<ReportData>>,
    arrived: Condvar,
}

/// What the Python `DecodeAgent` and its pulls' forwarder tasks share.
struct Shared {
    queue: Option<Queue>,
    pulls: Mutex<TrackedPulls>,
    next_id: AtomicU64,
    /// The pulls' forwarder tasks: a shutdown waits for them after the agent's own, so
    /// every report reached its `Pull` before the runtime (and any task on it) is dropped.
    forwarders: TaskTracker,
}

/// The pulls `DecodeAgent.cancel` may find a child in: weak, so a finished pull whose
/// `Pull` Python dropped is not kept; the dead ones are pruned as pulls are added (whenever
/// the list has doubled since the last pruning), so a long-running worker's list stays
/// about the size of its live pulls.
#[derive(Default)]
struct TrackedPulls {
    pulls: Vec<Weak<PullState>>,
    prune_at: usize,
}

impl TrackedPulls {
    /// Fewest entries worth a pruning pass.
    const MIN_PRUNE: usize = 64;

    fn push(&mut self, pull: &Arc<PullState>) {
        if self.pulls.len() >= self.prune_at.max(Self::MIN_PRUNE) {
            self.pulls.retain(|w| w.strong_count() > 0);
            self.prune_at = 2 * self.pulls.len();
        }
        self.pulls.push(Arc::downgrade(pull));
    }

    fn live(&mut self) -> Vec<Arc<PullState>> {
        self.pulls.retain(|w| w.strong_count() > 0);
        self.prune_at = 2 * self.pulls.len();
        self.pulls.iter().filter_map(Weak::upgrade).collect()
    }
}

/// Moves a pull's reports into its state (and the agent's queue) as children finish.
async fn forward(mut handle: kvxfer::PullHandle, state: Arc<PullState>, shared: Arc<Shared>) {
    while let Some(r) = handle.next().await {
        let data = state.report(r);
        // `Pull.wait` waits for the totals below: no wake-up of it per report.
        state.lock().reports.push(data.clone());
        if let Some(q) = &shared.queue {
            q.reports.lock().unwrap_or_else(|p| p.into_inner()).push_back(data);
            q.arrived.notify_all();
        }
    }
    let PullReport { wire_bytes, delivered_bytes, elapsed, .. } = handle.finished().await;
    state.lock().totals = Some((wire_bytes, delivered_bytes, elapsed));
    state.changed.notify_all();
}

/// A decode worker's agent: pulls children's KV blocks from prefill agents straight into
/// its registered memory and notifies. Do not touch a destination block until its child
/// reported.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub(crate) struct DecodeAgent {
    host: Hosted<kvxfer::DecodeAgent>,
    shared: Arc<Shared>,
    keeper: Arc<Keeper>,
    consumer_id: String,
}

impl DecodeAgent {
    fn agent(&self, py: Python<'_>) -> PyResult<(Arc<kvxfer::DecodeAgent>, tokio::runtime::Handle)> {
        self.host.get(py)
    }

    fn live_pulls(&self) -> Vec<Arc<PullState>> {
        self.shared.pulls.lock().unwrap_or_else(|p| p.into_inner()).live()
    }
}

/// Children of one parent with their local blocks.
type Children<L> = Vec<(ChildHandoff, L)>;

/// The hand-offs of `children`, checked to be distinct children of one parent, sorted by
/// child index, with their local block lists.
fn parse_children<L>(
    py: Python<'_>,
    children: &[Bound<'_, PyAny>],
    local_blocks: Vec<L>,
) -> PyResult<(String, Children<L>)> {
    let submit_err = |kind: &str, msg: String| submit_error(py, kind, msg);
    if children.is_empty() {
        return Err(submit_err("nothing_selected", "submit: no children given".into()));
    }
    if children.len() != local_blocks.len() {
        return Err(submit_err(
            "local_block_lists",
            format!("submit: {} children but {} lists of local blocks", children.len(), local_blocks.len()),
        ));
    }
    let mut pairs = Vec::with_capacity(children.len());
    for (i, (c, local)) in children.iter().zip(local_blocks).enumerate() {
        pairs.push((handoff_from_py(c, &format!("children[{i}]: "))?, local));
    }
    let parent = pairs[0].0.parent_request_id().to_owned();
    if let Some((h, _)) = pairs.iter().find(|(h, _)| h.parent_request_id() != parent) {
        return Err(submit_err(
            "mixed_parents",
            format!(
                "submit: children of several parents ({parent} and {}); submit one pull per parent",
                h.parent_request_id()
            ),
        ));
    }
    pairs.sort_by_key(|(h, _)| h.child_index());
    if let Some(w) = pairs.windows(2).find(|w| w[0].0.child_index() == w[1].0.child_index()) {
        return Err(submit_err(
            "bad_child",
            format!("submit: child {} of {parent} is given twice", w[0].0.child_index()),
        ));
    }
    Ok((parent, pairs))
}

#[pymethods]
impl DecodeAgent {
    /// Starts an agent pulling into `memory` (which it takes over). `queue_reports=True`
    /// also queues every child's report for `poll_reports` / `wait_reports` (then take
    /// them: they stay queued until taken). Durations are in seconds.
    #[new]
    #[pyo3(signature = (
        memory, *, agent_name = "decode", engine_id = None, rank = 0, kv_shape = None, consumer_id = None,
        cluster_key = None,
        io_timeout = 10.0, worker_threads = 2, connections_per_peer = 2, heartbeat_interval = None,
        transport = "auto", ucx_tls = None, ucx_peer_failure_handling = None, shutdown_grace = 5.0, queue_reports = false, notify_with_read = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        memory: &Memory,
        agent_name: &str,
        engine_id: Option<&str>,
        rank: u32,
        kv_shape: Option<Bound<'_, KvShape>>,
        consumer_id: Option<&str>,
        cluster_key: Option<&str>,
        io_timeout: f64,
        worker_threads: usize,
        connections_per_peer: usize,
        heartbeat_interval: Option<f64>,
        transport: &str,
        ucx_tls: Option<&str>,
        ucx_peer_failure_handling: Option<bool>,
        shutdown_grace: f64,
        queue_reports: bool,
        notify_with_read: bool,
    ) -> PyResult<Self> {
        let mut config = base_config(
            py,
            agent_name,
            engine_id,
            rank,
            cluster_key,
            io_timeout,
            worker_threads,
            (transport, ucx_tls, ucx_peer_failure_handling),
            shutdown_grace,
        )?;
        if let Some(shape) = kv_shape {
            config = apply_shape(py, config, shape.get(), memory, (rank, 1))?;
        }
        if let Some(id) = consumer_id {
            config = config.consumer_id(id);
        }
        config = config.connections_per_peer(connections_per_peer).notify_with_read(notify_with_read);
        config.heartbeat_interval =
            heartbeat_interval.map(|h| seconds(py, "heartbeat_interval", h)).transpose()?;
        let memory = memory.take(py)?;
        let keeper_hello = v1::Hello {
            protocol_version: config.protocol_version,
            engine_id: config.engine_id.clone(),
            agent_name: format!("{agent_name}-keeper"),
            compat_hash: kvxfer_core::groups_compat_hash(memory.group_layouts()),
            layout: Some(memory.layout().to_wire()),
            other_group_layouts: memory.group_layouts().skip(1).map(|l| l.to_wire()).collect(),
            kv_shape: config.kv_shape.as_ref().map(kvxfer_core::KvShapeSpec::to_wire),
            transports: vec![v1::TransportOffer {
                transport: v1::Transport::Tcp as i32,
                connection_info: vec![],
            }],
            ..Default::default()
        };
        let keeper = Arc::new(Keeper::new(keeper_hello, config.cluster_key.clone(), config.limits));
        let rt = runtime(py, agent_name, worker_threads)?;
        let handle = rt.handle().clone();
        let started = py.detach(|| rt.block_on(kvxfer::DecodeAgent::start_on(handle, config, memory)));
        let agent = started.map_err(|e| to_py(py, e))?;
        let consumer_id = agent.consumer_id().to_owned();
        let shared = Arc::new(Shared {
            queue: queue_reports.then(Queue::default),
            pulls: Mutex::new(TrackedPulls::default()),
            next_id: AtomicU64::new(1),
            forwarders: TaskTracker::new(),
        });
        Ok(DecodeAgent { host: Hosted::new(agent, rt, "decode agent"), shared, keeper, consumer_id })
    }

    /// How many pulls the agent keeps track of for `cancel` (finished ones are pruned as new
    /// ones come): for tests.
    #[getter]
    fn _tracked_pulls(&self) -> usize {
        self.shared.pulls.lock().unwrap_or_else(|p| p.into_inner()).pulls.len()
    }

    /// The consumer id this agent notifies with (`"{engine_id}/{rank}"` by default).
    #[getter]
    fn consumer_id(&self) -> &str {
        &self.consumer_id
    }

    /// Whether the agent started UCX (it pulls over UCX from peers that offer it).
    #[getter]
    fn has_ucx(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.agent(py)?.0.has_ucx())
    }

    /// Pulls `children` — `kv_transfer_params` dicts of children of one parent: all of them,
    /// or any subset (a child that arrived alone is pulled alone) — into `local_blocks[i]`
    /// for `children[i]` (one local block per remote block; for a cache of several KV-cache
    /// groups one list per group). Returns at once; the pull runs on the agent's threads.
    /// Blocks siblings share cross the wire once.
    fn submit(
        &self,
        py: Python<'_>,
        children: Vec<Bound<'_, PyAny>>,
        local_blocks: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Pull> {
        let local_blocks = BlockLists::extract_each(&local_blocks)?;
        let (parent, pairs) = parse_children(py, &children, local_blocks)?;
        // The pull covers exactly these children: renumbered 0..k (k = how many), their
        // reports mapped back to the prefill side's indices.
        let (results, info) =
            renumbered(py, &parent, pairs.into_iter().map(|(h, l)| (vec![h], l)).collect())?;
        let Some(result) = results.into_iter().next() else {
            return Err(submit_error(py, "nothing_selected", "submit: no children given"));
        };
        let local = info.iter().map(|c| c.local.groups()).collect();
        let (agent, rt) = self.agent(py)?;
        let submitted = Instant::now();
        // Planning a parent's reads takes milliseconds at thousands of blocks: without the GIL.
        let handle = py.detach(|| agent.submit_groups(result, local)).map_err(|e| to_py(py, e))?;
        Ok(self.track(parent, info, handle, submitted, &rt))
    }

    /// Pulls children of one parent from a prefill engine of another tensor-parallel size
    /// (or block size): `ranks[r]` are the children's `kv_transfer_params` dicts as prefill
    /// rank `r` handed them off (every rank, in rank order; the same children from each),
    /// `local_blocks[i]` the local blocks of the i-th child of `ranks[0]` (one list per
    /// KV-cache group for several groups; `ceil(remote / block_ratio)` blocks per group).
    /// Needs the agent's `kv_shape`; each prefill rank's shape comes from its handshake, and
    /// this rank reads its head slice of every block (or assembles its blocks from several
    /// ranks). Returns at once; reports name each child by prefill rank 0's
    /// `remote_request_id`.
    fn submit_ranks(
        &self,
        py: Python<'_>,
        ranks: Vec<Vec<Bound<'_, PyAny>>>,
        local_blocks: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Pull> {
        let local_blocks = BlockLists::extract_each(&local_blocks)?;
        let submit_err = |kind: &str, msg: String| submit_error(py, kind, msg);
        if ranks.is_empty() {
            return Err(submit_err("nothing_selected", "submit_ranks: no prefill ranks given".into()));
        }
        let (parent, first) = parse_children(py, &ranks[0], local_blocks)?;
        let mut per_child: Vec<(Vec<ChildHandoff>, BlockLists)> =
            first.into_iter().map(|(h, l)| (vec![h], l)).collect();
        for (r, children) in ranks.iter().enumerate().skip(1) {
            let units = vec![(); children.len()];
            let (p, pairs) = parse_children(py, children, units)?;
            let same = p == parent
                && pairs.len() == per_child.len()
                && pairs.iter().zip(&per_child).all(|((h, _), (f, _))| h.child_index() == f[0].child_index());
            if !same {
                return Err(submit_err(
                    "mixed_parents",
                    format!("submit_ranks: ranks[{r}] does not hand off the same children of {parent} as ranks[0]"),
                ));
            }
            for ((h, _), (hs, _)) in pairs.into_iter().zip(per_child.iter_mut()) {
                hs.push(h);
            }
        }
        let (results, info) = renumbered(py, &parent, per_child)?;
        let local = info.iter().map(|c| c.local.groups()).collect();
        let (agent, rt) = self.agent(py)?;
        let submitted = Instant::now();
        let handle = py.detach(|| agent.submit_ranks(results, local)).map_err(|e| to_py(py, e))?;
        Ok(self.track(parent, info, handle, submitted, &rt))
    }

    /// Reports queued since the last call, without waiting (needs `queue_reports=True`):
    /// one dict per child, as children finish (see `Pull.poll`).
    fn poll_reports<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let q = self.queue(py)?;
        let taken: Vec<ReportData> = q.reports.lock().unwrap_or_else(|p| p.into_inner()).drain(..).collect();
        taken.iter().map(|r| r.to_dict(py)).collect()
    }

    /// Waits up to `timeout` seconds (GIL released) for at least one queued report, then
    /// returns every queued one (none on timeout). Needs `queue_reports=True`.
    #[pyo3(signature = (timeout = 10.0))]
    fn wait_reports<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let timeout = seconds(py, "timeout", timeout)?;
        let shared = self.shared.clone();
        self.queue(py)?;
        let taken = py.detach(move || {
            let Some(q) = &shared.queue else { return Vec::new() };
            let deadline = Instant::now() + timeout;
            let mut reports = q.reports.lock().unwrap_or_else(|p| p.into_inner());
            while reports.is_empty() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                reports = q.arrived.wait_timeout(reports, left).unwrap_or_else(|p| p.into_inner()).0;
            }
            reports.drain(..).collect::<Vec<_>>()
        });
        taken.iter().map(|r| r.to_dict(py)).collect()
    }

    /// Cancels the child with this `remote_request_id` in whichever pull of this agent still
    /// under way has it: its lease is released (or ends as it already had), and its local
    /// blocks are not written after its report. Returns whether such a pull had it.
    fn cancel(&self, remote_request_id: &str) -> bool {
        // Pulls still under way, newest first: a request retried under its id is the latest
        // pull naming it (a finished one Python still holds may name it too).
        for pull in self.live_pulls().into_iter().rev().filter(|p| p.lock().totals.is_none()) {
            if let Some(j) = pull
                .children
                .iter()
                .position(|c| c.remote_request_ids.iter().any(|id| id == remote_request_id))
            {
                pull.canceller.cancel_child(j as u32);
                return true;
            }
        }
        false
    }

    /// Keeps the leases of `children` (`kv_transfer_params` dicts) alive while their pulls
    /// have not started (requests waiting in the decode queue): one heartbeat per prefill
    /// agent, extending each lease as a pull's own heartbeats do. Returns at once unless
    /// `wait` is true; then waits (GIL released, at most `timeout` s) and returns one outcome
    /// per child: "extended", "unrecognized", "already_pulled", "already_released",
    /// "already_expired", or "error" (the prefill agent could not be reached); an empty list
    /// when the answer did not come within `timeout` or the agent was shut down meanwhile.
    #[pyo3(signature = (children, *, wait = false, timeout = 10.0))]
    fn heartbeat(
        &self,
        py: Python<'_>,
        children: Vec<Bound<'_, PyAny>>,
        wait: bool,
        timeout: f64,
    ) -> PyResult<Option<Vec<&'static str>>> {
        let timeout = seconds(py, "timeout", timeout)?;
        let mut handoffs = Vec::with_capacity(children.len());
        for (i, c) in children.iter().enumerate() {
            handoffs.push(handoff_from_py(c, &format!("children[{i}]: "))?);
        }
        let (_, rt) = self.agent(py)?;
        let keeper = self.keeper.clone();
        let answer = spawn_answering(&rt, async move { keeper.heartbeat(&handoffs).await });
        if !wait {
            return Ok(None);
        }
        // Empty when the answer did not come in time or the agent was shut down meanwhile.
        let outcomes = py.detach(move || answer.recv_timeout(timeout).unwrap_or_default());
        Ok(Some(outcomes))
    }

    /// Releases the leases of `children` (`kv_transfer_params` dicts) this agent will not
    /// pull — requests aborted while they waited in the decode queue, or whose blocks all
    /// hit the local prefix cache — so the prefill side frees their blocks now instead of at
    /// expiry. Do not release a child a pull of this agent is reading (cancel it instead).
    /// Returns at once unless `wait` is true; then waits (GIL released, at most `timeout` s)
    /// and returns per child whether the prefill side released the lease (False: it had
    /// been pulled or had expired, was unknown there, or the prefill agent could not be
    /// reached — it then ends by expiry if it has not ended). Raises `TimeoutError` when
    /// not every answer came within `timeout` (the releases still go on), `AgentClosedError`
    /// when the agent was shut down before they came. Counted in `stats()` as
    /// `leases_released` / `releases_refused`.
    #[pyo3(signature = (children, *, wait = false, timeout = 10.0))]
    fn release(
        &self,
        py: Python<'_>,
        children: Vec<Bound<'_, PyAny>>,
        wait: bool,
        timeout: f64,
    ) -> PyResult<Option<Vec<bool>>> {
        let timeout = seconds(py, "timeout", timeout)?;
        let mut handoffs = Vec::with_capacity(children.len());
        for (i, c) in children.iter().enumerate() {
            handoffs.push(handoff_from_py(c, &format!("children[{i}]: "))?);
        }
        let (agent, rt) = self.agent(py)?;
        let answer = spawn_answering(&rt, async move {
            futures::future::join_all(handoffs.iter().map(|h| agent.release(h))).await
        });
        if !wait {
            return Ok(None);
        }
        match py.detach(move || answer.recv_timeout(timeout)) {
            Ok(released) => Ok(Some(released)),
            Err(RecvTimeoutError::Disconnected) => Err(raise::<AgentClosedError>(
                py,
                "release: the decode agent was shut down before every answer came".into(),
                &[],
            )),
            Err(RecvTimeoutError::Timeout) => Err(pyo3::exceptions::PyTimeoutError::new_err(format!(
                "release: not every prefill agent answered within {timeout:?}"
            ))),
        }
    }

    /// Blocks of failed-and-held children (a one-sided read that could not be stopped) that
    /// are free again, without waiting: dicts with `parent_request_id`, `children`,
    /// `local_blocks` (as the reports give them: a list, or for a memory of several KV-cache
    /// groups one list per group). (The TCP data path never holds blocks.)
    fn poll_reclaimed<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let (agent, _) = self.agent(py)?;
        // The engine numbers the blocks of several groups in one flat space: group g's block
        // b is `base[g] + b`, `base[g]` the blocks of the groups before it.
        let bases: Vec<u64> = agent
            .memory()
            .group_layouts()
            .scan(0u64, |next, l| {
                let base = *next;
                *next += u64::from(l.num_blocks());
                Some(base)
            })
            .collect();
        agent
            .reclaimed()
            .try_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("parent_request_id", r.parent_request_id)?;
                d.set_item("children", r.children)?;
                if bases.len() > 1 {
                    let mut groups = vec![Vec::<u64>::new(); bases.len()];
                    for flat in r.local_blocks.iter().map(|&b| u64::from(b)) {
                        let g = bases.partition_point(|&base| base <= flat).saturating_sub(1);
                        groups[g].push(flat - bases[g]);
                    }
                    d.set_item("local_blocks", groups)?;
                } else {
                    d.set_item("local_blocks", r.local_blocks)?;
                }
                Ok(d)
            })
            .collect()
    }

    /// Counters (every field of the engine's `DecodeStats`): pulls, children done / failed /
    /// cancelled, bytes pulled and delivered, unacknowledged notifications, connections,
    /// control and read retries, integrity failures, leases released without pulling
    /// (`leases_released`, `releases_refused`), reads that carried their notify, pipelined
    /// batches (`read_batches`, `reads_batched`, `reads_after_broken_batch`), UCX endpoints
    /// held open (`ucx_endpoints`), and the queued-lease heartbeats (`keeper_*`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (agent, _) = self.agent(py)?;
        // Destructured in full: a counter added to the engine fails to compile here until
        // it is exposed.
        let kvxfer::DecodeStats {
            pulls,
            children_done,
            children_failed,
            children_cancelled,
            bytes_pulled,
            bytes_delivered,
            notifications_unacknowledged,
            connections_opened,
            peers,
            auth_failures,
            control_retries,
            children_blocks_held,
            bytes_pulled_ucx,
            bytes_pulled_tcp,
            integrity_failures,
            integrity_failures_ucx,
            integrity_failures_tcp,
            peers_invalidated,
            read_retries,
            leases_released,
            releases_refused,
            notifies_with_read,
            read_batches,
            reads_batched,
            reads_after_broken_batch,
            ucx_endpoints,
        } = agent.stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("pulls", pulls),
            ("children_done", children_done),
            ("children_failed", children_failed),
            ("children_cancelled", children_cancelled),
            ("children_blocks_held", children_blocks_held),
            ("bytes_pulled", bytes_pulled),
            ("bytes_pulled_ucx", bytes_pulled_ucx),
            ("bytes_pulled_tcp", bytes_pulled_tcp),
            ("bytes_delivered", bytes_delivered),
            ("notifications_unacknowledged", notifications_unacknowledged),
            ("connections_opened", connections_opened),
            ("peers", peers),
            ("peers_invalidated", peers_invalidated),
            ("auth_failures", auth_failures),
            ("control_retries", control_retries),
            ("read_retries", read_retries),
            ("integrity_failures", integrity_failures),
            ("integrity_failures_ucx", integrity_failures_ucx),
            ("integrity_failures_tcp", integrity_failures_tcp),
            ("leases_released", leases_released),
            ("releases_refused", releases_refused),
            ("notifies_with_read", notifies_with_read),
            ("read_batches", read_batches),
            ("reads_batched", reads_batched),
            ("reads_after_broken_batch", reads_after_broken_batch),
            ("ucx_endpoints", ucx_endpoints),
        ] {
            d.set_item(k, v)?;
        }
        for (k, v) in self.keeper.stats() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Shuts the agent down (GIL released): takes no new pulls, lets pulls finish (up to
    /// `shutdown_grace`), then aborts their reads; every lease is notified or cancelled
    /// (each exchange bounded by `io_timeout`), and every child of every pull has reported
    /// when it returns. Later calls return at once.
    fn shutdown(&self, py: Python<'_>) {
        let (keeper, shared) = (self.keeper.clone(), self.shared.clone());
        py.detach(|| self.host.shutdown(|a| close(a, keeper, shared)));
    }

    /// Whether the agent was shut down.
    #[getter]
    fn closed(&self) -> bool {
        self.host.is_closed()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.shutdown(py);
    }
}

/// The children `(hand-off per prefill rank, local blocks)` of `parent`, sorted by child
/// index, renumbered 0..k (k = how many): one `PrefillResult` per prefill rank covering
/// exactly these children, and what the reports map back to the prefill side's terms.
fn renumbered(
    py: Python<'_>,
    parent: &str,
    children: Vec<(Vec<ChildHandoff>, BlockLists)>,
) -> PyResult<(Vec<PrefillResult>, Vec<PullChild>)> {
    let k = children.len() as u32;
    let ranks = children.first().map_or(0, |(hs, _)| hs.len());
    let mut per_rank: Vec<Vec<ChildHandoff>> = vec![Vec::with_capacity(children.len()); ranks];
    let mut info = Vec::with_capacity(children.len());
    for (j, (hs, l)) in (0u32..).zip(children) {
        info.push(PullChild {
            child_index: hs.first().map_or(0, ChildHandoff::child_index),
            remote_request_ids: hs.iter().map(|h| h.remote_request_id().to_owned()).collect(),
            local: LocalBlocks::from(l),
        });
        for (h, rank) in hs.into_iter().zip(per_rank.iter_mut()) {
            let mut wire = h.to_wire();
            wire.child_index = j;
            wire.n = k;
            rank.push(ChildHandoff::from_wire(wire).map_err(|e| to_py(py, e.into()))?);
        }
    }
    let results = per_rank
        .into_iter()
        .map(|hs| PrefillResult::new(parent.to_owned(), k, hs).map_err(|e| to_py(py, e.into())))
        .collect::<PyResult<_>>()?;
    Ok((results, info))
}

impl DecodeAgent {
    /// Tracks a submitted pull: its state, and the task forwarding its reports.
    fn track(
        &self,
        parent: String,
        children: Vec<PullChild>,
        handle: kvxfer::PullHandle,
        submitted: Instant,
        rt: &tokio::runtime::Handle,
    ) -> Pull {
        let state = Arc::new(PullState {
            id: self.shared.next_id.fetch_add(1, Ordering::Relaxed),
            parent,
            children,
            canceller: handle.canceller(),
            submitted,
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
        });
        self.shared.pulls.lock().unwrap_or_else(|p| p.into_inner()).push(&state);
        self.shared.forwarders.spawn_on(forward(handle, state.clone(), self.shared.clone()), rt);
        Pull { state }
    }

    fn queue(&self, py: Python<'_>) -> PyResult<&Queue> {
        self.shared.queue.as_ref().ok_or_else(|| {
            raise::<ConfigError>(
                py,
                "reports are queued only by agents made with queue_reports=True".into(),
                &[],
            )
        })
    }
}

impl Drop for DecodeAgent {
    fn drop(&mut self) {
        let (keeper, shared) = (self.keeper.clone(), self.shared.clone());
        self.host.shutdown_detached(|a| close(a, keeper, shared));
    }
}

/// The agent's graceful shutdown, then its pulls' forwarders (every report delivered to its
/// `Pull`), then the keeper's connections.
async fn close(agent: Arc<kvxfer::DecodeAgent>, keeper: Arc<Keeper>, shared: Arc<Shared>) {
    agent.shutdown().await;
    shared.forwarders.close();
    shared.forwarders.wait().await;
    keeper.close().await;
}

/// A pull under way: its children's reports, and cancelling children. Dropping it does not
/// stop the pull.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub(crate) struct Pull {
    state: Arc<PullState>,
}

impl Pull {
    fn sorted(reports: &[ReportData]) -> Vec<ReportData> {
        let mut v = reports.to_vec();
        v.sort_by_key(|r| r.child_index);
        v
    }
}

#[pymethods]
impl Pull {
    /// This pull's id (the `pull` of its reports).
    #[getter]
    fn id(&self) -> u64 {
        self.state.id
    }

    /// The parent request id.
    #[getter]
    fn parent_request_id(&self) -> &str {
        &self.state.parent
    }

    /// The `remote_request_id`s of the children this pull covers, by child index.
    #[getter]
    fn children(&self) -> Vec<String> {
        self.state.children.iter().filter_map(|c| c.remote_request_ids.first().cloned()).collect()
    }

    /// Whether every child reported.
    #[getter]
    fn done(&self) -> bool {
        self.state.lock().totals.is_some()
    }

    /// Bytes that crossed the wire (once done; else None).
    #[getter]
    fn wire_bytes(&self) -> Option<u64> {
        self.state.lock().totals.map(|t| t.0)
    }

    /// Bytes delivered into local blocks (wire and sibling copies; once done).
    #[getter]
    fn delivered_bytes(&self) -> Option<u64> {
        self.state.lock().totals.map(|t| t.1)
    }

    /// Seconds from submit to the last report (once done).
    #[getter]
    fn elapsed(&self) -> Option<f64> {
        self.state.lock().totals.map(|t| t.2.as_secs_f64())
    }

    /// Cancels child `child_index` (the prefill side's index): its lease is released now
    /// (or once reads siblings need from it finish); its local blocks are not written after
    /// its report. Ignored once it reported.
    fn cancel_child(&self, py: Python<'_>, child_index: u32) -> PyResult<()> {
        let Some(j) = self.state.children.iter().position(|c| c.child_index == child_index) else {
            return Err(submit_error(
                py,
                "bad_child",
                format_args!("pull of {} has no child {child_index}", self.state.parent),
            ));
        };
        self.state.canceller.cancel_child(j as u32);
        Ok(())
    }

    /// Reports that arrived since the last `poll()`, without waiting.
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let fresh: Vec<ReportData> = {
            let mut p = self.state.lock();
            let fresh = p.reports[p.polled..].to_vec();
            p.polled = p.reports.len();
            fresh
        };
        fresh.iter().map(|r| r.to_dict(py)).collect()
    }

    /// Waits (GIL released) until every child reported and returns all reports, child 0
    /// first: dicts with `remote_request_id`, `child_index`, `outcome` ("done", "failed",
    /// "cancelled", "failed_blocks_held"), `local_blocks`, `seconds` (from submit to the
    /// report), and `error` (a `PullError`
    /// instance with `kind` and `advice`, for failed children). Raises `TimeoutError` after
    /// `timeout` seconds (None: no limit).
    #[pyo3(signature = (timeout = None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let timeout = timeout.map(|t| seconds(py, "timeout", t)).transpose()?;
        let state = self.state.clone();
        let reports = py.detach(move || {
            let deadline = timeout.map(|t| Instant::now() + t);
            let mut p = state.lock();
            while p.totals.is_none() {
                match deadline {
                    None => p = state.changed.wait(p).unwrap_or_else(|e| e.into_inner()),
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return None;
                        }
                        p = state.changed.wait_timeout(p, left).unwrap_or_else(|e| e.into_inner()).0;
                    }
                }
            }
            Some(Pull::sorted(&p.reports))
        });
        match reports {
            Some(r) => r.iter().map(|r| r.to_dict(py)).collect(),
            None => Err(pyo3::exceptions::PyTimeoutError::new_err(format!(
                "pull of {} did not finish within {timeout:?}",
                self.state.parent
            ))),
        }
    }

    fn __repr__(&self) -> String {
        let p = self.state.lock();
        format!(
            "Pull({} of {}: {}/{} children reported)",
            self.state.id,
            self.state.parent,
            p.reports.len(),
            self.state.children.len()
        )
    }
}

/// Runs `work` on the agent's runtime and returns a channel its output arrives on. A caller
/// waits on the channel, never on the runtime: a shutdown racing the wait (the runtime
/// stops, the task is dropped) ends the wait with `Disconnected` instead of a panic.
fn spawn_answering<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> Receiver<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    rt.spawn(async move {
        let _ = tx.send(work.await);
    });
    rx
}
