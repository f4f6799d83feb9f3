//! Pinned ranges of one prefill-side connection: the read guards that one-sided reads (UCX,
//! RDMA) hold between a `Pin` and its `Unpin`, how long each is held, and the sweep that
//! drops the ones whose holder neither unpinned nor closed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::log::Peer;
use kvxfer_core::plan::BlockRange;
use kvxfer_core::ReadGuard;
use kvxfer_proto::v1::{self, ErrorCode};
use tracing::{debug, warn};

use crate::context::ServeContext;
use crate::frame::Frame;
use crate::read::{begin, guard_deadline, ranges_of};
use crate::stats::{bump, ServerCounters};

/// A pinned range: its read guard, its payload bytes, how long it is held and until when,
/// and the open-pin gauge it holds.
struct Pinned {
    guard: ReadGuard,
    bytes: u64,
    hold: Duration,
    deadline: Instant,
    counters: Arc<ServerCounters>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.counters.pins_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The pins of one connection, by pin sequence number; dropped (and their read guards with
/// them) with the connection.
#[derive(Default)]
pub(crate) struct Pins {
    by_seq: HashMap<u64, Pinned>,
}

impl Pins {
    /// No pin is open.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_seq.is_empty()
    }

    /// The earliest deadline of the open pins.
    pub(crate) fn earliest_deadline(&self) -> Option<Instant> {
        self.by_seq.values().map(|p| p.deadline).min()
    }

    /// Drops the pins whose deadline passed (loudly: the peer neither unpinned nor closed).
    pub(crate) fn expire(&mut self, ctx: &ServeContext, now: Instant) {
        self.by_seq.retain(|seq, p| {
            let keep = p.deadline > now;
            if !keep {
                bump(&ctx.counters.pins_expired);
                if let Some(suppressed) = ctx.counters.warnings.allow() {
                    warn!(
                        remote_request_id = %Peer(&p.guard.request_id()), seq, suppressed,
                        "pin dropped after {:?} without an unpin", p.hold
                    );
                }
            }
            keep
        });
    }

    /// Answers a `Pin`: the read guard is taken and held (for `Limits::pin_hold` of its
    /// bytes, at most until the lease's maximum lifetime plus the io timeout) and a `PinAck`
    /// answered, or the request is refused — past `Limits::max_inflight_reads`, for a sequence number in use, or as a read
    /// would be. A pin's CRC (`pin_crc32c`) is computed on tokio's blocking pool, not on a
    /// runtime worker (a 128 MiB range takes milliseconds), with the read guard moved into
    /// that task: the lease's blocks stay pinned until the CRC finished, even if this future
    /// is dropped.
    pub(crate) async fn pin(&mut self, ctx: &ServeContext, req: &v1::ReadRequest, now: Instant) -> Frame {
        if self.by_seq.len() >= ctx.limits.max_inflight_reads || self.by_seq.contains_key(&req.seq) {
            bump(&ctx.counters.pins_refused);
            let msg = format!(
                "pin {} refused: {} pins open on this connection (at most {}) or the sequence number is in use",
                req.seq,
                self.by_seq.len(),
                ctx.limits.max_inflight_reads
            );
            return Frame::error(ErrorCode::LimitExceeded, msg, req.seq);
        }
        if req.pin_crc32c && ctx.memory.is_device() {
            // A peer's request: answered, never a CPU read of device memory.
            let message = format!(
                "pin {}: this agent's KV cache is device memory, whose CRC it does not compute on the CPU \
                 (pin without pin_crc32c)",
                req.seq
            );
            return Frame::error(ErrorCode::Internal, message, req.seq);
        }
        let (guard, bytes, slices) = match begin(ctx, req) {
            Ok(started) => started,
            Err(e) => return Frame::Error(e),
        };
        if let Err(e) = crate::read::group_memory(ctx, req) {
            return Frame::Error(e);
        }
        let (guard, payload_crc32c) = if req.pin_crc32c {
            let memory = ctx.memory.clone();
            let group = req.group as usize;
            let ranges = ranges_of(req);
            // The guard moves into the blocking task and comes back with the CRC: the
            // blocks stay leased for as long as the CRC reads them.
            let crc = tokio::task::spawn_blocking(move || {
                let crc = memory.group(group).map(|mem| payload_crc(mem, &guard, &ranges, &slices));
                (guard, crc)
            })
            .await;
            match crc {
                Ok((guard, Some(crc))) => (guard, crc),
                _ => {
                    let message = format!("pin {}: the payload CRC could not be computed", req.seq);
                    return Frame::error(ErrorCode::Internal, message, req.seq);
                }
            }
        } else {
            (guard, 0)
        };
        bump(&ctx.counters.pins);
        bump(&ctx.counters.pins_open);
        // Held longer for larger pins, so a big one-sided read has time to finish,
        // but never past the lease's maximum lifetime (plus the io timeout); the
        // holder is told how long.
        let deadline = guard_deadline(ctx, &guard, now, ctx.limits.pin_hold(bytes));
        let hold = deadline.saturating_duration_since(now);
        debug!(remote_request_id = %Peer(&req.remote_request_id), seq = req.seq, bytes, ?hold, "pinned");
        self.by_seq.insert(req.seq, Pinned { guard, bytes, hold, deadline, counters: ctx.counters.clone() });
        let held_for_ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
        Frame::PinAck(v1::PinAck { seq: req.seq, payload_crc32c, held_for_ms })
    }

    /// Answers an `Unpin`: releases the pin (a completed read is counted as served) and
    /// says whether it was still held.
    pub(crate) fn unpin(&mut self, ctx: &ServeContext, u: &v1::Unpin) -> Frame {
        let pin = self.by_seq.remove(&u.seq);
        let held = pin.is_some();
        if let Some(pin) = pin {
            if u.completed {
                ctx.counters.bytes_served.fetch_add(pin.bytes, Ordering::Relaxed);
                ctx.counters.bytes_served_one_sided.fetch_add(pin.bytes, Ordering::Relaxed);
                bump(&ctx.counters.reads_served);
            }
            debug!(remote_request_id = %Peer(&pin.guard.request_id()), seq = u.seq, completed = u.completed, "unpinned");
        }
        Frame::UnpinAck(v1::UnpinAck { seq: u.seq, held })
    }
}

/// Whether this agent offers a one-sided transport (UCX): pins exist only for one-sided
/// reads, so an agent serving TCP alone refuses them — and closes the connection, since no
/// decode agent pins an agent that offered it no UCX (see [`refuse_pin`]).
pub(crate) fn offers_one_sided(ctx: &ServeContext) -> bool {
    ctx.hello_ack.transports.iter().any(|t| t.transport == v1::Transport::Ucx as i32)
}

/// What a pin sent to an agent that offers no one-sided transport is answered with before
/// its connection closes (counted in `pins_refused`): a decode agent reads over TCP from such
/// an agent and never pins it, so the peer is broken or hostile, and closing makes a flood of
/// pins cost a handshake each instead of an answer each.
pub(crate) fn refuse_pin(ctx: &ServeContext, req: &v1::ReadRequest) -> (ErrorCode, String) {
    bump(&ctx.counters.pins_refused);
    if let Some(suppressed) = ctx.counters.warnings.allow() {
        warn!(remote_request_id = %Peer(&req.remote_request_id), seq = req.seq, suppressed, "pin refused, closing the connection: this agent offers no one-sided transport");
    }
    let msg = format!(
        "pin {} refused: this agent offers no one-sided transport (UCX); read over TCP instead",
        req.seq
    );
    (ErrorCode::LimitExceeded, msg)
}

/// CRC-32C of the blocks of `ranges`, which `guard` keeps leased.
fn payload_crc(
    mem: &kvxfer_mem::KvMemory,
    guard: &ReadGuard,
    ranges: &[BlockRange],
    slices: &crate::read::BlockSlices,
) -> u32 {
    let _ = guard;
    #[cfg(test)]
    tests::gate(guard.request_id());
    crate::read::payload_chunks(mem, ranges, slices).fold(0, |crc, c| {
        // SAFETY: `guard` pins the lease and `begin_group_read` checked every block of
        // `ranges` against it and against `mem`'s group (a head slice lies inside each
        // block); the owner does not write leased blocks (kvxfer-mem's access contract).
        kvxfer_mem::crc32c_append(crc, unsafe { mem.chunk(c) })
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use kvxfer_core::LeaseRequest;
    use kvxfer_proto::v1::{self, ErrorCode};
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use crate::frame::{Frame, FrameReader};
    use crate::handshake::tests::{ctx, hello};
    use crate::server::{serve_connection, ServeContext};

    /// A pin CRC of this request id waits for the test: it says it started, then waits to be
    /// let go.
    type Gate = (String, mpsc::Sender<()>, mpsc::Receiver<()>);
    static GATE: Mutex<Option<Gate>> = Mutex::new(None);

    /// Called by `payload_crc` before it reads: holds a CRC of the gated request id.
    pub(crate) fn gate(request_id: &str) {
        let mut g = GATE.lock().unwrap_or_else(|p| p.into_inner());
        if g.as_ref().is_some_and(|(id, _, _)| id == request_id) {
            let (_, entered, open) = g.take().expect("gate");
            drop(g);
            let _ = entered.send(());
            let _ = open.recv_timeout(Duration::from_secs(30));
        }
    }

    /// Serves every connection to the returned address on a current-thread runtime of its
    /// own thread: one runtime worker for every connection.
    fn serve_on_one_thread(ctx: Arc<ServeContext>) -> std::net::SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        listener.set_nonblocking(true).expect("nonblocking");
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("listener");
                loop {
                    let (s, _) = listener.accept().await.expect("accept");
                    tokio::spawn(serve_connection(s, ctx.clone(), crate::admit_any()));
                }
            });
        });
        addr
    }

    async fn connect(addr: std::net::SocketAddr) -> (TcpStream, FrameReader) {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let mut reader = FrameReader::new();
        let limits = crate::Limits::default();
        crate::handshake::initiate_buffered(&mut s, &mut reader, "prefill", &hello(), None, &limits)
            .await
            .expect("handshake");
        (s, reader)
    }

    async fn send(s: &mut TcpStream, f: Frame) {
        let mut out = Vec::new();
        f.encode(&mut out);
        s.write_all(&out).await.expect("write");
    }

    fn pin_request(lease: &kvxfer_core::ChildHandoff, crc: bool) -> v1::ReadRequest {
        v1::ReadRequest {
            seq: 1,
            remote_request_id: lease.remote_request_id().into(),
            lease_token: lease.token().as_bytes().to_vec(),
            ranges: vec![v1::BlockRange { start: 1, count: 1 }],
            pin_crc32c: crc,
            ..Default::default()
        }
    }

    /// Hostile-peer review: pins exist for one-sided (UCX) reads, yet an agent serving TCP
    /// alone granted them (each one holding a lease's blocks, and with `pin_crc32c` a CRC
    /// over the range). Now it refuses them, counted, without touching the lease, and
    /// closes the connection (`kvxfer-hostile` pin-crc: 1.5 million refusals in 10 s cost
    /// more than the pulls got).
    #[test]
    fn a_tcp_only_agent_refuses_pins() {
        let mut c = ctx(None);
        c.hello_ack.transports =
            vec![v1::TransportOffer { transport: v1::Transport::Tcp as i32, connection_info: vec![] }];
        let ctx = Arc::new(c);
        let lease = ctx.table.lease(LeaseRequest::new("T", 0, 1, vec![1]), Instant::now()).expect("lease");
        let addr = serve_on_one_thread(ctx.clone());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        rt.block_on(async {
            let (mut s, mut reader) = connect(addr).await;
            send(&mut s, Frame::Pin(pin_request(&lease, true))).await;
            let answer = reader.read_frame(&mut s, 1 << 20).await.expect("answer");
            let Frame::Error(e) = &answer else { panic!("pin granted: {answer:?}") };
            assert_eq!(e.code, ErrorCode::LimitExceeded as i32, "{e:?}");
            assert_eq!(e.seq, 1);
            assert!(e.message.contains("no one-sided transport"), "{e:?}");
            // And the connection ends: a flood of pins costs a handshake each.
            assert!(matches!(reader.read_frame(&mut s, 1 << 20).await, Err(crate::FrameError::Closed)));
        });
        let stats = ctx.counters.snapshot();
        assert_eq!((stats.pins, stats.pins_open, stats.pins_refused), (0, 0, 1));
        assert_eq!(ctx.table.reads_in_flight(), 0);
    }

    /// Hostile-peer review: a pin's CRC ran inline on a runtime worker, so every other
    /// connection of that worker waited for it (two peers pipelining 128 MiB pins held a
    /// heartbeat for seconds). On a one-worker runtime, a heartbeat on another connection is
    /// now answered while a pin's CRC is held in the middle.
    #[test]
    fn a_pin_crc_does_not_block_the_runtime() {
        let ctx = Arc::new(ctx(None));
        let lease = ctx.table.lease(LeaseRequest::new("G", 0, 1, vec![1]), Instant::now()).expect("lease");
        let (entered_tx, entered) = mpsc::channel();
        let (open, open_rx) = mpsc::channel();
        *GATE.lock().expect("gate") = Some((lease.remote_request_id().to_owned(), entered_tx, open_rx));
        let addr = serve_on_one_thread(ctx.clone());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        let (mut a, mut a_reader) = rt.block_on(connect(addr));
        let (mut b, mut b_reader) = rt.block_on(connect(addr));
        rt.block_on(send(&mut a, Frame::Pin(pin_request(&lease, true))));
        entered.recv_timeout(Duration::from_secs(30)).expect("the pin's CRC started");
        // The CRC is held: the heartbeat on the other connection must be answered meanwhile.
        let hb = rt.block_on(async {
            send(&mut b, Frame::Heartbeat(v1::Heartbeat { leases: vec![] })).await;
            tokio::time::timeout(Duration::from_secs(5), b_reader.read_frame(&mut b, 1 << 20)).await
        });
        open.send(()).expect("open the gate");
        let pin = rt.block_on(a_reader.read_frame(&mut a, 1 << 20)).expect("pin answer");
        assert!(matches!(pin, Frame::PinAck(_)), "{pin:?}");
        let hb = hb.expect("the heartbeat was not answered while a pin's CRC ran");
        assert!(matches!(hb, Ok(Frame::HeartbeatAck(_))), "{hb:?}");
        assert_eq!(ctx.counters.snapshot().pins, 1);
    }
}
