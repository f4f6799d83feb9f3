//! The prefill agent: leases, serves reads, applies notifications, runs expiry.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvxfer_core::log;
use kvxfer_core::{
    CancelOutcome, ChildHandoff, EndKind, EngineInfo, LeaseConfig, LeaseEnd, LeaseRequest, LeaseStats,
    LeaseTable, ParentStatus, ParentTracker, PrefillResult, RetractOutcome,
};
use kvxfer_mem::KvMemory;
use kvxfer_tcp::{Admit, Refusal, ServeContext, ServerCounters, ServerStats};
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::crc_precompute::{Pending, Precompute};
use crate::{AgentConfig, Error};

/// How `make_lease` makes a lease: leased here, or armed with an id and token minted
/// elsewhere (the second phase of a two-phase lease, which a drain does not refuse).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Making {
    Lease,
    Arm,
}

impl Making {
    /// What the log says was done.
    fn done(self) -> &'static str {
        match self {
            Making::Lease => "leased",
            Making::Arm => "armed",
        }
    }
}

/// Counters of a prefill agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillStats {
    /// Leases: made, pulled, released, expired, live; unrecognized notifications; bad tokens.
    pub leases: LeaseStats,
    /// Connections: bytes and reads served, refusals, protocol errors.
    pub server: ServerStats,
    /// Connections open now whose handshake verified (served; refused ones and those still
    /// in their handshake are not counted).
    pub connections_open: u64,
}

/// What a prefill agent's tasks share.
struct Shared {
    table: Arc<LeaseTable>,
    memory: Arc<KvMemory>,
    counters: Arc<ServerCounters>,
    /// Connections being served now.
    connections_open: Arc<AtomicU64>,
    tracker: Arc<Mutex<ParentTracker>>,
    /// Wakes the expiry task (a new lease may have an earlier deadline).
    wake: Arc<Notify>,
    /// The deadline the expiry task sleeps until (`None`: none, or being recomputed): a new
    /// lease wakes it only when it would expire first, not on every lease.
    expiry_armed: Mutex<Option<Instant>>,
    /// Set by `shutdown`: the accept loop stops.
    stop_accepting: CancellationToken,
    /// Set once reads and pins had their grace: connections close, the expiry task and the
    /// event forwarder finish.
    stop: CancellationToken,
    /// Set once every connection is gone: the event forwarder delivers what is left and ends.
    events_final: CancellationToken,
    connections: TaskTracker,
    tasks: TaskTracker,
    grace: Duration,
    /// Dropped after every connection (no connection can pin any more), before the memory,
    /// and never on a runtime thread (it joins UCX's thread).
    #[cfg(feature = "ucx")]
    ucx: Mutex<Option<crate::runtime::DropOffRuntime<kvxfer_ucx::UcxTarget>>>,
    /// The etcd registration and the metrics, when configured.
    #[cfg(feature = "cluster")]
    cluster: Option<crate::cluster::PrefillCluster>,
    /// Set by [`PrefillAgent::drain`]: no new leases.
    draining: AtomicBool,
    /// The engine id, for the draining refusal.
    engine_id: String,
    /// The CRC-32C precompute of new leases (`AgentConfig::precompute_crcs`).
    crcs: Option<crate::crc_precompute::Precompute>,
}

/// A prefill worker's agent: owns the lease table and serves the registered KV cache. Runs
/// on the tokio runtime it was started on (it starts no threads of its own except its front
/// door, `AgentConfig::front_door_nice`, and UCX's progress thread);
/// [`crate::blocking::PrefillAgent`] is the same agent with a runtime of its own, for
/// callers without one.
pub struct PrefillAgent {
    shared: Arc<Shared>,
    events: Receiver<LeaseEnd>,
    events_ready: Arc<Notify>,
    handle: Handle,
    addr: SocketAddr,
    host: String,
    incarnation: u64,
}

