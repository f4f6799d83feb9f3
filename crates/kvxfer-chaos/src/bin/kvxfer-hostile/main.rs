//! A hostile-peer load generator: a prefill agent in a child process, a legitimate decode
//! agent pulling from it in a loop (a quiet baseline first, then the same under attack),
//! and many hostile connections from several loopback source addresses. It reports the
//! legitimate pull's latency against the baseline and the prefill process's RSS, file
//! descriptors, CPU time, server counters and log volume, as JSON (`--json`) or a table.
//!
//! ```text
//! kvxfer-hostile --conns 1024 --addrs 16 --baseline-secs 20 --duration 30 [--key HEX] [--json]
//! ```
//! It is a load generator, not a test: it exits 0 whenever it ran, whatever it measured.

mod attacks;
mod target;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attacks::{Attack, AttackCtx, AttackStats, RealLease};
use clap::{Parser, Subcommand};
use kvxfer::blocking::DecodeAgent;
use kvxfer::{AgentConfig, ChildOutcome, ClusterKey, KvMemory, PrefillResult};
use serde_json::{json, Map, Value};
use target::{Sampler, Target, TargetArgs};

#[derive(Parser, Debug)]
#[command(about = "Hostile peers against a prefill agent while a legitimate decode agent pulls")]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    mode: Option<Mode>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// The prefill agent under attack (started by the generator itself; not for humans).
    #[command(hide = true)]
    ServePrefill(TargetArgs),
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Seconds of the attack phase (every selected attack at once).
    #[arg(long, default_value_t = 30.0)]
    duration: f64,
    /// Seconds of the quiet baseline before it.
    #[arg(long, default_value_t = 20.0)]
    baseline_secs: f64,
    /// Also run each selected attack alone for this many seconds after the combined phase,
    /// each against a fresh prefill process with a baseline of its own (0: not).
    #[arg(long, default_value_t = 0.0)]
    each_secs: f64,
    /// Seconds of the quiet baseline before each attack alone (`--each-secs`; each runs
    /// against a fresh prefill process).
    #[arg(long, default_value_t = 5.0)]
    each_baseline_secs: f64,
    /// Milliseconds between two new connections of the legitimate prober.
    #[arg(long, default_value_t = 250)]
    probe_interval_ms: u64,
    /// Seconds after an attack phase before the prefill's RSS "after" is read.
    #[arg(long, default_value_t = 2.0)]
    settle_secs: f64,
    /// Hostile connections in all (spread evenly over the attacks that use connections).
    #[arg(long, default_value_t = 1024)]
    conns: usize,
    /// Source addresses of the hostile connections: 127.0.0.2 onwards.
    #[arg(long, default_value_t = 16)]
    addrs: u32,
    /// Attacks: `all`, or a comma-separated list of silent, slowloris, half-open,
    /// frame-flood, stale-release, own-stale-release, big-hello, pin-crc, log-flood.
    #[arg(long, default_value = "all")]
    attacks: String,
    /// Cluster key (hex) of the prefill agent and the legitimate decode agent (keyless
    /// without it).
    #[arg(long)]
    key: Option<String>,
    /// The hostile peers hold the cluster key too (a compromised or buggy insider).
    #[arg(long)]
    insider: bool,
    /// Legitimate pulls a second, paced (0: back to back, as fast as the machine allows).
    #[arg(long, default_value_t = 0.0)]
    pull_rate: f64,
    /// Blocks per legitimate hand-off.
    #[arg(long, default_value_t = 1)]
    pull_blocks: u32,
    /// Seconds between the slow-loris bytes.
    #[arg(long, default_value_t = 3.0)]
    trickle_secs: f64,
    /// Milliseconds between two releases of `own-stale-release`.
    #[arg(long, default_value_t = 1000)]
    stale_release_interval_ms: u64,
    /// Log filter of the prefill child (its stderr, whose volume is reported).
    #[arg(long, default_value = "info")]
    log_filter: String,
    /// Where the prefill child's log goes (default: a file in the temp directory, removed
    /// at the end).
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// Print the report as JSON on stdout (the table then goes to stderr).
    #[arg(long)]
    json: bool,
    /// CPUs the legitimate decode agent (and the generator's own threads) run on, e.g. `0`
    /// (default: any). With `--prefill-cpus` and `--attacker-cpus`, the attackers' CPU time
    /// cannot slow the legitimate side down: what is left is the prefill's own cost.
    #[arg(long, value_parser = target::parse_cpus)]
    legit_cpus: Option<target::CpuList>,
    /// CPUs the hostile connections' runtime runs on, e.g. `1` (default: any).
    #[arg(long, value_parser = target::parse_cpus)]
    attacker_cpus: Option<target::CpuList>,
}

