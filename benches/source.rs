//! Where a benchmark's leases come from: a prefill agent in this process, or a
//! `kvxfer-bench serve` process driven over its control socket.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvxfer::blocking::PrefillAgent;
use kvxfer::{AgentConfig, BlockId, BlockLayout, PrefillResult};
use kvxfer_mem::pattern;
use kvxfer_proto::Message;
use serde_json::{json, Value};

use crate::cli::Memory;
use crate::procstat::cpu_seconds;

/// The decode side: where the leases come from (an agent in this process or a `serve`).
pub(crate) trait LeaseSource {
    /// Sets up a prefill agent for `layout`; returns nothing (the result names the agent).
    fn setup(&mut self, block: u64, blocks: u32, segments: u32) -> Result<(), String>;
    /// Leases one parent (for `ttl`, or the prefill agent's default); returns its result.
    fn lease(
        &mut self,
        parent: &str,
        blocks: Vec<Vec<BlockId>>,
        consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<PrefillResult, String>;
    /// Leases several parents (name and children's blocks each) at once: in two processes,
    /// one control round trip for all of them.
    fn lease_many(
        &mut self,
        parents: Vec<(String, Vec<Vec<BlockId>>)>,
        consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<Vec<PrefillResult>, String> {
        parents.into_iter().map(|(p, blocks)| self.lease(&p, blocks, consumers, ttl)).collect()
    }
    /// Starts leasing several parents without waiting for them where that is possible (a
    /// `serve` process: the request is sent, the answer read by [`Self::lease_many_recv`]):
    /// `Some(results)` when they are already here, `None` when they are under way. At most
    /// one batch is under way at a time.
    fn lease_many_send(
        &mut self,
        parents: Vec<(String, Vec<Vec<BlockId>>)>,
        consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<Option<Vec<PrefillResult>>, String> {
        self.lease_many(parents, consumers, ttl).map(Some)
    }
    /// The results of the batch [`Self::lease_many_send`] left under way: `None` while they
    /// have not arrived and `wait` is false (or when none is under way).
    fn lease_many_recv(&mut self, wait: bool) -> Result<Option<Vec<PrefillResult>>, String> {
        let _ = wait;
        Ok(None)
    }
    /// Raw TCP GiB/s of `total` bytes over `connections` sockets from the prefill side to
    /// this process, written as kvxfer's server writes and read `read_span` bytes at a time
    /// (see [`crate::baselines`]): two threads of this process, or the `serve` process;
    /// with the CPU seconds its sending and receiving threads took, both ends.
    fn raw_tcp_run(&mut self, total: u64, connections: usize, read_span: u64) -> Result<RawTcpRun, String> {
        let (sent0, received0) = crate::baselines::raw_tcp_cpu_seconds();
        let w = crate::baselines::raw_tcp_gib_per_s(total, connections, read_span)?;
        let (sent, received) = crate::baselines::raw_tcp_cpu_seconds();
        Ok(RawTcpRun {
            gib_per_s: w.gib_per_s,
            send_cpu_seconds: sent - sent0,
            receive_cpu_seconds: received - received0,
            machine_cpu_seconds: w.machine_cpu_seconds,
            window_secs: w.secs,
        })
    }
    /// The prefill process's CPU seconds and context switches so far when it is another
    /// process (`serve`); `None` when the agents share this one (whose counters hold both).
    fn prefill_process(&mut self) -> Option<ProcessCounters> {
        None
    }
    /// A raw one-block round trip to the prefill side: a responder thread of this process,
    /// or of the `serve` process (so it crosses processes as the hand-off does).
    fn raw_rtt(&mut self, block: u64) -> Result<crate::baselines::RawRtt, String> {
        crate::baselines::RawRtt::start(block)
    }
    /// Prefill-side stats (bytes served, leases) as JSON.
    fn stats(&mut self) -> Value;
    /// Registers `bytes` of filled memory, of the kind the agent's KV cache is in
    /// (`--memory`), as a bare UCX target on the prefill side (kept until the next call or
    /// the next `setup`), for the raw get baseline.
    #[cfg(feature = "ucx")]
    fn raw_ucx_target(
        &mut self,
        config: &kvxfer_ucx::UcxConfig,
        bytes: u64,
    ) -> Result<kvxfer_ucx::TargetInfo, String>;
}

/// One run of the raw TCP baseline.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawTcpRun {
    /// Bytes read over the run's wall-clock time.
    pub(crate) gib_per_s: f64,
    /// CPU of the threads sending the bytes (the prefill side's end).
    pub(crate) send_cpu_seconds: f64,
    /// CPU of the threads receiving them (the decode side's end).
    pub(crate) receive_cpu_seconds: f64,
    /// This machine's busy CPU over the run (`None` where `/proc/stat` is unreadable).
    pub(crate) machine_cpu_seconds: Option<f64>,
    /// The run's window, seconds (see [`crate::baselines::MIN_MACHINE_WINDOW_SECS`]).
    pub(crate) window_secs: f64,
}

impl RawTcpRun {
    /// CPU seconds per GiB of the sending and the receiving end, for a run of `bytes`.
    pub(crate) fn cpu_s_per_gib(&self, bytes: u64) -> [f64; 2] {
        let gib = (bytes as f64 / f64::from(1u32 << 30)).max(1e-12);
        [self.send_cpu_seconds / gib, self.receive_cpu_seconds / gib]
    }
}

/// A process's counters at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ProcessCounters {
    /// User + system CPU seconds, every thread.
    pub(crate) cpu_seconds: f64,
    /// Voluntary and involuntary context switches, every thread.
    pub(crate) context_switches: u64,
    /// Read in this process only: the machine's busy CPU seconds, every process and kernel
    /// thread ([`crate::procstat::machine_busy_seconds`]).
    pub(crate) machine_busy_seconds: Option<f64>,
}

impl ProcessCounters {
    /// This process's counters now.
    pub(crate) fn now() -> Self {
        Self {
            cpu_seconds: cpu_seconds(),
            context_switches: crate::procstat::context_switches(),
            machine_busy_seconds: crate::procstat::machine_busy_seconds(),
        }
    }
    /// What the process spent from `earlier` to `self`.
    pub(crate) fn since(self, earlier: Self) -> Self {
        Self {
            cpu_seconds: self.cpu_seconds - earlier.cpu_seconds,
            context_switches: self.context_switches.saturating_sub(earlier.context_switches),
            machine_busy_seconds: self
                .machine_busy_seconds
                .zip(earlier.machine_busy_seconds)
                .map(|(a, b)| a - b),
        }
    }
}

/// A prefill agent in this process, started anew for each block size.
pub(crate) struct LocalSource {
    pub(crate) config: AgentConfig,
    /// Where the KV cache of each agent lives.
    pub(crate) memory: Memory,
    pub(crate) agent: Option<PrefillAgent>,
    /// The raw UCX baseline's target, while it is read.
    pub(crate) raw_ucx: Option<Box<dyn std::any::Any>>,
}

impl LeaseSource for LocalSource {
    fn setup(&mut self, block: u64, blocks: u32, segments: u32) -> Result<(), String> {
        self.raw_ucx = None;
        self.agent = None;
        self.agent = Some(start_prefill(self.config.clone(), self.memory, block, blocks, segments)?);
        Ok(())
    }
    fn lease(
        &mut self,
        parent: &str,
        blocks: Vec<Vec<BlockId>>,
        consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<PrefillResult, String> {
        let agent = self.agent.as_ref().ok_or("no prefill agent")?;
        let r = agent.lease_parent(parent, blocks, consumers, ttl).map_err(|e| e.to_string())?;
        for _ in agent.events().try_iter() {}
        Ok(r)
    }
    fn stats(&mut self) -> Value {
        let Some(agent) = &self.agent else { return Value::Null };
        let mut stats = prefill_stats(agent);
        stats["memory"] = json!(self.memory.name());
        stats
    }
    #[cfg(feature = "ucx")]
    fn raw_ucx_target(
        &mut self,
        config: &kvxfer_ucx::UcxConfig,
        bytes: u64,
    ) -> Result<kvxfer_ucx::TargetInfo, String> {
        self.raw_ucx = None;
        let (target, info) = crate::ucx_baseline::start_target(config, bytes, self.memory)?;
        self.raw_ucx = Some(Box::new(target));
        Ok(info)
    }
}

/// A prefill agent's stats as the benchmark reports them.
pub(crate) fn prefill_stats(a: &PrefillAgent) -> Value {
    let s = a.stats();
    json!({"leased": s.leases.leased, "pulled": s.leases.pulled, "released": s.leases.released,
           "expired": s.leases.expired, "unrecognized": s.leases.unrecognized, "bytes_served": s.server.bytes_served,
           "crc_bytes_precomputed": s.server.crc_bytes_precomputed,
           "offers_ucx": a.offers_ucx(), "cpu_seconds": cpu_seconds(),
           "cpus": crate::procstat::cpus_allowed(),
           "context_switches": crate::procstat::context_switches(),
           "raw_tcp_send_cpu_seconds": crate::baselines::raw_tcp_cpu_seconds().0,
           "raw_tcp_senders_done": crate::baselines::raw_tcp_senders_done(),
           "raw_tcp_sources_freed": crate::baselines::raw_tcp_sources_freed(),
           "rss_kib": crate::procstat::rss_kib(), "rss_peak_kib": crate::procstat::peak_rss_kib(),
           "fds": crate::procstat::open_fds(),
           "raw_rtt_rounds_served": crate::baselines::raw_rtt_rounds_served(),
           "ucx_version": ucx_runtime_version()})
}

/// The version of the libucp this process runs with (`null` without the `ucx` feature):
/// which UCX a figure was measured on, whatever the build was pointed at.
pub(crate) fn ucx_runtime_version() -> Value {
    #[cfg(feature = "ucx")]
    return json!(kvxfer_ucx::ucx_version().runtime);
    #[cfg(not(feature = "ucx"))]
    Value::Null
}

/// The bench's KV-cache layout: `blocks` blocks of one `piece`-byte piece in each of
/// `segments` regions (one region: the simplest layout; several: vLLM's per-layer, per-K/V
/// caches, `--layers` / `--kv-split`).
pub(crate) fn bench_layout(blocks: u32, piece: u64, segments: u32) -> Result<BlockLayout, String> {
    let segments = vec![kvxfer::Segment::packed(piece); segments.max(1) as usize];
    BlockLayout::new(blocks, segments, "u8", 16).map_err(|e| e.to_string())
}

/// A prefill agent over `blocks` blocks of `segments` pieces of `block` bytes, filled with
/// the test pattern, in `memory`.
pub(crate) fn start_prefill(
    config: AgentConfig,
    memory: Memory,
    block: u64,
    blocks: u32,
    segments: u32,
) -> Result<PrefillAgent, String> {
    let layout = bench_layout(blocks, block, segments)?;
    let mem = match memory {
        #[cfg(feature = "ucx")]
        Memory::Ucx => {
            let ucx = config.ucx.clone();
            // UCX's reason, not just "could not allocate" (e.g. a libucp of another version).
            let mut why = None;
            pattern::alloc_filled_in(layout, &mut |len| {
                kvxfer::ucx_region(&ucx, len).map_err(|e| {
                    why = Some(format!("kvxfer::ucx_region of {len} bytes: {e}"));
                    kvxfer_mem::MemError::Alloc(len)
                })
            })
            .map_err(|e| why.take().unwrap_or_else(|| e.to_string()))
        }
        #[cfg(not(feature = "ucx"))]
        Memory::Ucx => Err("--memory ucx needs kvxfer-bench built with the `ucx` feature".to_owned()),
        Memory::Heap => pattern::alloc_filled(layout).map_err(|e| e.to_string()),
    }?;
    PrefillAgent::start(config, "127.0.0.1:0", mem).map_err(|e| e.to_string())
}

/// A lease ttl as the control protocol carries it (`null`: the agent's default).
fn ttl_ms(ttl: Option<Duration>) -> Option<u64> {
    ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
}

/// A lease ttl from a control request's `ttl_ms` (absent or `null`: the agent's default).
pub(crate) fn ttl_from_ms(req: &Value) -> Option<Duration> {
    req["ttl_ms"].as_u64().map(Duration::from_millis)
}

/// A lease as `serve` sends it: the wire `PrefillResult`, hex-encoded.
fn result_from_hex(hex: &str) -> Result<PrefillResult, String> {
    let bytes = hex::decode(hex).map_err(|e| format!("serve sent bad hex: {e}"))?;
    let wire = kvxfer_proto::v1::PrefillResult::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    PrefillResult::from_wire(wire).map_err(|e| e.to_string())
}

/// A `serve` process, driven over its control socket (one JSON object per line).
pub(crate) struct RemoteSource {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// Parents of a `lease_many` request sent and not yet answered.
    leasing: Option<usize>,
    /// Its answer, when another request had to read it first.
    lease_answer: Option<Result<Value, String>>,
}

impl RemoteSource {
    /// Connects to a `serve` process (retrying for 10 s while it starts).
    pub(crate) fn connect(addr: &str) -> Result<Self, String> {
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
        // One request and one answer per line, each waited for: no Nagle delay.
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let writer = stream.try_clone().map_err(|e| e.to_string())?;
        Ok(RemoteSource { reader: BufReader::new(stream), writer, leasing: None, lease_answer: None })
    }

