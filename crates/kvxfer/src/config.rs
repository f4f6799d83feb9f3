//! Agent settings.

use std::time::Duration;

use kvxfer_tcp::{ClusterKey, Limits};

/// Which data path an agent offers and a decode agent pulls with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// The best path both peers offer: UCX when both have it, else TCP.
    #[default]
    Auto,
    /// TCP only.
    Tcp,
    /// UCX only: pulls fail (clearly) when the peer does not offer it.
    Ucx,
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Ucx => "ucx",
        })
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "ucx" => Ok(TransportChoice::Ucx),
            other => Err(format!("unknown transport {other:?} (auto, tcp or ucx)")),
        }
    }
}

/// Settings shared by prefill and decode agents.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// A name for logs and handshakes.
    pub agent_name: String,
    /// This engine's id (the prefill side's is copied into every hand-off). Random by default.
    pub engine_id: String,
    /// Host written into hand-offs (prefill); defaults to the listen address's IP.
    pub advertise_host: Option<String>,
    /// Lease time-to-live when a lease request names none (vLLM: 30 s).
    pub lease_ttl: Duration,
    /// Frame size limit and I/O timeout of every connection.
    pub limits: Limits,
    /// Worker threads of the runtime a blocking agent ([`crate::blocking`]) owns; the async
    /// agents run on their caller's runtime and start none. Default 2: more throughput per
    /// agent under load (bulk and many-request runs); 1: fewer context switches and less
    /// CPU per hand-off. 0: a current-thread runtime on one driver thread
    /// ([`crate::blocking::AgentRuntime`]): the agent's tasks, timers and sockets all run on
    /// that thread (the front door, tokio's blocking pool and UCX's progress thread stay
    /// apart), with the fewest context switches per hand-off, at one core's throughput.
    pub worker_threads: usize,
    /// How long `shutdown` lets reads in flight (and, on a prefill agent, open pins) finish
    /// before it cuts them. Default 5 s.
    pub shutdown_grace: Duration,
    /// Prefill side: where connections are accepted and their handshakes run until the
    /// peer proved the cluster key (or, keyless, sent a compatible hello). `Some(nice)`
    /// (default `Some(10)`): on a thread of the agent's own (named `kvxfer-accept`), whose CPU
    /// priority is lowered by `nice` (0: left as is; Linux `setpriority` of that thread).
    /// A flood of connections that prove nothing then gets the CPU the served connections
    /// leave, not an equal share of it; admitted connections move to the agent's runtime.
    /// `None`: on the agent's runtime, so the agent starts no thread of its own.
    pub front_door_nice: Option<i32>,
    /// Data connections a decode agent opens to one prefill agent (pulls of different
    /// children run in parallel over them). Reused across pulls.
    pub connections_per_peer: usize,
    /// Decode side, TCP: a child that its own read alone settles (no blocks shared with a
    /// sibling) sends its notify right behind its read request, so a hand-off takes one
    /// round trip instead of two. The prefill side then counts the lease pulled once it has
    /// sent the payload, before this side has received and checked it: a payload that
    /// fails its CRC or never arrives (this process dies, the connection breaks) still
    /// fails the child, but its lease ends as pulled instead of released or expired. (A
    /// read the prefill side refused, e.g. blocks outside the lease, does not count the
    /// notify behind it: nothing was sent, and the lease is released by the usual cancel.)
    /// Used only for single-group caches and plain `submit` pulls (not `submit_ranks`). Off
    /// by default.
    pub notify_with_read: bool,
    /// How often a decode agent heartbeats pending pulls; `None`: the shortest lease ttl of
    /// the pull / 6. Never more often than every 100 ms (a hand-off may state a ttl of 1 ms;
    /// the decode side does not spin on it).
    pub heartbeat_interval: Option<Duration>,
    /// Tensor-parallel size written into hand-offs.
    pub tp_size: u32,
    /// Protocol version sent in handshakes. Only tests of mismatched peers change it.
    pub protocol_version: u32,
    /// Data path: offered (prefill) and used (decode).
    pub transport: TransportChoice,
    /// UCX settings (transports, peer-failure handling).
    #[cfg(feature = "ucx")]
    pub ucx: kvxfer_ucx::UcxConfig,

    // Identity and trust.
    /// The cluster key every agent of the cluster shares: peers prove they hold it in a
    /// mutual challenge-response before anything internal (layout, UCX worker address,
    /// rkeys) is exchanged. `None`: peers are not authenticated (logged once per agent), and
    /// peers that require a key are refused. See [`ClusterKey::from_env`].
    pub cluster_key: Option<ClusterKey>,
    /// This agent's rank within its engine (tensor-parallel decode ranks pulling the same
    /// prefill blocks); part of the default consumer id.
    pub rank: u32,
    /// The consumer id a decode agent notifies with; `None`: `"{engine_id}/{rank}"`, so two
    /// ranks of one engine count as two consumers of a lease.
    pub consumer_id: Option<String>,
    // Hardening, part A (leases): kept together at the end.
    /// Longest a lease lives from the moment it is made (prefill): heartbeats never extend
    /// it past this, and a larger `lease_ttl` (or request ttl) is clamped to it. Default 10
    /// minutes.
    pub max_lease_lifetime: Duration,
    /// Largest `n` a lease may name (prefill); bounds per-parent bookkeeping. Default 1024.
    pub max_children: u32,
    /// This rank's KV-cache shape (tensor-parallel size and rank, heads, head dims, dtype,
    /// block tokens, groups), carried in the handshake: with both sides' shapes, peers of
    /// different TP sizes or block sizes are served by transfer plans
    /// ([`kvxfer_core::TransferPair`]) instead of being refused. The memory must have
    /// exactly the shape's block layouts. `None`: peers need identical layouts.
    pub kv_shape: Option<kvxfer_core::KvShapeSpec>,
    /// Prefill side: compute each leased block's CRC-32C (per segment) once, right after its
    /// lease is made, on a thread of the agent's own (`kvxfer-crc`), so a TCP read of whole
    /// blocks combines the stored values into its payload's CRC instead of checksumming
    /// the payload while sending it. It moves that work off the serving runtime, not away:
    /// every leased byte is read once more at lease time, also when the lease is pulled
    /// over UCX (which does not use the values) or released unread. Reads of head slices
    /// (heterogeneous TP) and of blocks not computed yet checksum while sending, as
    /// without it. A block written after its lease was made (which the lease contract
    /// forbids) fails its read's CRC check on the decode side. Off by default.
    pub precompute_crcs: bool,
    /// Running in a cluster: etcd discovery and Prometheus metrics (all off by default).
    #[cfg(feature = "cluster")]
    pub cluster: crate::cluster_config::ClusterConfig,
}

