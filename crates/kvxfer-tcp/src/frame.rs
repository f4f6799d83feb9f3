//! Frames: `length: u32 BE | type: u8 | protobuf body`, `length` counting type and body.

use std::io;

use kvxfer_proto::v1::{self, FrameType};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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

/// Parses a header: returns the type byte and the body length. Refuses lengths over `max`
/// before anything is allocated.
pub fn parse_header(h: [u8; HEADER_LEN], max: u32) -> Result<(u8, usize), FrameError> {
    let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok((h[4], len as usize - 1))
}

/// Decodes every complete frame at the front of `buf` (for fuzzing and property tests of
/// the codec): returns the frames and the bytes consumed, or the first error.
pub fn decode_all(mut buf: &[u8], max: u32) -> Result<(Vec<Frame>, usize), FrameError> {
    let total = buf.len();
    let mut frames = Vec::new();
    while buf.len() >= HEADER_LEN {
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&buf[..HEADER_LEN]);
        let (ty, body_len) = parse_header(h, max)?;
        let Some(body) = buf.get(HEADER_LEN..HEADER_LEN + body_len) else { break };
        frames.push(Frame::decode(ty, body)?);
        buf = &buf[HEADER_LEN + body_len..];
    }
    Ok((frames, total - buf.len()))
}

/// Reads one frame, reusing `buf` for the body: a header read, then a body read, nothing
/// read past the frame (for callers that hand the stream on; [`FrameReader`] reads fewer
/// times).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
    buf: &mut Vec<u8>,
) -> Result<Frame, FrameError> {
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
    Frame::decode(ty, buf)
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
#[derive(Debug)]
pub struct FrameReader {
    /// Always initialised; bytes `start..end` are read but not yet taken.
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameReader {
    /// An empty reader with a [`READ_WINDOW`] buffer.
    pub fn new() -> Self {
        FrameReader { buf: vec![0; READ_WINDOW], start: 0, end: 0 }
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
            if self.buf.len() > READ_WINDOW {
                self.buf.truncate(READ_WINDOW);
                self.buf.shrink_to_fit();
            }
        }
    }

    /// The next frame's type byte and body length when all of it is buffered; `None` while
    /// bytes of it are missing. Its header is checked as [`parse_header`] does.
    fn next_whole(&self, max: u32) -> Result<Option<(u8, usize)>, FrameError> {
        let b = self.buffered();
        let Some(h) = b.first_chunk::<HEADER_LEN>() else { return Ok(None) };
        let (ty, body_len) = parse_header(*h, max)?;
        Ok((b.len() - HEADER_LEN >= body_len).then_some((ty, body_len)))
    }

    /// Whether a whole frame of at most `max` bytes is buffered (taken without waiting).
    pub fn holds_frame(&self, max: u32) -> bool {
        matches!(self.next_whole(max), Ok(Some(_)))
    }

    /// The next frame when all of it is buffered, decoded but not taken.
    pub fn peek_frame(&self, max: u32) -> Option<Frame> {
        let (ty, body_len) = self.next_whole(max).ok()??;
        Frame::decode(ty, &self.buffered()[HEADER_LEN..HEADER_LEN + body_len]).ok()
    }

    /// Takes and decodes the next frame when all of it is buffered (`None` otherwise).
    pub fn try_frame(&mut self, max: u32) -> Result<Option<Frame>, FrameError> {
        let Some((ty, body_len)) = self.next_whole(max)? else { return Ok(None) };
        let frame = Frame::decode(ty, &self.buffered()[HEADER_LEN..HEADER_LEN + body_len]);
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
    fn frame_need(&self, max: u32) -> Result<usize, FrameError> {
        Ok(match self.buffered().first_chunk::<HEADER_LEN>() {
            Some(h) => HEADER_LEN + parse_header(*h, max)?.1,
            None => HEADER_LEN,
        })
    }

    /// One read into the buffer, with room for the rest of the next frame; returns the
    /// bytes read (0: end of stream).
    async fn fill<R: AsyncRead + Unpin>(&mut self, r: &mut R, max: u32) -> Result<usize, FrameError> {
        let need = self.frame_need(max)?;
        self.make_room(need);
        let n = r.read(&mut self.buf[self.end..]).await?;
        self.end += n;
        Ok(n)
    }

    /// Reads until the next frame is whole; returns its type byte and body length.
    async fn wait_whole<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max: u32,
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
        max: u32,
    ) -> Result<Frame, FrameError> {
        self.wait_whole(r, max).await?;
        self.try_frame(max)?.ok_or(FrameError::Closed)
    }

    /// [`Self::read_frame`], also copying the frame's body as received into `body` (what a
    /// handshake MAC covers).
    pub async fn read_frame_and_body<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max: u32,
        body: &mut Vec<u8>,
    ) -> Result<Frame, FrameError> {
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
        max: u32,
        idle: Option<std::time::Duration>,
        progress: std::time::Duration,
    ) -> Result<Frame, FrameError> {
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
