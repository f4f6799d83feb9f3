//! Frames: `length: u32 BE | type: u8 | protobuf body`, `length` counting type and body.

use std::io;
use std::sync::Arc;

use kvxfer_proto::v1::{self, FrameType};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 5;

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Frame {
    Hello(v1::Hello),
    HelloChallenge(v1::HelloChallenge),
    HelloProof(v1::HelloProof),
    HelloAck(v1::HelloAck),
    ReadRequest(v1::ReadRequest),
    ReadResponse(v1::ReadResponse),
    Notify(v1::Notify),
    NotifyAck(v1::NotifyAck),
    Heartbeat(v1::Heartbeat),
    HeartbeatAck(v1::HeartbeatAck),
    Cancel(v1::Cancel),
    CancelAck(v1::CancelAck),
    Error(v1::Error),
    Pin(v1::ReadRequest),
    PinAck(v1::PinAck),
    Unpin(v1::Unpin),
    UnpinAck(v1::UnpinAck),
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// An I/O error (including a close in the middle of a frame).
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The length prefix exceeds the configured maximum; nothing was allocated.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Length announced.
        len: u32,
        /// Maximum configured.
        max: u32,
    },
    /// A length prefix of 0 (no room for the type byte).
    #[error("empty frame")]
    Empty,
    /// A heartbeat named more leases than allowed (counted before decoding).
    #[error("a heartbeat named {named} leases; at most {max} are accepted per frame")]
    TooManyLeases {
        /// Lease references on the wire.
        named: u64,
        /// Maximum configured.
        max: u32,
    },
    /// A type byte this version does not know.
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    /// The body did not decode as the type's message.
    #[error("malformed {ty:?} frame: {err}")]
    Malformed {
        /// The frame type.
        ty: FrameType,
        /// The protobuf error.
        err: prost::DecodeError,
    },
    /// No progress within the I/O timeout.
    #[error("timed out")]
    Timeout,
    /// No frame started within the idle allowance ([`FrameReader::read_frame_timed`]); nothing was
    /// consumed and the connection is still in step.
    #[error("idle")]
    Idle,
}

impl FrameError {
    /// The error code a peer whose frame could not be read is answered with before the
    /// connection closes; `None` when the peer is gone or silent (nobody to tell).
    pub(crate) fn answer_code(&self) -> Option<v1::ErrorCode> {
        match self {
            FrameError::TooLarge { .. } => Some(v1::ErrorCode::FrameTooLarge),
            FrameError::TooManyLeases { .. } => Some(v1::ErrorCode::LimitExceeded),
            FrameError::UnknownType(_) => Some(v1::ErrorCode::UnknownFrameType),
            FrameError::Malformed { .. } | FrameError::Empty => Some(v1::ErrorCode::Malformed),
            FrameError::Closed | FrameError::Io(_) | FrameError::Timeout | FrameError::Idle => None,
        }
    }
}

