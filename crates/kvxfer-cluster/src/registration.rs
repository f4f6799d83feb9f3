//! One engine rank's key in etcd, on a lease kept alive by a background task.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, PutOptions};
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
}

#[derive(Debug, Default)]
struct Counters {
    grants: AtomicU64,
    puts: AtomicU64,
    leases_lost: AtomicU64,
    keepalives: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) status: StatusCell,
    counters: Counters,
    /// The lease the key is on, 0 when none.
    lease: AtomicI64,
}

impl Shared {
    pub(crate) fn stats(&self) -> RegistrationStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RegistrationStats {
            grants: l(&self.counters.grants),
            puts: l(&self.counters.puts),
            leases_lost: l(&self.counters.leases_lost),
            keepalives: l(&self.counters.keepalives),
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

    /// Grants (or keeps) a lease, puts the key on it, then keeps the lease alive until
    /// something fails.
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
        // Put on every (re)connection: it also restores a key someone deleted meanwhile.
        let put = c.put(key, self.value.clone(), Some(PutOptions::new().with_lease(id)));
        if let Err(e) = etcd.call(EtcdOp::Put, put).await {
            return e.into();
        }
        counters.puts.fetch_add(1, Ordering::Relaxed);
        let (mut keeper, mut responses) = match etcd.call(EtcdOp::KeepAlive, c.lease_keep_alive(id)).await {
            Ok(pair) => pair,
            Err(e) => return e.into(),
        };
        backoff.reset();
        if self.shared.status.connected() {
            tracing::info!(key = %key, lease = %format_args!("{id:x}"), "etcd registration restored");
        } else {
            tracing::info!(key = %key, lease = %format_args!("{id:x}"), ttl_s = ttl, "registered in etcd");
        }
        let interval = Duration::from_millis(u64::try_from(ttl).unwrap_or(1).saturating_mul(1000) / 3);
        loop {
            tokio::time::sleep(interval).await;
            if let Err(source) = keeper.keep_alive().await {
                return EtcdError::Client { op: EtcdOp::KeepAlive, source }.into();
            }
            // An answer must come before the next keep-alive is due.
            match tokio::time::timeout(interval, responses.message()).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    counters.keepalives.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Ok(Some(_))) => {
                    counters.leases_lost.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(key = %key, lease = %format_args!("{id:x}"), "etcd lease expired or was revoked; registering again on a new lease");
                    *lease = None;
                    self.shared.lease.store(0, Ordering::Relaxed);
                    return SessionEnd::LeaseLost;
                }
                Ok(Ok(None)) => {
                    let reason = "closed by etcd".to_owned();
                    return EtcdError::StreamEnded { op: EtcdOp::KeepAlive, reason }.into();
                }
                Ok(Err(source)) => return EtcdError::Client { op: EtcdOp::KeepAlive, source }.into(),
                Err(_) => return EtcdError::Timeout { op: EtcdOp::KeepAlive, after: interval }.into(),
            }
        }
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
