//! The decode side's view of the registered engines: a cache filled by one prefix list and
//! kept current by a prefix watch.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use rand::SeedableRng;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::backoff::{Backoff, WarnLimiter, REMINDER_INTERVAL};
use crate::error::{Error, EtcdError, EtcdOp, RecordError, ResolveError};
use crate::etcd::{EtcdConfig, EtcdState, EtcdStatus, Failover, StatusCell, StatusWatch};
use crate::names::{engines_prefix, EngineId, EngineKey, Namespace};
use crate::record::{AdvertiseAddr, EngineRecord};

/// One registered engine rank as the directory last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineEntry {
    /// Its key.
    pub key: EngineKey,
    /// Its record.
    pub record: EngineRecord,
    /// The etcd revision of the value.
    pub mod_revision: i64,
    /// The etcd lease the key is on (0: none — not written by a [`crate::Registration`]).
    pub lease: i64,
}

/// A change of the cache, sent to subscribers right after the cache changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirectoryEvent {
    /// A rank appeared.
    Added(Arc<EngineEntry>),
    /// A rank's record changed: a new incarnation (the agent restarted), or a new address,
    /// transports, layout or protocol — connections to `old` must not be reused — or only
    /// whether it is draining ([`EngineRecord::draining`]; same agent, connections stay
    /// good: [`DirectoryEvent::invalidates`] says which).
    Updated {
        /// What was cached.
        old: Arc<EngineEntry>,
        /// What is cached now.
        new: Arc<EngineEntry>,
    },
    /// A rank disappeared: its lease expired (crash), was revoked (shutdown), or its value
    /// stopped being a usable record.
    Removed(Arc<EngineEntry>),
}

impl DirectoryEvent {
    /// The rank it is about.
    pub fn key(&self) -> &EngineKey {
        match self {
            DirectoryEvent::Added(e) | DirectoryEvent::Removed(e) => &e.key,
            DirectoryEvent::Updated { new, .. } => &new.key,
        }
    }

    /// Whether connections made for the old record must be dropped: a rank removed, or
    /// updated to another agent or place (not when only its draining state changed).
    pub fn invalidates(&self) -> bool {
        match self {
            DirectoryEvent::Added(_) => false,
            DirectoryEvent::Removed(_) => true,
            DirectoryEvent::Updated { old, new } => !old.record.same_agent(&new.record),
        }
    }

    /// Whether this event starts (`Some(true)`) or ends (`Some(false)`) a rank's draining;
    /// `None` when its draining state did not change (an `Added` rank that is draining
    /// already says `Some(true)`).
    pub fn draining_changed(&self) -> Option<bool> {
        match self {
            DirectoryEvent::Added(e) => e.record.draining.then_some(true),
            DirectoryEvent::Removed(_) => None,
            DirectoryEvent::Updated { old, new } => {
                (old.record.draining != new.record.draining).then_some(new.record.draining)
            }
        }
    }
}

/// Why a value under the namespace was not taken into the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IgnoreReason {
    /// A key that is not `<engine_id>/<rank>` under the engines prefix.
    BadKey,
    /// A value that is not a valid record (garbage bytes, bad JSON, bad fields).
    Malformed,
    /// A record of another format version.
    UnsupportedVersion,
    /// A record whose layout hash differs from the expected one.
    LayoutMismatch,
    /// A new rank while the cache holds [`DirectoryOptions::max_entries`] already.
    Limit,
}

impl IgnoreReason {
    /// A short lowercase name (a metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            IgnoreReason::BadKey => "bad_key",
            IgnoreReason::Malformed => "malformed",
            IgnoreReason::UnsupportedVersion => "unsupported_version",
            IgnoreReason::LayoutMismatch => "layout_mismatch",
            IgnoreReason::Limit => "limit",
        }
    }

    /// Every reason.
    pub const ALL: [IgnoreReason; 5] = [
        IgnoreReason::BadKey,
        IgnoreReason::Malformed,
        IgnoreReason::UnsupportedVersion,
        IgnoreReason::LayoutMismatch,
        IgnoreReason::Limit,
    ];
}

/// One value that was ignored, with what to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ignored {
    pub(crate) reason: IgnoreReason,
    pub(crate) key: String,
    pub(crate) detail: String,
}

/// What a key-value pair turned out to be: an entry, or why it is ignored (with the key when
/// the key itself was good, so that its cached entry can be dropped).
pub(crate) type Parsed = Result<EngineEntry, (Option<EngineKey>, Ignored)>;

/// The rules that turn etcd's keys and values into entries. Applied outside the cache's
/// lock, so that a large listing never holds `resolve` up while it is parsed.
#[derive(Debug, Clone)]
pub(crate) struct RecordRules {
    namespace: Namespace,
    expected_compat_hash: Option<u64>,
}

/// A key-value pair as etcd delivers it.
pub(crate) struct Kv<'a> {
    pub(crate) key: &'a [u8],
    pub(crate) value: &'a [u8],
    pub(crate) mod_revision: i64,
    pub(crate) lease: i64,
}

impl<'a> From<&'a etcd_client::KeyValue> for Kv<'a> {
    fn from(kv: &'a etcd_client::KeyValue) -> Self {
        Kv { key: kv.key(), value: kv.value(), mod_revision: kv.mod_revision(), lease: kv.lease() }
    }
}

impl RecordRules {
    pub(crate) fn new(namespace: Namespace, expected_compat_hash: Option<u64>) -> Self {
        Self { namespace, expected_compat_hash }
    }

