//! Limits and floods: a connection limit that refuses clearly, and 100,000 bogus
//! notifications that are refused and counted while a legitimate pull completes.

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
    let prefill = prefill_with(config, layout.clone());
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

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

#[test]
fn a_flood_of_bogus_notifications_is_refused_while_a_real_pull_completes() {
    const FLOOD: usize = 100_000;
    const FLOODERS: usize = 4;
    let blocks = 4096u32; // 16 MiB per child at 4 KiB
    let prefill = Transport::Tcp.prefill(4 * blocks, Duration::from_secs(60));
    let decode = Transport::Tcp.decode(4 * blocks);
    let addr = prefill.local_addr().to_string();
    let layout = prefill.memory().layout().clone();
    let victim = prefill.lease_parent("V", vec![vec![0]], 1, None).expect("lease a bystander");
    let remote: Vec<Vec<BlockId>> = (0..4).map(|i| (i * blocks..(i + 1) * blocks).collect()).collect();
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
                let mut c = kvxfer_tcp::Connection::connect(&addr, &hello, kvxfer_tcp::Limits::default())
                    .await
                    .expect("flooder connects");
                let mut refused = 0usize;
                for i in 0..FLOOD / FLOODERS {
                    // Half for ids that were never leased, half with a wrong token for a live one.
                    let (id, token) = if i % 2 == 0 {
                        (format!("{i}_nope"), [1u8; 16])
                    } else {
                        ("V".to_owned(), [2u8; 16])
                    };
                    let ack = c.notify(&id, &token, "flooder").await.expect("ack");
                    if ack.outcome != v1::LeaseOutcome::Pulled as i32
                        && ack.outcome != v1::LeaseOutcome::Counted as i32
                    {
                        refused += 1;
                    }
                }
                refused
            }));
        }
        let mut refused = 0;
        for t in tasks {
            refused += t.await.expect("flooder task");
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
    assert_eq!(refused, FLOOD, "every bogus notification refused");
    let s = prefill.stats().leases;
    assert_eq!(s.unrecognized, (FLOOD / 2) as u64);
    assert_eq!(s.bad_token, (FLOOD / 2) as u64);
    // The bystander's lease was not touched by 50,000 wrong-token notifications.
    assert_eq!(s.live, 1);
    prefill.cancel(&victim.children()[0]);
    let ends = wait_ends(&prefill, 5, Duration::from_secs(5));
    assert_eq!(ends.iter().filter(|e| e.kind == EndKind::Pulled).count(), 4);
    let rss_after = peak_rss_kib();
    eprintln!(
        "flood: {FLOOD} bogus notifications refused in {:.2} s ({:.0}/s); legitimate 64 MiB pull took {:.3} s \
         during the flood; peak RSS {} -> {} KiB",
        flood_time.as_secs_f64(),
        FLOOD as f64 / flood_time.as_secs_f64(),
        pull_time.as_secs_f64(),
        rss_before,
        rss_after
    );
    // Refusals allocate nothing that stays: peak memory grows by far less than the data moved.
    assert!(
        rss_after.saturating_sub(rss_before) < 64 * 1024,
        "peak RSS grew {rss_before} -> {rss_after} KiB"
    );
}