impl AgentConfig {
    /// Defaults: 30 s leases, 1 MiB frames, 10 s I/O timeout, 2 threads, 2 connections per peer.
    pub fn new(agent_name: impl Into<String>) -> Self {
        let mut id = [0u8; 16];
        rand::fill(&mut id);
        let engine_id = id.iter().map(|b| format!("{b:02x}")).collect();
        AgentConfig {
            agent_name: agent_name.into(),
            engine_id,
            advertise_host: None,
            lease_ttl: Duration::from_secs(30),
            limits: Limits::default(),
            worker_threads: 2,
            shutdown_grace: Duration::from_secs(5),
            front_door_nice: Some(10),
            connections_per_peer: 2,
            notify_with_read: false,
            heartbeat_interval: None,
            tp_size: 1,
            protocol_version: kvxfer_proto::PROTOCOL_VERSION,
            transport: TransportChoice::Auto,
            #[cfg(feature = "ucx")]
            ucx: kvxfer_ucx::UcxConfig::default(),
            cluster_key: None,
            rank: 0,
            consumer_id: None,
            max_lease_lifetime: kvxfer_core::LeaseConfig::DEFAULT_MAX_LIFETIME,
            max_children: kvxfer_core::LeaseConfig::DEFAULT_MAX_CHILDREN,
            kv_shape: None,
            precompute_crcs: false,
            #[cfg(feature = "cluster")]
            cluster: crate::cluster_config::ClusterConfig::default(),
        }
    }

    /// Turns etcd discovery on (see [`crate::cluster`]).
    #[cfg(feature = "cluster")]
    pub fn discovery(mut self, discovery: crate::cluster_config::DiscoveryConfig) -> Self {
        self.cluster.discovery = Some(discovery);
        self
    }

    /// Feeds this process's metrics registry (share one `Arc` between a process's agents).
    #[cfg(feature = "cluster")]
    pub fn metrics(mut self, metrics: std::sync::Arc<kvxfer_cluster::Metrics>) -> Self {
        self.cluster.metrics = Some(metrics);
        self
    }

