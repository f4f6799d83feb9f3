//! Running in a cluster (the `cluster` feature): etcd discovery and Prometheus metrics
//! wired into the agents. Off unless [`AgentConfig::cluster`](crate::AgentConfig) asks for
//! it; an agent without it never touches etcd or a metrics registry.
//!
//! - **Prefill agents register** `/<namespace>/v1/engines/<engine_id>/<rank>` (advertise
//!   address, transports offered, layout compatibility hash, protocol version, incarnation)
//!   on an etcd lease kept alive by a background task, from `start` on; `shutdown` (and the
//!   shutdown a dropped agent runs) revokes it **first**, before it stops accepting, so
//!   decode agents see the key go before connections close. A crashed process's key goes
//!   when its lease runs out (the registration TTL, 2 s or more).
//! - **Decode agents watch** the namespace ([`kvxfer_cluster::EngineDirectory`]). When a
//!   rank's key is deleted, or put again with another record (a restarted process: a new
//!   incarnation; or a new address), the pooled connections to the old address are dropped
//!   at once and that incarnation is remembered as gone: a later pull of a hand-off it made
//!   fails at once with [`PullError::EngineNotRegistered`] instead of at an I/O timeout. A
//!   hand-off that names only the engine id (no host or port, see
//!   [`kvxfer_core::EngineInfo`]) is pulled from the cached record of rank
//!   `decode rank % tp_size`. Resolving reads only the cache: an unreachable etcd never
//!   holds a pull up (the directory retries in the background and says so in logs and
//!   metrics).
//! - **Metrics**: both agents feed a [`Metrics`] registry (one per process, shared through
//!   [`ClusterConfig::metrics`]; snapshot closures over the counters they keep, read at
//!   scrape time), the pull task observes pull and per-child durations, the prefill event
//!   task each lease's life by outcome; [`ClusterConfig::metrics_listen`] serves them at
//!   `GET /metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use kvxfer_core::log;
use kvxfer_core::pull::PullError;
use kvxfer_core::{EndKind, EngineInfo, LeaseTable};
use kvxfer_tcp::ServerCounters;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use kvxfer_cluster::{
    AdvertiseAddr, AgentName, DecodeSnapshot, DirectoryOptions, EngineId, EngineKey, EngineRecord, Host,
    PerTransport, PrefillSnapshot, Registration, RegistrationConfig, ResolveError, SourceGuard,
    TransportName,
};
pub use kvxfer_cluster::{
    ChildPullOutcome, DirectoryEvent, DirectoryEvents, EngineDirectory, EngineEntry, EtcdAuth, EtcdConfig,
    EtcdState, EtcdStatus, EtcdTls, HandoffOutcome, Metrics, MetricsServer, StatusWatch,
    OPENMETRICS_CONTENT_TYPE,
};

pub use crate::cluster_config::{ClusterConfig, DiscoveryConfig, DEFAULT_REGISTRATION_TTL};
use crate::decode::report::{Counters, DecodeStats};
use crate::{AgentConfig, Error};

/// What the cluster hooks see of a decode agent's shared state (`decode::shared::Inner`
/// implements it): its pooled peers, to count them for the metrics and to forget those
/// discovery says are gone. A trait, so this module does not import the agent's state that
/// holds a [`DecodeCluster`].
pub(crate) trait DecodePeers: Send + Sync + 'static {
    /// Prefill peers the agent keeps connections (or a pool) for.
    fn peer_count(&self) -> u64;
    /// Forgets the peer at `addr`, closing its pooled connections. Returns whether there
    /// was one.
    fn invalidate_peer(&self, addr: &str) -> bool;
}

/// Any error of the cluster crate as an engine error.
fn cluster_error(e: impl Into<kvxfer_cluster::Error>) -> Error {
    Error::Cluster(e.into())
}

/// The registry an agent feeds, if any: the configured one, or its own when it only serves.
fn registry(config: &ClusterConfig) -> Option<Arc<Metrics>> {
    config.metrics.clone().or_else(|| config.metrics_listen.as_ref().map(|_| Arc::new(Metrics::new())))
}

