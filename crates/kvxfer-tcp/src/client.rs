//! The decode side of one connection.

use std::time::Duration;

use kvxfer_core::plan::BlockRun;
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1::{self, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::frame::{self, Frame, FrameError};
use crate::Limits;

pub use crate::error::ClientError;

/// Most leases [`Connection::heartbeat`] names in one frame (a prefill agent's
/// `Limits::max_leases_per_frame` defaults to four times this).
pub const HEARTBEAT_LEASES_PER_FRAME: usize = 1024;

/// A pin the prefill side granted ([`Connection::pin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinGrant {
    /// The pin's sequence number (for [`Connection::unpin`]).
    pub seq: u64,
    /// The CRC-32C of the pinned blocks, when asked for (check the read against it with
    /// [`check_crc`]).
    pub payload_crc32c: Option<u32>,
    /// How long the prefill side holds the pin (its `pin_timeout`, grown with the pin's
    /// size). A one-sided read still running after that cannot be trusted: bound the read by
    /// it.
    pub held_for: Duration,
}

/// One read of a pipelined batch ([`Connection::read_batch_into`]).
#[derive(Debug, Clone, Copy)]
pub struct BatchRead<'a> {
    /// The lease's remote request id.
    pub id: &'a str,
    /// The lease's token.
    pub token: &'a [u8],
    /// Remote blocks to read and the local blocks they land in (group 0).
    pub runs: &'a [BlockRun],
    /// Send the lease's notify right behind the read request (see
    /// [`Connection::read_into_then_notify`] for when that is right).
    pub notify: bool,
}

/// How a batch of reads ended ([`Connection::read_batch_into`]).
#[derive(Debug)]
pub struct BatchEnd {
    /// Reads answered (each reported as it came), from the first: the batch's reads from
    /// here on were not answered.
    pub answered: usize,
    /// Whether every read was answered and the connection may be pooled again (false after
    /// a failed CRC check too, though the batch went on).
    pub in_step: bool,
    /// Why the reads from `answered` on were not answered, when that error was not an
    /// answered read's own: the batch could not be written, or the connection closed or
    /// broke before the next answer began.
    pub error: Option<ClientError>,
    /// Whether the batch ended because the peer sent nothing (or too little) within the
    /// I/O timeout: it is not likely to answer the reads left either.
    pub timed_out: bool,
}

/// A handshaken connection to a prefill agent. One request at a time, or one pipelined
/// batch of reads ([`Connection::read_batch_into`]).
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    peer: String,
    limits: Limits,
    reader: frame::FrameReader,
    scratch: Vec<u8>,
    next_seq: u64,
    ack: v1::HelloAck,
    payload_started: bool,
}

impl Connection {
    /// Waits for the answer to read `seq`: its `ReadResponse` announcing `expected` bytes
    /// (anything else is refused, naming what came), then marks the payload started.
    /// Returns the progress timeout and the overall deadline of the payload: it must arrive
    /// by then, not only make progress every `io_timeout` — a peer trickling bytes cannot
    /// hold the pull for ever.
    async fn await_read_response(
        &mut self,
        seq: u64,
        expected: u64,
    ) -> Result<(Duration, std::time::Instant), ClientError> {
        match self.recv().await? {
            Frame::ReadResponse(resp) if resp.seq == seq && resp.payload_len == expected => {}
            Frame::ReadResponse(resp) => {
                return Err(ClientError::Integrity {
                    peer: self.peer.clone(),
                    seq,
                    detail: format!(
                        "answered as read {} with {} bytes, expected read {seq} with {expected}",
                        resp.seq, resp.payload_len
                    ),
                })
            }
            Frame::Error(e) if e.seq == seq => return Err(self.refused(e)),
            other => return Err(self.unexpected(&other)),
        }
        self.payload_started = true;
        let deadline =
            crate::instant_after(std::time::Instant::now(), self.limits.transfer_deadline(expected));
        Ok((self.limits.io_timeout, deadline))
    }

    /// Connects to `addr` without a cluster key, sends `hello` and waits for the answer. A
    /// mismatch fails with the peer's message, which names both sides' values.
    pub async fn connect(addr: &str, hello: &v1::Hello, limits: Limits) -> Result<Self, ClientError> {
        Self::connect_with_key(addr, hello, None, limits).await
    }