/// One legitimate pull: the phase it started in, how long it took, and its failure.
struct Pull {
    phase: usize,
    took: Duration,
    error: Option<String>,
}

/// Phase index meaning "between phases" (pulls then are not recorded).
const NO_PHASE: usize = usize::MAX;

/// The legitimate side: a decode agent pulling hand-offs one after the other.
struct Legit {
    agent: Arc<DecodeAgent>,
    phase: AtomicUsize,
    pulls: Mutex<Vec<Pull>>,
    /// New connections of a legitimate peer (handshake only), one after the other.
    probes: Mutex<Vec<Pull>>,
    stop: AtomicBool,
}

/// A legitimate peer's new connection, every `every`: connect and handshake (with the
/// cluster key when there is one), then close. Shows whether hostile connections hold the
/// permits a new legitimate peer needs.
fn probe_loop(
    legit: &Legit,
    addr: &str,
    hello: &kvxfer_proto::v1::Hello,
    key: Option<&ClusterKey>,
    every: Duration,
) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
    while !legit.stop.load(Ordering::Relaxed) {
        let phase = legit.phase.load(Ordering::Relaxed);
        let started = Instant::now();
        let connect = kvxfer_tcp::Connection::connect_with_key(addr, hello, key, kvxfer::Limits::default());
        let error = match rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), connect).await })
        {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(short(&e.to_string())),
            Err(_) => Some("no handshake within 30 s".to_owned()),
        };
        let took = started.elapsed();
        if phase != NO_PHASE {
            legit.probes.lock().unwrap_or_else(|p| p.into_inner()).push(Pull { phase, took, error });
        }
        std::thread::sleep(every.saturating_sub(took));
    }
}

