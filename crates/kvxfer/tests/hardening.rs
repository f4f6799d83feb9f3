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
    let prefill = prefill_with(AgentConfig::new("prefill"), layout.clone());
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
            let p = c.pin(id, tok, &bad, true).await;
            assert_eq!(refusal_code(p.expect_err("refused")), v1::ErrorCode::BlockOutOfRange, "{bad:?}");
        }
        // The same connection still serves a well-formed read.
        // SAFETY: as above.
        let n = unsafe { c.read_into(id, tok, &runs(&[(1, 2)]), &dest) }.await.expect("read");
        assert_eq!(n, 2 * BLOCK);
    });
    eventually("the served read is counted", || prefill.stats().server.reads_served == 1);
    assert_eq!(prefill.stats().server.reads_refused, 6);
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
#[test]
fn pins_expire_even_when_a_frame_is_always_queued() {
    use std::io::{Read, Write};
    let mut config = AgentConfig::new("prefill");
    config.limits.pin_timeout = Duration::from_millis(200);
    let layout = BlockLayout::single(16, BLOCK).expect("layout");
    let prefill = prefill_with(config, layout.clone());
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
