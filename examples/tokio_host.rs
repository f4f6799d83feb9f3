//! A tokio host: a prefill worker, a decode worker and a router as tasks of **one**
//! `#[tokio::main]` runtime, using the async agents (no runtime, no thread of kvxfer's own).
//!
//! The prefill worker answers a request with a stream of frames, one per child, each with
//! that child's `kv_transfer_params` (as a parallel-sampling engine emits them). The router
//! consumes that stream the way Dynamo's `consume_prefill_stream` does — the first frame
//! must exist and carry no error — but then goes on and collects **every** child's
//! hand-off (not only the first frame's), builds the `PrefillResult` and forwards it to the
//! decode worker, which pulls, streams the per-child reports back and verifies every byte.
//! With `--cancel-child`, that child's request is aborted while it waits for decode (as vLLM
//! aborts a request still in its queue): the decode worker releases its lease without
//! pulling it (`DecodeAgent::release`) and pulls the others.
//!
//! ```text
//! cargo run --example tokio_host -- --n 4 --cancel-child 1 --json
//! ```
//! Exits non-zero unless every child ended as asked: pulled (and verified), or released for
//! `--cancel-child`.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use futures::StreamExt;
use kvxfer::{
    AgentConfig, BlockId, BlockLayout, ChildOutcome, DecodeAgent, EndKind, KvMemory, KvTransferParams,
    PrefillAgent, PrefillResult,
};
use kvxfer_mem::pattern;
use tokio::sync::{mpsc, oneshot};

