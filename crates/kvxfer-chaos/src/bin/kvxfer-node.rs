//! One kvxfer agent in its own process, driven by JSON lines on stdin and reporting JSON
//! lines on stdout, so tests can `kill -9` either side of a pull.
//!
//! ```text
//! kvxfer-node prefill --blocks 256 --block-bytes 65536 --ttl-ms 2000
//!   stdout: {"event":"listening","addr":"127.0.0.1:PORT"}
//!   stdin:  {"cmd":"lease","parent":"P","n":4,"blocks_per_child":16}
//!   stdout: {"event":"result","parent":"P","result":"<hex of the PrefillResult protobuf>"}
//!           {"event":"lease_end","parent":"P","child":0,"kind":"Pulled"}   (one per lease, as it ends)
//!   stdin:  {"cmd":"stats"}  ->  {"event":"stats","leased":..,"pulled":..,..}
//!
//! kvxfer-node decode --blocks 256 --block-bytes 65536
//!   stdout: {"event":"ready"}
//!   stdin:  {"cmd":"pull","result":"<hex>","peer":"127.0.0.1:PORT"}   (peer: optional override)
//!   stdout: {"event":"child","child":0,"outcome":"done","verified":true}
//!           {"event":"child","child":1,"outcome":"failed","reason":"..","invalid_local_blocks":[..]}
//!           {"event":"pull_done","parent":"P","elapsed_ms":..}
//! ```
//! Prefill memory holds `kvxfer_mem::pattern` bytes, so the decode side verifies every
//! byte it pulled. Local blocks are the remote ones, child by child.
//!
//! In a cluster (built with the `cluster` feature): `--etcd URL --namespace NS` registers a
//! prefill node (`--engine-id`, `--registration-ttl-s`; it prints
//! `{"event":"registered",..}` once its key is in etcd) and makes a decode node resolve and
//! watch engines (it prints `{"event":"directory","kind":"added|updated|removed",..}` as its
//! directory changes, and `"kind":"present"` for what it had listed already); `{"cmd":"lease",..,"engine_only":true}` hands out results naming only
//! the engine id; `--metrics ADDR` serves `/metrics` (`{"event":"metrics","addr":..}`);
//! `{"cmd":"status"}` prints where the prefill node's registration or the decode node's
//! directory stands with etcd (`{"event":"status","etcd":{"state":..,"endpoint":..,..}}`).
//! etcd TLS and credentials come from the environment (`KVXFER_ETCD_CA`, `KVXFER_ETCD_CERT`,
//! `KVXFER_ETCD_KEY`, `KVXFER_ETCD_USER`, `KVXFER_ETCD_PASSWORD` or
//! `KVXFER_ETCD_PASSWORD_FILE`: `EtcdConfig::security_from_env`).
//!
//! SIGTERM or SIGINT shuts the agent down gracefully — a prefill node deregisters from etcd
//! first, so decode agents see its hand-offs fail as `EngineNotRegistered` rather than at a
//! refused connection, then releases its live leases (their `lease_end` lines follow) — then
//! drops it, once its UCX objects are torn down, and prints
//! `{"event":"shutdown","signal":"SIGTERM","agent_dropped":true}` before exiting with status
//! 0. Closing stdin does the same, with `"signal":null`. (`"agent_dropped":false`: a
//! command still held the agent 10 s after the shutdown, and the node exits anyway.) A
//! command read once the shutdown began is not run: it is answered
//! `{"event":"error","message":"shutting down"}` unless the process ends first.
//!
//! Both roles authenticate peers with the cluster key of `KVXFER_CLUSTER_KEY` (hex) or
//! `KVXFER_CLUSTER_KEY_FILE`, and run unauthenticated when neither is set. A decode node
//! also reports blocks held by a one-sided read it could not stop
//! (`"outcome":"failed_blocks_held"`) and, when that read completes,
//! `{"event":"reclaimed","children":[..],"local_blocks":[..]}`.

