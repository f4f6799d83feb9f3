//! The command line: one-process runs, and the `serve` / `pull` halves of a two-process
//! run; and the agent configuration the options and the environment make.

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvxfer::{AgentConfig, TransportChoice};

#[derive(Parser, Debug)]
#[command(name = "kvxfer-bench", about = "kvxfer transfer benchmark (like nixlbench), with its ceilings")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) mode: Option<Mode>,
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

#[derive(Subcommand, Debug)]
// Parsed once per process: the size of `Pull`'s options does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Mode {
    /// The prefill side of a two-process run: leases on request and serves the blocks.
    Serve(ServeArgs),
    /// The decode side of a two-process run: drives `serve` and pulls.
    Pull {
        /// The control address of a `kvxfer-bench serve`.
        #[arg(long)]
        peer: String,
        #[command(flatten)]
        run: Box<RunArgs>,
    },
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ServeArgs {
    /// Control address to listen on (the agent itself takes a free port per block size).
    #[arg(long, default_value = "127.0.0.1:7300")]
    pub(crate) listen: String,
    /// Data path offered: auto, tcp or ucx.
    #[arg(long, default_value = "auto")]
    pub(crate) transport: TransportChoice,
    /// UCX transports (UCX_TLS).
    #[arg(long)]
    pub(crate) ucx_tls: Option<String>,
    /// UCX peer-failure handling (UCX 1.13 then avoids shared memory).
    #[arg(long)]
    pub(crate) ucx_peer_failure: bool,
    /// Where the prefill KV cache lives: heap (host memory UCX only registers, like vLLM's
    /// tensors) or ucx (memory UCX allocated, `kvxfer::ucx_region`). Default: ucx for
    /// `--transport ucx`, heap otherwise.
    #[arg(long, value_enum)]
    pub(crate) memory: Option<Memory>,
    /// Serve this many runs, then exit (0: until told to quit).
    #[arg(long, default_value_t = 0)]
    pub(crate) runs: u32,
    /// Runtime threads of the prefill agent (`AgentConfig::worker_threads`).
    #[arg(long, default_value_t = 2)]
    pub(crate) worker_threads: usize,
    /// CRC-32Cs of leased blocks computed at lease time (`AgentConfig::precompute_crcs`).
    #[arg(long)]
    pub(crate) precompute_crcs: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct RunArgs {
    /// Data path: tcp, ucx or auto.
    #[arg(long, default_value = "tcp")]
    pub(crate) transport: TransportChoice,
    /// UCX transports (UCX_TLS), e.g. "posix,sysv,cma,self" or "tcp".
    #[arg(long)]
    pub(crate) ucx_tls: Option<String>,
    /// UCX peer-failure handling (UCX 1.13 then avoids shared memory).
    #[arg(long)]
    pub(crate) ucx_peer_failure: bool,
    /// Where the prefill KV cache lives (see `serve --memory`). In a two-process run
    /// bench-two-process.sh passes it to `serve`, and a `pull` checks that `serve` used it
    /// (bulk runs; the many-requests and mixed-layout modes do not check it, and the mixed-layout
    /// mode ignores it).
    #[arg(long, value_enum)]
    pub(crate) memory: Option<Memory>,
    /// Check every one-sided (UCX) read against a CRC-32C taken at pin time.
    #[arg(long)]
    pub(crate) ucx_verify_payloads: bool,
    /// TCP: send each lone child's notify behind its read (one round trip per hand-off;
    /// `AgentConfig::notify_with_read`).
    #[arg(long)]
    pub(crate) notify_with_read: bool,
    /// A vLLM-shaped KV cache: one registered region per layer (and per K/V with
    /// --kv-split), each block one piece of --block-bytes in every region, so a child of B
    /// blocks is B x layers (x 2) pieces; 0: one region, one piece per block.
    #[arg(long, default_value_t = 0)]
    pub(crate) layers: u32,
    /// With --layers: separate K and V regions per layer (vLLM's FlashAttention caches).
    #[arg(long, requires = "layers")]
    pub(crate) kv_split: bool,
    /// Drive the async `DecodeAgent` on a runtime of the bench's own, not the blocking
    /// facade: in the bulk and latency runs each pull is submitted and awaited by a task on
    /// it (as an engine on tokio would); in the many-requests runs the bench's thread
    /// submits and waits with `block_on` on it.
    #[arg(long)]
    pub(crate) async_submit: bool,
    /// With --async-submit: a current-thread runtime, driven by the bench's thread while it
    /// waits for pulls (no thread hand-offs on the decode side at all).
    #[arg(long, requires = "async_submit")]
    pub(crate) current_thread: bool,
    /// Block sizes to sweep, e.g. 4K,64K,256K,2M.
    #[arg(long, value_delimiter = ',', default_value = "64K,2M", value_parser = parse_size)]
    pub(crate) block_bytes: Vec<u64>,
    /// Bytes moved per iteration (all parents and children together).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    pub(crate) total_bytes: u64,
    /// Children per parent (parallel sampling n).
    #[arg(long, default_value_t = 8)]
    pub(crate) n: u32,
    /// Parents per iteration.
    #[arg(long, default_value_t = 1)]
    pub(crate) parents: u32,
    /// Measured iterations per block size.
    #[arg(long, default_value_t = 3)]
    pub(crate) iters: u32,
    /// Unmeasured iterations first.
    #[arg(long, default_value_t = 1)]
    pub(crate) warmup: u32,
    /// Data connections per peer.
    #[arg(long, default_value_t = 2)]
    pub(crate) connections: usize,
    /// Runtime threads of each agent.
    #[arg(long, default_value_t = 2)]
    pub(crate) worker_threads: usize,
    /// The prefill agent computes CRC-32Cs of leased blocks at lease time
    /// (`AgentConfig::precompute_crcs`); in a two-process run, bench-two-process.sh passes
    /// it to `serve` (a `pull` ignores it).
    #[arg(long)]
    pub(crate) precompute_crcs: bool,
    /// Tensor-parallel size of the prefill engine: with --decode-tp or --block-ratio, a
    /// heterogeneous run (head-slice pulls, one process) measured beside the whole-block path.
    #[arg(long, default_value_t = 1)]
    pub(crate) prefill_tp: u32,
    /// Tensor-parallel size of the decode engine (see --prefill-tp).
    #[arg(long, default_value_t = 1)]
    pub(crate) decode_tp: u32,
    /// Decode block tokens / prefill block tokens (see --prefill-tp).
    #[arg(long, default_value_t = 1)]
    pub(crate) block_ratio: u32,
    /// Decode agents that each pull every child (heterogeneous TP); one process only.
    #[arg(long, default_value_t = 1)]
    pub(crate) expected_consumers: u32,
    /// Also measure a raw TCP copy and a memcpy of the same bytes, and print the ratios
    /// (wall-clock and counted CPU); with --concurrency/--rate, one raw TCP run after each
    /// level, for the kernel's CPU share of the same bytes per request.
    #[arg(long)]
    pub(crate) baseline: bool,
    /// Skip the final check of every destination block (the last pull into each).
    #[arg(long)]
    pub(crate) no_verify: bool,
    /// One JSON object per block size.
    #[arg(long)]
    pub(crate) json: bool,
    /// CSV, one row per block size.
    #[arg(long)]
    pub(crate) csv: bool,
    /// Draw GiB/s against block size (kvxfer and baselines) into this SVG file.
    #[arg(long)]
    pub(crate) plot: Option<String>,
    /// Both agents feed a Prometheus registry served at this address (`GET /metrics`), to
    /// measure what metrics cost; needs the `cluster` feature.
    #[arg(long)]
    pub(crate) metrics: Option<String>,
    /// Cost-growth sweep: one run per value, each as `--n` (e.g. 1,2,8,32,128).
    #[arg(long, value_delimiter = ',')]
    pub(crate) sweep_n: Vec<u32>,
    /// Cost-growth sweep: one run per value (and per --sweep-n value) with this many blocks
    /// per child: `--blocks-per-child` in the many-requests mode; in the bulk mode, one run
    /// per block size with `--total-bytes` = n × parents × this × the block size. Without
    /// it, a bulk `--sweep-n` keeps `--total-bytes` (fewer blocks per child as n grows).
    #[arg(long, value_delimiter = ',')]
    pub(crate) sweep_blocks_per_child: Vec<u32>,
    /// The many-requests workload (`--concurrency`).
    #[command(flatten)]
    pub(crate) workload: WorkloadArgs,
}

impl RunArgs {
    /// Regions of the KV cache (pieces per block): `--layers` (x 2 with `--kv-split`), or 1.
    pub(crate) fn segments(&self) -> u32 {
        if self.layers == 0 {
            1
        } else {
            self.layers.saturating_mul(if self.kv_split { 2 } else { 1 })
        }
    }

    /// The runs of the cost-growth sweep (`--sweep-n`, `--sweep-blocks-per-child`), every n
    /// with every blocks-per-child value; just this run without them.
    pub(crate) fn sweep(&self) -> Result<Vec<RunArgs>, String> {
        if self.sweep_n.is_empty() && self.sweep_blocks_per_child.is_empty() {
            return Ok(vec![self.clone()]);
        }
        let ns = if self.sweep_n.is_empty() { vec![self.n] } else { self.sweep_n.clone() };
        let mut runs = Vec::new();
        for &n in &ns {
            let mut with_n = self.clone();
            (with_n.n, with_n.sweep_n, with_n.sweep_blocks_per_child) = (n, Vec::new(), Vec::new());
            if self.sweep_blocks_per_child.is_empty() {
                runs.push(with_n);
                continue;
            }
            for &bpc in &self.sweep_blocks_per_child {
                let mut r = with_n.clone();
                r.workload.blocks_per_child = bpc;
                if r.workload.any() {
                    runs.push(r);
                    continue;
                }
                for &block in &self.block_bytes {
                    let total = [u64::from(n.max(1)), u64::from(self.parents.max(1)), u64::from(bpc.max(1))]
                        .into_iter()
                        .try_fold(block, u64::checked_mul)
                        .ok_or_else(|| format!("n = {n} x {bpc} blocks of {block} bytes overflows"))?;
                    let mut b = r.clone();
                    (b.block_bytes, b.total_bytes) = (vec![block], total);
                    runs.push(b);
                }
            }
        }
        Ok(runs)
    }
}

/// Where the prefill KV cache lives (`--memory`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Page-aligned host memory the process allocated, which UCX only registers
    /// (`ucp_mem_map` of existing memory): what an engine's own tensors are.
    Heap,
    /// Memory UCX allocated (`kvxfer::ucx_region`), in shared memory UCX 1.13 serves
    /// one-sided.
    Ucx,
}

