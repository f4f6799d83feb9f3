//! Regression tests of the hardening review (issue 10, part A) through a real prefill agent
//! on 127.0.0.1: ranges that name no blocks, lease_parent failing midway, the parent
//! tracker, bounded fan-out, and pins swept while frames keep arriving. Each failed before
//! its fix.

mod support;

use std::time::Duration;

use kvxfer::{AgentConfig, BlockLayout, ChildState, LeaseRequest};
use kvxfer_core::plan::BlockRun;
use kvxfer_proto::v1;
use support::*;

fn runs(v: &[(u32, u32)]) -> Vec<BlockRun> {
    v.iter().map(|&(remote_start, count)| BlockRun { remote_start, local_start: 0, count }).collect()
}

fn refusal_code(e: kvxfer_tcp::ClientError) -> v1::ErrorCode {
    match e {
        kvxfer_tcp::ClientError::Refused { code, .. } => code,
        other => panic!("expected a clean refusal on a live connection, got {other}"),
    }
}

/// Bug 1: `[{1, 1}, {1000, 0}]` with a valid token passed every check and the server's
/// memory access asserted, killing the connection task (the process under panic = abort).
/// Now a read and a pin (with its CRC) of it are refused, and the same connection and the
/// agent keep serving.
#[test]
fn a_zero_count_range_is_refused_cleanly_for_reads_and_pins() {
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(one_sided(AgentConfig::new("prefill")), layout.clone());
    // Without UCX the agent refuses every pin before looking at its ranges, and closes the
    // connection (no decode agent pins an agent that offers no UCX): checked last.
    let ucx = cfg!(feature = "ucx");
    let result = prefill.lease_parent("Z", vec![vec![1, 2]], 1, None).expect("lease");
    let child = result.children()[0].clone();
    let dest = kvxfer::KvMemory::alloc(layout.clone()).expect("alloc");
    let addr = prefill.local_addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let mut c = kvxfer_tcp::Connection::connect(&addr, &raw_hello(&layout, "raw"), Default::default())
            .await
            .expect("connect");
        let (id, tok) = (child.remote_request_id(), child.token().as_bytes());
        for bad in [runs(&[(1, 1), (1000, 0)]), runs(&[(1000, 0)]), runs(&[(1, 1), (2, 0)])] {
            // SAFETY: `dest` is this test's own memory; local block 0 is in its layout.
            let r = unsafe { c.read_into(id, tok, &bad, &dest) }.await;
            assert_eq!(refusal_code(r.expect_err("refused")), v1::ErrorCode::BlockOutOfRange, "{bad:?}");
            if ucx {
                let p = c.pin(id, tok, &bad, true).await;
                assert_eq!(refusal_code(p.expect_err("refused")), v1::ErrorCode::BlockOutOfRange, "{bad:?}");
            }
        }
        // The same connection still serves a well-formed read.
        // SAFETY: as above.
        let n = unsafe { c.read_into(id, tok, &runs(&[(1, 2)]), &dest) }.await.expect("read");
        assert_eq!(n, 2 * BLOCK);
        if !ucx {
            let p = c.pin(id, tok, &runs(&[(1, 1), (1000, 0)]), true).await;
            assert_eq!(refusal_code(p.expect_err("refused")), v1::ErrorCode::LimitExceeded);
        }
    });
    eventually("the served read is counted", || prefill.stats().server.reads_served == 1);
    assert_eq!(prefill.stats().server.reads_refused, if ucx { 6 } else { 3 });
}

