//! The prefill agent under attack, in its own process: the hidden `serve-prefill` mode of
//! this binary (the child side), and the generator's handle on it (the parent side): a
//! line-based control channel over the child's stdin/stdout, its stderr in a log file, and
//! its RSS, file descriptors and CPU time read from `/proc`.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer::blocking::PrefillAgent;
use kvxfer::{AgentConfig, BlockLayout, TransportChoice};
use kvxfer_mem::pattern;
use kvxfer_proto::Message;
use serde_json::{json, Map, Value};

/// What the child is started with (also the generator's view of the target's layout).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct TargetArgs {
    /// Blocks of the prefill agent's KV cache.
    #[arg(long, default_value_t = 256)]
    pub(crate) blocks: u32,
    /// Bytes per block.
    #[arg(long, default_value_t = 65536)]
    pub(crate) block_bytes: u64,
    /// Lease TTL of the prefill agent, in milliseconds.
    #[arg(long, default_value_t = 120_000)]
    pub(crate) ttl_ms: u64,
    /// Data path of both agents: auto, tcp or ucx (ucx needs the `ucx` feature).
    #[arg(long, default_value = "tcp")]
    pub(crate) transport: TransportChoice,
    /// CPUs the prefill process runs on, e.g. `0` or `0-1` (default: any).
    #[arg(long = "prefill-cpus", value_parser = parse_cpus)]
    pub(crate) cpus: Option<CpuList>,
}

/// A list of CPU numbers (`0`, `0,2`, `0-3`).
#[derive(Debug, Clone)]
pub(crate) struct CpuList(Vec<usize>);

impl std::fmt::Display for CpuList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(usize::to_string).collect();
        f.write_str(&parts.join(","))
    }
}

/// Parses `0`, `0,2` or `0-3`.
pub(crate) fn parse_cpus(s: &str) -> Result<CpuList, String> {
    let mut cpus = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("CPU {x:?}: {e}"));
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(num(a)?..=num(b)?),
            None => cpus.push(num(part)?),
        }
    }
    match cpus.iter().all(|&c| c < rustix::thread::CpuSet::MAX_CPU) && !cpus.is_empty() {
        true => Ok(CpuList(cpus)),
        false => Err(format!("no usable CPU in {s:?}")),
    }
}

impl CpuList {
    /// Pins the calling thread to these CPUs; threads it starts afterwards inherit them.
    pub(crate) fn pin_current_thread(&self) -> Result<(), String> {
        let mut set = rustix::thread::CpuSet::new();
        for &c in &self.0 {
            set.set(c);
        }
        rustix::thread::sched_setaffinity(None, &set).map_err(|e| format!("pinning to CPUs {self}: {e}"))
    }
}

impl TargetArgs {
    /// The layout both agents use.
    pub(crate) fn layout(&self) -> Result<BlockLayout, String> {
        BlockLayout::single(self.blocks, self.block_bytes).map_err(|e| e.to_string())
    }

    fn to_args(&self) -> Vec<String> {
        vec![
            "--blocks".into(),
            self.blocks.to_string(),
            "--block-bytes".into(),
            self.block_bytes.to_string(),
            "--ttl-ms".into(),
            self.ttl_ms.to_string(),
            "--transport".into(),
            self.transport.to_string(),
        ]
        .into_iter()
        .chain(self.cpus.iter().flat_map(|c| ["--prefill-cpus".to_owned(), c.to_string()]))
        .collect()
    }
}

/// Turns a `Debug` rendering of a struct of counters (`Name { a: 1, b: 2 }`) into a JSON
/// object of its numeric fields, so fields added later appear without a change here.
pub(crate) fn debug_fields(debug: &str) -> Map<String, Value> {
    let inner = debug.split_once('{').map(|(_, r)| r).unwrap_or(debug);
    let inner = inner.rsplit_once('}').map(|(l, _)| l).unwrap_or(inner);
    let mut out = Map::new();
    for field in inner.split(',') {
        let Some((name, value)) = field.split_once(':') else { continue };
        let (name, value) = (name.trim(), value.trim());
        if let Ok(n) = value.parse::<u64>() {
            out.insert(name.to_owned(), json!(n));
        } else if let Ok(b) = value.parse::<bool>() {
            out.insert(name.to_owned(), json!(b));
        }
    }
    out
}