impl Memory {
    /// The memory a run uses: the one asked for, else memory UCX allocated for `--transport
    /// ucx` (built with the `ucx` feature) and the heap otherwise (also under `auto`, so a
    /// TCP run serves from the memory its raw TCP baseline sends from, and `auto` never
    /// fails for want of UCX memory).
    pub(crate) fn resolve(asked: Option<Memory>, transport: TransportChoice) -> Result<Memory, String> {
        match asked {
            Some(Memory::Ucx) if !cfg!(feature = "ucx") => {
                Err("--memory ucx needs kvxfer-bench built with the `ucx` feature".into())
            }
            Some(m) => Ok(m),
            None if cfg!(feature = "ucx") && matches!(transport, TransportChoice::Ucx) => Ok(Memory::Ucx),
            None => Ok(Memory::Heap),
        }
    }

    /// Its name in the JSON (`prefill.memory`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Memory::Heap => "heap",
            Memory::Ucx => "ucx_region",
        }
    }
}

/// How open-loop arrivals are spaced.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrivals {
    /// Exactly 1/R apart.
    Fixed,
    /// Exponentially distributed gaps of mean 1/R (seeded by `--seed`).
    Poisson,
}

/// Options of the many-requests workload.
#[derive(Args, Debug, Clone)]
pub(crate) struct WorkloadArgs {
    /// Many-requests mode, closed loop: keep this many parents in flight (a list, e.g.
    /// 1,16,256,1024), a new one started as soon as one finishes; replaces the bulk
    /// iterations.
    #[arg(long, value_delimiter = ',')]
    pub(crate) concurrency: Vec<u32>,
    /// Many-requests mode, open loop: parents arriving per second (a list, e.g. 500,2000),
    /// whatever the system does; latency counts from each parent's scheduled arrival.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate)]
    pub(crate) rate: Vec<f64>,
    /// Open loop: spacing of the arrivals.
    #[arg(long, value_enum, default_value_t = Arrivals::Fixed)]
    pub(crate) arrivals: Arrivals,
    /// Open loop: parents in flight at most (the decode blocks held); an arrival that finds
    /// it reached waits (never dropped) and is counted in `cap_waits`.
    #[arg(long, default_value_t = 256)]
    pub(crate) max_in_flight: u32,
    /// Seed of the Poisson arrivals.
    #[arg(long, default_value_t = 15)]
    pub(crate) seed: u64,
    /// Parents leased per control round trip, ahead of need (1: one lease per parent, taken
    /// when its turn comes, as before). The open loop leases at most rate × ttl / 4 parents
    /// per batch, so no lease waits in the pool for longer than about half its ttl.
    #[arg(long, default_value_t = 64)]
    pub(crate) lease_batch: u32,
    /// Seconds each bench lease lives unless pulled (the ttl asked of the prefill agent;
    /// 30 is the agent's default). Leases taken ahead of need are not heartbeated.
    #[arg(long, default_value_t = 30.0, value_parser = parse_ttl)]
    pub(crate) lease_ttl: f64,
    /// Measured seconds per level (many-requests mode).
    #[arg(long, default_value_t = 5.0, value_parser = parse_secs)]
    pub(crate) duration: f64,
    /// Unmeasured seconds before them (many-requests mode).
    #[arg(long, default_value_t = 1.0, value_parser = parse_secs)]
    pub(crate) warmup_secs: f64,
    /// Blocks per child (many-requests mode; the bulk mode derives it from --total-bytes).
    #[arg(long, default_value_t = 2)]
    pub(crate) blocks_per_child: u32,
}