/// Bug 3: a lease_parent that failed midway released the leases it had made, so their
/// ends reached the owner for hand-offs it never received (an owner that frees on `Err`
/// freed twice). Now they are retracted: no end at all.
#[test]
fn lease_parent_failing_midway_emits_no_end_for_hand_offs_never_returned() {
    let prefill = prefill(16, Duration::from_secs(30));
    // Child 1 of P is already leased on its own, so lease_parent fails at child 1, after
    // child 0's lease was made.
    let one = prefill.lease(LeaseRequest::new("P", 1, 3, vec![5])).expect("lease child 1");
    let err = prefill.lease_parent("P", vec![vec![1], vec![2], vec![3]], 1, None).expect_err("1_P is live");
    assert!(err.to_string().contains("1_P"), "{err}");
    assert_no_more_ends(&prefill, Duration::from_millis(200));
    let s = prefill.stats().leases;
    assert_eq!((s.leased, s.live), (2, 1), "{s:?}");
    // The tracker knows only the lease that exists.
    let status = prefill.parent_status("P").expect("P has a live child");
    assert_eq!(status.children, vec![ChildState::Pending; 3]);
    prefill.cancel(&one);
    let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!(&*ends[0].remote_request_id, "1_P");
}

/// Bug 3: a re-leased child kept its old end state in the parent tracker, so its parent
/// could look complete while the new lease was live.
#[test]
fn a_re_leased_child_is_pending_again() {
    let prefill = prefill(16, Duration::from_secs(30));
    let zero = prefill.lease(LeaseRequest::new("Q", 0, 2, vec![1])).expect("lease");
    let _one = prefill.lease(LeaseRequest::new("Q", 1, 2, vec![2])).expect("lease");
    prefill.cancel(&zero);
    wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!(
        prefill.parent_status("Q").expect("tracked").children,
        vec![ChildState::Released, ChildState::Pending]
    );
    let _again = prefill.lease(LeaseRequest::new("Q", 0, 2, vec![3])).expect("re-lease");
    assert_eq!(prefill.parent_status("Q").expect("tracked").children, vec![ChildState::Pending; 2]);
}

/// Bug 3: the tracker allocated one slot per child for any `n` before the lease was even
/// checked (4 GiB for `u32::MAX`). `n` is now bounded (default 1024).
#[test]
fn a_huge_fan_out_is_refused_before_anything_is_allocated() {
    let prefill = prefill(16, Duration::from_secs(30));
    let err = prefill.lease(LeaseRequest::new("H", 0, 1 << 24, vec![1])).expect_err("n too large");
    assert!(err.to_string().contains("1024"), "{err}");
    assert!(prefill.parent_status("H").is_none());
    assert_eq!(prefill.stats().leases.leased, 0);
}

/// Pins were swept only when the connection sat idle, so a peer that always had a frame
/// queued kept its pins forever. They are swept on every loop iteration now.
#[cfg(feature = "ucx")]
#[test]
fn pins_expire_even_when_a_frame_is_always_queued() {
    use std::io::{Read, Write};
    let mut config = one_sided(AgentConfig::new("prefill"));
    config.limits.pin_timeout = Duration::from_millis(200);
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let result = prefill.lease_parent("S", vec![vec![1, 2]], 1, None).expect("lease");
    let child = result.children()[0].clone();
    let mut s = std::net::TcpStream::connect(prefill.local_addr()).expect("connect");
    s.write_all(&frame_bytes(v1::FrameType::Hello, &raw_hello(&layout, "raw"))).expect("hello");
    let pin = v1::ReadRequest {
        seq: 1,
        remote_request_id: child.remote_request_id().into(),
        lease_token: child.token().as_bytes().to_vec(),
        ranges: vec![v1::BlockRange { start: 1, count: 2 }],
        pin_crc32c: false,
        group: 0,
        head_slice: None,
    };
    s.write_all(&frame_bytes(v1::FrameType::Pin, &pin)).expect("pin");
    // Drain every answer on another thread; the pin must have been granted.
    let mut r = s.try_clone().expect("clone");
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        let mut total = Vec::new();
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            if total.len() < 4096 {
                total.extend_from_slice(&buf[..n]);
            }
        }
        total
    });
    eventually("the pin is granted", || prefill.stats().server.pins_open == 1);
    // Heartbeats back to back, so the server never finds its socket empty, for at most 5 s.
    let batch: Vec<u8> = (0..256)
        .flat_map(|_| frame_bytes(v1::FrameType::Heartbeat, &v1::Heartbeat { leases: vec![] }))
        .collect();
    let started = std::time::Instant::now();
    while prefill.stats().server.pins_expired == 0 && started.elapsed() < Duration::from_secs(5) {
        s.write_all(&batch).expect("heartbeats");
    }
    let stats = prefill.stats().server;
    s.shutdown(std::net::Shutdown::Both).expect("shutdown");
    let answers = drain.join().expect("drain");
    // The hello's answer first, then the pin's.
    let hello_len = u32::from_be_bytes([answers[0], answers[1], answers[2], answers[3]]) as usize;
    assert_eq!(answers[4], v1::FrameType::HelloAck as u8);
    assert_eq!(answers[4 + hello_len + 4], v1::FrameType::PinAck as u8, "the pin was granted");
    assert_eq!(stats.pins_expired, 1, "the pin outlived its timeout while frames kept arriving: {stats:?}");
}