impl std::fmt::Debug for PrefillAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillAgent").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl PrefillAgent {
    /// Starts an agent over `memory` on the current tokio runtime, listening on `listen`
    /// (port 0 picks a free port).
    ///
    /// # Panics
    /// Outside a tokio runtime (use [`Self::start_on`] or [`crate::blocking::PrefillAgent`]).
    pub async fn start(config: AgentConfig, listen: &str, memory: KvMemory) -> Result<Self, Error> {
        Self::start_on(Handle::current(), config, listen, memory).await
    }

    /// Starts an agent over `memory` on the runtime of `handle`, listening on `listen`.
    pub async fn start_on(
        handle: Handle,
        config: AgentConfig,
        listen: &str,
        memory: KvMemory,
    ) -> Result<Self, Error> {
        let config = config.for_memory(&memory)?;
        let memory = Arc::new(memory);
        #[cfg(feature = "ucx")]
        let ucx = {
            let m = memory.clone();
            crate::ucx::start_off_runtime(&handle, &config, move |u| crate::ucx::start_target(u, &m)).await?
        };
        Self::build(
            handle,
            config,
            listen,
            memory,
            #[cfg(feature = "ucx")]
            ucx,
        )
    }

    /// Starts an agent on `handle` from a thread that may block (the blocking facade).
    pub(crate) fn start_blocking(
        handle: Handle,
        config: AgentConfig,
        listen: &str,
        memory: KvMemory,
    ) -> Result<Self, Error> {
        let config = config.for_memory(&memory)?;
        let memory = Arc::new(memory);
        #[cfg(feature = "ucx")]
        let ucx = crate::ucx::start_if_wanted(&config, |u| crate::ucx::start_target(u, &memory))?;
        Self::build(
            handle,
            config,
            listen,
            memory,
            #[cfg(feature = "ucx")]
            ucx,
        )
    }

    fn build(
        handle: Handle,
        config: AgentConfig,
        listen: &str,
        memory: Arc<KvMemory>,
        #[cfg(feature = "ucx")] ucx: Option<kvxfer_ucx::UcxTarget>,
    ) -> Result<Self, Error> {
        // Bound without the runtime's resolver: listen addresses are local.
        let std_listener = std::net::TcpListener::bind(listen)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| Error::Io { what: format!("binding {listen}"), source })?;
        // Registered with the agent's runtime once, so a runtime without I/O fails here, not
        // in the accept loop; the loop registers it again where it runs (the front door).
        let std_listener = {
            let _enter = handle.enter();
            TcpListener::from_std(std_listener)
                .and_then(TcpListener::into_std)
                .map_err(|source| Error::Io { what: format!("binding {listen}"), source })?
        };
        let addr = std_listener
            .local_addr()
            .map_err(|source| Error::Io { what: "reading the listen address".into(), source })?;
        let host = advertise_host(config.advertise_host.as_deref(), addr)?;
        // Random per process, below 2^53 so it is exact wherever JSON numbers are doubles.
        let incarnation = (rand::random::<u64>() & ((1 << 53) - 1)).max(1);
        let engine = EngineInfo {
            engine_id: config.engine_id.clone(),
            host: host.clone(),
            port: addr.port(),
            tp_size: config.tp_size,
            incarnation,
        };
        let layout = memory.layout().clone();
        let mut lease_config = LeaseConfig::new(engine, layout.num_blocks());
        // Every further KV-cache group's blocks; leases then name one list per group.
        lease_config.other_group_blocks = memory.group_layouts().skip(1).map(|l| l.num_blocks()).collect();
        if !lease_config.flat_ids_fit() {
            return Err(Error::Unsupported(format!(
                "the KV-cache groups hold {} blocks together: more than block ids can number",
                memory.group_layouts().map(|l| u64::from(l.num_blocks())).sum::<u64>()
            )));
        }
        lease_config.default_ttl = config.lease_ttl;
        lease_config.max_lifetime = config.max_lease_lifetime;
        lease_config.max_children = config.max_children;
        let mut seed = [0u8; 32];
        rand::fill(&mut seed);
        let table = Arc::new(LeaseTable::new(lease_config, seed));
        let ended = Arc::new(Notify::new());
        {
            let ended = ended.clone();
            table.set_end_hook(move || ended.notify_one());
        }
        // Frames naming a lease not armed yet wait for the next lease (`Limits::arm_wait`).
        let leases_made = Arc::new(Notify::new());
        {
            let made = leases_made.clone();
            table.set_lease_hook(move || made.notify_waiters());
        }
        let counters = Arc::new(ServerCounters::default());
        #[cfg_attr(not(feature = "ucx"), allow(unused_mut))]
        let mut transports = vec![crate::hello::tcp_offer()];
        #[cfg(feature = "ucx")]
        if let Some(t) = &ucx {
            transports.insert(0, crate::ucx::offer(t));
        }
        let shape = config.checked_shape(&memory)?;
        let mut hello_ack = crate::hello::hello_ack(&config, &memory, transports, incarnation);
        hello_ack.kv_shape = shape.as_ref().map(|s| s.spec().to_wire());
        let ctx = Arc::new(ServeContext {
            shape,
            table: table.clone(),
            memory: memory.clone(),
            hello_ack,
            cluster_key: config.cluster_key.clone(),
            limits: config.limits,
            counters: counters.clone(),
            leases_made,
            budgets: kvxfer_tcp::ServeBudgets::new(&config.limits),
        });
        let connections_open = Arc::new(AtomicU64::new(0));
        #[cfg(feature = "cluster")]
        let cluster = crate::cluster::PrefillCluster::start(
            &handle,
            &config,
            crate::cluster::PrefillSide {
                host: &host,
                port: addr.port(),
                incarnation,
                compat_hash: kvxfer_core::groups_compat_hash(memory.group_layouts()),
                #[cfg(feature = "ucx")]
                offers_ucx: ucx.is_some(),
                #[cfg(not(feature = "ucx"))]
                offers_ucx: false,
                table: table.clone(),
                counters: counters.clone(),
                connections_open: connections_open.clone(),
            },
        )?;
        let crcs =
            if config.precompute_crcs { Precompute::start(memory.clone(), counters.clone()) } else { None };
        let shared = Arc::new(Shared {
            table,
            memory: memory.clone(),
            counters,
            connections_open,
            tracker: Arc::new(Mutex::new(ParentTracker::with_forget_after(config.max_lease_lifetime))),
            wake: Arc::new(Notify::new()),
            expiry_armed: Mutex::new(None),
            stop_accepting: CancellationToken::new(),
            stop: CancellationToken::new(),
            events_final: CancellationToken::new(),
            connections: TaskTracker::new(),
            tasks: TaskTracker::new(),
            grace: config.shutdown_grace,
            #[cfg(feature = "ucx")]
            ucx: Mutex::new(ucx.map(crate::runtime::DropOffRuntime::new)),
            #[cfg(feature = "cluster")]
            cluster,
            draining: AtomicBool::new(false),
            engine_id: config.engine_id.clone(),
            crcs,
        });
        let (events_tx, events) = crossbeam_channel::unbounded();
        let events_ready = Arc::new(Notify::new());
        match config.front_door_nice {
            Some(nice) => {
                let gone = crate::front_door::runtime_gone(&handle, &shared.stop);
                let accept = accept_loop(std_listener, ctx, shared.clone(), handle.clone(), gone);
                // Without a thread of its own (it could not start), on the agent's runtime.
                if let Err(accept) = crate::front_door::spawn(nice, shared.tasks.token(), accept) {
                    shared.tasks.spawn_on(accept, &handle);
                }
            }
            None => {
                let accept =
                    accept_loop(std_listener, ctx, shared.clone(), handle.clone(), CancellationToken::new());
                shared.tasks.spawn_on(accept, &handle);
            }
        }
        shared.tasks.spawn_on(expiry_loop(shared.clone()), &handle);
        shared
            .tasks
            .spawn_on(forward_events(shared.clone(), ended, events_tx, events_ready.clone()), &handle);
        shared.tasks.close();
        if config.cluster_key.is_none() {
            crate::hello::warn_unauthenticated("prefill", &config.agent_name);
        }
        info!(%addr, %host, engine_id = %config.engine_id, incarnation, "prefill agent listening");
        Ok(PrefillAgent { shared, events, events_ready, handle, addr, host, incarnation })
    }

    /// The host written into hand-offs: `AgentConfig::advertise_host`, else the listen
    /// address, else (listening on every interface) the address of the default route.
    pub fn advertised_host(&self) -> &str {
        &self.host
    }

    /// This agent process's incarnation: random per start, carried in the handshake and in
    /// every hand-off, so a decode agent tells hand-offs of an earlier process (same engine
    /// id, same address) from this one's.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The address the agent listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The etcd registration's state (`None` without discovery, or after shutdown).
    #[cfg(feature = "cluster")]
    pub fn registration_status(&self) -> Option<crate::cluster::EtcdStatus> {
        self.shared.cluster.as_ref().and_then(crate::cluster::PrefillCluster::registration_status)
    }

    /// Waits until the registration is in etcd, up to `timeout`: `Ok` once registered,
    /// `Err` with the status then (etcd unreachable, or no discovery configured: `None`).
    /// A registration that gave up (state `Failed`: another live process registered the
    /// same engine id and rank first) returns `Err` at once, its `last_error` saying why.
    /// The agent serves either way; this is for callers that hand out hand-offs naming only
    /// the engine id, which decode agents can resolve only once they saw the key.
    #[cfg(feature = "cluster")]
    pub async fn wait_registered(
        &self,
        timeout: Duration,
    ) -> Result<crate::cluster::EtcdStatus, Option<crate::cluster::EtcdStatus>> {
        use crate::cluster::EtcdState;
        let watch = self.shared.cluster.as_ref().and_then(crate::cluster::PrefillCluster::registration_watch);
        let Some(mut watch) = watch else { return Err(None) };
        let ended =
            |s: &crate::cluster::EtcdStatus| matches!(s.state, EtcdState::Connected | EtcdState::Failed);
        match watch.wait_until(timeout, ended).await {
            Ok(s) if s.state == EtcdState::Connected => Ok(s),
            Ok(s) | Err(s) => Err(Some(s)),
        }
    }

    /// The address `/metrics` is served on, when configured.
    #[cfg(feature = "cluster")]
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.shared.cluster.as_ref().and_then(crate::cluster::PrefillCluster::metrics_addr)
    }

    /// The metrics registry the agent feeds, when configured.
    #[cfg(feature = "cluster")]
    pub fn metrics(&self) -> Option<&Arc<crate::cluster::Metrics>> {
        self.shared.cluster.as_ref().and_then(crate::cluster::PrefillCluster::metrics)
    }

    /// Whether the agent offers the UCX data path.
    pub fn offers_ucx(&self) -> bool {
        #[cfg(feature = "ucx")]
        return self.shared.ucx.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        #[cfg(not(feature = "ucx"))]
        false
    }

    /// Starts draining: new leases ([`Self::lease`], [`Self::lease_parent`]) are refused
    /// with [`Error::Draining`] — from the moment this returns — while the leases made
    /// before are still read,
    /// notified, heartbeated, cancelled and expired as usual. With discovery the etcd
    /// record says `"draining":true` too (same key, lease and incarnation), so routers
    /// reading the directory stop sending this engine prefills and decode agents keep their
    /// connections. Putting the engine's drain key `/<ns>/v1/drain/<engine_id>` in etcd
    /// drains it the same way (deleting the key ends that drain). Returns at once.
    pub fn drain(&self) {
        if !self.shared.draining.swap(true, Ordering::Relaxed) {
            info!(engine_id = %self.shared.engine_id, "draining: new leases are refused, existing ones end as usual");
        }
        // A lease being made checks the drain under this lock: once it is released, every
        // later one sees the drain (leases_live then only goes down).
        drop(self.lock_tracker());
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.shared.cluster {
            c.drain(true);
        }
    }

    /// Ends a drain started by [`Self::drain`] (a drain held by the etcd drain key lasts
    /// until the key is deleted).
    pub fn undrain(&self) {
        if self.shared.draining.swap(false, Ordering::Relaxed) {
            info!(engine_id = %self.shared.engine_id, "no longer draining (unless the etcd drain key exists)");
        }
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.shared.cluster {
            c.drain(false);
        }
    }

    /// Whether new leases are refused: [`Self::drain`] was called, or (with discovery) the
    /// engine's etcd drain key exists.
    pub fn is_draining(&self) -> bool {
        #[cfg(feature = "cluster")]
        if self.shared.cluster.as_ref().is_some_and(crate::cluster::PrefillCluster::is_draining) {
            return true;
        }
        self.shared.draining.load(Ordering::Relaxed)
    }

    fn refuse_if_draining(&self) -> Result<(), Error> {
        if self.is_draining() {
            return Err(Error::Draining { engine_id: self.shared.engine_id.clone() });
        }
        Ok(())
    }

    /// The registered KV cache the agent serves.
    pub fn memory(&self) -> &Arc<KvMemory> {
        &self.shared.memory
    }

    /// Leases one child's blocks: the lease is registered before the hand-off is returned.
    /// The owner must not write those blocks until the lease's end arrives on [`Self::events`].
    /// `n` is bounded by `AgentConfig::max_children`; a ttl above
    /// `AgentConfig::max_lease_lifetime` is clamped to it.
    pub fn lease(&self, req: LeaseRequest) -> Result<ChildHandoff, Error> {
        let (h, pending) = self.lease_pending(req)?;
        self.precompute(pending);
        Ok(h)
    }

    /// [`Self::lease`], its CRC precompute (if any) left to [`Self::precompute`].
    fn lease_pending(&self, req: LeaseRequest) -> Result<(ChildHandoff, Option<Pending>), Error> {
        self.make_lease(req, Making::Lease, |table, req, now| table.lease_with_generation(req, now))
    }

    /// Starts the CRC-32C precompute of a lease made with a store.
    fn precompute(&self, pending: Option<Pending>) {
        if let (Some(crcs), Some(p)) = (&self.shared.crcs, pending) {
            crcs.queue(&self.shared.table, p);
        }
    }

    /// Arms a lease whose request id and token were minted elsewhere — the second phase of
    /// a two-phase lease: a scheduler process that does not hold the KV memory (vLLM's)
    /// chooses `remote_request_id` and the token and publishes them in `kv_transfer_params`,
    /// and the worker holding the memory arms the lease with exactly those at its next
    /// step. Refused as [`Self::lease`] refuses, and when `remote_request_id` is not the id
    /// `req` names, the token is all zeros, or it is the token of an ended lease of the same
    /// id (see [`LeaseTable::arm`]). Reads and notifications that reached the agent before
    /// the arm waited for it (`Limits::arm_wait`) and are answered now.
    pub fn arm(
        &self,
        remote_request_id: &str,
        req: LeaseRequest,
        token: kvxfer_core::LeaseToken,
    ) -> Result<ChildHandoff, Error> {
        let (h, pending) = self
            .make_lease(req, Making::Arm, |table, req, now| table.arm(remote_request_id, req, token, now))?;
        self.precompute(pending);
        Ok(h)
    }

    /// Makes a lease with `make` (the table's `lease` or `arm`, as `how` says). The tracker
    /// records it only once the table made it, under the tracker's lock, so the lease's end
    /// (applied by the event task under the same lock) cannot overtake it; then the expiry
    /// task is told its deadline.
    fn make_lease(
        &self,
        mut req: LeaseRequest,
        how: Making,
        make: impl FnOnce(
            &LeaseTable,
            LeaseRequest,
            Instant,
        ) -> Result<(ChildHandoff, u64), kvxfer_core::LeaseError>,
    ) -> Result<(ChildHandoff, Option<Pending>), Error> {
        if self.shared.crcs.is_some() {
            Precompute::prepare(&mut req);
        }
        let (parent, n, child) = (req.parent_request_id.clone(), req.n, req.child_index);
        let mut tracker = self.lock_tracker();
        // Under the tracker's lock, which `drain` takes before it returns: no lease is made
        // after `drain()` returned. An arm is not refused: its hand-off already left this
        // process (the scheduler published its id and token), so refusing it would fail a
        // request in flight instead of draining.
        if how == Making::Lease {
            self.refuse_if_draining()?;
        }
        let now = Instant::now();
        tracker.admit(&parent, n, now)?;
        let deadline = self.shared.table.deadline_for(req.ttl, now);
        let (h, generation) = make(&self.shared.table, req, now)?;
        tracker.leased(&parent, n, child, generation, now);
        drop(tracker);
        debug!(remote_request_id = %log::Peer(&h.remote_request_id()), blocks = h.remote_block_ids().len(), "{}", how.done());
        self.shared.new_deadline(deadline);
        let pending = self.shared.crcs.is_some().then(|| Pending::new(&h, generation));
        Ok((h, pending))
    }

    /// Leases every child of a parent (`blocks[i]` for child i) and returns the prefill
    /// result to hand to the decode side.
    ///
    /// On `Err`, no hand-off escaped, and no end is delivered on [`Self::events`] for any
    /// lease this call made: every request is checked before the first lease is made, and
    /// if a lease still fails (another lease of the same id is live), the ones already made
    /// are retracted ([`LeaseTable::retract`]) — an owner that frees the blocks on `Err`
    /// frees them once. The one exception is a lease whose ttl ran out while the call was
    /// still running and that the expiry task ended first (a ttl shorter than the call
    /// itself): its end arrives as usual, with kind `Expired`.
    pub fn lease_parent(
        &self,
        parent: &str,
        blocks: Vec<Vec<kvxfer_core::BlockId>>,
        expected_consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<PrefillResult, Error> {
        let groups = blocks.into_iter().map(|b| vec![b]).collect();
        self.lease_parent_groups(parent, groups, expected_consumers, ttl)
    }

    /// [`Self::lease_parent`] for a cache of several KV-cache groups: `blocks[i][g]` are
    /// child i's blocks of group g (vLLM's nested `remote_block_ids`).
    pub fn lease_parent_groups(
        &self,
        parent: &str,
        blocks: Vec<Vec<Vec<kvxfer_core::BlockId>>>,
        expected_consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<PrefillResult, Error> {
        let n = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
        let reqs: Vec<LeaseRequest> = (0u32..)
            .zip(blocks)
            .map(|(i, b)| {
                let mut req = LeaseRequest::grouped(parent, i, n, b).consumers(expected_consumers);
                req.ttl = ttl;
                req
            })
            .collect();
        self.refuse_if_draining()?;
        for req in &reqs {
            self.shared.table.validate(req)?;
        }
        let mut handoffs = Vec::with_capacity(reqs.len());
        // Precomputes start once the result is returned: a held lease could not be retracted.
        let mut pending = Vec::new();
        for req in reqs {
            match self.lease_pending(req) {
                Ok((h, p)) => {
                    handoffs.push(h);
                    pending.push(p);
                }
                Err(e) => {
                    self.retract_all(&handoffs);
                    return Err(e);
                }
            }
        }
        match PrefillResult::new(parent, n, handoffs.clone()) {
            Ok(result) => {
                pending.into_iter().for_each(|p| self.precompute(p));
                Ok(result)
            }
            Err(e) => {
                self.retract_all(&handoffs);
                Err(e.into())
            }
        }
    }

    /// Withdraws leases whose hand-offs are not going to be returned.
    fn retract_all(&self, handoffs: &[ChildHandoff]) {
        let mut tracker = self.lock_tracker();
        for h in handoffs {
            match self.shared.table.retract(h.remote_request_id(), h.token().as_bytes(), Instant::now()) {
                RetractOutcome::Retracted => tracker.retracted(h.parent_request_id(), h.child_index()),
                other => {
                    warn!(remote_request_id = %log::Peer(&h.remote_request_id()), ?other, "lease could not be retracted; it ends as usual")
                }
            }
        }
    }

    /// Releases a lease from the owner's side (the request was aborted).
    pub fn cancel(&self, h: &ChildHandoff) -> CancelOutcome {
        self.shared.table.cancel(h.remote_request_id(), h.token().as_bytes(), Instant::now())
    }

    /// How each lease ended, once per lease, with the blocks to free. Drain it: ends queue
    /// up here until received (clone it to keep receiving after the agent is gone; after a
    /// shutdown it disconnects once every end was delivered). Each end is delivered once,
    /// to whichever receiver or [`LeaseEnds`] stream takes it first.
    pub fn events(&self) -> &Receiver<LeaseEnd> {
        &self.events
    }

    /// The lease ends as an async [`Stream`](futures::Stream) (the same ends as
    /// [`Self::events`]); it ends after a shutdown, once every end was delivered.
    pub fn lease_ends(&self) -> LeaseEnds {
        LeaseEnds::new(self.events.clone(), self.events_ready.clone())
    }

    /// The children states of a parent that still has pending children.
    pub fn parent_status(&self, parent: &str) -> Option<ParentStatus> {
        self.lock_tracker().status(parent).cloned()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PrefillStats {
        PrefillStats {
            leases: self.shared.table.stats(),
            server: self.shared.counters.snapshot(),
            connections_open: self.shared.connections_open.load(Ordering::Relaxed),
        }
    }

    fn lock_tracker(&self) -> std::sync::MutexGuard<'_, ParentTracker> {
        self.shared.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PrefillAgent {
    /// Shuts the agent down gracefully: deregisters from etcd first (with discovery: the key
    /// is gone before anything else stops), then stops accepting connections, lets reads
    /// and pins in flight finish (up to `AgentConfig::shutdown_grace`), ends every live
    /// lease as released (each end delivered on [`Self::events`] — nothing is revoked
    /// silently), closes every connection, and returns once every end was delivered and the
    /// agent's tasks ended. Later calls return at once. Call it on SIGTERM/SIGINT (kvxfer
    /// installs no signal handler): killed by the default action, a process leaves its key
    /// until its lease expires.
    pub async fn shutdown(&self) {
        run_shutdown(self.shared.clone()).await;
    }

    /// The shutdown as a task of its own (it keeps the agent's memory alive).
    pub(crate) fn shutdown_task(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        run_shutdown(self.shared.clone())
    }
}

impl Drop for PrefillAgent {
    /// Never blocks: signals shutdown and leaves the bounded drain to a task that keeps the
    /// agent's memory (and UCX target) alive until it finished. A registered agent keeps
    /// accepting until that task deregistered it (the key goes first, as in
    /// [`Self::shutdown`]); any other stops accepting at once.
    fn drop(&mut self) {
        if self.shared.stop.is_cancelled() {
            return;
        }
        #[cfg(feature = "cluster")]
        let registered = self.shared.cluster.as_ref().is_some_and(|c| c.registration_status().is_some());
        #[cfg(not(feature = "cluster"))]
        let registered = false;
        if !registered {
            self.shared.stop_accepting.cancel();
        }
        // If the runtime is gone, its tasks were dropped with it.
        self.handle.spawn(self.shutdown_task());
    }
}

/// The graceful shutdown (see [`PrefillAgent::shutdown`]); safe to run more than once.
async fn run_shutdown(shared: Arc<Shared>) {
    // Deregistered first: decode agents see the key go (and stop pulling from here) before
    // the listener closes or any connection does — their pulls of this agent's hand-offs
    // then fail as `EngineNotRegistered`, not at a refused connection. (With etcd
    // unreachable this waits for the revoke's request timeout; the key then expires with
    // its lease.)
    #[cfg(feature = "cluster")]
    if let Some(c) = &shared.cluster {
        c.deregister().await;
    }
    shared.stop_accepting.cancel();
    // One-sided readers (UCX) read registered memory without us seeing the reads; a pin is
    // their promise to unpin when done. Reads and pins in flight hold read guards: wait for
    // them (bounded) before the memory can be unmapped and freed.
    let deadline = tokio::time::Instant::from_std(crate::runtime::instant_after(
        std::time::Instant::now(),
        shared.grace,
    ));
    wait_for_reads(&shared, deadline).await;
    let released = shared.table.release_all(Instant::now());
    if released > 0 {
        info!(released, "shutdown: live leases released");
    }
    // A read or pin granted after the wait saw none and before `release_all` ended its lease
    // holds a guard too (no later one can: every lease has ended). Wait for it as well: a
    // one-sided reader's get may be under way, and tearing the memory and UCX target down
    // under it left the get to never complete (its decode side holding its blocks for good).
    wait_for_reads(&shared, deadline).await;
    // Connections close (dropping the guards of reads cut short, which hands their leases
    // back); then the expiry task and the event forwarder finish.
    shared.stop.cancel();
    shared.connections.close();
    shared.connections.wait().await;
    shared.events_final.cancel();
    shared.tasks.wait().await;
    #[cfg(feature = "ucx")]
    drop(shared.ucx.lock().unwrap_or_else(|p| p.into_inner()).take());
    #[cfg(feature = "cluster")]
    if let Some(c) = &shared.cluster {
        c.stop().await;
    }
}

/// Waits (until `deadline`) for the reads and pins in flight to end.
async fn wait_for_reads(shared: &Shared, deadline: tokio::time::Instant) {
    while shared.table.reads_in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The lease ends of a prefill agent as a [`Stream`](futures::Stream)
/// ([`PrefillAgent::lease_ends`]).
pub struct LeaseEnds {
    inner: std::pin::Pin<Box<dyn futures::Stream<Item = LeaseEnd> + Send>>,
}

impl std::fmt::Debug for LeaseEnds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseEnds").finish_non_exhaustive()
    }
}

impl LeaseEnds {
    fn new(events: Receiver<LeaseEnd>, ready: Arc<Notify>) -> Self {
        let stream = futures::stream::unfold((events, ready), |(events, ready)| async move {
            let waker = ready.clone();
            loop {
                let notified = waker.notified();
                tokio::pin!(notified);
                // Registered before looking, so an end sent meanwhile is not missed.
                notified.as_mut().enable();
                match events.try_recv() {
                    Ok(end) => return Some((end, (events, ready))),
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
                    Err(crossbeam_channel::TryRecvError::Empty) => notified.await,
                }
            }
        });
        LeaseEnds { inner: Box::pin(stream) }
    }
}

impl futures::Stream for LeaseEnds {
    type Item = LeaseEnd;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<LeaseEnd>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// The host hand-offs name: the configured one, else the bound IP unless it is unspecified
/// (`0.0.0.0`, `::`), which no peer can connect to: then the local address the default route
/// would use, found by connecting a UDP socket (no packet is sent) to an address of the
/// documentation ranges, which only the default route reaches.
fn advertise_host(configured: Option<&str>, bound: SocketAddr) -> Result<String, Error> {
    if let Some(h) = configured {
        // An IP literal in its canonical form (`fd00:0::2` is `fd00::2`): the form the
        // registered record and every comparison of addresses use.
        let unbracketed = h.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(h);
        return Ok(unbracketed
            .parse::<std::net::IpAddr>()
            .map_or_else(|_| h.to_owned(), |ip| ip.to_string()));
    }
    if !bound.ip().is_unspecified() {
        return Ok(bound.ip().to_string());
    }
    let (local, probe) =
        if bound.is_ipv4() { ("0.0.0.0:0", "198.51.100.1:9") } else { ("[::]:0", "[2001:db8::1]:9") };
    let routed = std::net::UdpSocket::bind(local).and_then(|s| {
        s.connect(probe)?;
        s.local_addr()
    });
    match routed {
        Ok(a) if !a.ip().is_unspecified() => Ok(a.ip().to_string()),
        Ok(_) => Err(no_route(bound, std::io::ErrorKind::AddrNotAvailable.into())),
        Err(e) => Err(no_route(bound, e)),
    }
}

fn no_route(bound: SocketAddr, source: std::io::Error) -> Error {
    Error::Io {
        what: format!(
            "listening on {bound} (every interface) without AgentConfig::advertise_host, and no default \
             route to pick a reachable address from; set advertise_host"
        ),
        source,
    }
}

/// Connections open per peer, for `Limits::max_connections_per_peer` (and handshakes under
/// way per peer, for `Limits::max_handshakes_per_peer`).
#[derive(Debug, Default)]
struct PeerCounts(Mutex<HashMap<IpAddr, usize>>);

/// One open connection of a peer; dropping it gives the slot back.
struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: IpAddr,
}

/// Which peer an address counts as for the per-peer cap: an IPv4 address itself (also when
/// IPv4-mapped), an IPv6 address its /64 — a host is routinely given a whole /64, so one
/// peer could otherwise open the cap's worth of connections from each of its addresses.
fn peer_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from_bits(v6.to_bits() & !u128::from(u64::MAX))),
        },
    }
}