/// Open-loop arrival rates the loop can keep: at least one arrival in 10^6 s, and gaps of at
/// least a nanosecond (smaller ones round to zero, and the schedule would never advance).
const RATE_RANGE: std::ops::RangeInclusive<f64> = 1e-6..=1e9;

/// `--rate`: parents per second, finite and in [`RATE_RANGE`] (`inf`, 0 and negative rates
/// are refused rather than turned into something else).
fn parse_rate(s: &str) -> Result<f64, String> {
    let rate: f64 =
        s.trim().parse().map_err(|_| format!("not a rate: {s:?} (parents per second, e.g. 500)"))?;
    if !RATE_RANGE.contains(&rate) {
        return Err(format!(
            "rate {s} is not a finite number of parents per second from {:e} to {:e}",
            RATE_RANGE.start(),
            RATE_RANGE.end()
        ));
    }
    Ok(rate)
}

/// Seconds: finite and not negative.
fn parse_secs(s: &str) -> Result<f64, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("not a number of seconds: {s:?}"))?;
    if !(0.0..1e9).contains(&secs) {
        return Err(format!("{s} is not a finite, non-negative number of seconds"));
    }
    Ok(secs)
}

/// `--lease-ttl`: seconds, finite and at least a millisecond.
fn parse_ttl(s: &str) -> Result<f64, String> {
    let secs = parse_secs(s)?;
    if secs < 1e-3 {
        return Err(format!("a lease ttl of {s} s is shorter than a millisecond"));
    }
    Ok(secs)
}

