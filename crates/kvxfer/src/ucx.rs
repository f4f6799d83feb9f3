//! Everything UCX in the engine (the `ucx` feature gates this one file): starting the UCX
//! side of an agent over its registered memory, the handshake offer, the decode side's
//! endpoint per peer, and the one-sided read protocol — pin on the control protocol,
//! `ucp_get_nbx` straight into the claimed local blocks, unpin — with the reads UCX could
//! not stop ([`HeldReads`]). The engine's UCX `unsafe` calls live here, each with its
//! SAFETY note.
#![allow(unsafe_code)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::Sender;
use kvxfer_core::log;
use kvxfer_core::pull::{PullError, ReadResult};
use kvxfer_core::{BlockId, ChildHandoff};
use tracing::{debug, info, warn};

use crate::decode::report::Reclaimed;
use crate::decode::shared::{Inner, Peer};
use crate::TransportChoice;

use kvxfer_core::plan::BlockRun;
use kvxfer_core::BlockLayout;
use std::ptr::NonNull;

use kvxfer_mem::{KvMemory, Region};
use kvxfer_proto::v1;
use kvxfer_proto::Message;
use kvxfer_ucx::{
    GetPiece, RegionInfo, Span, TargetInfo, UcxBuffer, UcxConfig, UcxError, UcxInitiator, UcxTarget,
};

/// Every region of every KV-cache group, group 0's first: region `r` of the offer (and of
/// the initiator's mapping) is segment `r - first` of the group whose regions start at
/// `first` ([`region_base`]).
fn spans(memory: &KvMemory) -> Vec<Span> {
    memory.all_regions().map(|r| Span { ptr: r.as_ptr(), len: r.len() }).collect()
}

/// The index of KV-cache group `group`'s first region among [`spans`]: the segments of the
/// groups before it (the same on both sides, whose groups have the same segment counts).
pub(crate) fn region_base(memory: &KvMemory, group: usize) -> usize {
    memory.group_layouts().take(group).map(|l| l.segments().len()).sum()
}

/// A zeroed region of `len` bytes in memory UCX allocated for the transports of `config`
/// ([`kvxfer_ucx::UcxBuffer`]): give a prefill agent whose UCX settings are `config` its KV
/// cache in such regions (`KvMemory::alloc_in`) and a decode agent on the same host reads
/// them through shared memory with one-sided copies, instead of UCX 1.13's active-message
/// emulation of gets from merely registered memory, which needs the prefill side's UCX
/// thread to copy every fragment (BENCHMARKING.md, UCX shared memory). Other regions work
/// as before.
///
/// Releasing the memory is UCX teardown (`ucp_mem_unmap`, and `ucp_cleanup` of the shared
/// context by its last holder): when the region is dropped on a tokio runtime's thread
/// (e.g. the last `KvMemory` of an async agent's shutdown), that runs on a `kvxfer-teardown`
/// thread, which [`crate::wait_for_teardown`] (and a blocking agent's drop) waits for.
///
/// Fails if UCX cannot allocate the memory, or gives no thread-safe context to share it
/// from ([`UcxBuffer::alloc`]): fall back to ordinary memory then.
pub fn ucx_region(config: &UcxConfig, len: usize) -> Result<Region, crate::Error> {
    if len == 0 {
        return Ok(Region::alloc(0)?);
    }
    let buffer = UcxBuffer::alloc(config, len)?;
    let ptr = NonNull::new(buffer.as_ptr())
        .ok_or_else(|| crate::Error::Unsupported("UCX allocated a null region".into()))?;
    // SAFETY: the buffer holds at least `len` bytes at `ptr` (UcxBuffer::alloc checked),
    // valid for writes until it is dropped, and nobody else has its address yet.
    unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
    let keep_alive = crate::runtime::DropOffRuntime::new(buffer);
    // SAFETY: the memory stays valid for reads and writes from any thread while the
    // buffer lives, and the region owns the buffer (its keep-alive), so it is valid for as
    // long as the region is. The access contract is the caller's, as for any region.
    Ok(unsafe { Region::borrowed(ptr, len, Some(Box::new(keep_alive))) })
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
/// [`start_if_wanted`] on `handle`'s blocking pool: UCX starts a thread and waits for it to
/// set up, which must not happen on a runtime thread.
pub(crate) async fn start_off_runtime<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    config: &crate::AgentConfig,
    start: impl FnOnce(&UcxConfig) -> Result<T, UcxError> + Send + 'static,
) -> Result<Option<T>, crate::Error> {
    if config.transport == crate::TransportChoice::Tcp {
        return Ok(None);
    }
    let c = config.clone();
    match handle.spawn_blocking(move || start_if_wanted(&c, start)).await {
        Ok(r) => r,
        Err(e) => Err(crate::Error::Unsupported(format!("starting UCX failed: {e}"))),
    }
}