impl Frame {
    /// The frame's type.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Hello(_) => FrameType::Hello,
            Frame::HelloChallenge(_) => FrameType::HelloChallenge,
            Frame::HelloProof(_) => FrameType::HelloProof,
            Frame::HelloAck(_) => FrameType::HelloAck,
            Frame::ReadRequest(_) => FrameType::ReadRequest,
            Frame::ReadResponse(_) => FrameType::ReadResponse,
            Frame::Notify(_) => FrameType::Notify,
            Frame::NotifyAck(_) => FrameType::NotifyAck,
            Frame::Heartbeat(_) => FrameType::Heartbeat,
            Frame::HeartbeatAck(_) => FrameType::HeartbeatAck,
            Frame::Cancel(_) => FrameType::Cancel,
            Frame::CancelAck(_) => FrameType::CancelAck,
            Frame::Error(_) => FrameType::Error,
            Frame::Pin(_) => FrameType::Pin,
            Frame::PinAck(_) => FrameType::PinAck,
            Frame::Unpin(_) => FrameType::Unpin,
            Frame::UnpinAck(_) => FrameType::UnpinAck,
        }
    }

    fn body(&self) -> &dyn MessageRef {
        match self {
            Frame::Hello(m) => m,
            Frame::HelloChallenge(m) => m,
            Frame::HelloProof(m) => m,
            Frame::HelloAck(m) => m,
            Frame::ReadRequest(m) => m,
            Frame::ReadResponse(m) => m,
            Frame::Notify(m) => m,
            Frame::NotifyAck(m) => m,
            Frame::Heartbeat(m) => m,
            Frame::HeartbeatAck(m) => m,
            Frame::Cancel(m) => m,
            Frame::CancelAck(m) => m,
            Frame::Error(m) => m,
            Frame::Pin(m) => m,
            Frame::PinAck(m) => m,
            Frame::Unpin(m) => m,
            Frame::UnpinAck(m) => m,
        }
    }

    /// Bytes of the whole frame on the wire (header and body).
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.body().len()
    }

    /// Appends the whole frame (header and body) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let body = self.body();
        let len = body.len() + 1;
        // Frames we send are far below 4 GiB (the largest is a handshake).
        out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
        out.push(self.frame_type() as u8);
        body.encode_into(out);
    }

    /// Decodes a body of type `ty`.
    pub fn decode(ty: u8, body: &[u8]) -> Result<Frame, FrameError> {
        let t = FrameType::try_from(i32::from(ty)).map_err(|_| FrameError::UnknownType(ty))?;
        let m = |err| FrameError::Malformed { ty: t, err };
        Ok(match t {
            FrameType::Unspecified => return Err(FrameError::UnknownType(ty)),
            FrameType::Hello => Frame::Hello(v1::Hello::decode(body).map_err(m)?),
            FrameType::HelloChallenge => Frame::HelloChallenge(v1::HelloChallenge::decode(body).map_err(m)?),
            FrameType::HelloProof => Frame::HelloProof(v1::HelloProof::decode(body).map_err(m)?),
            FrameType::HelloAck => Frame::HelloAck(v1::HelloAck::decode(body).map_err(m)?),
            FrameType::ReadRequest => Frame::ReadRequest(v1::ReadRequest::decode(body).map_err(m)?),
            FrameType::ReadResponse => Frame::ReadResponse(v1::ReadResponse::decode(body).map_err(m)?),
            FrameType::Notify => Frame::Notify(v1::Notify::decode(body).map_err(m)?),
            FrameType::NotifyAck => Frame::NotifyAck(v1::NotifyAck::decode(body).map_err(m)?),
            FrameType::Heartbeat => Frame::Heartbeat(v1::Heartbeat::decode(body).map_err(m)?),
            FrameType::HeartbeatAck => Frame::HeartbeatAck(v1::HeartbeatAck::decode(body).map_err(m)?),
            FrameType::Cancel => Frame::Cancel(v1::Cancel::decode(body).map_err(m)?),
            FrameType::CancelAck => Frame::CancelAck(v1::CancelAck::decode(body).map_err(m)?),
            FrameType::Error => Frame::Error(v1::Error::decode(body).map_err(m)?),
            FrameType::Pin => Frame::Pin(v1::ReadRequest::decode(body).map_err(m)?),
            FrameType::PinAck => Frame::PinAck(v1::PinAck::decode(body).map_err(m)?),
            FrameType::Unpin => Frame::Unpin(v1::Unpin::decode(body).map_err(m)?),
            FrameType::UnpinAck => Frame::UnpinAck(v1::UnpinAck::decode(body).map_err(m)?),
        })
    }

    /// An error frame.
    pub fn error(code: v1::ErrorCode, message: impl Into<String>, seq: u64) -> Frame {
        Frame::Error(v1::Error { code: code as i32, message: message.into(), seq })
    }
}

/// Object-safe view of a prost message (encode into a Vec).
trait MessageRef {
    fn len(&self) -> usize;
    fn encode_into(&self, out: &mut Vec<u8>);
}

impl<M: Message> MessageRef for M {
    fn len(&self) -> usize {
        self.encoded_len()
    }
    fn encode_into(&self, out: &mut Vec<u8>) {
        // Encoding into a Vec grows it as needed and cannot fail.
        let _ = self.encode(out);
    }
}

/// The largest frame a reader accepts, by type: `max` for the frames that carry many ranges
/// or leases (`ReadRequest`, `Pin`, `Heartbeat`), `small` (never above `max`) for every
/// other type. A prefill agent reads its decode peers with `small` set to
/// `Limits::max_small_frame_len`, so a notify, cancel or unpin (or a frame a decode peer has
/// no business sending) cannot make it buffer and decode a megabyte; a plain `u32` is the
/// same cap for every type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameCaps {
    /// Cap of `ReadRequest`, `Pin` and `Heartbeat` frames (and the ceiling of `small`).
    pub max: u32,
    /// Cap of every other frame type.
    pub small: u32,
    /// Most leases a `Heartbeat` may name, counted on the wire before it is decoded (a
    /// lease reference of 2 bytes decodes to ~50).
    pub max_leases: u32,
}

impl FrameCaps {
    /// The cap of a frame whose type byte is `ty` (unknown types get `small`).
    pub fn of(self, ty: u8) -> u32 {
        let many = [FrameType::ReadRequest, FrameType::Pin, FrameType::Heartbeat];
        match many.iter().any(|t| *t as i32 == i32::from(ty)) {
            true => self.max,
            false => self.small.min(self.max),
        }
    }
}

impl From<u32> for FrameCaps {
    fn from(max: u32) -> Self {
        FrameCaps { max, small: max, max_leases: u32::MAX }
    }
}

