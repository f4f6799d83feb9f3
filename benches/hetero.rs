//! Heterogeneous runs (`--prefill-tp`, `--decode-tp`, `--block-ratio`, one process):
//! prefill ranks and decode ranks of the given TP sizes, each decode rank pulling its head
//! slice of every block (`DecodeAgent::submit_ranks`), measured beside the whole-block path
//! (TP 1 → 1, ratio 1, plain `submit`) moving the same total bytes with the same prefill
//! block size.
//!
//! The model: one KV-cache group, K and V segments, 8 KV heads of head dim 128, bf16. A
//! prefill rank's block (all its heads, K and V) is `--block-bytes`; its tokens per block
//! follow from that (`block / (2 * heads_per_rank * 128 * 2)`), and the decode block holds
//! `--block-ratio` times as many tokens. Per iteration the decode ranks together move
//! `--total-bytes`: every head of every remote block once.

use std::time::Instant;

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{AgentConfig, BlockId, ChildOutcome, KvMemory, LeaseRequest, PrefillResult};
use kvxfer_core::{GroupSpec, KvHeads, KvShape, KvShapeSpec, SegmentSpec, TransferPair};
use kvxfer_mem::pattern;
use serde_json::json;

use crate::cli::{ucx_config, RunArgs};
use crate::plot::human;

const HEADS: u32 = 8;
const HEAD_DIM: u32 = 128;
const DTYPE_BYTES: u32 = 2;

fn spec(tp_size: u32, tp_rank: u32, block_tokens: u32, num_blocks: u32) -> KvShapeSpec {
    KvShapeSpec {
        tp_size,
        tp_rank,
        heads: KvHeads::Split { total: HEADS },
        block_tokens,
        dtype: "bf16".into(),
        dtype_bytes: DTYPE_BYTES,
        groups: vec![GroupSpec { num_blocks, segments: vec![SegmentSpec::packed(HEAD_DIM); 2] }],
    }
}

fn config(run: &RunArgs, name: String, spec: KvShapeSpec) -> Result<AgentConfig, String> {
    let c = ucx_config(
        AgentConfig::new(name)
            .transport(run.transport)
            .connections_per_peer(run.connections)
            .worker_threads(run.worker_threads),
        &run.ucx_tls,
        run.ucx_peer_failure,
    )?
    .ucx_verify_payloads(run.ucx_verify_payloads)
    .map_err(|e| e.to_string())?;
    Ok(c.rank(spec.tp_rank).kv_shape(spec))
}

fn zeroed(shape: &KvShape) -> Result<KvMemory, String> {
    KvMemory::alloc(shape.block_layout(0).ok_or("no group")?.clone()).map_err(|e| e.to_string())
}

/// What one configuration measured.
struct Figures {
    gib_per_s: f64,
    bytes: u64,
    verified: Option<bool>,
}