    /// Turns a key-value pair into an entry, or says why it is ignored. A bad key yields
    /// `Err((None, ..))`; a good key with a bad value `Err((Some(key), ..))`.
    pub(crate) fn parse(&self, kv: &Kv<'_>) -> Parsed {
        let lossy_key = || String::from_utf8_lossy(kv.key).into_owned();
        let key = EngineKey::parse(&self.namespace, kv.key).map_err(|e| {
            (None, Ignored { reason: IgnoreReason::BadKey, key: lossy_key(), detail: e.to_string() })
        })?;
        let record = EngineRecord::from_json(kv.value).map_err(|e| {
            let reason = match e {
                RecordError::UnsupportedVersion { .. } => IgnoreReason::UnsupportedVersion,
                _ => IgnoreReason::Malformed,
            };
            (Some(key.clone()), Ignored { reason, key: lossy_key(), detail: e.to_string() })
        })?;
        if let Some(expected) = self.expected_compat_hash {
            if record.compat_hash != expected {
                let detail = format!(
                    "layout hash {:016x} differs from this agent's {expected:016x}",
                    record.compat_hash
                );
                let ignored = Ignored { reason: IgnoreReason::LayoutMismatch, key: lossy_key(), detail };
                return Err((Some(key), ignored));
            }
        }
        Ok(EngineEntry { key, record, mod_revision: kv.mod_revision, lease: kv.lease })
    }

    /// The engine key of a deleted key, if it is one (others were never cached).
    pub(crate) fn deleted_key(&self, key: &[u8]) -> Option<EngineKey> {
        EngineKey::parse(&self.namespace, key).ok()
    }
}

/// One change the watch saw, parsed (outside the cache's lock).
pub(crate) enum Change {
    /// A PUT.
    Put(Parsed),
    /// A DELETE of an engine key.
    Delete(EngineKey),
}

/// Incarnations the cache saw deleted or replaced, most recent last (bounded).
#[derive(Debug, Default)]
struct GoneIncarnations {
    order: VecDeque<(EngineId, u64)>,
    set: HashSet<(EngineId, u64)>,
}

impl GoneIncarnations {
    /// Plenty for every engine restart between two pulls of a hand-off.
    const CAPACITY: usize = 4096;

    fn insert(&mut self, engine: &EngineId, incarnation: u64) {
        let key = (engine.clone(), incarnation);
        if incarnation == 0 || !self.set.insert(key.clone()) {
            return;
        }
        self.order.push_back(key);
        while self.order.len() > Self::CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// The same incarnation registered again (e.g. re-put after etcd lost its data).
    fn remove(&mut self, engine: &EngineId, incarnation: u64) {
        let key = (engine.clone(), incarnation);
        if self.set.remove(&key) {
            self.order.retain(|k| *k != key);
        }
    }

    fn contains(&self, engine: &EngineId, incarnation: u64) -> bool {
        self.set.contains(&(engine.clone(), incarnation))
    }
}

/// The cache (sans-IO): applies parsed changes and turns them into events, and remembers
/// the incarnations that went (under the same lock, so a check never lags the cache).
#[derive(Debug)]
pub(crate) struct DirectoryCache {
    engines: HashMap<EngineId, BTreeMap<u32, Arc<EngineEntry>>>,
    len: usize,
    max_entries: usize,
    gone: GoneIncarnations,
}

impl DirectoryCache {
    pub(crate) fn new(max_entries: usize) -> Self {
        Self { engines: HashMap::new(), len: 0, max_entries, gone: GoneIncarnations::default() }
    }

    /// Whether a hand-off of `engine_id`'s `incarnation` (nonzero), made at `addr` when
    /// it names one, may be pulled from: not if that incarnation was seen to go and is not
    /// listed again, nor (when `listed` says the cache is complete) if the rank at `addr`
    /// is registered with another incarnation.
    pub(crate) fn check_handoff(
        &self,
        engine_id: &str,
        incarnation: u64,
        addr: Option<&AdvertiseAddr>,
        listed: bool,
    ) -> Result<(), ResolveError> {
        if incarnation == 0 {
            return Ok(());
        }
        let ranks = self.engines.get(engine_id);
        let cached = || ranks.into_iter().flat_map(|r| r.values());
        if cached().any(|e| e.record.incarnation == incarnation) {
            return Ok(());
        }
        let engine = || engine_id.to_owned();
        if let Ok(id) = EngineId::new(engine_id) {
            if self.gone.contains(&id, incarnation) {
                return Err(ResolveError::Gone { engine: engine(), incarnation });
            }
        }
        if let (true, Some(addr)) = (listed, addr) {
            if let Some(e) = cached().find(|e| e.record.addr == *addr) {
                return Err(ResolveError::StaleIncarnation {
                    engine: engine(),
                    rank: e.key.rank,
                    handoff: incarnation,
                    registered: e.record.incarnation,
                });
            }
        }
        Ok(())
    }

    pub(crate) fn get(&self, engine_id: &str, rank: u32) -> Option<Arc<EngineEntry>> {
        self.engines.get(engine_id)?.get(&rank).cloned()
    }

    pub(crate) fn engine(&self, engine_id: &str) -> Vec<Arc<EngineEntry>> {
        self.engines.get(engine_id).map(|ranks| ranks.values().cloned().collect()).unwrap_or_default()
    }