impl WorkloadArgs {
    /// Whether a many-requests level was asked for.
    pub(crate) fn any(&self) -> bool {
        !self.concurrency.is_empty() || !self.rate.is_empty()
    }
}

pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let v: u64 = num.parse().map_err(|_| format!("not a size: {s:?} (e.g. 64K, 2M)"))?;
    v.checked_mul(mult).filter(|&b| b > 0).ok_or_else(|| format!("size out of range: {s}"))
}

/// `c` with the UCX options and the cluster key of the environment (`KVXFER_CLUSTER_KEY` or
/// `KVXFER_CLUSTER_KEY_FILE`; without one the agents run unauthenticated). Serve and pull
/// processes of a two-process run need the same key.
/// `c` feeding the process's metrics registry when `--metrics ADDR` was given: one registry
/// for every agent of the run, served at ADDR from a runtime of its own (started with the
/// first agent, kept until the process exits).
#[cfg(feature = "cluster")]
pub(crate) fn metrics_config(c: AgentConfig, metrics: &Option<String>) -> Result<AgentConfig, String> {
    use std::sync::{Arc, OnceLock};

    use kvxfer::cluster::{Metrics, MetricsServer};

    type Served = (Arc<Metrics>, tokio::runtime::Runtime, MetricsServer);
    static SERVED: OnceLock<Result<Served, String>> = OnceLock::new();
    let Some(addr) = metrics else { return Ok(c) };
    let served = SERVED.get_or_init(|| {
        // One worker thread of its own serves scrapes (the agents have their runtimes).
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bench-metrics")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let m = Arc::new(Metrics::new());
        let server = MetricsServer::start(rt.handle(), addr, m.clone()).map_err(|e| e.to_string())?;
        eprintln!("kvxfer-bench: metrics at http://{}/metrics", server.local_addr());
        Ok((m, rt, server))
    });
    match served {
        Ok((m, _, _)) => Ok(c.metrics(m.clone())),
        Err(e) => Err(format!("--metrics {addr}: {e}")),
    }
}

