//! Limits and floods: a connection limit that refuses clearly, a limit on one-sided reads
//! in flight per connection, pins that expire, frames that stall midway, and 100,000 bogus
//! notifications and reads that are refused and counted while a legitimate pull completes.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvxfer::{AgentConfig, BlockId, BlockLayout, EndKind};
use kvxfer_proto::v1;
use support::*;

fn hello(layout: &BlockLayout) -> Vec<u8> {
    frame_bytes(v1::FrameType::Hello, &raw_hello(layout, "raw"))
}

fn first_frame_type(s: &mut TcpStream) -> u8 {
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut h = [0u8; 5];
    s.read_exact(&mut h).expect("a frame");
    let mut body = vec![0u8; u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize - 1];
    s.read_exact(&mut body).expect("its body");
    h[4]
}

#[test]
fn connections_past_the_limit_are_refused_with_an_error_frame() {
    let mut config = AgentConfig::new("prefill").lease_ttl(Duration::from_secs(30));
    config.limits.max_connections = 2;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let addr = prefill.local_addr();
    let open: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(&hello(&layout)).expect("hello");
            assert_eq!(first_frame_type(&mut s), v1::FrameType::HelloAck as u8);
            s
        })
        .collect();
    // A connection takes its place once its handshake verified: the third is refused in
    // place of its HelloAck.
    let mut third = TcpStream::connect(addr).expect("connect");
    third.write_all(&hello(&layout)).expect("hello");
    assert_eq!(first_frame_type(&mut third), v1::FrameType::Error as u8);
    assert_eq!(prefill.stats().server.connections_refused, 1);
    drop(open);
    // Once the others closed, there is room again.
    eventually("a slot frees up", || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(&hello(&layout)).expect("hello");
        first_frame_type(&mut s) == v1::FrameType::HelloAck as u8
    });
}

fn kvmem(blocks: u32) -> kvxfer::KvMemory {
    kvxfer::KvMemory::alloc(BlockLayout::single(blocks, BLOCK).expect("layout")).expect("alloc")
}

fn runs(remote_start: BlockId, count: u32) -> Vec<kvxfer_core::plan::BlockRun> {
    vec![kvxfer_core::plan::BlockRun { remote_start, local_start: 0, count }]
}

#[cfg(feature = "ucx")]
#[test]
fn pins_in_flight_are_limited_per_connection_and_expire_when_never_unpinned() {
    let mut config = one_sided(AgentConfig::new("prefill").lease_ttl(Duration::from_secs(30)));
    config.limits.max_inflight_reads = 4;
    config.limits.pin_timeout = Duration::from_millis(400);
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let result = prefill.lease_parent("P", vec![(0..8).collect()], 1, None).expect("lease");
    let child = &result.children()[0];
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let addr = prefill.local_addr().to_string();
        let mut c = kvxfer_tcp::Connection::connect(&addr, &raw_hello(&layout, "raw"), Default::default())
            .await
            .expect("connect");
        let token = child.token().as_bytes();
        let mut crcs = Vec::new();
        let mut seqs = Vec::new();
        for b in 0..4 {
            // Blocks 0 and 1 with their checksum, 2 and 3 without.
            let grant = c.pin(child.remote_request_id(), token, &runs(b, 1), b < 2).await.expect("pin");
            // One block held for pin_timeout plus its size at the minimum transfer rate.
            let limits = kvxfer::Limits { pin_timeout: Duration::from_millis(400), ..Default::default() };
            assert_eq!(grant.held_for.as_millis(), limits.pin_hold(BLOCK).as_millis());
            crcs.push(grant.payload_crc32c);
            seqs.push(grant.seq);
        }
        match c.pin(child.remote_request_id(), token, &runs(4, 1), false).await {
            Err(kvxfer_tcp::ClientError::Refused { code, .. }) => {
                assert_eq!(code, v1::ErrorCode::LimitExceeded)
            }
            other => panic!("the fifth pin must be refused: {other:?}"),
        }
        // The pin's checksum is the checksum of the block's bytes.
        let mem = prefill.memory();
        // SAFETY: the blocks are leased; nobody writes them.
        let direct: Vec<u32> = (0..2).map(|b| unsafe { mem.crc32c([(b, 1)]) }).collect();
        assert_eq!(crcs, [Some(direct[0]), Some(direct[1]), None, None]);
        let s = prefill.stats().server;
        assert_eq!((s.pins, s.pins_open, s.pins_refused), (4, 4, 1));
        // Never unpinned, connection left open: the server drops the pins itself.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let s = prefill.stats().server;
        assert_eq!((s.pins_open, s.pins_expired), (0, 4), "{s:?}");
        // A reader that unpins now learns its pin was gone: its read must not be used.
        assert!(!c.unpin(seqs[0], true).await.expect("unpin answered"));
        // The connection still works, and the lease can end: nothing pins it any more.
        let ack = c.notify(child.remote_request_id(), token, "raw").await.expect("notify");
        assert_eq!(ack.outcome, v1::LeaseOutcome::Pulled as i32);
    });
    let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!(ends[0].kind, EndKind::Pulled);
}

