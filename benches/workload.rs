//! The many-requests workload (`--concurrency 1,16,256,1024`): C parents in flight at once,
//! each of `--n` children of `--blocks-per-child` blocks, a new parent leased and submitted
//! as soon as one finishes (closed loop), for `--duration` seconds after `--warmup-secs`.
//! Reported per block size and C: requests/s, GiB/s, per-child hand-off latency
//! (p50/p99/p999), CPU per request, peak RSS and open file descriptors.
//!
//! Memory: the decode agent owns C parents' worth of blocks (one slot per parent in
//! flight); the prefill side 2C parents' worth, handed out first-in first-out, so a decode
//! slot reads other remote blocks on each reuse and the final check (every slot against
//! the pattern of the blocks it last pulled) cannot pass on stale data.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use clap::Args;
use futures::stream::{FuturesUnordered, StreamExt};
use kvxfer::blocking::DecodeAgent;
use kvxfer::{BlockId, BlockLayout, ChildOutcome, KvMemory, PullReport};
use kvxfer_mem::pattern;
use serde_json::{json, Value};

use crate::cli::RunArgs;
use crate::measure::{cpu_seconds, percentile};
use crate::procstat::{open_fds, peak_rss_kib, reset_peak_rss, rss_kib};
use crate::report::human;
use crate::source::LeaseSource;

/// Options of the many-requests workload.
#[derive(Args, Debug, Clone)]
pub(crate) struct WorkloadArgs {
    /// Many-requests mode: keep this many parents in flight (a list, e.g. 1,16,256,1024),
    /// a new one arriving as soon as one finishes; replaces the bulk iterations.
    #[arg(long, value_delimiter = ',')]
    pub(crate) concurrency: Vec<u32>,
    /// Measured seconds per concurrency level (many-requests mode).
    #[arg(long, default_value_t = 5.0)]
    pub(crate) duration: f64,
    /// Unmeasured seconds before them (many-requests mode).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) warmup_secs: f64,
    /// Blocks per child (many-requests mode; the bulk mode derives it from --total-bytes).
    #[arg(long, default_value_t = 2)]
    pub(crate) blocks_per_child: u32,
}

/// What one (block size, concurrency) measured.
pub(crate) struct Loaded {
    pub(crate) block: u64,
    pub(crate) concurrency: u32,
    pub(crate) requests: u64,
    pub(crate) requests_per_s: f64,
    pub(crate) gib_per_s: f64,
    /// Per-child hand-off latency quantiles, us: p50, p99, p999, max.
    pub(crate) child_us: [f64; 4],
    /// Per-request latency (lease → last child's report) quantiles, us: p50, p99.
    pub(crate) request_us: [f64; 2],
    pub(crate) cpu_us_per_request: f64,
    /// Mean time of one lease call (in two processes, a control round trip to `serve`):
    /// the submitting thread's own cost, which bounds requests/s at C parents in flight.
    pub(crate) lease_call_us: f64,
    pub(crate) prefill_cpu_us_per_request: Option<f64>,
    pub(crate) rss_before_mib: f64,
    pub(crate) rss_peak_mib: f64,
    pub(crate) kv_mib: f64,
    pub(crate) fds_before: u64,
    pub(crate) fds_max: u64,
    pub(crate) verified: Option<bool>,
    pub(crate) prefill: Value,
}

type Finished = Pin<Box<dyn Future<Output = (usize, usize, Instant, (PullReport, Vec<Instant>))>>>;

/// The prefill process's CPU seconds as its stats report them.
fn prefill_cpu(source: &mut dyn LeaseSource) -> Option<f64> {
    source.stats().get("cpu_seconds").and_then(Value::as_f64)
}

