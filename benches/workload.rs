//! The many-requests workload, in two modes, each parent of `--n` children of
//! `--blocks-per-child` blocks, measured for `--duration` seconds after `--warmup-secs`:
//!
//! - closed loop (`--concurrency 1,16,256,1024`): C parents in flight, a new one started as
//!   soon as one finishes; its latency counts from when its turn came (its lease included);
//! - open loop (`--rate 500,2000`): parents arrive on a fixed schedule (or Poisson,
//!   `--arrivals poisson`) at R per second whatever the system does; latency counts from
//!   the *scheduled* arrival, so a submitter that falls behind, or a full in-flight cap
//!   (`--max-in-flight`), shows in the tail instead of being hidden (no coordinated
//!   omission). Arrivals are never dropped: one that finds the cap reached waits, and the
//!   waits are reported (`cap_waits`, `max_backlog`).
//!
//! Each child's hand-off ends at [`kvxfer::ChildReport::completed_at`], stamped by the pull
//! task when its outcome was decided (not when this thread polled it). Leases are taken
//! `--lease-batch` parents per control round trip ahead of need (in two processes, one JSON
//! exchange with `serve` per batch), so the submitting thread measures the engine rather
//! than the bench's own control channel. Reported per block size and level: requests/s,
//! GiB/s, per-child latency (p50/p99/p999), CPU per request, peak RSS and open fds.
//!
//! Memory: the decode agent owns one parent's blocks per slot (C, or the in-flight cap);
//! the prefill side twice as many, handed out first-in first-out, so a decode slot reads
//! other remote blocks on each reuse and the final check (every slot against the pattern
//! of the blocks it last pulled) cannot pass on stale data.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use futures::task::ArcWake;
use kvxfer::{BlockId, ChildOutcome, KvMemory, PrefillResult, PullReport};
use kvxfer_mem::pattern;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::baselines::percentile;
use crate::cli::{Arrivals, RunArgs};
use crate::measure::Decoder;
use crate::plot::human;
use crate::procstat::{involuntary_switches, open_fds, peak_rss_kib, reset_peak_rss, rss_kib};
use crate::source::{LeaseSource, ProcessCounters, RawTcpRun};
use crate::types::{Level, Loaded};

/// Parents to lease per batch: `--lease-batch`, at most `c / 2` (the remote slots hold two
/// batches besides the parents in flight), and in the open loop at most `rate × ttl / 4`
/// (at least 1). The pool holds up to two batches, and nothing heartbeats a pooled lease:
/// at the offered rate its oldest waits about 2 × batch / rate ≤ ttl / 2 before it is used.
/// When the in-flight cap holds arrivals back, or in the closed loop, the pool (≤ c − 1
/// leases) drains at the completion rate, c / (a parent's latency): its oldest waits less
/// than one parent's latency.
fn lease_batch_size(lease_batch: u32, c: usize, level: Level, ttl: Duration) -> usize {
    let batch = (lease_batch.max(1) as usize).min((c / 2).max(1));
    match level {
        Level::Closed(_) => batch,
        Level::Open { rate, .. } => batch.min(((rate * ttl.as_secs_f64() / 4.0) as usize).max(1)),
    }
}

/// The latest the loop may park waiting for a completion: until the next arrival (`wait`,
/// `None`: until one completes), but never past a window edge whose readings (CPU,
/// context switches, the prefill's CPU) are still to be taken, so they are taken at the
/// edge and not at the next completion (parked at the in-flight cap, that one may come
/// much later, and the drain's work would count in the window).
fn park_deadline(wait: Option<Instant>, pending_edges: &[Option<Instant>]) -> Option<Instant> {
    pending_edges.iter().flatten().copied().chain(wait).min()
}

/// A finished parent: its local and remote slot, when it started (the scheduled arrival in
/// the open loop), when it was submitted, its report.
type Finished = Pin<Box<dyn Future<Output = Done>>>;

/// What a [`Finished`] gives: local slot, remote slot, started, submitted, report.
type Done = (usize, usize, Instant, Instant, PullReport);

/// This process's counters and the prefill process's (when it is `serve`), now.
fn counters(source: &mut dyn LeaseSource) -> (ProcessCounters, Option<ProcessCounters>) {
    (ProcessCounters::now(), source.prefill_process())
}

