//! What a decode agent's tasks share: the agent's state ([`Inner`]: configuration, memory,
//! counters, the busy-block set, the transports) and, per prefill peer, its pool of
//! connections ([`Peer`]). The pull tasks, the UCX glue (`crate::ucx`) and the cluster hooks
//! (`crate::cluster`) use it; it uses none of them but the cluster's `DecodeCluster` it holds.
//! How a peer is talked to (checking connections out, control exchanges, typed errors) is
//! [`super::peer`].

use std::collections::{HashMap, HashSet};
#[cfg(feature = "ucx")]
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use kvxfer_core::log;
use kvxfer_core::BlockId;
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1;
use kvxfer_tcp::{ClientError, Connection};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::report::{add, Counters, Reclaimed};
use crate::AgentConfig;

/// At most this many prefill addresses are remembered as refusing this agent's layouts.
pub(super) const REFUSED_LAYOUTS_CAP: usize = 4096;

/// What a decode agent's tasks share.
pub(crate) struct Inner {
    pub(crate) config: AgentConfig,
    pub(crate) memory: Arc<KvMemory>,
    /// This rank's KV-cache shape, when configured (pulls from peers of other TP or
    /// block sizes need it).
    pub(crate) shape: Option<kvxfer_core::KvShape>,
    pub(super) hello: v1::Hello,
    pub(crate) consumer_id: String,
    pub(super) peers: Mutex<HashMap<String, Arc<Peer>>>,
    /// Prefill addresses whose handshake refused this agent's layouts: releases to them go
    /// straight to a control-only connection (not a refused handshake first). Bounded:
    /// forgotten all at once past [`REFUSED_LAYOUTS_CAP`] addresses.
    pub(super) refused_layouts: Mutex<HashSet<String>>,
    /// Destination blocks of pulls under way, and blocks held by reads UCX could not stop.
    pub(crate) busy: Arc<Mutex<HashSet<BlockId>>>,
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) reclaimed_tx: Sender<Reclaimed>,
    /// Shared with the metrics source, which may outlive the agent by a scrape.
    pub(crate) counters: Arc<Counters>,
    /// Set by `shutdown`: pulls stop starting reads.
    pub(super) stop: CancellationToken,
    /// Set when the shutdown grace is over: pulls abort their reads.
    pub(super) abort: CancellationToken,
    #[cfg(feature = "ucx")]
    pub(crate) ucx: Option<crate::runtime::DropOffRuntime<kvxfer_ucx::UcxInitiator>>,
    /// The engine directory and the metrics, when configured.
    #[cfg(feature = "cluster")]
    pub(crate) cluster: Option<crate::cluster::DecodeCluster>,
}

impl Inner {
    /// Where to pull `engine`'s hand-offs from: their own address, checked against
    /// discovery when it runs (which also resolves hand-offs naming only the engine id).
    pub(crate) fn resolve(
        &self,
        engine: &kvxfer_core::EngineInfo,
    ) -> Result<String, kvxfer_core::pull::PullError> {
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.cluster {
            return c.resolve(engine, self.config.rank);
        }
        Ok(engine.addr())
    }

    /// Where prefill rank `rank` of `engine` is: the hand-off's own address, checked against
    /// discovery when it runs (which also resolves hand-offs naming only the engine id).
    pub(crate) fn resolve_rank(
        &self,
        engine: &kvxfer_core::EngineInfo,
        rank: u32,
    ) -> Result<String, kvxfer_core::pull::PullError> {
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.cluster {
            return c.resolve_rank(engine, rank);
        }
        let _ = rank;
        Ok(engine.addr())
    }

    /// Whether a hand-off naming only the engine id can be resolved here.
    pub(super) fn resolves_engine_ids(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.cluster {
            return c.directory().is_some();
        }
        false
    }

    /// Prefill peers this agent keeps connections (or a pool) for.
    pub(crate) fn peer_count(&self) -> u64 {
        self.peers.lock().unwrap_or_else(|p| p.into_inner()).len() as u64
    }

    /// Forgets the peer at `addr` (its engine left or changed): new pulls get fresh
    /// connections at once, and its pooled ones are closed. Returns whether there was one.
    #[cfg(feature = "cluster")]
    pub(crate) fn invalidate_peer(&self, addr: &str) -> bool {
        let peer = self.peers.lock().unwrap_or_else(|p| p.into_inner()).remove(addr);
        match peer {
            // Idle connections close now; those a pull uses, when its exchange ends.
            Some(peer) => {
                // Its UCX endpoint closes now (reads in flight on it finish first), not only
                // when the last pull using the peer lets go of it (`Peer`'s drop).
                #[cfg(feature = "ucx")]
                if let Some(init) = self.ucx() {
                    init.disconnect(&peer.ucx_endpoint);
                }
                peer.reset();
                true
            }
            None => false,
        }
    }