/// Endings survive a lost reply, on the wire: a retried notify, cancel or heartbeat with the
/// token of an ended lease is answered "already ..." and changes nothing; without the token
/// an ended lease is told exactly what an unknown id is told.
#[test]
fn retries_of_an_ended_lease_are_answered_already_ended_on_the_wire() {
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(AgentConfig::new("prefill"), layout.clone());
    let pulled = prefill.lease(LeaseRequest::new("A", 0, 1, vec![1])).expect("lease");
    let released = prefill.lease(LeaseRequest::new("B", 0, 1, vec![2])).expect("lease");
    let addr = prefill.local_addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let mut c = kvxfer_tcp::Connection::connect(&addr, &raw_hello(&layout, "raw"), Default::default())
            .await
            .expect("connect");
        let (a, ta) = (pulled.remote_request_id(), pulled.token().as_bytes());
        let (b, tb) = (released.remote_request_id(), released.token().as_bytes());
        let outcome = |o: i32| v1::LeaseOutcome::try_from(o).expect("known outcome");
        assert_eq!(outcome(c.notify(a, ta, "d0").await.expect("ack").outcome), v1::LeaseOutcome::Pulled);
        assert_eq!(c.cancel(b, tb).await.expect("ack"), v1::LeaseOutcome::Released);
        // The first answers were "lost": the retries learn what happened.
        assert_eq!(
            outcome(c.notify(a, ta, "d0").await.expect("ack").outcome),
            v1::LeaseOutcome::AlreadyPulled
        );
        assert_eq!(c.cancel(a, ta).await.expect("ack"), v1::LeaseOutcome::AlreadyPulled);
        assert_eq!(c.cancel(b, tb).await.expect("ack"), v1::LeaseOutcome::AlreadyReleased);
        let refs =
            |id: &str, t: &[u8]| v1::LeaseRef { remote_request_id: id.into(), lease_token: t.to_vec() };
        let hb = c
            .heartbeat(vec![refs(a, ta), refs(b, tb), refs(a, &[0; 16]), refs("nope", ta)])
            .await
            .expect("hb");
        assert_eq!(
            hb,
            vec![
                v1::LeaseOutcome::AlreadyPulled,
                v1::LeaseOutcome::AlreadyReleased,
                v1::LeaseOutcome::Unrecognized,
                v1::LeaseOutcome::Unrecognized
            ]
        );
        // Wrong token and unknown id: the same answer for notify, cancel and reads too.
        assert_eq!(
            outcome(c.notify(a, &[0; 16], "d0").await.expect("ack").outcome),
            v1::LeaseOutcome::Unrecognized
        );
        assert_eq!(c.cancel(b, &[0; 16]).await.expect("ack"), v1::LeaseOutcome::Unrecognized);
        let dest = kvxfer::KvMemory::alloc(layout.clone()).expect("alloc");
        let mut messages = Vec::new();
        for (id, tok) in [(a, &[0u8; 16][..]), ("nope", ta)] {
            // SAFETY: `dest` is this test's own memory; local block 0 is in its layout.
            match unsafe { c.read_into(id, tok, &runs(&[(1, 1)]), &dest) }.await {
                Err(kvxfer_tcp::ClientError::Refused { code, message, .. }) => {
                    assert_eq!(code, v1::ErrorCode::UnknownLease);
                    messages.push(message.replace(id, "<id>"));
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(messages[0], messages[1], "the messages do not tell them apart either");
    });
    // One end each, however many retries.
    assert_eq!(wait_ends(&prefill, 2, Duration::from_secs(5)).len(), 2);
    assert_no_more_ends(&prefill, Duration::from_millis(100));
    let s = prefill.stats().leases;
    // 5 answered from the records; the prefill side still tells wrong tokens from unknown ids.
    assert_eq!(
        (s.pulled, s.released, s.already_ended, s.bad_token, s.unrecognized),
        (1, 1, 5, 4, 1),
        "{s:?}"
    );
}

/// `AgentConfig::max_lease_lifetime` reaches the lease table: a longer ttl is clamped.
#[test]
fn the_maximum_lease_lifetime_clamps_the_ttl() {
    let config = AgentConfig::new("prefill").max_lease_lifetime(Duration::from_secs(5)).max_children(4);
    let prefill = prefill_with(config, BlockLayout::single(16, BLOCK).expect("layout"));
    let h =
        prefill.lease(LeaseRequest::new("M", 0, 1, vec![1]).ttl(Duration::from_secs(3600))).expect("lease");
    assert_eq!(h.ttl(), Duration::from_secs(5));
    assert!(prefill.lease(LeaseRequest::new("N", 0, 5, vec![1])).is_err(), "n above max_children");
}

/// Arbitrary ranges, read and pinned (with and without the pin's CRC), through a real
/// server: each is served exactly when it is valid, refused cleanly (BLOCK_OUT_OF_RANGE)
/// otherwise, and the connection and the agent keep serving throughout.
#[test]
fn arbitrary_read_and_pin_ranges_through_a_real_server() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    const LEASED: std::ops::Range<u32> = 4..12;
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(one_sided(AgentConfig::new("prefill")), layout.clone());
    // Pins only where the agent offers UCX (a TCP-only agent refuses them all).
    let hows = if cfg!(feature = "ucx") { 3 } else { 1 };
    let result = prefill.lease_parent("F", vec![LEASED.collect()], 1, None).expect("lease");
    let child = result.children()[0].clone();
    let dest = kvxfer::KvMemory::alloc(BlockLayout::single(64, BLOCK).expect("layout")).expect("alloc");
    let addr = prefill.local_addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    // TestRunner::run takes a `Fn`: the connection and tallies live in cells.
    let conn = std::cell::RefCell::new(rt.block_on(async {
        kvxfer_tcp::Connection::connect(&addr, &raw_hello(&layout, "raw"), Default::default())
            .await
            .expect("connect")
    }));
    // Biased towards the lease's blocks so that valid requests are common too.
    let start = prop_oneof![
        4 => LEASED,
        1 => 0u32..20,
        1 => 990u32..1010,
        1 => (u32::MAX - 8)..=u32::MAX,
        1 => any::<u32>()
    ];
    let count =
        prop_oneof![4 => 1u32..4, 1 => 0u32..5, 1 => 5u32..20, 1 => Just(u32::MAX), 1 => any::<u32>()];
    let ranges = proptest::collection::vec((start, count), 0..4);
    let mut runner = TestRunner::new(Config { cases: 300, failure_persistence: None, ..Config::default() });
    let (served, refused) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0u32));
    runner
        .run(&(ranges, 0u8..hows), |(ranges, how)| {
            let mut c = conn.borrow_mut();
            let runs: Vec<BlockRun> = ranges
                .iter()
                .map(|&(remote_start, count)| BlockRun { remote_start, local_start: 0, count })
                .collect();
            let total: u64 = ranges.iter().map(|&(_, n)| u64::from(n)).sum();
            let valid = !ranges.is_empty()
                && ranges.iter().all(|&(s, n)| {
                    n > 0
                        && u64::from(s) >= u64::from(LEASED.start)
                        && u64::from(s) + u64::from(n) <= u64::from(LEASED.end)
                })
                && total <= u64::from(LEASED.end - LEASED.start);
            let (id, tok) = (child.remote_request_id(), child.token().as_bytes());
            let outcome = rt.block_on(async {
                if how == 0 {
                    // SAFETY: `dest` is this test's own memory. A read is only answered with
                    // bytes when valid, and then every run is at most 8 blocks at local 0.
                    unsafe { c.read_into(id, tok, &runs, &dest) }.await.map(|_| ())
                } else {
                    let grant = c.pin(id, tok, &runs, how == 2).await?;
                    let held = c.unpin(grant.seq, true).await?;
                    assert!(held, "a fresh pin is held");
                    Ok(())
                }
            });
            match outcome {
                Ok(()) => {
                    prop_assert!(valid, "served an invalid request {ranges:?}");
                    served.set(served.get() + 1);
                }
                Err(kvxfer_tcp::ClientError::Refused { code, .. }) => {
                    prop_assert!(!valid, "refused a valid request {ranges:?}");
                    prop_assert_eq!(code, v1::ErrorCode::BlockOutOfRange);
                    refused.set(refused.get() + 1);
                }
                Err(e) => prop_assert!(false, "{ranges:?}: the connection broke: {e}"),
            }
            Ok(())
        })
        .expect("every range is served or refused cleanly");
    let (served, refused) = (served.get(), refused.get());
    assert!(served > 0 && refused > 0, "served {served}, refused {refused}");
    eprintln!("arbitrary ranges: {served} served, {refused} refused");
    let s = prefill.stats();
    assert_eq!(s.server.protocol_errors, 0);
    assert_eq!(s.leases.live, 1, "the lease is untouched");
    drop(conn);
    // And the agent still serves a new connection.
    rt.block_on(async {
        let mut c = kvxfer_tcp::Connection::connect(&addr, &raw_hello(&layout, "raw"), Default::default())
            .await
            .expect("connect");
        let (id, tok) = (child.remote_request_id(), child.token().as_bytes());
        // SAFETY: as above.
        unsafe { c.read_into(id, tok, &runs(&[(4, 8)]), &dest) }.await.expect("read");
    });
}

