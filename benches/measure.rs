//! One block size measured: leases, pulls by every decode agent, per-child latencies,
//! bandwidth, CPU time, and the final contents of every destination block checked (what
//! the last iteration pulled; earlier iterations wrote the same blocks and are not checked).

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Instant;

use kvxfer::blocking::DecodeAgent;
use kvxfer::{BlockId, ChildOutcome, KvMemory, PrefillResult, PullReport};
use kvxfer_mem::pattern;
use serde_json::Value;

use crate::baselines::percentile;
use crate::cli::RunArgs;
use crate::source::{LeaseSource, ProcessCounters};

/// Blocks per child so that every parent's children together move `total` bytes (a block
/// is one `block`-byte piece in each of the cache's regions).
pub(crate) fn blocks_per_child(run: &RunArgs, block: u64) -> Result<u32, String> {
    let children = u64::from(run.n.max(1)) * u64::from(run.parents.max(1));
    let b = run.total_bytes / (block * u64::from(run.segments())) / children;
    u32::try_from(b).ok().filter(|&b| b > 0).ok_or_else(|| {
        format!(
            "--total-bytes {} is too small for {children} children of {block}-byte blocks",
            run.total_bytes
        )
    })
}

/// Runs moving less than this per iteration are latency runs: their raw TCP bandwidth runs
/// are taken after the iterations, not between them (the raw round trips stay interleaved).
const LATENCY_RUN_BYTES: u64 = 4 << 20;

/// What one block size measured.
pub(crate) struct Measured {
    pub(crate) bytes: u64,
    pub(crate) gib_per_s: f64,
    pub(crate) blocks_per_s: f64,
    /// The 10th percentile: with the raw round trip's p10, the floors to compare on a
    /// loaded machine.
    pub(crate) p10_us: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) max_us: f64,
    /// CPU seconds per GiB of this process (the decode agents; in a one-process run the
    /// prefill agent too).
    pub(crate) cpu_s_per_gib: f64,
    /// The `serve` process's (the prefill agent's) CPU seconds per GiB, two-process runs.
    pub(crate) prefill_cpu_s_per_gib: Option<f64>,
    /// Context switches of this process, and of `serve`, per parent handed off.
    pub(crate) switches_per_parent: f64,
    pub(crate) prefill_switches_per_parent: Option<f64>,
    pub(crate) verified: Option<bool>,
    pub(crate) prefill: Value,
    /// Submit → report (the hand-off as the decode engine sees it, without the lease
    /// request): p10, p50, p99 in µs.
    pub(crate) submit_us: [f64; 3],
    /// `--baseline`: per measured hand-off, its submit → report time over the raw round trip
    /// sampled right after its iteration; p10, p50, p90 of those paired ratios.
    pub(crate) paired_ratio: Option<[f64; 3]>,
    /// `--baseline`: raw TCP one-block round trips (us), taken between the iterations.
    pub(crate) raw_rtt_us: Vec<f64>,
    /// kvxfer's GiB/s in each measured iteration.
    pub(crate) iter_gib_per_s: Vec<f64>,
    /// `--baseline`: raw TCP GiB/s right after each measured iteration (same bytes).
    pub(crate) raw_tcp_runs: Vec<f64>,
    /// `--baseline`: the CPU seconds per GiB of each of those runs: its sending end (the
    /// prefill side's) and its receiving end (the decode side's).
    pub(crate) raw_tcp_cpu_runs: Vec<[f64; 2]>,
    /// This machine's busy CPU seconds per GiB over kvxfer's measured iterations (every
    /// process and kernel thread: see [`crate::procstat::machine_busy_seconds`]); `None`
    /// where `/proc/stat` is unreadable.
    pub(crate) machine_cpu_s_per_gib: Option<f64>,
    /// `--baseline`: the same over each raw TCP run.
    pub(crate) raw_tcp_machine_cpu_runs: Vec<f64>,
    /// The raw runs' windows, summed: their machine-wide median is reported only when this
    /// is long enough for `/proc/stat`'s ticks.
    pub(crate) raw_tcp_window_secs: f64,
}

impl Measured {
    /// CPU seconds per GiB of both agents (both processes in a two-process run).
    pub(crate) fn cpu_s_per_gib_both(&self) -> f64 {
        self.cpu_s_per_gib + self.prefill_cpu_s_per_gib.unwrap_or(0.0)
    }
}