/// The child: a prefill agent on 127.0.0.1 answering `lease N`, `stats` and `quit` lines on
/// stdin with one JSON line each on stdout. Its cluster key, if any, comes from the
/// environment (`KVXFER_CLUSTER_KEY`).
pub(crate) fn serve(args: &TargetArgs) -> Result<(), String> {
    // Before any thread starts: the agent's threads inherit the CPUs.
    if let Some(cpus) = &args.cpus {
        cpus.pin_current_thread()?;
    }
    let layout = args.layout()?;
    let mem = pattern::alloc_filled(layout).map_err(|e| e.to_string())?;
    let config = AgentConfig::new("hostile-target")
        .lease_ttl(Duration::from_millis(args.ttl_ms))
        .transport(args.transport)
        .cluster_key_from_env()
        .map_err(|e| e.to_string())?;
    let keyed = config.cluster_key.is_some();
    let agent = PrefillAgent::start(config, "127.0.0.1:0", mem).map_err(|e| e.to_string())?;
    // Lease ends are not needed; drain them so the channel does not grow.
    let events = agent.events().clone();
    std::thread::spawn(move || for _ in events.iter() {});
    let emit = |v: Value| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{v}");
        let _ = out.flush();
    };
    emit(json!({
        "event": "listening", "addr": agent.local_addr().to_string(), "pid": std::process::id(),
        "offers_ucx": agent.offers_ucx(), "keyed": keyed,
    }));
    let mut next_block = 0u32;
    let mut parents = 0u64;
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("lease") => {
                let n = words.next().and_then(|w| w.parse::<u32>().ok()).unwrap_or(1).clamp(1, args.blocks);
                let blocks: Vec<u32> = (0..n)
                    .map(|_| {
                        let b = next_block % args.blocks;
                        next_block = next_block.wrapping_add(1);
                        b
                    })
                    .collect();
                parents += 1;
                let parent = format!("H{parents}");
                match agent.lease_parent(&parent, vec![blocks], 1, None) {
                    Ok(r) => emit(json!({"result": hex::encode(r.to_wire().encode_to_vec())})),
                    Err(e) => emit(json!({"error": e.to_string()})),
                }
            }
            Some("stats") => {
                let s = agent.stats();
                emit(json!({
                    "server": debug_fields(&format!("{:?}", s.server)),
                    "leases": debug_fields(&format!("{:?}", s.leases)),
                    "connections_open": s.connections_open,
                }));
            }
            Some("quit") => break,
            other => emit(json!({"error": format!("unknown command {other:?}")})),
        }
    }
    agent.shutdown();
    Ok(())
}

/// The generator's handle on the child process.
pub(crate) struct Target {
    child: Child,
    control: Mutex<(ChildStdin, BufReader<ChildStdout>)>,
    /// The child's process id (for `/proc`).
    pub(crate) pid: u32,
    /// Where the prefill agent listens.
    pub(crate) addr: SocketAddr,
    /// Whether the agent offers UCX (pins are only served then).
    pub(crate) offers_ucx: bool,
    /// The file the child's stderr (its log) goes to.
    pub(crate) log_path: PathBuf,
}