#[derive(Parser, Debug)]
#[command(about = "Prefill, decode and router tasks on one tokio runtime, n children per request")]
struct Args {
    /// Children of the parent request (parallel sampling n).
    #[arg(long, default_value_t = 4)]
    n: u32,
    /// Blocks each child leases.
    #[arg(long, default_value_t = 16)]
    blocks_per_child: u32,
    /// Bytes per block.
    #[arg(long, default_value_t = 65536)]
    block_bytes: u64,
    /// This child's request is aborted before it is pulled: the decode worker releases its
    /// lease without pulling it, and it must end released.
    #[arg(long)]
    cancel_child: Option<u32>,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// One frame of the prefill worker's response stream: a child's `kv_transfer_params`, or
/// an error.
type PrefillFrame = Result<String, String>;

/// A request to the prefill worker: the parent id, n, and where to stream the frames.
struct PrefillRequest {
    parent: String,
    n: u32,
    frames: mpsc::Sender<PrefillFrame>,
}

/// A pull for the decode worker: the result, a child to release instead of pulling (its
/// request was aborted), and where to send how each child ended.
struct DecodeRequest {
    result: PrefillResult,
    release: Option<u32>,
    ended: mpsc::UnboundedSender<Ended>,
}

/// How the decode worker ended one child.
#[derive(Debug)]
enum Ended {
    /// Pulled: the pull's report of the child.
    Pulled(kvxfer::ChildReport),
    /// Released without pulling: whether the prefill side released its lease.
    Released { child_index: u32, released: bool },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        // No colour codes in a log written to a file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    match run(&args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("tokio_host: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The router's part: consume the prefill stream of n frames, Dynamo-style for the first
/// frame, then every other one, and turn them into one complete `PrefillResult`.
async fn consume_prefill_stream(
    mut frames: mpsc::Receiver<PrefillFrame>,
    n: u32,
) -> Result<PrefillResult, String> {
    let Some(first) = frames.recv().await else {
        return Err("prefill returned no output (stream ended)".into());
    };
    let first = first.map_err(|e| format!("prefill returned an error: {e}"))?;
    let mut handoffs = vec![KvTransferParams::from_json(&first).map_err(|e| e.to_string())?];
    // Not only the first frame: every child's hand-off is forwarded.
    while let Some(frame) = frames.recv().await {
        let params = frame.map_err(|e| format!("prefill returned an error: {e}"))?;
        handoffs.push(KvTransferParams::from_json(&params).map_err(|e| e.to_string())?);
    }
    let children =
        handoffs.iter().map(|p| p.to_handoff().map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
    let parent = children.first().map(|c| c.parent_request_id().to_owned()).unwrap_or_default();
    // Refused (naming the missing children) unless exactly the children 0..n arrived.
    PrefillResult::new(&parent, n, children).map_err(|e| e.to_string())
}

async fn run(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let n = args.n.max(1);
    let bpc = args.blocks_per_child.max(1);
    if args.cancel_child.is_some_and(|i| i >= n) {
        return Err(format!("--cancel-child must be below --n {n}").into());
    }
    let layout = BlockLayout::single(n * bpc, args.block_bytes)?;
    let key = kvxfer::ClusterKey::from_env()?.unwrap_or_else(kvxfer::ClusterKey::generate);
    let config = |name: &str| AgentConfig::new(name).cluster_key(key.clone());
    let prefill =
        PrefillAgent::start(config("prefill"), "127.0.0.1:0", pattern::alloc_filled(layout.clone())?).await?;
    let decode = DecodeAgent::start(config("decode"), KvMemory::alloc(layout)?).await?;
    let mut ends = prefill.lease_ends();
    let remote: Vec<Vec<BlockId>> = (0..n).map(|i| (i * bpc..(i + 1) * bpc).collect()).collect();

    // The prefill worker: leases every child, then streams one frame per child.
    let (prefill_tx, mut prefill_rx) = mpsc::channel::<PrefillRequest>(8);
    let blocks = remote.clone();
    let prefill_worker = async move {
        while let Some(req) = prefill_rx.recv().await {
            let children = blocks.iter().take(req.n as usize).cloned().collect();
            match prefill.lease_parent(&req.parent, children, 1, None) {
                Ok(result) => {
                    for child in result.children() {
                        let frame = KvTransferParams::from_handoff(child).to_json();
                        if req.frames.send(Ok(frame)).await.is_err() {
                            break;
                        }
                    }
                }
                Err(e) => {
                    let _ = req.frames.send(Err(e.to_string())).await;
                }
            }
        }
        prefill
    };

    // The decode worker: releases the child whose request was aborted, pulls the others and
    // streams how each one ended back.
    let (decode_tx, mut decode_rx) = mpsc::channel::<DecodeRequest>(8);
    let decode_worker = async move {
        while let Some(req) = decode_rx.recv().await {
            if let Some(child) = req.release.and_then(|i| req.result.children().get(i as usize)) {
                let released = decode.release(child).await;
                let _ = req.ended.send(Ended::Released { child_index: child.child_index(), released });
            }
            let selection: Vec<(u32, Vec<BlockId>)> = (0..req.result.n())
                .filter(|&i| Some(i) != req.release)
                .map(|i| (i, (i * bpc..(i + 1) * bpc).collect()))
                .collect();
            if selection.is_empty() {
                continue;
            }
            match decode.submit_subset(&req.result, selection) {
                Ok(mut pull) => {
                    while let Some(report) = pull.next().await {
                        let _ = req.ended.send(Ended::Pulled(report));
                    }
                }
                Err(e) => eprintln!("decode: {e}"),
            }
        }
        decode
    };

    // The router: one request through prefill, the whole stream, then decode.
    let (done_tx, done_rx) = oneshot::channel();
    let (cancel_child, prefill_tx2, decode_tx2) = (args.cancel_child, prefill_tx.clone(), decode_tx.clone());
    let router = async move {
        let (frames_tx, frames_rx) = mpsc::channel(4);
        let req = PrefillRequest { parent: "cmpl-tokio-host".into(), n, frames: frames_tx };
        prefill_tx2.send(req).await.map_err(|_| "the prefill worker is gone".to_string())?;
        let result = consume_prefill_stream(frames_rx, n).await?;
        // The request of `--cancel-child` was aborted while it waited for decode.
        let (reports_tx, mut reports_rx) = mpsc::unbounded_channel();
        let req = DecodeRequest { result, release: cancel_child, ended: reports_tx };
        decode_tx2.send(req).await.map_err(|_| "the decode worker is gone".to_string())?;
        let mut reports = Vec::new();
        while let Some(r) = reports_rx.recv().await {
            reports.push(r);
        }
        let _ = done_tx.send(reports);
        Ok::<(), String>(())
    };
    drop((prefill_tx, decode_tx));
    let (prefill, decode, routed) = tokio::join!(prefill_worker, decode_worker, router);
    routed?;
    let mut reports = done_rx.await?;
    let index = |e: &Ended| match e {
        Ended::Pulled(r) => r.child_index,
        Ended::Released { child_index, .. } => *child_index,
    };
    reports.sort_by_key(index);

    let mut as_asked = reports.len() == n as usize;
    for r in &reports {
        let i = index(r) as usize;
        let cancelled = Some(index(r)) == args.cancel_child;
        let ok = match r {
            Ended::Pulled(report) => match &report.outcome {
                ChildOutcome::Done { acknowledged: true, .. } if !cancelled => {
                    // SAFETY: the child reported; nothing writes its blocks any more.
                    let bad = unsafe { pattern::check_blocks(decode.memory(), &remote[i], &remote[i])? };
                    bad.is_none()
                }
                _ => false,
            },
            Ended::Released { released, .. } => *released && cancelled,
        };
        if !ok {
            eprintln!("child {i}: {r:?}");
        }
        as_asked &= ok;
    }
    let mut kinds = Vec::new();
    for _ in 0..n {
        match tokio::time::timeout(Duration::from_secs(10), ends.next()).await {
            Ok(Some(end)) => kinds.push((end.child_index, end.kind)),
            _ => break,
        }
    }
    kinds.sort_unstable_by_key(|k| k.0);
    for &(i, kind) in &kinds {
        let want = if Some(i) == args.cancel_child { EndKind::Released } else { EndKind::Pulled };
        as_asked &= kind == want;
    }
    as_asked &= kinds.len() == n as usize;
    decode.shutdown().await;
    prefill.shutdown().await;
    let count = |k| kinds.iter().filter(|(_, e)| *e == k).count();
    println!(
        "tokio host: parent with n={n} routed with every child's hand-off; pulled {}, released {}, expired {}; as asked: {as_asked}",
        count(EndKind::Pulled),
        count(EndKind::Released),
        count(EndKind::Expired)
    );
    if args.json {
        let j = serde_json::json!({
            "children": n,
            "reports": reports.len(),
            "pulled": count(EndKind::Pulled),
            "released": count(EndKind::Released),
            "expired": count(EndKind::Expired),
            "ended_as_asked": as_asked,
        });
        println!("{j}");
    }
    Ok(as_asked)
}