    pub(crate) fn entries(&self) -> Vec<Arc<EngineEntry>> {
        self.engines.values().flat_map(|ranks| ranks.values().cloned()).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Caches `entry`; a new rank while the cache is full is ignored instead.
    fn insert(&mut self, entry: EngineEntry) -> Result<Option<DirectoryEvent>, Ignored> {
        if self.len >= self.max_entries && self.get(entry.key.engine_id.as_str(), entry.key.rank).is_none() {
            return Err(Ignored {
                reason: IgnoreReason::Limit,
                key: entry.key.to_string(),
                detail: format!("the directory holds {} ranks already (its limit)", self.len),
            });
        }
        let new = Arc::new(entry);
        self.gone.remove(&new.key.engine_id, new.record.incarnation);
        let ranks = self.engines.entry(new.key.engine_id.clone()).or_default();
        Ok(match ranks.insert(new.key.rank, new.clone()) {
            None => {
                self.len += 1;
                Some(DirectoryEvent::Added(new))
            }
            // The same record written again (a re-registration on a new lease): nothing
            // a connection cares about changed.
            Some(old) if old.record == new.record => None,
            Some(old) => {
                if old.record.incarnation != new.record.incarnation {
                    self.gone.insert(&old.key.engine_id, old.record.incarnation);
                }
                Some(DirectoryEvent::Updated { old, new })
            }
        })
    }

    fn remove(&mut self, key: &EngineKey) -> Option<DirectoryEvent> {
        let ranks = self.engines.get_mut(key.engine_id.as_str())?;
        let old = ranks.remove(&key.rank)?;
        if ranks.is_empty() {
            self.engines.remove(key.engine_id.as_str());
        }
        self.len -= 1;
        self.gone.insert(&old.key.engine_id, old.record.incarnation);
        Some(DirectoryEvent::Removed(old))
    }

    /// A PUT seen by the watch. A good key whose value is no longer a usable record loses
    /// its cached entry (it no longer describes a reachable engine).
    pub(crate) fn apply_put(&mut self, parsed: Parsed) -> (Option<DirectoryEvent>, Option<Ignored>) {
        match parsed {
            Ok(entry) => match self.insert(entry) {
                Ok(event) => (event, None),
                Err(ignored) => (None, Some(ignored)),
            },
            Err((Some(key), ignored)) => (self.remove(&key), Some(ignored)),
            Err((None, ignored)) => (None, Some(ignored)),
        }
    }

    /// A DELETE seen by the watch.
    pub(crate) fn apply_delete(&mut self, key: &EngineKey) -> Option<DirectoryEvent> {
        self.remove(key)
    }

    /// Changes the watch saw, in order.
    pub(crate) fn apply(&mut self, changes: Vec<Change>) -> (Vec<DirectoryEvent>, Vec<Ignored>) {
        let mut events = Vec::new();
        let mut ignored = Vec::new();
        for change in changes {
            match change {
                Change::Put(parsed) => {
                    let (e, i) = self.apply_put(parsed);
                    events.extend(e);
                    ignored.extend(i);
                }
                Change::Delete(key) => events.extend(self.apply_delete(&key)),
            }
        }
        (events, ignored)
    }

    /// A full listing: replaces the cache, and returns what changed since the last one.
    pub(crate) fn replace_all(&mut self, listing: Vec<Parsed>) -> (Vec<DirectoryEvent>, Vec<Ignored>) {
        let mut fresh = Vec::new();
        let mut ignored = Vec::new();
        for parsed in listing {
            match parsed {
                Ok(entry) => fresh.push(entry),
                Err((_, i)) => ignored.push(i),
            }
        }
        let mut events = Vec::new();
        let listed: std::collections::HashSet<&EngineKey> = fresh.iter().map(|e| &e.key).collect();
        let gone: Vec<EngineKey> =
            self.entries().into_iter().map(|e| e.key.clone()).filter(|k| !listed.contains(k)).collect();
        for key in gone {
            events.extend(self.remove(&key));
        }
        for entry in fresh {
            match self.insert(entry) {
                Ok(event) => events.extend(event),
                Err(i) => ignored.push(i),
            }
        }
        (events, ignored)
    }
}

/// The rules of [`EngineDirectory::resolve_current`].
fn check_current(
    entry: Option<Arc<EngineEntry>>,
    synced: bool,
    engine_id: &str,
    rank: u32,
    incarnation: Option<u64>,
) -> Result<Arc<EngineEntry>, ResolveError> {
    let engine = || engine_id.to_owned();
    let Some(entry) = entry else {
        return Err(if synced {
            ResolveError::NotRegistered { engine: engine(), rank }
        } else {
            ResolveError::NotSynced { engine: engine(), rank }
        });
    };
    match incarnation {
        Some(handoff) if handoff != 0 && handoff != entry.record.incarnation => {
            Err(ResolveError::StaleIncarnation {
                engine: engine(),
                rank,
                handoff,
                registered: entry.record.incarnation,
            })
        }
        _ => Ok(entry),
    }
}

/// The default [`DirectoryOptions::max_entries`].
pub const DEFAULT_MAX_ENTRIES: usize = 65_536;

/// Options of a directory.
#[derive(Debug, Clone)]
pub struct DirectoryOptions {
    /// When set, records with another layout hash are ignored (and counted): this agent
    /// could not pull from them anyway.
    pub expected_compat_hash: Option<u64>,
    /// Most ranks cached; further new ones are ignored (counted as `limit`), so that a
    /// flood of valid keys cannot grow the cache without bound. Default
    /// [`DEFAULT_MAX_ENTRIES`].
    pub max_entries: usize,
}

impl Default for DirectoryOptions {
    fn default() -> Self {
        Self { expected_compat_hash: None, max_entries: DEFAULT_MAX_ENTRIES }
    }
}

/// Counters of a directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectoryStats {
    /// Ranks cached now.
    pub entries: u64,
    /// `Added` events.
    pub added: u64,
    /// `Updated` events.
    pub updated: u64,
    /// `Removed` events.
    pub removed: u64,
    /// Values ignored: key not `<engine_id>/<rank>`.
    pub ignored_bad_key: u64,
    /// Values ignored: not a valid record.
    pub ignored_malformed: u64,
    /// Values ignored: another record format version.
    pub ignored_unsupported_version: u64,
    /// Values ignored: another layout hash.
    pub ignored_layout_mismatch: u64,
    /// New ranks ignored: the cache held [`DirectoryOptions::max_entries`].
    pub ignored_limit: u64,
    /// Full listings (1 + one per reconnection).
    pub listings: u64,
}

impl DirectoryStats {
    /// The ignored count for `reason`.
    pub fn ignored(&self, reason: IgnoreReason) -> u64 {
        match reason {
            IgnoreReason::BadKey => self.ignored_bad_key,
            IgnoreReason::Malformed => self.ignored_malformed,
            IgnoreReason::UnsupportedVersion => self.ignored_unsupported_version,
            IgnoreReason::LayoutMismatch => self.ignored_layout_mismatch,
            IgnoreReason::Limit => self.ignored_limit,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    added: AtomicU64,
    updated: AtomicU64,
    removed: AtomicU64,
    ignored: [AtomicU64; 5],
    listings: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) status: StatusCell,
    cache: RwLock<DirectoryCache>,
    subscribers: Mutex<Vec<mpsc::UnboundedSender<DirectoryEvent>>>,
    counters: Counters,
    /// A first listing has filled the cache.
    synced: AtomicBool,
    /// The cache is current: listed, and watching since (not degraded). A stale cache may
    /// lack a restarted process's record, so restarts are judged from it only when current.
    current: AtomicBool,
    warn: Mutex<WarnLimiter>,
    /// Rate limit of the per-event info logs (a flood of keys cannot flood the log).
    event_logs: Mutex<WarnLimiter>,
    rules: RecordRules,
}

impl Shared {
    fn cache(&self) -> std::sync::RwLockReadGuard<'_, DirectoryCache> {
        self.cache.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn stats(&self) -> DirectoryStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.counters;
        DirectoryStats {
            entries: self.cache().len() as u64,
            added: l(&c.added),
            updated: l(&c.updated),
            removed: l(&c.removed),
            ignored_bad_key: l(&c.ignored[0]),
            ignored_malformed: l(&c.ignored[1]),
            ignored_unsupported_version: l(&c.ignored[2]),
            ignored_layout_mismatch: l(&c.ignored[3]),
            ignored_limit: l(&c.ignored[4]),
            listings: l(&c.listings),
        }
    }