pub(crate) fn start_if_wanted<T>(
    config: &crate::AgentConfig,
    start: impl FnOnce(&UcxConfig) -> Result<T, UcxError>,
) -> Result<Option<T>, crate::Error> {
    match config.transport {
        crate::TransportChoice::Tcp => Ok(None),
        choice => match start(&config.ucx) {
            Ok(t) => Ok(Some(t)),
            Err(e) if choice == crate::TransportChoice::Ucx => Err(explain(e, &config.ucx).into()),
            Err(e) => {
                tracing::warn!(error = %explain(e, &config.ucx), "UCX unavailable; using TCP only");
                Ok(None)
            }
        },
    }
}

/// `e` (UCX failed to start) with the transports asked for and those UCX finds here.
fn explain(e: UcxError, config: &UcxConfig) -> UcxError {
    let asked = config.tls.as_deref().unwrap_or("UCX's default (or UCX_TLS)");
    let any = UcxConfig { tls: None, ..config.clone() };
    let here = match kvxfer_ucx::ucx_transports(&any) {
        Ok(t) => t.join(","),
        Err(e) => format!("none ({e})"),
    };
    e.with_context(format!("transports asked: {asked}; UCX finds here: {here}"))
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
/// piece per run and segment where both sides are packed, else one per block. `local` and
/// `remote` are one KV-cache group's memory and layout, whose regions start at
/// `region_base` among the peer's.
pub(crate) fn pieces(
    local: &KvMemory,
    remote: &BlockLayout,
    region_base: usize,
    runs: &[BlockRun],
) -> Vec<GetPiece> {
    let mut out = Vec::new();
    for run in runs {
        for (s, (ls, rs)) in local.layout().segments().iter().zip(remote.segments()).enumerate() {
            let base = local.regions()[s].as_ptr();
            let len = ls.block_len as usize;
            let piece = |l: u64, r: u64, n: usize| GetPiece {
                // The block is inside the local layout (checked by the plan), so the offset
                // is inside the region.
                local: base.wrapping_add((l * ls.stride) as usize),
                remote_region: region_base + s,
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

/// A head-slice read over UCX: the heads asked of every block, the gets that move them
/// (from [`slice_gets`]), and their local destinations in the order a TCP read would send
/// them (what the CRC of a verified read runs over).
pub(crate) struct SliceGets {
    pub(crate) head_slice: Option<(u32, u32)>,
    pub(crate) pieces: Vec<GetPiece>,
    pub(crate) chunks: Vec<kvxfer_mem::Chunk>,
    pub(crate) bytes: u64,
}

/// One get per contiguous copy of a plan's pieces (one source rank, one group): from the
/// peer's region `region_base + segment` at `remote block * remote stride + offset`, into
/// `local`'s region at `local block * local stride + offset`; neighbours contiguous on both
/// sides are merged into one get.
pub(crate) fn slice_gets(
    local: &KvMemory,
    remote_strides: &[u64],
    region_base: usize,
    plan_pieces: impl Iterator<Item = kvxfer_core::xfer::Piece>,
) -> Vec<GetPiece> {
    let segments = local.layout().segments();
    let mut out: Vec<GetPiece> = Vec::new();
    for p in plan_pieces {
        let (lstride, rstride) = (segments[p.segment].stride, remote_strides[p.segment]);
        let base = local.regions()[p.segment].as_ptr();
        for t in 0..u64::from(p.blocks) {
            let g = GetPiece {
                // Inside the region: the plan checked the local block against the layout.
                local: base
                    .wrapping_add(((u64::from(p.local_block) + t) * lstride + p.local_offset) as usize),
                remote_region: region_base + p.segment,
                remote_offset: (u64::from(p.remote_block) + t) * rstride + p.remote_offset,
                len: p.len as usize,
            };
            match out.last_mut() {
                Some(last)
                    if last.remote_region == g.remote_region
                        && last.local.wrapping_add(last.len) == g.local
                        && last.remote_offset + last.len as u64 == g.remote_offset =>
                {
                    last.len += g.len;
                }
                _ => out.push(g),
            }
        }
    }
    out
}

/// Makes (or reuses) the UCX endpoint to `peer` from its handshake answer: `Ok(Some(the
/// endpoint's transports))` when reads may use UCX, `Ok(None)` to fall back to TCP (`auto`),
/// an error when UCX is required and unusable.
pub(crate) async fn connect(
    inner: &Inner,
    peer: &Peer,
    ack: &v1::HelloAck,
) -> Result<Option<Vec<String>>, PullError> {
    let want = inner.config.transport;
    let Some(init) = inner.ucx() else { return Ok(None) };
    let unavailable = |detail: String| PullError::TransportUnavailable { peer: peer.addr.clone(), detail };
    match parse_offer(&ack.transports) {
        Some(Ok(info)) => {
            let engine = (ack.engine_id.clone(), ack.incarnation);
            let mut connected = peer.ucx_engine.lock().await;
            if let Some((_, transports)) = connected.as_ref().filter(|(e, _)| *e == engine) {
                return Ok(Some(transports.clone()));
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            let same_host = is_this_host(&peer.addr);
            init.connect_on_host(&peer.ucx_endpoint, info, same_host, Box::new(move |r| drop(tx.send(r))));
            match rx.await {
                Ok(Ok(transports)) => {
                    info!(peer = %peer.addr, transports = %transports.join(","), "UCX endpoint ready");
                    *connected = Some((engine, transports.clone()));
                    Ok(Some(transports))
                }
                Ok(Err(e)) if want == TransportChoice::Ucx => {
                    Err(unavailable(format!("UCX to {}: {e}", peer.addr)))
                }
                Ok(Err(e)) => {
                    warn!(peer = %peer.addr, error = %log::Peer(&e), "UCX endpoint failed; pulling over TCP");
                    Ok(None)
                }
                Err(_) => Err(unavailable("the UCX thread stopped".into())),
            }
        }
        Some(Err(e)) if want == TransportChoice::Ucx => Err(unavailable(e)),
        Some(Err(e)) => {
            warn!(peer = %peer.addr, error = %log::Peer(&e), "ignoring the peer's UCX offer");
            Ok(None)
        }
        None => Ok(None),
    }
}

/// Whether `addr` (`host:port` with an IP address) is on this host
/// ([`kvxfer_ucx::is_local_address`]). A host name is not resolved here and counts as
/// another host (peer-failure handling stays on: no shared memory for it).
fn is_this_host(addr: &str) -> bool {
    addr.parse::<std::net::SocketAddr>().is_ok_and(|sa| kvxfer_ucx::is_local_address(sa.ip()))
}

/// Pins child `i`'s runs on a pooled connection, reads them with UCX straight into the
/// local blocks, and unpins. A read UCX cannot stop is [`ReadResult::Abandoned`]: its
/// blocks stay held (in `held`) until UCX completes it, and so does its pin (a task keeps its
/// connection, and unpins then).
pub(crate) async fn read_child(
    inner: &Inner,
    peer: &Peer,
    child: &ChildHandoff,
    (group, local, runs): (u32, &KvMemory, &[BlockRun]),
    remote: &BlockLayout,
    slice: Option<SliceGets>,
    (held, i): (&Arc<HeldReads>, usize),
) -> ReadResult {
    let ucx_err = |detail: String| PullError::UcxRead { peer: peer.addr.clone(), detail };
    let Some(init) = inner.ucx() else { return ReadResult::Failed(ucx_err("this agent has no UCX".into())) };
    let (_permit, mut conn, _) = match peer.checkout(inner).await {
        Ok(c) => c,
        Err(e) => return ReadResult::Failed(e),
    };
    let id = child.remote_request_id();
    let verify = inner.config.ucx.verify_payloads;
    let head_slice = slice.as_ref().and_then(|s| s.head_slice);
    let grant = match conn.pin_group(id, child.token().as_bytes(), (group, head_slice), runs, verify).await {
        Ok(p) => p,
        Err(e) => {
            let error = crate::decode::peer::read_error(&e, inner, id);
            peer.checkin(conn, &Err::<(), _>(e));
            return ReadResult::Failed(error);
        }
    };
    let (pieces, slice_chunks, slice_bytes) = match slice {
        Some(s) => (s.pieces, Some(s.chunks), Some(s.bytes)),
        None => (pieces(local, remote, region_base(&inner.memory, group as usize), runs), None, None),
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Whether the pull gave up on the read before UCX completed it (then the completion
    // releases the blocks it held, from the UCX thread).
    let fate = Arc::new(Mutex::new(ReadFate::Waiting));
    let (done_held, done_fate) = (held.clone(), fate.clone());
    // SAFETY: every piece lands in local blocks of `runs`, which this pull claimed in
    // `submit` (no other pull writes them; the caller does not touch them until their
    // report, which the pull machine sends only after this read ended or was abandoned with
    // its blocks held) and which `ResultPlan::build` checked against the local layout,
    // inside the regions the initiator registered.
    unsafe {
        init.get(
            &peer.ucx_endpoint,
            pieces,
            Box::new(move |r| {
                drop(tx.send(r));
                done_held.completed(&done_fate);
            }),
        )
    };
    // Bounded: a peer that stops answering must not hang the pull. The allowance grows
    // with the size of the read (100 MB/s is far below any working UCX transport).
    let bytes: u64 = slice_bytes
        .unwrap_or_else(|| runs.iter().map(|r| u64::from(r.count)).sum::<u64>() * remote.block_bytes());
    // Not past the time the prefill side holds the pin (it grows with the pin's size; a
    // read finishing after it is refused by the unpin anyway), but never sooner than
    // `io_timeout`, the least a read is given before it counts as stuck: aborting a UCX
    // endpoint with a get in flight can make UCX 1.13 abort the prefill process (tcp).
    let io_timeout = inner.config.limits.io_timeout;
    let stuck = io_timeout + Duration::from_secs_f64(bytes as f64 / 100e6);
    let limit = stuck.min(grant.held_for.max(io_timeout));
    let (seq, pinned_crc) = (grant.seq, grant.payload_crc32c);
    let pinned_at = tokio::time::Instant::now();
    let mut rx = rx;
    let result = match tokio::time::timeout(limit, &mut rx).await {
        Ok(Ok(r)) => r.map_err(|e| ucx_err(e.to_string())),
        Ok(Err(_)) => Err(ucx_err("the UCX thread stopped".to_owned())),
        Err(_) => {
            init.abort(&peer.ucx_endpoint);
            match tokio::time::timeout(io_timeout, &mut rx).await {
                Ok(_) => Err(ucx_err(format!("UCX read made no progress in {limit:?}; endpoint aborted"))),
                // UCX still owns the read: its destination blocks are held (reported
                // FailedBlocksHeld) until UCX completes it.
                Err(_) if held.abandon(i, &fate) => {
                    let e = ucx_err(format!(
                        "UCX read made no progress in {limit:?} and did not stop after the endpoint was \
                         aborted; its local blocks stay held until it completes"
                    ));
                    // The endpoint may be broken: the next pull makes a new one.
                    init.disconnect(&peer.ucx_endpoint);
                    *peer.ucx_engine.lock().await = None;
                    // The pin stays held until UCX is done with the read: unpinning now would
                    // tell the prefill side its blocks (and, at its shutdown, its memory and UCX
                    // target) are free while our get may still read them — and a target gone
                    // before the get completed means it never completes, and these blocks
                    // never come back. Not past the pin's hold: the prefill side drops it then.
                    let hold_left = grant.held_for.saturating_sub(pinned_at.elapsed());
                    tokio::spawn(async move {
                        let completed = tokio::time::timeout(hold_left, rx).await.is_ok();
                        let unpinned = conn.unpin(seq, false).await;
                        debug!(seq, completed, ?unpinned, "pin of an abandoned UCX read released");
                    });
                    debug!(remote_request_id = %log::Peer(&id), error = %log::Peer(&e), "child read over UCX abandoned");
                    return ReadResult::Abandoned(e);
                }
                Err(_) => Err(ucx_err(format!("UCX read made no progress in {limit:?}; endpoint aborted"))),
            }
        }
    };
    // With payload verification on, the read must have fetched what was pinned.
    let result = result.and_then(|b| {
        let Some(want) = pinned_crc else { return Ok(b) };
        let got = match &slice_chunks {
            // SAFETY: the read completed, so UCX no longer writes these bytes, and this pull
            // still holds their blocks (see above).
            Some(chunks) => unsafe { local.crc32c_chunks(chunks) },
            // SAFETY: as above, for whole blocks.
            None => unsafe { local.crc32c(runs.iter().map(|r| (r.local_start, r.count))) },
        };
        kvxfer_tcp::check_crc(&peer.addr, seq, want, got)
            .map(|()| b)
            .map_err(|e| PullError::Integrity { peer: peer.addr.clone(), detail: e.to_string() })
    });
    if result.is_err() {
        // The endpoint may be broken: the next pull makes a new one.
        init.disconnect(&peer.ucx_endpoint);
        *peer.ucx_engine.lock().await = None;
    }
    let unpinned = conn.unpin(seq, result.is_ok()).await;
    // The read counts only if the pin was held until it finished; an unpin that got no
    // answer cannot prove that either.
    let result = match (&unpinned, result) {
        (Ok(true), r) | (_, r @ Err(_)) => r,
        (Ok(false), Ok(_)) => Err(PullError::PinNotHeld {
            peer: peer.addr.clone(),
            detail: format!(
                "{} dropped pin {seq} before the read finished (its pin_timeout passed); the blocks read may \
                 no longer have been leased",
                peer.addr
            ),
        }),
        (Err(e), Ok(_)) => Err(PullError::PinNotHeld {
            peer: peer.addr.clone(),
            detail: format!("unpin {seq} failed, so the read cannot be trusted: {e}"),
        }),
    };
    peer.checkin(conn, &unpinned);
    debug!(remote_request_id = %log::Peer(&id), ?result, "child read over UCX");
    match result {
        Ok(bytes) => ReadResult::Ok { bytes },
        Err(e) => ReadResult::Failed(e),
    }
}

/// One-sided reads of a pull that the transport could not stop, and the blocks they hold:
/// released (and announced on `DecodeAgent::reclaimed`) when the last of them completes
/// and the pull has reported. Completions arrive on the transport's thread.
pub(crate) struct HeldReads {
    busy: Arc<Mutex<HashSet<BlockId>>>,
    reclaimed: Sender<Reclaimed>,
    state: Mutex<HeldState>,
}

#[derive(Default)]
struct HeldState {
    /// Reads abandoned by the pull and not yet completed.
    outstanding: usize,
    /// Set once the pull reported: what to release and announce when `outstanding` is 0.
    release: Option<(HashSet<BlockId>, Reclaimed)>,
}

/// What became of one one-sided read: completed, or abandoned by its pull first.
#[derive(Debug, Default)]
enum ReadFate {
    #[default]
    Waiting,
    Completed,
    Abandoned,
}

impl HeldReads {
    pub(crate) fn new(busy: Arc<Mutex<HashSet<BlockId>>>, reclaimed: Sender<Reclaimed>) -> Self {
        HeldReads { busy, reclaimed, state: Mutex::new(HeldState::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HeldState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The read of child `i` with `fate` is given up while UCX may still write: true if it
    /// is now held, false if it completed meanwhile.
    fn abandon(&self, i: usize, fate: &Mutex<ReadFate>) -> bool {
        let mut fate = fate.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*fate, ReadFate::Completed) {
            return false;
        }
        *fate = ReadFate::Abandoned;
        self.lock().outstanding += 1;
        debug!(child = i, "UCX read abandoned; its blocks stay held");
        true
    }

    /// The transport finished the read with `fate` (on its own thread).
    fn completed(&self, fate: &Mutex<ReadFate>) {
        let mut fate = fate.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*fate, ReadFate::Abandoned) {
            let mut st = self.lock();
            st.outstanding -= 1;
            self.release_if_done(&mut st);
        }
        *fate = ReadFate::Completed;
    }

    /// The pull reported: release `blocks` (announcing `reclaimed`) once no abandoned read
    /// is outstanding — now, if none is.
    pub(crate) fn finish(&self, blocks: HashSet<BlockId>, reclaimed: Reclaimed) {
        let mut st = self.lock();
        st.release = Some((blocks, reclaimed));
        self.release_if_done(&mut st);
    }

    fn release_if_done(&self, st: &mut HeldState) {
        if st.outstanding > 0 {
            return;
        }
        let Some((blocks, reclaimed)) = st.release.take() else { return };
        {
            let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
            for b in &blocks {
                busy.remove(b);
            }
        }
        info!(parent = %log::Peer(&reclaimed.parent_request_id), blocks = blocks.len(), "held blocks reclaimed: the stuck read completed");
        // The agent (and every receiver) may be gone: then nobody needs telling.
        let _ = self.reclaimed.send(reclaimed);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// What a tracing subscriber wrote.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Runs `f` with a debug-level subscriber on this thread only: whether UCX released an
    /// allocation on this thread meanwhile (`kvxfer_ucx` logs it).
    fn releases_on_this_thread(f: impl FnOnce()) -> bool {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = out.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        String::from_utf8_lossy(&text).contains("UCX allocation released")
    }

    /// Releasing UCX-allocated memory is UCX teardown (`ucp_mem_unmap`, maybe
    /// `ucp_cleanup`): dropped on a runtime's thread (the last `KvMemory` of an async
    /// agent), it runs on a `kvxfer-teardown` thread that `wait_for_teardown` waits for, so
    /// a host exiting after that wait does not race it with UCX's exit handlers. On a plain
    /// thread it runs in place.
    #[test]
    fn ucx_region_dropped_on_a_runtime_thread_is_released_on_a_tracked_teardown_thread() {
        let config = UcxConfig {
            tls: Some("posix,sysv,cma,self".into()),
            peer_failure_handling: false,
            ..Default::default()
        };
        let region = ucx_region(&config, 4096).expect("region");
        assert!(releases_on_this_thread(|| drop(region)), "dropped on a plain thread: released in place");
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let region = ucx_region(&config, 4096).expect("region");
        assert!(
            !releases_on_this_thread(|| rt.block_on(async move { drop(region) })),
            "UCX teardown ran on the runtime's thread"
        );
        assert!(crate::wait_for_teardown(Duration::from_secs(10)));
    }
}
