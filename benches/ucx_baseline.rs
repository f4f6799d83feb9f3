//! The raw UCX get baseline (`--baseline` with `--transport ucx`): the same bytes read with
//! `ucp_get_nbx` between the same two processes (or within the one process), through
//! kvxfer-ucx's thin layer only — one registered region each side, one endpoint, every
//! get (one per child's contiguous bytes, as kvxfer's plan makes them) issued at once, no leases, pins, handshake or notifies. The real ceiling
//! of kvxfer's UCX path on this machine and transport set.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_mem::Region;
use kvxfer_ucx::{GetPiece, RegionInfo, Span, TargetInfo, UcxBuffer, UcxConfig, UcxInitiator, UcxTarget};
use serde_json::{json, Value};

use crate::cli::Memory;

/// UCX settings of a raw run (what the agents get from `--ucx-tls`, `--ucx-peer-failure`).
pub(crate) fn raw_config(tls: &Option<String>, peer_failure: bool) -> UcxConfig {
    UcxConfig {
        tls: tls.clone(),
        peer_failure_handling: peer_failure,
        same_host_shared_memory: false,
        verify_payloads: false,
    }
}

/// A touched region of `bytes` (every page written once, so no first-touch fault is timed).
fn touched_region(bytes: u64, fill: u8) -> Result<Arc<Region>, String> {
    let len = usize::try_from(bytes).map_err(|e| e.to_string())?;
    let region = Region::alloc(len).map_err(|e| e.to_string())?;
    // SAFETY: the region was just allocated here and nobody else holds it yet.
    unsafe { region.slice_mut(0, len) }.fill(fill);
    Ok(Arc::new(region))
}

/// Registers `bytes` of filled memory as a UCX target; returns it (keep it alive while the
/// baseline reads) with what an initiator needs. The memory is the kind kvxfer's prefill
/// memory is in the same run (`--memory`, `source::start_prefill`): UCX's own
/// ([`UcxBuffer`]) or a page-aligned heap region UCX only registers.
pub(crate) fn start_target(
    config: &UcxConfig,
    bytes: u64,
    memory: Memory,
) -> Result<(UcxTarget, TargetInfo), String> {
    let len = usize::try_from(bytes).map_err(|e| e.to_string())?;
    let (span, keep): (Span, Arc<dyn Any + Send + Sync>) = match memory {
        Memory::Ucx => {
            let buffer = UcxBuffer::alloc(config, len).map_err(|e| e.to_string())?;
            // SAFETY: the buffer holds at least `len` bytes and nobody else has its address yet.
            unsafe { std::ptr::write_bytes(buffer.as_ptr(), 0x5a, len) };
            (Span { ptr: buffer.as_ptr(), len }, Arc::new(buffer))
        }
        Memory::Heap => {
            let region = touched_region(bytes, 0x5a)?;
            (Span { ptr: region.as_ptr(), len: region.len() }, region)
        }
    };
    // SAFETY: `keep` owns the memory the span covers and is dropped by the target only
    // after the region is unmapped; nothing writes it after this point.
    let target = unsafe { UcxTarget::start(config, vec![span], keep) }.map_err(|e| e.to_string())?;
    let info = target.info().clone();
    Ok((target, info))
}

/// A target's info as the control socket carries it (hex for the opaque bytes).
pub(crate) fn info_to_json(info: &TargetInfo) -> Value {
    json!({
        "worker_address": hex::encode(&info.worker_address),
        "regions": info.regions.iter().map(|r| json!({"base": r.base, "len": r.len, "rkey": hex::encode(&r.rkey)}))
            .collect::<Vec<_>>(),
    })
}

/// The inverse of [`info_to_json`].
pub(crate) fn info_from_json(v: &Value) -> Result<TargetInfo, String> {
    let hex_field = |v: &Value, k: &str| -> Result<Vec<u8>, String> {
        hex::decode(v.get(k).and_then(Value::as_str).ok_or(format!("target info lacks {k}"))?)
            .map_err(|e| e.to_string())
    };
    let regions = v
        .get("regions")
        .and_then(Value::as_array)
        .ok_or("target info lacks regions")?
        .iter()
        .map(|r| {
            Ok(RegionInfo {
                base: r.get("base").and_then(Value::as_u64).ok_or("region lacks base")?,
                len: r.get("len").and_then(Value::as_u64).ok_or("region lacks len")?,
                rkey: hex_field(r, "rkey")?,
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(TargetInfo { worker_address: hex_field(v, "worker_address")?, regions })
}

/// Reads `total` bytes of the target `info` into a local region `iters` times, as
/// `piece`-byte gets all issued at once (kvxfer's plan makes one get per child when the
/// child's blocks are contiguous on both sides, as in the bench: pass the bytes per child); returns GiB/s per iteration. The endpoint is
/// connected and the first read (unmeasured) done before the clock starts.
pub(crate) fn raw_ucx_get_gib_per_s(
    config: &UcxConfig,
    info: TargetInfo,
    total: u64,
    piece: u64,
    iters: u32,
) -> Result<Vec<f64>, String> {
    let local = touched_region(total, 1)?;
    let base = local.as_ptr();
    let span = Span { ptr: base, len: local.len() };
    let keep: Arc<dyn Any + Send + Sync> = local;
    // SAFETY: `keep` owns the region; only the gets below write it, one read at a time.
    let initiator = unsafe { UcxInitiator::start(config, vec![span], keep) }.map_err(|e| e.to_string())?;
    let (tx, rx) = crossbeam_channel::bounded(1);
    initiator.connect("raw", info, Box::new(move |r| drop(tx.send(r))));
    rx.recv_timeout(Duration::from_secs(10))
        .map_err(|_| "raw UCX connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let piece = piece.clamp(1, total);
    let pieces: Vec<GetPiece> = (0..total / piece)
        .map(|i| GetPiece {
            // In bounds: i * piece + piece <= total = the region's length.
            local: base.wrapping_add((i * piece) as usize),
            remote_region: 0,
            remote_offset: i * piece,
            len: piece as usize,
        })
        .collect();
    let mut rates = Vec::new();
    for iter in 0..=iters {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let t0 = Instant::now();
        // SAFETY: every piece lies in the registered local region, and nothing else touches
        // it until `done` ran (we wait for it below).
        unsafe { initiator.get("raw", pieces.clone(), Box::new(move |r| drop(tx.send(r)))) };
        let got = rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| "raw UCX get timed out".to_string())?
            .map_err(|e| e.to_string())?;
        let secs = t0.elapsed().as_secs_f64();
        if iter > 0 {
            rates.push(got as f64 / f64::from(1u32 << 30) / secs);
        }
    }
    initiator.disconnect("raw");
    Ok(rates)
}