    /// Applies `change` to the cache under the write lock, then (lock released) counts,
    /// logs and sends what came out of it.
    fn update(&self, change: impl FnOnce(&mut DirectoryCache) -> (Vec<DirectoryEvent>, Vec<Ignored>)) {
        let (events, ignored) = {
            let mut cache = self.cache.write().unwrap_or_else(PoisonError::into_inner);
            change(&mut cache)
        };
        for i in ignored {
            let index = IgnoreReason::ALL.iter().position(|r| *r == i.reason).unwrap_or(0);
            self.counters.ignored[index].fetch_add(1, Ordering::Relaxed);
            let allowed = self.warn.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
            if let Some(suppressed) = allowed {
                tracing::warn!(key = %i.key, reason = i.reason.as_str(), detail = %i.detail, suppressed, "ignoring a value in the engine directory");
            }
        }
        if events.is_empty() {
            return;
        }
        let mut logs = self.event_logs.lock().unwrap_or_else(PoisonError::into_inner);
        for event in &events {
            let counter = match event {
                DirectoryEvent::Added(_) => &self.counters.added,
                DirectoryEvent::Updated { .. } => &self.counters.updated,
                DirectoryEvent::Removed(_) => &self.counters.removed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            let Some(suppressed) = logs.allow(Instant::now()) else { continue };
            match event {
                DirectoryEvent::Added(e) => {
                    tracing::info!(engine = %e.key, addr = %e.record.addr, incarnation = %format_args!("{:016x}", e.record.incarnation), suppressed, "engine registered");
                }
                DirectoryEvent::Updated { old, new } => {
                    tracing::info!(engine = %new.key, addr = %new.record.addr, old_incarnation = %format_args!("{:016x}", old.record.incarnation), new_incarnation = %format_args!("{:016x}", new.record.incarnation), suppressed, "engine record changed");
                }
                DirectoryEvent::Removed(e) => {
                    tracing::info!(engine = %e.key, addr = %e.record.addr, suppressed, "engine gone");
                }
            }
        }
        drop(logs);
        let mut subscribers = self.subscribers.lock().unwrap_or_else(PoisonError::into_inner);
        subscribers.retain(|tx| events.iter().all(|e| tx.send(e.clone()).is_ok()));
    }
}

/// The events of one subscriber, in the order the cache changed. Unbounded: a subscriber
/// never misses an event (etcd's rate of changes bounds the queue).
#[derive(Debug)]
pub struct DirectoryEvents {
    rx: mpsc::UnboundedReceiver<DirectoryEvent>,
}

impl DirectoryEvents {
    /// The next event; `None` once the directory is gone.
    pub async fn recv(&mut self) -> Option<DirectoryEvent> {
        self.rx.recv().await
    }

    /// The next event if one is queued.
    pub fn try_recv(&mut self) -> Option<DirectoryEvent> {
        self.rx.try_recv().ok()
    }

