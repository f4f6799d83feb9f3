//! One engine rank's key in etcd, on a lease kept alive by a background task.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use rand::SeedableRng;
use tokio::runtime::Handle;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;

use crate::backoff::{Backoff, WarnLimiter, REMINDER_INTERVAL};
use crate::error::{ConfigError, Error, EtcdError, EtcdOp, RegistrationError};
use crate::etcd::{EtcdConfig, EtcdState, EtcdStatus, Failover, StatusCell, StatusWatch};
use crate::names::EngineKey;
use crate::record::EngineRecord;

/// The shortest lease TTL: etcd's default minimum (1.5 × its 1 s election timeout, rounded
/// up); etcd silently raises shorter ones.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(2);
/// The longest lease TTL accepted here (a day: longer only delays crash detection).
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(86_400);

/// The longest time between two keep-alives: they go every TTL/3, but at least this often,
/// so that an etcd stall, a failover to another member or a leader election may last up
/// to about TTL − 1.5 s (this interval, plus a quick reconnection) before the lease runs
/// out. A renewal is one small message to etcd's leader (no raft round).
pub const MAX_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);

/// The longest wait between two reconnection attempts while the lease may still be alive
/// (its TTL since the last answer has not run out): every moment of a stall or failover
/// counts against the lease. Once it is surely gone the usual backoff applies.
const LEASE_SAVING_RETRY: Duration = Duration::from_millis(200);

/// How often a first registration that found another incarnation's key looks again (is it
/// gone, is its lease being renewed?).
const HOLDER_POLL: Duration = Duration::from_millis(250);

/// How much of the time measured between two answers about the holder's lease is not
/// trusted (request latency): a lease left alone loses at least `floor(waited - this)`
/// whole seconds of its remaining TTL in between.
const HOLDER_CLOCK_SLACK: Duration = Duration::from_millis(300);

/// How often a lease of `ttl_secs` is kept alive: every TTL/3, at most
/// [`MAX_KEEPALIVE_INTERVAL`] apart.
fn keepalive_interval(ttl_secs: i64) -> Duration {
    let ttl_ms = u64::try_from(ttl_secs).unwrap_or(1).max(1).saturating_mul(1000);
    Duration::from_millis(ttl_ms / 3).min(MAX_KEEPALIVE_INTERVAL)
}

/// What to register.
#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    /// Where.
    pub key: EngineKey,
    /// What.
    pub record: EngineRecord,
    /// The lease TTL: a crashed agent's key disappears at most this long after its last
    /// keep-alive (keep-alives go every TTL/3, at least every second). It is also how long
    /// etcd may be unreachable (stalled, failing over, electing a leader) before a live
    /// agent's key goes and comes back: stalls up to about TTL − 1.5 s are survived. Whole
    /// seconds, [`MIN_LEASE_TTL`] or more.
    pub ttl: Duration,
}

/// Counters of a registration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistrationStats {
    /// Leases granted (1 + one per lease lost).
    pub grants: u64,
    /// Times the key was written (once per (re)connection).
    pub puts: u64,
    /// Leases found expired or revoked (etcd restarted without its data, keep-alives
    /// missing for longer than the TTL, an operator revoking it).
    pub leases_lost: u64,
    /// Keep-alives answered.
    pub keepalives: u64,
    /// Times the key was put back after it was deleted under a live lease (an operator's
    /// `etcdctl del`, or a replacement's key going away).
    pub restores: u64,
    /// Times the key held another incarnation's record when this registration (back from
    /// a lost lease or a broken connection) went to put its own, or was overwritten by
    /// another incarnation: this one then leaves the key alone until it is free.
    pub conflicts: u64,
}

#[derive(Debug, Default)]
struct Counters {
    grants: AtomicU64,
    puts: AtomicU64,
    leases_lost: AtomicU64,
    keepalives: AtomicU64,
    restores: AtomicU64,
    conflicts: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) status: StatusCell,
    counters: Counters,
    /// The lease the key is on, 0 when none.
    lease: AtomicI64,
    /// Whether the key was put once: later puts take it only if free or still ours.
    claimed: AtomicBool,
    /// Why it gave up for good, if it did.
    failure: OnceLock<RegistrationError>,
    /// Draining because the owner said so ([`Registration::drain`]).
    drain_called: AtomicBool,
    /// Draining because the engine's drain key exists in etcd.
    drain_keyed: AtomicBool,
    /// Either drain flag changed: the record is put again with the new state.
    drain_changed: Notify,
}