/// Decodes a body of type `ty` within `caps`: a heartbeat naming more than
/// `caps.max_leases` leases is refused from its wire bytes, before anything is decoded.
fn decode_within(ty: u8, body: &[u8], caps: FrameCaps) -> Result<Frame, FrameError> {
    if i32::from(ty) == FrameType::Heartbeat as i32 {
        // A body the walk cannot read is not counted: decoding it fails below.
        if let Some(named) = count_field(body, 1) {
            if named > u64::from(caps.max_leases) {
                return Err(FrameError::TooManyLeases { named, max: caps.max_leases });
            }
        }
    }
    Frame::decode(ty, body)
}

/// How many times field `tag` occurs at the top level of the protobuf message `body`
/// (walks the wire format, decodes nothing); `None` when `body` is not well-formed
/// protobuf.
fn count_field(mut body: &[u8], tag: u32) -> Option<u64> {
    use prost::encoding::{decode_key, decode_varint, WireType};
    let (mut n, mut depth) = (0u64, 0u32);
    while !body.is_empty() {
        let (t, wire) = decode_key(&mut body).ok()?;
        n += u64::from(depth == 0 && t == tag);
        let skip = match wire {
            WireType::Varint => {
                decode_varint(&mut body).ok()?;
                0
            }
            WireType::SixtyFourBit => 8,
            WireType::ThirtyTwoBit => 4,
            WireType::LengthDelimited => usize::try_from(decode_varint(&mut body).ok()?).ok()?,
            WireType::StartGroup => {
                depth += 1;
                0
            }
            WireType::EndGroup => {
                depth = depth.checked_sub(1)?;
                0
            }
        };
        body = body.get(skip..)?;
    }
    (depth == 0).then_some(n)
}

/// Parses a header: returns the type byte and the body length. Refuses lengths over the
/// type's cap before anything is allocated.
pub fn parse_header(h: [u8; HEADER_LEN], caps: impl Into<FrameCaps>) -> Result<(u8, usize), FrameError> {
    let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    if len == 0 {
        return Err(FrameError::Empty);
    }
    let max = caps.into().of(h[4]);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok((h[4], len as usize - 1))
}

/// Decodes every complete frame at the front of `buf` (for fuzzing and property tests of
/// the codec): returns the frames and the bytes consumed, or the first error.
pub fn decode_all(mut buf: &[u8], max: impl Into<FrameCaps>) -> Result<(Vec<Frame>, usize), FrameError> {
    let max: FrameCaps = max.into();
    let total = buf.len();
    let mut frames = Vec::new();
    while buf.len() >= HEADER_LEN {
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&buf[..HEADER_LEN]);
        let (ty, body_len) = parse_header(h, max)?;
        let Some(body) = buf.get(HEADER_LEN..HEADER_LEN + body_len) else { break };
        frames.push(decode_within(ty, body, max)?);
        buf = &buf[HEADER_LEN + body_len..];
    }
    Ok((frames, total - buf.len()))
}

/// Reads one frame, reusing `buf` for the body: a header read, then a body read, nothing
/// read past the frame (for callers that hand the stream on; [`FrameReader`] reads fewer
/// times).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: impl Into<FrameCaps>,
    buf: &mut Vec<u8>,
) -> Result<Frame, FrameError> {
    let max: FrameCaps = max.into();
    let mut h = [0u8; HEADER_LEN];
    // A clean close is only a close before the first header byte.
    let n = r.read(&mut h).await?;
    if n == 0 {
        return Err(FrameError::Closed);
    }
    r.read_exact(&mut h[n..]).await?;
    let (ty, body_len) = parse_header(h, max)?;
    buf.clear();
    buf.resize(body_len, 0);
    r.read_exact(buf).await?;
    decode_within(ty, buf, max)
}

/// Bytes a [`FrameReader`] asks the kernel for per read when no larger frame is under way:
/// room for many small frames, or a read response's header and the first bytes of its
/// payload (the rest of a payload is read straight into its destination, see
/// [`FrameReader::take_into`] and [`FrameReader::spare`]).
pub const READ_WINDOW: usize = 8 * 1024;

