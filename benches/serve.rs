//! `kvxfer-bench serve`: the prefill process of a two-process run, answering one JSON
//! request per line (setup, lease, lease_many, stats, raw_tcp_source, raw_rtt_responder,
//! quit) on its control socket.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;

use kvxfer::{AgentConfig, BlockId};
use kvxfer_proto::Message;
use serde_json::{json, Value};

use crate::cli::{ucx_config, Memory, ServeArgs};
use crate::source::{LeaseSource, LocalSource};

/// Serves runs until told to quit (or `--runs` of them).
pub(crate) fn serve(args: &ServeArgs) -> Result<(), String> {
    let listener = TcpListener::bind(&args.listen).map_err(|e| format!("binding {}: {e}", args.listen))?;
    // On stdout, so a driver (or a test) can read the address when it asked for port 0.
    println!("kvxfer-bench serve: control on {}", listener.local_addr().map_err(|e| e.to_string())?);
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let config = ucx_config(
        AgentConfig::new("bench-prefill")
            .transport(args.transport)
            .worker_threads(args.worker_threads)
            .precompute_crcs(args.precompute_crcs),
        &args.ucx_tls,
        args.ucx_peer_failure,
    )?;
    let memory = Memory::resolve(args.memory, args.transport)?;
    let mut runs = 0;
    for stream in listener.incoming() {
        let stream = stream.map_err(|e| e.to_string())?;
        let mut source = LocalSource { config: config.clone(), memory, agent: None, raw_ucx: None };
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
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
                        let segments = u32::try_from(req["segments"].as_u64().unwrap_or(1)).unwrap_or(1);
                        match source.setup(block, blocks, segments) {
                            Ok(()) => json!({"ok": true}),
                            Err(e) => json!({"error": e}),
                        }
                    }
                    Some("lease") => {
                        let parent = req["parent"].as_str().unwrap_or("bench").to_owned();
                        let blocks: Option<Vec<Vec<BlockId>>> =
                            serde_json::from_value(req["blocks"].clone()).ok();
                        let consumers = u32::try_from(req["consumers"].as_u64().unwrap_or(1)).unwrap_or(1);
                        let ttl = crate::source::ttl_from_ms(&req);
                        match blocks.map(|b| source.lease(&parent, b, consumers, ttl)) {
                            Some(Ok(r)) => json!({"result": hex::encode(r.to_wire().encode_to_vec())}),
                            Some(Err(e)) => json!({"error": e}),
                            None => json!({"error": "lease needs blocks"}),
                        }
                    }
                    Some("lease_many") => lease_many(&mut source, &req),
                    Some("raw_tcp_source") => {
                        let bytes = req["bytes"].as_u64().unwrap_or(0);
                        let connections = req["connections"].as_u64().unwrap_or(1) as usize;
                        match crate::baselines::raw_tcp_source(bytes, connections) {
                            Ok(addr) => json!({"addr": addr}),
                            Err(e) => json!({"error": e}),
                        }
                    }
                    // The raw one-block round trip's responder, in this process.
                    Some("raw_rtt_responder") => {
                        match crate::baselines::raw_rtt_responder(req["block_bytes"].as_u64().unwrap_or(0)) {
                            Ok((addr, _thread)) => json!({"addr": addr}),
                            Err(e) => json!({"error": e}),
                        }
                    }
                    Some("stats") => source.stats(),
                    #[cfg(feature = "ucx")]
                    Some("raw_ucx_target") => {
                        let config = crate::ucx_baseline::raw_config(
                            &req["tls"].as_str().map(str::to_owned),
                            req["peer_failure"].as_bool().unwrap_or(false),
                        );
                        match source.raw_ucx_target(&config, req["bytes"].as_u64().unwrap_or(0)) {
                            Ok(info) => json!({"info": crate::ucx_baseline::info_to_json(&info)}),
                            Err(e) => json!({"error": e}),
                        }
                    }
                    Some("quit") => {
                        quit = true;
                        json!({"ok": true})
                    }
                    other => json!({"error": format!("unknown op {other:?}")}),
                },
            };
            // One write per answer: a line written in pieces would wait on the delayed ACK.
            if writer.write_all(format!("{reply}\n").as_bytes()).is_err() || quit {
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

/// `lease_many`: every parent of the request leased (`consumers` each), their results in
/// order; the first refusal is the answer.
fn lease_many(source: &mut LocalSource, req: &Value) -> Value {
    let consumers = u32::try_from(req["consumers"].as_u64().unwrap_or(1)).unwrap_or(1);
    let ttl = crate::source::ttl_from_ms(req);
    let Some(parents) = req["parents"].as_array() else {
        return json!({"error": "lease_many needs parents"});
    };
    let mut results = Vec::with_capacity(parents.len());
    for p in parents {
        let parent = p["parent"].as_str().unwrap_or("bench");
        let Ok(blocks) = serde_json::from_value::<Vec<Vec<BlockId>>>(p["blocks"].clone()) else {
            return json!({"error": "lease_many: a parent without blocks"});
        };
        match source.lease(parent, blocks, consumers, ttl) {
            Ok(r) => results.push(Value::String(hex::encode(r.to_wire().encode_to_vec()))),
            Err(e) => return json!({"error": e}),
        }
    }
    json!({"results": results})
}
