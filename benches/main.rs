//! kvxfer-bench: the transfer benchmark, with the machine's ceilings measured in the same run.
//!
//! ```text
//! kvxfer-bench --transport tcp --block-bytes 64K,2M --baseline --json     # one process
//! kvxfer-bench serve --listen 127.0.0.1:7300                              # prefill process
//! kvxfer-bench pull --peer 127.0.0.1:7300 --transport ucx --block-bytes 64K,2M
//! ```
//! Every pulled byte is checked against the pattern it was filled with unless `--no-verify`.
//! Agents authenticate each other with the cluster key in `KVXFER_CLUSTER_KEY` (hex) or
//! `KVXFER_CLUSTER_KEY_FILE` when one is set (both processes of a two-process run need it).
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{AgentConfig, BlockId, BlockLayout, ChildOutcome, KvMemory, PrefillResult, TransportChoice};
use kvxfer_mem::pattern;
use kvxfer_proto::Message;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(name = "kvxfer-bench", about = "kvxfer transfer benchmark (like nixlbench), with its ceilings")]
struct Cli {
    #[command(subcommand)]
    mode: Option<Mode>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// The prefill side of a two-process run: leases on request and serves the blocks.
    Serve(ServeArgs),
    /// The decode side of a two-process run: drives `serve` and pulls.
    Pull {
        /// The control address of a `kvxfer-bench serve`.
        #[arg(long)]
        peer: String,
        #[command(flatten)]
        run: RunArgs,
    },
}

#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// Control address to listen on (the agent itself takes a free port per block size).
    #[arg(long, default_value = "127.0.0.1:7300")]
    listen: String,
    /// Data path offered: auto, tcp or ucx.
    #[arg(long, default_value = "auto")]
    transport: TransportChoice,
    /// UCX transports (UCX_TLS).
    #[arg(long)]
    ucx_tls: Option<String>,
    /// UCX peer-failure handling (UCX 1.13 then avoids shared memory).
    #[arg(long)]
    ucx_peer_failure: bool,
    /// Serve this many runs, then exit (0: until told to quit).
    #[arg(long, default_value_t = 0)]
    runs: u32,
}

#[derive(Args, Debug, Clone)]
struct RunArgs {
    /// Data path: tcp, ucx or auto.
    #[arg(long, default_value = "tcp")]
    transport: TransportChoice,
    /// UCX transports (UCX_TLS), e.g. "posix,sysv,cma,self" or "tcp".
    #[arg(long)]
    ucx_tls: Option<String>,
    /// UCX peer-failure handling (UCX 1.13 then avoids shared memory).
    #[arg(long)]
    ucx_peer_failure: bool,
    /// Check every one-sided (UCX) read against a CRC-32C taken at pin time.
    #[arg(long)]
    ucx_verify_payloads: bool,
    /// Block sizes to sweep, e.g. 4K,64K,256K,2M.
    #[arg(long, value_delimiter = ',', default_value = "64K,2M", value_parser = parse_size)]
    block_bytes: Vec<u64>,
    /// Bytes moved per iteration (all parents and children together).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    total_bytes: u64,
    /// Children per parent (parallel sampling n).
    #[arg(long, default_value_t = 8)]
    n: u32,
    /// Parents per iteration.
    #[arg(long, default_value_t = 1)]
    parents: u32,
    /// Measured iterations per block size.
    #[arg(long, default_value_t = 3)]
    iters: u32,
    /// Unmeasured iterations first.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Data connections per peer.
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// Runtime threads of each agent.
    #[arg(long, default_value_t = 2)]
    worker_threads: usize,
    /// Decode agents that each pull every child (heterogeneous TP); one process only.
    #[arg(long, default_value_t = 1)]
    expected_consumers: u32,
    /// Also measure a raw TCP copy and a memcpy of the same bytes, and print the ratios.
    #[arg(long)]
    baseline: bool,
    /// Skip checking every pulled byte.
    #[arg(long)]
    no_verify: bool,
    /// One JSON object per block size.
    #[arg(long)]
    json: bool,
    /// CSV, one row per block size.
    #[arg(long)]
    csv: bool,
    /// Draw GiB/s against block size (kvxfer and baselines) into this SVG file.
    #[arg(long)]
    plot: Option<String>,
}

