//! The hostile peers: each attack is a number of connection slots, each slot a loop that
//! connects from its source address (127.0.0.{2..}), runs one session of its attack until the
//! server closes it or it fails, and connects again until the phase ends (its task is then
//! aborted, which drops the connection).

use std::collections::VecDeque;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer::{BlockLayout, ClusterKey, Limits};
use kvxfer_proto::v1;
use kvxfer_tcp::frame::FrameReader;
use kvxfer_tcp::Frame;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpSocket, TcpStream};

/// One kind of hostile (or unlucky) peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attack {
    /// Connect, send nothing.
    Silent,
    /// A partial frame header, then a byte every `--trickle-secs` (half of the slots before
    /// the hello, half after it).
    Slowloris,
    /// A hello, then requests written without ever reading the answers (a tiny receive
    /// buffer).
    HalfOpen,
    /// After a hello: pipelined heartbeats, cancels and notifies of unknown leases (half of
    /// the slots), or heartbeats naming the most leases a frame may name, near
    /// `max_frame_len` (the other half).
    FrameFlood,
    /// After a hello: cancels of unknown leases (each answered only after `arm_wait`).
    StaleRelease,
    /// The legitimate decode agent itself releases leases the prefill does not know (no
    /// hostile connection: the "no attacker needed" stall behind its control connection).
    OwnStaleRelease,
    /// Hellos near and over `max_hello_len` (authenticated ones then never prove).
    BigHello,
    /// After a hello: pins with `pin_crc32c` over every block of a real lease.
    PinCrc,
    /// After a hello: notifies with 1 MiB peer strings full of newlines (unknown ids, and
    /// duplicate notifies of leases the legitimate agent pulled).
    LogFlood,
}

impl Attack {
    /// Every attack, in report order.
    pub(crate) const ALL: [Attack; 9] = [
        Attack::Silent,
        Attack::Slowloris,
        Attack::HalfOpen,
        Attack::FrameFlood,
        Attack::StaleRelease,
        Attack::OwnStaleRelease,
        Attack::BigHello,
        Attack::PinCrc,
        Attack::LogFlood,
    ];

    /// Its name on the command line and in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Attack::Silent => "silent",
            Attack::Slowloris => "slowloris",
            Attack::HalfOpen => "half-open",
            Attack::FrameFlood => "frame-flood",
            Attack::StaleRelease => "stale-release",
            Attack::OwnStaleRelease => "own-stale-release",
            Attack::BigHello => "big-hello",
            Attack::PinCrc => "pin-crc",
            Attack::LogFlood => "log-flood",
        }
    }

    /// Parses `all` or a comma-separated list of names.
    pub(crate) fn parse_list(s: &str) -> Result<Vec<Attack>, String> {
        if s.trim() == "all" {
            return Ok(Attack::ALL.to_vec());
        }
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let a = Attack::ALL.into_iter().find(|a| a.name() == name).ok_or_else(|| {
                format!("unknown attack {name:?} (all, or some of: {})", names(&Attack::ALL))
            })?;
            if !out.contains(&a) {
                out.push(a);
            }
        }
        Ok(out)
    }

    /// Whether it uses hostile connections (all but [`Attack::OwnStaleRelease`]).
    pub(crate) fn uses_connections(self) -> bool {
        self != Attack::OwnStaleRelease
    }
}

/// `a,b,c`.
pub(crate) fn names(attacks: &[Attack]) -> String {
    attacks.iter().map(|a| a.name()).collect::<Vec<_>>().join(",")
}