use std::io::{BufRead, IsTerminal};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{Advice, AgentConfig, BlockLayout, ChildOutcome, EndKind, KvMemory, TransportChoice};
use kvxfer_core::log::Incarnation;
use kvxfer_mem::pattern;
use kvxfer_proto::Message;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(
    about = "A kvxfer agent in its own process, for fault tests",
    after_help = "With --etcd, TLS and credentials for etcd come from the environment: KVXFER_ETCD_CA \
                  (a PEM file; https:// endpoints), KVXFER_ETCD_CERT and KVXFER_ETCD_KEY (a client \
                  certificate), KVXFER_ETCD_USER with KVXFER_ETCD_PASSWORD or KVXFER_ETCD_PASSWORD_FILE. \
                  The peers' cluster key: KVXFER_CLUSTER_KEY (hex) or KVXFER_CLUSTER_KEY_FILE."
)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// A prefill agent over patterned blocks.
    Prefill {
        #[command(flatten)]
        common: Common,
        /// Lease ttl in milliseconds.
        #[arg(long, default_value_t = 2000)]
        ttl_ms: u64,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
    },
    /// A decode agent.
    Decode {
        #[command(flatten)]
        common: Common,
    },
}

#[derive(clap::Args, Debug)]
struct Common {
    /// Blocks of the KV cache.
    #[arg(long, default_value_t = 256)]
    blocks: u32,
    /// Bytes per block.
    #[arg(long, default_value_t = 65536)]
    block_bytes: u64,
    /// I/O timeout in milliseconds.
    #[arg(long, default_value_t = 2000)]
    io_timeout_ms: u64,
    /// Data path: auto, tcp or ucx.
    #[arg(long, default_value = "tcp")]
    transport: TransportChoice,
    /// UCX transports (UCX_TLS), e.g. `tcp` or `posix,sysv,cma,self` (needs the `ucx` feature).
    #[arg(long)]
    ucx_tls: Option<String>,
    /// UCX endpoint error mode PEER (for networks; UCX then avoids shared memory).
    #[arg(long)]
    ucx_peer_failure: bool,
    /// Serve Prometheus metrics at `GET /metrics` on this address (needs the `cluster` feature).
    #[arg(long)]
    metrics: Option<String>,
    /// etcd client URL, repeatable: discovery on (needs the `cluster` feature). TLS and
    /// credentials: the KVXFER_ETCD_* variables (`kvxfer-node --help`).
    #[arg(long = "etcd")]
    etcd: Vec<String>,
    /// Discovery namespace.
    #[arg(long, default_value = "kvxfer")]
    namespace: String,
    /// This node's engine id (random when absent).
    #[arg(long)]
    engine_id: Option<String>,
    /// Registration lease TTL in seconds (prefill, with `--etcd`).
    #[arg(long, default_value_t = 10)]
    registration_ttl_s: u64,
    /// How long a prefill node waits for its key to be in etcd before it prints
    /// `{"event":"registered","ok":false,..}` (it keeps registering in the background).
    #[arg(long, default_value_t = 15)]
    registration_wait_s: u64,
    /// The host hand-offs name (prefill; default: the listen address).
    #[arg(long)]
    advertise_host: Option<String>,
}

impl Common {
    fn config(&self, name: &str) -> Result<AgentConfig, String> {
        let mut c = AgentConfig::new(name)
            .io_timeout(Duration::from_millis(self.io_timeout_ms))
            .transport(self.transport)
            .ucx_options(self.ucx_tls.clone(), self.ucx_peer_failure)
            .and_then(AgentConfig::cluster_key_from_env)
            .map_err(|e| e.to_string())?;
        if let Some(id) = &self.engine_id {
            c = c.engine_id(id);
        }
        c.advertise_host.clone_from(&self.advertise_host);
        self.cluster(c)
    }

    #[cfg(feature = "cluster")]
    fn cluster(&self, mut c: AgentConfig) -> Result<AgentConfig, String> {
        if !self.etcd.is_empty() {
            let mut d = kvxfer::cluster::DiscoveryConfig::new(self.etcd.clone(), self.namespace.clone())
                .registration_ttl(Duration::from_secs(self.registration_ttl_s));
            d.etcd = d.etcd.security_from_env().map_err(|e| e.to_string())?;
            c = c.discovery(d);
        }
        if let Some(addr) = &self.metrics {
            c = c.metrics_listen(addr);
        }
        Ok(c)
    }

