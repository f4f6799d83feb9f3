//! Serving one TCP read on a prefill-side connection: the read guard taken against the
//! lease table (or the refusal answered), then the payload written straight from
//! registered memory with vectored writes, CRC-32C taken group by group, all within the
//! read's overall deadline.

use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvxfer_core::log::Peer;
use kvxfer_core::plan::BlockRange;
use kvxfer_core::{BlockCrcs, BlockId, GroupCrcs, ReadGuard, ReadRefused};
use kvxfer_mem::{Chunk, Crc32cShift, KvMemory};
use kvxfer_proto::v1::{self, ErrorCode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::{debug, warn};

use crate::context::ServeContext;
use crate::frame::{Frame, FrameError, FrameReader};
use crate::stats::bump;

/// What a refused read is told: its code and message. An unknown id and a wrong token get
/// the same answer, so a peer without the token cannot tell unknown, live and ended ids
/// apart (the prefill side's counters and log still tell them apart; "ended" is said only
/// with the right token).
fn refusal_answer(r: &ReadRefused, id: &str) -> (ErrorCode, String) {
    match r {
        ReadRefused::Unknown(_) | ReadRefused::BadToken(_) => {
            (ErrorCode::UnknownLease, format!("no lease for request {id} with this token"))
        }
        ReadRefused::Ended(_) => (ErrorCode::LeaseEnded, r.to_string()),
        ReadRefused::OutOfRange { .. }
        | ReadRefused::NotLeased { .. }
        | ReadRefused::BadSize { .. }
        | ReadRefused::EmptyRange { .. }
        | ReadRefused::NoSuchGroup { .. } => (ErrorCode::BlockOutOfRange, r.to_string()),
        _ => (ErrorCode::Internal, r.to_string()),
    }
}

/// The block ranges a read or pin request asks for.
pub(crate) fn ranges_of(req: &v1::ReadRequest) -> Vec<BlockRange> {
    req.ranges.iter().map(|r| BlockRange { start: r.start, count: r.count }).collect()
}

/// The memory of the KV-cache group a read or pin request names. The lease table refuses
/// a group the layout does not have before this is asked ([`begin`]), and it is built from
/// this memory, so `None` is never expected; it is answered as an internal error.
pub(crate) fn group_memory<'c>(
    ctx: &'c ServeContext,
    req: &v1::ReadRequest,
) -> Result<&'c KvMemory, v1::Error> {
    ctx.memory.group(req.group as usize).ok_or_else(|| v1::Error {
        code: ErrorCode::Internal as i32,
        message: format!("KV-cache group {} has no memory here", req.group),
        seq: req.seq,
    })
}

/// What a read sends of every block, per segment of its group: `(offset, len)` in the
/// block. `None` without a head slice (whole blocks). A head slice is checked against this
/// rank's shape — heads `first .. first + count` must be some of its heads, without
/// overflow — so every range lies inside its block; without a shape it is refused.
pub(crate) type BlockSlices = Option<Vec<(u64, u64)>>;

fn block_slices(ctx: &ServeContext, req: &v1::ReadRequest) -> Result<BlockSlices, v1::Error> {
    let Some(slice) = &req.head_slice else { return Ok(None) };
    let refuse =
        |message: String| v1::Error { code: ErrorCode::BlockOutOfRange as i32, message, seq: req.seq };
    let Some(shape) = &ctx.shape else {
        return Err(refuse(format!(
            "read for request {}: a head slice was asked for, but this agent has no KV-cache shape",
            req.remote_request_id
        )));
    };
    let heads = shape.heads_per_rank();
    let end = slice.first.checked_add(slice.count);
    if slice.count == 0 || end.is_none_or(|e| e > heads) {
        return Err(refuse(format!(
            "read for request {}: head slice {}+{} is outside this rank's {heads} heads",
            req.remote_request_id, slice.first, slice.count
        )));
    }
    // Below `heads_per_rank` heads, so inside `block_len = heads * head_bytes` (which the
    // shape computed without overflow).
    Ok(Some(
        shape
            .segments(req.group as usize)
            .iter()
            .map(|s| (u64::from(slice.first) * s.head_bytes(), u64::from(slice.count) * s.head_bytes()))
            .collect(),
    ))
}