fn parse_size(s: &str) -> Result<u64, String> {
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
fn ucx_config(c: AgentConfig, tls: &Option<String>, peer_failure: bool) -> Result<AgentConfig, String> {
    c.ucx_options(tls.clone(), peer_failure)
        .and_then(AgentConfig::cluster_key_from_env)
        .map_err(|e| e.to_string())
}

/// Blocks per child so that every parent's children together move `total` bytes.
fn blocks_per_child(run: &RunArgs, block: u64) -> Result<u32, String> {
    let children = u64::from(run.n.max(1)) * u64::from(run.parents.max(1));
    let b = run.total_bytes / block / children;
    u32::try_from(b).ok().filter(|&b| b > 0).ok_or_else(|| {
        format!(
            "--total-bytes {} is too small for {children} children of {block}-byte blocks",
            run.total_bytes
        )
    })
}

/// Resource usage of this process: user + system CPU seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes one rusage struct; zeroed is a valid initial value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// The decode side: where the leases come from (an agent in this process or a `serve`).
trait LeaseSource {
    /// Sets up a prefill agent for `layout`; returns nothing (the result names the agent).
    fn setup(&mut self, block: u64, blocks: u32) -> Result<(), String>;
    /// Leases one parent; returns its result.
    fn lease(
        &mut self,
        parent: &str,
        blocks: Vec<Vec<BlockId>>,
        consumers: u32,
    ) -> Result<PrefillResult, String>;
    /// Prefill-side stats (bytes served, leases) as JSON.
    fn stats(&mut self) -> Value;
}

struct LocalSource {
    config: AgentConfig,
    agent: Option<PrefillAgent>,
}

impl LeaseSource for LocalSource {
    fn setup(&mut self, block: u64, blocks: u32) -> Result<(), String> {
        self.agent = None;
        self.agent = Some(start_prefill(self.config.clone(), block, blocks)?);
        Ok(())
    }
    fn lease(
        &mut self,
        parent: &str,
        blocks: Vec<Vec<BlockId>>,
        consumers: u32,
    ) -> Result<PrefillResult, String> {
        let agent = self.agent.as_ref().ok_or("no prefill agent")?;
        let r = agent.lease_parent(parent, blocks, consumers, None).map_err(|e| e.to_string())?;
        for _ in agent.events().try_iter() {}
        Ok(r)
    }
    fn stats(&mut self) -> Value {
        self.agent.as_ref().map(prefill_stats).unwrap_or(Value::Null)
    }
}

fn prefill_stats(a: &PrefillAgent) -> Value {
    let s = a.stats();
    json!({"leased": s.leases.leased, "pulled": s.leases.pulled, "released": s.leases.released,
           "expired": s.leases.expired, "unrecognized": s.leases.unrecognized, "bytes_served": s.server.bytes_served,
           "offers_ucx": a.offers_ucx(), "cpu_seconds": cpu_seconds()})
}

fn start_prefill(config: AgentConfig, block: u64, blocks: u32) -> Result<PrefillAgent, String> {
    let layout = BlockLayout::single(blocks, block).map_err(|e| e.to_string())?;
    let mem = pattern::alloc_filled(layout).map_err(|e| e.to_string())?;
    PrefillAgent::start(config, "127.0.0.1:0", mem).map_err(|e| e.to_string())
}

/// A `serve` process, driven over its control socket (one JSON object per line).
struct RemoteSource {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl RemoteSource {
    fn connect(addr: &str) -> Result<Self, String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("connecting to serve at {addr}: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let writer = stream.try_clone().map_err(|e| e.to_string())?;
        Ok(RemoteSource { reader: BufReader::new(stream), writer })
    }

    fn call(&mut self, req: Value) -> Result<Value, String> {
        writeln!(self.writer, "{req}").map_err(|e| format!("to serve: {e}"))?;
        let mut line = String::new();
        self.reader.read_line(&mut line).map_err(|e| format!("from serve: {e}"))?;
        let v: Value = serde_json::from_str(&line).map_err(|e| format!("from serve: {e}: {line:?}"))?;
        match v.get("error").and_then(Value::as_str) {
            Some(e) => Err(format!("serve: {e}")),
            None => Ok(v),
        }
    }

    fn quit(&mut self) {
        let _ = self.call(json!({"op": "quit"}));
    }
}

impl LeaseSource for RemoteSource {
    fn setup(&mut self, block: u64, blocks: u32) -> Result<(), String> {
        self.call(json!({"op": "setup", "block_bytes": block, "blocks": blocks})).map(drop)
    }
    fn lease(
        &mut self,
        parent: &str,
        blocks: Vec<Vec<BlockId>>,
        consumers: u32,
    ) -> Result<PrefillResult, String> {
        let v =
            self.call(json!({"op": "lease", "parent": parent, "blocks": blocks, "consumers": consumers}))?;
        let hex = v.get("result").and_then(Value::as_str).ok_or("serve sent no result")?;
        let bytes = hex::decode(hex).map_err(|e| format!("serve sent bad hex: {e}"))?;
        let wire = kvxfer_proto::v1::PrefillResult::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
        PrefillResult::from_wire(wire).map_err(|e| e.to_string())
    }
    fn stats(&mut self) -> Value {
        self.call(json!({"op": "stats"})).unwrap_or(Value::Null)
    }
}

fn serve(args: &ServeArgs) -> Result<(), String> {
    let listener = TcpListener::bind(&args.listen).map_err(|e| format!("binding {}: {e}", args.listen))?;
    // On stdout, so a driver (or a test) can read the address when it asked for port 0.
    println!("kvxfer-bench serve: control on {}", listener.local_addr().map_err(|e| e.to_string())?);
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let config = ucx_config(
        AgentConfig::new("bench-prefill").transport(args.transport),
        &args.ucx_tls,
        args.ucx_peer_failure,
    )?;
    let mut runs = 0;
    for stream in listener.incoming() {
        let stream = stream.map_err(|e| e.to_string())?;
        let mut source = LocalSource { config: config.clone(), agent: None };
        let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
        let mut quit = false;
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let reply = match serde_json::from_str::<Value>(&line) {
                Err(e) => json!({"error": format!("bad request: {e}")}),
                Ok(req) => match req.get("op").and_then(Value::as_str) {
                    Some("setup") => {
                        let block = req["block_bytes"].as_u64().unwrap_or(0);
                        let blocks = u32::try_from(req["blocks"].as_u64().unwrap_or(0)).unwrap_or(0);
                        match source.setup(block, blocks) {
                            Ok(()) => json!({"ok": true}),
                            Err(e) => json!({"error": e}),
                        }
                    }
                    Some("lease") => {
                        let parent = req["parent"].as_str().unwrap_or("bench").to_owned();
                        let blocks: Option<Vec<Vec<BlockId>>> =
                            serde_json::from_value(req["blocks"].clone()).ok();
                        let consumers = u32::try_from(req["consumers"].as_u64().unwrap_or(1)).unwrap_or(1);
                        match blocks.map(|b| source.lease(&parent, b, consumers)) {
                            Some(Ok(r)) => json!({"result": hex::encode(r.to_wire().encode_to_vec())}),
                            Some(Err(e)) => json!({"error": e}),
                            None => json!({"error": "lease needs blocks"}),
                        }
                    }
                    Some("stats") => source.stats(),
                    Some("quit") => {
                        quit = true;
                        json!({"ok": true})
                    }
                    other => json!({"error": format!("unknown op {other:?}")}),
                },
            };
            if writeln!(writer, "{reply}").is_err() || quit {
                break;
            }
        }
        runs += 1;
        if quit || (args.runs > 0 && runs >= args.runs) {
            return Ok(());
        }
    }
    Ok(())
}

struct Measured {
    bytes: u64,
    gib_per_s: f64,
    blocks_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    cpu_s_per_gib: f64,
    verified: Option<bool>,
    prefill: Value,
}

fn run_block_size(run: &RunArgs, source: &mut dyn LeaseSource, block: u64) -> Result<Measured, String> {
    let bpc = blocks_per_child(run, block)?;
    let n = run.n.max(1);
    let parents = run.parents.max(1);
    let blocks = bpc * n * parents;
    source.setup(block, blocks)?;
    let layout = BlockLayout::single(blocks, block).map_err(|e| e.to_string())?;
    let consumers = run.expected_consumers.max(1);
    let decoders = (0..consumers)
        .map(|i| {
            let c = ucx_config(
                AgentConfig::new(format!("bench-decode-{i}"))
                    .transport(run.transport)
                    .connections_per_peer(run.connections)
                    .worker_threads(run.worker_threads),
                &run.ucx_tls,
                run.ucx_peer_failure,
            )?
            .ucx_verify_payloads(run.ucx_verify_payloads)
            .map_err(|e| e.to_string())?;
            DecodeAgent::start(c, KvMemory::alloc(layout.clone()).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, String>>()?;
    let ids = |p: u32, c: u32| -> Vec<BlockId> {
        let first = (p * n + c) * bpc;
        (first..first + bpc).collect()
    };
    let mut latencies = Vec::new();
    let (mut seconds, mut bytes, mut cpu) = (0.0f64, 0u64, 0.0f64);
    let show_progress = std::io::stderr().is_terminal() && !run.json && !run.csv;
    for iter in 0..run.warmup + run.iters {
        let measured = iter >= run.warmup;
        if show_progress {
            eprint!("\r{block:>9} B blocks: iteration {}/{}   ", iter + 1, run.warmup + run.iters);
        }
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let mut handles = Vec::new();
        for p in 0..parents {
            let lease_start = Instant::now();
            let result = source.lease(
                &format!("bench-{block}-{iter}-{p}"),
                (0..n).map(|c| ids(p, c)).collect(),
                consumers,
            )?;
            for d in &decoders {
                let h = d
                    .submit(result.clone(), (0..n).map(|c| ids(p, c)).collect())
                    .map_err(|e| e.to_string())?;
                handles.push((lease_start, h));
            }
        }
        for (lease_start, h) in handles {
            let (report, arrived) = h.wait_timed();
            for (c, at) in report.children.iter().zip(arrived) {
                if !matches!(c.outcome, ChildOutcome::Done { .. }) {
                    return Err(format!(
                        "child {} of {}: {:?}",
                        c.child_index, report.parent_request_id, c.outcome
                    ));
                }
                if measured {
                    latencies.push(at.duration_since(lease_start).as_secs_f64() * 1e6);
                }
            }
            if measured {
                bytes += report.delivered_bytes;
            }
        }
        if measured {
            seconds += t0.elapsed().as_secs_f64();
            cpu += cpu_seconds() - cpu0;
        }
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
    latencies.sort_by(f64::total_cmp);
    let gib = bytes as f64 / f64::from(1u32 << 30);
    Ok(Measured {
        bytes: bytes / u64::from(run.iters.max(1)),
        gib_per_s: gib / seconds.max(1e-9),
        blocks_per_s: (bytes / block) as f64 / seconds.max(1e-9),
        p50_us: percentile(&latencies, 0.5),
        p99_us: percentile(&latencies, 0.99),
        max_us: latencies.last().copied().unwrap_or(0.0),
        cpu_s_per_gib: cpu / gib.max(1e-12),
        verified,
        prefill: source.stats(),
    })
}

/// Raw TCP: `connections` sockets on 127.0.0.1 moving `total` bytes from one buffer to
/// another, `block`-sized writes and reads, no protocol. Buffers are allocated and touched
/// and connections made before the clock starts.
fn raw_tcp_gib_per_s(total: u64, connections: usize, block: u64) -> Result<f64, String> {
    use std::sync::{Arc, Barrier};
    let connections = connections.max(1);
    let per = (total / connections as u64) as usize;
    let chunk = (block as usize).clamp(4096, 1 << 21);
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let clients: Vec<TcpStream> = (0..connections)
        .map(|_| TcpStream::connect(addr).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let servers: Vec<TcpStream> = (0..connections)
        .map(|_| listener.accept().map(|(s, _)| s).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    // Senders, receivers and this thread start together.
    let start = Arc::new(Barrier::new(2 * connections + 1));
    let mut threads = Vec::new();
    for mut s in servers {
        let start = start.clone();
        threads.push(std::thread::spawn(move || {
            let src = vec![0x5au8; per];
            start.wait();
            for c in src.chunks(chunk) {
                if s.write_all(c).is_err() {
                    return;
                }
            }
        }));
    }
    for mut s in clients {
        let start = start.clone();
        threads.push(std::thread::spawn(move || {
            let mut dst = vec![1u8; per];
            start.wait();
            for c in dst.chunks_mut(chunk) {
                if s.read_exact(c).is_err() {
                    return;
                }
            }
            std::hint::black_box(&dst);
        }));
    }
    start.wait();
    let t0 = Instant::now();
    for t in threads {
        t.join().map_err(|_| "raw tcp thread panicked".to_string())?;
    }
    Ok((per * connections) as f64 / f64::from(1u32 << 30) / t0.elapsed().as_secs_f64())
}

/// Median round trip on 127.0.0.1 of a 64-byte request answered with one `block` of data
/// read into a buffer: what a one-block hand-off cannot beat.
fn raw_tcp_rtt_p50_us(block: u64) -> Result<f64, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let len = block as usize;
    let rounds = 200;
    let server = std::thread::spawn(move || -> Result<(), String> {
        let (mut s, _) = listener.accept().map_err(|e| e.to_string())?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        let data = vec![7u8; len];
        let mut req = [0u8; 64];
        for _ in 0..rounds {
            s.read_exact(&mut req).map_err(|e| e.to_string())?;
            s.write_all(&data).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
    let mut c = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    c.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; len];
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        c.write_all(&[1u8; 64]).map_err(|e| e.to_string())?;
        c.read_exact(&mut buf).map_err(|e| e.to_string())?;
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    server.join().map_err(|_| "rtt server panicked".to_string())??;
    samples.sort_by(f64::total_cmp);
    Ok(percentile(&samples, 0.5))
}

/// One memcpy of `total` bytes between two pre-touched buffers.
fn memcpy_gib_per_s(total: u64) -> f64 {
    let src = vec![0xa5u8; total as usize];
    let mut dst = vec![0u8; total as usize];
    dst.iter_mut().step_by(4096).for_each(|b| *b = 1);
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    let secs = t0.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    total as f64 / f64::from(1u32 << 30) / secs
}

/// One block size's bandwidths, for the plot.
struct PlotRow {
    block: u64,
    kvxfer: f64,
    raw_tcp: Option<f64>,
    memcpy: Option<f64>,
}

type Series = (&'static str, &'static str, fn(&PlotRow) -> Option<f64>);

fn svg_plot(path: &str, transport: &str, rows: &[PlotRow]) -> Result<(), String> {
    let (w, h, m) = (720.0, 420.0, 60.0);
    let max =
        rows.iter().flat_map(|r| [Some(r.kvxfer), r.raw_tcp, r.memcpy]).flatten().fold(0.1f64, f64::max)
            * 1.1;
    let xs: Vec<f64> = rows.iter().map(|r| (r.block as f64).log2()).collect();
    let (x0, x1) = (xs.iter().copied().fold(f64::MAX, f64::min), xs.iter().copied().fold(f64::MIN, f64::max));
    let px = |x: f64| m + if x1 > x0 { (x - x0) / (x1 - x0) * (w - 2.0 * m) } else { (w - 2.0 * m) / 2.0 };
    let py = |y: f64| h - m - y / max * (h - 2.0 * m);
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n\
         <rect width='100%' height='100%' fill='white'/>\n\
         <line x1='{m}' y1='{}' x2='{}' y2='{}' stroke='black'/><line x1='{m}' y1='{m}' x2='{m}' y2='{}' stroke='black'/>\n\
         <text x='{}' y='{}' text-anchor='middle'>block size</text>\
         <text x='15' y='{}' transform='rotate(-90 15 {})' text-anchor='middle'>GiB/s</text>\n",
        h - m, w - m, h - m, h - m, w / 2.0, h - 15.0, h / 2.0, h / 2.0
    );
    for (i, r) in rows.iter().enumerate() {
        svg += &format!(
            "<text x='{}' y='{}' text-anchor='middle'>{}</text>\n",
            px(xs[i]),
            h - m + 18.0,
            human(r.block)
        );
    }
    for k in 0..=4 {
        let v = max * f64::from(k) / 4.0;
        svg += &format!("<text x='{}' y='{}' text-anchor='end'>{v:.1}</text>\n", m - 6.0, py(v) + 4.0);
    }
    let series: [Series; 3] = [
        ("kvxfer", "#1f77b4", |r| Some(r.kvxfer)),
        ("raw TCP", "#ff7f0e", |r| r.raw_tcp),
        ("memcpy", "#2ca02c", |r| r.memcpy),
    ];
    for (si, (name, color, get)) in series.iter().enumerate() {
        let pts: Vec<String> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| get(r).map(|v| format!("{},{}", px(xs[i]), py(v))))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let label = if si == 0 { format!("kvxfer ({transport})") } else { (*name).to_owned() };
        svg += &format!(
            "<polyline fill='none' stroke='{color}' stroke-width='2' points='{}'/>\n",
            pts.join(" ")
        );
        for p in &pts {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            svg += &format!("<circle cx='{x}' cy='{y}' r='3' fill='{color}'/>\n");
        }
        svg += &format!(
            "<text x='{}' y='{}' fill='{color}'>{label}</text>\n",
            w - m - 140.0,
            m + 16.0 * si as f64
        );
    }
    svg += "</svg>\n";
    std::fs::write(path, svg).map_err(|e| format!("writing {path}: {e}"))
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

fn bench(run: &RunArgs, source: &mut dyn LeaseSource, processes: &str) -> Result<bool, String> {
    let transport = run.transport.to_string();
    let mut all_ok = true;
    let mut plot_rows = Vec::new();
    if !run.json && run.csv {
        println!("transport,processes,block_bytes,bytes,gib_per_s,blocks_per_s,p50_us,p99_us,max_us,cpu_s_per_gib,verified,raw_tcp_gib_per_s,memcpy_gib_per_s,ratio_vs_raw_tcp,ratio_vs_memcpy");
    } else if !run.json {
        println!(
            "{:>9} {:>10} {:>9} {:>12} {:>10} {:>10} {:>10} {:>9} {:>8} {:>9} {:>9}",
            "block",
            "bytes",
            "GiB/s",
            "blocks/s",
            "p50 us",
            "p99 us",
            "max us",
            "CPU s/GiB",
            "verified",
            "vs rawTCP",
            "vs memcpy"
        );
    }
    for &block in &run.block_bytes {
        let m = run_block_size(run, source, block)?;
        let (raw, mem, rtt) = if run.baseline {
            (
                Some(raw_tcp_gib_per_s(run.total_bytes, run.connections, block)?),
                Some(memcpy_gib_per_s(run.total_bytes)),
                Some(raw_tcp_rtt_p50_us(block)?),
            )
        } else {
            (None, None, None)
        };
        all_ok &= m.verified != Some(false);
        let ratio = |b: Option<f64>| b.map(|b| m.gib_per_s / b);
        plot_rows.push(PlotRow { block, kvxfer: m.gib_per_s, raw_tcp: raw, memcpy: mem });
        if run.json {
            let mut j = json!({
                "transport": transport, "ucx_verify_payloads": run.ucx_verify_payloads, "processes": processes, "block_bytes": block, "bytes": m.bytes,
                "n": run.n, "parents": run.parents, "iters": run.iters, "connections": run.connections,
                "expected_consumers": run.expected_consumers,
                "gib_per_s": m.gib_per_s, "blocks_per_s": m.blocks_per_s, "p50_us": m.p50_us, "p99_us": m.p99_us,
                "max_us": m.max_us, "cpu_s_per_gib": m.cpu_s_per_gib, "verified": m.verified, "prefill": m.prefill,
            });
            if run.baseline {
                j["raw_tcp_gib_per_s"] = json!(raw);
                j["memcpy_gib_per_s"] = json!(mem);
                j["ratio_vs_raw_tcp"] = json!(ratio(raw));
                j["ratio_vs_memcpy"] = json!(ratio(mem));
                j["raw_tcp_rtt_one_block_p50_us"] = json!(rtt);
            }
            println!("{j}");
        } else if run.csv {
            let o = |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_default();
            println!(
                "{transport},{processes},{block},{},{:.4},{:.0},{:.1},{:.1},{:.1},{:.4},{},{},{},{},{}",
                m.bytes,
                m.gib_per_s,
                m.blocks_per_s,
                m.p50_us,
                m.p99_us,
                m.max_us,
                m.cpu_s_per_gib,
                m.verified.map(|v| v.to_string()).unwrap_or_default(),
                o(raw),
                o(mem),
                o(ratio(raw)),
                o(ratio(mem))
            );
        } else {
            let o = |v: Option<f64>| v.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into());
            println!(
                "{:>9} {:>10} {:>9.3} {:>12.0} {:>10.0} {:>10.0} {:>10.0} {:>9.3} {:>8} {:>9} {:>9}",
                human(block),
                human(m.bytes),
                m.gib_per_s,
                m.blocks_per_s,
                m.p50_us,
                m.p99_us,
                m.max_us,
                m.cpu_s_per_gib,
                m.verified.map(|v| v.to_string()).unwrap_or_else(|| "skipped".into()),
                o(ratio(raw)),
                o(ratio(mem))
            );
        }
    }
    if let Some(path) = &run.plot {
        svg_plot(path, &transport, &plot_rows)?;
    }
    Ok(all_ok)
}

fn main() -> ExitCode {
    kvxfer::ucx_log_to_stderr();
    let cli = Cli::parse();
    let result = match &cli.mode {
        Some(Mode::Serve(args)) => serve(args).map(|()| true),
        Some(Mode::Pull { peer, run }) => {
            if run.expected_consumers > 1 {
                Err("--expected-consumers > 1 is measured in one process (several decode agents)".into())
            } else {
                RemoteSource::connect(peer).and_then(|mut source| {
                    let r = bench(run, &mut source, "2");
                    source.quit();
                    r
                })
            }
        }
        None => ucx_config(
            AgentConfig::new("bench-prefill")
                .transport(cli.run.transport)
                .worker_threads(cli.run.worker_threads),
            &cli.run.ucx_tls,
            cli.run.ucx_peer_failure,
        )
        .and_then(|config| bench(&cli.run, &mut LocalSource { config, agent: None }, "1")),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("kvxfer-bench: verification FAILED");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("kvxfer-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