/// A large one-sided read gets the time it needs: the prefill side holds a pin for
/// `pin_timeout + bytes / min_transfer_rate` and says so in the grant. Before, a pin was
/// held `pin_timeout` whatever its size, so a read longer than that always failed
/// `held = false` — here (pin_timeout ~0) every read did.
#[cfg(feature = "ucx")]
#[test]
fn a_large_one_sided_read_is_held_long_enough() {
    let mut config = Transport::UcxShm.config(AgentConfig::new("prefill").io_timeout(Duration::from_secs(5)));
    config.limits.pin_timeout = Duration::from_nanos(1);
    config.limits.min_transfer_rate = 2 << 20; // 16 MiB: held 8 s
    let layout = BlockLayout::single(256, 64 * 1024).expect("layout");
    let prefill = prefill_with(config, layout.clone());
    let decode = decode_with(
        Transport::UcxShm.config(AgentConfig::new("decode").io_timeout(Duration::from_secs(5))),
        layout,
    );
    let blocks: Vec<kvxfer::BlockId> = (0..256).collect();
    let result = prefill.lease_parent("X", vec![blocks.clone()], 1, None).expect("lease");
    let report = decode.submit(result, vec![blocks.clone()]).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
    assert!(verify(&decode, &blocks, &blocks));
    assert_eq!(prefill.stats().server.pins_expired, 0);
}

