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
    /// No frame started within the idle allowance ([`read_frame_timed`]); nothing was
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

/// Reads one frame, reusing `buf` for the body.
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
    read_rest(r, h, n, max, buf).await
}

/// Reads the rest of a frame whose first `n` header bytes are in `h`.
async fn read_rest<R: AsyncRead + Unpin>(
    r: &mut R,
    mut h: [u8; HEADER_LEN],
    n: usize,
    max: u32,
    buf: &mut Vec<u8>,
) -> Result<Frame, FrameError> {
    r.read_exact(&mut h[n..]).await?;
    let (ty, body_len) = parse_header(h, max)?;
    buf.clear();
    buf.resize(body_len, 0);
    r.read_exact(buf).await?;
    Frame::decode(ty, buf)
}

/// Reads one frame: waits up to `idle` for it to start (`None`: forever), then fails with
/// [`FrameError::Timeout`] if the rest has not arrived within `progress` — so a peer that sends half a
/// frame and stops cannot hold the connection.
pub async fn read_frame_timed<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
    buf: &mut Vec<u8>,
    idle: Option<std::time::Duration>,
    progress: std::time::Duration,
) -> Result<Frame, FrameError> {
    let mut h = [0u8; HEADER_LEN];
    // Cancel-safe: a read that times out has consumed nothing.
    let first = r.read(&mut h);
    let n = match idle {
        Some(d) => tokio::time::timeout(d, first).await.map_err(|_| FrameError::Idle)??,
        None => first.await?,
    };
    if n == 0 {
        return Err(FrameError::Closed);
    }
    tokio::time::timeout(progress, read_rest(r, h, n, max, buf)).await.map_err(|_| FrameError::Timeout)?
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