    #[cfg(not(feature = "cluster"))]
    fn cluster(&self, c: AgentConfig) -> Result<AgentConfig, String> {
        if self.etcd.is_empty() && self.metrics.is_none() {
            Ok(c)
        } else {
            Err("--etcd and --metrics need kvxfer-node built with the `cluster` feature".into())
        }
    }
    fn layout(&self) -> Result<BlockLayout, String> {
        BlockLayout::single(self.blocks, self.block_bytes).map_err(|e| e.to_string())
    }
}

fn emit(v: Value) {
    println!("{v}");
}

fn commands() -> impl Iterator<Item = Value> {
    std::io::stdin().lock().lines().map_while(Result::ok).filter_map(|l| match serde_json::from_str(&l) {
        Ok(v) => Some(v),
        Err(e) => {
            emit(json!({"event": "error", "message": format!("bad command {l:?}: {e}")}));
            None
        }
    })
}

/// SIGTERM and SIGINT, caught from startup on (their default, ending the process at once,
/// would leave the etcd key to its TTL and every live lease to expire).
struct Signals {
    runtime: tokio::runtime::Runtime,
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self, String> {
        use tokio::signal::unix::{signal, SignalKind};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(|e| format!("signal runtime: {e}"))?;
        let entered = runtime.enter();
        let err = |e: std::io::Error| format!("installing the SIGTERM/SIGINT handlers: {e}");
        let term = signal(SignalKind::terminate()).map_err(err)?;
        let int = signal(SignalKind::interrupt()).map_err(err)?;
        drop(entered);
        Ok(Self { runtime, term, int })
    }

    /// On a thread of its own: waits for a signal, then runs `stop` with its name (outside
    /// any runtime, so the blocking agents' shutdown waits to its end; `stop` prints the
    /// shutdown line) and exits with status 0.
    fn on_signal(mut self, stop: impl FnOnce(&'static str) + Send + 'static) {
        std::thread::spawn(move || {
            let (term, int) = (&mut self.term, &mut self.int);
            let name = self.runtime.block_on(async {
                tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                }
            });
            tracing::info!(signal = name, "shutting down");
            stop(name);
            std::process::exit(0);
        });
    }
}

/// The agent the command loop and the signal thread share: whichever ends the node (a
/// signal, or stdin closing) stops it through [`AgentSlot::stop`], so the process never
/// exits with the agent, and its UCX objects, still alive.
struct AgentSlot<A>(Mutex<Option<Arc<A>>>);

impl<A> AgentSlot<A> {
    fn new(agent: Arc<A>) -> Arc<Self> {
        Arc::new(Self(Mutex::new(Some(agent))))
    }

    /// The agent, or `None` once it was stopped.
    fn get(&self) -> Option<Arc<A>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Takes the agent out, runs `shutdown` on it (which ends the command under way, if
    /// any), then drops it as soon as the command loop has let go of it, waiting up to
    /// 10 s, and prints the shutdown line (`signal` is `None` when stdin closed). A
    /// blocking agent's drop waits for the teardown of its UCX objects, and a process that
    /// exits with a UCX worker alive can crash in UCX's exit handlers. Only the call that
    /// stopped the agent prints; any other returns once that line is out (the slot stays
    /// locked through all of it), so whichever then ends the process does not cut it.
    fn stop(&self, shutdown: impl FnOnce(&A), signal: Option<&str>) {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(mut agent) = slot.take() else { return };
        shutdown(&agent);
        let deadline = Instant::now() + Duration::from_secs(10);
        let dropped = loop {
            agent = match Arc::try_unwrap(agent) {
                Ok(agent) => {
                    drop(agent);
                    break true;
                }
                Err(_) if Instant::now() >= deadline => {
                    tracing::warn!("the command loop still holds the agent 10 s after its shutdown; exiting without its drop");
                    break false;
                }
                Err(agent) => agent,
            };
            std::thread::sleep(Duration::from_millis(5));
        };
        emit(json!({"event": "shutdown", "signal": signal, "agent_dropped": dropped}));
    }
}

fn end_kind(kind: EndKind) -> &'static str {
    match kind {
        EndKind::Pulled => "Pulled",
        EndKind::Released => "Released",
        EndKind::Expired => "Expired",
    }
}