/// Reads frames through a buffer: one read takes whatever has arrived — a read request and
/// the notify behind it, a response's header and the start of its payload — and as many
/// whole frames as it holds are decoded without another system call.
///
/// It holds at most [`READ_WINDOW`] bytes, or one frame of at most the `max` it is asked to
/// read with: a frame's length is checked against `max` from its header before the buffer
/// grows for it, and the buffer shrinks back once that frame is taken. Reads are cancel-safe
/// (bytes are never lost when a read's future is dropped).
///
/// A reader made [`with_budget`](Self::with_budget) takes its frames' bytes from a budget
/// it shares with other readers before growing past the window, and gives them back when
/// the buffer shrinks: many connections that each send one large frame slowly hold at most
/// the budget between them, and wait (within their reads' timeouts) for the rest.
#[derive(Debug)]
pub struct FrameReader {
    /// Always initialised; bytes `start..end` are read but not yet taken.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes shared by the readers that grow past the window (`None`: not bounded).
    budget: Option<Arc<Semaphore>>,
    /// What this reader took from `budget` for its grown buffer.
    held: Option<OwnedSemaphorePermit>,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameReader {
    /// An empty reader with a [`READ_WINDOW`] buffer.
    pub fn new() -> Self {
        FrameReader { buf: vec![0; READ_WINDOW], start: 0, end: 0, budget: None, held: None }
    }

    /// An empty reader that takes the bytes of a buffer grown past [`READ_WINDOW`] from
    /// `budget` (one permit per byte) before growing it, waiting for them when they are
    /// taken; the budget must hold at least the largest frame it is asked to read.
    pub fn with_budget(budget: Arc<Semaphore>) -> Self {
        FrameReader { budget: Some(budget), ..Self::new() }
    }

    /// Takes bytes from the budget (if any) so that it covers a buffer about to grow to
    /// `need`. While it waits, the buffer is no larger than what it holds (a window at
    /// least), and the permits it keeps cover exactly that: a buffer grown for an earlier
    /// frame is not kept uncounted. A reader whose pipelined bytes alone exceed a window
    /// keeps their permits while it waits for more; two such readers can wait on each
    /// other until `Limits::io_timeout` closes one.
    async fn reserve(&mut self, need: usize) {
        let Some(budget) = self.budget.clone() else { return };
        let held = |r: &Self| r.held.as_ref().map_or(0, OwnedSemaphorePermit::num_permits);
        if held(self) >= need {
            return;
        }
        self.shrink_if_small();
        let more = need.saturating_sub(held(self));
        // The budget is never closed; if it were, the frame would be read unbounded.
        if let Ok(p) = budget.acquire_many_owned(u32::try_from(more).unwrap_or(u32::MAX)).await {
            match &mut self.held {
                Some(h) => h.merge(p),
                None => self.held = Some(p),
            }
        }
    }

    /// When what is buffered fits in a window and the buffer grew past one: moves it to
    /// the front, shrinks the buffer back to a window and gives its bytes back to the
    /// budget (a large frame's bytes are held while it arrives, not while it is served).
    fn shrink_if_small(&mut self) {
        let len = self.end - self.start;
        if self.buf.len() <= READ_WINDOW || len > READ_WINDOW {
            return;
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.start = 0;
        self.end = len;
        self.buf.truncate(READ_WINDOW);
        self.buf.shrink_to_fit();
        self.held = None;
    }

    /// The bytes read but not yet taken.
    pub fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        self.shrink_if_small();
    }

    /// The next frame's type byte and body length when all of it is buffered; `None` while
    /// bytes of it are missing. Its header is checked as [`parse_header`] does.
    fn next_whole(&self, max: FrameCaps) -> Result<Option<(u8, usize)>, FrameError> {
        let b = self.buffered();
        let Some(h) = b.first_chunk::<HEADER_LEN>() else { return Ok(None) };
        let (ty, body_len) = parse_header(*h, max)?;
        Ok((b.len() - HEADER_LEN >= body_len).then_some((ty, body_len)))
    }

    /// Whether a whole frame of at most `max` bytes is buffered (taken without waiting).
    pub fn holds_frame(&self, max: impl Into<FrameCaps>) -> bool {
        let max: FrameCaps = max.into();
        matches!(self.next_whole(max), Ok(Some(_)))
    }

    /// The next frame when all of it is buffered, decoded but not taken.
    pub fn peek_frame(&self, max: impl Into<FrameCaps>) -> Option<Frame> {
        let max: FrameCaps = max.into();
        let (ty, body_len) = self.next_whole(max).ok()??;
        decode_within(ty, &self.buffered()[HEADER_LEN..HEADER_LEN + body_len], max).ok()
    }

    /// Takes and decodes the next frame when all of it is buffered (`None` otherwise).
    pub fn try_frame(&mut self, max: impl Into<FrameCaps>) -> Result<Option<Frame>, FrameError> {
        let max: FrameCaps = max.into();
        let Some((ty, body_len)) = self.next_whole(max)? else { return Ok(None) };
        let frame = decode_within(ty, &self.buffered()[HEADER_LEN..HEADER_LEN + body_len], max);
        self.consume(HEADER_LEN + body_len);
        frame.map(Some)
    }

    /// Makes room after the buffered bytes for `need` bytes counted from the first buffered
    /// one (at least a window's worth of free space when the buffer allows it).
    fn make_room(&mut self, need: usize) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        let short = self.start + need > self.buf.len();
        let cramped = self.buf.len() - self.end < READ_WINDOW / 4;
        if self.start > 0 && (short || cramped) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if need > self.buf.len() {
            self.buf.resize(need, 0);
        }
    }

