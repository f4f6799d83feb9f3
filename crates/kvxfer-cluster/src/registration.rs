//! One engine rank's key in etcd, on a lease kept alive by a background task.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use rand::SeedableRng;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::backoff::Backoff;
use crate::error::{ConfigError, Error, EtcdError, EtcdOp};
use crate::etcd::{EtcdConfig, EtcdState, EtcdStatus, StatusCell, StatusWatch};
use crate::names::EngineKey;
use crate::record::EngineRecord;

/// The shortest lease TTL: etcd's default minimum (1.5 × its 1 s election timeout, rounded
/// up); etcd silently raises shorter ones.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(2);
/// The longest lease TTL accepted here (a day: longer only delays crash detection).
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(86_400);

/// What to register.
#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    /// Where.
    pub key: EngineKey,
    /// What.
    pub record: EngineRecord,
    /// The lease TTL: a crashed agent's key disappears at most this long after its last
    /// keep-alive (keep-alives go every TTL/3). Whole seconds, [`MIN_LEASE_TTL`] or more.
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
}

impl Shared {
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
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        let task = Keeper {
            shared: shared.clone(),
            etcd,
            key: config.key.clone(),
            value: config.record.to_json(),
            ttl_secs: i64::try_from(ttl_secs).unwrap_or(i64::MAX),
        };
        let task = runtime.spawn(task.run(stop_rx));
        Ok(Self { shared, key: config.key, record: config.record, stop: Some(stop_tx), task: Some(task) })
    }

    /// The registered key.
    pub fn key(&self) -> &EngineKey {
        &self.key
    }

    /// The registered record.
    pub fn record(&self) -> &EngineRecord {
        &self.record
    }

    /// Where it stands with etcd.
    pub fn status(&self) -> EtcdStatus {
        self.shared.status.get()
    }

    /// A receiver that sees every status change.
    pub fn status_watch(&self) -> StatusWatch {
        self.shared.status.subscribe()
    }

    /// Waits until the key is in etcd (state `Connected`), up to `timeout`; on timeout
    /// returns the status as it then is (with the last error).
    pub async fn wait_registered(&self, timeout: Duration) -> Result<EtcdStatus, EtcdStatus> {
        self.status_watch().wait_until(timeout, |s| s.state == EtcdState::Connected).await
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
    value: Vec<u8>,
    ttl_secs: i64,
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

/// Why a session ended.
enum SessionEnd {
    /// The lease expired or was revoked: grant a new one now.
    LeaseLost,
    /// etcd failed: retry after a backoff.
    Failed(EtcdError),
}

impl From<EtcdError> for SessionEnd {
    fn from(e: EtcdError) -> Self {
        SessionEnd::Failed(e)
    }
}

impl Keeper {
    async fn run(self, mut stop: oneshot::Receiver<Stop>) -> Result<(), EtcdError> {
        let mut rng = rand::rngs::StdRng::from_os_rng();
        let mut backoff = Backoff::new(self.etcd.backoff_initial, self.etcd.backoff_max);
        let mut client: Option<Client> = None;
        let mut lease: Option<i64> = None;
        let key = self.key.to_key();
        loop {
            let ended = tokio::select! {
                s = &mut stop => return self.stop(s.ok(), client, lease).await,
                ended = self.session(&key, &mut client, &mut lease, &mut backoff) => ended,
            };
            match ended {
                SessionEnd::LeaseLost => continue,
                SessionEnd::Failed(e) => {
                    // A fresh client per attempt: no state survives from a broken connection.
                    client = None;
                    let delay = backoff.next_delay(&mut rng);
                    if self.shared.status.failed(&e) {
                        tracing::warn!(key = %key, error = %e, "etcd registration degraded; retrying (the key stays until its lease expires)");
                    } else {
                        tracing::debug!(key = %key, error = %e, retry_in = ?delay, "etcd registration still failing");
                    }
                    tokio::select! {
                        s = &mut stop => return self.stop(s.ok(), client, lease).await,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// Grants (or keeps) a lease, puts the key on it, then keeps the lease alive and
    /// watches the key until something fails: a key deleted under the live lease is put
    /// back; a key another incarnation holds is left alone (a conflict) until it is free.
    async fn session(
        &self,
        key: &str,
        client: &mut Option<Client>,
        lease: &mut Option<i64>,
        backoff: &mut Backoff,
    ) -> SessionEnd {
        let etcd = &self.etcd;
        let c = match client {
            Some(c) => c,
            None => match etcd.client().await {
                Ok(c) => client.insert(c),
                Err(e) => return e.into(),
            },
        };
        let counters = &self.shared.counters;
        if let Some(id) = *lease {
            // After a broken connection: is the lease still there (etcd restarted with its
            // data, or a short outage)? Then keep it, else grant a new one.
            match etcd.call(EtcdOp::TimeToLive, c.lease_time_to_live(id, None)).await {
                Ok(r) if r.ttl() > 0 => {}
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
                    counters.grants.fetch_add(1, Ordering::Relaxed);
                    *lease = Some(r.id());
                    self.shared.lease.store(r.id(), Ordering::Relaxed);
                    (r.id(), r.ttl().max(1))
                }
                Err(e) => return e.into(),
            },
        };
        // The first put of this registration takes the key whatever it holds (a restart
        // that beat the old process's lease replaces its record). Every later one, after a
        // lost lease or a broken connection, takes it only if it is free or still ours: a
        // replacement that registered meanwhile keeps it.
        let first = !self.shared.claimed.load(Ordering::Relaxed);
        let claim = if first {
            let put = c.put(key, self.value.clone(), Some(PutOptions::new().with_lease(id)));
            match etcd.call(EtcdOp::Put, put).await {
                Ok(r) => Claim::Put { revision: r.header().map_or(0, |h| h.revision()) },
                Err(e) => return self.put_failed(e, key, id, lease),
            }
        } else {
            match self.claim(c, key, id).await {
                Ok(claim) => claim,
                Err(e) => return self.put_failed(e, key, id, lease),
            }
        };
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
        let (mut keeper, mut responses) = match etcd.call(EtcdOp::KeepAlive, c.lease_keep_alive(id)).await {
            Ok(pair) => pair,
            Err(e) => return e.into(),
        };
        let watch = c.watch(key, Some(WatchOptions::new().with_start_revision(revision + 1)));
        let mut watch = match etcd.call(EtcdOp::Watch, watch).await {
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
        let interval = Duration::from_millis(u64::try_from(ttl).unwrap_or(1).saturating_mul(1000) / 3);
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Whether a keep-alive went out and its answer has not come yet.
        let mut awaiting = false;
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    // An answer must come before the next keep-alive is due.
                    if awaiting {
                        return EtcdError::Timeout { op: EtcdOp::KeepAlive, after: interval }.into();
                    }
                    if let Err(source) = keeper.keep_alive().await {
                        return EtcdError::Client { op: EtcdOp::KeepAlive, source }.into();
                    }
                    awaiting = true;
                }
                answer = responses.message() => match answer {
                    Ok(Some(r)) if r.ttl() > 0 => {
                        awaiting = false;
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
                message = watch.message() => {
                    let response = match message {
                        Ok(Some(r)) => r,
                        Ok(None) => {
                            let reason = "closed by etcd".to_owned();
                            return EtcdError::StreamEnded { op: EtcdOp::Watch, reason }.into();
                        }
                        Err(source) => return EtcdError::Client { op: EtcdOp::Watch, source }.into(),
                    };
                    if response.canceled() || response.compact_revision() > 0 {
                        let reason = format!("cancelled by etcd ({})", response.cancel_reason());
                        return EtcdError::StreamEnded { op: EtcdOp::Watch, reason }.into();
                    }
                    let Some(last) = response.events().last() else { continue };
                    // Only the key's latest state matters.
                    let deleted = last.event_type() == EventType::Delete;
                    match last.kv() {
                        Some(kv) if !deleted && kv.value() == self.value.as_slice() => holding = true,
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

    /// Puts the key on lease `id` if it is absent or holds this registration's record
    /// (compared in a transaction, so a replacement's record is never overwritten).
    async fn claim(&self, c: &mut Client, key: &str, id: i64) -> Result<Claim, EtcdError> {
        let put = || TxnOp::put(key, self.value.clone(), Some(PutOptions::new().with_lease(id)));
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
                Some((value, mod_revision)) if value == self.value => {
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
                    None => self.etcd.client().await?,
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
