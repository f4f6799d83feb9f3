//! Prometheus metrics: one registry per process, filled two ways.
//!
//! - Counters and gauges the agents already keep (lease table, server and decode counters)
//!   are read **at scrape time** from snapshot closures ([`Metrics::add_prefill_source`],
//!   [`Metrics::add_decode_source`]): nothing is added to the data path. Several agents of
//!   one kind in one process are summed (label sets stay bounded); an agent that goes away
//!   leaves its final counts behind, so counters never go down.
//! - Latency histograms, which nothing keeps today, are observed directly
//!   ([`Metrics::observe_pull`], [`Metrics::observe_child_handoff`]): one short lock per
//!   pull or per child, never per block.
//!
//! Registrations and directories report their etcd state the same way
//! ([`Metrics::add_registration`], [`Metrics::add_directory`]).
//!
//! Every name starts with `kvxfer_` (but `process_start_time_seconds`, the name every
//! Prometheus client library gives it); counters end in `_total`, units are in the name
//! (`_bytes`, `_seconds`); labels are bounded enums (transport, outcome, kind, side,
//! component, state, reason) — never request ids — and `kvxfer_build_info` names the
//! version, engine id, rank and incarnation of each registration.
//!
//! A family appears once the process has something it describes: the prefill families
//! (histogram included) once a prefill source was added or a lease's life observed, the
//! decode ones once a decode source was added or a pull observed; RDMA series only once an
//! RDMA count is not zero (no RDMA data path is built).
//!
//! Two text formats ([`Format`]): OpenMetrics 1.0 ([`Metrics::encode`]) and the Prometheus
//! text format 0.0.4 ([`Metrics::encode_prometheus`]); `/metrics` answers the one the
//! scraper's `Accept` header prefers, the Prometheus one when it names neither.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::directory::{DirectoryStats, EngineDirectory, IgnoreReason};
use crate::error::MetricsError;
use crate::etcd::{EtcdState, EtcdStatus};
use crate::registration::{Registration, RegistrationStats};

/// The OpenMetrics text content type `/metrics` answers with when the scraper asks for it.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The Prometheus text format's (0.0.4) content type, what `/metrics` answers by default.
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// A text exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text (ends with `# EOF`).
    OpenMetrics,
    /// The Prometheus text format, version 0.0.4.
    PrometheusText,
}

impl Format {
    /// The `Content-Type` of this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
            Format::PrometheusText => PROMETHEUS_TEXT_CONTENT_TYPE,
        }
    }

    /// The format an HTTP `Accept` header asks for: OpenMetrics when it names
    /// `application/openmetrics-text` with a quality above zero and at least that of any
    /// `text/plain` it names (as Prometheus asks: OpenMetrics first, the text format as a
    /// fallback); the Prometheus text format otherwise (no header, `text/plain`, `*/*`).
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else { return Format::PrometheusText };
        let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
            let mut q = 1.0f32;
            for param in parts {
                if let Some((k, v)) = param.split_once('=') {
                    if k.trim().eq_ignore_ascii_case("q") {
                        q = v.trim().parse().unwrap_or(0.0);
                    }
                }
            }
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(q),
                "text/plain" => text = text.max(q),
                _ => {}
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Format::OpenMetrics
        } else {
            Format::PrometheusText
        }
    }
}

/// A data path, as a label value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// TCP.
    Tcp,
    /// UCX.
    Ucx,
    /// RDMA verbs.
    Rdma,
}

impl Transport {
    /// Every transport.
    pub const ALL: [Transport; 3] = [Transport::Tcp, Transport::Ucx, Transport::Rdma];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Ucx => "ucx",
            Transport::Rdma => "rdma",
        }
    }
}

/// One count per transport.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerTransport {
    /// Over TCP.
    pub tcp: u64,
    /// Over UCX.
    pub ucx: u64,
    /// Over RDMA verbs (no RDMA data path is built: exported only when not zero).
    pub rdma: u64,
}

impl PerTransport {
    /// The count of `transport`.
    pub fn get(&self, transport: Transport) -> u64 {
        match transport {
            Transport::Tcp => self.tcp,
            Transport::Ucx => self.ucx,
            Transport::Rdma => self.rdma,
        }
    }

    fn add(&mut self, o: &Self) {
        self.tcp += o.tcp;
        self.ucx += o.ucx;
        self.rdma += o.rdma;
    }

    /// TCP and UCX always; RDMA only once its count is not zero (no RDMA data path is
    /// built: a series always at zero would only suggest one).
    fn samples(&self) -> Vec<(&'static str, u64)> {
        Transport::ALL
            .into_iter()
            .filter(|t| *t != Transport::Rdma || self.rdma > 0)
            .map(|t| (t.as_str(), self.get(t)))
            .collect()
    }
}