/// Bytes of the raw TCP run beside a many-requests level at most: its CPU per byte is
/// scaled to the level's bytes per request.
const RAW_RUN_MAX_BYTES: u64 = 512 << 20;

/// Wakes the submitting thread when a pull finishes.
struct Unpark(std::thread::Thread);

impl ArcWake for Unpark {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        arc_self.0.unpark();
    }
}

/// The next finished parent, waiting at most until `until` (for ever when `None`): `None`
/// on timeout, `Some(None)` when nothing is in flight. With `--async-submit` the wait is a
/// `block_on` on the bench's runtime (so a current-thread one runs the pulls meanwhile);
/// else this thread parks until a pull's waker unparks it.
fn next_until(
    in_flight: &mut FuturesUnordered<Finished>,
    waker: &std::task::Waker,
    until: Option<Instant>,
    runtime: Option<&tokio::runtime::Runtime>,
) -> Option<Option<Done>> {
    if let Some(rt) = runtime {
        return match (in_flight.is_empty(), until) {
            (true, None) => Some(None),
            // Timers made inside `block_on`: they need the runtime's context.
            (true, Some(t)) => {
                rt.block_on(async { tokio::time::sleep_until(t.into()).await });
                None
            }
            (false, None) => Some(rt.block_on(in_flight.next())),
            // A turn for the runtime's tasks and I/O first, even when the deadline passed
            // already: a current-thread runtime runs its pulls only inside `block_on`.
            (false, Some(t)) => rt
                .block_on(async {
                    tokio::task::yield_now().await;
                    tokio::time::timeout_at(t.into(), in_flight.next()).await
                })
                .ok(),
        };
    }
    if in_flight.is_empty() {
        if let Some(t) = until {
            std::thread::sleep(t.saturating_duration_since(Instant::now()));
            return None;
        }
        return Some(None);
    }
    let mut cx = Context::from_waker(waker);
    loop {
        if let Poll::Ready(r) = in_flight.poll_next_unpin(&mut cx) {
            return Some(r);
        }
        match until {
            None => std::thread::park(),
            Some(t) => {
                let now = Instant::now();
                if now >= t {
                    return None;
                }
                std::thread::park_timeout(t - now);
            }
        }
    }
}

/// Leases taken ahead of need, `batch` parents per call of the source; the next batch is
/// asked for while the last one is used (in two processes, its control round trip overlaps
/// the pulls), so the submitting thread waits only when the pool runs dry.
struct LeasePool {
    ready: VecDeque<(usize, PrefillResult)>,
    /// The remote slots of the batch under way.
    under_way: Option<Vec<usize>>,
    batch: usize,
    /// Names the parents: `many-{tag}-{seq}`.
    tag: String,
    seq: u64,
    /// The children's remote blocks of a parent leased over a remote slot.
    children: Box<dyn Fn(usize) -> Vec<Vec<BlockId>>>,
    /// The ttl each lease is asked for.
    ttl: Duration,
    /// Seconds the submitting thread spent in lease calls (sending, waiting, decoding).
    calls_secs: f64,
    leased: u64,
}

impl LeasePool {
    /// Collects the batch under way if it arrived (waits for it when `wait`).
    fn collect(&mut self, source: &mut dyn LeaseSource, wait: bool) -> Result<(), String> {
        if self.under_way.is_none() {
            return Ok(());
        }
        let t0 = Instant::now();
        let got = source.lease_many_recv(wait)?;
        self.calls_secs += t0.elapsed().as_secs_f64();
        if let Some(results) = got {
            let slots = self.under_way.take().unwrap_or_default();
            self.landed(slots, results);
        }
        Ok(())
    }

    /// Leases of `slots` arrived: ready to take.
    fn landed(&mut self, slots: Vec<usize>, results: Vec<PrefillResult>) {
        self.leased += results.len() as u64;
        self.ready.extend(slots.into_iter().zip(results));
    }

