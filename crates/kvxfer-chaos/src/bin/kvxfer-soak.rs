//! The soak run: for `--seconds`, drivers lease parents with random n in 1..=8 on prefill
//! agents, a decode agent pulls them — skipping random children, cancelling random ones —
//! while prefill agents restart at random. The owner side hands blocks back only when
//! their lease ends. At the end the books must balance exactly:
//!
//! - every lease ended exactly once (pulled, released or expired) or died with its agent;
//! - expired only where a child was skipped or its pull was cut by a peer restart;
//! - zero unrecognized notifications (every peer here is well behaved);
//! - every block of every surviving prefill agent back in its free pool;
//! - resident memory back near where it started.
//!
//! `cargo run --release -p kvxfer-chaos --bin kvxfer-soak -- --seconds 300`
//!
//! Every agent authenticates its peers with the cluster key of `KVXFER_CLUSTER_KEY` /
//! `KVXFER_CLUSTER_KEY_FILE`, or, when neither is set, a random key for the run.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use clap::Parser;
use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{AgentConfig, BlockId, BlockLayout, ChildOutcome, EndKind, KvMemory, TransportChoice};
use kvxfer_mem::pattern;
use rand::{Rng, SeedableRng};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    about = "kvxfer soak: random parents, cancels, skipped children and peer restarts; the books must balance"
)]
struct Cli {
    /// How long to generate traffic.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Prefill agents (peers) alive at once.
    #[arg(long, default_value_t = 2)]
    peers: usize,
    /// Threads submitting parents.
    #[arg(long, default_value_t = 4)]
    drivers: usize,
    /// Mean time between peer restarts, milliseconds (0: none).
    #[arg(long, default_value_t = 3000)]
    restart_every_ms: u64,
    /// Lease ttl, milliseconds.
    #[arg(long, default_value_t = 1000)]
    ttl_ms: u64,
    /// Chance a child is skipped (never pulled: its lease must expire).
    #[arg(long, default_value_t = 0.05)]
    skip: f64,
    /// Chance a child is cancelled by the decode side.
    #[arg(long, default_value_t = 0.05)]
    cancel: f64,
    /// Blocks per prefill agent.
    #[arg(long, default_value_t = 4096)]
    blocks: u32,
    /// Bytes per block.
    #[arg(long, default_value_t = 16384)]
    block_bytes: u64,
    /// Print the final books as one JSON line.
    #[arg(long)]
    json: bool,
    /// The cluster key of every agent (from the environment, else random for the run).
    #[arg(skip)]
    key: Option<kvxfer::ClusterKey>,
}

impl Cli {
    /// `config` with the run's cluster key.
    fn keyed(&self, config: AgentConfig) -> AgentConfig {
        match &self.key {
            Some(k) => config.cluster_key(k.clone()),
            None => config,
        }
    }
}

/// One prefill agent's life: the agent, its free blocks, the ends it delivered.
struct Incarnation {
    id: usize,
    agent: PrefillAgent,
    free: Mutex<Vec<BlockId>>,
    /// Ends delivered: pulled, released, expired.
    ends: [AtomicU64; 3],
}

/// What the owner does with a lease end: free its blocks, count it, enter it in the ledger.
fn record_end(
    inc: usize,
    ends: &[AtomicU64; 3],
    e: kvxfer::LeaseEnd,
    free: &mut Vec<BlockId>,
    ledger: &Mutex<Ledger>,
    at_shutdown: bool,
) {
    free.extend(e.blocks.iter().copied());
    let k = match e.kind {
        EndKind::Pulled => 0,
        EndKind::Released => 1,
        EndKind::Expired => 2,
    };
    ends[k].fetch_add(1, Ordering::Relaxed);
    ledger.lock().expect("ledger").ended(inc, e.remote_request_id, (e.kind, at_shutdown));
}

impl Incarnation {
    fn drain(&self, ledger: &Mutex<Ledger>) {
        while let Ok(e) = self.agent.events().try_recv() {
            let mut free = self.free.lock().expect("pool");
            record_end(self.id, &self.ends, e, &mut free, ledger, false);
        }
    }
}

/// One side of a lease's story, waiting for the other.
#[derive(Debug, Clone, Copy)]
enum Side {
    Seen(Seen),
    /// How it ended, and whether the end came with its agent's shutdown.
    Ended((EndKind, bool)),
}