/// A prefill agent's counters, read at scrape time. Counters only grow; gauges are now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefillSnapshot {
    /// Leases made.
    pub leases_made: u64,
    /// Leases ended as pulled.
    pub leases_pulled: u64,
    /// Leases ended as released.
    pub leases_released: u64,
    /// Leases ended as expired.
    pub leases_expired: u64,
    /// Gauge: leases not yet ended.
    pub leases_live: u64,
    /// Gauge: ended leases whose blocks wait for reads in flight.
    pub leases_draining: u64,
    /// Notifications, heartbeats and cancels for ids with no live lease.
    pub notifications_unrecognized: u64,
    /// Operations with a wrong token.
    pub notifications_bad_token: u64,
    /// Notifications from a consumer that had already notified.
    pub notifications_duplicate: u64,
    /// Bytes served, per transport.
    pub bytes_served: PerTransport,
    /// Reads served.
    pub reads_served: u64,
    /// Reads refused.
    pub reads_refused: u64,
    /// Connections accepted.
    pub connections_accepted: u64,
    /// Gauge: connections open now (served, not yet closed).
    pub connections_open: u64,
    /// Connections refused at a connection limit: of connections served, or of handshakes
    /// under way.
    pub connections_refused_limit: u64,
    /// Handshakes refused (version, layout, authentication).
    pub handshakes_refused: u64,
    /// Protocol errors (bad frames, stalled frames).
    pub protocol_errors: u64,
    /// Pins taken.
    pub pins_made: u64,
    /// Gauge: pins held now.
    pub pins_open: u64,
    /// Pins refused at the per-connection limit.
    pub pins_refused: u64,
    /// Pins dropped after the pin timeout.
    pub pins_expired: u64,
}

/// A decode agent's counters, read at scrape time. Counters only grow; gauges are now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeSnapshot {
    /// Pulls submitted.
    pub pulls: u64,
    /// Children pulled and notified.
    pub children_done: u64,
    /// Children failed. In the agent's own stats only: the exposition counts failed
    /// children by error kind as each one is reported ([`Metrics::count_child_failure`]).
    pub children_failed: u64,
    /// Children cancelled.
    pub children_cancelled: u64,
    /// Bytes pulled over the wire, per transport.
    pub bytes_pulled: PerTransport,
    /// Reads whose payload failed its integrity check, per transport.
    pub integrity_failures: PerTransport,
    /// Notifications the prefill side did not count.
    pub notifications_unacknowledged: u64,
    /// Connections opened.
    pub connections_opened: u64,
    /// Gauge: prefill peers with connections.
    pub peers: u64,
    /// Peers whose pooled connections were dropped because discovery saw their engine leave
    /// or change (a new incarnation or address).
    pub peers_invalidated: u64,
    /// TCP reads (or pipelined batches) made again on a fresh connection because their
    /// pooled one was closed by the peer before any answer.
    pub read_retries: u64,
    /// Control exchanges (notify, cancel, heartbeat) retried on a fresh connection.
    pub control_retries: u64,
    /// Reads made again alone because their batch's connection broke after earlier answers.
    pub reads_after_broken_batch: u64,
    /// TCP reads that carried their child's notify.
    pub notifies_with_read: u64,
    /// Pipelined TCP batches of two or more reads.
    pub read_batches: u64,
    /// The reads those batches carried.
    pub reads_batched: u64,
}

/// How a lease ended, as a label value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandoffOutcome {
    /// Every expected consumer notified.
    Pulled,
    /// Cancelled by the decode side or the owner.
    Released,
    /// The lease ran out.
    Expired,
}

impl HandoffOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffOutcome::Pulled => "pulled",
            HandoffOutcome::Released => "released",
            HandoffOutcome::Expired => "expired",
        }
    }
}

/// How one child of a pull ended on the decode side, as a label value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChildPullOutcome {
    /// Its blocks are in place and the prefill side was notified.
    Done,
    /// It failed (its blocks hold no valid data).
    Failed,
    /// The caller cancelled it.
    Cancelled,
}

impl ChildPullOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ChildPullOutcome::Done => "done",
            ChildPullOutcome::Failed => "failed",
            ChildPullOutcome::Cancelled => "cancelled",
        }
    }
}

/// Sums snapshots of live sources, plus the final counts of retired ones.
trait Snapshot: Copy + Default + Send + 'static {
    /// Adds everything (counters and gauges) of `o`.
    fn add(&mut self, o: &Self);
    /// Adds the counters of `o` (gauges of a source that is gone are zero).
    fn retire(&mut self, o: &Self);
}

