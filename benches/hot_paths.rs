//! The other hot pure parts: transfer-plan coalescing, the frame codec (and the buffered
//! frame reader against two reads per frame), and the payload
//! checksum (CRC-32C) both sides compute for every read; and one whole hand-off of a 64 KiB
//! block over TCP on 127.0.0.1 (lease, pull, notify with the read).
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvxfer_core::plan::{coalesce, ResultPlan};
use kvxfer_proto::v1;
use kvxfer_tcp::frame::{decode_all, read_frame, Frame, FrameReader};

fn plans(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    // 1024 blocks per child, contiguous in runs of 16 on both sides.
    let remote: Vec<u32> = (0..1024u32).map(|i| (i / 16) * 32 + i % 16).collect();
    let local: Vec<u32> = (0..1024u32).map(|i| (i / 16) * 40 + i % 16).collect();
    g.throughput(Throughput::Elements(1024));
    g.bench_function("coalesce_1024_blocks", |b| {
        b.iter(|| black_box(coalesce(black_box(&remote), black_box(&local), 1 << 20, 1 << 20)))
    });
    let shared: Vec<u32> = (0..1024).collect();
    let locals: Vec<Vec<u32>> = (0..8u32).map(|c| (c * 1024..(c + 1) * 1024).collect()).collect();
    let children: Vec<(&[u32], &[u32])> = locals.iter().map(|l| (shared.as_slice(), l.as_slice())).collect();
    g.throughput(Throughput::Elements(8 * 1024));
    g.bench_function("result_plan_8_children_shared_prompt", |b| {
        b.iter(|| black_box(ResultPlan::build(black_box(&children), 1 << 20, 1 << 20)))
    });
    g.finish();
}

fn frames(c: &mut Criterion) {
    let mut g = c.benchmark_group("frame");
    let req = Frame::ReadRequest(v1::ReadRequest {
        seq: 42,
        remote_request_id: "3_cmpl-b9d6c33a-482061a8-551f-4964-925d-fc0925e9261b-0".into(),
        lease_token: vec![7; 16],
        ranges: (0..64).map(|i| v1::BlockRange { start: i * 32, count: 16 }).collect(),
        ..Default::default()
    });
    let mut buf = Vec::new();
    g.bench_function("encode_read_request_64_ranges", |b| {
        b.iter(|| {
            buf.clear();
            black_box(&req).encode(&mut buf);
            black_box(buf.len())
        })
    });
    let mut encoded = Vec::new();
    req.encode(&mut encoded);
    g.throughput(Throughput::Bytes(encoded.len() as u64));
    g.bench_function("decode_read_request_64_ranges", |b| {
        b.iter(|| black_box(decode_all(black_box(&encoded), 1 << 20)))
    });
    // 64 notifies arriving together (what a pipelined decode side sends): the buffered
    // reader against a header read and a body read per frame, over the same bytes in memory
    // (no system calls on either side, so this is the framing's CPU; the syscalls saved are
    // in BENCHMARKING.md).
    let mut notifies = Vec::new();
    for i in 0..64 {
        Frame::Notify(v1::Notify {
            remote_request_id: format!("{i}_cmpl-b9d6c33a-482061a8-551f-4964-925d-fc0925e9261b-0"),
            lease_token: vec![7; 16],
            consumer_id: "decode-0/0".into(),
        })
        .encode(&mut notifies);
    }
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    g.throughput(Throughput::Elements(64));
    g.bench_function("reader_64_notifies_buffered", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let (mut src, mut reader) = (black_box(&notifies[..]), FrameReader::new());
                for _ in 0..64 {
                    black_box(reader.read_frame(&mut src, 1 << 20).await.expect("frame"));
                }
            })
        })
    });
    g.bench_function("reader_64_notifies_two_reads_each", |b| {
        let mut body = Vec::new();
        b.iter(|| {
            runtime.block_on(async {
                let mut src = black_box(&notifies[..]);
                for _ in 0..64 {
                    black_box(read_frame(&mut src, 1 << 20, &mut body).await.expect("frame"));
                }
            })
        })
    });
    g.finish();
}

fn checksum(c: &mut Criterion) {
    let mut g = c.benchmark_group("checksum");
    for size in [64 * 1024usize, 2 << 20] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        g.throughput(Throughput::Bytes(size as u64));
        // The crc32c crate (SSE 4.2 `crc32` loop), which the TCP check used before, and the
        // folding implementation it uses now (kvxfer_mem::crc32c_append, crc-fast).
        g.bench_function(format!("crc32c_{}KiB", size / 1024), |b| {
            b.iter(|| black_box(crc32c::crc32c(black_box(&data))))
        });
        g.bench_function(format!("crc32c_fast_{}KiB", size / 1024), |b| {
            b.iter(|| black_box(kvxfer_mem::crc32c_append(0, black_box(&data))))
        });
    }
    g.finish();
}

/// One-block hand-offs between a prefill and a decode agent of this process (blocking
/// facades, one runtime thread each, the notify sent with the read): lease a 64 KiB block,
/// pull it, wait for the report.
fn handoff(c: &mut Criterion) {
    use kvxfer::blocking::{DecodeAgent, PrefillAgent};
    use kvxfer::{AgentConfig, BlockLayout, KvMemory, TransportChoice};
    let mut g = c.benchmark_group("handoff");
    let layout = BlockLayout::single(4, 64 * 1024).expect("layout");
    let one_thread = |name: &str| AgentConfig::new(name).transport(TransportChoice::Tcp).worker_threads(1);
    let memory = || KvMemory::alloc(layout.clone()).expect("memory");
    let prefill = PrefillAgent::start(one_thread("prefill"), "127.0.0.1:0", memory()).expect("prefill");
    let decode = DecodeAgent::start(one_thread("decode").notify_with_read(true), memory()).expect("decode");
    let mut k = 0u64;
    g.throughput(Throughput::Bytes(64 * 1024));
    g.bench_function("one_block_64KiB", |b| {
        b.iter(|| {
            k += 1;
            let result = prefill.lease_parent(&format!("h{k}"), vec![vec![1]], 1, None).expect("lease");
            let report = decode.submit(result, vec![vec![2]]).expect("submit").wait();
            assert!(report.all_done(), "{report:?}");
        })
    });
    g.finish();
}

criterion_group!(benches, plans, frames, checksum, handoff);
criterion_main!(benches);