fn advice_name(advice: Advice) -> &'static str {
    match advice {
        Advice::RetryFreshHandoff => "RetryFreshHandoff",
        Advice::Recompute => "Recompute",
        Advice::FailRequest => "FailRequest",
        _ => "Unknown",
    }
}

fn prefill(common: &Common, ttl: Duration, listen: &str, signals: Signals) -> Result<(), String> {
    let mem = pattern::alloc_filled(common.layout()?).map_err(|e| e.to_string())?;
    let config = common.config("node-prefill")?.lease_ttl(ttl);
    let engine_id = config.engine_id.clone();
    let agent = Arc::new(PrefillAgent::start(config, listen, mem).map_err(|e| e.to_string())?);
    emit(json!({
        "event": "listening", "addr": agent.local_addr().to_string(),
        "incarnation": Incarnation(agent.incarnation()).to_string(),
        "engine_id": engine_id,
    }));
    #[cfg(feature = "cluster")]
    {
        if let Some(addr) = agent.metrics_addr() {
            emit(json!({"event": "metrics", "addr": addr.to_string()}));
        }
        if agent.registration_status().is_some() {
            match agent.wait_registered(Duration::from_secs(common.registration_wait_s)) {
                Ok(_) => emit(json!({"event": "registered", "ok": true})),
                Err(s) => emit(json!({
                    "event": "registered", "ok": false,
                    "state": s.as_ref().map(|s| s.state.as_str()),
                    "last_error": s.as_ref().and_then(|s| s.last_error.as_deref()),
                    "failures": s.as_ref().map(|s| s.failures),
                })),
            }
        }
    }
    let events = agent.events().clone();
    let ends = std::thread::spawn(move || {
        for e in events.iter() {
            emit(json!({
                "event": "lease_end", "parent": &*e.parent_request_id, "child": e.child_index,
                "kind": end_kind(e.kind),
            }));
        }
    });
    // Shutdown deregisters first (the key is gone before the listener closes), then
    // releases the live leases: their ends are printed before the shutdown line.
    let slot = AgentSlot::new(agent);
    // The forwarder of lease ends finishes once the shutdown closed the events channel.
    let ends = Mutex::new(Some(ends));
    let stop = move |slot: &AgentSlot<PrefillAgent>, signal: Option<&str>| {
        let shutdown = |agent: &PrefillAgent| {
            agent.shutdown();
            if let Some(ends) = ends.lock().unwrap_or_else(PoisonError::into_inner).take() {
                let _ = ends.join();
            }
        };
        slot.stop(shutdown, signal);
    };
    let stop = Arc::new(stop);
    let (stopping, on_signal) = (slot.clone(), stop.clone());
    signals.on_signal(move |name| on_signal(&stopping, Some(name)));
    let mut next_block = 0u32;
    for cmd in commands() {
        let Some(agent) = slot.get() else {
            emit(json!({"event": "error", "message": "shutting down"}));
            continue;
        };
        match cmd["cmd"].as_str() {
            Some("lease") => {
                let parent = cmd["parent"].as_str().unwrap_or("P");
                let n = cmd["n"].as_u64().unwrap_or(1) as u32;
                let bpc = cmd["blocks_per_child"].as_u64().unwrap_or(1) as u32;
                let blocks = (0..n)
                    .map(|_| {
                        (0..bpc)
                            .map(|_| {
                                let b = next_block % common.blocks;
                                next_block += 1;
                                b
                            })
                            .collect()
                    })
                    .collect();
                match agent.lease_parent(parent, blocks, 1, None) {
                    // Hand-offs naming only the engine id (decode nodes resolve it in etcd).
                    Ok(r) if cmd["engine_only"].as_bool() == Some(true) => emit(json!({
                        "event": "result", "parent": parent,
                        "result": hex::encode(r.engine_only().to_wire().encode_to_vec()),
                    })),
                    Ok(r) => emit(json!({
                        "event": "result", "parent": parent, "result": hex::encode(r.to_wire().encode_to_vec()),
                    })),
                    Err(e) => emit(json!({"event": "error", "message": e.to_string()})),
                }
            }
            Some("status") => {
                #[cfg(feature = "cluster")]
                let status = agent.registration_status().map(|s| etcd_status(&s));
                #[cfg(not(feature = "cluster"))]
                let status: Option<Value> = None;
                emit(json!({"event": "status", "etcd": status}));
            }
            Some("stats") => {
                let s = agent.stats();
                emit(json!({
                    "event": "stats", "leased": s.leases.leased, "pulled": s.leases.pulled,
                    "released": s.leases.released, "expired": s.leases.expired, "live": s.leases.live,
                    "unrecognized": s.leases.unrecognized, "pins_open": s.server.pins_open,
                    "bytes_served": s.server.bytes_served, "auth_required": s.server.auth_required,
                    "bytes_served_one_sided": s.server.bytes_served_one_sided,
                    "connections_open": s.connections_open,
                    "auth_failed": s.server.auth_failed,
                }));
            }
            other => emit(json!({"event": "error", "message": format!("unknown command {other:?}")})),
        }
    }
    stop(&slot, None);
    Ok(())
}