/// The chunks of a read's payload, in wire order: per range, per segment, the whole run
/// ([`KvMemory::run_chunks`]) or, with a head slice, each block's slice.
pub(crate) fn payload_chunks<'m>(
    mem: &'m KvMemory,
    ranges: &'m [BlockRange],
    slices: &'m BlockSlices,
) -> Box<dyn Iterator<Item = Chunk> + Send + 'm> {
    match slices {
        None => Box::new(ranges.iter().flat_map(|r| mem.run_chunks(r.start, r.count))),
        Some(slices) => Box::new(ranges.iter().flat_map(move |r| {
            mem.layout().segments().iter().zip(slices).enumerate().flat_map(
                move |(region, (seg, &(off, len)))| {
                    r.iter().map(move |b| Chunk {
                        region,
                        offset: (u64::from(b) * seg.stride + off) as usize,
                        len: len as usize,
                    })
                },
            )
        })),
    }
}

/// Takes a read guard for a read or pin request: the guard, the payload bytes and what is
/// sent of every block, or the error to answer with. The lease table checks the ranges
/// (against the named KV-cache group) and the token; the head slice (against this rank's
/// heads) is checked next, its guard dropped if refused. Every refusal is counted in
/// `reads_refused`.
pub(crate) fn begin(
    ctx: &ServeContext,
    req: &v1::ReadRequest,
) -> Result<(ReadGuard, u64, BlockSlices), v1::Error> {
    let ranges = ranges_of(req);
    let now = Instant::now();
    match ctx.table.begin_group_read(&req.remote_request_id, &req.lease_token, req.group, &ranges, now) {
        Ok(g) => {
            let slices = block_slices(ctx, req).inspect_err(|e| {
                bump(&ctx.counters.reads_refused);
                if let Some(suppressed) = ctx.counters.warnings.allow() {
                    warn!(remote_request_id = %Peer(&req.remote_request_id), suppressed, "read refused: {}", Peer(&e.message));
                }
            })?;
            let per_block = match &slices {
                None => group_memory(ctx, req)?.layout().block_bytes(),
                Some(s) => s.iter().map(|&(_, len)| len).sum(),
            };
            let bytes = ranges.iter().map(|r| u64::from(r.count) * per_block).sum();
            Ok((g, bytes, slices))
        }
        Err(refused) => {
            bump(&ctx.counters.reads_refused);
            if let Some(suppressed) = ctx.counters.warnings.allow() {
                warn!(remote_request_id = %Peer(&req.remote_request_id), suppressed, "read refused: {}", Peer(&refused));
            }
            let (code, message) = refusal_answer(&refused, &req.remote_request_id);
            Err(v1::Error { code: code as i32, message, seq: req.seq })
        }
    }
}

/// Until when a read or pin that `guard` holds may hold it: `allowance` from `now`, but never
/// past the lease's hard deadline ([`ReadGuard::expires_no_later_than`], its maximum
/// lifetime) plus `Limits::io_timeout` — a lease's blocks are never held (much) past its
/// maximum lifetime, however slow the transfer rate allowed, and a read or pin taken just
/// before it still gets the io timeout.
pub(crate) fn guard_deadline(
    ctx: &ServeContext,
    guard: &ReadGuard,
    now: Instant,
    allowance: Duration,
) -> Instant {
    let wanted = crate::instant_after(now, allowance);
    match guard.expires_no_later_than() {
        Some(hard) => wanted.min(crate::instant_after(hard, ctx.limits.io_timeout)),
        None => wanted,
    }
}

/// Counts (and warns about, rate-limited) a read whose payload missed its deadline, and
/// makes the close a reset: what is still queued in the send buffer is dropped rather than
/// trickled out to the slow reader after the connection is "closed".
fn too_slow(stream: &TcpStream, ctx: &ServeContext, e: &FrameError, bytes: u64) {
    if matches!(e, FrameError::Timeout) {
        let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
        bump(&ctx.counters.slow_transfers);
        if let Some(suppressed) = ctx.counters.warnings.allow() {
            warn!(
                bytes,
                suppressed,
                "closing connection: a read's payload did not move within {:?} (or by the lease's maximum lifetime)",
                ctx.limits.transfer_deadline(bytes)
            );
        }
    }
}