    /// One request, one answer (a JSON `error` becomes `Err`). A `lease_many` answer still
    /// due is read first and kept for [`LeaseSource::lease_many_recv`].
    fn call(&mut self, req: Value) -> Result<Value, String> {
        if self.leasing.is_some() && self.lease_answer.is_none() {
            self.lease_answer = Some(self.answer());
        }
        self.send(&req)?;
        self.answer()
    }

    /// Sends one request.
    fn send(&mut self, req: &Value) -> Result<(), String> {
        // One write per request (a line written in pieces would wait on the delayed ACK).
        self.writer.write_all(format!("{req}\n").as_bytes()).map_err(|e| format!("to serve: {e}"))
    }

    /// Reads one answer (a JSON `error` becomes `Err`).
    fn answer(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        self.reader.read_line(&mut line).map_err(|e| format!("from serve: {e}"))?;
        let v: Value = serde_json::from_str(&line).map_err(|e| format!("from serve: {e}: {line:?}"))?;
        match v.get("error").and_then(Value::as_str) {
            Some(e) => Err(format!("serve: {e}")),
            None => Ok(v),
        }
    }

    /// Whether an answer (or its start) can be read without waiting.
    fn answer_ready(&self) -> bool {
        use std::os::fd::AsRawFd;
        if !self.reader.buffer().is_empty() {
            return true;
        }
        let mut fd = libc::pollfd { fd: self.reader.get_ref().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for an open socket, and a zero timeout.
        unsafe { libc::poll(&mut fd, 1, 0) > 0 }
    }

    /// The results of a `lease_many` answer for `count` parents.
    fn lease_results(v: Value, count: usize) -> Result<Vec<PrefillResult>, String> {
        let results = v.get("results").and_then(Value::as_array).ok_or("serve sent no results")?;
        if results.len() != count {
            return Err(format!("serve leased {} parents of {count}", results.len()));
        }
        results.iter().map(|r| result_from_hex(r.as_str().ok_or("serve sent a non-string result")?)).collect()
    }

    /// Tells the `serve` process to exit.
    pub(crate) fn quit(&mut self) {
        let _ = self.call(json!({"op": "quit"}));
    }
}

impl LeaseSource for RemoteSource {
    fn setup(&mut self, block: u64, blocks: u32, segments: u32) -> Result<(), String> {
        let r = self
            .call(json!({"op": "setup", "block_bytes": block, "blocks": blocks, "segments": segments}))
            .map(drop);
        // A batch still under way leased from the agent this replaced: dropped with it.
        (self.leasing, self.lease_answer) = (None, None);
        r
    }
    fn lease(
        &mut self,
        parent: &str,
        blocks: Vec<Vec<BlockId>>,
        consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<PrefillResult, String> {
        let v = self
            .call(json!({"op": "lease", "parent": parent, "blocks": blocks, "consumers": consumers,
                                 "ttl_ms": ttl_ms(ttl)}))?;
        result_from_hex(v.get("result").and_then(Value::as_str).ok_or("serve sent no result")?)
    }
    fn lease_many(
        &mut self,
        parents: Vec<(String, Vec<Vec<BlockId>>)>,
        consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<Vec<PrefillResult>, String> {
        match self.lease_many_send(parents, consumers, ttl)? {
            Some(results) => Ok(results),
            None => self.lease_many_recv(true)?.ok_or_else(|| "serve sent no lease answer".into()),
        }
    }
    fn lease_many_send(
        &mut self,
        parents: Vec<(String, Vec<Vec<BlockId>>)>,
        consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<Option<Vec<PrefillResult>>, String> {
        if self.leasing.is_some() {
            return Err("a lease_many batch is already under way".into());
        }
        let count = parents.len();
        let parents: Vec<Value> =
            parents.into_iter().map(|(parent, blocks)| json!({"parent": parent, "blocks": blocks})).collect();
        self.send(
            &json!({"op": "lease_many", "parents": parents, "consumers": consumers, "ttl_ms": ttl_ms(ttl)}),
        )?;
        self.leasing = Some(count);
        Ok(None)
    }
    fn lease_many_recv(&mut self, wait: bool) -> Result<Option<Vec<PrefillResult>>, String> {
        let Some(count) = self.leasing else { return Ok(None) };
        let answer = match self.lease_answer.take() {
            Some(a) => a,
            None if wait || self.answer_ready() => self.answer(),
            None => return Ok(None),
        };
        self.leasing = None;
        Self::lease_results(answer?, count).map(Some)
    }
    fn raw_tcp_run(&mut self, total: u64, connections: usize, read_span: u64) -> Result<RawTcpRun, String> {
        let v = self.call(json!({"op": "raw_tcp_source", "bytes": total, "connections": connections}))?;
        let addr = v.get("addr").and_then(Value::as_str).ok_or("serve sent no raw source address")?;
        // (sending CPU, senders done, sources freed) so far in `serve`.
        let remote = |s: &mut Self| {
            let v = s.stats();
            let sent = v.get("raw_tcp_send_cpu_seconds").and_then(Value::as_f64)?;
            let done = v.get("raw_tcp_senders_done").and_then(Value::as_u64)?;
            Some((sent, done, v.get("raw_tcp_sources_freed").and_then(Value::as_u64)?))
        };
        let (before, received0) = (remote(self), crate::baselines::raw_tcp_cpu_seconds().1);
        let w = crate::baselines::raw_tcp_sink_gib_per_s(addr, total, connections, read_span)?;
        let received = crate::baselines::raw_tcp_cpu_seconds().1 - received0;
        let (sent0, done0, freed0) = before.ok_or("serve sent no raw tcp CPU count")?;
        // Each sender adds its CPU once its last write returned, which may be after the last
        // bytes were read here, and frees its buffer once this side hung up: wait (a while
        // at most) until every sender of this run has done both, so neither lands in what
        // comes next (kvxfer's next iteration).
        let deadline = Instant::now() + Duration::from_secs(10);
        let n = connections.max(1) as u64;
        let sent = loop {
            let (sent, done, freed) = remote(self).ok_or("serve sent no raw tcp CPU count")?;
            if done >= done0 + n && freed >= freed0 + n {
                break sent - sent0;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "serve's raw tcp senders did not finish ({} of {connections} done, {} freed)",
                    done - done0,
                    freed - freed0
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        Ok(RawTcpRun {
            gib_per_s: w.gib_per_s,
            send_cpu_seconds: sent,
            receive_cpu_seconds: received,
            machine_cpu_seconds: w.machine_cpu_seconds,
            window_secs: w.secs,
        })
    }
    fn prefill_process(&mut self) -> Option<ProcessCounters> {
        let s = self.stats();
        Some(ProcessCounters {
            cpu_seconds: s.get("cpu_seconds")?.as_f64()?,
            context_switches: s.get("context_switches")?.as_u64()?,
            machine_busy_seconds: None,
        })
    }
    fn raw_rtt(&mut self, block: u64) -> Result<crate::baselines::RawRtt, String> {
        let v = self.call(json!({"op": "raw_rtt_responder", "block_bytes": block}))?;
        let addr = v.get("addr").and_then(Value::as_str).ok_or("serve sent no raw rtt address")?;
        crate::baselines::RawRtt::connect(addr, block)
    }
    fn stats(&mut self) -> Value {
        self.call(json!({"op": "stats"})).unwrap_or(Value::Null)
    }
    #[cfg(feature = "ucx")]
    fn raw_ucx_target(
        &mut self,
        config: &kvxfer_ucx::UcxConfig,
        bytes: u64,
    ) -> Result<kvxfer_ucx::TargetInfo, String> {
        let v = self.call(json!({"op": "raw_ucx_target", "bytes": bytes, "tls": config.tls,
                                 "peer_failure": config.peer_failure_handling}))?;
        crate::ucx_baseline::info_from_json(&v["info"])
    }
}