/// Without the `cluster` feature there are no metrics.
#[cfg(not(feature = "cluster"))]
pub(crate) fn metrics_config(c: AgentConfig, metrics: &Option<String>) -> Result<AgentConfig, String> {
    match metrics {
        None => Ok(c),
        Some(_) => Err("--metrics needs kvxfer-bench built with the `cluster` feature".into()),
    }
}

/// The configuration of a decode agent named `name` for `run` (transport, connections,
/// notify-with-read, threads, UCX options, payload verification, metrics).
pub(crate) fn decode_config(run: &RunArgs, name: String) -> Result<AgentConfig, String> {
    let c = ucx_config(
        AgentConfig::new(name)
            .transport(run.transport)
            .connections_per_peer(run.connections)
            .notify_with_read(run.notify_with_read)
            .worker_threads(run.worker_threads),
        &run.ucx_tls,
        run.ucx_peer_failure,
    )?
    .ucx_verify_payloads(run.ucx_verify_payloads)
    .map_err(|e| e.to_string())?;
    metrics_config(c, &run.metrics)
}

pub(crate) fn ucx_config(
    c: AgentConfig,
    tls: &Option<String>,
    peer_failure: bool,
) -> Result<AgentConfig, String> {
    c.ucx_options(tls.clone(), peer_failure)
        .and_then(AgentConfig::cluster_key_from_env)
        .map_err(|e| e.to_string())
}