fn first_frame_type(s: &mut std::net::TcpStream) -> u8 {
    use std::io::Read;
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut h = [0u8; 5];
    s.read_exact(&mut h).expect("a frame");
    let mut body = vec![0u8; u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize - 1];
    s.read_exact(&mut body).expect("its body");
    h[4]
}

/// (Here rather than in limits.rs: its 64 MiB would disturb the flood test's peak-RSS
/// measurement there.) A reader that takes a little of the payload often enough to beat the progress timeout
/// cannot hold a read (and its lease's blocks) for ever: the payload must move within
/// `io_timeout + bytes / min_transfer_rate`.
#[test]
fn a_trickling_reader_is_cut_off_at_the_overall_deadline() {
    use std::io::{Read, Write};
    let mut config = AgentConfig::new("prefill").io_timeout(Duration::from_secs(2));
    config.limits.min_transfer_rate = 256 << 20;
    // 64 MiB: far more than the socket buffers hold, so the writer must wait on the reader.
    let layout = BlockLayout::single(1024, 64 * 1024).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let result = prefill.lease_parent("T", vec![(0..1024).collect()], 1, None).expect("lease");
    let child = &result.children()[0];
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let mut s = rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("small receive buffer");
        let s = socket.connect(prefill.local_addr()).await.expect("connect").into_std().expect("std");
        s.set_nonblocking(false).expect("blocking");
        s
    });
    s.write_all(&frame_bytes(v1::FrameType::Hello, &raw_hello(&layout, "raw"))).expect("hello");
    assert_eq!(first_frame_type(&mut s), v1::FrameType::HelloAck as u8);
    let read = v1::ReadRequest {
        seq: 1,
        remote_request_id: child.remote_request_id().into(),
        lease_token: child.token().as_bytes().to_vec(),
        ranges: vec![v1::BlockRange { start: 0, count: 1024 }],
        pin_crc32c: false,
        group: 0,
        head_slice: None,
    };
    s.write_all(&frame_bytes(v1::FrameType::ReadRequest, &read)).expect("read request");
    s.set_read_timeout(Some(Duration::from_secs(3))).expect("read timeout");
    // 64 KiB every 5 ms (about 12 MiB/s): the writer makes progress well within the 2 s
    // timeout, but the whole payload takes about 5 s, past its 2.25 s deadline. Give up
    // after 10 s.
    let started = std::time::Instant::now();
    let mut got = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    let cut_off = loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break true,
            Ok(n) => got += n,
        }
        if started.elapsed() > Duration::from_secs(10) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(cut_off, "the trickling reader still held its read after 10 s ({got} bytes)");
    assert!(got < 64 << 20, "the whole payload arrived ({got} bytes in {:?})", started.elapsed());
    eventually("the slow transfer is counted", || prefill.stats().server.slow_transfers == 1);
}