fn decode(common: &Common, signals: Signals) -> Result<(), String> {
    let mem = KvMemory::alloc(common.layout()?).map_err(|e| e.to_string())?;
    let agent = Arc::new(DecodeAgent::start(common.config("node-decode")?, mem).map_err(|e| e.to_string())?);
    emit(json!({"event": "ready"}));
    #[cfg(feature = "cluster")]
    {
        if let Some(addr) = agent.metrics_addr() {
            emit(json!({"event": "metrics", "addr": addr.to_string()}));
        }
        if let Some(dir) = agent.directory() {
            let mut events = dir.subscribe();
            // What the directory listed before this subscription (its events went unseen).
            for e in dir.entries() {
                let mut line = directory_event(&kvxfer::cluster::DirectoryEvent::Added(e));
                line["kind"] = json!("present");
                emit(line);
            }
            std::thread::spawn(move || {
                while let Some(e) = events.blocking_recv() {
                    emit(directory_event(&e));
                }
            });
        }
    }
    let reclaimed = agent.reclaimed().clone();
    std::thread::spawn(move || {
        for r in reclaimed.iter() {
            emit(json!({
                "event": "reclaimed", "parent": r.parent_request_id, "children": r.children,
                "local_blocks": r.local_blocks,
            }));
        }
    });
    let slot = AgentSlot::new(agent);
    let stopping = slot.clone();
    signals.on_signal(move |name| stopping.stop(DecodeAgent::shutdown, Some(name)));
    for cmd in commands() {
        let Some(agent) = slot.get() else {
            emit(json!({"event": "error", "message": "shutting down"}));
            continue;
        };
        if cmd["cmd"].as_str() == Some("stats") {
            let s = agent.stats();
            emit(json!({
                "event": "stats", "pulls": s.pulls, "children_done": s.children_done,
                "children_failed": s.children_failed, "bytes_pulled": s.bytes_pulled,
                "bytes_pulled_ucx": s.bytes_pulled_ucx, "connections_opened": s.connections_opened,
                "peers": s.peers, "peers_invalidated": s.peers_invalidated,
                "integrity_failures": s.integrity_failures,
            }));
            continue;
        }
        if cmd["cmd"].as_str() == Some("status") {
            #[cfg(feature = "cluster")]
            let status = agent.directory().map(|d| etcd_status(&d.status()));
            #[cfg(not(feature = "cluster"))]
            let status: Option<Value> = None;
            emit(json!({"event": "status", "etcd": status}));
            continue;
        }
        if cmd["cmd"].as_str() != Some("pull") {
            emit(json!({"event": "error", "message": format!("unknown command {cmd}")}));
            continue;
        }
        let wire = cmd["result"]
            .as_str()
            .and_then(|h| hex::decode(h).ok())
            .and_then(|b| kvxfer_proto::v1::PrefillResult::decode(&b[..]).ok());
        let Some(mut wire) = wire else {
            emit(json!({"event": "error", "message": "pull: no valid result"}));
            continue;
        };
        if let Some((host, port)) = cmd["peer"].as_str().and_then(|p| p.rsplit_once(':')) {
            for c in &mut wire.children {
                c.remote_host = host.to_owned();
                c.remote_port = port.parse().unwrap_or(0);
            }
        }
        let parent = wire.parent_request_id.clone();
        let local: Vec<Vec<u32>> = wire.children.iter().map(|c| c.remote_block_ids.clone()).collect();
        let handle = match agent.submit_wire(wire, local.clone()) {
            Ok(h) => h,
            Err(e) => {
                emit(json!({"event": "error", "message": e.to_string()}));
                continue;
            }
        };
        let report = handle.wait();
        for c in &report.children {
            let i = c.child_index as usize;
            match &c.outcome {
                ChildOutcome::Done { acknowledged, .. } => {
                    // SAFETY: this child's pull reported; nobody writes its blocks now.
                    let bad = unsafe { pattern::check_blocks(agent.memory(), &local[i], &local[i]) };
                    emit(json!({
                        "event": "child", "child": i, "outcome": "done",
                        "verified": matches!(bad, Ok(None)), "acknowledged": acknowledged,
                    }));
                }
                ChildOutcome::Failed { error: reason, invalid_local_blocks } => emit(json!({
                    "event": "child", "child": i, "outcome": "failed", "reason": reason.to_string(), "advice": advice_name(reason.advice()),
                    "error_kind": error_kind(reason),
                    "invalid_local_blocks": invalid_local_blocks,
                })),
                ChildOutcome::Cancelled { .. } => {
                    emit(json!({"event": "child", "child": i, "outcome": "cancelled"}))
                }
                ChildOutcome::FailedBlocksHeld { error: reason, held_local_blocks } => emit(json!({
                    "event": "child", "child": i, "outcome": "failed_blocks_held", "reason": reason.to_string(), "advice": advice_name(reason.advice()),
                    "error_kind": error_kind(reason),
                    "held_local_blocks": held_local_blocks,
                })),
            }
        }
        emit(
            json!({"event": "pull_done", "parent": parent, "elapsed_ms": report.elapsed.as_millis() as u64}),
        );
    }
    slot.stop(DecodeAgent::shutdown, None);
    Ok(())
}