/// The `/metrics` endpoint, if configured.
fn serve(
    handle: &Handle,
    config: &ClusterConfig,
    metrics: &Option<Arc<Metrics>>,
) -> Result<Option<MetricsServer>, Error> {
    match (&config.metrics_listen, metrics) {
        (Some(listen), Some(m)) => {
            MetricsServer::start(handle, listen, m.clone()).map(Some).map_err(cluster_error)
        }
        _ => Ok(None),
    }
}

fn take<T>(m: &Mutex<Option<T>>) -> Option<T> {
    m.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// What a prefill agent registers, and the counters its metrics read.
pub(crate) struct PrefillSide<'a> {
    pub(crate) host: &'a str,
    pub(crate) port: u16,
    pub(crate) incarnation: u64,
    pub(crate) compat_hash: u64,
    pub(crate) offers_ucx: bool,
    pub(crate) table: Arc<LeaseTable>,
    pub(crate) counters: Arc<ServerCounters>,
    pub(crate) connections_open: Arc<AtomicU64>,
}

/// A prefill agent's registration, metrics sources and endpoint.
pub(crate) struct PrefillCluster {
    registration: Mutex<Option<Registration>>,
    metrics: Option<Arc<Metrics>>,
    guards: Mutex<Vec<SourceGuard>>,
    server: Mutex<Option<MetricsServer>>,
}

impl PrefillCluster {
    /// Starts registering (in the background: this never waits for etcd) and feeding the
    /// metrics, when configured; `None` when the config asks for neither.
    pub(crate) fn start(
        handle: &Handle,
        config: &AgentConfig,
        side: PrefillSide<'_>,
    ) -> Result<Option<Self>, Error> {
        let c = &config.cluster;
        let metrics = registry(c);
        if c.discovery.is_none() && metrics.is_none() {
            return Ok(None);
        }
        // Bound first: a start that fails leaves no registration behind.
        let server = serve(handle, c, &metrics)?;
        let registration = match &c.discovery {
            Some(d) => {
                let record = EngineRecord {
                    addr: Host::parse(side.host)
                        .and_then(|h| AdvertiseAddr::new(h, side.port))
                        .map_err(cluster_error)?,
                    transports: if side.offers_ucx {
                        vec![TransportName::ucx(), TransportName::tcp()]
                    } else {
                        vec![TransportName::tcp()]
                    },
                    compat_hash: side.compat_hash,
                    protocol_version: config.protocol_version,
                    incarnation: side.incarnation,
                    agent: AgentName::new(&config.agent_name).map_err(cluster_error)?,
                    draining: false,
                };
                let engine_id = EngineId::new(&config.engine_id).map_err(cluster_error)?;
                let key = EngineKey::new(d.namespace()?, engine_id, config.rank);
                let reg = Registration::start(
                    handle,
                    d.etcd.clone(),
                    RegistrationConfig { key, record, ttl: d.registration_ttl },
                )
                .map_err(cluster_error)?;
                info!(key = %reg.key(), addr = %reg.record().addr, "registering in etcd");
                Some(reg)
            }
            None => None,
        };
        let mut guards = Vec::new();
        if let Some(m) = &metrics {
            let (table, counters, open) = (side.table, side.counters, side.connections_open);
            guards.push(m.add_prefill_source(move || prefill_snapshot(&table, &counters, &open)));
            if let Some(reg) = &registration {
                guards.push(m.add_registration(reg));
            }
        }
        Ok(Some(Self {
            registration: Mutex::new(registration),
            metrics,
            guards: Mutex::new(guards),
            server: Mutex::new(server),
        }))
    }

    pub(crate) fn metrics(&self) -> Option<&Arc<Metrics>> {
        self.metrics.as_ref()
    }

    /// Records one lease's life by how it ended (the event task, once per lease end).
    pub(crate) fn observe_end(&self, end: &kvxfer_core::LeaseEnd) {
        if let Some(m) = &self.metrics {
            let outcome = match end.kind {
                EndKind::Pulled => HandoffOutcome::Pulled,
                EndKind::Released => HandoffOutcome::Released,
                EndKind::Expired => HandoffOutcome::Expired,
            };
            m.observe_child_handoff(outcome, end.ended_at.saturating_duration_since(end.leased_at));
        }
    }

    /// The registration's state with etcd (`None` without discovery, or after shutdown).
    pub(crate) fn registration_status(&self) -> Option<EtcdStatus> {
        self.registration.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(Registration::status)
    }