/// Review finding 6 (c): a child leased with another `n` than its parent's live leases was
/// silently left untracked; the agent refuses it, naming both values.
#[test]
fn a_child_leased_with_another_n_than_its_siblings_is_refused() {
    let prefill =
        prefill_unkeyed(AgentConfig::new("prefill"), BlockLayout::single(16, BLOCK).expect("layout"));
    prefill.lease_parent("P", vec![vec![1], vec![2]], 1, None).expect("n = 2");
    let e = prefill.lease(LeaseRequest::new("P", 0, 3, vec![3])).expect_err("n = 3 for a parent of 2");
    assert!(e.to_string().contains("n = 3") && e.to_string().contains("n = 2"), "{e}");
    assert_eq!(prefill.stats().leases.live, 2, "nothing leased");
}

/// A blocking socket to `addr` whose receive buffer is as small as the kernel allows (so a
/// peer that never reads fills it fast).
#[cfg(feature = "ucx")]
fn small_window_socket(addr: std::net::SocketAddr) -> std::net::TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("small receive buffer");
        let s = socket.connect(addr).await.expect("connect").into_std().expect("std");
        s.set_nonblocking(false).expect("blocking");
        s
    })
}

/// Review 10 finding 2: the server's replies (to pins, notifies, heartbeats, cancels, unpins
/// and refused reads) were written with no timeout, so a peer that pins, then keeps sending
/// frames but never reads, blocked its connection task for ever once the socket buffers
/// filled: its pin was never swept, its lease's blocks never handed back. Every reply write
/// is bounded by the io timeout now (the connection is reset and counted). Both kinds of
/// reply: the loop's (a pin refused past `max_inflight_reads`) and a refused read's.
#[cfg(feature = "ucx")]
#[test]
fn a_peer_that_never_reads_its_replies_loses_its_pins_and_connection() {
    use std::io::Write;
    for refused_reads in [false, true] {
        // No arm wait: the reads of an unknown id must be refused (and their replies pile up)
        // at once, not after waiting for an arm.
        let mut config = one_sided(
            AgentConfig::new("prefill").io_timeout(Duration::from_millis(500)).arm_wait(Duration::ZERO),
        );
        config.limits.max_inflight_reads = 1;
        config.limits.pin_timeout = Duration::from_millis(200);
        let layout = BlockLayout::single(16, BLOCK).expect("layout");
        let prefill = prefill_unkeyed(config, layout.clone());
        let result = prefill.lease_parent("W", vec![vec![1, 2]], 1, None).expect("lease");
        let child = result.children()[0].clone();
        let mut s = small_window_socket(prefill.local_addr());
        s.write_all(&frame_bytes(v1::FrameType::Hello, &raw_hello(&layout, "raw"))).expect("hello");
        let pin = |seq: u64, id: &str| v1::ReadRequest {
            seq,
            remote_request_id: id.into(),
            lease_token: child.token().as_bytes().to_vec(),
            ranges: vec![v1::BlockRange { start: 1, count: 2 }],
            pin_crc32c: false,
            group: 0,
            head_slice: None,
        };
        s.write_all(&frame_bytes(v1::FrameType::Pin, &pin(1, child.remote_request_id()))).expect("pin");
        eventually("the pin is granted", || prefill.stats().server.pins_open == 1);
        // Requests whose answers are larger than themselves, never read: more pins (refused,
        // one open at most), or reads of an unknown id (refused, naming the id).
        let flood: Vec<u8> = if refused_reads {
            let long_id = "u".repeat(8 * 1024);
            (2..66).flat_map(|seq| frame_bytes(v1::FrameType::ReadRequest, &pin(seq, &long_id))).collect()
        } else {
            (2..2050).flat_map(|seq| frame_bytes(v1::FrameType::Pin, &pin(seq, "W"))).collect()
        };
        s.set_write_timeout(Some(Duration::from_millis(300))).expect("write timeout");
        // Until both directions are full (the write times out) or the server gives up on us.
        let started = std::time::Instant::now();
        while s.write_all(&flood).is_ok() {
            assert!(started.elapsed() < Duration::from_secs(60), "the socket buffers never filled");
        }
        // The server's reply write times out: the connection (and its pin) is gone.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while prefill.stats().server.pins_open != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "refused reads {refused_reads}: the pin outlived its connection's stalled reply: {:?}",
                prefill.stats().server
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(prefill.stats().server.slow_transfers >= 1, "{:?}", prefill.stats().server);
        // Nothing holds the lease's blocks any more: released now, they are handed back.
        assert_eq!(prefill.cancel(&child), kvxfer_core::CancelOutcome::Released);
        let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
        assert_eq!(ends[0].kind, kvxfer::EndKind::Released);
        assert_eq!(prefill.stats().leases.draining, 0);
    }
}