    /// Bytes from the first buffered one to the end of the next frame: its whole length
    /// when its header is buffered (checked against `max` first), else a header's.
    fn frame_need(&self, max: FrameCaps) -> Result<usize, FrameError> {
        Ok(match self.buffered().first_chunk::<HEADER_LEN>() {
            Some(h) => HEADER_LEN + parse_header(*h, max)?.1,
            None => HEADER_LEN,
        })
    }

    /// One read into the buffer, with room for the rest of the next frame; returns the
    /// bytes read (0: end of stream).
    async fn fill<R: AsyncRead + Unpin>(&mut self, r: &mut R, max: FrameCaps) -> Result<usize, FrameError> {
        let need = self.frame_need(max)?;
        if need > self.buf.len() {
            // Cancel-safe: nothing is read or moved before the bytes are held.
            self.reserve(need).await;
        }
        self.make_room(need);
        let n = r.read(&mut self.buf[self.end..]).await?;
        self.end += n;
        Ok(n)
    }

    /// Reads until the next frame is whole; returns its type byte and body length.
    async fn wait_whole<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max: FrameCaps,
    ) -> Result<(u8, usize), FrameError> {
        loop {
            if let Some(whole) = self.next_whole(max)? {
                return Ok(whole);
            }
            if self.fill(r, max).await? == 0 {
                // A clean close is only a close between frames.
                return Err(match self.buffered().is_empty() {
                    true => FrameError::Closed,
                    false => FrameError::Io(io::ErrorKind::UnexpectedEof.into()),
                });
            }
        }
    }

    /// Reads one frame of at most `max` bytes (from the buffer when it is there).
    pub async fn read_frame<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max: impl Into<FrameCaps>,
    ) -> Result<Frame, FrameError> {
        let max: FrameCaps = max.into();
        self.wait_whole(r, max).await?;
        self.try_frame(max)?.ok_or(FrameError::Closed)
    }

    /// [`Self::read_frame`], also copying the frame's body as received into `body` (what a
    /// handshake MAC covers).
    pub async fn read_frame_and_body<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max: impl Into<FrameCaps>,
        body: &mut Vec<u8>,
    ) -> Result<Frame, FrameError> {
        let max: FrameCaps = max.into();
        let (_, body_len) = self.wait_whole(r, max).await?;
        body.clear();
        body.extend_from_slice(&self.buffered()[HEADER_LEN..HEADER_LEN + body_len]);
        self.try_frame(max)?.ok_or(FrameError::Closed)
    }

    /// Reads one frame: a buffered one at once; else waits up to `idle` for one to start
    /// (`None`: forever), then fails with [`FrameError::Timeout`] if the rest has not
    /// arrived within `progress` — so a peer that sends half a frame and stops cannot hold
    /// the connection. Bytes of the frame already buffered count as its start.
    pub async fn read_frame_timed<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max: impl Into<FrameCaps>,
        idle: Option<std::time::Duration>,
        progress: std::time::Duration,
    ) -> Result<Frame, FrameError> {
        let max: FrameCaps = max.into();
        if let Some(f) = self.try_frame(max)? {
            return Ok(f);
        }
        if self.buffered().is_empty() {
            // Cancel-safe: a read that times out has taken nothing.
            let first = self.fill(r, max);
            let n = match idle {
                Some(d) => tokio::time::timeout(d, first).await.map_err(|_| FrameError::Idle)??,
                None => first.await?,
            };
            if n == 0 {
                return Err(FrameError::Closed);
            }
        }
        tokio::time::timeout(progress, self.read_frame(r, max)).await.map_err(|_| FrameError::Timeout)?
    }

    /// Moves buffered bytes into the front of `dst` (as many as it takes); returns how many.
    pub fn take_into(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.end - self.start);
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.consume(n);
        n
    }

    /// The free room after the buffered bytes (a window's worth when nothing is buffered):
    /// the last slice of a vectored read that fills a payload's destination first, so what
    /// follows the payload lands here. Say how much landed with [`Self::filled`].
    pub fn spare(&mut self) -> &mut [u8] {
        self.make_room(HEADER_LEN);
        &mut self.buf[self.end..]
    }

    /// Marks `n` bytes of [`Self::spare`] as read.
    pub fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }
}