impl Shared {
    fn is_draining(&self) -> bool {
        self.drain_called.load(Ordering::Relaxed) || self.drain_keyed.load(Ordering::Relaxed)
    }

    pub(crate) fn stats(&self) -> RegistrationStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RegistrationStats {
            grants: l(&self.counters.grants),
            puts: l(&self.counters.puts),
            leases_lost: l(&self.counters.leases_lost),
            keepalives: l(&self.counters.keepalives),
            restores: l(&self.counters.restores),
            conflicts: l(&self.counters.conflicts),
        }
    }
}

/// How the owner stops the task.
#[derive(Debug)]
enum Stop {
    /// Revoke the lease (the key goes at once) and end.
    Revoke,
}

/// A registered engine rank. The key lives as long as this value keeps its lease alive:
/// [`Registration::shutdown`] revokes it (gone at once); dropping it stops the keep-alives
/// (gone within the TTL — what a crash looks like).
#[derive(Debug)]
pub struct Registration {
    shared: Arc<Shared>,
    key: EngineKey,
    record: EngineRecord,
    stop: Option<oneshot::Sender<Stop>>,
    task: Option<JoinHandle<Result<(), EtcdError>>>,
}

impl Registration {
    /// Starts registering on `runtime` and returns at once: the first put happens in the
    /// background, retried with backoff until etcd answers ([`Self::status`] says where it
    /// stands; [`Self::wait_registered`] waits for it).
    pub fn start(runtime: &Handle, etcd: EtcdConfig, config: RegistrationConfig) -> Result<Self, Error> {
        etcd.check()?;
        let ttl_secs = config.ttl.as_secs() + u64::from(config.ttl.subsec_nanos() > 0);
        if config.ttl < MIN_LEASE_TTL || config.ttl > MAX_LEASE_TTL {
            return Err(ConfigError::LeaseTtl {
                ttl: config.ttl,
                min: MIN_LEASE_TTL.as_secs(),
                max: MAX_LEASE_TTL.as_secs(),
            }
            .into());
        }
        let shared = Arc::new(Shared {
            status: StatusCell::new(),
            counters: Counters::default(),
            lease: AtomicI64::new(0),
            claimed: AtomicBool::new(false),
            failure: OnceLock::new(),
            drain_called: AtomicBool::new(false),
            drain_keyed: AtomicBool::new(false),
            drain_changed: Notify::new(),
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        let task = Keeper {
            shared: shared.clone(),
            etcd,
            key: config.key.clone(),
            drain_key: config.key.drain_key(),
            record: config.record.clone(),
            ttl_secs: i64::try_from(ttl_secs).unwrap_or(i64::MAX),
        };
        let task = runtime.spawn(task.run(stop_rx));
        Ok(Self { shared, key: config.key, record: config.record, stop: Some(stop_tx), task: Some(task) })
    }

    /// The registered key.
    pub fn key(&self) -> &EngineKey {
        &self.key
    }

    /// The registered record, as given at start (the stored one also says whether the
    /// engine is draining: [`Self::is_draining`]).
    pub fn record(&self) -> &EngineRecord {
        &self.record
    }

    /// Starts draining: the record is put again with `"draining":true`, so directories
    /// (and the routers reading them) see that this engine takes no new hand-offs, while
    /// the key, its lease and every connection stay. What "no new hand-offs" means is up
    /// to the owner (a kvxfer prefill agent refuses new leases). Returns at once; without
    /// etcd the new state is put when it is back. Draining also starts while the engine's
    /// drain key `/<ns>/v1/drain/<engine_id>` exists ([`EngineKey::drain_key`]).
    pub fn drain(&self) {
        if !self.shared.drain_called.swap(true, Ordering::Relaxed) {
            self.shared.drain_changed.notify_one();
        }
    }

    /// Ends a drain started by [`Self::drain`] (one held by the drain key lasts until the
    /// key is deleted).
    pub fn undrain(&self) {
        if self.shared.drain_called.swap(false, Ordering::Relaxed) {
            self.shared.drain_changed.notify_one();
        }
    }

    /// Whether the engine is draining: [`Self::drain`] was called, or the engine's drain
    /// key exists (as of the registration's last look at etcd).
    pub fn is_draining(&self) -> bool {
        self.shared.is_draining()
    }

    /// Where it stands with etcd.
    pub fn status(&self) -> EtcdStatus {
        self.shared.status.get()
    }

    /// A receiver that sees every status change.
    pub fn status_watch(&self) -> StatusWatch {
        self.shared.status.subscribe()
    }

    /// Waits until the key is in etcd (state `Connected`), up to `timeout`; on timeout, or
    /// at once when the registration gave up ([`EtcdState::Failed`]: another live process
    /// holds the key — [`Self::failure`] says why), returns the status as it then is (with
    /// the last error).
    pub async fn wait_registered(&self, timeout: Duration) -> Result<EtcdStatus, EtcdStatus> {
        let ended = |s: &EtcdStatus| matches!(s.state, EtcdState::Connected | EtcdState::Failed);
        match self.status_watch().wait_until(timeout, ended).await {
            Ok(s) if s.state == EtcdState::Connected => Ok(s),
            Ok(s) | Err(s) => Err(s),
        }
    }

    /// Why the registration gave up for good, if it did (its state is then
    /// [`EtcdState::Failed`] and nothing is retried): another live process registered the
    /// same engine id and rank first, or the key holds a value on no lease.
    pub fn failure(&self) -> Option<&RegistrationError> {
        self.shared.failure.get()
    }

    /// The etcd lease the key is on now, if any (for diagnostics).
    pub fn lease_id(&self) -> Option<i64> {
        Some(self.shared.lease.load(Ordering::Relaxed)).filter(|&id| id != 0)
    }

    /// Counters.
    pub fn stats(&self) -> RegistrationStats {
        self.shared.stats()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops the keep-alives and revokes the lease, so the key is gone when this returns
    /// `Ok`. If etcd cannot be reached the error says so, and the key expires within the TTL.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        if let Some(stop) = self.stop.take() {
            // The task may have ended already (runtime shutting down): nothing to stop then.
            let _ = stop.send(Stop::Revoke);
        }
        match self.task.take() {
            Some(task) => match task.await {
                Ok(result) => result.map_err(Error::from),
                Err(_) => Ok(()),
            },
            None => Ok(()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Stop keeping the lease alive without revoking it: the key expires within the TTL.
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The background task.
struct Keeper {
    shared: Arc<Shared>,
    etcd: EtcdConfig,
    key: EngineKey,
    /// `/<ns>/v1/drain/<engine_id>`: drains while it exists.
    drain_key: String,
    /// What to register; `draining` is set from the drain flags at each put.
    record: EngineRecord,
    ttl_secs: i64,
}

/// What a session keeps across reconnections.
#[derive(Default)]
struct Conn {
    /// The client of the member in use (`None`: connect first).
    client: Option<Client>,
    /// The lease the key is on.
    lease: Option<i64>,
    /// Until when the lease runs at least, as of its last answer.
    lease_until: Option<Instant>,
    /// Which member to try first.
    failover: Failover,
}

/// What putting the key came to.
enum Claim {
    /// The key holds this registration's record, as of `revision`.
    Put { revision: i64 },
    /// Another incarnation's record (or something unreadable) holds it, as of `revision`.
    Held { incarnation: Option<u64>, revision: i64 },
}

/// The incarnation of a stored value, if it is a record.
fn incarnation_of(value: &[u8]) -> Option<u64> {
    EngineRecord::from_json(value).ok().map(|r| r.incarnation)
}

/// Who a stored value says holds the key, for messages.
fn holder_of(value: &[u8]) -> String {
    match EngineRecord::from_json(value) {
        Ok(r) => format!("incarnation {:016x} at {}", r.incarnation, r.addr),
        Err(_) => "a value that is not an engine record".to_owned(),
    }
}

/// Why a session ended.
enum SessionEnd {
    /// The lease expired or was revoked: grant a new one now.
    LeaseLost,
    /// The key was taken between the wait for it and the first put: look at it again now.
    Again,
    /// etcd failed: retry after a backoff.
    Failed(EtcdError),
    /// Nothing retrying can mend (a live duplicate holds the key): give up.
    Refused(RegistrationError),
}

impl From<EtcdError> for SessionEnd {
    fn from(e: EtcdError) -> Self {
        SessionEnd::Failed(e)
    }
}

impl Keeper {
    /// The value to put now: the record, draining or not.
    fn value(&self) -> Vec<u8> {
        EngineRecord { draining: self.shared.is_draining(), ..self.record.clone() }.to_json()
    }

    /// Whether a stored value is this registration's record (draining or not).
    fn is_ours(&self, value: &[u8]) -> bool {
        EngineRecord::from_json(value).is_ok_and(|r| r.same_agent(&self.record))
    }

    /// Records whether the drain key exists; a change puts the record again.
    fn drain_key_seen(&self, key: &str, exists: bool) {
        if self.shared.drain_keyed.swap(exists, Ordering::Relaxed) != exists {
            tracing::info!(key = %key, drain_key = %self.drain_key, draining = exists, "etcd drain key {}", if exists { "put: draining" } else { "deleted: no longer draining (unless drain() was called)" });
            self.shared.drain_changed.notify_one();
        }
    }

    /// Gives up for good: logs `why`, keeps it for [`Registration::failure`], and sets the
    /// state `Failed` (the reason first: whoever sees the state finds it set).
    fn give_up(&self, key: &str, why: RegistrationError) {
        tracing::error!(key = %key, error = %why, "etcd registration refused");
        let status_error = why.to_string();
        let _ = self.shared.failure.set(why);
        self.shared.status.gave_up(&status_error);
    }

    async fn run(self, mut stop: oneshot::Receiver<Stop>) -> Result<(), EtcdError> {
        let mut rng = rand::rngs::StdRng::from_os_rng();
        let mut backoff = Backoff::new(self.etcd.backoff_initial, self.etcd.backoff_max);
        let mut reminder = WarnLimiter::every(REMINDER_INTERVAL);
        let mut conn = Conn::default();
        let key = self.key.to_key();
        loop {
            let ended = tokio::select! {
                s = &mut stop => return self.stop(s.ok(), conn.client, conn.lease).await,
                ended = self.session(&key, &mut conn, &mut backoff) => ended,
            };
            match ended {
                SessionEnd::LeaseLost | SessionEnd::Again => continue,
                SessionEnd::Refused(why) => {
                    self.give_up(&key, why);
                    // The lease granted for the put that never happened: not needed.
                    return self.stop(Some(Stop::Revoke), conn.client, conn.lease).await;
                }
                // Final only before the first registration: afterwards (a permission
                // taken away and given back, a certificate rotated) it is retried as any
                // failure, so the engine comes back once etcd accepts it again.
                SessionEnd::Failed(e) if e.is_permanent() && !self.shared.status.was_connected() => {
                    self.give_up(&key, RegistrationError::Refused { reason: e.to_string() });
                    // Nothing to revoke that this client may revoke: a lease granted before
                    // a permission was taken away expires with its TTL.
                    return Ok(());
                }
                SessionEnd::Failed(e) => {
                    // A fresh client per attempt, on the next member first: no state
                    // survives from a broken connection.
                    conn.client = None;
                    conn.failover.session_failed();
                    let mut delay = backoff.next_delay(&mut rng);
                    if conn.lease.is_some() && conn.lease_until.is_some_and(|t| t > Instant::now()) {
                        // The lease may still be saved: every moment counts.
                        delay = delay.min(LEASE_SAVING_RETRY);
                    }
                    let first = self.shared.status.failed(&e);
                    if let Some(failures) = reminder.failed(Instant::now(), first) {
                        let since = self.shared.status.get().since;
                        let failing_for = since.elapsed();
                        if self.shared.claimed.load(Ordering::Relaxed) {
                            tracing::warn!(key = %key, error = %e, failures, ?failing_for, "etcd registration degraded; retrying (a key written before stays until its lease expires)");
                        } else {
                            tracing::warn!(key = %key, error = %e, failures, ?failing_for, "etcd registration failing; retrying (not registered yet: no key was written)");
                        }
                    } else {
                        tracing::debug!(key = %key, error = %e, retry_in = ?delay, "etcd registration still failing");
                    }
                    tokio::select! {
                        s = &mut stop => return self.stop(s.ok(), conn.client, conn.lease).await,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// Grants (or keeps) a lease, puts the key on it, then keeps the lease alive and
    /// watches the key until something fails: a key deleted under the live lease is put
    /// back; a key another incarnation holds is left alone (a conflict) until it is free.
    async fn session(&self, key: &str, conn: &mut Conn, backoff: &mut Backoff) -> SessionEnd {
        let etcd = &self.etcd;
        let Conn { client, lease, lease_until, failover } = conn;
        let c = match client {
            Some(c) => c,
            None => match etcd.connect(failover, key).await {
                Ok((c, endpoint)) => {
                    self.shared.status.endpoint(&endpoint);
                    client.insert(c)
                }
                Err(e) => return e.into(),
            },
        };
        let counters = &self.shared.counters;
        // The first put waits for another incarnation's key to go (a crashed predecessor's
        // lease running out), and gives up if the holder is alive.
        let first = !self.shared.claimed.load(Ordering::Relaxed);
        if first {
            if let Err(end) = self.await_free_key(c, key).await {
                return end;
            }
        }
        if let Some(id) = *lease {
            // After a broken connection: is the lease still there (etcd restarted with its
            // data, a short outage, another member)? Then keep it, else grant a new one.
            let asked = Instant::now();
            match etcd.call(EtcdOp::TimeToLive, c.lease_time_to_live(id, None)).await {
                Ok(r) if r.ttl() > 0 => {
                    *lease_until = Some(asked + Duration::from_secs(r.ttl().unsigned_abs()));
                }
                Ok(_) => {
                    counters.leases_lost.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(key = %key, lease = %format_args!("{id:x}"), "etcd lease expired while disconnected; granting a new one");
                    *lease = None;
                }
                Err(e) => return e.into(),
            }
        }
        let (id, ttl) = match *lease {
            Some(id) => (id, self.ttl_secs),
            None => match etcd.call(EtcdOp::Grant, c.lease_grant(self.ttl_secs, None)).await {
                Ok(r) => {
                    *lease_until = Some(Instant::now() + Duration::from_secs(r.ttl().unsigned_abs()));
                    counters.grants.fetch_add(1, Ordering::Relaxed);
                    *lease = Some(r.id());
                    self.shared.lease.store(r.id(), Ordering::Relaxed);
                    (r.id(), r.ttl().max(1))
                }
                Err(e) => return e.into(),
            },
        };
        // Every put takes the key only if it is free or still ours: a live process that
        // registered the same engine rank first keeps it, and so does a replacement that
        // registered while this one was cut off.
        // Whether the engine's drain key exists, before the put (which says so).
        let drain_revision = {
            let get = c.get(self.drain_key.as_str(), Some(GetOptions::new().with_count_only()));
            match etcd.call(EtcdOp::Get, get).await {
                Ok(r) => {
                    self.drain_key_seen(key, r.count() > 0);
                    r.header().map_or(0, |h| h.revision())
                }
                Err(e) => return e.into(),
            }
        };
        let claim = match self.claim(c, key, id).await {
            Ok(claim) => claim,
            Err(e) => return self.put_failed(e, key, id, lease),
        };
        if first && matches!(claim, Claim::Held { .. }) {
            // Taken since the wait found it free: wait (or refuse) again, on a new lease then.
            if let Err(e) = etcd.call(EtcdOp::Revoke, c.lease_revoke(id)).await {
                tracing::debug!(key = %key, error = %e, "could not revoke an unused lease; it expires");
            }
            *lease = None;
            self.shared.lease.store(0, Ordering::Relaxed);
            return SessionEnd::Again;
        }
        let (mut holding, revision) = match claim {
            Claim::Put { revision } => {
                self.shared.claimed.store(true, Ordering::Relaxed);
                counters.puts.fetch_add(1, Ordering::Relaxed);
                (true, revision)
            }
            Claim::Held { incarnation, revision } => {
                self.conflict(key, incarnation);
                (false, revision)
            }
        };
        // Opening the stream renews the lease once (etcd-client waits for that answer).
        let opened = Instant::now();
        let (mut keeper, mut responses) = match etcd.call(EtcdOp::KeepAlive, c.lease_keep_alive(id)).await {
            Ok(pair) => pair,
            Err(e) => return e.into(),
        };
        *lease_until = Some(opened + Duration::from_secs(ttl.unsigned_abs()));
        let watch = c.watch(key, Some(WatchOptions::new().with_start_revision(revision + 1)));
        let mut watch = match etcd.call(EtcdOp::Watch, watch).await {
            Ok(w) => w,
            Err(e) => return e.into(),
        };
        let drain_watch = c.watch(
            self.drain_key.as_str(),
            Some(WatchOptions::new().with_start_revision(drain_revision + 1)),
        );
        let mut drain_watch = match etcd.call(EtcdOp::Watch, drain_watch).await {
            Ok(w) => w,
            Err(e) => return e.into(),
        };
        backoff.reset();
        if holding {
            if self.shared.status.connected() {
                tracing::info!(key = %key, lease = %format_args!("{id:x}"), "etcd registration restored");
            } else {
                tracing::info!(key = %key, lease = %format_args!("{id:x}"), ttl_s = ttl, "registered in etcd");
            }
        }
        let interval = keepalive_interval(ttl);
        // An unanswered keep-alive ends the session once it has waited an interval (a
        // renewal takes milliseconds): a hung member is left within two intervals, and the
        // next member is tried while the lease still runs.
        let answer_timeout = interval;
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Since when a keep-alive has been waiting for its answer.
        let mut unanswered: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    if let Some(since) = unanswered.filter(|t| t.elapsed() >= answer_timeout) {
                        return EtcdError::Timeout { op: EtcdOp::KeepAlive, after: since.elapsed() }.into();
                    }
                    if let Err(source) = keeper.keep_alive().await {
                        return EtcdError::Client { op: EtcdOp::KeepAlive, source }.into();
                    }
                    unanswered.get_or_insert_with(Instant::now);
                }
                answer = responses.message() => match answer {
                    Ok(Some(r)) if r.ttl() > 0 => {
                        // The lease runs its TTL from when the oldest unanswered keep-alive
                        // went out, at the latest.
                        let sent = unanswered.take().unwrap_or_else(Instant::now);
                        *lease_until = Some(sent + Duration::from_secs(r.ttl().unsigned_abs()));
                        counters.keepalives.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Some(_)) => {
                        counters.leases_lost.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(key = %key, lease = %format_args!("{id:x}"), "etcd lease expired or was revoked; registering again on a new lease");
                        *lease = None;
                        self.shared.lease.store(0, Ordering::Relaxed);
                        return SessionEnd::LeaseLost;
                    }
                    Ok(None) => {
                        let reason = "closed by etcd".to_owned();
                        return EtcdError::StreamEnded { op: EtcdOp::KeepAlive, reason }.into();
                    }
                    Err(source) => return EtcdError::Client { op: EtcdOp::KeepAlive, source }.into(),
                },
                _ = self.shared.drain_changed.notified() => {
                    if !holding {
                        continue; // put with the new state once the key is ours again
                    }
                    match self.claim(c, key, id).await {
                        Ok(Claim::Put { .. }) => {
                            counters.puts.fetch_add(1, Ordering::Relaxed);
                            let draining = self.shared.is_draining();
                            tracing::info!(key = %key, draining, "etcd registration: draining state put");
                        }
                        Ok(Claim::Held { incarnation, .. }) => {
                            holding = false;
                            self.conflict(key, incarnation);
                        }
                        Err(e) => return self.put_failed(e, key, id, lease),
                    }
                }
                message = drain_watch.message() => {
                    let response = match crate::etcd::watch_message(message) {
                        Ok(r) => r,
                        Err(e) => return e.into(),
                    };
                    if let Some(last) = response.events().last() {
                        self.drain_key_seen(key, last.event_type() != EventType::Delete);
                    }
                }
                message = watch.message() => {
                    let response = match crate::etcd::watch_message(message) {
                        Ok(r) => r,
                        Err(e) => return e.into(),
                    };
                    let Some(last) = response.events().last() else { continue };
                    // Only the key's latest state matters.
                    let deleted = last.event_type() == EventType::Delete;
                    match last.kv() {
                        Some(kv) if !deleted && self.is_ours(kv.value()) => {
                            holding = true;
                            if kv.value() != self.value().as_slice() {
                                // Ours, with a draining state that changed since: put again.
                                self.shared.drain_changed.notify_one();
                            }
                        }
                        Some(kv) if !deleted => {
                            if holding {
                                holding = false;
                                self.conflict(key, incarnation_of(kv.value()));
                            }
                        }
                        _ => {
                            // Deleted: by an operator under our live lease, or a replacement
                            // that held it went away. Ours again if still free.
                            if holding {
                                tracing::warn!(key = %key, "etcd registration key deleted under a live lease; putting it back");
                            }
                            match self.claim(c, key, id).await {
                                Ok(Claim::Put { .. }) => {
                                    counters.puts.fetch_add(1, Ordering::Relaxed);
                                    counters.restores.fetch_add(1, Ordering::Relaxed);
                                    if !holding {
                                        tracing::info!(key = %key, "etcd registration key free again: registered");
                                    }
                                    holding = true;
                                    self.shared.status.connected();
                                }
                                Ok(Claim::Held { incarnation, .. }) => {
                                    if holding {
                                        holding = false;
                                        self.conflict(key, incarnation);
                                    }
                                }
                                Err(e) => return self.put_failed(e, key, id, lease),
                            }
                        }
                    }
                }
            }
        }
    }

    /// Before this registration's first put: returns once the key is free (or holds this
    /// registration's own record). Another incarnation's key on a lease that is running out
    /// — a crashed predecessor's — is waited for (etcd deletes it when its TTL runs out: a
    /// restart right after a crash registers within about the TTL). A holder whose lease is
    /// being renewed is a live process with the same engine id and rank: refused (so is a
    /// value on no lease, which never expires).
    ///
    /// Renewal is told from the lease's remaining TTL, which etcd gives in whole seconds: a
    /// lease left alone for `d` seconds reads at least `floor(d)` less, so a reading that
    /// went down by less than that over a second or more was renewed. A holder not seen
    /// renewed is waited for until its lease should have run out, plus slack.
    async fn await_free_key(&self, c: &mut Client, key: &str) -> Result<(), SessionEnd> {
        let etcd = &self.etcd;
        // The holder's lease, when it was last read as a baseline, what it had left then, and
        // the raft term of that reading.
        let mut seen: Option<(i64, Instant, i64, u64)> = None;
        // Readings in a row that showed the lease renewed: two are needed, so one late
        // answer, or a leader change extending every lease between two readings, is not
        // taken for a live holder.
        let mut renewals = 0u32;
        let mut warned = false;
        loop {
            let got = etcd.call(EtcdOp::Get, c.get(key, None)).await?;
            let term = got.header().map_or(0, |h| h.raft_term());
            let Some(kv) = got.kvs().first() else { return Ok(()) };
            if self.is_ours(kv.value()) {
                return Ok(());
            }
            let holder = holder_of(kv.value());
            let holder_lease = kv.lease();
            if holder_lease == 0 {
                return Err(SessionEnd::Refused(RegistrationError::HeldWithoutLease {
                    key: key.into(),
                    holder,
                }));
            }
            let remaining =
                match etcd.call(EtcdOp::TimeToLive, c.lease_time_to_live(holder_lease, None)).await {
                    Ok(r) => r.ttl(),
                    Err(e) if is_lease_not_found(&e) => -1,
                    Err(e) => return Err(e.into()),
                };
            let now = Instant::now();
            match seen {
                // Same lease, same leader term: compare with the baseline.
                Some((l, since, left, t)) if l == holder_lease && t == term && remaining > 0 => {
                    let waited = now.saturating_duration_since(since);
                    let lost = i64::try_from(waited.saturating_sub(HOLDER_CLOCK_SLACK).as_secs())
                        .unwrap_or(i64::MAX);
                    // Renewed: more left than a lease left alone could have.
                    let renewed = lost >= 1 && remaining > left.saturating_sub(lost);
                    // Still there, with time left, well after it should have run out.
                    let overdue =
                        waited > Duration::from_secs(left.unsigned_abs()) + 2 * MAX_KEEPALIVE_INTERVAL;
                    if renewed || overdue {
                        renewals += 1;
                        if renewals >= 2 {
                            let why = RegistrationError::EngineTaken {
                                key: key.into(),
                                holder,
                                lease: holder_lease,
                            };
                            return Err(SessionEnd::Refused(why));
                        }
                        // A new baseline for the second reading.
                        seen = Some((holder_lease, now, remaining, term));
                    }
                }
                // A new lease, a new leader (which extends every lease), or the first look.
                _ if remaining > 0 => {
                    seen = Some((holder_lease, now, remaining, term));
                    renewals = 0;
                    if !warned {
                        warned = true;
                        tracing::warn!(key = %key, %holder, lease = %format_args!("{holder_lease:x}"), left_s = remaining, "etcd key of this engine rank held by another process: waiting for its lease to run out (a restart after a crash); refused if it is renewed (a live process with the same engine id)");
                    }
                }
                // Run out: etcd deletes the key at its next expiry check.
                _ => {}
            }
            tokio::time::sleep(HOLDER_POLL).await;
        }
    }

    /// Puts the key on lease `id` if it is absent or holds this registration's record
    /// (compared in a transaction, so a replacement's record is never overwritten).
    async fn claim(&self, c: &mut Client, key: &str, id: i64) -> Result<Claim, EtcdError> {
        let put = || TxnOp::put(key, self.value(), Some(PutOptions::new().with_lease(id)));
        let mut when = Compare::version(key, CompareOp::Equal, 0);
        // A few rounds: the key may change between the comparison and the next one.
        for _ in 0..4 {
            let txn = Txn::new().when([when]).and_then([put()]).or_else([TxnOp::get(key, None)]);
            let answer = self.etcd.call(EtcdOp::Put, c.txn(txn)).await?;
            let revision = answer.header().map_or(0, |h| h.revision());
            if answer.succeeded() {
                return Ok(Claim::Put { revision });
            }
            let held = answer.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => {
                    get.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision()))
                }
                _ => None,
            });
            when = match held {
                None => Compare::version(key, CompareOp::Equal, 0),
                // Ours (a put of ours on an older lease, etcd back with its data): put it
                // on this lease, unless it changes meanwhile.
                Some((value, mod_revision)) if self.is_ours(&value) => {
                    Compare::mod_revision(key, CompareOp::Equal, mod_revision)
                }
                Some((value, _)) => return Ok(Claim::Held { incarnation: incarnation_of(&value), revision }),
            };
        }
        Err(EtcdError::StreamEnded { op: EtcdOp::Put, reason: "the key kept changing under the put".into() })
    }

    /// Another incarnation holds the key: say so (error, counted) and leave it alone.
    fn conflict(&self, key: &str, holder: Option<u64>) {
        self.shared.counters.conflicts.fetch_add(1, Ordering::Relaxed);
        let holder =
            holder.map_or_else(|| "an unreadable record".to_owned(), |i| format!("incarnation {i:016x}"));
        tracing::error!(key = %key, %holder, "etcd registration conflict: another process holds this engine rank's key; not overwriting it (this agent is not discoverable until the key is free)");
        self.shared.status.failed(&format_args!("the key is held by {holder}"));
    }

    /// A put or claim failed: a lease that is gone means granting a new one now.
    fn put_failed(&self, e: EtcdError, key: &str, id: i64, lease: &mut Option<i64>) -> SessionEnd {
        if !is_lease_not_found(&e) {
            return e.into();
        }
        self.shared.counters.leases_lost.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(key = %key, lease = %format_args!("{id:x}"), "etcd lease gone when putting the key; registering again on a new lease");
        *lease = None;
        self.shared.lease.store(0, Ordering::Relaxed);
        SessionEnd::LeaseLost
    }

    /// The owner asked to stop (`Some`) or went away (`None`: end without revoking).
    async fn stop(
        &self,
        how: Option<Stop>,
        client: Option<Client>,
        lease: Option<i64>,
    ) -> Result<(), EtcdError> {
        let result = match (how, lease) {
            (Some(Stop::Revoke), Some(id)) => {
                let mut c = match client {
                    Some(c) => c,
                    None => self.etcd.connect(&mut Failover::default(), &self.key.to_key()).await?.0,
                };
                let revoked = match self.etcd.call(EtcdOp::Revoke, c.lease_revoke(id)).await {
                    Ok(_) => Ok(()),
                    // Expired or revoked already: the key is gone, which is all that was asked.
                    Err(e) if is_lease_not_found(&e) => Ok(()),
                    Err(e) => Err(e),
                };
                match &revoked {
                    Ok(()) => tracing::info!(key = %self.key, "etcd registration revoked"),
                    Err(e) => {
                        tracing::warn!(key = %self.key, error = %e, "could not revoke the etcd lease; the key expires within its TTL")
                    }
                }
                revoked
            }
            _ => Ok(()),
        };
        self.shared.lease.store(0, Ordering::Relaxed);
        self.shared.status.stopped();
        result
    }
}

/// etcd's `ErrLeaseNotFound` ("etcdserver: requested lease not found").
fn is_lease_not_found(e: &EtcdError) -> bool {
    match e {
        EtcdError::Client { source: etcd_client::Error::GRpcStatus(status), .. } => {
            status.message().contains("lease not found")
        }
        _ => false,
    }
}