/// What one attack's slots did.
#[derive(Debug, Default)]
pub(crate) struct AttackStats {
    slots: AtomicU64,
    connects: AtomicU64,
    connect_errors: AtomicU64,
    handshakes_ok: AtomicU64,
    handshakes_refused: AtomicU64,
    frames_sent: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    closed_by_server: AtomicU64,
    pins_granted: AtomicU64,
    pins_refused: AtomicU64,
    /// `own-stale-release`: releases done, and the total and longest time they took (µs).
    releases: AtomicU64,
    release_us_total: AtomicU64,
    release_us_max: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl AttackStats {
    /// A JSON object of the counters (the ones that apply to `attack`).
    pub(crate) fn to_json(&self, attack: Attack) -> Value {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        if attack == Attack::OwnStaleRelease {
            let n = l(&self.releases);
            return json!({
                "releases": n,
                "release_ms_mean": if n > 0 { l(&self.release_us_total) as f64 / n as f64 / 1000.0 } else { 0.0 },
                "release_ms_max": l(&self.release_us_max) as f64 / 1000.0,
            });
        }
        let mut v = json!({
            "slots": l(&self.slots), "connects": l(&self.connects), "connect_errors": l(&self.connect_errors),
            "handshakes_ok": l(&self.handshakes_ok), "handshakes_refused": l(&self.handshakes_refused),
            "frames_sent": l(&self.frames_sent), "bytes_sent": l(&self.bytes_sent),
            "bytes_received": l(&self.bytes_received), "closed_by_server": l(&self.closed_by_server),
        });
        if attack == Attack::PinCrc {
            v["pins_granted"] = json!(l(&self.pins_granted));
            v["pins_refused"] = json!(l(&self.pins_refused));
        }
        v
    }

    /// Counts one release by the legitimate agent that took `took`.
    pub(crate) fn release_done(&self, took: Duration) {
        let us = took.as_micros().min(u128::from(u64::MAX)) as u64;
        add(&self.releases, 1);
        add(&self.release_us_total, us);
        self.release_us_max.fetch_max(us, Ordering::Relaxed);
    }
}

/// A real lease for the pin attack: its id, token and block count.
#[derive(Debug, Clone)]
pub(crate) struct RealLease {
    pub(crate) id: String,
    pub(crate) token: Vec<u8>,
    pub(crate) blocks: u32,
}

/// What every slot shares.
pub(crate) struct AttackCtx {
    /// The prefill agent.
    pub(crate) target: SocketAddr,
    /// Source addresses: 127.0.0.2 and the `addrs - 1` after it.
    pub(crate) addrs: u32,
    /// The target's layout (a valid hello names it).
    pub(crate) layout: BlockLayout,
    /// The cluster key, when the hostile peers hold it (`--insider`).
    pub(crate) key: Option<ClusterKey>,
    /// Interval between slow-loris bytes.
    pub(crate) trickle: Duration,
    /// The lease the pin attack pins (set per phase).
    pub(crate) pin_lease: Mutex<Option<RealLease>>,
    /// Leases the legitimate agent pulled lately (id, token): duplicate notifies name them.
    pub(crate) ended: Mutex<VecDeque<(String, Vec<u8>)>>,
    /// The target's limits (its defaults).
    pub(crate) limits: Limits,
    /// A heartbeat naming `max_leases_per_frame` unknown leases, just under `max_frame_len`.
    big_heartbeat: Vec<u8>,
    /// A notify of an unknown id of ~1 MiB full of newlines.
    big_notify: Vec<u8>,
}

impl AttackCtx {
    /// The shared state of the slots attacking `target`.
    pub(crate) fn new(
        target: SocketAddr,
        addrs: u32,
        layout: BlockLayout,
        key: Option<ClusterKey>,
        trickle: Duration,
    ) -> AttackCtx {
        let limits = Limits::default();
        let n = limits.max_leases_per_frame;
        // Each LeaseRef: tag + len + (tag + len + id) + (tag + len + 16-byte token).
        let room = (limits.max_frame_len as usize).saturating_sub(64);
        let id_len = (room / n.max(1)).saturating_sub(2 + 3 + 2 + 16 + 2).clamp(1, 100_000);
        let leases = (0..n)
            .map(|i| v1::LeaseRef {
                remote_request_id: format!("{i:08}{}", "x".repeat(id_len.saturating_sub(8))),
                lease_token: vec![0xab; 16],
            })
            .collect();
        let mut big_heartbeat = Vec::new();
        Frame::Heartbeat(v1::Heartbeat { leases }).encode(&mut big_heartbeat);
        let mut big_notify = Vec::new();
        Frame::Notify(v1::Notify {
            remote_request_id: newline_string((limits.max_frame_len as usize).saturating_sub(4096)),
            lease_token: vec![0xcd; 16],
            consumer_id: "hostile\nERROR forged log line".into(),
        })
        .encode(&mut big_notify);
        AttackCtx {
            target,
            addrs: addrs.max(1),
            layout,
            key,
            trickle,
            pin_lease: Mutex::new(None),
            ended: Mutex::new(VecDeque::new()),
            limits,
            big_heartbeat,
            big_notify,
        }
    }

    /// The source address of slot `global` (slots are spread round-robin).
    fn source(&self, global: usize) -> Ipv4Addr {
        Ipv4Addr::from(0x7f00_0002u32 + (global as u32 % self.addrs))
    }