/// Measures one block size: `warmup + iters` iterations of every parent leased and
/// pulled by every decode agent, then every destination block checked against the pattern
/// (unless `--no-verify`): every byte of the last iteration's pulls.
pub(crate) fn run_block_size(
    run: &RunArgs,
    source: &mut dyn LeaseSource,
    block: u64,
) -> Result<Measured, String> {
    let bpc = blocks_per_child(run, block)?;
    let n = run.n.max(1);
    let parents = run.parents.max(1);
    let blocks = bpc * n * parents;
    source.setup(block, blocks, run.segments())?;
    let layout = crate::source::bench_layout(blocks, block, run.segments())?;
    let consumers = run.expected_consumers.max(1);
    let decoders = (0..consumers)
        .map(|i| {
            let c = crate::cli::decode_config(run, format!("bench-decode-{i}"))?;
            Decoder::start(run, c, KvMemory::alloc(layout.clone()).map_err(|e| e.to_string())?)
        })
        .collect::<Result<Vec<_>, String>>()?;
    let ids = |p: u32, c: u32| -> Vec<BlockId> {
        let first = (p * n + c) * bpc;
        (first..first + bpc).collect()
    };
    let (mut latencies, mut submit_latencies) = (Vec::new(), Vec::new());
    // Per measured iteration: (first index in `submit_latencies`, count).
    let mut iter_spans: Vec<(usize, usize)> = Vec::new();
    let (mut seconds, mut bytes) = (0.0f64, 0u64);
    // What this process and the prefill's (when it is `serve`) spent in measured iterations.
    let (mut spent, mut prefill_spent) = (ProcessCounters::default(), Some(ProcessCounters::default()));
    let show_progress = std::io::stderr().is_terminal() && !run.json && !run.csv;
    // Raw round trips interleaved with the iterations: ~200 in all, at least one per iteration;
    // to a responder on the prefill side (the `serve` process in a two-process run).
    let mut raw_rtt = if run.baseline { Some(source.raw_rtt(block)?) } else { None };
    let rtt_per_iter = (200 / run.iters.max(1)).max(1) as usize;
    // Iterations this small measure hand-off latency more than bandwidth.
    let latency_run = run.total_bytes < LATENCY_RUN_BYTES;
    let mut latency_iter_bytes = Vec::new();
    let mut raw_rtt_us = Vec::new();
    let (mut iter_gib_per_s, mut raw) = (Vec::new(), RawRuns::default());
    let mut machine_spent = Some(0.0f64);
    // One child's bytes: what kvxfer's read of a child spans, and the raw run's read size.
    let read_span = u64::from(bpc) * block * u64::from(run.segments());
    for iter in 0..run.warmup + run.iters {
        let measured = iter >= run.warmup;
        if show_progress {
            eprint!("\r{block:>9} B blocks: iteration {}/{}   ", iter + 1, run.warmup + run.iters);
        }
        let prefill0 = source.prefill_process();
        let local0 = ProcessCounters::now();
        let bytes_before = bytes;
        let t0 = Instant::now();
        let mut handles = Vec::new();
        for p in 0..parents {
            let lease_start = Instant::now();
            let result = source.lease(
                &format!("bench-{block}-{iter}-{p}"),
                (0..n).map(|c| ids(p, c)).collect(),
                consumers,
                None,
            )?;
            for d in &decoders {
                handles.push((lease_start, d.submit(result.clone(), (0..n).map(|c| ids(p, c)).collect())?));
            }
        }
        let span_start = submit_latencies.len();
        for (lease_start, h) in handles {
            let (submitted, report, arrived) = h.wait()?;
            for (c, at) in report.children.iter().zip(arrived) {
                if !matches!(c.outcome, ChildOutcome::Done { .. }) {
                    return Err(format!(
                        "child {} of {}: {:?}",
                        c.child_index, report.parent_request_id, c.outcome
                    ));
                }
                if measured {
                    // Lease → the child's end in the agent (its own stamp: these parents are
                    // waited for in turn, so when this thread takes a report says little);
                    // submit → the report reaching this thread, as a decode engine sees it.
                    debug_assert!(
                        c.completed_at >= lease_start,
                        "a child ended before its lease was asked for"
                    );
                    latencies.push(c.completed_at.saturating_duration_since(lease_start).as_secs_f64() * 1e6);
                    submit_latencies.push(at.duration_since(submitted).as_secs_f64() * 1e6);
                }
            }
            if measured {
                bytes += report.delivered_bytes;
            }
        }
        if measured {
            iter_spans.push((span_start, submit_latencies.len() - span_start));
            let (secs, iter_bytes) = (t0.elapsed().as_secs_f64(), bytes - bytes_before);
            seconds += secs;
            let local = ProcessCounters::now().since(local0);
            machine_spent = machine_spent.zip(local.machine_busy_seconds).map(|(total, m)| total + m);
            spent.cpu_seconds += local.cpu_seconds;
            spent.context_switches += local.context_switches;
            prefill_spent = match (prefill_spent, source.prefill_process().zip(prefill0)) {
                (Some(total), Some((after, before))) => {
                    let p = after.since(before);
                    Some(ProcessCounters {
                        cpu_seconds: total.cpu_seconds + p.cpu_seconds,
                        context_switches: total.context_switches + p.context_switches,
                        machine_busy_seconds: None,
                    })
                }
                _ => None,
            };
            iter_gib_per_s.push(iter_bytes as f64 / f64::from(1u32 << 30) / secs.max(1e-9));
            if let Some(r) = raw_rtt.as_mut() {
                raw_rtt_us.extend(r.sample(rtt_per_iter)?);
                // The bandwidth ceiling interleaved too, so each iteration has its own —
                // except in a latency run, see below.
                if !latency_run {
                    raw.run(source, iter_bytes, run.connections, read_span)?;
                } else {
                    latency_iter_bytes.push(iter_bytes);
                }
            }
        }
    }
    // A latency run's bandwidth ceilings, one per measured iteration, after all of them: a
    // raw run between two hand-offs (threads started, connections made) delayed the next
    // hand-off about 4x (p50 ~200 µs against ~50 µs without, one process, load 10).
    for iter_bytes in latency_iter_bytes {
        raw.run(source, iter_bytes, run.connections, read_span)?;
    }
    if show_progress {
        eprintln!();
    }
    let verified = if run.no_verify {
        None
    } else {
        let mut ok = true;
        for d in &decoders {
            for p in 0..parents {
                for c in 0..n {
                    let b = ids(p, c);
                    // SAFETY: every pull into these blocks has reported.
                    ok &= unsafe { pattern::check_blocks(d.memory(), &b, &b) }
                        .map_err(|e| e.to_string())?
                        .is_none();
                }
            }
        }
        Some(ok)
    };
    // Each hand-off against the raw round trips taken right after its iteration (the same
    // moment's machine), before the samples are sorted.
    let paired_ratio = (!raw_rtt_us.is_empty()).then(|| {
        let mut ratios = Vec::with_capacity(submit_latencies.len());
        for (k, &(first, count)) in iter_spans.iter().enumerate() {
            let Some(raw) = raw_rtt_us.get(k * rtt_per_iter..(k + 1) * rtt_per_iter) else { continue };
            let mut raw = raw.to_vec();
            raw.sort_by(f64::total_cmp);
            let r = percentile(&raw, 0.5);
            ratios.extend(submit_latencies[first..first + count].iter().map(|l| l / r));
        }
        ratios.sort_by(f64::total_cmp);
        [percentile(&ratios, 0.1), percentile(&ratios, 0.5), percentile(&ratios, 0.9)]
    });
    latencies.sort_by(f64::total_cmp);
    submit_latencies.sort_by(f64::total_cmp);
    let gib = bytes as f64 / f64::from(1u32 << 30);
    // Parents handed off in the measured iterations (each to every decode agent).
    let handed_off = f64::from(parents) * f64::from(run.iters.max(1));
    Ok(Measured {
        bytes: bytes / u64::from(run.iters.max(1)),
        gib_per_s: gib / seconds.max(1e-9),
        blocks_per_s: (bytes / block) as f64 / seconds.max(1e-9),
        p10_us: percentile(&latencies, 0.1),
        p50_us: percentile(&latencies, 0.5),
        p99_us: percentile(&latencies, 0.99),
        max_us: latencies.last().copied().unwrap_or(0.0),
        submit_us: [0.1, 0.5, 0.99].map(|p| percentile(&submit_latencies, p)),
        paired_ratio,
        cpu_s_per_gib: spent.cpu_seconds / gib.max(1e-12),
        prefill_cpu_s_per_gib: prefill_spent.map(|p| p.cpu_seconds / gib.max(1e-12)),
        switches_per_parent: spent.context_switches as f64 / handed_off.max(1.0),
        prefill_switches_per_parent: prefill_spent.map(|p| p.context_switches as f64 / handed_off.max(1.0)),
        verified,
        prefill: source.stats(),
        raw_rtt_us,
        iter_gib_per_s,
        raw_tcp_runs: raw.rates,
        raw_tcp_cpu_runs: raw.cpu,
        // Too short a window for /proc/stat's 10 ms ticks gives none.
        machine_cpu_s_per_gib: machine_spent
            .filter(|_| seconds >= crate::baselines::MIN_MACHINE_WINDOW_SECS)
            .map(|s| s / gib.max(1e-12)),
        raw_tcp_machine_cpu_runs: raw.machine,
        raw_tcp_window_secs: raw.window_secs,
    })
}