fn main() -> std::process::ExitCode {
    kvxfer::ucx_log_to_stderr();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: escape codes in a log file are noise.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    let cli = Cli::parse();
    let r = Signals::install().and_then(|signals| match &cli.role {
        Role::Prefill { common, ttl_ms, listen } => {
            prefill(common, Duration::from_millis(*ttl_ms), listen, signals)
        }
        Role::Decode { common } => decode(common, signals),
    });
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvxfer-node: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A registration's or directory's connection to etcd.
#[cfg(feature = "cluster")]
fn etcd_status(s: &kvxfer::cluster::EtcdStatus) -> Value {
    json!({
        "state": s.state.as_str(), "endpoint": s.endpoint.as_deref(), "failures": s.failures,
        "recoveries": s.recoveries, "last_error": s.last_error.as_deref(),
        "since_ms": s.since.elapsed().as_millis() as u64,
    })
}

/// A directory change as a JSON line.
#[cfg(feature = "cluster")]
fn directory_event(e: &kvxfer::cluster::DirectoryEvent) -> Value {
    use kvxfer::cluster::DirectoryEvent;
    let (kind, entry, old) = match e {
        DirectoryEvent::Added(n) => ("added", n, None),
        DirectoryEvent::Updated { old, new } => ("updated", new, Some(old)),
        DirectoryEvent::Removed(o) => ("removed", o, None),
    };
    json!({
        "event": "directory", "kind": kind, "engine": entry.key.engine_id.as_str(), "rank": entry.key.rank,
        "addr": entry.record.addr.to_string(), "incarnation": Incarnation(entry.record.incarnation).to_string(),
        "old_incarnation": old.map(|o| Incarnation(o.record.incarnation).to_string()),
        "transports": entry.record.transports.iter().map(|t| t.as_str()).collect::<Vec<_>>(),
    })
}

/// The name of the `PullError` variant at the root of `e` (a sibling's failure: its cause),
/// `EngineNotRegistered`: `PullError::kind` (`engine_not_registered`) in upper camel case.
fn error_kind(e: &kvxfer::PullError) -> String {
    e.root_cause()
        .kind()
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map(|c| c.to_ascii_uppercase().to_string() + chars.as_str()).unwrap_or_default()
        })
        .collect()
}