    fn hello(&self, slot: usize) -> v1::Hello {
        v1::Hello {
            protocol_version: kvxfer_proto::PROTOCOL_VERSION,
            engine_id: format!("hostile-{slot}"),
            agent_name: "kvxfer-hostile".into(),
            compat_hash: self.layout.compat_hash(),
            layout: Some(self.layout.to_wire()),
            ..Default::default()
        }
    }

    /// The hello of the legitimate prober.
    pub(crate) fn probe_hello(&self) -> v1::Hello {
        v1::Hello {
            engine_id: "legit-probe".into(),
            agent_name: "kvxfer-hostile-probe".into(),
            ..self.hello(0)
        }
    }

    /// Remembers a lease the legitimate agent pulled.
    pub(crate) fn pulled(&self, id: String, token: Vec<u8>) {
        let mut q = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        q.push_back((id, token));
        while q.len() > 1024 {
            q.pop_front();
        }
    }

    fn some_ended(&self, n: u64) -> Option<(String, Vec<u8>)> {
        let q = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        if q.is_empty() {
            return None;
        }
        q.get(n as usize % q.len()).cloned()
    }
}

/// A string of about `len` bytes with a newline every 64.
fn newline_string(len: usize) -> String {
    let line = format!("{}\n", "y".repeat(63));
    line.repeat(len / 64 + 1)
}

/// Runs one slot of `attack` until its task is aborted.
pub(crate) async fn slot(
    attack: Attack,
    global: usize,
    local: usize,
    ctx: Arc<AttackCtx>,
    stats: Arc<AttackStats>,
) {
    add(&stats.slots, 1);
    let src = ctx.source(global);
    // Spread the first connects over a second.
    tokio::time::sleep(Duration::from_millis((global as u64 * 7) % 1000)).await;
    let mut session = 0u64;
    loop {
        let rcvbuf = (attack == Attack::HalfOpen).then_some(4096);
        match connect_from(src, ctx.target, rcvbuf).await {
            Ok(stream) => {
                add(&stats.connects, 1);
                let closed = run_session(attack, stream, local, session, &ctx, &stats).await;
                if closed {
                    add(&stats.closed_by_server, 1);
                }
            }
            Err(_) => add(&stats.connect_errors, 1),
        }
        session += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn connect_from(src: Ipv4Addr, target: SocketAddr, rcvbuf: Option<u32>) -> io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.set_reuseaddr(true)?;
    if let Some(b) = rcvbuf {
        s.set_recv_buffer_size(b)?;
    }
    s.bind(SocketAddr::new(src.into(), 0))?;
    match tokio::time::timeout(Duration::from_secs(5), s.connect(target)).await {
        Ok(r) => r,
        Err(_) => Err(io::ErrorKind::TimedOut.into()),
    }
}

/// The authenticated (with `--insider`) or plain handshake; `None` when refused.
async fn handshake(
    stream: &mut TcpStream,
    ctx: &AttackCtx,
    slot: usize,
    stats: &AttackStats,
) -> Option<FrameReader> {
    let mut reader = FrameReader::new();
    let hello = ctx.hello(slot);
    let r = kvxfer_tcp::handshake::initiate_buffered(
        stream,
        &mut reader,
        "target",
        &hello,
        ctx.key.as_ref(),
        &ctx.limits,
    )
    .await;
    match r {
        Ok(_) => {
            add(&stats.handshakes_ok, 1);
            Some(reader)
        }
        Err(_) => {
            add(&stats.handshakes_refused, 1);
            None
        }
    }
}

/// Reads and discards until the server closes (or resets): `true` then.
async fn drain(mut r: OwnedReadHalf, stats: &AttackStats) -> bool {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return true,
            Ok(n) => add(&stats.bytes_received, n as u64),
        }
    }
}

/// Writes `bytes` (counted as `frames` frames); `false` when the write failed or made no
/// progress for a minute.
async fn send(w: &mut OwnedWriteHalf, bytes: &[u8], frames: u64, stats: &AttackStats) -> bool {
    match tokio::time::timeout(Duration::from_secs(60), w.write_all(bytes)).await {
        Ok(Ok(())) => {
            add(&stats.frames_sent, frames);
            add(&stats.bytes_sent, bytes.len() as u64);
            true
        }
        _ => false,
    }
}

/// Runs `writer` against the write half while the read half is drained; `true` when the
/// server closed the connection.
async fn with_drain<F, Fut>(stream: TcpStream, stats: &AttackStats, writer: F) -> bool
where
    F: FnOnce(OwnedWriteHalf) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (r, w) = stream.into_split();
    tokio::select! {
        closed = drain(r, stats) => closed,
        () = writer(w) => false,
    }
}