/// Prefill TP `tp_p` → decode TP `tp_d` at block ratio `k`, prefill blocks of `block`
/// bytes per rank; `whole`: the plain whole-block path instead (needs 1, 1, 1).
fn measure(
    run: &RunArgs,
    block: u64,
    (tp_p, tp_d, k): (u32, u32, u32),
    whole: bool,
) -> Result<Figures, String> {
    let hpr = HEADS / tp_p;
    let per_token = u64::from(2 * hpr * HEAD_DIM * DTYPE_BYTES);
    if !block.is_multiple_of(per_token) || block < per_token {
        return Err(format!(
            "--block-bytes {block} is not a multiple of {per_token} (K and V of {hpr} heads)"
        ));
    }
    let bt = u32::try_from(block / per_token).map_err(|_| "block too large")?;
    // Every head of a remote block once, over all decode ranks: tp_p * block bytes.
    let n = run.n.max(1);
    let remote_blocks = run.total_bytes / (block * u64::from(tp_p));
    let bpc = u32::try_from(remote_blocks / u64::from(n)).ok().filter(|&b| b > 0 && b % k == 0).ok_or_else(
        || format!("--total-bytes {} gives no whole number of decode blocks per child", run.total_bytes),
    )?;
    let remote_num = bpc * n;
    let local_num = remote_num / k;
    let prefill_shapes: Vec<KvShape> = (0..tp_p)
        .map(|r| KvShape::new(spec(tp_p, r, bt, remote_num)).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let decode_shapes: Vec<KvShape> = (0..tp_d)
        .map(|r| KvShape::new(spec(tp_d, r, bt * k, local_num)).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let prefills: Vec<PrefillAgent> = prefill_shapes
        .iter()
        .map(|s| {
            let mem = pattern::alloc_filled_shape(s).map_err(|e| e.to_string())?;
            PrefillAgent::start(
                // One prefill engine: its ranks share the engine id (submit_ranks checks).
                config(run, format!("bench-prefill-{}", s.tp_rank()), s.spec().clone())?
                    .engine_id("bench-prefill"),
                "127.0.0.1:0",
                mem,
            )
            .map_err(|e| e.to_string())
        })
        .collect::<Result<_, String>>()?;
    let decodes: Vec<DecodeAgent> = decode_shapes
        .iter()
        .map(|s| {
            DecodeAgent::start(
                config(run, format!("bench-decode-{}", s.tp_rank()), s.spec().clone())?,
                zeroed(s)?,
            )
            .map_err(|e| e.to_string())
        })
        .collect::<Result<_, String>>()?;
    let consumers = kvxfer_core::expected_consumers(tp_p, tp_d).map_err(|e| e.to_string())?;
    let remote = |c: u32| -> Vec<BlockId> { (c * bpc..(c + 1) * bpc).collect() };
    let local = |c: u32| -> Vec<BlockId> { (c * bpc / k..(c + 1) * bpc / k).collect() };
    let (mut seconds, mut bytes) = (0.0f64, 0u64);
    for iter in 0..run.warmup + run.iters {
        let parent = format!("hetero-{block}-{iter}");
        let t0 = Instant::now();
        let results: Vec<PrefillResult> = prefills
            .iter()
            .map(|p| {
                let handoffs = (0..n)
                    .map(|c| {
                        p.lease(LeaseRequest::new(&parent, c, n, remote(c)).consumers(consumers))
                            .map_err(|e| e.to_string())
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                PrefillResult::new(&parent, n, handoffs).map_err(|e| e.to_string())
            })
            .collect::<Result<_, String>>()?;
        let handles = decodes
            .iter()
            .map(|d| {
                let r = if whole {
                    d.submit(results[0].clone(), (0..n).map(local).collect())
                } else {
                    d.submit_ranks(results.clone(), (0..n).map(|c| vec![local(c)]).collect())
                };
                r.map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, String>>()?;
        let mut moved = 0;
        for h in handles {
            let report = h.wait();
            if let Some(c) = report.children.iter().find(|c| !matches!(c.outcome, ChildOutcome::Done { .. }))
            {
                return Err(format!("child {}: {:?}", c.child_index, c.outcome));
            }
            moved += report.delivered_bytes;
        }
        if iter >= run.warmup {
            seconds += t0.elapsed().as_secs_f64();
            bytes += moved;
        }
        // The leases end once every consumer notified: drain the ends.
        for p in &prefills {
            while p.events().try_recv().is_ok() {}
        }
    }
    let verified = if run.no_verify {
        None
    } else {
        let mut ok = true;
        for (d, s) in decodes.iter().zip(&decode_shapes) {
            let pair = TransferPair::new(&prefill_shapes[0], s).map_err(|e| e.to_string())?;
            for c in 0..n {
                // SAFETY: every pull into these blocks has reported.
                ok &= unsafe { pattern::check_shaped_blocks(d.memory(), &pair, 0, &remote(c), &local(c)) }
                    .map_err(|e| e.to_string())?
                    .is_none();
            }
        }
        Some(ok)
    };
    Ok(Figures {
        gib_per_s: bytes as f64 / f64::from(1u32 << 30) / seconds.max(1e-9),
        bytes: bytes / u64::from(run.iters.max(1)),
        verified,
    })
}

/// Measures every block size in the heterogeneous configuration and the whole-block path
/// beside it; `Ok(false)` when a check failed.
pub(crate) fn bench_hetero(run: &RunArgs) -> Result<bool, String> {
    let (tp_p, tp_d, k) = (run.prefill_tp.max(1), run.decode_tp.max(1), run.block_ratio.max(1));
    if !run.json {
        println!(
            "{:>9} {:>6} {:>10} {:>12} {:>12} {:>8} {:>8}",
            "block", "TP p>d", "bytes", "slice GiB/s", "whole GiB/s", "ratio", "verified"
        );
    }
    let mut all_ok = true;
    for &block in &run.block_bytes {
        let slice = measure(run, block, (tp_p, tp_d, k), false)?;
        let whole = measure(run, block, (1, 1, 1), true)?;
        let ok = slice.verified != Some(false) && whole.verified != Some(false);
        all_ok &= ok;
        let ratio = slice.gib_per_s / whole.gib_per_s.max(1e-12);
        if run.json {
            println!(
                "{}",
                json!({
                    "transport": run.transport.to_string(),
                    "block_bytes": block,
                    "prefill_tp": tp_p,
                    "decode_tp": tp_d,
                    "block_ratio": k,
                    "bytes": slice.bytes,
                    "slice_gib_per_s": slice.gib_per_s,
                    "whole_gib_per_s": whole.gib_per_s,
                    "whole_bytes": whole.bytes,
                    "ratio_slice_vs_whole": ratio,
                    "verified": slice.verified.zip(whole.verified).map(|(a, b)| a && b),
                })
            );
        } else {
            let verified = match slice.verified.zip(whole.verified) {
                None => "skipped",
                Some((true, true)) => "yes",
                Some(_) => "FAILED",
            };
            println!(
                "{:>9} {:>6} {:>10} {:>12.3} {:>12.3} {:>8.2} {:>8}",
                human(block),
                format!("{tp_p}>{tp_d}{}", if k > 1 { format!(" k{k}") } else { String::new() }),
                human(slice.bytes),
                slice.gib_per_s,
                whole.gib_per_s,
                ratio,
                verified
            );
        }
    }
    Ok(all_ok)
}
