//! Heartbeats of leases whose pulls have not started: vLLM's decode side keeps the prefill
//! side's lease of a request alive while the request waits in its queue for free blocks
//! (NIXL's lease semantics). A pull heartbeats its own leases once it runs; before that,
//! the [`Keeper`] sends `Heartbeat` frames over a connection per prefill agent of its own
//! (kvxfer-tcp's `Connection`, with the decode agent's layout and cluster key), reconnecting
//! after a failure.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Instant;

use kvxfer_core::{log, ChildHandoff, EngineInfo};
use kvxfer_proto::v1::{self, LeaseOutcome};
use kvxfer_tcp::{ClusterKey, Connection, Limits};
use tracing::{debug, warn};

/// Counters as a map (for `stats`).
pub(crate) type Counters = HashMap<&'static str, u64>;

/// Connections and counters of the queued-lease heartbeats of one decode agent.
pub(crate) struct Keeper {
    hello: v1::Hello,
    key: Option<ClusterKey>,
    limits: Limits,
    conns: tokio::sync::Mutex<HashMap<String, (Connection, Instant)>>,
    sent: AtomicU64,
    extended: AtomicU64,
    unrecognized: AtomicU64,
    ended: AtomicU64,
    errors: AtomicU64,
    /// Connections pooled now.
    pooled: AtomicU64,
}

fn outcome_name(o: LeaseOutcome) -> &'static str {
    match o {
        LeaseOutcome::Extended => "extended",
        LeaseOutcome::AlreadyPulled => "already_pulled",
        LeaseOutcome::AlreadyReleased => "already_released",
        LeaseOutcome::AlreadyExpired => "already_expired",
        _ => "unrecognized",
    }
}

impl Keeper {
    /// A keeper that handshakes with `hello` (the decode agent's identity and layout).
    pub(crate) fn new(hello: v1::Hello, key: Option<ClusterKey>, limits: Limits) -> Self {
        Keeper {
            hello,
            key,
            limits,
            conns: tokio::sync::Mutex::new(HashMap::new()),
            sent: AtomicU64::new(0),
            extended: AtomicU64::new(0),
            unrecognized: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            pooled: AtomicU64::new(0),
        }
    }

    /// Whether a pooled connection is worth reusing: the peer has not closed it and it has
    /// been idle for less than half the idle timeout.
    fn reusable(&self, conn: &Connection, since: Instant) -> bool {
        !conn.closed_by_peer() && since.elapsed() < self.limits.idle_timeout / 2
    }

    /// A connection to the prefill agent at `addr`: a pooled one the peer has not closed and
    /// that has been idle for less than half the idle timeout, or (`fresh`, or none pooled) a
    /// new one.
    async fn connection(&self, addr: &str, fresh: bool) -> Option<Connection> {
        let pooled = {
            let mut conns = self.conns.lock().await;
            let pooled = conns.remove(addr);
            self.pooled.store(conns.len() as u64, Ordering::Relaxed);
            pooled
        };
        if let Some((c, _)) = pooled.filter(|(c, since)| !fresh && self.reusable(c, *since)) {
            return Some(c);
        }
        match Connection::connect_with_key(addr, &self.hello, self.key.as_ref(), self.limits).await {
            Ok(c) => Some(c),
            Err(e) => {
                warn!(peer = %addr, error = %e, "queued-lease heartbeat: cannot reach the prefill agent");
                None
            }
        }
    }

    /// Pools `conn` for the next heartbeat to `addr`, first dropping the pooled connections
    /// no heartbeat would reuse (closed by their peer, or idle past half the idle timeout):
    /// a prefill agent that went away — a restart on a new port, a host replaced — leaves
    /// no connection behind for as long as this agent runs.
    async fn pool(&self, addr: &str, conn: Connection) {
        let mut conns = self.conns.lock().await;
        conns.retain(|_, (c, since)| self.reusable(c, *since));
        conns.insert(addr.to_owned(), (conn, Instant::now()));
        self.pooled.store(conns.len() as u64, Ordering::Relaxed);
    }