fn encode(frames: &[Frame]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        f.encode(&mut out);
    }
    out
}

/// One session of `attack` on a connected `stream`: `true` when the server closed it.
async fn run_session(
    attack: Attack,
    mut stream: TcpStream,
    slot: usize,
    session: u64,
    ctx: &AttackCtx,
    stats: &AttackStats,
) -> bool {
    match attack {
        Attack::Silent => {
            // The write half is held (dropping it would send a FIN), never written.
            with_drain(stream, stats, |w| async move {
                let _held = w;
                std::future::pending::<()>().await;
            })
            .await
        }
        Attack::Slowloris => {
            let after_hello = slot % 2 == 1;
            if after_hello && handshake(&mut stream, ctx, slot, stats).await.is_none() {
                return true;
            }
            let trickle = ctx.trickle;
            with_drain(stream, stats, |mut w| async move {
                // A hello (or heartbeat) header announcing 4000 bytes, then its body; three
                // bytes at first, then one every `trickle`.
                let ty = if after_hello { v1::FrameType::Heartbeat } else { v1::FrameType::Hello } as u8;
                let mut bytes = 4000u32.to_be_bytes().to_vec();
                bytes.push(ty);
                bytes.extend(std::iter::repeat_n(0x0a, 3999));
                if !send(&mut w, &bytes[..3], 0, stats).await {
                    return;
                }
                for b in &bytes[3..] {
                    tokio::time::sleep(trickle).await;
                    if !send(&mut w, std::slice::from_ref(b), 0, stats).await {
                        return;
                    }
                }
                std::future::pending::<()>().await;
            })
            .await
        }
        Attack::HalfOpen => {
            if handshake(&mut stream, ctx, slot, stats).await.is_none() {
                return true;
            }
            // Never read again: the answers pile up in the server's send buffer.
            let batch = encode(&vec![Frame::Heartbeat(v1::Heartbeat { leases: vec![] }); 1024]);
            let (_r, mut w) = stream.into_split();
            while send(&mut w, &batch, 1024, stats).await {}
            true
        }
        Attack::FrameFlood => {
            if handshake(&mut stream, ctx, slot, stats).await.is_none() {
                return true;
            }
            let unknown = |k: usize| (format!("flood-{slot}-{session}-{k}"), vec![0x5a; 16]);
            let mut small = vec![Frame::Heartbeat(v1::Heartbeat { leases: vec![] }); 50];
            for k in 0..10 {
                let (id, token) = unknown(k);
                small.push(Frame::Cancel(v1::Cancel {
                    remote_request_id: id.clone(),
                    lease_token: token.clone(),
                }));
                small.push(Frame::Notify(v1::Notify {
                    remote_request_id: id.clone(),
                    lease_token: token.clone(),
                    consumer_id: "hostile".into(),
                }));
                let leases = (0..8).map(|j| v1::LeaseRef {
                    remote_request_id: format!("{id}-{j}"),
                    lease_token: token.clone(),
                });
                small.push(Frame::Heartbeat(v1::Heartbeat { leases: leases.collect() }));
            }
            let n_small = small.len() as u64;
            let small = encode(&small);
            // Half of the slots send only the big heartbeats: behind the small frames (each
            // unknown lease waits `arm_wait`), a big one would not be read within a phase.
            let big_only = slot.is_multiple_of(2);
            with_drain(stream, stats, |mut w| async move {
                if big_only {
                    while send(&mut w, &ctx.big_heartbeat, 1, stats).await {}
                } else {
                    while send(&mut w, &small, n_small, stats).await {}
                }
            })
            .await
        }
        Attack::StaleRelease => {
            if handshake(&mut stream, ctx, slot, stats).await.is_none() {
                return true;
            }
            with_drain(stream, stats, |mut w| async move {
                let mut k = 0u64;
                loop {
                    let frames: Vec<Frame> = (0..16)
                        .map(|_| {
                            k += 1;
                            Frame::Cancel(v1::Cancel {
                                remote_request_id: format!("stale-{slot}-{session}-{k}"),
                                lease_token: vec![0x11; 16],
                            })
                        })
                        .collect();
                    if !send(&mut w, &encode(&frames), 16, stats).await {
                        return;
                    }
                }
            })
            .await
        }
        Attack::OwnStaleRelease => true,
        Attack::BigHello => {
            let max_hello = ctx.limits.max_hello_len as usize;
            let (target_len, authenticated) = match slot % 4 {
                0 => (max_hello.saturating_sub(64), true),
                1 => (max_hello.saturating_sub(64), false),
                2 => (max_hello + max_hello / 2, true),
                _ => (20 << 10, true),
            };
            // Empty repeated layouts: 2 bytes each on the wire, far more decoded.
            let mut hello = ctx.hello(slot);
            hello.authenticated = authenticated;
            hello.nonce = if authenticated { kvxfer_tcp::handshake::nonce() } else { Vec::new() };
            let base = Frame::Hello(hello.clone());
            let mut probe = Vec::new();
            base.encode(&mut probe);
            hello.other_group_layouts =
                vec![v1::BlockLayout::default(); target_len.saturating_sub(probe.len()) / 2];
            let bytes = encode(&[Frame::Hello(hello)]);
            with_drain(stream, stats, |mut w| async move {
                if send(&mut w, &bytes, 1, stats).await {
                    // Never prove: hold the server's wait for the proof.
                    std::future::pending::<()>().await;
                }
            })
            .await
        }
        Attack::PinCrc => {
            let Some(mut reader) = handshake(&mut stream, ctx, slot, stats).await else {
                return true;
            };
            let lease = ctx.pin_lease.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let Some(lease) = lease else {
                tokio::time::sleep(Duration::from_secs(1)).await;
                return false;
            };
            pin_loop(&mut stream, &mut reader, &lease, ctx, stats).await
        }
        Attack::LogFlood => {
            if handshake(&mut stream, ctx, slot, stats).await.is_none() {
                return true;
            }
            let consumer = newline_string((ctx.limits.max_frame_len as usize).saturating_sub(8192));
            with_drain(stream, stats, |mut w| async move {
                let mut k = session;
                loop {
                    k += 1;
                    // A duplicate notify of a pulled lease (answered at once) with a 1 MiB
                    // consumer id, then an unknown id of 1 MiB (answered after arm_wait).
                    if let Some((id, token)) = ctx.some_ended(k + slot as u64) {
                        let dup = encode(&[Frame::Notify(v1::Notify {
                            remote_request_id: id,
                            lease_token: token,
                            consumer_id: consumer.clone(),
                        })]);
                        if !send(&mut w, &dup, 1, stats).await {
                            return;
                        }
                    }
                    if !send(&mut w, &ctx.big_notify, 1, stats).await {
                        return;
                    }
                }
            })
            .await
        }
    }
}