#[test]
fn a_frame_stalled_midway_closes_its_connection_but_idle_ones_stay() {
    let mut config = AgentConfig::new("prefill").io_timeout(Duration::from_millis(300));
    config.limits.max_connections = 8;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let addr = prefill.local_addr();
    let mut idle = TcpStream::connect(addr).expect("connect");
    idle.write_all(&hello(&layout)).expect("hello");
    assert_eq!(first_frame_type(&mut idle), v1::FrameType::HelloAck as u8);
    let mut stalled = TcpStream::connect(addr).expect("connect");
    stalled.write_all(&hello(&layout)).expect("hello");
    assert_eq!(first_frame_type(&mut stalled), v1::FrameType::HelloAck as u8);
    // Three bytes of a header, then nothing (slowloris).
    stalled.write_all(&[0, 0, 0]).expect("partial header");
    eventually("the stalled frame is noticed", || prefill.stats().server.stalled_frames == 1);
    let mut b = [0u8; 1];
    assert_eq!(stalled.read(&mut b).expect("closed"), 0, "the server closed the stalled connection");
    // The idle connection (no frame started) outlives several timeouts and still works.
    std::thread::sleep(Duration::from_millis(1000));
    idle.write_all(&frame_bytes(v1::FrameType::Heartbeat, &v1::Heartbeat { leases: vec![] })).expect("hb");
    assert_eq!(first_frame_type(&mut idle), v1::FrameType::HeartbeatAck as u8);
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

#[test]
fn a_flood_of_bogus_notifications_and_reads_is_refused_while_a_real_pull_completes() {
    const FLOOD: usize = 100_000;
    const FLOODERS: usize = 4;
    let blocks = 4096u32; // 16 MiB per child at 4 KiB
                          // No arm wait: this measures how fast bogus requests are refused. With one, each bogus
                          // request first waits `arm_wait` for an arm that never comes, which throttles the
                          // flooder's own connection (its requests are answered one after the other).
    let config = Transport::Tcp.config(
        AgentConfig::new("prefill")
            .lease_ttl(Duration::from_secs(60))
            .io_timeout(Duration::from_secs(5))
            .arm_wait(Duration::ZERO),
    );
    let prefill = prefill_with(config, BlockLayout::single(4 * blocks, BLOCK).expect("layout"));
    let decode = Transport::Tcp.decode(4 * blocks);
    let addr = prefill.local_addr().to_string();
    let layout = prefill.memory().layout().clone();
    let victim = prefill.lease_parent("V", vec![vec![0]], 1, None).expect("lease a bystander");
    let remote: Vec<Vec<BlockId>> = (0..4).map(|i| (i * blocks..(i + 1) * blocks).collect()).collect();
    // The same pull without a flood first: the baseline for the slowdown.
    let quiet = prefill.lease_parent("Q", remote.clone(), 1, None).expect("lease");
    let quiet_started = Instant::now();
    assert!(decode.submit(quiet, remote.clone()).expect("submit").wait().all_done());
    let quiet_time = quiet_started.elapsed();
    let result = prefill.lease_parent("L", remote.clone(), 1, None).expect("lease");
    let rss_before = peak_rss_kib();

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let flood_started = Instant::now();
    let flood = rt.spawn(async move {
        let mut tasks = Vec::new();
        for f in 0..FLOODERS {
            let (addr, layout) = (addr.clone(), layout.clone());
            tasks.push(tokio::spawn(async move {
                let hello = raw_hello(&layout, &format!("flooder-{f}"));
                let mut c = raw_connect(&addr, &hello).await.expect("flooder connects");
                let dest = kvmem(1);
                let mut refused = [0usize; 3];
                for i in 0..FLOOD / FLOODERS {
                    // A third each: notifications for ids never leased, notifications with a
                    // wrong token for a live lease, reads with a wrong token.
                    match i % 3 {
                        0 | 1 => {
                            let (id, token) = if i % 3 == 0 {
                                (format!("{i}_nope"), [1u8; 16])
                            } else {
                                ("V".to_owned(), [2u8; 16])
                            };
                            let ack = c.notify(&id, &token, "flooder").await.expect("ack");
                            if ack.outcome != v1::LeaseOutcome::Pulled as i32
                                && ack.outcome != v1::LeaseOutcome::Counted as i32
                            {
                                refused[i % 3] += 1;
                            }
                        }
                        _ => {
                            // SAFETY: `dest` is this task's own memory; block 0 is in its layout.
                            let r = unsafe { c.read_into("V", &[3u8; 16], &runs(0, 1), &dest) }.await;
                            // A wrong token is told exactly what an unknown id is told.
                            if let Err(kvxfer_tcp::ClientError::Refused {
                                code: v1::ErrorCode::UnknownLease,
                                ..
                            }) = r
                            {
                                refused[2] += 1;
                            }
                        }
                    }
                }
                refused
            }));
        }
        let mut refused = [0usize; 3];
        for t in tasks {
            let r = t.await.expect("flooder task");
            for k in 0..3 {
                refused[k] += r[k];
            }
        }
        refused
    });
    // The legitimate pull runs during the flood.
    let pull_started = Instant::now();
    let report = decode.submit(result, remote.clone()).expect("submit").wait();
    let pull_time = pull_started.elapsed();
    let refused = rt.block_on(flood).expect("flood");
    let flood_time = flood_started.elapsed();
    assert!(report.all_done(), "{report:?}");
    for r in &remote {
        assert!(verify(&decode, r, r));
    }
    assert_eq!(refused.iter().sum::<usize>(), FLOOD, "every bogus request refused: {refused:?}");
    let s = prefill.stats();
    assert_eq!(s.leases.unrecognized, refused[0] as u64);
    // The lease table counts wrong tokens of notifications and reads alike.
    assert_eq!(s.leases.bad_token, (refused[1] + refused[2]) as u64);
    assert_eq!(s.server.reads_refused, refused[2] as u64);
    // The bystander's lease was not touched by the wrong-token notifications and reads.
    assert_eq!(s.leases.live, 1);
    prefill.cancel(&victim.children()[0]);
    let ends = wait_ends(&prefill, 9, Duration::from_secs(5));
    assert_eq!(ends.iter().filter(|e| e.kind == EndKind::Pulled).count(), 8);
    let rss_after = peak_rss_kib();
    eprintln!(
        "flood: {FLOOD} bogus requests ({refused:?} unknown-id notifies, wrong-token notifies, wrong-token \
         reads) refused in {:.2} s ({:.0}/s); legitimate 64 MiB pull took {:.3} s during the flood vs {:.3} s \
         without; peak RSS {} -> {} KiB",
        flood_time.as_secs_f64(),
        FLOOD as f64 / flood_time.as_secs_f64(),
        pull_time.as_secs_f64(),
        quiet_time.as_secs_f64(),
        rss_before,
        rss_after
    );
    // Refusals allocate nothing that stays: peak memory grows by far less than the data moved.
    assert!(
        rss_after.saturating_sub(rss_before) < 64 * 1024,
        "peak RSS grew {rss_before} -> {rss_after} KiB"
    );
}

/// A connection with no pin and no frame for `idle_timeout` is closed; one with a pin open
/// stays until the pin is gone.
#[cfg(feature = "ucx")]
#[test]
fn idle_connections_without_pins_are_closed() {
    let mut config = one_sided(AgentConfig::new("prefill"));
    config.limits.idle_timeout = Duration::from_millis(300);
    config.limits.pin_timeout = Duration::from_millis(800);
    config.limits.min_transfer_rate = u64::MAX;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let result = prefill.lease_parent("I", vec![vec![1]], 1, None).expect("lease");
    let child = &result.children()[0];
    let mut idle = TcpStream::connect(prefill.local_addr()).expect("connect");
    idle.write_all(&hello(&layout)).expect("hello");
    assert_eq!(first_frame_type(&mut idle), v1::FrameType::HelloAck as u8);
    let mut pinned = TcpStream::connect(prefill.local_addr()).expect("connect");
    pinned.write_all(&hello(&layout)).expect("hello");
    assert_eq!(first_frame_type(&mut pinned), v1::FrameType::HelloAck as u8);
    let pin = v1::ReadRequest {
        seq: 1,
        remote_request_id: child.remote_request_id().into(),
        lease_token: child.token().as_bytes().to_vec(),
        ranges: vec![v1::BlockRange { start: 1, count: 1 }],
        pin_crc32c: false,
        group: 0,
        head_slice: None,
    };
    pinned.write_all(&frame_bytes(v1::FrameType::Pin, &pin)).expect("pin");
    assert_eq!(first_frame_type(&mut pinned), v1::FrameType::PinAck as u8);
    let mut b = [0u8; 1];
    assert_eq!(idle.read(&mut b).expect("closed"), 0, "the idle connection was closed");
    assert_eq!(prefill.stats().server.idle_closed, 1);
    // The pinned one outlives the idle timeout: it closes only once its pin expired.
    assert_eq!(pinned.read(&mut b).expect("closed"), 0);
    let s = prefill.stats().server;
    assert_eq!((s.pins_expired, s.idle_closed), (1, 2), "{s:?}");
}

/// One peer address cannot take every slot: past `max_connections_per_peer` its
/// connections are refused with an error frame, while another address is still served.
#[test]
fn connections_per_peer_address_are_capped() {
    let mut config = AgentConfig::new("prefill");
    config.limits.max_connections_per_peer = 2;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let addr = prefill.local_addr();
    let open: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(&hello(&layout)).expect("hello");
            assert_eq!(first_frame_type(&mut s), v1::FrameType::HelloAck as u8);
            s
        })
        .collect();
    let mut third = TcpStream::connect(addr).expect("connect");
    third.write_all(&hello(&layout)).expect("hello");
    assert_eq!(first_frame_type(&mut third), v1::FrameType::Error as u8);
    let s = prefill.stats().server;
    assert_eq!((s.peer_connections_refused, s.connections_refused), (1, 0));
    // Another loopback address is another peer.
    let mut other = connect_from("127.0.0.2", addr);
    other.write_all(&hello(&layout)).expect("hello");
    assert_eq!(first_frame_type(&mut other), v1::FrameType::HelloAck as u8);
    drop(open);
    eventually("a slot frees up", || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(&hello(&layout)).expect("hello");
        first_frame_type(&mut s) == v1::FrameType::HelloAck as u8
    });
}