/// The CRC-32C of a read's payload, taken in wire order: from the bytes, or for a whole
/// block whose CRC the lease's store holds ([`BlockCrcs`], `AgentConfig::precompute_crcs`)
/// from that value. Head-slice reads (part of each block) and blocks not computed yet are
/// checksummed from their bytes.
pub(crate) struct PayloadCrc<'a> {
    /// The store of the read's group; `None` for a head-slice read or a lease without one.
    stored: Option<&'a GroupCrcs>,
    segments: &'a [kvxfer_core::Segment],
    /// Per segment, the shift of one block's bytes (made when there is a store).
    shifts: Vec<Crc32cShift>,
    /// The CRC so far.
    pub(crate) crc: u32,
    /// Payload bytes whose CRC came from the store.
    pub(crate) precomputed: u64,
}

impl<'a> PayloadCrc<'a> {
    pub(crate) fn new(
        mem: &'a KvMemory,
        slices: &BlockSlices,
        crcs: Option<&'a BlockCrcs>,
        group: u32,
    ) -> Self {
        let stored = match (slices, crcs) {
            (None, Some(crcs)) => crcs.group(group as usize),
            _ => None,
        };
        let segments = mem.layout().segments();
        let shifts = match stored {
            Some(_) => segments.iter().map(|s| Crc32cShift::new(s.block_len)).collect(),
            None => Vec::new(),
        };
        PayloadCrc { stored, segments, shifts, crc: 0, precomputed: 0 }
    }

    /// The bytes of chunk `c` of the payload, block by block with each block's stored CRC
    /// (`None`: not stored) when there is a store; else all of it at once, with `None`. A
    /// chunk of whole blocks of segment `c.region` starts at block `c.offset / stride`.
    pub(crate) fn pieces<'b>(
        &self,
        c: Chunk,
        bytes: &'b [u8],
    ) -> impl Iterator<Item = (&'b [u8], Option<u32>)> + use<'a, 'b> {
        let stored = self.stored;
        let (per_block, first) = match (stored, self.segments.get(c.region)) {
            (Some(_), Some(seg)) if seg.stride > 0 => (seg.block_len as usize, c.offset as u64 / seg.stride),
            _ => (bytes.len(), 0),
        };
        (0u64..).zip(bytes.chunks(per_block.max(1))).map(move |(i, block_bytes)| {
            let known = stored.and_then(|g| {
                let block = BlockId::try_from(first + i).ok()?;
                g.get(g.index_of(block)?, c.region)
            });
            (block_bytes, known)
        })
    }

    /// Appends a whole block of segment `segment` from its stored CRC.
    pub(crate) fn combine(&mut self, segment: usize, value: u32, len: usize) {
        self.crc = self.shifts[segment].combine(self.crc, value);
        self.precomputed += len as u64;
    }

    /// Appends bytes.
    pub(crate) fn append(&mut self, bytes: &[u8]) {
        self.crc = kvxfer_mem::crc32c_append(self.crc, bytes);
    }
}

/// Bytes of payload checksummed and written per vectored write: small enough to stay in
/// cache between the CRC and the kernel's copy.
const CRC_GROUP: usize = 256 * 1024;

/// Slices per vectored write at most (head-slice reads send many small ones; the kernel
/// takes at most 1024 per call).
const MAX_IOV: usize = 512;