impl Snapshot for PrefillSnapshot {
    fn add(&mut self, o: &Self) {
        self.retire(o);
        self.leases_live += o.leases_live;
        self.leases_draining += o.leases_draining;
        self.pins_open += o.pins_open;
        self.connections_open += o.connections_open;
    }

    fn retire(&mut self, o: &Self) {
        self.leases_made += o.leases_made;
        self.leases_pulled += o.leases_pulled;
        self.leases_released += o.leases_released;
        self.leases_expired += o.leases_expired;
        self.notifications_unrecognized += o.notifications_unrecognized;
        self.notifications_bad_token += o.notifications_bad_token;
        self.notifications_duplicate += o.notifications_duplicate;
        self.bytes_served.add(&o.bytes_served);
        self.reads_served += o.reads_served;
        self.reads_refused += o.reads_refused;
        self.connections_accepted += o.connections_accepted;
        self.connections_refused_limit += o.connections_refused_limit;
        self.handshakes_refused += o.handshakes_refused;
        self.protocol_errors += o.protocol_errors;
        self.pins_made += o.pins_made;
        self.pins_refused += o.pins_refused;
        self.pins_expired += o.pins_expired;
    }
}

impl Snapshot for DecodeSnapshot {
    fn add(&mut self, o: &Self) {
        self.retire(o);
        self.peers += o.peers;
    }

    fn retire(&mut self, o: &Self) {
        self.pulls += o.pulls;
        self.children_done += o.children_done;
        self.children_failed += o.children_failed;
        self.children_cancelled += o.children_cancelled;
        self.bytes_pulled.add(&o.bytes_pulled);
        self.integrity_failures.add(&o.integrity_failures);
        self.notifications_unacknowledged += o.notifications_unacknowledged;
        self.connections_opened += o.connections_opened;
        self.peers_invalidated += o.peers_invalidated;
        self.read_retries += o.read_retries;
        self.control_retries += o.control_retries;
        self.reads_after_broken_batch += o.reads_after_broken_batch;
        self.notifies_with_read += o.notifies_with_read;
        self.read_batches += o.read_batches;
        self.reads_batched += o.reads_batched;
    }
}

/// The etcd side of a registration or a directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct EtcdPart {
    /// Gauge: how many are in each state of [`EtcdState::ALL`].
    in_state: [u64; EtcdState::ALL.len()],
    failures: u64,
    recoveries: u64,
}

impl EtcdPart {
    fn of(status: &EtcdStatus) -> Self {
        let mut in_state = [0; EtcdState::ALL.len()];
        if let Some(i) = EtcdState::ALL.iter().position(|s| *s == status.state) {
            in_state[i] = 1;
        }
        Self { in_state, failures: status.failures, recoveries: status.recoveries }
    }

    fn retire(&mut self, o: &Self) {
        self.failures += o.failures;
        self.recoveries += o.recoveries;
    }