/// The raw TCP runs of a block size: GiB/s, CPU per GiB (sending end, receiving end), and
/// the machine's busy CPU per GiB, each run; and their windows summed.
#[derive(Default)]
struct RawRuns {
    rates: Vec<f64>,
    cpu: Vec<[f64; 2]>,
    machine: Vec<f64>,
    window_secs: f64,
}

impl RawRuns {
    /// One raw TCP run of `bytes` (read `read_span` at a time), added to the others.
    fn run(
        &mut self,
        source: &mut dyn LeaseSource,
        bytes: u64,
        connections: usize,
        read_span: u64,
    ) -> Result<(), String> {
        let r = source.raw_tcp_run(bytes, connections, read_span)?;
        if let Some(busy) = r.machine_cpu_seconds {
            self.machine.push(busy / (bytes as f64 / f64::from(1u32 << 30)).max(1e-12));
        }
        self.rates.push(r.gib_per_s);
        self.cpu.push(r.cpu_s_per_gib(bytes));
        self.window_secs += r.window_secs;
        Ok(())
    }
}

/// A decode agent as the bench drives it: the blocking facade (the caller's thread submits
/// and waits), or with `--async-submit` the async agent on a runtime of the bench's own,
/// each pull submitted and awaited by a task on that runtime (as an engine on tokio would);
/// with `--current-thread` that runtime is a current-thread one, driven by the bench's
/// thread while it waits (the pull, its I/O and its reports all on that one thread).
pub(crate) enum Decoder {
    Blocking(DecodeAgent),
    Async { agent: Arc<kvxfer::DecodeAgent>, runtime: tokio::runtime::Runtime },
}