/// Writes all of `slices`: each write must make progress within `timeout`, and all of them
/// finish by `deadline` (the read's overall deadline), else [`FrameError::Timeout`]. With
/// `more`, see [`write_some`].
async fn write_all_vectored(
    stream: &mut TcpStream,
    slices: &mut [IoSlice<'_>],
    timeout: Duration,
    deadline: Instant,
    more: bool,
) -> Result<(), FrameError> {
    let mut rest = slices;
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(timeout.min(left), write_some(stream, rest, more))
            .await
            .map_err(|_| FrameError::Timeout)??;
        if n == 0 {
            return Err(FrameError::Io(std::io::ErrorKind::WriteZero.into()));
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// One vectored write. With `more`, on Linux, it tells the kernel more follows
/// (`MSG_MORE`): a last segment shorter than a full one waits for the next write — the
/// notify's answer right behind — and leaves with it in one segment, so the decode side is
/// woken once for the end of the payload and the answer instead of twice. (The kernel sends
/// it anyway after 200 ms; the answer follows within microseconds.)
async fn write_some(stream: &mut TcpStream, slices: &[IoSlice<'_>], more: bool) -> std::io::Result<usize> {
    #[cfg(target_os = "linux")]
    if more {
        loop {
            stream.writable().await?;
            let sock = socket2::SockRef::from(&*stream);
            let flags = libc::MSG_MORE | libc::MSG_NOSIGNAL;
            match stream
                .try_io(tokio::io::Interest::WRITABLE, || sock.send_vectored_with_flags(slices, flags))
            {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }
    let _ = more;
    stream.write_vectored(slices).await
}

/// Whether the next frame is a notify of lease `id` with the read's `token` (one with
/// another token may wait for an arm before its answer, which would leave the payload's
/// corked end waiting too): a decode agent that sends its notify
/// with its read (`notify_with_read`) puts both in one write, so the notify usually came in
/// the same read as the request and is in `reader` already. When no whole frame is
/// buffered, one read that never waits takes what the socket has (into `reader`, where the
/// connection loop finds it next). `false` when nothing, or not all of that frame, is
/// there yet, or the socket failed (the connection loop's next read meets the failure).
pub(crate) fn notify_follows(
    stream: &TcpStream,
    reader: &mut FrameReader,
    id: &str,
    token: &[u8],
    caps: impl Into<crate::frame::FrameCaps>,
) -> bool {
    let caps = caps.into();
    if !reader.holds_frame(caps) {
        match stream.try_read(reader.spare()) {
            Ok(n) => reader.filled(n),
            Err(_) => return false,
        }
    }
    matches!(
        reader.peek_frame(caps),
        Some(Frame::Notify(n)) if n.remote_request_id == id && n.lease_token == token
    )
}

/// Serves one `ReadRequest`: a `ReadResponse` header, the payload and its CRC-32C trailer,
/// or an error frame when the read is refused (the connection goes on). With
/// `answer_follows` (its notify is already waiting behind it, see [`notify_follows`]), the
/// last write tells the kernel more follows, so the end of the payload leaves together with
/// the notify's answer.
pub(crate) async fn serve_read(
    stream: &mut TcpStream,
    ctx: &ServeContext,
    req: v1::ReadRequest,
    scratch: &mut Vec<u8>,
    answer_follows: bool,
) -> Result<ReadServed, FrameError> {
    let refused = ReadServed::Refused(req.remote_request_id.clone());
    if ctx.memory.is_device() {
        // Checked before the lease is touched: a TCP read would copy device memory on the CPU.
        let e = v1::Error {
            code: ErrorCode::Internal as i32,
            message: "this prefill agent's KV cache is device memory, which it serves only over UCX \
                      (pull with UCX)"
                .into(),
            seq: req.seq,
        };
        crate::context::write_reply(stream, ctx, &Frame::Error(e), scratch).await?;
        return Ok(refused);
    }
    let (guard, payload_len, slices) = match begin(ctx, &req) {
        Ok(g) => g,
        Err(e) => {
            crate::context::write_reply(stream, ctx, &Frame::Error(e), scratch).await?;
            return Ok(refused);
        }
    };
    let ranges = ranges_of(&req);
    let mem = match group_memory(ctx, &req) {
        Ok(m) => m,
        Err(e) => {
            crate::context::write_reply(stream, ctx, &Frame::Error(e), scratch).await?;
            return Ok(refused);
        }
    };
    scratch.clear();
    Frame::ReadResponse(v1::ReadResponse { seq: req.seq, payload_len }).encode(scratch);
    let io_timeout = ctx.limits.io_timeout;
    // The whole payload must move by this deadline, not only make progress every
    // `io_timeout`: a peer reading a byte at a time cannot hold the read guard for ever —
    // nor past the lease's maximum lifetime (plus the io timeout).
    let deadline = guard_deadline(ctx, &guard, Instant::now(), ctx.limits.transfer_deadline(payload_len));
    // Written in groups of about CRC_GROUP bytes: each group's CRC is taken just before the
    // kernel copies it, while it is in cache; the header rides with the first group and the
    // CRC trailer with the last. A block whose CRC was precomputed (whole-block reads of a
    // lease made with a CRC store) is not read for it: its stored CRC is combined instead.
    let mut crc = PayloadCrc::new(mem, &slices, guard.block_crcs(), req.group);
    let mut trailer = [0u8; 4];
    let mut io: Vec<IoSlice<'_>> = Vec::with_capacity(16);
    io.push(IoSlice::new(scratch));
    let mut group = 0usize;
    for c in payload_chunks(mem, &ranges, &slices) {
        // SAFETY: `guard` pins the lease, and every block of `ranges` was checked by
        // `begin_group_read` to belong to it and to the group `mem` holds (a head slice lies
        // inside each block, checked by `begin`); the owner does not write leased blocks
        // (the access contract of kvxfer-mem). The slices die before `guard` is dropped.
        let bytes = unsafe { mem.chunk(c) };
        for (block_bytes, known) in crc.pieces(c, bytes) {
            if let Some(value) = known {
                crc.combine(c.region, value, block_bytes.len());
            }
            for piece in block_bytes.chunks(CRC_GROUP) {
                if known.is_none() {
                    crc.append(piece);
                }
                io.push(IoSlice::new(piece));
                group += piece.len();
                if group >= CRC_GROUP || io.len() >= MAX_IOV {
                    write_all_vectored(stream, &mut io, io_timeout, deadline, false)
                        .await
                        .inspect_err(|e| too_slow(stream, ctx, e, payload_len))?;
                    io.clear();
                    group = 0;
                }
            }
        }
    }
    let (crc, precomputed) = (crc.crc, crc.precomputed);
    trailer.copy_from_slice(&crc.to_be_bytes());
    io.push(IoSlice::new(&trailer));
    let last = write_all_vectored(stream, &mut io, io_timeout, deadline, answer_follows).await;
    last.inspect_err(|e| too_slow(stream, ctx, e, payload_len))?;
    drop(io);
    drop(guard);
    ctx.counters.bytes_served.fetch_add(payload_len, Ordering::Relaxed);
    ctx.counters.bytes_served_tcp.fetch_add(payload_len, Ordering::Relaxed);
    ctx.counters.crc_bytes_precomputed.fetch_add(precomputed, Ordering::Relaxed);
    bump(&ctx.counters.reads_served);
    debug!(remote_request_id = %Peer(&req.remote_request_id), bytes = payload_len, "read served");
    Ok(ReadServed::Sent)
}

/// How a read ended (when the connection survived it).
pub(crate) enum ReadServed {
    /// Its payload and trailer were sent.
    Sent,
    /// It was refused (an error frame was sent instead): the read of this lease id.
    Refused(String),
}

#[cfg(test)]
pub(crate) mod tests {
    use kvxfer_core::plan::BlockRange;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use super::notify_follows;
    use crate::frame::{Frame, FrameReader};
    use kvxfer_proto::v1;

    /// A connected pair on 127.0.0.1: (the decode side's end, the prefill side's end).
    pub(crate) async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr")).await.expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        (client, server)
    }

    /// Memory of `segments` (block length, stride padding) over `num_blocks` blocks, every
    /// byte distinct-ish (the block pattern of kvxfer-mem's tests is per block; strides'
    /// padding is filled too, so a piece read from the wrong place would show).
    pub(crate) fn patterned(num_blocks: u32, segments: &[(u64, u64)], seed: u32) -> kvxfer_mem::KvMemory {
        let segs =
            segments.iter().map(|&(len, pad)| kvxfer_core::Segment { block_len: len, stride: len + pad });
        let layout = kvxfer_core::BlockLayout::new(num_blocks, segs.collect(), "u8", 16).expect("layout");
        let mem = kvxfer_mem::KvMemory::alloc(layout).expect("memory");
        for (r, region) in mem.regions().iter().enumerate() {
            let c = kvxfer_mem::Chunk { region: r, offset: 0, len: region.len() };
            // SAFETY: nothing else touches this fresh memory.
            let bytes = unsafe { mem.chunk_mut(c) };
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = ((i as u32 ^ (r as u32) << 20).wrapping_add(seed).wrapping_mul(2_654_435_761) >> 11)
                    as u8;
            }
        }
        mem
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(96))]
        /// The payload CRC a read sends, combined from the blocks' stored CRCs where the
        /// store has them and checksummed from the bytes where it does not (not computed
        /// yet, or not leased), equals the CRC of the payload's bytes — for arbitrary ranges
        /// over packed and strided segments, and with no store or a store not published.
        #[test]
        fn a_payload_crc_from_stored_block_crcs_equals_the_streamed_one(
            segments in proptest::collection::vec((1u64..300, 0u64..3), 1..4),
            ranges in proptest::collection::vec((0u32..24, 1u32..9), 1..6),
            stored in proptest::collection::vec(proptest::prelude::any::<bool>(), 32 * 3),
            leased in proptest::collection::vec(0u32..32, 0..32),
            published in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u32>(),
        ) {
            let segments: Vec<(u64, u64)> =
                segments.into_iter().map(|(len, pad)| (len, if pad == 2 { 0 } else { pad * 17 })).collect();
            let mem = patterned(32, &segments, seed);
            let ranges: Vec<BlockRange> = ranges.into_iter().map(|(start, count)| BlockRange { start, count }).collect();
            let crcs = kvxfer_core::BlockCrcs::new();
            if published {
                let g = &crcs.publish(vec![kvxfer_core::GroupCrcs::new(&leased, segments.len())])[0];
                for (i, &b) in g.blocks().iter().enumerate() {
                    for (seg, s) in mem.layout().segments().iter().enumerate() {
                        if stored[b as usize * 3 + seg] {
                            let c = kvxfer_mem::Chunk { region: seg, offset: (u64::from(b) * s.stride) as usize, len: s.block_len as usize };
                            // SAFETY: nothing writes this memory.
                            g.set(i, seg, kvxfer_mem::crc32c_append(0, unsafe { mem.chunk(c) }));
                        }
                    }
                }
            }
            // SAFETY: nothing writes this memory.
            let want = unsafe { mem.crc32c(ranges.iter().map(|r| (r.start, r.count))) };
            for store in [Some(&crcs), None] {
                let mut crc = super::PayloadCrc::new(&mem, &None, store, 0);
                let mut sent = Vec::new();
                for c in super::payload_chunks(&mem, &ranges, &None) {
                    // SAFETY: as above.
                    let bytes = unsafe { mem.chunk(c) };
                    for (block, known) in crc.pieces(c, bytes) {
                        sent.extend_from_slice(block);
                        match known {
                            Some(v) => crc.combine(c.region, v, block.len()),
                            None => block.chunks(7).for_each(|p| crc.append(p)),
                        }
                    }
                }
                proptest::prop_assert_eq!(crc.crc, want);
                proptest::prop_assert_eq!(kvxfer_mem::crc32c_append(0, &sent), want, "the bytes sent, in wire order");
                if store.is_none() || !published {
                    proptest::prop_assert_eq!(crc.precomputed, 0);
                }
            }
        }
    }

    /// A head-slice read (part of each block) never uses the store, whatever it holds.
    #[test]
    fn a_head_slice_read_checksums_its_bytes() {
        let mem = patterned(4, &[(64, 0)], 1);
        let crcs = kvxfer_core::BlockCrcs::new();
        let g = &crcs.publish(vec![kvxfer_core::GroupCrcs::new(&[0, 1, 2, 3], 1)])[0];
        (0..4).for_each(|i| g.set(i, 0, 0xdead_beef));
        let slices = Some(vec![(16, 32)]);
        let crc = super::PayloadCrc::new(&mem, &slices, Some(&crcs), 0);
        let c = kvxfer_mem::Chunk { region: 0, offset: 16, len: 32 };
        // SAFETY: nothing writes this memory.
        let bytes = unsafe { mem.chunk(c) };
        let pieces: Vec<_> = crc.pieces(c, bytes).collect();
        assert_eq!(pieces, vec![(bytes, None)]);
    }

    /// The lease token of the notifies here.
    const T: [u8; 16] = [7; 16];

    fn notify(id: &str) -> Vec<u8> {
        let mut out = Vec::new();
        let n =
            v1::Notify { remote_request_id: id.into(), lease_token: T.to_vec(), consumer_id: "d/0".into() };
        Frame::Notify(n).encode(&mut out);
        out
    }

    /// Waits until `n` bytes are readable on `s` (peeking, nothing taken).
    pub(crate) async fn readable(s: &TcpStream, n: usize) {
        let mut buf = vec![0u8; n];
        while s.peek(&mut buf).await.expect("peek") < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_notify_of_the_same_lease_waiting_behind_the_read_is_seen_and_kept_for_the_loop() {
        let (mut client, mut server) = pair().await;
        let mut reader = FrameReader::new();
        assert!(!notify_follows(&server, &mut reader, "0_P", &T, 1 << 20), "nothing is waiting");
        let bytes = notify("0_P");
        client.write_all(&bytes).await.expect("write");
        readable(&server, bytes.len()).await;
        assert!(notify_follows(&server, &mut reader, "0_P", &T, 1 << 20));
        assert!(!notify_follows(&server, &mut reader, "1_P", &T, 1 << 20), "another lease's notify");
        assert!(!notify_follows(&server, &mut reader, "0_P", &[8; 16], 1 << 20), "another token's notify");
        assert!(!notify_follows(&server, &mut reader, "0_P", &T, 8), "a frame over the limit is not parsed");
        // Still there for the connection loop to read.
        assert!(notify_follows(&server, &mut reader, "0_P", &T, 1 << 20));
        let f = reader.read_frame(&mut server, 1 << 20).await.expect("the notify");
        assert!(matches!(f, Frame::Notify(n) if n.remote_request_id == "0_P"));
    }

    #[tokio::test]
    async fn a_notify_already_in_the_buffer_is_seen_without_the_socket() {
        let (mut client, mut server) = pair().await;
        // A read request and its notify in one write, as `notify_with_read` sends them.
        let mut bytes = Vec::new();
        Frame::Heartbeat(v1::Heartbeat { leases: Vec::new() }).encode(&mut bytes);
        bytes.extend_from_slice(&notify("0_P"));
        client.write_all(&bytes).await.expect("write");
        readable(&server, bytes.len()).await;
        let mut reader = FrameReader::new();
        let first = reader.read_frame(&mut server, 1 << 20).await.expect("the first frame");
        assert!(matches!(first, Frame::Heartbeat(_)));
        assert_eq!(reader.buffered().len(), notify("0_P").len(), "the notify came in the same read");
        assert!(notify_follows(&server, &mut reader, "0_P", &T, 1 << 20));
    }

    #[tokio::test]
    async fn half_a_notify_or_another_frame_is_not_a_notify_following() {
        let (mut client, server) = pair().await;
        let bytes = notify("0_P");
        client.write_all(&bytes[..bytes.len() - 3]).await.expect("write");
        readable(&server, bytes.len() - 3).await;
        let mut reader = FrameReader::new();
        assert!(!notify_follows(&server, &mut reader, "0_P", &T, 1 << 20), "not all of it is there yet");
        client.write_all(&bytes[bytes.len() - 3..]).await.expect("write");
        readable(&server, 3).await;
        assert!(notify_follows(&server, &mut reader, "0_P", &T, 1 << 20), "the rest joins what was buffered");

        let (mut client, server) = pair().await;
        let mut cancel = Vec::new();
        Frame::Cancel(v1::Cancel { remote_request_id: "0_P".into(), lease_token: vec![7; 16] })
            .encode(&mut cancel);
        client.write_all(&cancel).await.expect("write");
        readable(&server, cancel.len()).await;
        assert!(
            !notify_follows(&server, &mut FrameReader::new(), "0_P", &T, 1 << 20),
            "a cancel is not a notify"
        );
    }
}