impl PeerCounts {
    /// Takes a slot for the peer `ip` belongs to ([`peer_key`]), unless it already has `max`
    /// connections open.
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<PeerSlot> {
        let ip = peer_key(ip);
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let open = counts.entry(ip).or_insert(0);
        if *open >= max.max(1) {
            return None;
        }
        *open += 1;
        Some(PeerSlot { counts: self.clone(), ip })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(open) = counts.get_mut(&self.ip) {
            *open -= 1;
            if *open == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

/// The places a connection can hold: among the handshakes under way (taken when it is
/// accepted), and among the connections served (taken once its handshake verified).
struct Places {
    handshakes: Arc<tokio::sync::Semaphore>,
    handshakes_per_peer: Arc<PeerCounts>,
    served: Arc<tokio::sync::Semaphore>,
    served_per_peer: Arc<PeerCounts>,
}

impl Places {
    fn new(limits: &kvxfer_tcp::Limits) -> Self {
        Places {
            handshakes: Arc::new(tokio::sync::Semaphore::new(limits.max_handshakes.max(1))),
            handshakes_per_peer: Arc::new(PeerCounts::default()),
            served: Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1))),
            served_per_peer: Arc::new(PeerCounts::default()),
        }
    }

    /// A place among the handshakes under way for a connection from `ip`, and what takes
    /// its place among the connections served once its handshake verified (giving the
    /// first back); or why it is refused now.
    fn handshake(
        &self,
        ip: IpAddr,
        limits: &kvxfer_tcp::Limits,
        open: &Arc<AtomicU64>,
    ) -> Result<Admit, Refusal> {
        let permit = self.handshakes.clone().try_acquire_owned().map_err(|_| Refusal::TooManyHandshakes)?;
        let slot = self
            .handshakes_per_peer
            .take(ip, limits.max_handshakes_per_peer)
            .ok_or(Refusal::TooManyHandshakesFromPeer)?;
        let (served, per_peer, max_per_peer) =
            (self.served.clone(), self.served_per_peer.clone(), limits.max_connections_per_peer);
        let open = open.clone();
        Ok(Box::new(move || {
            drop((permit, slot));
            let permit = served.try_acquire_owned().map_err(|_| Refusal::TooManyConnections)?;
            let slot = per_peer.take(ip, max_per_peer).ok_or(Refusal::TooManyFromPeer)?;
            Ok(Box::new((permit, slot, OpenConnection::new(open))) as Box<dyn Send>)
        }))
    }
}