/// Review 10 finding 4: a pin was held `pin_timeout + bytes / min_transfer_rate` whatever the
/// lease's maximum lifetime, so pins (and long TCP reads) kept a lease's blocks far past
/// `max_lease_lifetime`. A pin's hold is capped at the lease's hard deadline plus the io
/// timeout now, and the holder is told.
#[cfg(feature = "ucx")]
#[test]
fn a_pin_never_holds_a_lease_past_its_maximum_lifetime() {
    let io = Duration::from_millis(300);
    let max_life = Duration::from_millis(700);
    let config = one_sided(AgentConfig::new("prefill").io_timeout(io).max_lease_lifetime(max_life));
    // pin_timeout stays at its default (60 s).
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let result = prefill.lease_parent("L", vec![vec![1, 2, 3]], 1, None).expect("lease");
    let child = &result.children()[0];
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let addr = prefill.local_addr().to_string();
        let mut c = kvxfer_tcp::Connection::connect(&addr, &raw_hello(&layout, "raw"), Default::default())
            .await
            .expect("connect");
        let grant = c
            .pin(child.remote_request_id(), child.token().as_bytes(), &runs(&[(1, 3)]), false)
            .await
            .expect("pin");
        assert!(
            grant.held_for <= max_life + io,
            "held for {:?}, past the lease's maximum lifetime",
            grant.held_for
        );
        // Never unpinned, never heartbeated: the pin goes at the cap, and the lease (expired at
        // its deadline, draining while pinned) is handed back.
        let ends = wait_ends(&prefill, 1, Duration::from_secs(10));
        assert_eq!(ends[0].kind, kvxfer::EndKind::Expired);
        let s = prefill.stats();
        assert_eq!((s.server.pins_open, s.server.pins_expired, s.leases.draining), (0, 1, 0), "{s:?}");
        drop(c);
    });
}

