//! Glue between the engine and kvxfer-ucx: starting the UCX side of an agent over its
//! registered memory, the handshake offer, and turning block runs into UCX get pieces.
//! The engine's UCX `unsafe` calls live here and in `decode.rs`, each with its SAFETY note.
#![allow(unsafe_code)]

use std::sync::Arc;

use kvxfer_core::plan::BlockRun;
use kvxfer_core::BlockLayout;
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1;
use kvxfer_proto::Message;
use kvxfer_ucx::{GetPiece, RegionInfo, Span, TargetInfo, UcxConfig, UcxError, UcxInitiator, UcxTarget};

fn spans(memory: &KvMemory) -> Vec<Span> {
    memory.regions().iter().map(|r| Span { ptr: r.as_ptr(), len: r.len() }).collect()
}

/// Maps a prefill agent's regions for remote reads.
pub(crate) fn start_target(config: &UcxConfig, memory: &Arc<KvMemory>) -> Result<UcxTarget, UcxError> {
    // SAFETY: the regions belong to `memory`, which the target keeps alive (keep_alive)
    // until it has unmapped them; remote peers only read them, and only blocks pinned by a
    // read guard are read by well-behaved peers (the access contract of kvxfer-mem).
    unsafe { UcxTarget::start(config, spans(memory), memory.clone()) }
}

/// Maps a decode agent's regions as destinations of reads.
pub(crate) fn start_initiator(config: &UcxConfig, memory: &Arc<KvMemory>) -> Result<UcxInitiator, UcxError> {
    // SAFETY: as above; the initiator keeps `memory` alive until its regions are unmapped,
    // and it writes only into destination blocks claimed by a pull (`UcxInitiator::get`).
    unsafe { UcxInitiator::start(config, spans(memory), memory.clone()) }
}

/// Starts the UCX side of an agent when its config wants it: `None` for `tcp`, and under
/// `auto` when UCX cannot start here (logged); an error when UCX was required.
pub(crate) fn start_if_wanted<T>(
    config: &crate::AgentConfig,
    start: impl FnOnce(&UcxConfig) -> Result<T, UcxError>,
) -> Result<Option<T>, crate::Error> {
    match config.transport {
        crate::TransportChoice::Tcp => Ok(None),
        choice => match start(&config.ucx) {
            Ok(t) => Ok(Some(t)),
            Err(e) if choice == crate::TransportChoice::Ucx => Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "UCX unavailable; using TCP only");
                Ok(None)
            }
        },
    }
}

/// The handshake offer of a UCX target.
pub(crate) fn offer(target: &UcxTarget) -> v1::TransportOffer {
    let info = target.info();
    let wire = v1::UcxInfo {
        worker_address: info.worker_address.clone(),
        regions: info
            .regions
            .iter()
            .map(|r| v1::UcxRegion { base: r.base, len: r.len, rkey: r.rkey.clone() })
            .collect(),
    };
    v1::TransportOffer { transport: v1::Transport::Ucx as i32, connection_info: wire.encode_to_vec() }
}

/// Parses a peer's UCX offer, if it made one.
pub(crate) fn parse_offer(offers: &[v1::TransportOffer]) -> Option<Result<TargetInfo, String>> {
    let o = offers.iter().find(|o| o.transport == v1::Transport::Ucx as i32)?;
    Some(
        v1::UcxInfo::decode(o.connection_info.as_slice())
            .map(|w| TargetInfo {
                worker_address: w.worker_address,
                regions: w
                    .regions
                    .into_iter()
                    .map(|r| RegionInfo { base: r.base, len: r.len, rkey: r.rkey })
                    .collect(),
            })
            .map_err(|e| format!("malformed UCX offer: {e}")),
    )
}

/// The get pieces that move `runs` from the peer (laid out as `remote`) into `local`: one
/// piece per run and segment where both sides are packed, else one per block.
pub(crate) fn pieces(local: &KvMemory, remote: &BlockLayout, runs: &[BlockRun]) -> Vec<GetPiece> {
    let mut out = Vec::new();
    for run in runs {
        for (s, (ls, rs)) in local.layout().segments().iter().zip(remote.segments()).enumerate() {
            let base = local.regions()[s].as_ptr();
            let len = ls.block_len as usize;
            let piece = |l: u64, r: u64, n: usize| GetPiece {
                // The block is inside the local layout (checked by the plan), so the offset
                // is inside the region.
                local: base.wrapping_add((l * ls.stride) as usize),
                remote_region: s,
                remote_offset: r * rs.stride,
                len: len * n,
            };
            if ls.is_packed() && rs.is_packed() {
                out.push(piece(u64::from(run.local_start), u64::from(run.remote_start), run.count as usize));
            } else {
                for i in 0..u64::from(run.count) {
                    out.push(piece(u64::from(run.local_start) + i, u64::from(run.remote_start) + i, 1));
                }
            }
        }
    }
    out
}