/// One served connection in `PrefillStats::connections_open`, until dropped.
struct OpenConnection(Arc<AtomicU64>);

impl OpenConnection {
    fn new(open: Arc<AtomicU64>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        OpenConnection(open)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts connections until the agent stops accepting (or `runtime_gone`: the front door
/// outlived the agent's runtime). A connection holds a place among the handshakes under way
/// until its handshake verified, and only then one among the connections served (`Places`):
/// connections that never complete a handshake cannot take the places of authenticated
/// ones. Runs, with the handshakes, on the front door when there is one
/// (`AgentConfig::front_door_nice`); admitted connections are served on `serve_on`.
async fn accept_loop(
    listener: std::net::TcpListener,
    ctx: Arc<ServeContext>,
    shared: Arc<Shared>,
    serve_on: Handle,
    runtime_gone: CancellationToken,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            warn!(error = %e, "the listener could not be registered; accepting no connections");
            return;
        }
    };
    let places = Places::new(&ctx.limits);
    loop {
        let accepted = tokio::select! {
            // Stopping first: nothing is accepted once the agent stopped accepting.
            biased;
            () = shared.stop_accepting.cancelled() => return,
            () = runtime_gone.cancelled() => return,
            // Dropping the listener stops accepting at once.
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => match places.handshake(peer.ip(), &ctx.limits, &shared.connections_open) {
                Ok(admit) => {
                    let (ctx, shared_, serve_on) = (ctx.clone(), shared.clone(), serve_on.clone());
                    shared.connections.spawn(async move {
                        let mut stream = stream;
                        let admitted = tokio::select! {
                            a = kvxfer_tcp::handshake_connection(&mut stream, &ctx, admit) => a,
                            // Shutdown: the connection is dropped.
                            () = shared_.stop.cancelled() => None,
                        };
                        if let Some(admitted) = admitted {
                            hand_over(stream, ctx, admitted, &shared_, &serve_on);
                        }
                    });
                }
                Err(why) => {
                    shared.connections.spawn(kvxfer_tcp::refuse_connection(stream, ctx.clone(), why));
                }
            },
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves an admitted connection on `serve_on` (the agent's runtime) until it ends or the
/// agent stops. The stream leaves the front door's reactor and joins that runtime's.
fn hand_over(
    stream: tokio::net::TcpStream,
    ctx: Arc<ServeContext>,
    admitted: kvxfer_tcp::Admitted,
    shared: &Shared,
    serve_on: &Handle,
) {
    let stream = match stream.into_std() {
        Ok(s) => s,
        Err(e) => {
            debug!(error = %e, "an admitted connection could not be handed over");
            return;
        }
    };
    let stop = shared.stop.clone();
    shared.connections.spawn_on(
        async move {
            let stream = match tokio::net::TcpStream::from_std(stream) {
                Ok(s) => s,
                Err(e) => {
                    debug!(error = %e, "an admitted connection could not be registered");
                    return;
                }
            };
            tokio::select! {
                () = kvxfer_tcp::serve_admitted(stream, ctx, admitted) => {}
                // Shutdown: the connection (and any read guard) is dropped.
                () = stop.cancelled() => {}
            }
        },
        serve_on,
    );
}

impl Shared {
    fn lock_expiry_armed(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.expiry_armed.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A lease with this deadline was made: wakes the expiry task only when it would
    /// expire before the deadline the task sleeps until (or the task is recomputing it).
    fn new_deadline(&self, deadline: Instant) {
        let mut armed = self.lock_expiry_armed();
        if armed.is_none_or(|a| deadline < a) {
            *armed = Some(deadline);
            drop(armed);
            self.wake.notify_one();
        }
    }
}

/// Sleeps until the table's next deadline (or a lease that expires sooner wakes it), then expires.
async fn expiry_loop(shared: Arc<Shared>) {
    let table = &shared.table;
    loop {
        // Cleared first: a lease made while the deadline is recomputed sees `None` and wakes
        // this task (the permit is kept), so no earlier deadline is slept past.
        *shared.lock_expiry_armed() = None;
        let next = table.poll_timeout();
        {
            let mut armed = shared.lock_expiry_armed();
            // A lease made since may have stored its earlier deadline (and woken us).
            *armed = match (*armed, next) {
                (Some(a), Some(n)) => Some(a.min(n)),
                (a, n) => a.or(n),
            };
        }
        let sleep = match next {
            Some(t) => tokio::time::sleep_until(t.into()),
            None => tokio::time::sleep(Duration::from_secs(3600)),
        };
        tokio::select! {
            _ = sleep => {
                let n = table.expire(Instant::now());
                if n > 0 {
                    debug!(expired = n, "expired leases");
                }
            }
            _ = shared.wake.notified() => {}
            () = shared.stop.cancelled() => return,
        }
    }
}

/// Moves lease ends from the table to the owner, updating the parent tracker and logging
/// each one with its request id. Woken by the table's end hook; after shutdown it delivers
/// what is left and drops its sender (the owner's receivers then disconnect).
async fn forward_events(shared: Arc<Shared>, ended: Arc<Notify>, out: Sender<LeaseEnd>, ready: Arc<Notify>) {
    // However this task ends — finished, or dropped with its runtime — the channel is
    // closed and the `LeaseEnds` streams are woken, so they end instead of waiting for ever.
    let closing = CloseOnDrop { out: Some(out), ready };
    let (Some(out), ready) = (closing.out.as_ref(), &closing.ready) else { return };
    loop {
        forward(&shared, out, ready);
        tokio::select! {
            () = ended.notified() => {}
            () = shared.events_final.cancelled() => break,
        }
    }
    // Every connection is gone (the shutdown waited for them), so no end can follow.
    forward(&shared, out, ready);
}

/// Closes the lease-end channel, then wakes the streams waiting on it.
struct CloseOnDrop {
    out: Option<Sender<LeaseEnd>>,
    ready: Arc<Notify>,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        drop(self.out.take());
        self.ready.notify_waiters();
    }
}

fn forward(shared: &Shared, out: &Sender<LeaseEnd>, ready: &Notify) {
    let mut any = false;
    while let Ok(end) = shared.table.ended().try_recv() {
        match end.kind {
            EndKind::Pulled => {
                debug!(remote_request_id = %log::Peer(&end.remote_request_id), consumers = end.consumers_seen, "lease ended: pulled")
            }
            EndKind::Released => {
                info!(remote_request_id = %log::Peer(&end.remote_request_id), "lease ended: released")
            }
            EndKind::Expired => warn!(
                remote_request_id = %log::Peer(&end.remote_request_id),
                "Releasing expired KV blocks for request {} which were retrieved by {} of {} remote worker(s) before lease expired",
                end.remote_request_id, end.consumers_seen, end.expected_consumers
            ),
        }
        #[cfg(feature = "cluster")]
        if let Some(c) = &shared.cluster {
            c.observe_end(&end);
        }
        let done = shared.tracker.lock().unwrap_or_else(|p| p.into_inner()).on_end(&end, Instant::now());
        if let Some(status) = done {
            debug!(parent = %log::Peer(&end.parent_request_id), ?status, "parent complete");
        }
        // The owner may have dropped its receiver; the ends are then simply dropped.
        let _ = out.send(end);
        any = true;
    }
    if any {
        ready.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review 10 finding 14: the per-peer cap was keyed on the full IP address, so an IPv6
    /// client with a /64 (every host gets one) had as many caps as it has addresses. IPv6
    /// peers share one cap per /64 now; IPv4 peers (and IPv4-mapped IPv6 ones) one per address.
    #[test]
    fn the_per_peer_connection_cap_counts_an_ipv6_slash_64_as_one_peer() {
        let counts = Arc::new(PeerCounts::default());
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let first = counts.take(ip("2001:db8:1:2::1"), 2).expect("first");
        let second = counts.take(ip("2001:db8:1:2:ffff:eeee:dddd:cccc"), 2).expect("same /64, second slot");
        assert!(counts.take(ip("2001:db8:1:2::3"), 2).is_none(), "a third address of the same /64");
        let other = counts.take(ip("2001:db8:1:3::1"), 2).expect("another /64 is another peer");
        let v4 = counts.take(ip("192.0.2.1"), 1).expect("an IPv4 peer");
        assert!(counts.take(ip("::ffff:192.0.2.1"), 1).is_none(), "the same IPv4 peer, mapped");
        let v4b = counts.take(ip("192.0.2.2"), 1).expect("IPv4 peers are one address each");
        drop(first);
        let again = counts.take(ip("2001:db8:1:2::3"), 2).expect("a slot came back");
        drop((second, other, v4, v4b, again));
        assert!(counts.0.lock().expect("lock").is_empty());
    }

    #[test]
    fn unspecified_listen_addresses_advertise_a_concrete_one() {
        let bound: SocketAddr = "0.0.0.0:5559".parse().expect("addr");
        assert_eq!(
            advertise_host(Some("prefill-0.example"), bound).expect("configured"),
            "prefill-0.example"
        );
        let loopback: SocketAddr = "127.0.0.1:5559".parse().expect("addr");
        assert_eq!(advertise_host(None, loopback).expect("bound"), "127.0.0.1");
        for any in ["0.0.0.0:5559", "[::]:5559"] {
            let bound: SocketAddr = any.parse().expect("addr");
            match advertise_host(None, bound) {
                Ok(host) => {
                    let ip: std::net::IpAddr = host.parse().expect("an IP address");
                    assert!(!ip.is_unspecified(), "{any} advertised {host}");
                    assert_eq!(ip.is_ipv4(), bound.is_ipv4());
                }
                // A machine without a default route for this family: refused, clearly.
                Err(e) => {
                    eprintln!("{any}: {e}");
                    assert!(e.to_string().contains("advertise_host"), "{e}");
                }
            }
        }
    }
}
