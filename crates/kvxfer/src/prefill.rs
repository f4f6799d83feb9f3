//! The prefill agent: leases, serves reads, applies notifications, runs expiry.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvxfer_core::{
    CancelOutcome, ChildHandoff, EndKind, EngineInfo, LeaseConfig, LeaseEnd, LeaseRequest, LeaseStats,
    LeaseTable, ParentStatus, ParentTracker, PrefillResult, RetractOutcome,
};
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1;
use kvxfer_tcp::{serve_connection, Refusal, ServeContext, ServerCounters, ServerStats};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::{AgentConfig, Error};

/// Counters of a prefill agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillStats {
    /// Leases: made, pulled, released, expired, live; unrecognized notifications; bad tokens.
    pub leases: LeaseStats,
    /// Connections: bytes and reads served, refusals, protocol errors.
    pub server: ServerStats,
}

/// A prefill worker's agent: owns the lease table and serves the registered KV cache.
pub struct PrefillAgent {
    table: Arc<LeaseTable>,
    memory: Arc<KvMemory>,
    counters: Arc<ServerCounters>,
    tracker: Arc<Mutex<ParentTracker>>,
    events: Receiver<LeaseEnd>,
    wake: Arc<Notify>,
    addr: SocketAddr,
    stop: Option<Sender<()>>,
    event_thread: Option<JoinHandle<()>>,
    runtime: Option<Runtime>,
    io_timeout: Duration,
    host: String,
    incarnation: u64,
    /// Dropped after the runtime (no connection can pin any more), before the memory.
    #[cfg(feature = "ucx")]
    ucx: Option<kvxfer_ucx::UcxTarget>,
}