/// The decode side bounds a read overall too: a peer that trickles a payload a byte at a
/// time, often enough to beat the progress timeout, fails the read with a timeout.
#[test]
fn a_trickling_sender_fails_the_read_at_the_overall_deadline() {
    use std::net::TcpListener;
    let layout = BlockLayout::single(4, BLOCK).expect("layout");
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let ack = v1::HelloAck {
        protocol_version: kvxfer_proto::PROTOCOL_VERSION,
        engine_id: "trickler".into(),
        agent_name: "trickler".into(),
        compat_hash: layout.compat_hash(),
        layout: Some(layout.to_wire()),
        ..Default::default()
    };
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let frame = |s: &mut std::net::TcpStream| {
            let mut h = [0u8; 5];
            s.read_exact(&mut h).expect("header");
            let mut body = vec![0u8; u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize - 1];
            s.read_exact(&mut body).expect("body");
            (h[4], body)
        };
        let (ty, _) = frame(&mut s);
        assert_eq!(ty, v1::FrameType::Hello as u8);
        s.write_all(&frame_bytes(v1::FrameType::HelloAck, &ack)).expect("ack");
        let (ty, body) = frame(&mut s);
        assert_eq!(ty, v1::FrameType::ReadRequest as u8);
        let req = <v1::ReadRequest as kvxfer_proto::Message>::decode(body.as_slice()).expect("request");
        let resp = v1::ReadResponse { seq: req.seq, payload_len: BLOCK };
        s.write_all(&frame_bytes(v1::FrameType::ReadResponse, &resp)).expect("response");
        // One byte every 50 ms, for at most 10 s.
        for _ in 0..200 {
            if s.write_all(&[0]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let limits = kvxfer::Limits {
        io_timeout: Duration::from_millis(300),
        min_transfer_rate: 64 * 1024,
        ..Default::default()
    };
    let dest = kvmem(4);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let err = rt.block_on(async {
        let mut c = kvxfer_tcp::Connection::connect(&addr, &raw_hello(&layout, "raw"), limits)
            .await
            .expect("connect");
        // SAFETY: `dest` is this test's own memory; block 0 is in its layout.
        unsafe { c.read_into("R", &[1; 16], &runs(0, 1), &dest) }.await.expect_err("trickled")
    });
    assert!(
        matches!(err, kvxfer_tcp::ClientError::Frame { source: kvxfer_tcp::FrameError::Timeout, .. }),
        "the read must fail at its deadline, not when the sender gives up: {err}"
    );
    server.join().expect("server");
}

/// A connection to `addr` from the loopback address `ip` (127.0.0.0/8 all routes locally).
fn connect_from(ip: &str, addr: std::net::SocketAddr) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    let from: std::net::SocketAddr = format!("{ip}:0").parse().expect("address");
    socket.bind(&from.into()).expect("bind");
    socket.connect(&addr.into()).expect("connect");
    socket.into()
}

/// Hostile-peer review: a connection took its place among `max_connections` when it was
/// accepted, and one that sent nothing kept it for `io_timeout`: with the defaults four
/// silent source addresses took every place (again after each timeout), locking every keyed
/// decode agent out, and nothing was counted. Now a connection holds a place among the
/// handshakes under way (capped per address, refusals counted in `preauth_refused`) until its
/// handshake verified, and only then one among the connections served.
#[test]
fn silent_connections_do_not_take_the_places_of_authenticated_ones() {
    let mut config = AgentConfig::new("prefill").io_timeout(Duration::from_secs(120));
    config.limits.max_connections = 4;
    config.limits.max_handshakes_per_peer = 2;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_with(config, layout.clone());
    let addr = prefill.local_addr();
    // As many silent connections as there are places, from two addresses.
    let silent: Vec<TcpStream> = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
        .iter()
        .map(|ip| connect_from(ip, addr))
        .collect();
    eventually("every silent connection is accepted", || prefill.stats().server.connections == 4);
    // A third from one address is refused at once (it sent nothing), and counted.
    let mut third = connect_from("127.0.0.3", addr);
    assert_eq!(first_frame_type(&mut third), v1::FrameType::Error as u8);
    let s = prefill.stats().server;
    assert_eq!((s.preauth_refused, s.connections_refused, s.peer_connections_refused), (1, 0, 0), "{s:?}");
    // A keyed decode agent from another address still pulls.
    let decode = decode_with(AgentConfig::new("decode"), layout);
    let h = prefill.lease(kvxfer::LeaseRequest::new("R", 0, 1, vec![1, 2])).expect("lease");
    let report = decode
        .submit(kvxfer::PrefillResult::new("R", 1, vec![h]).expect("result"), vec![vec![3, 4]])
        .expect("submit")
        .wait();
    assert!(report.all_done(), "{report:?}");
    assert!(verify(&decode, &[1, 2], &[3, 4]), "every byte pulled");
    assert_eq!(wait_ends(&prefill, 1, Duration::from_secs(10))[0].kind, EndKind::Pulled);
    drop(silent);
}

/// Review of the pooled control connections: a burst of pulls starting at once against an
/// empty pool opened one control connection per pull (each took the places of a handshake
/// and a connection at the prefill agent). The pulls share what the first ones opened: at
/// most 8 control connections and `connections_per_peer` data connections.
#[test]
fn a_burst_of_pulls_shares_a_bounded_set_of_connections() {
    let prefill = prefill(64, Duration::from_secs(30));
    let decode = decode(64);
    let pulls: Vec<_> = (0..32u32)
        .map(|i| {
            let h = prefill.lease(kvxfer::LeaseRequest::new(format!("R{i}"), 0, 1, vec![i])).expect("lease");
            let result = kvxfer::PrefillResult::new(format!("R{i}"), 1, vec![h]).expect("result");
            decode.submit(result, vec![vec![32 + i]]).expect("submit")
        })
        .collect();
    for pull in pulls {
        let report = pull.wait();
        assert!(report.all_done(), "{report:?}");
    }
    let remote: Vec<BlockId> = (0..32).collect();
    let local: Vec<BlockId> = (32..64).collect();
    assert!(verify(&decode, &remote, &local), "every byte pulled");
    let opened = decode.stats().connections_opened;
    // Two data connections (the default `connections_per_peer`) and eight control ones.
    assert!(opened <= 10, "{opened} connections opened for 32 pulls");
    assert_eq!(prefill.stats().server.connections, opened);
}

/// With a cluster key, a connection past `max_connections` is refused after its proof
/// verified, in place of the HelloAck, and the connecting side reads it as a refused
/// handshake naming the limit.
#[test]
fn a_keyed_connection_past_the_limit_is_refused_after_its_proof() {
    let mut config = AgentConfig::new("prefill");
    config.limits.max_connections = 1;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_with(config, layout.clone());
    let addr = prefill.local_addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let key = test_key();
        let hello = raw_hello(&layout, "raw");
        let limits = kvxfer::Limits::default();
        let first =
            kvxfer_tcp::Connection::connect_with_key(&addr, &hello, Some(&key), limits).await.expect("first");
        assert!(first.peer_hello().authenticated);
        match kvxfer_tcp::Connection::connect_with_key(&addr, &hello, Some(&key), limits).await {
            Err(kvxfer_tcp::ClientError::Busy { message, .. }) => {
                assert!(message.contains("at most 1 connections"), "{message}")
            }
            other => panic!("the second connection must be refused: {:?}", other.map(|_| ())),
        }
        let s = prefill.stats().server;
        assert_eq!((s.connections_refused, s.auth_failed, s.handshakes_refused), (1, 0, 0), "{s:?}");
    });
}