/// Review 10 finding 4, TCP reads: a read's payload may take `io_timeout + bytes /
/// min_transfer_rate`, which a slow transfer rate makes far longer than the lease may live;
/// the read's deadline is capped at the lease's hard deadline plus the io timeout.
#[test]
fn a_tcp_read_never_holds_a_lease_past_its_maximum_lifetime() {
    use std::io::{Read, Write};
    let mut config = AgentConfig::new("prefill")
        .io_timeout(Duration::from_secs(2))
        .max_lease_lifetime(Duration::from_secs(1));
    // 1 KiB/s: without the cap the 64 MiB read below would be allowed 18 hours.
    config.limits.min_transfer_rate = 1024;
    let layout = BlockLayout::single(1024, 64 * 1024).expect("layout");
    let prefill = prefill_unkeyed(config, layout.clone());
    let result = prefill.lease_parent("T", vec![(0..1024).collect()], 1, None).expect("lease");
    let child = &result.children()[0];
    let mut s = std::net::TcpStream::connect(prefill.local_addr()).expect("connect");
    s.write_all(&frame_bytes(v1::FrameType::Hello, &raw_hello(&layout, "raw"))).expect("hello");
    assert_eq!(first_frame_type(&mut s), v1::FrameType::HelloAck as u8);
    let read = v1::ReadRequest {
        seq: 1,
        remote_request_id: child.remote_request_id().into(),
        lease_token: child.token().as_bytes().to_vec(),
        ranges: vec![v1::BlockRange { start: 0, count: 1024 }],
        pin_crc32c: false,
        group: 0,
        head_slice: None,
    };
    s.write_all(&frame_bytes(v1::FrameType::ReadRequest, &read)).expect("read request");
    s.set_read_timeout(Some(Duration::from_secs(3))).expect("read timeout");
    // At most 64 KiB every 8 ms (about 8 MiB/s): fast enough for every progress timeout, but
    // the whole payload takes about 8 s, past the lease's 1 s life (+ the 2 s io timeout).
    // Give up after 20 s.
    let started = std::time::Instant::now();
    let mut got = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    let cut_off = loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break true,
            Ok(n) => got += n,
        }
        if started.elapsed() > Duration::from_secs(20) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(8));
    };
    eprintln!("cut off: {cut_off} after {got} bytes in {:?}", started.elapsed());
    assert!(cut_off, "the reader still held its read after 20 s ({got} bytes)");
    assert!(got < 64 << 20, "the whole payload arrived ({got} bytes in {:?})", started.elapsed());
    eventually("the cut-off read is counted", || prefill.stats().server.slow_transfers == 1);
    let ends = wait_ends(&prefill, 1, Duration::from_secs(5));
    assert_eq!(ends[0].kind, kvxfer::EndKind::Expired);
}