    /// Serves the metrics at `GET /metrics` on `listen` (port 0 picks one).
    #[cfg(feature = "cluster")]
    pub fn metrics_listen(mut self, listen: impl Into<String>) -> Self {
        self.cluster.metrics_listen = Some(listen.into());
        self
    }

    /// Sets this rank's KV-cache shape (see [`Self::kv_shape`](AgentConfig::kv_shape)); its
    /// `tp_size` is also written into hand-offs, and its `tp_rank` becomes the agent's
    /// [`rank`](AgentConfig::rank) (registration key, default consumer id).
    pub fn kv_shape(mut self, spec: kvxfer_core::KvShapeSpec) -> Self {
        self.tp_size = spec.tp_size;
        self.rank = spec.tp_rank;
        self.kv_shape = Some(spec);
        self
    }

    /// The configured shape, checked and compared with `memory`'s layouts.
    pub(crate) fn checked_shape(
        &self,
        memory: &kvxfer_mem::KvMemory,
    ) -> Result<Option<kvxfer_core::KvShape>, crate::Error> {
        let Some(spec) = &self.kv_shape else { return Ok(None) };
        let shape = kvxfer_core::KvShape::new(spec.clone())
            .map_err(|e| crate::Error::ShapeMismatch(e.to_string()))?;
        if !shape.matches_layouts(memory.group_layouts()) {
            let want: Vec<_> = (0..shape.num_groups()).filter_map(|g| shape.block_layout(g)).collect();
            let have: Vec<_> = memory.group_layouts().collect();
            return Err(crate::Error::ShapeMismatch(format!(
                "the shape's layouts are {want:?}, the memory's {have:?}"
            )));
        }
        Ok(Some(shape))
    }

    /// Sets the cluster key peers must prove (and this agent proves to them).
    pub fn cluster_key(mut self, key: ClusterKey) -> Self {
        self.cluster_key = Some(key);
        self
    }

    /// Sets the cluster key from the environment (`KVXFER_CLUSTER_KEY` as hex, or a file
    /// named by `KVXFER_CLUSTER_KEY_FILE`), leaving it unset when neither is set. A key that
    /// is set but unreadable or too short is an error, never silently ignored.
    pub fn cluster_key_from_env(mut self) -> Result<Self, crate::Error> {
        if let Some(key) = ClusterKey::from_env()? {
            self.cluster_key = Some(key);
        }
        Ok(self)
    }

    /// Sets this agent's rank within its engine.
    pub fn rank(mut self, rank: u32) -> Self {
        self.rank = rank;
        self
    }

    /// Sets the consumer id notifications carry (default `"{engine_id}/{rank}"`).
    pub fn consumer_id(mut self, id: impl Into<String>) -> Self {
        self.consumer_id = Some(id.into());
        self
    }

    /// The consumer id a decode agent notifies with.
    pub fn effective_consumer_id(&self) -> String {
        self.consumer_id.clone().unwrap_or_else(|| format!("{}/{}", self.engine_id, self.rank))
    }

    /// Sets the data path.
    pub fn transport(mut self, t: TransportChoice) -> Self {
        self.transport = t;
        self
    }

    /// Sets UCX's transports (`UCX_TLS`) and peer-failure handling — what the command-line
    /// tools expose. Without the `ucx` feature, asking for either is an error.
    pub fn ucx_options(self, tls: Option<String>, peer_failure_handling: bool) -> Result<Self, crate::Error> {
        #[cfg(feature = "ucx")]
        {
            let mut c = self;
            c.ucx.tls = tls;
            // An explicit choice, for every peer (no same-host exception).
            c.ucx.peer_failure_handling = peer_failure_handling;
            c.ucx.same_host_shared_memory = false;
            Ok(c)
        }
        #[cfg(not(feature = "ucx"))]
        if tls.is_some() || peer_failure_handling {
            Err(crate::Error::Unsupported("UCX options need kvxfer built with the `ucx` feature".into()))
        } else {
            Ok(self)
        }
    }