/// Matches each lease's end (prefill side) with what the decode side saw, as both arrive:
/// only leases in flight are held, so the soak's own bookkeeping stays small.
#[derive(Default)]
struct Ledger {
    pending: HashMap<(usize, Arc<str>), Side>,
    skipped: u64,
    cancelled: u64,
    failed: u64,
    unacknowledged: u64,
    matched: u64,
    unexplained_expired: u64,
    mismatched: u64,
    duplicate_ends: u64,
    /// Failed or unacknowledged children per incarnation (only restarts may cause them).
    trouble: HashMap<usize, u64>,
    /// Incarnations dropped by a restart, whose books are closed.
    dead: HashSet<usize>,
    /// Decode outcomes of leases that died with their (restarted) prefill agent.
    died_seen: u64,
    examples: Vec<String>,
}

impl Ledger {
    fn seen(&mut self, inc: usize, id: Arc<str>, s: Seen) {
        match s {
            Seen::Skipped => self.skipped += 1,
            Seen::Cancelled { .. } => self.cancelled += 1,
            Seen::Failed => self.failed += 1,
            Seen::Done { acknowledged: false } => self.unacknowledged += 1,
            Seen::Done { acknowledged: true } => {}
        }
        if matches!(s, Seen::Failed | Seen::Done { acknowledged: false }) {
            *self.trouble.entry(inc).or_default() += 1;
        }
        match self.pending.remove(&(inc, id.clone())) {
            Some(Side::Ended(kind)) => self.classify(inc, &id, kind, s),
            Some(Side::Seen(prev)) => self.note(format!("{inc}/{id}: reported twice ({prev:?}, {s:?})")),
            // Its agent is gone with every end it delivered: this lease died with it.
            None if self.dead.contains(&inc) => self.died_seen += 1,
            None => {
                self.pending.insert((inc, id), Side::Seen(s));
            }
        }
    }

    fn ended(&mut self, inc: usize, id: Arc<str>, kind: (EndKind, bool)) {
        match self.pending.remove(&(inc, id.clone())) {
            Some(Side::Seen(s)) => self.classify(inc, &id, kind, s),
            Some(Side::Ended(prev)) => {
                self.duplicate_ends += 1;
                self.note(format!("{inc}/{id}: ended twice ({prev:?}, {kind:?})"));
            }
            None => {
                self.pending.insert((inc, id), Side::Ended(kind));
            }
        }
    }

    fn classify(&mut self, inc: usize, id: &str, (kind, at_shutdown): (EndKind, bool), s: Seen) {
        let ok = match kind {
            // A shutdown releases every live lease, whatever the decode side made of it.
            EndKind::Released if at_shutdown => true,
            // Nobody pulled it: skipped, or the decode side could not reach the peer.
            EndKind::Expired => matches!(
                s,
                Seen::Skipped
                    | Seen::Failed
                    | Seen::Done { acknowledged: false }
                    | Seen::Cancelled { released: false }
            ),
            // Pulled; a cancel that raced a finished read loses to it.
            EndKind::Pulled => matches!(s, Seen::Done { acknowledged: true } | Seen::Cancelled { .. }),
            // The decode side releases what it cancelled and what failed.
            EndKind::Released => matches!(s, Seen::Cancelled { released: true } | Seen::Failed),
        };
        if ok {
            self.matched += 1;
        } else if kind == EndKind::Expired {
            self.unexplained_expired += 1;
            self.note(format!("{inc}/{id}: expired, decode saw {s:?}"));
        } else {
            self.mismatched += 1;
            self.note(format!("{inc}/{id}: ended {kind:?}, decode saw {s:?}"));
        }
    }

    /// Closes a restarted incarnation after its last end was entered: what the decode side
    /// saw of leases that never ended died with the agent.
    fn bury(&mut self, inc: usize) {
        self.dead.insert(inc);
        let before = self.pending.len();
        self.pending.retain(|(i, _), side| *i != inc || matches!(side, Side::Ended(_)));
        self.died_seen += (before - self.pending.len()) as u64;
    }

    fn note(&mut self, m: String) {
        if self.examples.len() < 20 {
            self.examples.push(m);
        }
    }
}

/// The books of one finished incarnation.
#[derive(Default, Debug, Clone, Copy)]
struct Books {
    leased: u64,
    pulled: u64,
    released: u64,
    expired: u64,
    died_live: u64,
    unrecognized: u64,
    bad_token: u64,
    blocks_missing: u64,
    counter_mismatch: u64,
}