/// A submitted pull: waited for on the caller's thread, or the task that submitted it.
enum Submitted<'a> {
    Blocking(Instant, kvxfer::blocking::PullHandle),
    /// Waited for with `Runtime::block_on`, which also drives a current-thread runtime.
    Async(&'a tokio::runtime::Runtime, tokio::task::JoinHandle<Result<Timed, String>>),
}

/// When a pull was submitted, its report, and when each child's report arrived.
type Timed = (Instant, PullReport, Vec<Instant>);

impl Decoder {
    /// Starts the decode agent `run` asks for: the blocking facade, or with
    /// `--async-submit` the async agent on a runtime of the bench's own.
    pub(crate) fn start(
        run: &RunArgs,
        config: kvxfer::AgentConfig,
        memory: KvMemory,
    ) -> Result<Self, String> {
        if !run.async_submit {
            return DecodeAgent::start(config, memory).map(Decoder::Blocking).map_err(|e| e.to_string());
        }
        let runtime = if run.current_thread {
            tokio::runtime::Builder::new_current_thread().enable_all().build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(run.worker_threads.max(1))
                .thread_name("bench-decode")
                .enable_all()
                .build()
        }
        .map_err(|e| e.to_string())?;
        let agent =
            runtime.block_on(kvxfer::DecodeAgent::start(config, memory)).map_err(|e| e.to_string())?;
        Ok(Decoder::Async { agent: Arc::new(agent), runtime })
    }

    /// The agent's KV-cache memory.
    pub(crate) fn memory(&self) -> &Arc<KvMemory> {
        match self {
            Decoder::Blocking(d) => d.memory(),
            Decoder::Async { agent, .. } => agent.memory(),
        }
    }

    /// The async agent (the blocking facade's own, or the one on the bench's runtime).
    pub(crate) fn agent(&self) -> &kvxfer::DecodeAgent {
        match self {
            Decoder::Blocking(d) => d.as_async(),
            Decoder::Async { agent, .. } => agent,
        }
    }

    /// The bench's runtime with `--async-submit`: whoever waits for pulls waits on it
    /// (`block_on`, which also drives a current-thread runtime).
    pub(crate) fn runtime(&self) -> Option<&tokio::runtime::Runtime> {
        match self {
            Decoder::Blocking(_) => None,
            Decoder::Async { runtime, .. } => Some(runtime),
        }
    }

    fn submit(&self, result: PrefillResult, blocks: Vec<Vec<BlockId>>) -> Result<Submitted<'_>, String> {
        match self {
            Decoder::Blocking(d) => {
                let at = Instant::now();
                let h = d.submit(result, blocks).map_err(|e| e.to_string())?;
                Ok(Submitted::Blocking(at, h))
            }
            Decoder::Async { agent, runtime } => {
                let agent = agent.clone();
                let pull = async move {
                    let at = Instant::now();
                    let h = agent.submit(result, blocks).map_err(|e| e.to_string())?;
                    let (report, arrived) = h.finished_timed().await;
                    Ok((at, report, arrived))
                };
                Ok(Submitted::Async(runtime, runtime.spawn(pull)))
            }
        }
    }
}

impl Submitted<'_> {
    fn wait(self) -> Result<Timed, String> {
        match self {
            Submitted::Blocking(at, h) => {
                let (report, arrived) = h.wait_timed();
                Ok((at, report, arrived))
            }
            Submitted::Async(runtime, task) => runtime.block_on(task).map_err(|e| e.to_string())?,
        }
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        if let Decoder::Async { agent, runtime } = self {
            runtime.block_on(agent.shutdown());
        }
    }
}