    /// Asks for the next batch (at most `wanted` parents, over free remote slots) when fewer
    /// than a batch are ready and none is under way.
    fn top_up(
        &mut self,
        source: &mut dyn LeaseSource,
        free_remote: &mut VecDeque<usize>,
        wanted: usize,
    ) -> Result<(), String> {
        if self.under_way.is_some() || self.ready.len() >= self.batch {
            return Ok(());
        }
        let k = self.batch.min(wanted).min(free_remote.len());
        if k == 0 {
            return Ok(());
        }
        let slots: Vec<usize> = free_remote.drain(..k).collect();
        let parents: Vec<(String, Vec<Vec<BlockId>>)> = slots
            .iter()
            .map(|&r| {
                self.seq += 1;
                (format!("many-{}-{}", self.tag, self.seq), (self.children)(r))
            })
            .collect();
        let t0 = Instant::now();
        let sent = source.lease_many_send(parents, 1, Some(self.ttl))?;
        self.calls_secs += t0.elapsed().as_secs_f64();
        match sent {
            Some(results) => self.landed(slots, results),
            None => self.under_way = Some(slots),
        }
        Ok(())
    }

    /// One parent's lease, asking for (and waiting for) a batch when none is ready; `None`
    /// when no remote slot is free.
    fn take(
        &mut self,
        source: &mut dyn LeaseSource,
        free_remote: &mut VecDeque<usize>,
        wanted: usize,
    ) -> Result<Option<(usize, PrefillResult)>, String> {
        if self.ready.is_empty() {
            self.top_up(source, free_remote, wanted.max(1))?;
            self.collect(source, true)?;
        }
        Ok(self.ready.pop_front())
    }
}

