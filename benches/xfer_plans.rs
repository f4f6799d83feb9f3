//! Heterogeneous transfer plans (kvxfer_core::xfer): building one decode rank's plan for a
//! long request, and expanding it into contiguous pieces, for a Llama-70B-like cache
//! (80 layers × K and V, 8 KV heads, head_dim 128, bf16).
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvxfer_core::{GroupSpec, KvHeads, KvShape, KvShapeSpec, SegmentSpec, TransferPair};

const BLOCKS: u32 = 4096;

fn shape(tp_size: u32, tp_rank: u32, block_tokens: u32) -> KvShape {
    KvShape::new(KvShapeSpec {
        tp_size,
        tp_rank,
        heads: KvHeads::Split { total: 8 },
        block_tokens,
        dtype: "bf16".into(),
        dtype_bytes: 2,
        groups: vec![GroupSpec { num_blocks: 1 << 16, segments: vec![SegmentSpec::packed(128); 160] }],
    })
    .expect("valid shape")
}

fn plans(c: &mut Criterion) {
    let mut g = c.benchmark_group("xfer_plan");
    // Remote blocks in runs of 16; local blocks likewise.
    let remote: Vec<u32> = (0..BLOCKS).map(|i| (i / 16) * 32 + i % 16).collect();
    let cases = [
        ("tp1_to_tp2", shape(1, 0, 16), shape(2, 1, 16)),
        ("tp8_to_tp2", shape(8, 0, 16), shape(2, 1, 16)),
        ("tp2_to_tp2_ratio2", shape(2, 0, 16), shape(2, 1, 32)),
    ];
    for (name, prefill, decode) in cases {
        let pair = TransferPair::new(&prefill, &decode).expect("compatible");
        let local_len = BLOCKS.div_ceil(pair.block_ratio());
        let local: Vec<u32> = (0..local_len).map(|i| (i / 16) * 40 + i % 16).collect();
        let groups = [(remote.as_slice(), local.as_slice())];
        g.throughput(Throughput::Elements(u64::from(BLOCKS)));
        g.bench_function(format!("build_{name}_{BLOCKS}_blocks"), |b| {
            b.iter(|| black_box(pair.plan(black_box(&groups)).expect("plan")))
        });
        let plan = pair.plan(&groups).expect("plan");
        g.bench_function(format!("pieces_{name}_{BLOCKS}_blocks"), |b| {
            b.iter(|| black_box(plan.pieces().fold(0u64, |n, p| n + p.len * u64::from(p.blocks))))
        });
    }
    g.finish();
}

criterion_group!(benches, plans);
criterion_main!(benches);