/// Runs one (block size, concurrency) level.
pub(crate) fn run_level(
    run: &RunArgs,
    source: &mut dyn LeaseSource,
    block: u64,
    concurrency: u32,
    processes: &str,
) -> Result<Loaded, String> {
    let w = &run.workload;
    let (n, bpc) = (run.n.max(1), w.blocks_per_child.max(1));
    let c = concurrency.max(1) as usize;
    let per_parent = n * bpc;
    let slots = u32::try_from(c).map_err(|e| e.to_string())?;
    source.setup(block, 2 * slots * per_parent)?;
    let layout = BlockLayout::single(slots * per_parent, block).map_err(|e| e.to_string())?;
    let config = crate::cli::decode_config(run, "bench-decode-many".into())?;
    let decoder = DecodeAgent::start(config, KvMemory::alloc(layout).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    // Peak RSS and fds from here on: what the agent and the requests in flight hold.
    let peak_reset = reset_peak_rss();
    let (rss_before, fds_before) = (rss_kib(), open_fds());
    let ids = |slot: usize, child: u32| -> Vec<BlockId> {
        let first = slot as u32 * per_parent + child * bpc;
        (first..first + bpc).collect()
    };
    let mut free_local: Vec<usize> = (0..c).rev().collect();
    let mut free_remote: VecDeque<usize> = (0..2 * c).collect();
    let mut last_remote: Vec<Option<usize>> = vec![None; c];
    let mut in_flight: FuturesUnordered<Finished> = FuturesUnordered::new();

    let start = Instant::now();
    let warm = start + Duration::from_secs_f64(w.warmup_secs.max(0.0));
    let end = warm + Duration::from_secs_f64(w.duration.max(0.01));
    let (mut cpu0, mut pcpu0, mut cpu1, mut pcpu1) = (None, None, None, None);
    let (mut child_lat, mut req_lat) = (Vec::new(), Vec::new());
    let (mut requests, mut bytes) = (0u64, 0u64);
    let (mut fds_max, mut next_fd_sample) = (fds_before, start);
    let mut seq = 0u64;
    let mut lease_secs = 0.0f64;
    let show_progress = std::io::IsTerminal::is_terminal(&std::io::stderr()) && !run.json && !run.csv;
    loop {
        let now = Instant::now();
        if cpu0.is_none() && now >= warm {
            cpu0 = Some(cpu_seconds());
            pcpu0 = if processes == "2" { prefill_cpu(source) } else { None };
        }
        if cpu1.is_none() && now >= end {
            cpu1 = Some(cpu_seconds());
            pcpu1 = if processes == "2" { prefill_cpu(source) } else { None };
            if show_progress {
                eprintln!("\r{} B blocks, C = {concurrency}: draining   ", human(block));
            }
        }
        while now < end && in_flight.len() < c {
            let (Some(local), Some(remote)) = (free_local.pop(), free_remote.pop_front()) else { break };
            seq += 1;
            let lease_start = Instant::now();
            let result = source.lease(
                &format!("many-{block}-{concurrency}-{seq}"),
                (0..n).map(|k| ids(remote, k)).collect(),
                1,
            )?;
            lease_secs += lease_start.elapsed().as_secs_f64();
            let h = decoder
                .as_async()
                .submit(result, (0..n).map(|k| ids(local, k)).collect())
                .map_err(|e| e.to_string())?;
            in_flight.push(Box::pin(async move { (local, remote, lease_start, h.finished_timed().await) }));
        }
        let Some((local, remote, lease_start, (report, arrived))) =
            futures::executor::block_on(in_flight.next())
        else {
            break;
        };
        let done_at = Instant::now();
        for ch in &report.children {
            if !matches!(ch.outcome, ChildOutcome::Done { .. }) {
                return Err(format!(
                    "child {} of {}: {:?}",
                    ch.child_index, report.parent_request_id, ch.outcome
                ));
            }
        }
        if done_at >= warm && done_at < end {
            requests += 1;
            bytes += report.delivered_bytes;
            child_lat.extend(arrived.iter().map(|a| a.duration_since(lease_start).as_secs_f64() * 1e6));
            if let Some(last) = arrived.iter().max() {
                req_lat.push(last.duration_since(lease_start).as_secs_f64() * 1e6);
            }
        }
        last_remote[local] = Some(remote);
        free_local.push(local);
        free_remote.push_back(remote);
        if done_at >= next_fd_sample {
            fds_max = fds_max.max(open_fds());
            next_fd_sample = done_at + Duration::from_millis(20);
        }
    }
    let cpu = cpu1.zip(cpu0).map(|(b, a)| b - a).unwrap_or(0.0);
    let pcpu = pcpu1.zip(pcpu0).map(|(b, a)| b - a);
    let rss_peak = peak_rss_kib();
    let verified = if run.no_verify {
        None
    } else {
        let mut ok = true;
        for (local, remote) in last_remote.iter().enumerate() {
            let Some(remote) = *remote else { continue };
            for k in 0..n {
                // SAFETY: every pull has reported (the loop drained them all).
                ok &= unsafe { pattern::check_blocks(decoder.memory(), &ids(remote, k), &ids(local, k)) }
                    .map_err(|e| e.to_string())?
                    .is_none();
            }
        }
        Some(ok)
    };
    drop(decoder);
    child_lat.sort_by(f64::total_cmp);
    req_lat.sort_by(f64::total_cmp);
    let secs = w.duration.max(0.01);
    let per_req = |s: f64| s * 1e6 / (requests.max(1) as f64);
    Ok(Loaded {
        block,
        concurrency,
        requests,
        requests_per_s: requests as f64 / secs,
        gib_per_s: bytes as f64 / f64::from(1u32 << 30) / secs,
        child_us: [
            percentile(&child_lat, 0.5),
            percentile(&child_lat, 0.99),
            percentile(&child_lat, 0.999),
            child_lat.last().copied().unwrap_or(0.0),
        ],
        request_us: [percentile(&req_lat, 0.5), percentile(&req_lat, 0.99)],
        cpu_us_per_request: per_req(cpu),
        lease_call_us: lease_secs * 1e6 / (seq.max(1) as f64),
        prefill_cpu_us_per_request: pcpu.map(per_req),
        rss_before_mib: rss_before as f64 / 1024.0,
        rss_peak_mib: if peak_reset { rss_peak as f64 / 1024.0 } else { f64::NAN },
        kv_mib: (u64::from(slots * per_parent) * block) as f64 / f64::from(1u32 << 20),
        fds_before,
        fds_max,
        verified,
        prefill: source.stats(),
    })
}

/// Runs every (block size, concurrency) level of `run` and reports each; `Ok(false)` when
/// a check failed.
pub(crate) fn bench_many(
    run: &RunArgs,
    source: &mut dyn LeaseSource,
    processes: &str,
) -> Result<bool, String> {
    let transport = run.transport.to_string();
    let mut all_ok = true;
    let mut rows = Vec::new();
    if !run.json {
        println!(
            "{:>6} {:>5} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>6} {:>8}",
            "block",
            "C",
            "requests/s",
            "GiB/s",
            "p50 us",
            "p99 us",
            "p999 us",
            "CPU us/rq",
            "RSS pk MiB",
            "KV MiB",
            "fds max",
            "fds0",
            "verified"
        );
    }
    for &block in &run.block_bytes {
        for &c in &run.workload.concurrency {
            let l = run_level(run, source, block, c, processes)?;
            all_ok &= l.verified != Some(false);
            if run.json {
                println!(
                    "{}",
                    json!({
                        "mode": "many", "transport": transport, "processes": processes, "block_bytes": block,
                        "concurrency": l.concurrency, "n": run.n, "blocks_per_child": run.workload.blocks_per_child,
                        "duration_s": run.workload.duration, "connections": run.connections,
                        "notify_with_read": run.notify_with_read,
                        "requests": l.requests, "requests_per_s": l.requests_per_s, "gib_per_s": l.gib_per_s,
                        "p50_us": l.child_us[0], "p99_us": l.child_us[1], "p999_us": l.child_us[2], "max_us": l.child_us[3],
                        "request_p50_us": l.request_us[0], "request_p99_us": l.request_us[1],
                        "cpu_us_per_request": l.cpu_us_per_request, "lease_call_us": l.lease_call_us,
                        "prefill_cpu_us_per_request": l.prefill_cpu_us_per_request,
                        "rss_before_mib": l.rss_before_mib, "rss_peak_mib": l.rss_peak_mib, "kv_mib": l.kv_mib,
                        "fds_before": l.fds_before, "fds_max": l.fds_max, "verified": l.verified, "prefill": l.prefill,
                    })
                );
            } else {
                println!(
                    "{:>6} {:>5} {:>10.0} {:>8.3} {:>9.0} {:>9.0} {:>9.0} {:>9.1} {:>10.1} {:>9.1} {:>9} {:>6} {:>8}",
                    human(l.block),
                    l.concurrency,
                    l.requests_per_s,
                    l.gib_per_s,
                    l.child_us[0],
                    l.child_us[1],
                    l.child_us[2],
                    l.cpu_us_per_request,
                    l.rss_peak_mib,
                    l.kv_mib,
                    l.fds_max,
                    l.fds_before,
                    l.verified.map(|v| v.to_string()).unwrap_or_else(|| "skipped".into()),
                );
            }
            rows.push(l);
        }
    }
    if let Some(path) = &run.plot {
        crate::plot::svg_latency_plot(path, &transport, &rows)?;
    }
    Ok(all_ok)
}