/// Writes one frame, encoding into `scratch`.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    frame: &Frame,
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    scratch.clear();
    frame.encode(scratch);
    w.write_all(scratch).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_every_type() {
        let frames = vec![
            Frame::Hello(v1::Hello { protocol_version: 1, engine_id: "e".into(), ..Default::default() }),
            Frame::ReadRequest(v1::ReadRequest {
                seq: 9,
                remote_request_id: "0_R".into(),
                lease_token: vec![1; 16],
                ranges: vec![v1::BlockRange { start: 3, count: 4 }],
                ..Default::default()
            }),
            Frame::NotifyAck(v1::NotifyAck { outcome: 2, remaining: 0 }),
            Frame::error(v1::ErrorCode::BadToken, "nope", 9),
        ];
        let mut buf = Vec::new();
        for f in &frames {
            f.encode(&mut buf);
        }
        let (back, used) = decode_all(&buf, 1 << 20).expect("decodes");
        assert_eq!((back, used), (frames, buf.len()));
    }

    #[test]
    fn header_checks_come_before_allocation() {
        assert!(matches!(parse_header([0xff, 0xff, 0xff, 0xff, 1], 1024), Err(FrameError::TooLarge { .. })));
        assert!(matches!(parse_header([0, 0, 0, 0, 1], 1024), Err(FrameError::Empty)));
        assert!(matches!(Frame::decode(0, &[]), Err(FrameError::UnknownType(0))));
        assert!(matches!(Frame::decode(200, &[]), Err(FrameError::UnknownType(200))));
        assert!(matches!(Frame::decode(3, &[0xff, 0xff]), Err(FrameError::Malformed { .. })));
    }

    /// Hostile-peer review: a heartbeat of 2-byte lease references decoded to ~25x its size
    /// before its lease count was checked. The count is now read from the wire: the frame
    /// is refused without decoding, and the walk agrees with prost on what it counts.
    #[test]
    fn a_heartbeat_naming_too_many_leases_is_refused_before_decoding() {
        let caps = FrameCaps { max: 1 << 20, small: 16 << 10, max_leases: 4 };
        let hb = |n: usize| {
            let leases = (0..n).map(|_| v1::LeaseRef::default()).collect();
            let mut out = Vec::new();
            Frame::Heartbeat(v1::Heartbeat { leases }).encode(&mut out);
            out
        };
        for (n, ok) in [(4, true), (5, false), (300_000, false)] {
            let bytes = hb(n);
            match decode_all(&bytes, caps) {
                Ok((frames, _)) => {
                    assert!(ok && matches!(&frames[..], [Frame::Heartbeat(h)] if h.leases.len() == n))
                }
                Err(FrameError::TooManyLeases { named, max: 4 }) => assert!(!ok && named == n as u64),
                Err(e) => panic!("{n}: {e}"),
            }
        }
        // Other fields, unknown fields and groups are not counted; a body the walk cannot
        // read is left to prost, which refuses it.
        let mut body = Vec::new();
        prost::encoding::encode_key(7, prost::encoding::WireType::StartGroup, &mut body);
        prost::encoding::encode_key(1, prost::encoding::WireType::Varint, &mut body);
        body.push(1);
        prost::encoding::encode_key(7, prost::encoding::WireType::EndGroup, &mut body);
        body.extend_from_slice(&hb(3)[HEADER_LEN..]);
        assert_eq!(count_field(&body, 1), Some(3));
        assert_eq!(count_field(&[0x0a, 0x05, 0x00], 1), None);
        assert!(matches!(
            decode_within(FrameType::Heartbeat as u8, &[0x0a, 0x05, 0x00], caps),
            Err(FrameError::Malformed { .. })
        ));
    }

    proptest! {
        /// The wire walk counts what prost decodes.
        #[test]
        fn the_lease_count_on_the_wire_is_what_prost_decodes(ids in proptest::collection::vec(".{0,8}", 0..40)) {
            let leases: Vec<v1::LeaseRef> = ids.iter().map(|i| v1::LeaseRef { remote_request_id: i.clone(), lease_token: vec![1; 3] }).collect();
            let body = v1::Heartbeat { leases }.encode_to_vec();
            prop_assert_eq!(count_field(&body, 1), Some(ids.len() as u64));
        }
    }

    /// Hostile-peer review: only `ReadRequest`, `Pin` and `Heartbeat` may be large; a notify
    /// (or any other type) over the small cap is refused at its header, before its body is
    /// buffered.
    #[test]
    fn only_frames_that_name_many_things_may_be_large() {
        let caps = FrameCaps { max: 1 << 20, small: 16 << 10, max_leases: 4096 };
        let header = |ty: FrameType, len: u32| {
            let mut h = [0u8; HEADER_LEN];
            h[..4].copy_from_slice(&len.to_be_bytes());
            h[4] = ty as u8;
            h
        };
        for ty in [FrameType::ReadRequest, FrameType::Pin, FrameType::Heartbeat] {
            assert!(parse_header(header(ty, 1 << 20), caps).is_ok(), "{ty:?}");
        }
        for ty in
            [FrameType::Notify, FrameType::Cancel, FrameType::Unpin, FrameType::Hello, FrameType::HelloAck]
        {
            assert!(parse_header(header(ty, 16 << 10), caps).is_ok(), "{ty:?}");
            let refused = parse_header(header(ty, (16 << 10) + 1), caps);
            assert!(matches!(refused, Err(FrameError::TooLarge { max, .. }) if max == 16 << 10), "{ty:?}");
        }
        // An unknown type byte gets the small cap too; a plain u32 caps every type alike.
        assert!(parse_header([0, 1, 0, 0, 200], caps).is_err());
        assert!(parse_header(header(FrameType::Notify, 1 << 20), 1 << 20).is_ok());
    }

    /// Hostile-peer review: a thousand connections each trickling a 1 MiB frame held a
    /// gigabyte of read buffers. Readers made with a budget take a grown buffer's bytes
    /// from it first: a second large frame waits while the first holds the budget, and
    /// is read once the first was taken.
    #[test]
    fn readers_share_a_budget_for_large_frames() {
        runtime().block_on(async {
            let budget = Arc::new(Semaphore::new(40 << 10));
            let frame = |tag| {
                let mut out = Vec::new();
                sized_frame(30 << 10, tag).encode(&mut out);
                out
            };
            let (mut a_in, mut a_out) = tokio::io::duplex(1 << 20);
            let (mut b_in, mut b_out) = tokio::io::duplex(1 << 20);
            let (mut a, mut b) =
                (FrameReader::with_budget(budget.clone()), FrameReader::with_budget(budget.clone()));
            // A's frame arrives in part: A holds its 30 KiB.
            let fa = frame(1);
            a_in.write_all(&fa[..1000]).await.expect("write");
            let mut a_read = Box::pin(a.read_frame(&mut a_out, caps_all()));
            assert!(poll_once(a_read.as_mut()).is_none());
            assert_eq!(budget.available_permits(), (40 << 10) - fa.len());
            // B's whole frame is there, but the budget is not: B waits, buffering nothing.
            b_in.write_all(&frame(2)).await.expect("write");
            let mut b_read = Box::pin(b.read_frame(&mut b_out, caps_all()));
            assert!(poll_once(b_read.as_mut()).is_none());
            // A's frame completes and is taken: its bytes go back, and B reads.
            a_in.write_all(&fa[1000..]).await.expect("write");
            assert_eq!(a_read.await.expect("a"), sized_frame(30 << 10, 1));
            assert_eq!(b_read.await.expect("b"), sized_frame(30 << 10, 2));
            assert_eq!(budget.available_permits(), 40 << 10);
        });
    }

    fn caps_all() -> FrameCaps {
        FrameCaps::from(1 << 20)
    }

    /// Polls `f` once (with a waker that does nothing).
    fn poll_once<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> Option<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match f.poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    /// A frame whose body size is about `len` bytes (a notify with an id that long).
    fn sized_frame(len: usize, tag: u8) -> Frame {
        Frame::Notify(v1::Notify {
            remote_request_id: char::from(b'a' + tag % 26).to_string().repeat(len),
            lease_token: vec![tag; 16],
            consumer_id: format!("d/{tag}"),
        })
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    /// Writes `bytes` to a real 127.0.0.1 socket in pieces cut at `cuts` (each piece its
    /// own write, flushed with a pause so pieces arrive apart), and reads frames back
    /// through a [`FrameReader`] until the writer closes.
    fn through_socket(bytes: Vec<u8>, cuts: Vec<usize>, max: u32) -> Result<Vec<Frame>, FrameError> {
        runtime().block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let writer = tokio::spawn(async move {
                let mut w = tokio::net::TcpStream::connect(addr).await.expect("connect");
                w.set_nodelay(true).expect("nodelay");
                let mut at = 0;
                for cut in cuts.into_iter().chain([bytes.len()]) {
                    let cut = cut.clamp(at, bytes.len());
                    w.write_all(&bytes[at..cut]).await.expect("write");
                    at = cut;
                    tokio::task::yield_now().await;
                }
            });
            let (mut r, _) = listener.accept().await.expect("accept");
            let mut reader = FrameReader::new();
            let mut frames = Vec::new();
            let end = loop {
                match reader.read_frame(&mut r, max).await {
                    Ok(f) => frames.push(f),
                    Err(FrameError::Closed) => break Ok(frames),
                    Err(e) => break Err(e),
                }
            };
            writer.await.expect("writer");
            end
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// A stream of frames — small ones many to a read, and ones larger than the read
        /// window — cut at random points decodes to the same frames through a real socket.
        #[test]
        fn frames_cut_anywhere_decode_the_same(
            sizes in proptest::collection::vec(prop_oneof![4 => 0usize..64, 1 => 6000usize..20_000], 1..24),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..16),
        ) {
            let frames: Vec<Frame> = sizes.iter().enumerate().map(|(i, &n)| sized_frame(n, i as u8)).collect();
            let mut bytes = Vec::new();
            for f in &frames {
                f.encode(&mut bytes);
            }
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let back = through_socket(bytes, cuts, 1 << 20).expect("decodes");
            prop_assert_eq!(back, frames);
        }
    }

    /// Every split of a few frames (one cut at each byte) over an in-memory duplex.
    #[test]
    fn every_single_cut_decodes_the_same() {
        let frames = vec![sized_frame(3, 0), sized_frame(9000, 1), sized_frame(0, 2)];
        let mut bytes = Vec::new();
        for f in &frames {
            f.encode(&mut bytes);
        }
        runtime().block_on(async {
            for cut in (0..=bytes.len()).step_by(7) {
                let (mut w, mut r) = tokio::io::duplex(64 * 1024);
                w.write_all(&bytes[..cut]).await.expect("write");
                let mut reader = FrameReader::new();
                let rest = bytes[cut..].to_vec();
                let writer = async move {
                    tokio::task::yield_now().await;
                    w.write_all(&rest).await.expect("write");
                };
                let reading = async {
                    let mut back = Vec::new();
                    loop {
                        match reader.read_frame(&mut r, 1 << 20).await {
                            Ok(f) => back.push(f),
                            Err(FrameError::Closed) => return back,
                            Err(e) => panic!("cut at {cut}: {e}"),
                        }
                    }
                };
                let (back, ()) = tokio::join!(reading, writer);
                assert_eq!(back, frames, "cut at {cut}");
            }
        });
    }

    #[test]
    fn an_oversized_frame_is_refused_from_its_header_before_the_buffer_grows() {
        runtime().block_on(async {
            let (mut w, mut r) = tokio::io::duplex(64 * 1024);
            let mut bytes = Vec::new();
            sized_frame(2, 0).encode(&mut bytes);
            sized_frame(30_000, 1).encode(&mut bytes);
            w.write_all(&bytes[..bytes.len() - 1000]).await.expect("write");
            let mut reader = FrameReader::new();
            assert_eq!(
                reader.read_frame(&mut r, 16 << 10).await.expect("the small frame"),
                sized_frame(2, 0)
            );
            let e = reader.read_frame(&mut r, 16 << 10).await.expect_err("too large");
            assert!(matches!(e, FrameError::TooLarge { max, .. } if max == 16 << 10), "{e}");
            assert!(reader.buf.len() <= READ_WINDOW, "the buffer did not grow for it");
            // A zero length is refused too.
            let (mut w, mut r) = tokio::io::duplex(1024);
            w.write_all(&[0, 0, 0, 0, 1]).await.expect("write");
            let e = FrameReader::new().read_frame(&mut r, 1 << 20).await.expect_err("empty");
            assert!(matches!(e, FrameError::Empty), "{e}");
        });
    }

    #[test]
    fn a_close_inside_a_frame_is_an_error_and_between_frames_a_close() {
        runtime().block_on(async {
            let mut bytes = Vec::new();
            sized_frame(5, 0).encode(&mut bytes);
            let (mut w, mut r) = tokio::io::duplex(1024);
            w.write_all(&bytes[..bytes.len() - 1]).await.expect("write");
            drop(w);
            let e = FrameReader::new().read_frame(&mut r, 1 << 20).await.expect_err("cut short");
            assert!(matches!(e, FrameError::Io(ref io) if io.kind() == io::ErrorKind::UnexpectedEof), "{e}");
            let (mut w, mut r) = tokio::io::duplex(1024);
            w.write_all(&bytes).await.expect("write");
            drop(w);
            let mut reader = FrameReader::new();
            assert_eq!(reader.read_frame(&mut r, 1 << 20).await.expect("frame"), sized_frame(5, 0));
            assert!(matches!(reader.read_frame(&mut r, 1 << 20).await, Err(FrameError::Closed)));
        });
    }

    #[test]
    fn the_idle_allowance_covers_only_a_frame_not_started() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("rt");
        runtime.block_on(async {
            let (mut w, mut r) = tokio::io::duplex(1024);
            let mut reader = FrameReader::new();
            let (idle, progress) =
                (Some(std::time::Duration::from_secs(1)), std::time::Duration::from_secs(5));
            let e = reader.read_frame_timed(&mut r, 1 << 20, idle, progress).await.expect_err("idle");
            assert!(matches!(e, FrameError::Idle));
            let mut bytes = Vec::new();
            sized_frame(5, 0).encode(&mut bytes);
            sized_frame(5, 1).encode(&mut bytes);
            w.write_all(&bytes[..bytes.len() - 2]).await.expect("write");
            let f = reader.read_frame_timed(&mut r, 1 << 20, idle, progress).await.expect("a frame");
            assert_eq!(f, sized_frame(5, 0));
            // Half of the next frame is buffered: it has started, so it stalls, not idles.
            let e = reader.read_frame_timed(&mut r, 1 << 20, idle, progress).await.expect_err("stalled");
            assert!(matches!(e, FrameError::Timeout), "{e}");
        });
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_all(&bytes, 4096);
        }

        #[test]
        fn arbitrary_bodies_never_panic(ty in any::<u8>(), body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Frame::decode(ty, &body);
        }
    }
}
