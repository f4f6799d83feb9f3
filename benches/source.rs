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

use crate::measure::cpu_seconds;

/// The decode side: where the leases come from (an agent in this process or a `serve`).
pub(crate) trait LeaseSource {
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
    /// Registers `bytes` of filled memory as a bare UCX target on the prefill side (kept
    /// until the next call or the next `setup`), for the raw get baseline.
    #[cfg(feature = "ucx")]
    fn raw_ucx_target(
        &mut self,
        config: &kvxfer_ucx::UcxConfig,
        bytes: u64,
    ) -> Result<kvxfer_ucx::TargetInfo, String>;
}

/// A prefill agent in this process, started anew for each block size.
pub(crate) struct LocalSource {
    pub(crate) config: AgentConfig,
    pub(crate) agent: Option<PrefillAgent>,
    /// The raw UCX baseline's target, while it is read.
    pub(crate) raw_ucx: Option<Box<dyn std::any::Any>>,
}

impl LeaseSource for LocalSource {
    fn setup(&mut self, block: u64, blocks: u32) -> Result<(), String> {
        self.raw_ucx = None;
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
    #[cfg(feature = "ucx")]
    fn raw_ucx_target(
        &mut self,
        config: &kvxfer_ucx::UcxConfig,
        bytes: u64,
    ) -> Result<kvxfer_ucx::TargetInfo, String> {
        self.raw_ucx = None;
        let (target, info) = crate::ucx_baseline::start_target(config, bytes)?;
        self.raw_ucx = Some(Box::new(target));
        Ok(info)
    }
}

/// A prefill agent's stats as the benchmark reports them.
pub(crate) fn prefill_stats(a: &PrefillAgent) -> Value {
    let s = a.stats();
    json!({"leased": s.leases.leased, "pulled": s.leases.pulled, "released": s.leases.released,
           "expired": s.leases.expired, "unrecognized": s.leases.unrecognized, "bytes_served": s.server.bytes_served,
           "offers_ucx": a.offers_ucx(), "cpu_seconds": cpu_seconds(),
           "rss_kib": crate::procstat::rss_kib(), "rss_peak_kib": crate::procstat::peak_rss_kib(),
           "fds": crate::procstat::open_fds()})
}

/// A prefill agent over `blocks` blocks of `block` bytes, filled with the test pattern; in
/// memory UCX allocated when the agent may use UCX (`kvxfer::ucx_region`).
pub(crate) fn start_prefill(config: AgentConfig, block: u64, blocks: u32) -> Result<PrefillAgent, String> {
    let layout = BlockLayout::single(blocks, block).map_err(|e| e.to_string())?;
    let mem = match config.transport {
        #[cfg(feature = "ucx")]
        kvxfer::TransportChoice::Ucx | kvxfer::TransportChoice::Auto => {
            let ucx = config.ucx.clone();
            pattern::alloc_filled_in(layout, &mut |len| {
                kvxfer::ucx_region(&ucx, len).map_err(|_| kvxfer_mem::MemError::Alloc(len))
            })
        }
        _ => pattern::alloc_filled(layout),
    }
    .map_err(|e| e.to_string())?;
    PrefillAgent::start(config, "127.0.0.1:0", mem).map_err(|e| e.to_string())
}

/// A `serve` process, driven over its control socket (one JSON object per line).
pub(crate) struct RemoteSource {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
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
        Ok(RemoteSource { reader: BufReader::new(stream), writer })
    }

    /// One request, one answer (a JSON `error` becomes `Err`).
    fn call(&mut self, req: Value) -> Result<Value, String> {
        // One write per request (a line written in pieces would wait on the delayed ACK).
        self.writer.write_all(format!("{req}\n").as_bytes()).map_err(|e| format!("to serve: {e}"))?;
        let mut line = String::new();
        self.reader.read_line(&mut line).map_err(|e| format!("from serve: {e}"))?;
        let v: Value = serde_json::from_str(&line).map_err(|e| format!("from serve: {e}: {line:?}"))?;
        match v.get("error").and_then(Value::as_str) {
            Some(e) => Err(format!("serve: {e}")),
            None => Ok(v),
        }
    }

    /// Tells the `serve` process to exit.
    pub(crate) fn quit(&mut self) {
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