/// What the decode side saw, per child, keyed by (incarnation, remote request id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Skipped,
    Done { acknowledged: bool },
    Cancelled { released: bool },
    Failed,
}

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn start_prefill(cli: &Cli, id: usize) -> Result<Arc<Incarnation>, String> {
    let layout = BlockLayout::single(cli.blocks, cli.block_bytes).map_err(|e| e.to_string())?;
    let mem = pattern::alloc_filled(layout).map_err(|e| e.to_string())?;
    let config = AgentConfig::new(format!("soak-prefill-{id}"))
        .engine_id(format!("soak-engine-{id}"))
        .lease_ttl(Duration::from_millis(cli.ttl_ms))
        .io_timeout(Duration::from_secs(2))
        .transport(TransportChoice::Tcp);
    let agent = PrefillAgent::start(cli.keyed(config), "127.0.0.1:0", mem).map_err(|e| e.to_string())?;
    Ok(Arc::new(Incarnation {
        id,
        agent,
        free: Mutex::new((0..cli.blocks).collect()),
        ends: Default::default(),
    }))
}

/// Closes an incarnation's books at a restart: waits until no driver holds it, reads its
/// counters, drops it (a graceful shutdown: every live lease ends released), and drains
/// every end it delivered. Leases that had not ended by then die with it. A survivor (`survivor`: traffic over) must match its counters exactly.
fn retire(inc: Arc<Incarnation>, blocks: u32, survivor: bool, ledger: &Mutex<Ledger>) -> Books {
    // Drivers hold the incarnation only while leasing on it.
    let mut inc = inc;
    let inc = loop {
        match Arc::try_unwrap(inc) {
            Ok(i) => break i,
            Err(shared) => {
                inc = shared;
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    };
    let s = inc.agent.stats().leases;
    let events = inc.agent.events().clone();
    let Incarnation { id, agent, free, ends } = inc;
    // Ends delivered before the shutdown, then those of the shutdown (it releases every
    // live lease; the channel keeps them after its sender is gone).
    let mut free = free.into_inner().expect("pool");
    for e in events.try_iter() {
        record_end(id, &ends, e, &mut free, ledger, false);
    }
    drop(agent);
    for e in events.try_iter() {
        record_end(id, &ends, e, &mut free, ledger, true);
    }
    if !survivor {
        ledger.lock().expect("ledger").bury(id);
    }
    let [pulled, released, expired] = ends.each_ref().map(|a| a.load(Ordering::Relaxed));
    let mut books = Books {
        leased: s.leased,
        pulled,
        released,
        expired,
        died_live: s.leased.saturating_sub(pulled + released + expired),
        unrecognized: s.unrecognized,
        bad_token: s.bad_token,
        blocks_missing: 0,
        counter_mismatch: 0,
    };
    if survivor {
        // No traffic any more: every block is back and the counters match what was delivered.
        books.blocks_missing = u64::from(blocks) - free.len() as u64;
        if (pulled, released, expired, 0) != (s.pulled, s.released, s.expired, s.live) {
            eprintln!("survivor {id}: delivered ends {pulled}/{released}/{expired} != counters {s:?}");
            books.counter_mismatch = 1;
        }
    }
    books
}

fn main() -> std::process::ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: escape codes in a log file are noise.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let mut cli = Cli::parse();
    cli.key = match kvxfer::ClusterKey::from_env() {
        Ok(key) => Some(key.unwrap_or_else(kvxfer::ClusterKey::generate)),
        Err(e) => {
            eprintln!("kvxfer-soak: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match run(&cli) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kvxfer-soak: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

type Slots = Arc<RwLock<Vec<Arc<Incarnation>>>>;

fn run(cli: &Cli) -> Result<bool, String> {
    let mut next_id = 0;
    let slots: Slots = Arc::new(RwLock::new(Vec::new()));
    for _ in 0..cli.peers {
        slots.write().expect("slots").push(start_prefill(cli, next_id)?);
        next_id += 1;
    }
    // Local blocks: enough for every driver's largest parent (8 children × 4 blocks).
    let local_blocks = (cli.drivers as u32 * 32).max(64);
    let decode_layout = BlockLayout::single(local_blocks, cli.block_bytes).map_err(|e| e.to_string())?;
    let decode_config =
        AgentConfig::new("soak-decode").io_timeout(Duration::from_secs(2)).transport(TransportChoice::Tcp);
    let decode = Arc::new(
        DecodeAgent::start(
            cli.keyed(decode_config),
            KvMemory::alloc(decode_layout).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?,
    );
    let local_free = Arc::new(Mutex::new((0..local_blocks).collect::<Vec<BlockId>>()));
    let rss_setup = rss_kib("VmRSS:");
    let stop = Arc::new(AtomicBool::new(false));
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let parents = Arc::new(AtomicU64::new(0));
    let bad_bytes = Arc::new(AtomicU64::new(0));
    let submit_errors = Arc::new(AtomicU64::new(0));
    let retired: Arc<Mutex<Vec<(usize, Books)>>> = Arc::default();

    // The owners: hand blocks back as leases end.
    let owner = {
        let (slots, stop, ledger) = (slots.clone(), stop.clone(), ledger.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for inc in slots.read().expect("slots").iter() {
                    inc.drain(&ledger);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };

    let started = Instant::now();
    let until = started + Duration::from_secs(cli.seconds);
    let mut drivers = Vec::new();
    for d in 0..cli.drivers {
        let (slots, decode, local_free, ledger) =
            (slots.clone(), decode.clone(), local_free.clone(), ledger.clone());
        let (parents, bad_bytes, submit_errors) = (parents.clone(), bad_bytes.clone(), submit_errors.clone());
        let (skip, cancel, seed) = (cli.skip, cli.cancel, cli.seed);
        drivers.push(std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(driver_seed(seed, d));
            let mut k = 0u64;
            while Instant::now() < until {
                k += 1;
                let n: u32 = rng.random_range(1..=8);
                let bpc: usize = rng.random_range(1..=4);
                let inc = {
                    let s = slots.read().expect("slots");
                    s[rng.random_range(0..s.len())].clone()
                };
                let parent = format!("d{d}-p{k}");
                // Take blocks from the owner's pool; if it is short, wait for ends.
                let remote: Vec<Vec<BlockId>> = {
                    let mut free = inc.free.lock().expect("pool");
                    if free.len() < n as usize * bpc {
                        drop(free);
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    (0..n).map(|_| (0..bpc).filter_map(|_| free.pop()).collect()).collect()
                };
                let result = match inc.agent.lease_parent(&parent, remote.clone(), 1, None) {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("lease refused: {e}");
                        inc.free.lock().expect("pool").extend(remote.into_iter().flatten());
                        continue;
                    }
                };
                let inc_id = inc.id;
                drop(inc); // a restart must not wait for this pull
                parents.fetch_add(1, Ordering::Relaxed);
                // Skip some children (at least one is pulled).
                let mut selected: Vec<u32> = (0..n).filter(|_| !rng.random_bool(skip)).collect();
                if selected.is_empty() {
                    selected.push(rng.random_range(0..n));
                }
                {
                    let mut ledger = ledger.lock().expect("ledger");
                    for c in result.children() {
                        if !selected.contains(&c.child_index()) {
                            ledger.seen(inc_id, c.remote_request_id().into(), Seen::Skipped);
                        }
                    }
                }
                let local: Vec<Vec<BlockId>> = {
                    let mut free = local_free.lock().expect("local pool");
                    selected.iter().map(|_| (0..bpc).filter_map(|_| free.pop()).collect()).collect()
                };
                let selection: Vec<(u32, Vec<BlockId>)> =
                    selected.iter().copied().zip(local.clone()).collect();
                let handle = match decode.submit_subset(&result, selection) {
                    Ok(h) => h,
                    Err(e) => {
                        eprintln!("submit refused: {e}");
                        submit_errors.fetch_add(1, Ordering::Relaxed);
                        local_free.lock().expect("local pool").extend(local.into_iter().flatten());
                        continue;
                    }
                };
                for &i in &selected {
                    if rng.random_bool(cancel) {
                        handle.cancel_child(i);
                    }
                }
                let report = handle.wait();
                let mut outcomes = Vec::with_capacity(report.children.len());
                for c in &report.children {
                    let pos = selected.iter().position(|&i| i == c.child_index).expect("selected child");
                    let s = match &c.outcome {
                        ChildOutcome::Done { acknowledged, .. } => {
                            let i = c.child_index as usize;
                            // SAFETY: this child reported; nothing writes its local blocks now.
                            let bad =
                                unsafe { pattern::check_blocks(decode.memory(), &remote[i], &local[pos]) };
                            if !matches!(bad, Ok(None)) {
                                bad_bytes.fetch_add(1, Ordering::Relaxed);
                            }
                            Seen::Done { acknowledged: *acknowledged }
                        }
                        ChildOutcome::Cancelled { released, .. } => Seen::Cancelled { released: *released },
                        ChildOutcome::Failed { .. } => Seen::Failed,
                        // Only a one-sided (UCX) read can be left running; the soak pulls over
                        // TCP. Its blocks would be the agent's until reclaimed.
                        ChildOutcome::FailedBlocksHeld { .. } => Seen::Failed,
                    };
                    outcomes.push((c.remote_request_id.as_str().into(), s));
                }
                let mut ledger = ledger.lock().expect("ledger");
                for (id, s) in outcomes {
                    ledger.seen(inc_id, id, s);
                }
                drop(ledger);
                local_free.lock().expect("local pool").extend(local.into_iter().flatten());
            }
        }));
    }

    // Random peer restarts.
    let mut rng = rand::rngs::StdRng::seed_from_u64(cli.seed);
    let mut restarts = 0u64;
    let mut last_report = Instant::now();
    // Memory once every agent and connection exists: what the end is compared with.
    let warmup = started + Duration::from_secs((cli.seconds / 20).clamp(1, 10));
    let mut rss_warm = None;
    while Instant::now() < until {
        if rss_warm.is_none() && Instant::now() >= warmup {
            rss_warm = Some(rss_kib("VmRSS:"));
        }
        let wait = if cli.restart_every_ms == 0 {
            Duration::from_millis(200)
        } else {
            Duration::from_millis(rng.random_range(cli.restart_every_ms / 2..=cli.restart_every_ms * 3 / 2))
        };
        let slice = if rss_warm.is_none() { warmup } else { until };
        std::thread::sleep(wait.min(slice.saturating_duration_since(Instant::now())));
        if cli.restart_every_ms > 0 && Instant::now() < until {
            let fresh = start_prefill(cli, next_id)?;
            next_id += 1;
            let old = {
                let mut s = slots.write().expect("slots");
                let i = rng.random_range(0..s.len());
                std::mem::replace(&mut s[i], fresh)
            };
            let id = old.id;
            retired.lock().expect("retired").push((id, retire(old, cli.blocks, false, &ledger)));
            restarts += 1;
        }
        if last_report.elapsed() > Duration::from_secs(10) {
            last_report = Instant::now();
            eprintln!(
                "[{:>4.0} s] parents {} restarts {restarts} rss {} KiB",
                started.elapsed().as_secs_f64(),
                parents.load(Ordering::Relaxed),
                rss_kib("VmRSS:")
            );
        }
    }
    for d in drivers {
        d.join().map_err(|_| "a driver panicked")?;
    }
    // Let skipped children's leases expire, then close every book.
    std::thread::sleep(Duration::from_millis(cli.ttl_ms * 2 + 500));
    stop.store(true, Ordering::Relaxed);
    owner.join().map_err(|_| "the owner thread panicked")?;
    // Same agents alive as after warm-up, no traffic: memory should be back near there.
    let rss_end = rss_kib("VmRSS:");
    let rss_warm = rss_warm.unwrap_or(rss_setup);
    let survivors: Vec<Arc<Incarnation>> = std::mem::take(&mut *slots.write().expect("slots"));
    let mut all = std::mem::take(&mut *retired.lock().expect("retired"));
    for inc in survivors {
        let id = inc.id;
        all.push((id, retire(inc, cli.blocks, true, &ledger)));
    }
    // Restarted peers must not pile up in the decode agent (entries or sockets).
    let decode_peers = decode.stats().peers;
    drop(decode);

    // Restarted agents' leases were settled when they were dropped (`Ledger::bury`), so
    // anything still unmatched is a lease whose end and decode outcome never met.
    let mut ledger = std::mem::take(&mut *ledger.lock().expect("ledger"));
    let died_seen = ledger.died_seen;
    let mut unmatched = 0u64;
    let pending = std::mem::take(&mut ledger.pending);
    for ((inc, id), side) in pending {
        unmatched += 1;
        ledger.note(format!("{inc}/{id}: unmatched {side:?}"));
    }
    // Without a restart nothing fails: only agents that were restarted (buried) may have
    // failed or unacknowledged children.
    let failures_without_restart: u64 =
        ledger.trouble.iter().filter(|(inc, _)| !ledger.dead.contains(inc)).map(|(_, n)| n).sum();
    let (skipped, cancelled, failed, unacknowledged) =
        (ledger.skipped, ledger.cancelled, ledger.failed, ledger.unacknowledged);
    let unexplained_expired = ledger.unexplained_expired;
    let mismatched = ledger.mismatched;

    let mut total = Books::default();
    for (_, b) in &all {
        total.leased += b.leased;
        total.pulled += b.pulled;
        total.released += b.released;
        total.expired += b.expired;
        total.died_live += b.died_live;
        total.unrecognized += b.unrecognized;
        total.bad_token += b.bad_token;
        total.blocks_missing += b.blocks_missing;
        total.counter_mismatch += b.counter_mismatch;
    }
    let rss_teardown = rss_kib("VmRSS:");
    let balanced = total.leased == total.pulled + total.released + total.expired + total.died_live;
    let survivors_clean = all.iter().rev().take(cli.peers).all(|(_, b)| b.died_live == 0);
    let ok = balanced
        && survivors_clean
        && ledger.duplicate_ends == 0
        && unmatched == 0
        && failures_without_restart == 0
        && total.unrecognized == 0
        && total.bad_token == 0
        && total.blocks_missing == 0
        && total.counter_mismatch == 0
        && decode_peers <= cli.peers as u64 + 2
        && unexplained_expired == 0
        && mismatched == 0
        && bad_bytes.load(Ordering::Relaxed) == 0
        && submit_errors.load(Ordering::Relaxed) == 0;
    let summary = json!({
        "seconds": cli.seconds, "seed": cli.seed, "ok": ok,
        "parents": parents.load(Ordering::Relaxed), "restarts": restarts, "incarnations": all.len(),
        "leased": total.leased, "pulled": total.pulled, "released": total.released, "expired": total.expired,
        "died_with_peer": total.died_live, "balanced": balanced,
        "children_skipped": skipped, "children_cancelled": cancelled, "children_failed": failed,
        "children_done_unacknowledged": unacknowledged,
        "expired_unexplained": unexplained_expired, "ends_mismatched": mismatched,
        "ends_matched": ledger.matched, "outcomes_of_leases_that_died": died_seen, "unmatched": unmatched,
        "failures_without_restart": failures_without_restart,
        "duplicate_ends": ledger.duplicate_ends, "unrecognized_notifications": total.unrecognized,
        "bad_tokens": total.bad_token, "decode_peers_at_end": decode_peers, "blocks_not_handed_back": total.blocks_missing,
        "children_with_wrong_bytes": bad_bytes.load(Ordering::Relaxed),
        "rss_after_setup_kib": rss_setup, "rss_after_warmup_kib": rss_warm, "rss_end_kib": rss_end,
        "rss_after_teardown_kib": rss_teardown, "rss_peak_kib": rss_kib("VmHWM:"),
    });
    for m in &ledger.examples {
        eprintln!("  {m}");
    }
    if cli.json {
        println!("{summary}");
    } else {
        println!(
            "soak {} s: {} parents, {} restarts; leased {} = pulled {} + released {} + expired {} + died with peer {} ({}); \
             skipped {skipped}, cancelled {cancelled}, failed {failed}, done but unacknowledged {unacknowledged}; unexplained expiries {}, mismatched ends {}, \
             duplicate ends {}, unrecognized {}, blocks not handed back {}; RSS after warm-up {} KiB, at the end {} KiB \
             (peak {}, after teardown {}); {}",
            cli.seconds,
            parents.load(Ordering::Relaxed),
            restarts,
            total.leased,
            total.pulled,
            total.released,
            total.expired,
            total.died_live,
            if balanced { "balanced" } else { "NOT BALANCED" },
            unexplained_expired,
            mismatched,
            ledger.duplicate_ends,
            total.unrecognized,
            total.blocks_missing,
            rss_warm,
            rss_end,
            rss_kib("VmHWM:"),
            rss_teardown,
            if ok { "OK" } else { "FAILED" }
        );
    }
    Ok(ok)
}

fn driver_seed(seed: u64, driver: usize) -> u64 {
    seed ^ 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(driver as u64 + 1)
}