    fn add(&mut self, o: &Self) {
        self.retire(o);
        for (a, b) in self.in_state.iter_mut().zip(o.in_state) {
            *a += b;
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RegistrationSnapshot {
    etcd: EtcdPart,
    stats: RegistrationStats,
}

impl Snapshot for RegistrationSnapshot {
    fn add(&mut self, o: &Self) {
        self.etcd.add(&o.etcd);
        self.retire_stats(o);
    }

    fn retire(&mut self, o: &Self) {
        self.etcd.retire(&o.etcd);
        self.retire_stats(o);
    }
}

impl RegistrationSnapshot {
    fn retire_stats(&mut self, o: &Self) {
        self.stats.grants += o.stats.grants;
        self.stats.puts += o.stats.puts;
        self.stats.leases_lost += o.stats.leases_lost;
        self.stats.keepalives += o.stats.keepalives;
        self.stats.restores += o.stats.restores;
        self.stats.conflicts += o.stats.conflicts;
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct DirectorySnapshot {
    etcd: EtcdPart,
    stats: DirectoryStats,
}

impl Snapshot for DirectorySnapshot {
    fn add(&mut self, o: &Self) {
        self.etcd.add(&o.etcd);
        self.stats.entries += o.stats.entries;
        self.retire_stats(o);
    }

    fn retire(&mut self, o: &Self) {
        self.etcd.retire(&o.etcd);
        self.retire_stats(o);
    }
}

impl DirectorySnapshot {
    fn retire_stats(&mut self, o: &Self) {
        let (s, o) = (&mut self.stats, &o.stats);
        s.added += o.added;
        s.updated += o.updated;
        s.removed += o.removed;
        s.ignored_bad_key += o.ignored_bad_key;
        s.ignored_malformed += o.ignored_malformed;
        s.ignored_unsupported_version += o.ignored_unsupported_version;
        s.ignored_layout_mismatch += o.ignored_layout_mismatch;
        s.ignored_limit += o.ignored_limit;
        s.listings += o.listings;
    }
}

type SourceFn<T> = Box<dyn Fn() -> T + Send + Sync>;

/// The live sources of one kind and the final counts of those that went away.
struct SourceSet<T> {
    next_id: u64,
    live: Vec<(u64, SourceFn<T>)>,
    retired: T,
    /// Whether any source was ever added (a process without prefill agents exports no
    /// prefill families).
    ever: bool,
}

impl<T: Snapshot> SourceSet<T> {
    fn new() -> Self {
        Self { next_id: 0, live: Vec::new(), retired: T::default(), ever: false }
    }

    fn total(&self) -> Option<T> {
        if !self.ever {
            return None;
        }
        let mut total = self.retired;
        for (_, source) in &self.live {
            total.add(&source());
        }
        Some(total)
    }
}

type Shared<T> = Arc<Mutex<SourceSet<T>>>;

/// One label, as every labelled histogram here has.
type OneLabel = [(&'static str, &'static str); 1];
type HistogramFamily = Family<OneLabel, Histogram, fn() -> Histogram>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn add_source<T: Snapshot>(set: &Shared<T>, source: SourceFn<T>) -> SourceGuard {
    let id = {
        let mut s = lock(set);
        let id = s.next_id;
        s.next_id += 1;
        s.live.push((id, source));
        s.ever = true;
        id
    };
    let set = set.clone();
    SourceGuard {
        retire: Some(Box::new(move || {
            let mut s = lock(&set);
            if let Some(at) = s.live.iter().position(|(i, _)| *i == id) {
                let (_, source) = s.live.remove(at);
                let last = source();
                s.retired.retire(&last);
            }
        })),
    }
}

/// Keeps a snapshot source registered; dropping it removes the source and keeps its final
/// counter values (its gauges drop to zero).
#[must_use = "the source is removed when the guard is dropped"]
pub struct SourceGuard {
    retire: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl fmt::Debug for SourceGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceGuard").finish_non_exhaustive()
    }
}

impl Drop for SourceGuard {
    fn drop(&mut self) {
        if let Some(retire) = self.retire.take() {
            retire();
        }
    }
}

/// Most distinct error kinds the failure counter keeps apart; later ones count as `other`
/// (`PullError` has about twenty).
const MAX_FAILURE_KINDS: usize = 64;

/// An engine rank this process registered, for `kvxfer_build_info`.
#[derive(Debug, Clone)]
struct Identity {
    id: u64,
    engine_id: String,
    rank: String,
    incarnation: String,
}

/// What agents observe directly (histograms, failures by kind) and the registrations'
/// identities, shared with the collector.
#[derive(Clone)]
struct Sources {
    prefill: Shared<PrefillSnapshot>,
    decode: Shared<DecodeSnapshot>,
    registration: Shared<RegistrationSnapshot>,
    directory: Shared<DirectorySnapshot>,
    pull_duration: Histogram,
    child_pull: HistogramFamily,
    child_handoff: HistogramFamily,
    /// Whether a lease's life (prefill) or a pull (decode) was observed.
    prefill_observed: Arc<AtomicBool>,
    decode_observed: Arc<AtomicBool>,
    /// Failed children by `PullError` kind, in first-seen order.
    failures: Arc<Mutex<Vec<(String, u64)>>>,
    identities: Arc<Mutex<(u64, Vec<Identity>)>>,
    /// Unix time the process started, in seconds.
    process_start: f64,
}

impl fmt::Debug for Sources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sources").finish_non_exhaustive()
    }
}

/// The process's metrics: a registry with kvxfer's families, the snapshot sources behind
/// them, and the histograms agents observe into. Share it in an `Arc`.
pub struct Metrics {
    registry: Registry,
    sources: Sources,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn pull_histogram() -> Histogram {
    // 100 µs .. ~52 s.
    Histogram::new(exponential_buckets(0.000_1, 2.0, 20))
}

fn handoff_histogram() -> Histogram {
    // 1 ms .. ~65 s: from a local pull to a lease that ran out.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// When this process started (Unix seconds): Linux's `/proc/self/stat` start time (clock
/// ticks after boot, at 100 per second — the USER_HZ every Linux exports, as Prometheus'
/// procfs reads it) plus the boot time of `/proc/stat`; elsewhere, the first call's time.
fn process_start_time() -> f64 {
    fn from_proc() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command (in parentheses, which may hold spaces): state is field 3,
        // starttime field 22.
        let after = stat.rsplit_once(')')?.1;
        let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let btime: u64 = boot.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
        Some(btime as f64 + ticks as f64 / 100.0)
    }
    static START: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *START.get_or_init(|| {
        from_proc().unwrap_or_else(|| {
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
        })
    })
}

impl Metrics {
    /// An empty registry (sources and observations add their families).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let sources = Sources {
            prefill: Arc::new(Mutex::new(SourceSet::new())),
            decode: Arc::new(Mutex::new(SourceSet::new())),
            registration: Arc::new(Mutex::new(SourceSet::new())),
            directory: Arc::new(Mutex::new(SourceSet::new())),
            pull_duration: pull_histogram(),
            child_pull: Family::new_with_constructor(pull_histogram),
            child_handoff: Family::new_with_constructor(handoff_histogram),
            prefill_observed: Arc::new(AtomicBool::new(false)),
            decode_observed: Arc::new(AtomicBool::new(false)),
            failures: Arc::new(Mutex::new(Vec::new())),
            identities: Arc::new(Mutex::new((0, Vec::new()))),
            process_start: process_start_time(),
        };
        registry
            .sub_registry_with_prefix("kvxfer")
            .register_collector(Box::new(SnapshotCollector { sources: sources.clone() }));
        registry.register_collector(Box::new(ProcessCollector { start: sources.process_start }));
        Self { registry, sources }
    }

    /// Reads a prefill agent's counters at every scrape, until the guard is dropped.
    pub fn add_prefill_source(
        &self,
        source: impl Fn() -> PrefillSnapshot + Send + Sync + 'static,
    ) -> SourceGuard {
        add_source(&self.sources.prefill, Box::new(source))
    }

    /// Reads a decode agent's counters at every scrape, until the guard is dropped.
    pub fn add_decode_source(
        &self,
        source: impl Fn() -> DecodeSnapshot + Send + Sync + 'static,
    ) -> SourceGuard {
        add_source(&self.sources.decode, Box::new(source))
    }

    /// Reports a registration's etcd state and counters, and its engine id, rank and
    /// incarnation in `kvxfer_build_info`, until the guard is dropped.
    pub fn add_registration(&self, registration: &Registration) -> SourceGuard {
        let shared = registration.shared().clone();
        let inner = add_source(
            &self.sources.registration,
            Box::new(move || RegistrationSnapshot {
                etcd: EtcdPart::of(&shared.status.get()),
                stats: shared.stats(),
            }),
        );
        let identities = self.sources.identities.clone();
        let id = {
            let mut ids = lock(&identities);
            let id = ids.0;
            ids.0 += 1;
            let key = registration.key();
            ids.1.push(Identity {
                id,
                engine_id: key.engine_id.as_str().to_owned(),
                rank: key.rank.to_string(),
                incarnation: format!("{:016x}", registration.record().incarnation),
            });
            id
        };
        SourceGuard {
            retire: Some(Box::new(move || {
                drop(inner);
                lock(&identities).1.retain(|i| i.id != id);
            })),
        }
    }

    /// Reports a directory's etcd state and counters, until the guard is dropped.
    pub fn add_directory(&self, directory: &EngineDirectory) -> SourceGuard {
        let shared = directory.shared().clone();
        add_source(
            &self.sources.directory,
            Box::new(move || DirectorySnapshot {
                etcd: EtcdPart::of(&shared.status.get()),
                stats: shared.stats(),
            }),
        )
    }

    /// Records one pull's duration (submit to last child report).
    pub fn observe_pull(&self, duration: Duration) {
        self.sources.decode_observed.store(true, Ordering::Relaxed);
        self.sources.pull_duration.observe(duration.as_secs_f64());
    }

    /// Records how long one child of a pull took (submit to its report) and how it ended.
    /// A failed child is counted by [`Self::count_child_failure`], not here.
    pub fn observe_child_pull(&self, outcome: ChildPullOutcome, duration: Duration) {
        self.sources.decode_observed.store(true, Ordering::Relaxed);
        self.sources
            .child_pull
            .get_or_create(&[("outcome", outcome.as_str())])
            .observe(duration.as_secs_f64());
    }

    /// Counts one failed child of a pull under its error kind (`PullError::kind`, e.g.
    /// `engine_not_registered`): `kvxfer_children_total{outcome="failed",kind=...}`.
    pub fn count_child_failure(&self, kind: &str) {
        self.sources.decode_observed.store(true, Ordering::Relaxed);
        let mut failures = lock(&self.sources.failures);
        let kind = if failures.len() >= MAX_FAILURE_KINDS && !failures.iter().any(|(k, _)| k == kind) {
            "other"
        } else {
            kind
        };
        match failures.iter_mut().find(|(k, _)| k == kind) {
            Some((_, n)) => *n += 1,
            None => failures.push((kind.to_owned(), 1)),
        }
    }

    /// Records one lease's life (leased to ended) with how it ended.
    pub fn observe_child_handoff(&self, outcome: HandoffOutcome, duration: Duration) {
        self.sources.prefill_observed.store(true, Ordering::Relaxed);
        self.sources
            .child_handoff
            .get_or_create(&[("outcome", outcome.as_str())])
            .observe(duration.as_secs_f64());
    }

    /// The OpenMetrics text exposition (ends with `# EOF`).
    pub fn encode(&self) -> Result<String, MetricsError> {
        self.encode_as(Format::OpenMetrics)
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn encode_prometheus(&self) -> Result<String, MetricsError> {
        self.encode_as(Format::PrometheusText)
    }

    /// The exposition in `format`.
    pub fn encode_as(&self, format: Format) -> Result<String, MetricsError> {
        let mut text = String::with_capacity(8192);
        match format {
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut text, &self.registry),
            Format::PrometheusText => {
                prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
            }
        }
        .map_err(|_| MetricsError::Encode)?;
        Ok(text)
    }
}

/// `process_start_time_seconds` (outside the `kvxfer_` prefix, as every client library
/// names it).
#[derive(Debug)]
struct ProcessCollector {
    start: f64,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let m = enc.encode_descriptor(
            "process_start_time",
            "Start time of the process since the Unix epoch, in seconds.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        ConstGauge::new(self.start).encode(m)
    }
}

/// Encodes the snapshot families at scrape time.
#[derive(Debug)]
struct SnapshotCollector {
    sources: Sources,
}

/// Writes families of constant values.
struct Writer<'a, 'b> {
    enc: &'a mut DescriptorEncoder<'b>,
}

/// Help texts end with a full stop, as the registry writes them for registered metrics.
fn sentence(help: &str) -> String {
    format!("{help}.")
}

impl Writer<'_, '_> {
    fn counter(&mut self, name: &str, help: &str, unit: Option<&Unit>, value: u64) -> fmt::Result {
        let m = self.enc.encode_descriptor(name, &sentence(help), unit, MetricType::Counter)?;
        ConstCounter::new(value).encode(m)
    }

