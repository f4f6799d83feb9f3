//! Lease table throughput: lease + notify pairs on one and two threads, and the cost of
//! expiring one lease with 1k vs 100k unexpired leases live (it must not grow).
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvxfer_bench::bench_table;
use kvxfer_core::{LeaseRequest, NotifyOutcome};

fn pairs(table: &kvxfer_core::LeaseTable, prefix: &str, iters: u64, now: Instant) {
    for i in 0..iters {
        let h = table
            .lease(LeaseRequest::new(format!("{prefix}{i}"), 0, 1, vec![(i % 1024) as u32, 7]), now)
            .expect("lease");
        let out = table.notify(h.remote_request_id(), h.token().as_bytes(), "decode-0", now);
        debug_assert_eq!(out, NotifyOutcome::Pulled);
        black_box(out);
        if i % 64 == 0 {
            for e in table.ended().try_iter() {
                black_box(e);
            }
        }
    }
    for e in table.ended().try_iter() {
        black_box(e);
    }
}

fn lease_notify(c: &mut Criterion) {
    let mut g = c.benchmark_group("lease_notify");
    g.throughput(Throughput::Elements(1));
    g.bench_function("1_thread", |b| {
        let table = bench_table(1024);
        let now = Instant::now();
        let mut round = 0u64;
        b.iter_custom(|iters| {
            round += 1;
            let start = Instant::now();
            pairs(&table, &format!("r{round}-"), iters, now);
            start.elapsed()
        });
    });
    g.bench_function("2_threads", |b| {
        let table = Arc::new(bench_table(1024));
        let now = Instant::now();
        let mut round = 0u64;
        b.iter_custom(|iters| {
            round += 1;
            let start = Instant::now();
            std::thread::scope(|s| {
                for t in 0..2 {
                    let table = &table;
                    s.spawn(move || pairs(table, &format!("r{round}-t{t}-"), iters / 2, now));
                }
            });
            start.elapsed()
        });
    });
    g.finish();
}

fn expire_one_among_live(c: &mut Criterion) {
    let mut g = c.benchmark_group("expire_one");
    for live in [1_000u32, 100_000] {
        let table = bench_table(1024);
        let t0 = Instant::now();
        for i in 0..live {
            table
                .lease(
                    LeaseRequest::new(format!("live{i}"), 0, 1, vec![i % 1024])
                        .ttl(Duration::from_secs(3600)),
                    t0,
                )
                .expect("lease");
        }
        g.bench_with_input(BenchmarkId::new("live", live), &live, |b, _| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                // One short lease that expires, among `live` that do not.
                let now = t0 + Duration::from_millis(i);
                table
                    .lease(
                        LeaseRequest::new(format!("short{i}"), 0, 1, vec![1]).ttl(Duration::from_nanos(1)),
                        now,
                    )
                    .expect("lease");
                let n = table.expire(now + Duration::from_nanos(1));
                assert_eq!(n, 1);
                black_box(table.ended().try_recv().ok());
            });
        });
    }
    g.finish();
}

criterion_group!(benches, lease_notify, expire_one_among_live);
criterion_main!(benches);