impl std::fmt::Debug for PrefillAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillAgent").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl PrefillAgent {
    /// Starts an agent over `memory`, listening on `listen` (port 0 picks a free port).
    pub fn start(config: AgentConfig, listen: &str, memory: KvMemory) -> Result<Self, Error> {
        let runtime = crate::runtime::build(&config.agent_name, config.worker_threads)?;
        let listener = runtime
            .block_on(TcpListener::bind(listen))
            .map_err(|source| Error::Io { what: format!("binding {listen}"), source })?;
        let addr = listener
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
        lease_config.default_ttl = config.lease_ttl;
        lease_config.max_lifetime = config.max_lease_lifetime;
        lease_config.max_children = config.max_children;
        let mut seed = [0u8; 32];
        rand::fill(&mut seed);
        let table = Arc::new(LeaseTable::new(lease_config, seed));
        let memory = Arc::new(memory);
        let counters = Arc::new(ServerCounters::default());
        config.check_transport()?;
        #[cfg_attr(not(feature = "ucx"), allow(unused_mut))]
        let mut transports = vec![crate::tcp_offer()];
        #[cfg(feature = "ucx")]
        let ucx = crate::ucx::start_if_wanted(&config, |c| crate::ucx::start_target(c, &memory))?;
        #[cfg(feature = "ucx")]
        if let Some(t) = &ucx {
            transports.insert(0, crate::ucx::offer(t));
        }
        let ctx = Arc::new(ServeContext {
            table: table.clone(),
            memory: memory.clone(),
            hello_ack: v1::HelloAck {
                protocol_version: config.protocol_version,
                engine_id: config.engine_id.clone(),
                agent_name: config.agent_name.clone(),
                compat_hash: layout.compat_hash(),
                layout: Some(layout.to_wire()),
                transports,
                incarnation,
                authenticated: false,
            },
            cluster_key: config.cluster_key.clone(),
            limits: config.limits,
            counters: counters.clone(),
        });
        runtime.spawn(accept_loop(listener, ctx));
        let wake = Arc::new(Notify::new());
        runtime.spawn(expiry_loop(table.clone(), wake.clone()));

        let tracker = Arc::new(Mutex::new(ParentTracker::with_forget_after(config.max_lease_lifetime)));
        let (events_tx, events) = crossbeam_channel::unbounded();
        let (stop, stop_rx) = crossbeam_channel::bounded(1);
        let event_thread = {
            let (table, tracker) = (table.clone(), tracker.clone());
            std::thread::Builder::new()
                .name(format!("kvxfer-{}-events", config.agent_name))
                .spawn(move || forward_events(&table, &tracker, &events_tx, &stop_rx))
                .map_err(|source| Error::Io { what: "starting the lease event thread".into(), source })?
        };
        if config.cluster_key.is_none() {
            crate::warn_unauthenticated("prefill", &config.agent_name);
        }
        info!(%addr, %host, engine_id = %config.engine_id, incarnation, "prefill agent listening");
        Ok(PrefillAgent {
            table,
            memory,
            counters,
            tracker,
            events,
            wake,
            addr,
            stop: Some(stop),
            event_thread: Some(event_thread),
            runtime: Some(runtime),
            io_timeout: config.limits.io_timeout,
            host,
            incarnation,
            #[cfg(feature = "ucx")]
            ucx,
        })
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

    /// Whether the agent offers the UCX data path.
    pub fn offers_ucx(&self) -> bool {
        #[cfg(feature = "ucx")]
        return self.ucx.is_some();
        #[cfg(not(feature = "ucx"))]
        false
    }

    /// The registered KV cache the agent serves.
    pub fn memory(&self) -> &Arc<KvMemory> {
        &self.memory
    }

    /// Leases one child's blocks: the lease is registered before the hand-off is returned.
    /// The owner must not write those blocks until the lease's end arrives on [`Self::events`].
    /// `n` is bounded by `AgentConfig::max_children`; a ttl above
    /// `AgentConfig::max_lease_lifetime` is clamped to it.
    pub fn lease(&self, req: LeaseRequest) -> Result<ChildHandoff, Error> {
        let (parent, n, child) = (req.parent_request_id.clone(), req.n, req.child_index);
        // The tracker records the lease only once the table made it, under the tracker's
        // lock, so the lease's end (applied by the event thread under the same lock) cannot
        // overtake it.
        let mut tracker = self.lock_tracker();
        tracker.admit(&parent, n, Instant::now())?;
        let (h, generation) = self.table.lease_with_generation(req, Instant::now())?;
        tracker.leased(&parent, n, child, generation, Instant::now());
        drop(tracker);
        debug!(remote_request_id = %h.remote_request_id(), blocks = h.remote_block_ids().len(), "leased");
        // The expiry task sleeps until the earliest deadline; this one may be earlier.
        self.wake.notify_one();
        Ok(h)
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
        let n = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
        let reqs: Vec<LeaseRequest> = (0u32..)
            .zip(blocks)
            .map(|(i, b)| {
                let mut req = LeaseRequest::new(parent, i, n, b).consumers(expected_consumers);
                req.ttl = ttl;
                req
            })
            .collect();
        for req in &reqs {
            self.table.validate(req)?;
        }
        let mut handoffs = Vec::with_capacity(reqs.len());
        for req in reqs {
            match self.lease(req) {
                Ok(h) => handoffs.push(h),
                Err(e) => {
                    self.retract_all(&handoffs);
                    return Err(e);
                }
            }
        }
        match PrefillResult::new(parent, n, handoffs.clone()) {
            Ok(result) => Ok(result),
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
            match self.table.retract(h.remote_request_id(), h.token().as_bytes(), Instant::now()) {
                RetractOutcome::Retracted => tracker.retracted(h.parent_request_id(), h.child_index()),
                other => {
                    warn!(remote_request_id = %h.remote_request_id(), ?other, "lease could not be retracted; it ends as usual")
                }
            }
        }
    }

    /// Releases a lease from the owner's side (the request was aborted).
    pub fn cancel(&self, h: &ChildHandoff) -> CancelOutcome {
        self.table.cancel(h.remote_request_id(), h.token().as_bytes(), Instant::now())
    }

    /// How each lease ended, once per lease, with the blocks to free. Drain it: ends queue
    /// up here until received.
    pub fn events(&self) -> &Receiver<LeaseEnd> {
        &self.events
    }

    /// The children states of a parent that still has pending children.
    pub fn parent_status(&self, parent: &str) -> Option<ParentStatus> {
        self.lock_tracker().status(parent).cloned()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PrefillStats {
        PrefillStats { leases: self.table.stats(), server: self.counters.snapshot() }
    }

    fn lock_tracker(&self) -> std::sync::MutexGuard<'_, ParentTracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for PrefillAgent {
    fn drop(&mut self) {
        // One-sided readers (UCX) read registered memory without us seeing the reads; a pin
        // is their promise to unpin when done. Wait for open pins (bounded) before the
        // memory can be unmapped and freed, so no peer's read outlives its buffer.
        let deadline = Instant::now() + self.io_timeout;
        while self.counters.pins_open.load(std::sync::atomic::Ordering::Relaxed) > 0
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(rt) = self.runtime.take() {
            crate::runtime::shutdown(rt);
        }
        drop(self.stop.take());
        if let Some(t) = self.event_thread.take() {
            let _ = t.join();
        }
    }
}

/// The host hand-offs name: the configured one, else the bound IP unless it is unspecified
/// (`0.0.0.0`, `::`), which no peer can connect to: then the local address the default route
/// would use, found by connecting a UDP socket (no packet is sent) to an address of the
/// documentation ranges, which only the default route reaches.
fn advertise_host(configured: Option<&str>, bound: SocketAddr) -> Result<String, Error> {
    if let Some(h) = configured {
        return Ok(h.to_owned());
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

/// Connections open per peer address, for `Limits::max_connections_per_peer`.
#[derive(Debug, Default)]
struct PeerCounts(Mutex<HashMap<IpAddr, usize>>);

/// One open connection of a peer; dropping it gives the slot back.
struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: IpAddr,
}

impl PeerCounts {
    /// Takes a slot for `ip`, unless it already has `max` connections open.
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<PeerSlot> {
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

async fn accept_loop(listener: TcpListener, ctx: Arc<ServeContext>) {
    let open = Arc::new(tokio::sync::Semaphore::new(ctx.limits.max_connections.max(1)));
    let per_peer = Arc::new(PeerCounts::default());
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => match open.clone().try_acquire_owned() {
                Ok(permit) => match per_peer.take(peer.ip(), ctx.limits.max_connections_per_peer) {
                    Some(slot) => {
                        let ctx = ctx.clone();
                        tokio::spawn(async move {
                            serve_connection(stream, ctx).await;
                            drop(slot);
                            drop(permit);
                        });
                    }
                    None => {
                        tokio::spawn(kvxfer_tcp::refuse_connection(
                            stream,
                            ctx.clone(),
                            Refusal::TooManyFromPeer,
                        ));
                    }
                },
                Err(_) => {
                    tokio::spawn(kvxfer_tcp::refuse_connection(
                        stream,
                        ctx.clone(),
                        Refusal::TooManyConnections,
                    ));
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

/// Sleeps until the table's next deadline (or a new lease wakes it), then expires.
async fn expiry_loop(table: Arc<LeaseTable>, wake: Arc<Notify>) {
    loop {
        let next = table.poll_timeout();
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
            _ = wake.notified() => {}
        }
    }
}

/// Moves lease ends from the table to the owner, updating the parent tracker and logging
/// each one with its request id.
fn forward_events(
    table: &LeaseTable,
    tracker: &Mutex<ParentTracker>,
    out: &Sender<LeaseEnd>,
    stop: &Receiver<()>,
) {
    loop {
        crossbeam_channel::select! {
            recv(table.ended()) -> end => {
                let Ok(end) = end else { return };
                match end.kind {
                    EndKind::Pulled => debug!(remote_request_id = %end.remote_request_id, consumers = end.consumers_seen, "lease ended: pulled"),
                    EndKind::Released => info!(remote_request_id = %end.remote_request_id, "lease ended: released"),
                    EndKind::Expired => warn!(
                        remote_request_id = %end.remote_request_id,
                        "Releasing expired KV blocks for request {} which were retrieved by {} of {} remote worker(s) before lease expired",
                        end.remote_request_id, end.consumers_seen, end.expected_consumers
                    ),
                }
                let done = tracker.lock().unwrap_or_else(|p| p.into_inner()).on_end(&end, Instant::now());
                if let Some(status) = done {
                    debug!(parent = %end.parent_request_id, ?status, "parent complete");
                }
                // The owner may have dropped its receiver; the ends are then simply dropped.
                let _ = out.send(end);
            }
            recv(stop) -> _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