/// The legitimate pulls: back to back (`rate` 0), or paced at `rate` pulls a second — a
/// steady offered load, so a saturated machine does not decide the latency by itself (a
/// pull that starts late is not counted from its slot: behind by over a second, the
/// schedule restarts from now).
fn legit_loop(legit: &Legit, target: &Target, ctx: &AttackCtx, pull_blocks: u32, rate: f64) {
    let local: Vec<u32> = (0..pull_blocks).collect();
    let gap = (rate > 0.0).then(|| Duration::from_secs_f64(1.0 / rate));
    let mut slot = Instant::now();
    while !legit.stop.load(Ordering::Relaxed) {
        if let Some(gap) = gap {
            let now = Instant::now();
            if slot > now {
                std::thread::sleep(slot - now);
            } else if now.duration_since(slot) > Duration::from_secs(1) {
                slot = now;
            }
            slot += gap;
        }
        let phase = legit.phase.load(Ordering::Relaxed);
        let wire = match target.lease(pull_blocks) {
            Ok(w) => w,
            Err(e) => {
                if phase != NO_PHASE {
                    let error = Some(format!("lease: {e}"));
                    legit.pulls.lock().unwrap_or_else(|p| p.into_inner()).push(Pull {
                        phase,
                        took: Duration::ZERO,
                        error,
                    });
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let ids: Vec<(String, Vec<u8>)> =
            wire.children.iter().map(|c| (c.remote_request_id.clone(), c.lease_token.clone())).collect();
        let started = Instant::now();
        let error = match legit.agent.submit_wire(wire, vec![local.clone()]) {
            Ok(h) => {
                let report = h.wait();
                report.children.iter().find_map(|c| match &c.outcome {
                    ChildOutcome::Done { .. } => None,
                    ChildOutcome::Failed { error, .. } | ChildOutcome::FailedBlocksHeld { error, .. } => {
                        Some(short(&error.to_string()))
                    }
                    ChildOutcome::Cancelled { .. } => Some("cancelled".into()),
                })
            }
            Err(e) => Some(short(&format!("submit: {e}"))),
        };
        let took = started.elapsed();
        if error.is_none() {
            for (id, token) in ids {
                ctx.pulled(id, token);
            }
        }
        if phase != NO_PHASE {
            legit.pulls.lock().unwrap_or_else(|p| p.into_inner()).push(Pull { phase, took, error });
        }
    }
}

fn short(s: &str) -> String {
    let mut s: String = s.chars().take(160).collect();
    s.retain(|c| c != '\n');
    s
}

/// The legitimate agent releases leases the prefill does not know, one after the other.
fn own_stale_releases(
    agent: &DecodeAgent,
    template: &kvxfer_proto::v1::PrefillResult,
    stop: &AtomicBool,
    interval: Duration,
    stats: &AttackStats,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let mut wire = template.clone();
        for c in &mut wire.children {
            c.remote_request_id = format!("own-stale-{n}-{}", c.remote_request_id);
        }
        if let Ok(result) = PrefillResult::from_wire(wire) {
            if let Some(child) = result.children().first() {
                let started = Instant::now();
                agent.release(child);
                stats.release_done(started.elapsed());
            }
        }
        let deadline = Instant::now() + interval;
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// What one phase measured.
struct PhaseReport {
    name: String,
    attacks: Vec<Attack>,
    secs: f64,
    rss_before_kib: u64,
    rss_peak_kib: u64,
    rss_after_kib: u64,
    fds_before: u64,
    fds_peak: u64,
    fds_after: u64,
    cpu_secs: f64,
    generator_cpu_secs: f64,
    log_bytes: u64,
    counters_before: Value,
    counters_end: Value,
    attack_stats: Vec<(Attack, Arc<AttackStats>)>,
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::ZERO)
}

struct Runner<'a> {
    args: &'a RunArgs,
    target: &'a Target,
    sampler: &'a Sampler,
    legit: &'a Legit,
    ctx: Arc<AttackCtx>,
    rt: &'a tokio::runtime::Runtime,
}

impl Runner<'_> {
    fn phase(
        &self,
        index: usize,
        name: &str,
        attacks: &[Attack],
        length: f64,
    ) -> Result<PhaseReport, String> {
        let counters_before = self.target.stats()?;
        let before = target::sample(self.target.pid);
        let own_before = target::sample(std::process::id());
        let log_before = self.target.log_bytes();
        self.sampler.reset(before);
        if attacks.contains(&Attack::PinCrc) {
            let wire = self.target.lease(self.args.target.blocks)?;
            let lease = wire.children.first().map(|c| RealLease {
                id: c.remote_request_id.clone(),
                token: c.lease_token.clone(),
                blocks: c.remote_block_ids.len() as u32,
            });
            *self.ctx.pin_lease.lock().unwrap_or_else(|p| p.into_inner()) = lease;
        }
        let with_conns: Vec<Attack> = attacks.iter().copied().filter(|a| a.uses_connections()).collect();
        let attack_stats: Vec<(Attack, Arc<AttackStats>)> =
            attacks.iter().map(|a| (*a, Arc::new(AttackStats::default()))).collect();
        let mut tasks = Vec::new();
        let mut global = 0usize;
        for (i, a) in with_conns.iter().enumerate() {
            let share =
                self.args.conns / with_conns.len() + usize::from(i < self.args.conns % with_conns.len());
            let stats = attack_stats.iter().find(|(x, _)| x == a).map(|(_, s)| s.clone()).unwrap_or_default();
            for local in 0..share {
                tasks.push(self.rt.spawn(attacks::slot(*a, global, local, self.ctx.clone(), stats.clone())));
                global += 1;
            }
        }
        let stale_stop = Arc::new(AtomicBool::new(false));
        let mut stale_thread = None;
        if let Some((_, stats)) = attack_stats.iter().find(|(a, _)| *a == Attack::OwnStaleRelease) {
            let template = self.target.lease(1)?;
            let (agent, stop, stats) = (self.legit.agent.clone(), stale_stop.clone(), stats.clone());
            let interval = Duration::from_millis(self.args.stale_release_interval_ms);
            stale_thread = Some(std::thread::spawn(move || {
                own_stale_releases(&agent, &template, &stop, interval, &stats)
            }));
        }
        self.legit.phase.store(index, Ordering::Relaxed);
        let started = Instant::now();
        std::thread::sleep(secs(length));
        self.legit.phase.store(NO_PHASE, Ordering::Relaxed);
        let elapsed = started.elapsed().as_secs_f64();
        let end = target::sample(self.target.pid);
        let own_end = target::sample(std::process::id());
        let (rss_peak_kib, fds_peak) = self.sampler.peaks(end);
        let counters_end = self.target.stats()?;
        for t in &tasks {
            t.abort();
        }
        stale_stop.store(true, Ordering::Relaxed);
        if let Some(t) = stale_thread {
            let _ = t.join();
        }
        let log_bytes = self.target.log_bytes().saturating_sub(log_before);
        let mut after = end;
        if !attacks.is_empty() {
            std::thread::sleep(secs(self.args.settle_secs));
            after = target::sample(self.target.pid);
        }
        Ok(PhaseReport {
            name: name.to_owned(),
            attacks: attacks.to_vec(),
            secs: elapsed,
            rss_before_kib: before.rss_kib,
            rss_peak_kib,
            rss_after_kib: after.rss_kib,
            fds_before: before.fds,
            fds_peak,
            fds_after: after.fds,
            cpu_secs: end.cpu_ticks.saturating_sub(before.cpu_ticks) as f64 / target::TICKS_PER_SEC,
            generator_cpu_secs: own_end.cpu_ticks.saturating_sub(own_before.cpu_ticks) as f64
                / target::TICKS_PER_SEC,
            log_bytes,
            counters_before,
            counters_end,
            attack_stats,
        })
    }
}

/// Latency figures of a phase's pulls (milliseconds).
fn pull_figures(pulls: &[&Pull], secs: f64) -> Value {
    let mut ok: Vec<f64> =
        pulls.iter().filter(|p| p.error.is_none()).map(|p| p.took.as_secs_f64() * 1000.0).collect();
    ok.sort_by(f64::total_cmp);
    let pct = |q: f64| -> Value {
        if ok.is_empty() {
            return Value::Null;
        }
        let i = ((ok.len() as f64 * q).ceil() as usize).clamp(1, ok.len()) - 1;
        json!(round3(ok[i]))
    };
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for p in pulls {
        if let Some(e) = &p.error {
            *errors.entry(e.clone()).or_default() += 1;
        }
    }
    json!({
        "count": pulls.len(), "ok": ok.len(), "failed": pulls.len() - ok.len(),
        "per_sec": round3(ok.len() as f64 / secs.max(1e-9)),
        "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": ok.last().map(|m| round3(*m)),
        "errors": errors,
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// `end - before` for every numeric field of both objects' `server` and `leases`.
fn counter_delta(before: &Value, end: &Value) -> Value {
    let mut out = Map::new();
    for part in ["server", "leases"] {
        let mut d = Map::new();
        if let Some(e) = end[part].as_object() {
            for (k, v) in e {
                if let Some(v) = v.as_u64() {
                    let b = before[part][k].as_u64().unwrap_or(0);
                    d.insert(k.clone(), json!(v as i128 - b as i128));
                }
            }
        }
        out.insert(part.to_owned(), Value::Object(d));
    }
    Value::Object(out)
}

fn phase_json(p: &PhaseReport, pulls: &[&Pull], probes: &[&Pull]) -> Value {
    let mib = |k: u64| round3(k as f64 / 1024.0);
    let attack_stats: Map<String, Value> =
        p.attack_stats.iter().map(|(a, s)| (a.name().to_owned(), s.to_json(*a))).collect();
    json!({
        "name": p.name, "attacks": attacks::names(&p.attacks), "secs": round3(p.secs),
        "pulls": pull_figures(pulls, p.secs),
        "new_connections": pull_figures(probes, p.secs),
        "prefill": {
            "rss_before_mib": mib(p.rss_before_kib), "rss_peak_mib": mib(p.rss_peak_kib),
            "rss_after_mib": mib(p.rss_after_kib),
            "rss_growth_mib": mib(p.rss_peak_kib.saturating_sub(p.rss_before_kib)),
            "fds_before": p.fds_before, "fds_peak": p.fds_peak, "fds_after": p.fds_after,
            "cpu_secs": round3(p.cpu_secs), "log_bytes": p.log_bytes,
        },
        "generator_cpu_secs": round3(p.generator_cpu_secs),
        "counters": p.counters_end,
        "counters_delta": counter_delta(&p.counters_before, &p.counters_end),
        "hostile": attack_stats,
    })
}

fn ratio(a: &Value, b: &Value) -> Value {
    match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => json!(round3(a / b)),
        _ => Value::Null,
    }
}

/// The human-readable table of a report.
fn table(report: &Value) -> String {
    let mut s = String::new();
    let c = &report["config"];
    s += &format!(
        "kvxfer-hostile: {} hostile connections from {} addresses, attacks {}, keyed {}, insider {}\n",
        c["conns"], c["addrs"], c["attacks"], c["keyed"], c["insider"]
    );
    s += &format!(
        "{:<32} {:>6} {:>7} {:>6} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>6} {:>7} {:>7} {:>10} {:>15} {:>9}\n",
        "phase",
        "pulls",
        "pulls/s",
        "failed",
        "p50 ms",
        "p99 ms",
        "max ms",
        "RSS0 MiB",
        "RSSpk",
        "RSSaft",
        "fdspk",
        "CPU s",
        "gen CPU",
        "log bytes",
        "new conn ok/all",
        "p99 ms"
    );
    let f = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.3}"));
    let empty = Vec::new();
    for p in report["phases"].as_array().unwrap_or(&empty) {
        let (q, r) = (&p["pulls"], &p["prefill"]);
        s += &format!(
            "{:<32} {:>6} {:>7.1} {:>6} {:>9} {:>9} {:>9} {:>8.1} {:>8.1} {:>8.1} {:>6} {:>7.2} {:>7.2} {:>10} {:>15} {:>9}\n",
            p["name"].as_str().unwrap_or(""),
            q["count"].to_string(),
            q["per_sec"].as_f64().unwrap_or(0.0),
            q["failed"].to_string(),
            f(&q["p50_ms"]),
            f(&q["p99_ms"]),
            f(&q["max_ms"]),
            r["rss_before_mib"].as_f64().unwrap_or(0.0),
            r["rss_peak_mib"].as_f64().unwrap_or(0.0),
            r["rss_after_mib"].as_f64().unwrap_or(0.0),
            r["fds_peak"].to_string(),
            r["cpu_secs"].as_f64().unwrap_or(0.0),
            p["generator_cpu_secs"].as_f64().unwrap_or(0.0),
            r["log_bytes"].to_string(),
            format!("{}/{}", p["new_connections"]["ok"], p["new_connections"]["count"]),
            f(&p["new_connections"]["p99_ms"]),
        );
    }
    for p in report["phases"].as_array().unwrap_or(&empty) {
        s += &format!("\n[{}] server counters (change during the phase):", p["name"].as_str().unwrap_or(""));
        if let Some(d) = p["counters_delta"]["server"].as_object() {
            let nonzero: Vec<String> =
                d.iter().filter(|(_, v)| v.as_i64() != Some(0)).map(|(k, v)| format!("{k}={v}")).collect();
            s += &format!(" {}", if nonzero.is_empty() { "none".to_owned() } else { nonzero.join(" ") });
        }
        if let Some(h) = p["hostile"].as_object() {
            for (a, v) in h {
                s += &format!("\n  {a}: {v}");
            }
        }
        for (what, key) in [("pull", "pulls"), ("new connection", "new_connections")] {
            if let Some(e) = p[key]["errors"].as_object() {
                for (k, v) in e {
                    s += &format!("\n  {what} error x{v}: {k}");
                }
            }
        }
        s += "\n";
    }
    if let Some(sm) = report["summary"].as_array() {
        s += "\nagainst the baseline:\n";
        for x in sm {
            s += &format!(
                "  {:<32} p50 x{}  p99 x{}  pulls/s x{}  RSS +{} MiB  failed {}  new connections failed {}\n",
                x["phase"].as_str().unwrap_or(""),
                f(&x["p50_ratio"]),
                f(&x["p99_ratio"]),
                f(&x["pulls_per_sec_ratio"]),
                f(&x["rss_growth_mib"]),
                x["pulls_failed"],
                x["new_connections_failed"]
            );
        }
    }
    s
}

/// One prefill child, one legitimate decode agent and prober, and their phases: a quiet
/// baseline, then `attacks` at once. Returns the phases' JSON and their summary against the
/// baseline.
fn session(
    args: &RunArgs,
    label: &str,
    attack_list: &[Attack],
    baseline: f64,
    duration: f64,
) -> Result<(Vec<Value>, Vec<Value>, bool), String> {
    let layout = args.target.layout()?;
    let key_hex = args.key.as_deref().map(str::trim);
    let key = |k: &str| ClusterKey::from_hex(k).map_err(|e| format!("--key: {e}"));
    let legit_key = key_hex.map(key).transpose()?;
    let probe_key = key_hex.map(key).transpose()?;
    let hostile_key = if args.insider { key_hex.map(key).transpose()? } else { None };
    let (log_path, remove_log) = match &args.log_file {
        Some(p) if label.is_empty() => (p.clone(), false),
        Some(p) => (PathBuf::from(format!("{}.{}", p.display(), label.replace(':', "-"))), false),
        None => (std::env::temp_dir().join(format!("kvxfer-hostile-{}.log", std::process::id())), true),
    };
    let target = Target::start(&args.target, key_hex, &args.log_filter, &log_path)?;
    let sampler = Sampler::start(target.pid);

    let mut config = AgentConfig::new("legit-decode").transport(args.target.transport);
    if let Some(k) = legit_key {
        config = config.cluster_key(k);
    }
    let mem = KvMemory::alloc(layout.clone()).map_err(|e| e.to_string())?;
    let agent = Arc::new(DecodeAgent::start(config, mem).map_err(|e| e.to_string())?);
    let legit = Arc::new(Legit {
        agent,
        phase: AtomicUsize::new(NO_PHASE),
        pulls: Mutex::new(Vec::new()),
        probes: Mutex::new(Vec::new()),
        stop: AtomicBool::new(false),
    });
    let ctx = Arc::new(AttackCtx::new(
        target.addr,
        args.addrs,
        layout.clone(),
        hostile_key,
        secs(args.trickle_secs),
    ));
    let attacker_cpus = args.attacker_cpus.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(move || {
            if let Some(cpus) = &attacker_cpus {
                if let Err(e) = cpus.pin_current_thread() {
                    eprintln!("kvxfer-hostile: {e}");
                }
            }
        })
        .build()
        .map_err(|e| format!("runtime: {e}"))?;

    let phases_run = std::thread::scope(|scope| -> Result<Vec<PhaseReport>, String> {
        let (l, t, c) = (&*legit, &target, &*ctx);
        let puller = scope.spawn(move || legit_loop(l, t, c, args.pull_blocks.max(1), args.pull_rate));
        let probe_every = Duration::from_millis(args.probe_interval_ms);
        let (addr, hello) = (target.addr.to_string(), ctx.probe_hello());
        let prober = scope.spawn(move || probe_loop(l, &addr, &hello, probe_key.as_ref(), probe_every));
        let runner =
            Runner { args, target: &target, sampler: &sampler, legit: &legit, ctx: ctx.clone(), rt: &rt };
        let name = |n: &str| if label.is_empty() { n.to_owned() } else { format!("{label} {n}") };
        let mut plan: Vec<(String, Vec<Attack>, f64)> = vec![(name("baseline"), vec![], baseline)];
        if !attack_list.is_empty() {
            let attack_name = if label.is_empty() { "attack".to_owned() } else { label.to_owned() };
            plan.push((attack_name, attack_list.to_vec(), duration));
        }
        let mut out = Vec::new();
        let mut failure = None;
        for (i, (name, attacks, length)) in plan.iter().enumerate() {
            match runner.phase(i, name, attacks, *length) {
                Ok(r) => out.push(r),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        legit.stop.store(true, Ordering::Relaxed);
        let _ = puller.join();
        let _ = prober.join();
        match failure {
            Some(e) => Err(e),
            None => Ok(out),
        }
    });
    sampler.stop();
    rt.shutdown_timeout(Duration::from_secs(2));
    let offers_ucx = target.offers_ucx;
    legit.agent.shutdown();
    target.stop();
    if remove_log {
        let _ = std::fs::remove_file(&log_path);
    }
    let phases = phases_run?;

    let pulls = legit.pulls.lock().unwrap_or_else(|p| p.into_inner());
    let probes = legit.probes.lock().unwrap_or_else(|p| p.into_inner());
    fn of(v: &[Pull], i: usize) -> Vec<&Pull> {
        v.iter().filter(|x| x.phase == i).collect()
    }
    let phase_values: Vec<Value> =
        phases.iter().enumerate().map(|(i, p)| phase_json(p, &of(&pulls, i), &of(&probes, i))).collect();
    let base = &phase_values[0];
    let summary: Vec<Value> = phase_values
        .iter()
        .skip(1)
        .map(|p| {
            let (q, b) = (&p["pulls"], &base["pulls"]);
            json!({
                "phase": p["name"],
                "p50_ratio": ratio(&q["p50_ms"], &b["p50_ms"]),
                "p99_ratio": ratio(&q["p99_ms"], &b["p99_ms"]),
                "pulls_per_sec_ratio": ratio(&q["per_sec"], &b["per_sec"]),
                "rss_growth_mib": p["prefill"]["rss_growth_mib"],
                "pulls_failed": q["failed"],
                "new_connections_failed": p["new_connections"]["failed"],
                "new_connection_p99_ratio": ratio(&p["new_connections"]["p99_ms"], &base["new_connections"]["p99_ms"]),
            })
        })
        .collect();
    Ok((phase_values, summary, offers_ucx))
}

fn run(args: &RunArgs) -> Result<(), String> {
    // Before the legitimate agent's threads start: they inherit the CPUs.
    if let Some(cpus) = &args.legit_cpus {
        cpus.pin_current_thread()?;
    }
    let attack_list = Attack::parse_list(&args.attacks)?;
    let (mut phases, mut summary, offers_ucx) =
        session(args, "", &attack_list, args.baseline_secs, args.duration)?;
    if args.each_secs > 0.0 && attack_list.len() > 1 {
        for a in &attack_list {
            let label = format!("only:{}", a.name());
            let (p, s, _) = session(args, &label, &[*a], args.each_baseline_secs, args.each_secs)?;
            phases.extend(p);
            summary.extend(s);
        }
    }
    let report = json!({
        "config": {
            "conns": args.conns, "addrs": args.addrs, "attacks": attacks::names(&attack_list),
            "duration_secs": args.duration, "baseline_secs": args.baseline_secs,
            "each_secs": args.each_secs, "each_baseline_secs": args.each_baseline_secs,
            "keyed": args.key.is_some(), "insider": args.insider && args.key.is_some(),
            "pull_blocks": args.pull_blocks, "pull_rate": args.pull_rate, "blocks": args.target.blocks, "block_bytes": args.target.block_bytes,
            "transport": args.target.transport.to_string(), "prefill_offers_ucx": offers_ucx,
            "log_filter": args.log_filter, "probe_interval_ms": args.probe_interval_ms,
            "prefill_cpus": args.target.cpus.as_ref().map(ToString::to_string),
            "legit_cpus": args.legit_cpus.as_ref().map(ToString::to_string),
            "attacker_cpus": args.attacker_cpus.as_ref().map(ToString::to_string),
        },
        "phases": phases,
        "summary": summary,
    });
    if args.json {
        println!("{report}");
        eprint!("{}", table(&report));
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    kvxfer::ucx_log_to_stderr();
    let cli = Cli::parse();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        // The prefill child's stderr is a file: its volume is measured without colour codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let r = match &cli.mode {
        Some(Mode::ServePrefill(t)) => target::serve(t),
        None => run(&cli.run),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvxfer-hostile: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