    /// A watch of the registration's state.
    pub(crate) fn registration_watch(&self) -> Option<StatusWatch> {
        self.registration.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(Registration::status_watch)
    }

    /// Starts (`true`) or ends (`false`) the registration's drain, if registering.
    pub(crate) fn drain(&self, on: bool) {
        if let Some(reg) = self.registration.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            if on {
                reg.drain();
            } else {
                reg.undrain();
            }
        }
    }

    /// Whether the registration is draining (called, or the etcd drain key exists).
    pub(crate) fn is_draining(&self) -> bool {
        self.registration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(Registration::is_draining)
    }

    /// The `/metrics` address, if served.
    pub(crate) fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.server.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(MetricsServer::local_addr)
    }

    /// Revokes the registration (the key is gone when this returns, unless etcd cannot be
    /// reached: then it expires within its TTL). Later calls do nothing.
    pub(crate) async fn deregister(&self) {
        if let Some(reg) = take(&self.registration) {
            let key = reg.key().clone();
            if let Err(e) = reg.shutdown().await {
                warn!(%key, error = %e, "could not deregister from etcd; the key expires with its lease");
            }
        }
    }

    /// Stops serving `/metrics` and retires the sources (their counts stay in the registry).
    pub(crate) async fn stop(&self) {
        if let Some(server) = take(&self.server) {
            server.shutdown().await;
        }
        self.guards.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Bytes served per transport, each from its own counter.
fn served_bytes(s: &kvxfer_tcp::ServerStats) -> PerTransport {
    PerTransport { tcp: s.bytes_served_tcp, ucx: s.bytes_served_one_sided, rdma: 0 }
}

fn prefill_snapshot(table: &LeaseTable, counters: &ServerCounters, open: &AtomicU64) -> PrefillSnapshot {
    let l = table.stats();
    let s = counters.snapshot();
    PrefillSnapshot {
        leases_made: l.leased,
        leases_pulled: l.pulled,
        leases_released: l.released,
        leases_expired: l.expired,
        leases_live: l.live,
        leases_draining: l.draining,
        notifications_unrecognized: l.unrecognized,
        notifications_bad_token: l.bad_token,
        notifications_duplicate: l.duplicate,
        bytes_served: served_bytes(&s),
        reads_served: s.reads_served,
        reads_refused: s.reads_refused,
        connections_accepted: s.connections,
        connections_open: open.load(Ordering::Relaxed),
        connections_refused_limit: s.connections_refused + s.peer_connections_refused + s.preauth_refused,
        handshakes_refused: s.handshakes_refused,
        protocol_errors: s.protocol_errors + s.stalled_frames,
        pins_made: s.pins,
        pins_open: s.pins_open,
        pins_refused: s.pins_refused,
        pins_expired: s.pins_expired,
    }
}

/// A decode agent's directory, metrics sources and endpoint.
pub(crate) struct DecodeCluster {
    directory: Option<Arc<EngineDirectory>>,
    namespace: String,
    metrics: Option<Arc<Metrics>>,
    guards: Mutex<Vec<SourceGuard>>,
    server: Mutex<Option<MetricsServer>>,
    watcher: Mutex<Option<JoinHandle<()>>>,
}

impl DecodeCluster {
    /// Starts the directory (in the background: this never waits for etcd) and the metrics
    /// endpoint, when configured; `None` when the config asks for neither. The sources and
    /// the invalidation task start in [`Self::attach`], once the agent exists.
    pub(crate) fn start(
        handle: &Handle,
        config: &AgentConfig,
        compat_hash: u64,
    ) -> Result<Option<Self>, Error> {
        let c = &config.cluster;
        let metrics = registry(c);
        if c.discovery.is_none() && metrics.is_none() {
            return Ok(None);
        }
        let directory = match &c.discovery {
            Some(d) => {
                // Records of another layout are ignored (and counted): this agent could not
                // pull from them — unless it has a KV-cache shape, which lets it pull from
                // engines of other TP and block sizes (the handshake checks the shapes).
                let expected_compat_hash = Some(compat_hash).filter(|_| config.kv_shape.is_none());
                let options = DirectoryOptions { expected_compat_hash, ..Default::default() };
                let dir = EngineDirectory::start(handle, d.etcd.clone(), d.namespace()?, options);
                Some(Arc::new(dir.map_err(cluster_error)?))
            }
            None => None,
        };
        let server = serve(handle, c, &metrics)?;
        Ok(Some(Self {
            directory,
            namespace: c.discovery.as_ref().map(|d| d.namespace.clone()).unwrap_or_default(),
            metrics,
            guards: Mutex::new(Vec::new()),
            server: Mutex::new(server),
            watcher: Mutex::new(None),
        }))
    }

    /// Adds the agent's metrics sources and starts the task that invalidates connections on
    /// directory events. Holds only a weak reference to the agent.
    pub(crate) fn attach(&self, handle: &Handle, counters: &Arc<Counters>, inner: Weak<dyn DecodePeers>) {
        if let Some(m) = &self.metrics {
            let counters = counters.clone();
            let weak = inner.clone();
            let source = move || {
                let peers = weak.upgrade().map_or(0, |i| i.peer_count());
                decode_snapshot(&counters.snapshot(peers))
            };
            let mut guards = self.guards.lock().unwrap_or_else(|p| p.into_inner());
            guards.push(m.add_decode_source(source));
            if let Some(dir) = &self.directory {
                guards.push(m.add_directory(dir));
            }
        }
        if let Some(dir) = &self.directory {
            let events = dir.subscribe();
            let task = handle.spawn(invalidate_on_events(events, inner, counters.clone()));
            *self.watcher.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        }
    }

    pub(crate) fn directory(&self) -> Option<&Arc<EngineDirectory>> {
        self.directory.as_ref()
    }

    pub(crate) fn metrics(&self) -> Option<&Arc<Metrics>> {
        self.metrics.as_ref()
    }

    /// The `/metrics` address, if served.
    pub(crate) fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.server.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(MetricsServer::local_addr)
    }

    /// Where to pull the hand-offs of `engine` from: the hand-off's own address, unless
    /// discovery saw the incarnation that made it go; for a hand-off naming only the engine
    /// id, the cached record of rank `decode_rank % tp_size`. Reads only the cache.
    pub(crate) fn resolve(&self, engine: &EngineInfo, decode_rank: u32) -> Result<String, PullError> {
        self.resolve_rank(engine, decode_rank % engine.tp_size.max(1))
    }

    /// [`Self::resolve`] of prefill rank `rank` itself (a pull from several prefill ranks,
    /// `DecodeAgent::submit_ranks`, names each rank it reads).
    pub(crate) fn resolve_rank(&self, engine: &EngineInfo, rank: u32) -> Result<String, PullError> {
        let Some(dir) = &self.directory else {
            return Ok(engine.addr());
        };
        let ns = &self.namespace;
        let not_registered = |detail: String| PullError::EngineNotRegistered {
            engine: engine.engine_id.clone(),
            rank,
            detail,
        };
        let inc = engine.incarnation;
        // Judged under the cache's lock: never behind the events an application reacts to,
        // and a restart is seen even by an agent that started after it (the rank registered
        // at the hand-off's address names another incarnation).
        let at = engine
            .names_address()
            .then(|| Host::parse(&engine.host).and_then(|h| AdvertiseAddr::new(h, engine.port)).ok())
            .flatten();
        match dir.check_handoff(&engine.engine_id, inc, at.as_ref()) {
            Ok(()) => {}
            // Only judged while the directory is current (listed and watching): a stale
            // cache (etcd unreachable) may list the process a restart replaced.
            Err(ResolveError::StaleIncarnation { registered, .. }) => {
                return Err(not_registered(format!(
                    "incarnation {} is not registered in etcd namespace {ns:?}: etcd lists incarnation {} \
                     at {} (the process there restarted; the hand-off's leases are gone)",
                    log::Incarnation(inc),
                    log::Incarnation(registered),
                    engine.addr()
                )));
            }
            Err(_) => {
                return Err(not_registered(format!(
                    "incarnation {} left etcd namespace {ns:?} (deregistered, or its lease expired after a \
                     crash, or replaced by a restart): its leases are gone",
                    log::Incarnation(inc)
                )));
            }
        }
        if engine.names_address() {
            return Ok(engine.addr());
        }
        // The cached record's address; the handshake checks the incarnation.
        match dir.resolve(&engine.engine_id, rank) {
            Some(entry) => Ok(entry.record.addr.to_string()),
            None if dir.is_synced() => Err(not_registered(format!(
                "not registered in etcd namespace {ns:?}, and the hand-off names no address (shut down, \
                 crashed, or not registered yet)"
            ))),
            None => Err(not_registered(format!(
                "the hand-off names no address, and this agent has not listed etcd namespace {ns:?} yet \
                 ({:?})",
                dir.status().last_error.as_deref().unwrap_or("no answer yet")
            ))),
        }
    }

    /// Stops serving `/metrics`, the invalidation task and the sources (the directory stops
    /// watching when the agent is dropped).
    pub(crate) async fn stop(&self) {
        if let Some(server) = take(&self.server) {
            server.shutdown().await;
        }
        if let Some(task) = take(&self.watcher) {
            task.abort();
        }
        self.guards.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

impl Drop for DecodeCluster {
    fn drop(&mut self) {
        if let Some(task) = take(&self.watcher) {
            task.abort();
        }
    }
}

fn decode_snapshot(s: &DecodeStats) -> DecodeSnapshot {
    DecodeSnapshot {
        pulls: s.pulls,
        children_done: s.children_done,
        children_failed: s.children_failed,
        children_cancelled: s.children_cancelled,
        bytes_pulled: PerTransport { tcp: s.bytes_pulled_tcp, ucx: s.bytes_pulled_ucx, rdma: 0 },
        integrity_failures: PerTransport {
            tcp: s.integrity_failures_tcp,
            ucx: s.integrity_failures_ucx,
            rdma: 0,
        },
        notifications_unacknowledged: s.notifications_unacknowledged,
        connections_opened: s.connections_opened,
        peers: s.peers,
        peers_invalidated: s.peers_invalidated,
        read_retries: s.read_retries,
        control_retries: s.control_retries,
        reads_after_broken_batch: s.reads_after_broken_batch,
        notifies_with_read: s.notifies_with_read,
        read_batches: s.read_batches,
        reads_batched: s.reads_batched,
    }
}

/// Drops the pooled connections of every engine rank whose key was deleted or whose record
/// changed, as soon as the directory says so (the directory itself remembers the
/// incarnations that went).
async fn invalidate_on_events(
    mut events: DirectoryEvents,
    inner: Weak<dyn DecodePeers>,
    counters: Arc<Counters>,
) {
    while let Some(event) = events.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        if let Some(draining) = event.draining_changed() {
            let e = event.key();
            info!(engine = %e, draining, "engine draining state changed in etcd (pooled connections kept)");
        }
        let old = match &event {
            _ if !event.invalidates() => continue,
            DirectoryEvent::Added(_) => continue,
            DirectoryEvent::Updated { old, .. } | DirectoryEvent::Removed(old) => old,
        };
        let addr = old.record.addr.to_string();
        if inner.invalidate_peer(&addr) {
            counters.peers_invalidated.fetch_add(1, Ordering::Relaxed);
            info!(engine = %old.key, %addr, incarnation = %log::Incarnation(old.record.incarnation), "engine left or changed in etcd: pooled connections dropped");
        } else {
            debug!(engine = %old.key, %addr, "engine left or changed in etcd (no pooled connections)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scrape between a writer's two adds (total first, then the transport's part) must
    /// not see the bytes under another transport: counts per transport only ever grow.
    #[test]
    fn per_transport_counts_never_borrow_from_the_total() {
        // A one-sided read counted in the total, its UCX part not yet.
        let served = kvxfer_tcp::ServerStats { bytes_served: 4096, ..Default::default() };
        assert_eq!(served_bytes(&served).tcp, 0, "a UCX read in progress showed as TCP bytes");
        let pulled = DecodeStats { bytes_pulled: 4096, integrity_failures: 1, ..Default::default() };
        let d = decode_snapshot(&pulled);
        assert_eq!((d.bytes_pulled.tcp, d.integrity_failures.tcp), (0, 0));
        // Each transport's own counter is what shows.
        let served = kvxfer_tcp::ServerStats {
            bytes_served: 4096 + 100,
            bytes_served_tcp: 100,
            bytes_served_one_sided: 4096,
            ..Default::default()
        };
        assert_eq!((served_bytes(&served).tcp, served_bytes(&served).ucx), (100, 4096));
    }
}