    pub(crate) fn peer(&self, addr: &str) -> Arc<Peer> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if !peers.contains_key(addr) {
            // Prefill workers come and go (restarts, scale-down): forget peers no pull uses
            // whose connections their side has closed, so neither entries nor sockets pile up
            // (nor UCX endpoints: a dropped `Peer` closes its own).
            peers.retain(|_, p| Arc::strong_count(p) > 1 || !p.is_gone());
        }
        peers
            .entry(addr.to_owned())
            .or_insert_with(|| {
                let peer = Peer::new(addr, self.config.connections_per_peer, self.config.limits.idle_timeout);
                #[cfg(feature = "ucx")]
                let peer = peer.with_ucx(self.ucx().map(kvxfer_ucx::UcxInitiator::disconnector));
                Arc::new(peer)
            })
            .clone()
    }

    pub(crate) async fn connect(&self, addr: &str) -> Result<Connection, ClientError> {
        let key = self.config.cluster_key.as_ref();
        let c = match Connection::connect_with_key(addr, &self.hello, key, self.config.limits).await {
            Ok(c) => c,
            Err(e) => {
                if let ClientError::Auth { reason, .. } = &e {
                    add(&self.counters.auth_failures, 1);
                    warn!(peer = %addr, reason = %log::Peer(&reason), "handshake failed authentication");
                }
                return Err(e);
            }
        };
        add(&self.counters.connections_opened, 1);
        Ok(c)
    }

    /// Whether `addr` refused this agent's layouts at a handshake before.
    pub(super) fn layouts_refused_at(&self, addr: &str) -> bool {
        self.refused_layouts.lock().unwrap_or_else(|p| p.into_inner()).contains(addr)
    }

    /// Remembers that `addr` refused this agent's layouts.
    pub(super) fn remember_layouts_refused(&self, addr: &str) {
        let mut set = self.refused_layouts.lock().unwrap_or_else(|p| p.into_inner());
        if set.len() >= REFUSED_LAYOUTS_CAP {
            set.clear();
        }
        set.insert(addr.to_owned());
    }

    /// A connection that may only cancel leases (`Hello::control_only`): the prefill side
    /// skips the layout checks, so a decode whose cache can never read a hand-off can still
    /// give its lease back. Never pooled.
    pub(crate) async fn connect_control_only(&self, addr: &str) -> Result<Connection, ClientError> {
        let hello = v1::Hello { control_only: true, ..self.hello.clone() };
        let key = self.config.cluster_key.as_ref();
        let c = Connection::connect_with_key(addr, &hello, key, self.config.limits).await?;
        add(&self.counters.connections_opened, 1);
        Ok(c)
    }

    #[cfg(feature = "ucx")]
    pub(crate) fn ucx(&self) -> Option<&kvxfer_ucx::UcxInitiator> {
        self.ucx.as_ref().and_then(crate::runtime::DropOffRuntime::get)
    }
}

#[cfg(feature = "cluster")]
impl crate::cluster::DecodePeers for Inner {
    fn peer_count(&self) -> u64 {
        Inner::peer_count(self)
    }

    fn invalidate_peer(&self, addr: &str) -> bool {
        Inner::invalidate_peer(self, addr)
    }
}

/// A connection waiting in a pool, and since when.
pub(super) struct Pooled {
    pub(super) conn: Connection,
    since: Instant,
}

impl Pooled {
    pub(super) fn new(conn: Connection) -> Self {
        Pooled { conn, since: Instant::now() }
    }

    /// Whether it may be reused: the peer did not close it, and it has been idle for less
    /// than `max_idle` (the prefill side closes connections idle for its `idle_timeout`; a
    /// request racing that close would fail).
    pub(super) fn reusable(&self, max_idle: Duration) -> bool {
        self.since.elapsed() < max_idle && !self.conn.closed_by_peer()
    }
}

/// Control exchanges (notify, heartbeat, cancel, the hello of a pull) a decode agent runs
/// at once with one prefill agent, each on a connection of its own: the prefill side answers
/// the frames of a connection in order, and holds a frame naming a lease it does not know
/// for up to its `Limits::arm_wait` (the lease may be about to be armed), so an exchange
/// never waits behind another one's arm wait unless this many wait at once.
pub(crate) const CONTROL_CONNECTIONS_PER_PEER: usize = 8;

/// A peer's idle control connections (at most [`CONTROL_CONNECTIONS_PER_PEER`]: with those
/// in use, a decode agent holds twice that at most to one prefill agent), and the generation
/// they belong to: [`Peer::reset`]
/// starts a new one, so a connection an exchange held across the reset is not pooled again.
#[derive(Default)]
pub(super) struct ControlPool {
    pub(super) idle: Vec<Pooled>,
    pub(super) generation: u64,
}

/// The engine (id, incarnation) a UCX endpoint was made for, and the transports UCX said it
/// uses.
#[cfg(feature = "ucx")]
pub(crate) type UcxLink = ((String, u64), Vec<String>);