    fn counters(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        label: &str,
        values: &[(&str, u64)],
    ) -> fmt::Result {
        let mut m = self.enc.encode_descriptor(name, &sentence(help), unit, MetricType::Counter)?;
        for (label_value, value) in values {
            ConstCounter::new(*value).encode(m.encode_family(&[(label, *label_value)])?)?;
        }
        Ok(())
    }

    fn gauge(&mut self, name: &str, help: &str, value: u64) -> fmt::Result {
        let m = self.enc.encode_descriptor(name, &sentence(help), None, MetricType::Gauge)?;
        ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(m)
    }

    fn histogram(&mut self, name: &str, help: &str, metric: &impl EncodeMetric) -> fmt::Result {
        let m =
            self.enc.encode_descriptor(name, &sentence(help), Some(&Unit::Seconds), MetricType::Histogram)?;
        metric.encode(m)
    }
}

/// One info sample (`<name>_info{labels} 1`).
fn info(m: &mut MetricEncoder<'_>, labels: &[(&str, &str)]) -> fmt::Result {
    m.encode_info(&labels)
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        // Each source is read once per scrape (the locks are not held while encoding).
        let prefill = lock(&self.sources.prefill).total();
        let decode = lock(&self.sources.decode).total();
        let registration = lock(&self.sources.registration).total();
        let directory = lock(&self.sources.directory).total();
        let failures = lock(&self.sources.failures).clone();
        let identities = lock(&self.sources.identities).1.clone();
        // A side's histograms only in a process with that side (a prefill-only process has
        // no pulls to time, a decode-only one no leases).
        let prefill_side = prefill.is_some() || self.sources.prefill_observed.load(Ordering::Relaxed);
        let decode_side = decode.is_some() || self.sources.decode_observed.load(Ordering::Relaxed);
        let mut w = Writer { enc: &mut enc };
        {
            let mut m = w.enc.encode_descriptor(
                "build",
                "The kvxfer version, and the engine id, rank and incarnation (16 hex digits) of each \
                 engine rank this process registered.",
                None,
                MetricType::Info,
            )?;
            let version = env!("CARGO_PKG_VERSION");
            if identities.is_empty() {
                info(&mut m, &[("version", version)])?;
            }
            for i in &identities {
                info(
                    &mut m,
                    &[
                        ("version", version),
                        ("engine_id", &i.engine_id),
                        ("rank", &i.rank),
                        ("incarnation", &i.incarnation),
                    ],
                )?;
            }
        }
        if prefill_side {
            w.histogram(
                "child_handoff_duration",
                "Prefill side: time from leasing a child's blocks to the lease's end, by outcome",
                &self.sources.child_handoff,
            )?;
        }
        if decode_side {
            w.histogram(
                "pull_duration",
                "Decode side: time from submitting a prefill result to its last child's report",
                &self.sources.pull_duration,
            )?;
            w.histogram(
                "child_pull_duration",
                "Decode side: time from submitting a prefill result to one child's report, by outcome",
                &self.sources.child_pull,
            )?;
        }
        let bytes = Some(&Unit::Bytes);
        if let Some(p) = &prefill {
            w.counter("leases_made", "Leases made (one per child hand-off)", None, p.leases_made)?;
            w.counters(
                "leases_ended",
                "Leases ended, by outcome (each lease ends exactly once)",
                None,
                "outcome",
                &[
                    ("pulled", p.leases_pulled),
                    ("released", p.leases_released),
                    ("expired", p.leases_expired),
                ],
            )?;
            w.gauge("leases_live", "Leases not yet ended", p.leases_live)?;
            w.gauge(
                "leases_draining",
                "Ended leases whose blocks wait for reads in flight",
                p.leases_draining,
            )?;
            w.counters(
                "notifications_rejected",
                "Notifications, heartbeats and cancels that changed nothing, by kind",
                None,
                "kind",
                &[
                    ("unrecognized", p.notifications_unrecognized),
                    ("bad_token", p.notifications_bad_token),
                    ("duplicate", p.notifications_duplicate),
                ],
            )?;
            w.counters(
                "served",
                "Bytes served to decode agents, by transport",
                bytes,
                "transport",
                &p.bytes_served.samples(),
            )?;
            w.counters(
                "reads",
                "Read requests, by outcome",
                None,
                "outcome",
                &[("served", p.reads_served), ("refused", p.reads_refused)],
            )?;
            w.counters(
                "connections_refused",
                "Connections refused, by kind (at the connection limit, or at the handshake)",
                None,
                "kind",
                &[("limit", p.connections_refused_limit), ("handshake", p.handshakes_refused)],
            )?;
            w.counter(
                "protocol_errors",
                "Connections closed for a protocol error or a stalled frame",
                None,
                p.protocol_errors,
            )?;
            w.counter("pins", "Pins taken for one-sided reads", None, p.pins_made)?;
            w.gauge("pins_open", "Pins held now", p.pins_open)?;
            w.gauge("connections_open", "Prefill side: connections open now", p.connections_open)?;
            w.counters(
                "pins_dropped",
                "Pins not granted or not kept, by kind",
                None,
                "kind",
                &[("refused", p.pins_refused), ("expired", p.pins_expired)],
            )?;
        }
        if prefill.is_some() || decode.is_some() {
            let mut sides = Vec::new();
            if let Some(p) = &prefill {
                sides.push(("prefill", p.connections_accepted));
            }
            if let Some(d) = &decode {
                sides.push(("decode", d.connections_opened));
            }
            w.counters(
                "connections_opened",
                "Connections opened (prefill: accepted; decode: dialed), by side",
                None,
                "side",
                &sides,
            )?;
        }
        if let Some(d) = &decode {
            w.counter("pulls", "Prefill results submitted for pulling", None, d.pulls)?;
            {
                let mut m = w.enc.encode_descriptor(
                    "children",
                    &sentence("Children of pulls, by outcome; failed ones by error kind (PullError::kind)"),
                    None,
                    MetricType::Counter,
                )?;
                for (outcome, n) in [("done", d.children_done), ("cancelled", d.children_cancelled)] {
                    ConstCounter::new(n).encode(m.encode_family(&[("outcome", outcome)])?)?;
                }
                for (kind, n) in &failures {
                    let labels = [("outcome", "failed"), ("kind", kind.as_str())];
                    ConstCounter::new(*n).encode(m.encode_family(&labels)?)?;
                }
            }
            w.counters(
                "pulled",
                "Bytes pulled over the wire, by transport",
                bytes,
                "transport",
                &d.bytes_pulled.samples(),
            )?;
            w.counters(
                "integrity_failures",
                "Reads whose payload failed its integrity check, by transport",
                None,
                "transport",
                &d.integrity_failures.samples(),
            )?;
            w.counter(
                "notifications_unacknowledged",
                "Notifications the prefill side did not count",
                None,
                d.notifications_unacknowledged,
            )?;
            w.gauge("peers", "Prefill peers with open connections", d.peers)?;
            w.counter(
                "peers_invalidated",
                "Peers whose pooled connections were dropped because their engine left etcd or changed",
                None,
                d.peers_invalidated,
            )?;
            w.counters(
                "retries",
                "Exchanges made again on a fresh connection, by kind: read (its pooled connection closed before any answer), control (notify, cancel, heartbeat), broken_batch (a read left unanswered when its pipelined batch's connection broke)",
                None,
                "kind",
                &[
                    ("read", d.read_retries),
                    ("control", d.control_retries),
                    ("broken_batch", d.reads_after_broken_batch),
                ],
            )?;
            w.counter(
                "notifies_with_read",
                "TCP reads that carried their child's notify (one round trip per hand-off)",
                None,
                d.notifies_with_read,
            )?;
            w.counter(
                "read_batches",
                "Pipelined TCP batches: two or more reads of a pull written together on one connection",
                None,
                d.read_batches,
            )?;
            w.counter("reads_batched", "The reads pipelined batches carried", None, d.reads_batched)?;
        }
        if registration.is_some() || directory.is_some() {
            let parts: Vec<(&str, EtcdPart)> =
                [("registration", registration.map(|r| r.etcd)), ("directory", directory.map(|d| d.etcd))]
                    .into_iter()
                    .filter_map(|(c, p)| Some((c, p?)))
                    .collect();
            let mut m = w.enc.encode_descriptor(
                "etcd_state",
                "Registrations and directories in each etcd connection state.",
                None,
                MetricType::Gauge,
            )?;
            for (component, part) in &parts {
                for (state, count) in EtcdState::ALL.iter().zip(part.in_state) {
                    let labels = [("component", *component), ("state", state.as_str())];
                    ConstGauge::new(i64::try_from(count).unwrap_or(i64::MAX))
                        .encode(m.encode_family(&labels)?)?;
                }
            }
            let failures: Vec<(&str, u64)> = parts.iter().map(|(c, p)| (*c, p.failures)).collect();
            w.counters(
                "etcd_failures",
                "Failed etcd sessions (each followed by a retry), by component",
                None,
                "component",
                &failures,
            )?;
            let recoveries: Vec<(&str, u64)> = parts.iter().map(|(c, p)| (*c, p.recoveries)).collect();
            w.counters(
                "etcd_recoveries",
                "Reconnections to etcd after a failure, by component",
                None,
                "component",
                &recoveries,
            )?;
        }
        if let Some(r) = registration {
            w.counter("etcd_leases_granted", "etcd leases granted to registrations", None, r.stats.grants)?;
            w.counter(
                "etcd_leases_lost",
                "Registration leases found expired or revoked (then re-granted)",
                None,
                r.stats.leases_lost,
            )?;
            w.counter(
                "etcd_registration_restores",
                "Registration keys put back after they were deleted under a live lease",
                None,
                r.stats.restores,
            )?;
            w.counter(
                "etcd_registration_conflicts",
                "Registration keys found held by another incarnation (left alone until free)",
                None,
                r.stats.conflicts,
            )?;
        }
        if let Some(d) = directory {
            w.gauge("discovery_engines", "Engine ranks in the directory cache", d.stats.entries)?;
            w.counters(
                "discovery_events",
                "Directory changes, by kind",
                None,
                "kind",
                &[("added", d.stats.added), ("updated", d.stats.updated), ("removed", d.stats.removed)],
            )?;
            let ignored = IgnoreReason::ALL.map(|r| (r.as_str(), d.stats.ignored(r)));
            w.counters(
                "discovery_ignored",
                "Values under the namespace ignored, by reason",
                None,
                "reason",
                &ignored,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn retired_sources_keep_their_counts_but_not_their_gauges() {
        let metrics = Metrics::new();
        let made = Arc::new(AtomicU64::new(5));
        let m = made.clone();
        let guard = metrics.add_prefill_source(move || PrefillSnapshot {
            leases_made: m.load(Ordering::Relaxed),
            leases_live: 2,
            ..Default::default()
        });
        let _other = metrics.add_prefill_source(|| PrefillSnapshot { leases_made: 1, ..Default::default() });
        let text = metrics.encode().expect("encode");
        assert!(text.contains("kvxfer_leases_made_total 6\n"), "{text}");
        assert!(text.contains("kvxfer_leases_live 2\n"), "{text}");
        made.store(7, Ordering::Relaxed);
        drop(guard);
        let text = metrics.encode().expect("encode");
        assert!(text.contains("kvxfer_leases_made_total 8\n"), "{text}");
        assert!(text.contains("kvxfer_leases_live 0\n"), "{text}");
        assert!(!text.contains("kvxfer_pulls"), "no decode source, no decode families: {text}");
        assert!(text.ends_with("# EOF\n"));
    }
}