    /// Connects to `addr` and handshakes: with `key`, the mutual challenge-response of
    /// [`crate::handshake`] (this side proves the key, then accepts the peer's `HelloAck`
    /// only with the peer's MAC over it; a peer that cannot prove the key is refused with
    /// [`ClientError::Auth`]); the `HelloAck` is checked against `hello`. The hello's nonce
    /// and `authenticated` flag are set here.
    pub async fn connect_with_key(
        addr: &str,
        hello: &v1::Hello,
        key: Option<&crate::handshake::ClusterKey>,
        limits: Limits,
    ) -> Result<Self, ClientError> {
        // An IP literal needs no resolver (tokio resolves names on its blocking pool, a thread
        // of the caller's runtime).
        let connect = async {
            match addr.parse::<std::net::SocketAddr>() {
                Ok(a) => TcpStream::connect(a).await,
                Err(_) => TcpStream::connect(addr).await,
            }
        };
        let stream = match tokio::time::timeout(limits.io_timeout, connect).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => return Err(ClientError::Connect { peer: addr.to_owned(), source }),
            Err(_) => {
                return Err(ClientError::Connect {
                    peer: addr.to_owned(),
                    source: std::io::ErrorKind::TimedOut.into(),
                })
            }
        };
        crate::tune_stream(&stream, limits.io_timeout);
        let mut c = Connection {
            stream,
            peer: addr.to_owned(),
            limits,
            reader: frame::FrameReader::new(),
            scratch: Vec::new(),
            next_seq: 1,
            ack: v1::HelloAck::default(),
            payload_started: false,
        };
        c.ack =
            crate::handshake::initiate_buffered(&mut c.stream, &mut c.reader, &c.peer, hello, key, &c.limits)
                .await?;
        Ok(c)
    }

    /// The peer's handshake answer (its engine id, layout and transports).
    pub fn peer_hello(&self) -> &v1::HelloAck {
        &self.ack
    }

    /// Whether the last read answered on this connection ([`Self::read_into`] and its
    /// kin, or the last read of a [`Self::read_batch_into`] taken) got as far as its
    /// payload (its `ReadResponse` header arrived; bytes may have been written into the
    /// destination). False after a read that failed before: nothing of it reached the
    /// destination blocks, so it can be retried on another connection as it is (e.g. a
    /// pooled connection the peer closed as it was reused).
    pub fn payload_started(&self) -> bool {
        self.payload_started
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether the peer closed (or reset) this idle connection, e.g. because its process
    /// restarted — checked without blocking before a pooled connection is reused. Bytes
    /// nobody asked for also make it unusable.
    pub fn closed_by_peer(&self) -> bool {
        if !self.reader.buffered().is_empty() {
            return true;
        }
        match self.stream.try_read(&mut [0u8; 1]) {
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            Ok(_) => true,
        }
    }

    fn frame_err(&self, source: FrameError) -> ClientError {
        ClientError::Frame { peer: self.peer.clone(), source }
    }

    fn unexpected(&self, f: &Frame) -> ClientError {
        ClientError::Protocol {
            peer: self.peer.clone(),
            message: format!("unexpected {:?} frame", f.frame_type()),
        }
    }

    pub(crate) async fn send(&mut self, f: &Frame) -> Result<(), ClientError> {
        let io = frame::write_frame(&mut self.stream, f, &mut self.scratch);
        match tokio::time::timeout(self.limits.io_timeout, io).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.frame_err(e.into())),
            Err(_) => Err(self.frame_err(FrameError::Timeout)),
        }
    }

    /// Sends two frames in one write.
    async fn send_both(&mut self, a: &Frame, b: &Frame) -> Result<(), ClientError> {
        self.scratch.clear();
        a.encode(&mut self.scratch);
        b.encode(&mut self.scratch);
        self.write_scratch().await
    }

    /// Writes the frames encoded in `scratch`, in one write bounded by the I/O timeout.
    async fn write_scratch(&mut self) -> Result<(), ClientError> {
        let io = self.stream.write_all(&self.scratch);
        match tokio::time::timeout(self.limits.io_timeout, io).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.frame_err(FrameError::Io(e))),
            Err(_) => Err(self.frame_err(FrameError::Timeout)),
        }
    }

    pub(crate) async fn recv(&mut self) -> Result<Frame, ClientError> {
        let io = self.reader.read_frame(&mut self.stream, self.limits.max_frame_len);
        match tokio::time::timeout(self.limits.io_timeout, io).await {
            Ok(Ok(f)) => Ok(f),
            Ok(Err(e)) => Err(self.frame_err(e)),
            Err(_) => Err(self.frame_err(FrameError::Timeout)),
        }
    }

    fn refused(&self, e: v1::Error) -> ClientError {
        ClientError::Refused {
            peer: self.peer.clone(),
            code: ErrorCode::try_from(e.code).unwrap_or(ErrorCode::Unspecified),
            message: e.message,
        }
    }

    /// A read (or pin) request for the remote side of `runs`, with the next sequence number.
    fn request(&mut self, id: &str, token: &[u8], group: u32, runs: &[BlockRun]) -> (u64, v1::ReadRequest) {
        let ranges = runs.iter().map(|r| v1::BlockRange { start: r.remote_start, count: r.count }).collect();
        self.request_of(id, token, group, ranges, None)
    }

    /// A read request of `ranges` (of `head_slice`'s heads when given), with the next
    /// sequence number.
    fn request_of(
        &mut self,
        id: &str,
        token: &[u8],
        group: u32,
        ranges: Vec<v1::BlockRange>,
        head_slice: Option<v1::HeadSlice>,
    ) -> (u64, v1::ReadRequest) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let req = v1::ReadRequest {
            seq,
            remote_request_id: id.to_owned(),
            lease_token: token.to_vec(),
            ranges,
            pin_crc32c: false,
            group,
            head_slice,
        };
        (seq, req)
    }

    /// Reads the remote blocks of `runs` of lease `id` straight into their local blocks in
    /// `dest`, and checks them against the CRC-32C trailer the peer sent after them (a
    /// mismatch is [`ClientError::Integrity`]). Returns the payload bytes received.
    ///
    /// # Safety
    /// Nobody else reads or writes the local blocks of `runs` in `dest` until this returns
    /// (they are the destination of a pull under way), and their ids are inside `dest`'s
    /// layout.
    pub async unsafe fn read_into(
        &mut self,
        id: &str,
        token: &[u8],
        runs: &[BlockRun],
        dest: &KvMemory,
    ) -> Result<u64, ClientError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.read_payload(id, token, 0, runs, dest, None) }.await
    }

    /// [`Self::read_into`] for KV-cache group `group`: the runs name group-local blocks on
    /// both sides and `dest` is the local memory of that group.
    ///
    /// # Safety
    /// As [`Self::read_into`], for `dest`.
    pub async unsafe fn read_group_into(
        &mut self,
        id: &str,
        token: &[u8],
        group: u32,
        runs: &[BlockRun],
        dest: &KvMemory,
    ) -> Result<u64, ClientError> {
        // SAFETY: forwarded contract.
        unsafe { self.read_payload(id, token, group, runs, dest, None) }.await
    }

    /// [`Self::read_into`] with the notify of lease `id` by `consumer` written right behind
    /// the read request, in the same write: the prefill side serves the read, then takes the
    /// notify, so the read's payload and the notify's answer come back in one round trip
    /// instead of two. Returns the read's result and, when the connection is still in step
    /// (the read succeeded or was refused), the notify's answer.
    ///
    /// The prefill side counts the notify before this side has checked the payload's CRC:
    /// a payload that fails the check still fails the read (the caller must not use its
    /// blocks), but the lease is then counted as pulled rather than released. Use it only
    /// when nothing but this read needs the lease.
    ///
    /// # Safety
    /// As for [`Self::read_into`].
    pub async unsafe fn read_into_then_notify(
        &mut self,
        id: &str,
        token: &[u8],
        runs: &[BlockRun],
        dest: &KvMemory,
        consumer: &str,
    ) -> (Result<u64, ClientError>, Option<Result<v1::NotifyAck, ClientError>>) {
        let notify = notify_of(id, token, consumer);
        // SAFETY: the caller's contract, passed on.
        let read = unsafe { self.read_payload(id, token, 0, runs, dest, Some(notify)) }.await;
        if read.as_ref().is_err_and(|e| !e.connection_usable()) {
            return (read, None);
        }
        let answer = self.recv_notify_ack().await;
        (read, Some(answer))
    }

    /// The answer to a notify (sent alone, or behind a read).
    async fn recv_notify_ack(&mut self) -> Result<v1::NotifyAck, ClientError> {
        match self.recv().await? {
            Frame::NotifyAck(a) => Ok(a),
            Frame::Error(e) => Err(self.refused(e)),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Reads several leases' blocks pipelined on this connection: every read request (each
    /// with its notify behind it when [`BatchRead::notify`] says so, as in
    /// [`Self::read_into_then_notify`]) goes out in one write, and the answers, which the
    /// prefill side sends in request order, are taken one after another: one round trip for
    /// the whole batch instead of one per read. Each payload is checked against its CRC-32C
    /// trailer, as in [`Self::read_into`].
    ///
    /// `answered(k, read, notify)` is called as soon as read `k` is answered, in order: the
    /// read's result and, when its notify went with it and the connection was still in step
    /// after the read, the notify's answer. A read whose answer breaks the connection
    /// (anything but a refusal, or a payload that arrived whole and failed its CRC check)
    /// ends the batch; after a failed CRC check the batch goes on, and the connection is
    /// not in step for reuse ([`BatchEnd::in_step`]). The reads from [`BatchEnd::answered`] on are
    /// not reported: the connection closed or broke before their answers began (or the
    /// batch could not be written), so nothing reached their blocks — but the prefill side
    /// may have served their requests and taken their notifies.
    ///
    /// Keep a batch's requests small (a few KiB): they are written before any answer is
    /// read, so they must fit in the peer's receive buffer.
    ///
    /// # Safety
    /// As for [`Self::read_into`], for the local blocks of every read's runs; and no two
    /// reads of the batch name the same local block.
    pub async unsafe fn read_batch_into(
        &mut self,
        reads: &[BatchRead<'_>],
        dest: &KvMemory,
        consumer: &str,
        mut answered: impl FnMut(usize, Result<u64, ClientError>, Option<Result<v1::NotifyAck, ClientError>>),
    ) -> BatchEnd {
        self.payload_started = false;
        let mut seqs = Vec::with_capacity(reads.len());
        self.scratch.clear();
        for r in reads {
            let (seq, req) = self.request(r.id, r.token, 0, r.runs);
            Frame::ReadRequest(req).encode(&mut self.scratch);
            if r.notify {
                Frame::Notify(notify_of(r.id, r.token, consumer)).encode(&mut self.scratch);
            }
            seqs.push(seq);
        }
        if let Err(e) = self.write_scratch().await {
            return BatchEnd { answered: 0, in_step: false, timed_out: e.is_timeout(), error: Some(e) };
        }
        // A payload that failed its CRC check arrived whole: the stream is still in step and
        // the batch goes on (the connection is not used again afterwards).
        let mut corrupted = false;
        for (k, (r, &seq)) in reads.iter().zip(&seqs).enumerate() {
            // SAFETY: the caller's contract, passed on (the reads' blocks are disjoint).
            let read = unsafe { self.receive_unchecked(seq, r.runs, dest) }.await;
            let (read, arrived_whole) = match read {
                // Closed or broken before this answer began: neither it nor the rest came.
                Err(e @ ClientError::Frame { source: FrameError::Closed | FrameError::Io(_), .. })
                    if !self.payload_started =>
                {
                    return BatchEnd { answered: k, in_step: false, timed_out: false, error: Some(e) };
                }
                Ok((bytes, trailer, crc)) => {
                    let checked = check_crc(&self.peer, seq, trailer, crc).map(|()| bytes);
                    corrupted |= checked.is_err();
                    (checked, true)
                }
                Err(e) => (Err(e), false),
            };
            let mut timed_out = read.as_ref().is_err_and(ClientError::is_timeout);
            let mut broke = !arrived_whole && read.as_ref().is_err_and(|e| !e.connection_usable());
            let notified = if r.notify && !broke { Some(self.recv_notify_ack().await) } else { None };
            if let Some(Err(e)) = &notified {
                timed_out |= e.is_timeout();
                broke |= !e.connection_usable();
            }
            answered(k, read, notified);
            if broke {
                return BatchEnd { answered: k + 1, in_step: false, timed_out, error: None };
            }
        }
        BatchEnd { answered: reads.len(), in_step: !corrupted, timed_out: false, error: None }
    }

    /// The body of [`Self::read_into`]; with `notify`, that frame goes out with the request.
    ///
    /// # Safety
    /// As for [`Self::read_into`].
    async unsafe fn read_payload(
        &mut self,
        id: &str,
        token: &[u8],
        group: u32,
        runs: &[BlockRun],
        dest: &KvMemory,
        notify: Option<v1::Notify>,
    ) -> Result<u64, ClientError> {
        self.payload_started = false;
        let (seq, req) = self.request(id, token, group, runs);
        match notify {
            None => self.send(&Frame::ReadRequest(req)).await?,
            Some(n) => self.send_both(&Frame::ReadRequest(req), &Frame::Notify(n)).await?,
        }
        // SAFETY: the caller's contract, passed on.
        let (bytes, trailer, crc) = unsafe { self.receive_unchecked(seq, runs, dest) }.await?;
        check_crc(&self.peer, seq, trailer, crc)?;
        Ok(bytes)
    }

    /// The answer to read `seq` of `runs`: its header, the payload straight into the local
    /// blocks of `runs` in `dest`, and the CRC-32C trailer. Returns the payload bytes, the
    /// trailer and the CRC-32C of what arrived, for the caller to compare ([`check_crc`]).
    ///
    /// # Safety
    /// As for [`Self::read_into`].
    async unsafe fn receive_unchecked(
        &mut self,
        seq: u64,
        runs: &[BlockRun],
        dest: &KvMemory,
    ) -> Result<(u64, u32, u32), ClientError> {
        self.payload_started = false;
        let expected: u64 = runs.iter().map(|r| u64::from(r.count) * dest.layout().block_bytes()).sum();
        let (timeout, deadline) = self.await_read_response(seq, expected).await?;
        let mut crc = 0;
        let chunks: Vec<kvxfer_mem::Chunk> =
            runs.iter().flat_map(|run| dest.run_chunks(run.local_start, run.count)).collect();
        for (i, &c) in chunks.iter().enumerate() {
            // SAFETY: the caller guarantees exclusive access to these destination blocks for
            // the duration of this call, and that they are in the layout. One chunk's slice
            // at a time: runs are not known to be disjoint.
            let dst = unsafe { dest.chunk_mut(c) };
            let last = i + 1 == chunks.len();
            let io = (&mut self.stream, &mut self.reader);
            crc = read_payload_spans(io, &mut [dst], last, crc, (timeout, deadline))
                .await
                .map_err(|e| self.frame_err(e))?;
        }
        let trailer = self.read_trailer(timeout, deadline).await?;
        Ok((expected, trailer, crc))
    }

    /// Reads a payload's CRC-32C trailer (usually buffered already, with the payload's end).
    async fn read_trailer(
        &mut self,
        timeout: Duration,
        deadline: std::time::Instant,
    ) -> Result<u32, ClientError> {
        let mut trailer = [0u8; 4];
        let io = (&mut self.stream, &mut self.reader);
        read_payload_spans(io, &mut [&mut trailer], true, 0, (timeout, deadline))
            .await
            .map_err(|e| self.frame_err(e))?;
        Ok(u32::from_be_bytes(trailer))
    }

    /// Reads heads `what.head_slice = (first, count)` (rank-local; `None`: whole blocks) of
    /// the remote blocks `what.ranges` of KV-cache group `what.group` of lease `id`, scattering the
    /// payload straight into `dest` as it lands: payload byte `i` goes to the `i`-th byte of
    /// `chunks` taken in order (each a span of one of `dest`'s regions). The payload is, per
    /// range, per segment, per block, the block's slice (see `ReadRequest.head_slice`), so
    /// the caller lists the destination of every slice in that order; its length must equal
    /// the chunks' total. Vectored reads fill many chunks per call; the CRC-32C trailer is
    /// checked over the bytes as they landed. Returns the payload bytes.
    ///
    /// # Safety
    /// Nobody else reads or writes the bytes of `chunks` until this returns (destination
    /// blocks of a pull under way), and no two chunks overlap.
    ///
    /// # Panics
    /// If a chunk is outside its region (a caller bug: chunks come from a checked plan).
    pub async unsafe fn read_scatter(
        &mut self,
        id: &str,
        token: &[u8],
        what: SliceSpec<'_>,
        dest: &KvMemory,
        chunks: &[kvxfer_mem::Chunk],
    ) -> Result<u64, ClientError> {
        let SliceSpec { group, head_slice, ranges } = what;
        self.payload_started = false;
        let (seq, req) = self.request_of(
            id,
            token,
            group,
            ranges.iter().map(|r| v1::BlockRange { start: r.start, count: r.count }).collect(),
            head_slice.map(|(first, count)| v1::HeadSlice { first, count }),
        );
        self.send(&Frame::ReadRequest(req)).await?;
        let expected: u64 = chunks.iter().map(|c| c.len as u64).sum();
        let (timeout, deadline) = self.await_read_response(seq, expected).await?;
        // SAFETY: the caller guarantees exclusive access to the chunks' bytes, which do not
        // overlap, so these mutable slices are disjoint and unaliased until they drop.
        let mut spans: Vec<&mut [u8]> = chunks.iter().map(|&c| unsafe { dest.chunk_mut(c) }).collect();
        let io = (&mut self.stream, &mut self.reader);
        let crc = read_payload_spans(io, &mut spans, true, 0, (timeout, deadline))
            .await
            .map_err(|e| self.frame_err(e))?;
        drop(spans);
        let trailer = self.read_trailer(timeout, deadline).await?;
        check_crc(&self.peer, seq, trailer, crc)?;
        Ok(expected)
    }

    /// Pins `runs` of lease `id` for a one-sided read (UCX, RDMA): the prefill side holds a
    /// read guard until [`Self::unpin`], until this connection closes, or until the time it
    /// states in the grant passes. Returns the grant: the pin's sequence number, how long it
    /// is held and, if `want_crc`, the CRC-32C of the pinned blocks.
    pub async fn pin(
        &mut self,
        id: &str,
        token: &[u8],
        runs: &[BlockRun],
        want_crc: bool,
    ) -> Result<PinGrant, ClientError> {
        self.pin_group(id, token, (0, None), runs, want_crc).await
    }

    /// [`Self::pin`] of blocks of KV-cache group `group` (group-local ids); with a head
    /// slice `(first, count)`, the CRC (if wanted) covers only those heads of each block,
    /// in the order a read of them would send them.
    pub async fn pin_group(
        &mut self,
        id: &str,
        token: &[u8],
        (group, head_slice): (u32, Option<(u32, u32)>),
        runs: &[BlockRun],
        want_crc: bool,
    ) -> Result<PinGrant, ClientError> {
        let (seq, mut req) = self.request(id, token, group, runs);
        req.pin_crc32c = want_crc;
        req.head_slice = head_slice.map(|(first, count)| v1::HeadSlice { first, count });
        self.send(&Frame::Pin(req)).await?;
        match self.recv().await? {
            Frame::PinAck(a) if a.seq == seq => Ok(PinGrant {
                seq,
                payload_crc32c: want_crc.then_some(a.payload_crc32c),
                held_for: Duration::from_millis(a.held_for_ms),
            }),
            Frame::Error(e) if e.seq == seq => Err(self.refused(e)),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Ends pin `seq`; `completed` says whether the one-sided read succeeded. Returns whether
    /// the pin was still held: `false` means the prefill side had dropped it, so a read that
    /// finished before this call may have seen blocks no longer leased and must not be used.
    pub async fn unpin(&mut self, seq: u64, completed: bool) -> Result<bool, ClientError> {
        self.send(&Frame::Unpin(v1::Unpin { seq, completed })).await?;
        match self.recv().await? {
            Frame::UnpinAck(a) if a.seq == seq => Ok(a.held),
            Frame::Error(e) => Err(self.refused(e)),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Tells the prefill side `consumer` finished pulling lease `id`.
    pub async fn notify(
        &mut self,
        id: &str,
        token: &[u8],
        consumer: &str,
    ) -> Result<v1::NotifyAck, ClientError> {
        self.send(&Frame::Notify(notify_of(id, token, consumer))).await?;
        self.recv_notify_ack().await
    }

    /// Keeps leases alive while their pulls are slow; one outcome per lease. Sent in frames
    /// of at most [`HEARTBEAT_LEASES_PER_FRAME`] leases (a prefill agent refuses frames naming
    /// more than its `Limits::max_leases_per_frame`, 4096 by default), one after another.
    pub async fn heartbeat(
        &mut self,
        leases: Vec<v1::LeaseRef>,
    ) -> Result<Vec<v1::LeaseOutcome>, ClientError> {
        let mut outcomes = Vec::with_capacity(leases.len());
        let mut leases = leases.into_iter().peekable();
        loop {
            let chunk: Vec<v1::LeaseRef> = leases.by_ref().take(HEARTBEAT_LEASES_PER_FRAME).collect();
            let count = chunk.len();
            self.send(&Frame::Heartbeat(v1::Heartbeat { leases: chunk })).await?;
            match self.recv().await? {
                Frame::HeartbeatAck(a) if a.outcomes.len() == count => outcomes.extend(
                    a.outcomes
                        .into_iter()
                        .map(|o| v1::LeaseOutcome::try_from(o).unwrap_or(v1::LeaseOutcome::Unspecified)),
                ),
                Frame::Error(e) => return Err(self.refused(e)),
                other => return Err(self.unexpected(&other)),
            }
            if leases.peek().is_none() {
                return Ok(outcomes);
            }
        }
    }

    /// Releases lease `id` now.
    pub async fn cancel(&mut self, id: &str, token: &[u8]) -> Result<v1::LeaseOutcome, ClientError> {
        let c = v1::Cancel { remote_request_id: id.to_owned(), lease_token: token.to_vec() };
        self.send(&Frame::Cancel(c)).await?;
        match self.recv().await? {
            Frame::CancelAck(a) => {
                Ok(v1::LeaseOutcome::try_from(a.outcome).unwrap_or(v1::LeaseOutcome::Unspecified))
            }
            Frame::Error(e) => Err(self.refused(e)),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Sends raw bytes (tests of malformed input use this to break the protocol on purpose).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }
}

/// The notify of lease `id` (with `token`) by `consumer`.
fn notify_of(id: &str, token: &[u8], consumer: &str) -> v1::Notify {
    v1::Notify {
        remote_request_id: id.to_owned(),
        lease_token: token.to_vec(),
        consumer_id: consumer.to_owned(),
    }
}

/// Compares a payload's CRC-32C with the one its peer announced for read (or pin) `seq`.
pub fn check_crc(peer: &str, seq: u64, announced: u32, computed: u32) -> Result<(), ClientError> {
    if announced == computed {
        return Ok(());
    }
    Err(ClientError::Integrity {
        peer: peer.to_owned(),
        seq,
        detail: format!("CRC-32C {computed:#010x}, announced {announced:#010x}"),
    })
}

/// What a [`Connection::read_scatter`] asks for: blocks `ranges` of KV-cache group `group`,
/// and of each block heads `head_slice = (first, count)` of the serving rank (`None`: whole
/// blocks).
#[derive(Debug, Clone, Copy)]
pub struct SliceSpec<'a> {
    /// The KV-cache group.
    pub group: u32,
    /// Rank-local heads `(first, count)`, or `None` for whole blocks.
    pub head_slice: Option<(u32, u32)>,
    /// The remote block ranges.
    pub ranges: &'a [kvxfer_core::plan::BlockRange],
}

/// Slices filled per vectored read (the kernel caps an iovec list at 1024).
const SCATTER_SLICES: usize = 64;

/// Payload bytes left at most when a read of them also offers the reader's room for what
/// follows (see [`read_payload_spans`]).
const TAIL_WITHIN: usize = 256 * 1024;

/// Fills every span of `spans` in order: first with what `reader` holds (bytes that came
/// with the response's header), then with vectored reads straight from `stream` (up to
/// [`SCATTER_SLICES`] spans per read). With `tail` (the spans end the payload), the last
/// slice of the read that reaches the last span (within its last [`TAIL_WITHIN`] bytes) is
/// `reader`'s spare room, so what follows the payload (its trailer, the next frame) comes
/// in the same call. Each read must make
/// progress within `timeout` and all must be done by `deadline`, else
/// [`FrameError::Timeout`]. Returns `crc` with every span byte folded in as it lands.
async fn read_payload_spans(
    (stream, reader): (&mut TcpStream, &mut frame::FrameReader),
    spans: &mut [&mut [u8]],
    tail: bool,
    mut crc: u32,
    (timeout, deadline): (Duration, std::time::Instant),
) -> Result<u32, FrameError> {
    // Position: span index and offset in it.
    let (mut at, mut off) = (0usize, 0usize);
    while at < spans.len() {
        if spans[at].len() == off {
            at += 1;
            off = 0;
            continue;
        }
        let n = match reader.take_into(&mut spans[at][off..]) {
            0 => {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                // The reader's room rides along only near the payload's end: before that, a
                // plain read (which tokio knows drained the socket when it comes back short)
                // saves the would-block call a vectored try costs after each short read.
                let near_end =
                    tail && spans[at..].iter().map(|s| s.len()).sum::<usize>() - off <= TAIL_WITHIN;
                let read = read_spans_once(stream, reader, &mut spans[at..], off, near_end);
                let n = tokio::time::timeout(timeout.min(left), read)
                    .await
                    .map_err(|_| FrameError::Timeout)??;
                if n == 0 {
                    return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                n
            }
            n => n,
        };
        // Fold what landed into the CRC, span by span, advancing the position.
        let mut n = n;
        while n > 0 && at < spans.len() {
            let take = (spans[at].len() - off).min(n);
            crc = kvxfer_mem::crc32c_append(crc, &spans[at][off..off + take]);
            off += take;
            n -= take;
            if off == spans[at].len() {
                at += 1;
                off = 0;
            }
        }
    }
    Ok(crc)
}

/// One vectored read into `spans` (the first from `off`), at most [`SCATTER_SLICES`] of them;
/// with `tail` and all of them in this read, `reader`'s spare room last. Returns the bytes
/// that landed in the spans; those past them are left in `reader`.
async fn read_spans_once(
    stream: &mut TcpStream,
    reader: &mut frame::FrameReader,
    spans: &mut [&mut [u8]],
    off: usize,
    tail: bool,
) -> std::io::Result<usize> {
    if spans.len() == 1 && !tail {
        return stream.read(&mut spans[0][off..]).await;
    }
    loop {
        stream.readable().await?;
        let all = spans.len() < SCATTER_SLICES;
        let (first, rest) = spans.split_first_mut().expect("a span is left");
        let mut io: Vec<std::io::IoSliceMut<'_>> = Vec::with_capacity(SCATTER_SLICES);
        io.push(std::io::IoSliceMut::new(&mut first[off..]));
        io.extend(rest.iter_mut().take(SCATTER_SLICES - 2).map(|s| std::io::IoSliceMut::new(s)));
        let room: usize = io.iter().map(|s| s.len()).sum();
        if tail && all {
            io.push(std::io::IoSliceMut::new(reader.spare()));
        }
        match stream.try_read_vectored(&mut io) {
            Ok(n) => {
                drop(io);
                reader.filled(n.saturating_sub(room));
                return Ok(n.min(room));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read::tests::{pair, readable};

    /// A response's header, its payload (`split` bytes in the same write as the header, the
    /// rest later), its trailer and a notify's answer behind it: the payload lands whole in
    /// the destination spans with its CRC taken over every byte, and the trailer and the
    /// answer come in the read that ends the payload.
    async fn payload_split_at(split: usize) {
        let payload: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let crc = kvxfer_mem::crc32c_append(0, &payload);
        let mut first = Vec::new();
        Frame::ReadResponse(v1::ReadResponse { seq: 3, payload_len: payload.len() as u64 })
            .encode(&mut first);
        first.extend_from_slice(&payload[..split]);
        let mut rest = payload[split..].to_vec();
        rest.extend_from_slice(&crc.to_be_bytes());
        let mut ack = Vec::new();
        Frame::NotifyAck(v1::NotifyAck { outcome: 2, remaining: 0 }).encode(&mut ack);
        rest.extend_from_slice(&ack);

        let (client, mut server) = pair().await;
        let mut stream = client;
        let mut reader = frame::FrameReader::new();
        server.write_all(&first).await.expect("write");
        readable(&stream, first.len()).await;
        let resp = reader.read_frame(&mut stream, 1 << 20).await.expect("the response");
        assert!(matches!(resp, Frame::ReadResponse(r) if r.seq == 3));
        let head = first.len() - split;
        assert_eq!(
            reader.buffered().len(),
            split.min(frame::READ_WINDOW - head),
            "payload bytes came with it"
        );
        server.write_all(&rest).await.expect("write");
        readable(&stream, first.len().saturating_sub(frame::READ_WINDOW) + rest.len()).await;

        let mut dest = vec![0u8; payload.len()];
        let (a, b) = dest.split_at_mut(5_000);
        let limits = (Duration::from_secs(5), std::time::Instant::now() + Duration::from_secs(5));
        let got = read_payload_spans((&mut stream, &mut reader), &mut [a, b], true, 0, limits)
            .await
            .expect("payload");
        assert_eq!(got, crc, "the CRC covers every payload byte, buffered or not");
        assert_eq!(dest, payload);
        assert_eq!(reader.buffered().len(), 4 + ack.len(), "trailer and answer came with the payload's end");
        let mut trailer = [0u8; 4];
        let got = read_payload_spans((&mut stream, &mut reader), &mut [&mut trailer], true, 0, limits)
            .await
            .expect("trailer");
        assert_eq!(
            (u32::from_be_bytes(trailer), got),
            (crc, kvxfer_mem::crc32c_append(0, &crc.to_be_bytes()))
        );
        let answer = reader.read_frame(&mut stream, 1 << 20).await.expect("the answer");
        assert!(matches!(answer, Frame::NotifyAck(a) if a.outcome == 2));
    }

    #[tokio::test]
    async fn a_payload_whose_first_bytes_came_with_its_header_lands_whole() {
        for split in [0, 1, 4_999, 5_000, 5_001, 8_000, 12_000] {
            payload_split_at(split).await;
        }
    }

    #[tokio::test]
    async fn a_payload_cut_short_is_an_error_not_a_hang() {
        let (client, mut server) = pair().await;
        let mut stream = client;
        let mut reader = frame::FrameReader::new();
        server.write_all(&[1, 2, 3]).await.expect("write");
        drop(server);
        let mut dest = vec![0u8; 10];
        let limits = (Duration::from_secs(5), std::time::Instant::now() + Duration::from_secs(5));
        let e = read_payload_spans((&mut stream, &mut reader), &mut [&mut dest], true, 0, limits).await;
        assert!(matches!(e, Err(FrameError::Io(ref io)) if io.kind() == std::io::ErrorKind::UnexpectedEof));
    }
}