/// A prefill agent this decode agent talks to.
pub(crate) struct Peer {
    pub(crate) addr: String,
    pub(super) idle: Mutex<Vec<Pooled>>,
    pub(super) permits: Semaphore,
    /// Idle control connections ([`CONTROL_CONNECTIONS_PER_PEER`] exchanges at most run at
    /// once, each holding one of `control_permits`).
    pub(super) control: Mutex<ControlPool>,
    pub(super) control_permits: Semaphore,
    /// Longest a pooled connection may have been idle to be reused: half the agent's
    /// `Limits::idle_timeout`.
    pub(super) max_idle: Duration,
    /// The engine id and incarnation our UCX endpoint to this address was made for (a
    /// restarted prefill at the same address gets a new endpoint), and the transports UCX
    /// said the endpoint uses.
    #[cfg(feature = "ucx")]
    pub(crate) ucx_engine: tokio::sync::Mutex<Option<UcxLink>>,
    /// The name of this peer's UCX endpoint in the initiator: the address and a number
    /// unique to this `Peer`, so a peer forgotten (or invalidated) while a pull still holds
    /// it closes its own endpoint, never that of a newer `Peer` for the same address.
    #[cfg(feature = "ucx")]
    pub(crate) ucx_endpoint: String,
    /// Closes the UCX endpoint when the peer is dropped (`None` without UCX).
    #[cfg(feature = "ucx")]
    ucx_disconnector: Option<kvxfer_ucx::Disconnector>,
}

/// Closes the peer's UCX endpoint (and so unmaps the prefill side's shared memory its rkeys
/// attached, see `kvxfer_ucx::UcxBuffer`) once nothing uses the peer any more: it was
/// forgotten (`Inner::peer`), invalidated by discovery, or the agent is dropped. Reads in
/// flight on it finish first.
#[cfg(feature = "ucx")]
impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(d) = &self.ucx_disconnector {
            d.disconnect(&self.ucx_endpoint);
        }
    }
}

impl Peer {
    /// A peer at `addr` with `connections` data connections at most, whose pooled connections
    /// are reused while idle for less than half of `idle_timeout`.
    pub(crate) fn new(addr: &str, connections: usize, idle_timeout: Duration) -> Self {
        Peer {
            addr: addr.to_owned(),
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(connections.max(1)),
            control: Mutex::new(ControlPool::default()),
            control_permits: Semaphore::new(CONTROL_CONNECTIONS_PER_PEER),
            max_idle: idle_timeout / 2,
            #[cfg(feature = "ucx")]
            ucx_engine: tokio::sync::Mutex::new(None),
            #[cfg(feature = "ucx")]
            ucx_endpoint: {
                static PEERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                format!("{addr}#{}", PEERS.fetch_add(1, Ordering::Relaxed))
            },
            #[cfg(feature = "ucx")]
            ucx_disconnector: None,
        }
    }

    /// The peer, closing its UCX endpoint with `disconnector` when dropped.
    #[cfg(feature = "ucx")]
    pub(crate) fn with_ucx(mut self, disconnector: Option<kvxfer_ucx::Disconnector>) -> Self {
        self.ucx_disconnector = disconnector;
        self
    }

    /// Forgets every connection to the peer (it is no longer the engine they were made to);
    /// control connections in use now are dropped when their exchange ends.
    pub(crate) fn reset(&self) {
        {
            let mut control = self.lock_control();
            control.idle.clear();
            control.generation += 1;
        }
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Whether the peer closed every connection this agent holds to it (or there are none).
    /// A control exchange under way holds a connection: then it is not gone.
    pub(crate) fn is_gone(&self) -> bool {
        if self.control_permits.available_permits() < CONTROL_CONNECTIONS_PER_PEER {
            return false;
        }
        let control = self.lock_control();
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        control.idle.iter().all(|p| p.conn.closed_by_peer()) && idle.iter().all(|p| p.conn.closed_by_peer())
    }

    pub(super) fn lock_control(&self) -> std::sync::MutexGuard<'_, ControlPool> {
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle control connection that may be reused, and the pool's generation (to give it
    /// back with [`Peer::checkin_control`]).
    pub(super) fn checkout_control(&self) -> (Option<Pooled>, u64) {
        let mut control = self.lock_control();
        let max_idle = self.max_idle;
        let pooled = std::iter::from_fn(|| control.idle.pop()).find(|p| p.reusable(max_idle));
        (pooled, control.generation)
    }

    /// Pools a control connection again, unless the peer was reset since it was checked out
    /// or [`CONTROL_CONNECTIONS_PER_PEER`] are idle (then it is closed).
    pub(super) fn checkin_control(&self, pooled: Pooled, generation: u64) {
        let mut control = self.lock_control();
        if control.generation == generation && control.idle.len() < CONTROL_CONNECTIONS_PER_PEER {
            control.idle.push(pooled);
        }
    }

    /// Returns a connection to the pool after a request ended with `r`, unless the error
    /// left it unusable (it is dropped then).
    pub(crate) fn checkin<T>(&self, conn: Connection, r: &Result<T, ClientError>) {
        if r.as_ref().err().is_none_or(ClientError::connection_usable) {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(Pooled::new(conn));
        }
    }
}