/// Pins every block of `lease` with a CRC, eight at a time, unpinning what was granted;
/// `true` when the server closed the connection.
async fn pin_loop(
    stream: &mut TcpStream,
    reader: &mut FrameReader,
    lease: &RealLease,
    ctx: &AttackCtx,
    stats: &AttackStats,
) -> bool {
    let mut seq = 0u64;
    loop {
        let mut out = Vec::new();
        for _ in 0..8 {
            seq += 1;
            Frame::Pin(v1::ReadRequest {
                seq,
                remote_request_id: lease.id.clone(),
                lease_token: lease.token.clone(),
                ranges: vec![v1::BlockRange { start: 0, count: lease.blocks }],
                pin_crc32c: true,
                ..Default::default()
            })
            .encode(&mut out);
        }
        if tokio::time::timeout(Duration::from_secs(60), stream.write_all(&out))
            .await
            .map_or(true, |r| r.is_err())
        {
            return true;
        }
        add(&stats.frames_sent, 8);
        add(&stats.bytes_sent, out.len() as u64);
        let mut answered = 0;
        let mut unpins = Vec::new();
        while answered < 8 {
            let f = tokio::time::timeout(
                Duration::from_secs(60),
                reader.read_frame(stream, ctx.limits.max_frame_len),
            )
            .await;
            match f {
                Ok(Ok(Frame::PinAck(a))) => {
                    answered += 1;
                    add(&stats.pins_granted, 1);
                    Frame::Unpin(v1::Unpin { seq: a.seq, completed: false }).encode(&mut unpins);
                }
                Ok(Ok(Frame::Error(_))) => {
                    answered += 1;
                    add(&stats.pins_refused, 1);
                }
                Ok(Ok(_)) => {}
                Ok(Err(_)) | Err(_) => return true,
            }
        }
        if !unpins.is_empty() {
            if tokio::time::timeout(Duration::from_secs(60), stream.write_all(&unpins))
                .await
                .map_or(true, |r| r.is_err())
            {
                return true;
            }
            add(&stats.bytes_sent, unpins.len() as u64);
        }
    }
}