/// Runs one (block size, level).
pub(crate) fn run_level(
    run: &RunArgs,
    source: &mut dyn LeaseSource,
    block: u64,
    level: Level,
) -> Result<Loaded, String> {
    let w = &run.workload;
    let (n, bpc) = (run.n.max(1), w.blocks_per_child.max(1));
    let c = match level {
        Level::Closed(c) => c.max(1),
        Level::Open { cap, .. } => cap.max(1),
    } as usize;
    let per_parent = n * bpc;
    let slots = u32::try_from(c).map_err(|e| e.to_string())?;
    source.setup(block, 2 * slots * per_parent, run.segments())?;
    let layout = crate::source::bench_layout(slots * per_parent, block, run.segments())?;
    let config = crate::cli::decode_config(run, "bench-decode-many".into())?;
    let decoder = Decoder::start(run, config, KvMemory::alloc(layout).map_err(|e| e.to_string())?)?;
    // Peak RSS and fds from here on: what the agent and the requests in flight hold.
    let peak_reset = reset_peak_rss();
    let (rss_before, fds_before) = (rss_kib(), open_fds());
    let ids = move |slot: usize, child: u32| -> Vec<BlockId> {
        let first = slot as u32 * per_parent + child * bpc;
        (first..first + bpc).collect()
    };
    let tag = match level {
        Level::Closed(c) => format!("{block}-c{c}"),
        Level::Open { rate, .. } => format!("{block}-r{rate}"),
    };
    let mut free_local: Vec<usize> = (0..c).rev().collect();
    let mut free_remote: VecDeque<usize> = (0..2 * c).collect();
    let mut last_remote: Vec<Option<usize>> = vec![None; c];
    let mut in_flight: FuturesUnordered<Finished> = FuturesUnordered::new();
    // Up to two batches ahead (one ready, one under way) besides the c parents in flight:
    // the 2c remote slots hold them when a batch is at most c / 2.
    let ttl = Duration::from_secs_f64(w.lease_ttl);
    let mut pool = LeasePool {
        ready: VecDeque::new(),
        under_way: None,
        batch: lease_batch_size(w.lease_batch, c, level, ttl),
        tag,
        seq: 0,
        children: Box::new(move |r| (0..n).map(|k| ids(r, k)).collect()),
        ttl,
        calls_secs: 0.0,
        leased: 0,
    };
    let waker = futures::task::waker(Arc::new(Unpark(std::thread::current())));

    let start = Instant::now();
    let warm = start + Duration::from_secs_f64(w.warmup_secs.max(0.0));
    let end = warm + Duration::from_secs_f64(w.duration.max(0.01));
    // Open loop: the arrival schedule.
    let mut rng = rand::rngs::StdRng::seed_from_u64(w.seed);
    // `rate` is within `RATE_RANGE` (its parser), so the mean gap is a valid duration.
    let mut gap = |rate: f64| -> Duration {
        let mean = 1.0 / rate;
        match w.arrivals {
            Arrivals::Fixed => Duration::from_secs_f64(mean),
            Arrivals::Poisson => Duration::from_secs_f64(-mean * (1.0 - rng.random::<f64>()).ln()),
        }
    };
    let mut next_arrival = start;
    let (mut cap_waits, mut max_backlog) = (0u64, 0u64);
    // The last moment an arrival was due while the cap was reached.
    let mut cap_blocked_upto: Option<Instant> = None;
    let mut submit_lag = Vec::new();

    let (mut at0, mut at1) = (None, None);
    let (mut preempted0, mut preempted1) = (0, 0);
    // How long after the window's end its readings were taken.
    let mut end_reading_late = Duration::ZERO;
    let (mut child_lat, mut req_lat, mut service_lat) = (Vec::new(), Vec::new(), Vec::new());
    let (mut requests, mut bytes) = (0u64, 0u64);
    let (mut fds_max, mut next_fd_sample) = (fds_before, start);
    let show_progress = std::io::IsTerminal::is_terminal(&std::io::stderr()) && !run.json && !run.csv;
    loop {
        let now = Instant::now();
        if at0.is_none() && now >= warm {
            at0 = Some(counters(source));
            preempted0 = involuntary_switches();
        }
        if at1.is_none() && now >= end {
            end_reading_late = now - end;
            at1 = Some(counters(source));
            preempted1 = involuntary_switches();
            if show_progress {
                eprintln!("\r{} B blocks, {level:?}: draining   ", human(block));
            }
        }
        // Start what is due.
        let mut wait_until = None;
        match level {
            Level::Closed(_) => {
                while Instant::now() < end && in_flight.len() < c {
                    let started = Instant::now();
                    let Some(local) = free_local.pop() else { break };
                    let wanted = pool.batch;
                    let Some((remote, result)) = pool.take(source, &mut free_remote, wanted)? else {
                        free_local.push(local);
                        break;
                    };
                    submit(decoder.agent(), &mut in_flight, result, local, remote, started, n, &ids)?;
                }
            }
            Level::Open { rate, .. } => {
                while next_arrival < end && next_arrival <= Instant::now() {
                    if in_flight.len() >= c {
                        // Every arrival due by now waits for a slot.
                        cap_blocked_upto = Some(Instant::now());
                        break;
                    }
                    let Some(local) = free_local.pop() else { break };
                    let due = ((end - next_arrival).as_secs_f64() * rate).ceil() as usize;
                    let Some((remote, result)) = pool.take(source, &mut free_remote, due)? else {
                        free_local.push(local);
                        break;
                    };
                    let scheduled = next_arrival;
                    let submitted =
                        submit(decoder.agent(), &mut in_flight, result, local, remote, scheduled, n, &ids)?;
                    if scheduled >= warm {
                        // Taken as the submit call starts (the service latency's start).
                        submit_lag.push(submitted.saturating_duration_since(scheduled).as_secs_f64() * 1e6);
                    }
                    if cap_blocked_upto.is_some_and(|t| scheduled <= t) {
                        cap_waits += 1;
                    }
                    next_arrival += gap(rate);
                    // Arrivals overdue now (waiting for a slot, or for this thread); exact
                    // for fixed spacing, about right for Poisson.
                    let now = Instant::now();
                    if next_arrival <= now {
                        let overdue = ((now - next_arrival).as_secs_f64() * rate) as u64;
                        max_backlog = max_backlog.max(overdue.saturating_add(1));
                    }
                }
                if next_arrival < end && in_flight.len() < c {
                    wait_until = Some(next_arrival);
                }
            }
        }
        // Ask for the next batch ahead of need, and collect it once it is here.
        let wanted = match level {
            Level::Closed(_) if Instant::now() < end => pool.batch,
            Level::Closed(_) => 0,
            Level::Open { rate, .. } if next_arrival < end => {
                ((end - next_arrival).as_secs_f64() * rate).ceil() as usize
            }
            Level::Open { .. } => 0,
        };
        pool.collect(source, false)?;
        pool.top_up(source, &mut free_remote, wanted)?;
        let edges = [at0.is_none().then_some(warm), at1.is_none().then_some(end)];
        let next =
            match next_until(&mut in_flight, &waker, park_deadline(wait_until, &edges), decoder.runtime()) {
                None => continue,
                Some(None) => break,
                Some(Some(done)) => done,
            };
        let (local, remote, started, submitted, report) = next;
        for ch in &report.children {
            if !matches!(ch.outcome, ChildOutcome::Done { .. }) {
                return Err(format!(
                    "child {} of {}: {:?}",
                    ch.child_index, report.parent_request_id, ch.outcome
                ));
            }
        }
        let done_at = report.children.iter().map(|ch| ch.completed_at).max().unwrap_or(started);
        let completed_in_window = done_at >= warm && done_at < end;
        if completed_in_window {
            requests += 1;
            bytes += report.delivered_bytes;
        }
        // Latency samples: closed loop, the parents that finished in the window (as
        // throughput); open loop, every parent *scheduled* in it, however late it finished.
        let sampled = match level {
            Level::Closed(_) => completed_in_window,
            Level::Open { .. } => started >= warm && started < end,
        };
        if sampled {
            child_lat.extend(
                report.children.iter().map(|ch| ch.completed_at.duration_since(started).as_secs_f64() * 1e6),
            );
            req_lat.push(done_at.duration_since(started).as_secs_f64() * 1e6);
            service_lat.extend(
                report
                    .children
                    .iter()
                    .map(|ch| ch.completed_at.duration_since(submitted).as_secs_f64() * 1e6),
            );
        }
        last_remote[local] = Some(remote);
        free_local.push(local);
        free_remote.push_back(remote);
        let now = Instant::now();
        if now >= next_fd_sample {
            fds_max = fds_max.max(open_fds());
            next_fd_sample = now + Duration::from_millis(20);
        }
    }
    // The measured window is over even when the last pull finished before its end.
    if at1.is_none() {
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
        end_reading_late = end.elapsed();
        at1 = Some(counters(source));
        preempted1 = involuntary_switches();
    }
    if cap_waits > 0 {
        eprintln!(
            "kvxfer-bench: {} B blocks, {level:?}: the in-flight cap was reached; {cap_waits} arrivals \
             waited for a slot (most overdue at once: {max_backlog}); their latency counts from their \
             scheduled arrival",
            human(block)
        );
    }
    let (local, prefill) = match (at0, at1) {
        (Some((l0, p0)), Some((l1, p1))) => (l1.since(l0), p1.zip(p0).map(|(b, a)| b.since(a))),
        _ => (ProcessCounters::default(), None),
    };
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
    let async_submit = decoder.runtime().is_some();
    let current_thread = decoder
        .runtime()
        .is_some_and(|rt| rt.handle().runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
    drop(decoder);
    // The prefill's figures (its peak memory among them) before the raw run's buffers.
    let prefill_stats = source.stats();
    // The kernel's share of the same bytes: a raw TCP run (the level's bytes, at most
    // RAW_RUN_MAX_BYTES, scaled), from the prefill side to this process as kvxfer's bytes;
    // after every memory reading of the level: its buffers are no part of them.
    let raw = if run.baseline && bytes > 0 {
        let moved = bytes.min(RAW_RUN_MAX_BYTES);
        let r =
            source.raw_tcp_run(moved, run.connections, u64::from(bpc) * block * u64::from(run.segments()))?;
        let scale = bytes as f64 / moved as f64;
        Some(RawTcpRun {
            gib_per_s: r.gib_per_s,
            send_cpu_seconds: r.send_cpu_seconds * scale,
            receive_cpu_seconds: r.receive_cpu_seconds * scale,
            // Judged on the run's own window (one run of up to RAW_RUN_MAX_BYTES).
            machine_cpu_seconds: r
                .machine_cpu_seconds
                .filter(|_| r.window_secs >= crate::baselines::MIN_MACHINE_WINDOW_SECS)
                .map(|m| m * scale),
            window_secs: r.window_secs,
        })
    } else {
        None
    };
    child_lat.sort_by(f64::total_cmp);
    req_lat.sort_by(f64::total_cmp);
    submit_lag.sort_by(f64::total_cmp);
    service_lat.sort_by(f64::total_cmp);
    let secs = w.duration.max(0.01);
    let per_req = |s: f64| s * 1e6 / (requests.max(1) as f64);
    Ok(Loaded {
        block,
        level,
        async_submit,
        current_thread,
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
        cpu_us_per_request: per_req(local.cpu_seconds),
        switches_per_request: local.context_switches as f64 / (requests.max(1) as f64),
        prefill_switches_per_request: prefill.map(|p| p.context_switches as f64 / (requests.max(1) as f64)),
        raw_tcp_us_per_request: raw.map(|r| [per_req(r.send_cpu_seconds), per_req(r.receive_cpu_seconds)]),
        machine_cpu_us_per_request: local
            .machine_busy_seconds
            .filter(|_| secs >= crate::baselines::MIN_MACHINE_WINDOW_SECS)
            .map(per_req),
        raw_tcp_machine_cpu_us_per_request: raw.and_then(|r| r.machine_cpu_seconds).map(per_req),
        lease_call_us: pool.calls_secs * 1e6 / (pool.leased.max(1) as f64),
        submit_lag_us: [
            percentile(&submit_lag, 0.5),
            percentile(&submit_lag, 0.99),
            submit_lag.last().copied().unwrap_or(0.0),
        ],
        service_us: [
            percentile(&service_lat, 0.5),
            percentile(&service_lat, 0.99),
            percentile(&service_lat, 0.999),
        ],
        cap_waits,
        end_reading_late_us: end_reading_late.as_secs_f64() * 1e6,
        max_backlog,
        prefill_cpu_us_per_request: prefill.map(|p| per_req(p.cpu_seconds)),
        preempted_per_s: preempted1.saturating_sub(preempted0) as f64 / secs,
        rss_before_mib: rss_before as f64 / 1024.0,
        rss_peak_mib: if peak_reset { rss_peak as f64 / 1024.0 } else { f64::NAN },
        kv_mib: (u64::from(slots * per_parent) * block) as f64 / f64::from(1u32 << 20),
        fds_before,
        fds_max,
        verified,
        prefill: prefill_stats,
    })
}

/// Submits one leased parent into local slot `local`, to report with its start time;
/// returns when the submit call started (the parent's submission time).
#[allow(clippy::too_many_arguments)]
fn submit(
    decoder: &kvxfer::DecodeAgent,
    in_flight: &mut FuturesUnordered<Finished>,
    result: PrefillResult,
    local: usize,
    remote: usize,
    started: Instant,
    n: u32,
    ids: &dyn Fn(usize, u32) -> Vec<BlockId>,
) -> Result<Instant, String> {
    let submitted = Instant::now();
    let h = decoder.submit(result, (0..n).map(|k| ids(local, k)).collect()).map_err(|e| e.to_string())?;
    in_flight.push(Box::pin(async move { (local, remote, started, submitted, h.finished().await) }));
    Ok(submitted)
}

/// Runs every (block size, level) of `run` — closed-loop levels first, then open-loop ones
/// — and reports each; `Ok(false)` when a check failed.
pub(crate) fn bench_many(
    run: &RunArgs,
    source: &mut dyn LeaseSource,
    processes: &str,
) -> Result<bool, String> {
    let transport = run.transport.to_string();
    let w = &run.workload;
    let levels: Vec<Level> = w
        .concurrency
        .iter()
        .map(|&c| Level::Closed(c))
        .chain(w.rate.iter().map(|&rate| Level::Open { rate, cap: w.max_in_flight }))
        .collect();
    let mut all_ok = true;
    let mut rows = Vec::new();
    if !run.json {
        println!(
            "{:>6} {:>10} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>6} {:>9} {:>8}",
            "block",
            "C | rate/s",
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
            "cap waits",
            "verified"
        );
    }
    for &block in &run.block_bytes {
        for &level in &levels {
            let l = run_level(run, source, block, level)?;
            // Pieces one request moves: children x blocks x the cache's regions.
            let pieces =
                u64::from(run.n.max(1)) * u64::from(w.blocks_per_child.max(1)) * u64::from(run.segments());
            all_ok &= l.verified != Some(false);
            let (mode, concurrency, offered, cap) = match l.level {
                Level::Closed(c) => ("many", Some(c), None, None),
                Level::Open { rate, cap } => ("open", None, Some(rate), Some(cap)),
            };
            if run.json {
                let mut j = json!({
                    "mode": mode, "transport": transport, "processes": processes, "block_bytes": block,
                    "concurrency": concurrency, "n": run.n, "blocks_per_child": w.blocks_per_child,
                    "duration_s": w.duration, "connections": run.connections,
                    "notify_with_read": run.notify_with_read, "lease_batch": w.lease_batch,
                    "async_submit": l.async_submit, "current_thread": l.current_thread,
                    "requests": l.requests, "requests_per_s": l.requests_per_s, "gib_per_s": l.gib_per_s,
                    "p50_us": l.child_us[0], "p99_us": l.child_us[1], "p999_us": l.child_us[2], "max_us": l.child_us[3],
                    "request_p50_us": l.request_us[0], "request_p99_us": l.request_us[1],
                    "service_p50_us": l.service_us[0], "service_p99_us": l.service_us[1], "service_p999_us": l.service_us[2],
                    "cpu_us_per_request": l.cpu_us_per_request, "lease_call_us": l.lease_call_us,
                    "lease_ttl_s": w.lease_ttl, "window_end_reading_late_us": l.end_reading_late_us,
                    "prefill_cpu_us_per_request": l.prefill_cpu_us_per_request,
                    "involuntary_switches_per_s": l.preempted_per_s,
                    "rss_before_mib": l.rss_before_mib, "rss_peak_mib": l.rss_peak_mib, "kv_mib": l.kv_mib,
                    "fds_before": l.fds_before, "fds_max": l.fds_max, "verified": l.verified, "prefill": l.prefill,
                    "context_switches_per_request": l.switches_per_request,
                    "prefill_context_switches_per_request": l.prefill_switches_per_request,
                });
                j["layers"] = json!(run.layers);
                j["kv_split"] = json!(run.kv_split);
                j["segments"] = json!(run.segments());
                j["pieces_per_request"] = json!(pieces);
                j["cpu_us_per_piece"] = json!(
                    (l.cpu_us_per_request + l.prefill_cpu_us_per_request.unwrap_or(0.0))
                        / pieces.max(1) as f64
                );
                // Counted CPU against the kernel's share of the same bytes (`--baseline`):
                // both agents against both raw ends; in two processes each side against its
                // end (decode: receiving, prefill: sending).
                if let Some([send, receive]) = l.raw_tcp_us_per_request {
                    let both = l.cpu_us_per_request + l.prefill_cpu_us_per_request.unwrap_or(0.0);
                    j["cpu_us_per_request_both"] = json!(both);
                    j["raw_tcp_send_cpu_us_per_request"] = json!(send);
                    j["raw_tcp_receive_cpu_us_per_request"] = json!(receive);
                    j["ratio_cpu_vs_raw_tcp"] = json!(both / (send + receive).max(1e-9));
                    j["cpu_us_above_raw_tcp_per_request"] = json!(both - (send + receive));
                    if let Some(prefill) = l.prefill_cpu_us_per_request {
                        j["decode_cpu_us_above_raw_receive"] = json!(l.cpu_us_per_request - receive);
                        j["prefill_cpu_us_above_raw_send"] = json!(prefill - send);
                    }
                }
                // This machine's busy CPU (every process and kernel thread, /proc/stat) over the
                // measured window, and over the raw run scaled to the same bytes.
                j["machine_cpu_us_per_request"] = json!(l.machine_cpu_us_per_request);
                j["cpus"] = json!(crate::procstat::cpus_allowed());
                j["raw_tcp_machine_cpu_us_per_request"] = json!(l.raw_tcp_machine_cpu_us_per_request);
                j["ratio_machine_cpu_vs_raw_tcp"] = json!(l
                    .machine_cpu_us_per_request
                    .zip(l.raw_tcp_machine_cpu_us_per_request.filter(|&r| r > 0.0))
                    .map(|(k, r)| k / r));
                // The open loop's own figures (null in the closed loop).
                let open = |v: Value| if offered.is_some() { v } else { Value::Null };
                j["offered_per_s"] = json!(offered);
                j["max_in_flight"] = json!(cap);
                j["arrivals"] = open(json!(format!("{:?}", w.arrivals).to_lowercase()));
                j["submit_lag_p50_us"] = open(json!(l.submit_lag_us[0]));
                j["submit_lag_p99_us"] = open(json!(l.submit_lag_us[1]));
                j["submit_lag_max_us"] = open(json!(l.submit_lag_us[2]));
                j["cap_waits"] = open(json!(l.cap_waits));
                j["max_backlog"] = open(json!(l.max_backlog));
                println!("{j}");
            } else {
                println!(
                    "{:>6} {:>10} {:>10.0} {:>8.3} {:>9.0} {:>9.0} {:>9.0} {:>9.1} {:>10.1} {:>9.1} {:>9} {:>6} {:>9} {:>8}",
                    human(l.block),
                    match l.level {
                        Level::Closed(c) => format!("C={c}"),
                        Level::Open { rate, .. } => format!("{rate}/s"),
                    },
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
                    offered.map(|_| l.cap_waits.to_string()).unwrap_or_else(|| "-".into()),
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