    /// One heartbeat exchange with the prefill agent at `addr`; a connection whose exchange
    /// failed is dropped. Each lease comes with the engine id and incarnation its hand-off
    /// names (incarnation 0: not stated): a lease of another process than the one answering
    /// (asked again on a new connection before it counts — a pooled connection may predate a
    /// crash) went with the process that made it and is answered unrecognized here, not sent
    /// (the prefill side would hold the frame for its arm wait).
    async fn exchange(
        &self,
        addr: &str,
        leases: Vec<(v1::LeaseRef, &EngineInfo)>,
    ) -> Option<Vec<LeaseOutcome>> {
        let made_by = |ack: &v1::HelloAck, e: &EngineInfo| {
            (e.engine_id.is_empty() || e.engine_id == ack.engine_id)
                && (e.incarnation == 0 || e.incarnation == ack.incarnation)
        };
        let mut conn = self.connection(addr, false).await?;
        if leases.iter().any(|(_, e)| !made_by(conn.peer_hello(), e)) {
            conn = self.connection(addr, true).await?;
        }
        let ack = conn.peer_hello().clone();
        let (live, gone): (Vec<_>, Vec<_>) =
            leases.into_iter().enumerate().partition(|(_, (_, e))| made_by(&ack, e));
        let mut out = vec![LeaseOutcome::Unrecognized; live.len() + gone.len()];
        if !gone.is_empty() {
            debug!(peer = %addr, leases = gone.len(), engine = %log::Peer(&ack.engine_id), incarnation = %log::Incarnation(ack.incarnation), "queued-lease heartbeat: leases of another process not sent");
        }
        if live.is_empty() {
            // Only a new connection tells every lease gone (a pooled one is asked again on
            // one): it is pooled for the next heartbeat rather than made again.
            self.pool(addr, conn).await;
            return Some(out);
        }
        let (at, refs): (Vec<usize>, Vec<v1::LeaseRef>) = live.into_iter().map(|(i, (r, _))| (i, r)).unzip();
        match conn.heartbeat(refs).await {
            Ok(outcomes) => {
                self.pool(addr, conn).await;
                for (i, o) in at.into_iter().zip(outcomes) {
                    out[i] = o;
                }
                Some(out)
            }
            Err(e) => {
                warn!(peer = %addr, error = %e, "queued-lease heartbeat failed");
                None
            }
        }
    }

    /// Heartbeats every lease of `handoffs` (one exchange per prefill agent) and returns
    /// one outcome per hand-off, in order.
    pub(crate) async fn heartbeat(&self, handoffs: &[ChildHandoff]) -> Vec<&'static str> {
        let mut by_peer: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, h) in handoffs.iter().enumerate() {
            by_peer.entry(h.engine().addr()).or_default().push(i);
        }
        let mut out = vec!["error"; handoffs.len()];
        for (addr, idx) in by_peer {
            let leases = idx
                .iter()
                .map(|&i| {
                    let r = v1::LeaseRef {
                        remote_request_id: handoffs[i].remote_request_id().to_owned(),
                        lease_token: handoffs[i].token().as_bytes().to_vec(),
                    };
                    (r, handoffs[i].engine())
                })
                .collect();
            self.sent.fetch_add(1, Ordering::Relaxed);
            match self.exchange(&addr, leases).await {
                Some(outcomes) => {
                    for (&i, o) in idx.iter().zip(outcomes) {
                        let counter = match o {
                            LeaseOutcome::Extended => &self.extended,
                            LeaseOutcome::AlreadyPulled
                            | LeaseOutcome::AlreadyReleased
                            | LeaseOutcome::AlreadyExpired => &self.ended,
                            _ => &self.unrecognized,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        out[i] = outcome_name(o);
                        debug!(remote_request_id = %handoffs[i].remote_request_id(), outcome = out[i], "queued-lease heartbeat");
                    }
                }
                None => {
                    self.errors.fetch_add(idx.len() as u64, Ordering::Relaxed);
                }
            }
        }
        out
    }

    /// Closes every connection.
    pub(crate) async fn close(&self) {
        self.conns.lock().await.clear();
        self.pooled.store(0, Ordering::Relaxed);
    }

    /// The counters, named as `DecodeAgent.stats()` reports them.
    pub(crate) fn stats(&self) -> Counters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters::from([
            ("keeper_heartbeats", l(&self.sent)),
            ("keeper_extended", l(&self.extended)),
            ("keeper_unrecognized", l(&self.unrecognized)),
            ("keeper_ended", l(&self.ended)),
            ("keeper_errors", l(&self.errors)),
            ("keeper_connections", l(&self.pooled)),
        ])
    }
}