impl Target {
    /// Starts this binary's `serve-prefill` mode as a child process.
    pub(crate) fn start(
        args: &TargetArgs,
        key_hex: Option<&str>,
        log_filter: &str,
        log_path: &Path,
    ) -> Result<Target, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let log = File::create(log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve-prefill")
            .args(args.to_args())
            .env("RUST_LOG", log_filter)
            .env_remove(kvxfer::CLUSTER_KEY_FILE_ENV)
            .env_remove(kvxfer::CLUSTER_KEY_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        if let Some(k) = key_hex {
            cmd.env(kvxfer::CLUSTER_KEY_ENV, k);
        }
        let mut child = cmd.spawn().map_err(|e| format!("spawning the prefill child: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err("the prefill child has no stdin/stdout".into());
        };
        let mut stdout = BufReader::new(stdout);
        let mut first = String::new();
        let read = stdout.read_line(&mut first);
        let hello: Value = match read {
            Ok(n) if n > 0 => serde_json::from_str(&first).unwrap_or(Value::Null),
            _ => Value::Null,
        };
        let addr = hello["addr"].as_str().and_then(|a| a.parse().ok());
        let Some(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(log_path).unwrap_or_default();
            return Err(format!("the prefill child did not start: {first:?}; its log: {log}"));
        };
        Ok(Target {
            pid: child.id(),
            child,
            control: Mutex::new((stdin, stdout)),
            addr,
            offers_ucx: hello["offers_ucx"].as_bool().unwrap_or(false),
            log_path: log_path.to_owned(),
        })
    }

    /// Sends one command line, returns the child's JSON answer.
    pub(crate) fn ask(&self, line: &str) -> Result<Value, String> {
        let mut guard = self.control.lock().unwrap_or_else(|p| p.into_inner());
        let (stdin, stdout) = &mut *guard;
        writeln!(stdin, "{line}").and_then(|()| stdin.flush()).map_err(|e| format!("to the child: {e}"))?;
        let mut answer = String::new();
        match stdout.read_line(&mut answer) {
            Ok(0) => Err("the prefill child closed its stdout (it died?)".into()),
            Ok(_) => serde_json::from_str(&answer).map_err(|e| format!("child answered {answer:?}: {e}")),
            Err(e) => Err(format!("from the child: {e}")),
        }
    }

    /// A new lease of `blocks` blocks: the wire `PrefillResult`.
    pub(crate) fn lease(&self, blocks: u32) -> Result<kvxfer_proto::v1::PrefillResult, String> {
        let v = self.ask(&format!("lease {blocks}"))?;
        let Some(h) = v["result"].as_str() else {
            return Err(format!("lease refused: {v}"));
        };
        let bytes = hex::decode(h).map_err(|e| e.to_string())?;
        kvxfer_proto::v1::PrefillResult::decode(&bytes[..]).map_err(|e| e.to_string())
    }

    /// The agent's counters: `{"server": {..}, "leases": {..}, "connections_open": n}`.
    pub(crate) fn stats(&self) -> Result<Value, String> {
        self.ask("stats")
    }

    /// Bytes the child has logged so far.
    pub(crate) fn log_bytes(&self) -> u64 {
        std::fs::metadata(&self.log_path).map(|m| m.len()).unwrap_or(0)
    }

    /// Stops the child (asks, then kills it after a grace period).
    pub(crate) fn stop(mut self) {
        let _ = self.ask("quit");
        for _ in 0..50 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One reading of a process's resources.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProcSample {
    /// Resident set size, KiB (`VmRSS`).
    pub(crate) rss_kib: u64,
    /// Open file descriptors.
    pub(crate) fds: u64,
    /// User plus system CPU time, in clock ticks (`/proc/PID/stat` utime + stime).
    pub(crate) cpu_ticks: u64,
}

/// Clock ticks per second of `/proc/PID/stat` (USER_HZ, 100 on Linux).
pub(crate) const TICKS_PER_SEC: f64 = 100.0;

/// Reads `pid`'s RSS, descriptors and CPU time (zeros for what cannot be read).
pub(crate) fn sample(pid: u32) -> ProcSample {
    let rss_kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as u64).unwrap_or(0);
    let cpu_ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces): state is field 3, utime
            // and stime are fields 14 and 15.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: u64 = f.get(11)?.parse().ok()?;
            let stime: u64 = f.get(12)?.parse().ok()?;
            Some(utime + stime)
        })
        .unwrap_or(0);
    ProcSample { rss_kib, fds, cpu_ticks }
}

/// Samples a process every 100 ms and keeps the peaks since the last [`Sampler::reset`].
pub(crate) struct Sampler {
    rss_peak: AtomicU64,
    fds_peak: AtomicU64,
    stop: AtomicBool,
}

impl Sampler {
    /// Starts sampling `pid` on a thread of its own.
    pub(crate) fn start(pid: u32) -> Arc<Sampler> {
        let s = Arc::new(Sampler {
            rss_peak: AtomicU64::new(0),
            fds_peak: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let t = s.clone();
        std::thread::spawn(move || {
            while !t.stop.load(Ordering::Relaxed) {
                t.observe(sample(pid));
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        s
    }

    fn observe(&self, p: ProcSample) {
        self.rss_peak.fetch_max(p.rss_kib, Ordering::Relaxed);
        self.fds_peak.fetch_max(p.fds, Ordering::Relaxed);
    }

    /// Starts a new peak at `now`.
    pub(crate) fn reset(&self, now: ProcSample) {
        self.rss_peak.store(now.rss_kib, Ordering::Relaxed);
        self.fds_peak.store(now.fds, Ordering::Relaxed);
    }

    /// Peak RSS (KiB) and descriptors since the last reset, `now` included.
    pub(crate) fn peaks(&self, now: ProcSample) -> (u64, u64) {
        self.observe(now);
        (self.rss_peak.load(Ordering::Relaxed), self.fds_peak.load(Ordering::Relaxed))
    }

    /// Stops the sampling thread.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