    /// The next event, blocking this thread (not for use inside an async task).
    pub fn blocking_recv(&mut self) -> Option<DirectoryEvent> {
        self.rx.blocking_recv()
    }
}

/// The registered engines of one namespace, cached and kept current from etcd.
/// [`Self::resolve`] answers from the cache and never waits for etcd.
#[derive(Debug)]
pub struct EngineDirectory {
    shared: Arc<Shared>,
    namespace: Namespace,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl EngineDirectory {
    /// Starts listing and watching `namespace` on `runtime`; returns at once (the cache fills
    /// in the background: [`Self::wait_synced`] waits for the first listing).
    pub fn start(
        runtime: &Handle,
        etcd: EtcdConfig,
        namespace: Namespace,
        options: DirectoryOptions,
    ) -> Result<Self, Error> {
        etcd.check()?;
        let shared = Arc::new(Shared {
            status: StatusCell::new(),
            cache: RwLock::new(DirectoryCache::new(options.max_entries)),
            subscribers: Mutex::new(Vec::new()),
            counters: Counters::default(),
            synced: AtomicBool::new(false),
            current: AtomicBool::new(false),
            warn: Mutex::new(WarnLimiter::new(10)),
            event_logs: Mutex::new(WarnLimiter::new(EVENT_LOGS_PER_SECOND)),
            rules: RecordRules::new(namespace.clone(), options.expected_compat_hash),
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        let watcher = Watcher { shared: shared.clone(), etcd, prefix: engines_prefix(&namespace) };
        let task = runtime.spawn(watcher.run(stop_rx));
        Ok(Self { shared, namespace, stop: Some(stop_tx), task: Some(task) })
    }

    /// The namespace it watches.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// The cached entry of `engine_id`'s rank `rank`. Never touches etcd: while etcd is
    /// unreachable this is the last state seen (see [`Self::status`]).
    pub fn resolve(&self, engine_id: &str, rank: u32) -> Option<Arc<EngineEntry>> {
        self.shared.cache().get(engine_id, rank)
    }

    /// The cached entry a pull from `engine_id`'s rank `rank` should use, checked against
    /// the hand-off's `incarnation` when it states one (nonzero): an engine that is gone or
    /// restarted fails at once, with why, instead of at the next I/O timeout.
    pub fn resolve_current(
        &self,
        engine_id: &str,
        rank: u32,
        incarnation: Option<u64>,
    ) -> Result<Arc<EngineEntry>, ResolveError> {
        let entry = self.resolve(engine_id, rank);
        check_current(entry, self.is_synced(), engine_id, rank, incarnation)
    }

    /// Whether a hand-off of `engine_id` made by `incarnation` (0: states none, never
    /// refused) at `addr` (when it names one) may be pulled from, judged from the cache
    /// alone: [`ResolveError::Gone`] when the directory saw that incarnation deleted or
    /// replaced and does not list it again; [`ResolveError::StaleIncarnation`] when the
    /// cache is current ([`Self::is_current`]: listed, and watching since) and the rank
    /// registered at `addr` is another incarnation (a restart this agent may not have seen
    /// happen). While degraded the cache may predate a restart (a process restarted while
    /// etcd is down cannot register), so an incarnation it does not know is not refused
    /// then: the pull's handshake checks the incarnation anyway. Checked under the cache's
    /// lock, so it never lags the events subscribers receive.
    pub fn check_handoff(
        &self,
        engine_id: &str,
        incarnation: u64,
        addr: Option<&AdvertiseAddr>,
    ) -> Result<(), ResolveError> {
        let cache = self.shared.cache();
        cache.check_handoff(engine_id, incarnation, addr, self.is_current())
    }

    /// Every cached rank of `engine_id`, by rank.
    pub fn engine(&self, engine_id: &str) -> Vec<Arc<EngineEntry>> {
        self.shared.cache().engine(engine_id)
    }

    /// Every cached rank.
    pub fn entries(&self) -> Vec<Arc<EngineEntry>> {
        self.shared.cache().entries()
    }

    /// A new subscriber: receives every change from now on.
    pub fn subscribe(&self) -> DirectoryEvents {
        let (tx, rx) = mpsc::unbounded_channel();
        self.shared.subscribers.lock().unwrap_or_else(PoisonError::into_inner).push(tx);
        DirectoryEvents { rx }
    }

    /// Whether a first listing has filled the cache (it stays filled while degraded).
    pub fn is_synced(&self) -> bool {
        self.shared.synced.load(Ordering::Acquire)
    }

    /// Whether the cache is current: listed, and watching etcd since (false from the first
    /// failure until the next listing). A cache that is not current answers [`Self::resolve`]
    /// with the last state seen, but [`Self::check_handoff`] does not judge restarts by it.
    pub fn is_current(&self) -> bool {
        self.shared.current.load(Ordering::Acquire)
    }

    /// Waits until the cache is filled from etcd and being watched, up to `timeout`; at
    /// once `Err` when the directory gave up ([`EtcdState::Failed`]: etcd refused its
    /// credentials, certificate or permissions — `last_error` says which).
    pub async fn wait_synced(&self, timeout: Duration) -> Result<EtcdStatus, EtcdStatus> {
        let ended = |s: &EtcdStatus| matches!(s.state, EtcdState::Connected | EtcdState::Failed);
        match self.status_watch().wait_until(timeout, ended).await {
            Ok(s) if s.state == EtcdState::Connected => Ok(s),
            Ok(s) | Err(s) => Err(s),
        }
    }

    /// Where it stands with etcd.
    pub fn status(&self) -> EtcdStatus {
        self.shared.status.get()
    }

    /// A receiver that sees every status change.
    pub fn status_watch(&self) -> StatusWatch {
        self.shared.status.subscribe()
    }

    /// Counters.
    pub fn stats(&self) -> DirectoryStats {
        self.shared.stats()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops watching (the cache stays readable until this value is dropped).
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for EngineDirectory {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The background task: list, then watch from the listing's revision; on any failure,
/// back off and list again (which also covers a compacted watch and a restarted etcd).
struct Watcher {
    shared: Arc<Shared>,
    etcd: EtcdConfig,
    prefix: String,
}

impl Watcher {
    async fn run(self, mut stop: oneshot::Receiver<()>) {
        let mut rng = rand::rngs::StdRng::from_os_rng();
        let mut backoff = Backoff::new(self.etcd.backoff_initial, self.etcd.backoff_max);
        let mut failover = Failover::default();
        let mut reminder = WarnLimiter::every(REMINDER_INTERVAL);
        loop {
            let failed = tokio::select! {
                _ = &mut stop => break,
                e = self.session(&mut backoff, &mut failover) => e,
            };
            // From now on the cache may miss changes: restarts are not judged by it.
            self.shared.current.store(false, Ordering::Release);
            // Final only before the first listing (see the registration's keeper).
            if failed.is_permanent() && !self.shared.status.was_connected() {
                let why = crate::error::RegistrationError::Refused { reason: failed.to_string() };
                tracing::error!(prefix = %self.prefix, error = %why, "engine directory refused by etcd; it stops (serving from its cache)");
                self.shared.status.gave_up(&why);
                break;
            }
            failover.session_failed();
            let delay = backoff.next_delay(&mut rng);
            let first = self.shared.status.failed(&failed);
            if let Some(failures) = reminder.failed(Instant::now(), first) {
                let failing_for = self.shared.status.get().since.elapsed();
                tracing::warn!(prefix = %self.prefix, error = %failed, failures, ?failing_for, "engine directory degraded; serving from its cache and retrying");
            } else {
                tracing::debug!(prefix = %self.prefix, error = %failed, retry_in = ?delay, "engine directory still cannot reach etcd");
            }
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(delay) => {}
            }
        }
        self.shared.current.store(false, Ordering::Release);
        self.shared.status.stopped();
    }

    /// One connection: list, watch, apply until something fails. Never returns `Ok`.
    async fn session(&self, backoff: &mut Backoff, failover: &mut Failover) -> EtcdError {
        let etcd = &self.etcd;
        // A fresh client per attempt, of one live member: no state survives from a broken
        // connection.
        let client: Client = match etcd.connect(failover, &self.prefix).await {
            Ok((c, endpoint)) => {
                self.shared.status.endpoint(&endpoint);
                c
            }
            Err(e) => return e,
        };
        let (revision, listing) = match self.list(&client).await {
            Ok(l) => l,
            Err(e) => return e,
        };
        self.shared.counters.listings.fetch_add(1, Ordering::Relaxed);
        self.shared.update(|cache| cache.replace_all(listing));
        // Listed: the cache is a whole snapshot from here on, so what it lacks (or lists
        // under another incarnation) can be judged — also in the window before the watch
        // below is set up (a check made then saw a filled cache but called it unlisted).
        self.shared.synced.store(true, Ordering::Release);
        self.shared.current.store(true, Ordering::Release);
        // Fragments: etcd splits a response larger than its request limit (1.5 MiB by
        // default) instead of sending one that could exceed the client's.
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1).with_fragment();
        let mut watch_client = client.watch_client().max_decoding_message_size(etcd.max_response_bytes);
        let mut stream =
            match etcd.call(EtcdOp::Watch, watch_client.watch(self.prefix.as_str(), Some(options))).await {
                Ok(s) => s,
                Err(e) => return e,
            };
        backoff.reset();
        if self.shared.status.connected() {
            tracing::info!(prefix = %self.prefix, revision, "engine directory reconnected to etcd and re-listed");
        } else {
            tracing::info!(prefix = %self.prefix, revision, entries = self.shared.cache().len(), "engine directory listed and watching");
        }
        loop {
            // No timeout: HTTP/2 pings bound how long a dead connection goes unnoticed.
            let response = match crate::etcd::watch_message(stream.message().await) {
                Ok(r) => r,
                Err(e) => return e,
            };
            if response.events().is_empty() {
                continue;
            }
            let rules = &self.shared.rules;
            let changes: Vec<Change> = response
                .events()
                .iter()
                .filter_map(|event| {
                    let kv = event.kv()?;
                    match event.event_type() {
                        EventType::Put => Some(Change::Put(rules.parse(&Kv::from(kv)))),
                        EventType::Delete => rules.deleted_key(kv.key()).map(Change::Delete),
                    }
                })
                .collect();
            self.shared.update(|cache| cache.apply(changes));
        }
    }

    /// Lists the prefix page by page, every page at the first page's revision (a
    /// consistent snapshot; a revision compacted meanwhile fails the listing, which is then
    /// retried), parsing each page as it comes. A page larger than the client accepts
    /// is asked for again with half as many keys. Returns the revision and the parsed pairs.
    async fn list(&self, client: &Client) -> Result<(i64, Vec<Parsed>), EtcdError> {
        let mut kv = client.kv_client().max_decoding_message_size(self.etcd.max_response_bytes);
        let end = prefix_end(self.prefix.as_bytes());
        let mut from = self.prefix.clone().into_bytes();
        let mut revision = 0;
        let mut page_keys = LIST_PAGE_KEYS;
        let mut parsed = Vec::new();
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(page_keys);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let page = match self.etcd.call(EtcdOp::List, kv.get(from.clone(), Some(options))).await {
                Ok(page) => page,
                Err(e) if page_keys > 1 && is_message_too_large(&e) => {
                    page_keys /= 2;
                    tracing::debug!(prefix = %self.prefix, page_keys, "listing page too large; asking for fewer keys");
                    continue;
                }
                Err(e) => return Err(e),
            };
            if revision == 0 {
                revision = page.header().map_or(0, |h| h.revision());
            }
            parsed.extend(page.kvs().iter().map(|kv| self.shared.rules.parse(&Kv::from(kv))));
            match page.kvs().last() {
                Some(last) if page.more() => {
                    // The next page starts right after the last key of this one.
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok((revision, parsed)),
            }
        }
    }
}

/// Keys asked for per listing page (fewer when a page would exceed the client's message
/// limit). Valid records are at most 4 KiB; a page of junk values etcd accepts (1.5 MiB
/// each by default) stays under [`EtcdConfig::max_response_bytes`]'s default 128 MiB.
const LIST_PAGE_KEYS: i64 = 64;

/// Most per-event info logs a second; the others are counted in the next one.
const EVENT_LOGS_PER_SECOND: u32 = 20;

/// The end of the key range of `prefix` (the first key after every key it starts).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    // Only 0xff bytes: every key from the prefix on (etcd's "\0" range end).
    vec![0]
}

/// The client refused a message above its decoding limit (tonic's `OutOfRange`).
fn is_message_too_large(e: &EtcdError) -> bool {
    match e {
        EtcdError::Client { source: etcd_client::Error::GRpcStatus(status), .. } => {
            status.message().contains("message length too large")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::{AgentName, TransportName};
    use crate::record::{AdvertiseAddr, Host};

    fn record(incarnation: u64, hash: u64) -> Vec<u8> {
        EngineRecord {
            addr: AdvertiseAddr::new(Host::parse("10.0.0.1").expect("host"), 7000).expect("addr"),
            transports: vec![TransportName::tcp()],
            compat_hash: hash,
            protocol_version: 2,
            incarnation,
            agent: AgentName::new("p").expect("name"),
            draining: false,
        }
        .to_json()
    }

    fn kv<'a>(key: &'a [u8], value: &'a [u8]) -> Kv<'a> {
        Kv { key, value, mod_revision: 1, lease: 7 }
    }

    /// A cache and the rules that parse for it, as the watcher uses them.
    struct Cache {
        rules: RecordRules,
        cache: DirectoryCache,
    }

    impl Cache {
        fn apply_put(&mut self, kv: &Kv<'_>) -> (Option<DirectoryEvent>, Option<Ignored>) {
            self.cache.apply_put(self.rules.parse(kv))
        }

        fn apply_delete(&mut self, key: &[u8]) -> Option<DirectoryEvent> {
            self.cache.apply_delete(&self.rules.deleted_key(key)?)
        }

        fn replace_all<'a>(
            &mut self,
            kvs: impl IntoIterator<Item = Kv<'a>>,
        ) -> (Vec<DirectoryEvent>, Vec<Ignored>) {
            let parsed = kvs.into_iter().map(|kv| self.rules.parse(&kv)).collect();
            self.cache.replace_all(parsed)
        }
    }

    impl std::ops::Deref for Cache {
        type Target = DirectoryCache;
        fn deref(&self) -> &DirectoryCache {
            &self.cache
        }
    }

    fn cache_of(max_entries: usize) -> Cache {
        Cache {
            rules: RecordRules::new(Namespace::new("ns").expect("ns"), Some(0xab)),
            cache: DirectoryCache::new(max_entries),
        }
    }

    fn cache() -> Cache {
        cache_of(DEFAULT_MAX_ENTRIES)
    }

    #[test]
    fn puts_and_deletes_become_events() {
        let mut c = cache();
        let k = b"/ns/v1/engines/e1/0";
        let (e, i) = c.apply_put(&kv(k, &record(1, 0xab)));
        assert!(matches!(e, Some(DirectoryEvent::Added(_))) && i.is_none());
        // The same record again (re-registration on a new lease): no event.
        assert_eq!(c.apply_put(&kv(k, &record(1, 0xab))), (None, None));
        // A new incarnation: Updated with both.
        match c.apply_put(&kv(k, &record(2, 0xab))) {
            (Some(DirectoryEvent::Updated { old, new }), None) => {
                assert_eq!((old.record.incarnation, new.record.incarnation), (1, 2));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.get("e1", 0).map(|e| e.record.incarnation), Some(2));
        assert!(matches!(c.apply_delete(k), Some(DirectoryEvent::Removed(_))));
        assert_eq!(c.apply_delete(k), None);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn bad_values_are_ignored_and_evict_a_good_one() {
        let mut c = cache();
        let k = b"/ns/v1/engines/e1/0";
        c.apply_put(&kv(k, &record(1, 0xab)));
        let (e, i) = c.apply_put(&kv(k, b"\xff\x00garbage"));
        assert!(matches!(e, Some(DirectoryEvent::Removed(_))));
        assert_eq!(i.map(|i| i.reason), Some(IgnoreReason::Malformed));
        let (e, i) = c.apply_put(&kv(k, &record(1, 0xcd)));
        assert_eq!((e, i.map(|i| i.reason)), (None, Some(IgnoreReason::LayoutMismatch)));
        let (e, i) = c.apply_put(&kv(b"/ns/v1/engines/e1/x", &record(1, 0xab)));
        assert_eq!((e, i.map(|i| i.reason)), (None, Some(IgnoreReason::BadKey)));
        let v2 = String::from_utf8(record(1, 0xab)).expect("utf8").replace(r#""v":1"#, r#""v":9"#);
        let (_, i) = c.apply_put(&kv(k, v2.as_bytes()));
        assert_eq!(i.map(|i| i.reason), Some(IgnoreReason::UnsupportedVersion));
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn resolving_for_a_pull_names_why_an_engine_cannot_be_used() {
        let mut c = cache();
        c.apply_put(&kv(b"/ns/v1/engines/e1/0", &record(5, 0xab)));
        let entry = c.get("e1", 0);
        assert!(check_current(entry.clone(), true, "e1", 0, Some(5)).is_ok());
        assert!(check_current(entry.clone(), true, "e1", 0, None).is_ok());
        assert!(check_current(entry.clone(), true, "e1", 0, Some(0)).is_ok(), "0 states nothing");
        assert!(matches!(
            check_current(entry, true, "e1", 0, Some(4)),
            Err(ResolveError::StaleIncarnation { handoff: 4, registered: 5, .. })
        ));
        assert!(matches!(check_current(None, true, "e2", 0, None), Err(ResolveError::NotRegistered { .. })));
        assert!(matches!(check_current(None, false, "e2", 0, None), Err(ResolveError::NotSynced { .. })));
    }

    #[test]
    fn a_listing_reports_what_changed_since_the_last() {
        let mut c = cache();
        let (a, b, d) = (&b"/ns/v1/engines/a/0"[..], &b"/ns/v1/engines/b/0"[..], &b"/ns/v1/engines/d/1"[..]);
        let (r1, r2) = (record(1, 0xab), record(2, 0xab));
        let (events, _) = c.replace_all([kv(a, &r1), kv(b, &r1)]);
        assert_eq!(events.len(), 2);
        // Meanwhile: a restarted (new incarnation), b gone, d new, plus garbage.
        let (events, ignored) = c.replace_all([kv(a, &r2), kv(d, &r1), kv(b"/ns/v1/engines/zz", b"x")]);
        let kinds: Vec<&str> = events
            .iter()
            .map(|e| match e {
                DirectoryEvent::Added(_) => "added",
                DirectoryEvent::Updated { .. } => "updated",
                DirectoryEvent::Removed(_) => "removed",
            })
            .collect();
        assert_eq!(kinds, ["removed", "updated", "added"]);
        assert_eq!(ignored.len(), 1);
        assert_eq!(c.engine("d").len(), 1);
        assert_eq!(c.entries().len(), 2);
    }

    #[test]
    fn a_full_cache_ignores_new_ranks_but_keeps_updating_cached_ones() {
        let mut c = cache_of(2);
        let r1 = record(1, 0xab);
        c.apply_put(&kv(b"/ns/v1/engines/a/0", &r1));
        c.apply_put(&kv(b"/ns/v1/engines/b/0", &r1));
        let (e, i) = c.apply_put(&kv(b"/ns/v1/engines/c/0", &r1));
        assert_eq!((e, i.map(|i| i.reason)), (None, Some(IgnoreReason::Limit)));
        // A cached rank still changes.
        let (e, i) = c.apply_put(&kv(b"/ns/v1/engines/a/0", &record(2, 0xab)));
        assert!(matches!(e, Some(DirectoryEvent::Updated { .. })) && i.is_none());
        // A listing keeps what fits and counts the rest.
        let (events, ignored) = c.replace_all([
            kv(b"/ns/v1/engines/x/0", &r1),
            kv(b"/ns/v1/engines/y/0", &r1),
            kv(b"/ns/v1/engines/z/0", &r1),
        ]);
        assert_eq!(events.len(), 2 + 2, "a and b removed, two added");
        assert_eq!(ignored.iter().map(|i| i.reason).collect::<Vec<_>>(), [IgnoreReason::Limit]);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn gone_incarnations_are_known_as_soon_as_the_cache_changes() {
        let mut c = cache();
        let k = b"/ns/v1/engines/e1/0";
        let at = AdvertiseAddr::new(Host::parse("10.0.0.1").expect("host"), 7000).expect("addr");
        let elsewhere = AdvertiseAddr::new(Host::parse("10.0.0.9").expect("host"), 7000).expect("addr");
        c.apply_put(&kv(k, &record(1, 0xab)));
        assert_eq!(c.check_handoff("e1", 1, Some(&at), true), Ok(()));
        // Replaced by a restart: the old incarnation is gone at once.
        c.apply_put(&kv(k, &record(2, 0xab)));
        assert!(matches!(
            c.check_handoff("e1", 1, Some(&at), true),
            Err(ResolveError::Gone { incarnation: 1, .. })
        ));
        assert_eq!(c.check_handoff("e1", 2, Some(&at), true), Ok(()));
        assert_eq!(c.check_handoff("e1", 0, Some(&at), true), Ok(()), "0 states nothing");
        c.apply_delete(k);
        assert!(matches!(
            c.check_handoff("e1", 2, None, true),
            Err(ResolveError::Gone { incarnation: 2, .. })
        ));
        // Registered again with the same incarnation (etcd lost its data): fine again.
        c.apply_put(&kv(k, &record(2, 0xab)));
        assert_eq!(c.check_handoff("e1", 2, None, true), Ok(()));

        // A fresh cache (a decode agent started after the restart) never saw 1 go: the
        // rank registered at the hand-off's address says it is stale, once listed.
        let mut fresh = cache();
        fresh.apply_put(&kv(k, &record(2, 0xab)));
        assert!(matches!(
            fresh.check_handoff("e1", 1, Some(&at), true),
            Err(ResolveError::StaleIncarnation { handoff: 1, registered: 2, rank: 0, .. })
        ));
        assert_eq!(fresh.check_handoff("e1", 1, Some(&at), false), Ok(()), "not listed yet: no verdict");
        assert_eq!(fresh.check_handoff("e1", 1, Some(&elsewhere), true), Ok(()), "another rank's address");
        assert_eq!(fresh.check_handoff("e9", 1, Some(&at), true), Ok(()), "an engine not registered");
    }
}