    /// Sets `UcxConfig::verify_payloads` (a CRC-32C check of every one-sided read). Without
    /// the `ucx` feature, asking for it is an error.
    pub fn ucx_verify_payloads(self, on: bool) -> Result<Self, crate::Error> {
        #[cfg(feature = "ucx")]
        {
            let mut c = self;
            c.ucx.verify_payloads = on;
            Ok(c)
        }
        #[cfg(not(feature = "ucx"))]
        if on {
            Err(crate::Error::Unsupported("UCX options need kvxfer built with the `ucx` feature".into()))
        } else {
            Ok(self)
        }
    }

    /// The config an agent over `memory` runs with: a UCX-only config is refused in a build
    /// without UCX; device memory (a CUDA cache, `kvxfer_mem::Region::borrowed_device`)
    /// needs UCX — `auto` becomes `ucx`, so UCX must start and every peer must offer it —
    /// and refuses the options that read its bytes on the CPU (`precompute_crcs`, UCX's
    /// `verify_payloads`) and `tcp`.
    pub(crate) fn for_memory(mut self, memory: &kvxfer_mem::KvMemory) -> Result<Self, crate::Error> {
        let no_ucx = cfg!(not(feature = "ucx"));
        if no_ucx && self.transport == TransportChoice::Ucx {
            return Err(crate::Error::Unsupported(
                "UCX was requested, but kvxfer was built without the `ucx` feature".into(),
            ));
        }
        if !memory.is_device() {
            return Ok(self);
        }
        let refuse = |why: &str| {
            Err(crate::Error::Unsupported(format!(
                "the KV cache is device memory, which only UCX reads and writes here (no CPU copy of \
                 it is made): {why}; or register a host copy (host staging)"
            )))
        };
        if self.transport == TransportChoice::Tcp {
            return refuse("the transport is `tcp`; use `auto` or `ucx`");
        }
        if self.precompute_crcs {
            return refuse("`precompute_crcs` reads every leased block on the CPU; turn it off");
        }
        #[cfg(feature = "ucx")]
        if self.ucx.verify_payloads {
            return refuse("UCX's `verify_payloads` checks reads on the CPU; turn it off");
        }
        if no_ucx {
            return refuse("this kvxfer is built without the `ucx` feature");
        }
        self.transport = TransportChoice::Ucx;
        Ok(self)
    }

    /// Sets the engine id.
    pub fn engine_id(mut self, id: impl Into<String>) -> Self {
        self.engine_id = id.into();
        self
    }

    /// Sets the default lease time-to-live.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets the I/O timeout.
    pub fn io_timeout(mut self, t: Duration) -> Self {
        self.limits.io_timeout = t;
        self
    }

    /// Sets the number of data connections per peer (at least 1).
    pub fn connections_per_peer(mut self, n: usize) -> Self {
        self.connections_per_peer = n.max(1);
        self
    }

    /// Sets [`Self::notify_with_read`]: one round trip per hand-off over TCP, the lease
    /// counted pulled once its payload was sent.
    pub fn notify_with_read(mut self, on: bool) -> Self {
        self.notify_with_read = on;
        self
    }

    /// Sets [`Self::worker_threads`] (0: a current-thread runtime on one driver thread).
    pub fn worker_threads(mut self, n: usize) -> Self {
        self.worker_threads = n;
        self
    }

    /// Sets where a prefill agent runs its handshakes (see [`Self::front_door_nice`]):
    /// `Some(nice)` on a front-door thread of that lowered priority, `None` on its runtime.
    pub fn front_door(mut self, nice: Option<i32>) -> Self {
        self.front_door_nice = nice;
        self
    }

    /// Sets how long `shutdown` lets reads in flight finish.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// Sets the maximum lease lifetime (prefill side).
    pub fn max_lease_lifetime(mut self, t: Duration) -> Self {
        self.max_lease_lifetime = t;
        self
    }

    /// Sets the largest `n` a lease may name (prefill side).
    pub fn max_children(mut self, n: u32) -> Self {
        self.max_children = n;
        self
    }

    /// Sets [`Self::precompute_crcs`] (prefill side): CRC-32Cs of leased blocks computed at
    /// lease time, off the serving runtime.
    pub fn precompute_crcs(mut self, on: bool) -> Self {
        self.precompute_crcs = on;
        self
    }

    /// Sets how long a frame naming a lease not armed yet waits for it (prefill side;
    /// `Limits::arm_wait`, default 5 s; see [`crate::PrefillAgent::arm`]).
    pub fn arm_wait(mut self, wait: Duration) -> Self {
        self.limits.arm_wait = wait;
        self
    }
}
