//! Lease table throughput: lease + notify pairs on one and two threads; and the cost of each
//! table operation with 1k, 100k and 1M unrelated leases live (it must not grow with them):
//! lease + notify, expiring one lease, the expiry driver's `poll_timeout` and its `expire`
//! with nothing due, a lookup (`knows`) of any live lease and of one of a hot 1000, a
//! heartbeat of any live lease, and the prefill agent's parent tracker (admit + leased +
//! on_end) with as many live parents.
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvxfer_bench::bench_table;
use kvxfer_core::{EndKind, LeaseEnd, LeaseRequest, NotifyOutcome, ParentTracker};

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

/// Live-lease counts the per-operation benches run at.
const LIVE: [u32; 3] = [1_000, 100_000, 1_000_000];

/// A table holding `live` leases of one block each that do not expire within the bench (a
/// ttl of an hour, clamped to the ten-minute maximum lifetime), and the id and token of each.
fn table_with_live(live: u32, t0: Instant) -> (kvxfer_core::LeaseTable, Vec<(String, [u8; 16])>) {
    let table = bench_table(1024);
    let held = (0..live)
        .map(|i| {
            let h = table
                .lease(
                    LeaseRequest::new(format!("live{i}"), 0, 1, vec![i % 1024])
                        .ttl(Duration::from_secs(3600)),
                    t0,
                )
                .expect("lease");
            (h.remote_request_id().to_owned(), *h.token().as_bytes())
        })
        .collect();
    (table, held)
}

/// An index into `len` items that jumps around (a live lease picked anywhere in the table,
/// so lookups pay the cache misses of a large table).
fn scatter(i: u64, len: usize) -> usize {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16) as usize % len
}

fn with_live_leases(c: &mut Criterion) {
    let mut g = c.benchmark_group("with_live");
    g.sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for live in LIVE {
        let t0 = Instant::now();
        let (table, held) = table_with_live(live, t0);
        // Every operation below happens within a minute of t0: no live lease is due.
        g.bench_with_input(BenchmarkId::new("lease_notify", live), &live, |b, _| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                let now = t0 + Duration::from_micros(i);
                let h =
                    table.lease(LeaseRequest::new(format!("pair{i}"), 0, 1, vec![7]), now).expect("lease");
                let out = table.notify(h.remote_request_id(), h.token().as_bytes(), "decode-0", now);
                debug_assert_eq!(out, NotifyOutcome::Pulled);
                black_box(table.ended().try_recv().ok());
            });
        });
        g.bench_with_input(BenchmarkId::new("expire_one", live), &live, |b, _| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                // One short lease that expires, among `live` that do not.
                let now = t0 + Duration::from_micros(i);
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
        g.bench_with_input(BenchmarkId::new("poll_timeout", live), &live, |b, _| {
            b.iter(|| black_box(table.poll_timeout()));
        });
        g.bench_with_input(BenchmarkId::new("expire_nothing_due", live), &live, |b, _| {
            let now = t0 + Duration::from_secs(1);
            b.iter(|| assert_eq!(table.expire(black_box(now)), 0));
        });
        g.bench_with_input(BenchmarkId::new("lookup_any", live), &live, |b, _| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                let (id, token) = &held[scatter(i, held.len())];
                assert!(table.knows(id, token));
            });
        });
        // The control: a lease picked among the same 1000 (a working set that stays in the
        // caches) in a table of `live`: what the lookup costs without the cache misses.
        g.bench_with_input(BenchmarkId::new("lookup_hot", live), &live, |b, _| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                let (id, token) = &held[scatter(i, 1000)];
                assert!(table.knows(id, token));
            });
        });
        g.bench_with_input(BenchmarkId::new("heartbeat", live), &live, |b, _| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                let (id, token) = &held[scatter(i, held.len())];
                black_box(table.heartbeat(id, token, t0 + Duration::from_micros(i)));
            });
        });
        assert_eq!(table.stats().live, u64::from(live), "the live leases stayed live");
        drop((table, held));

        // The parent tracker with `live` parents of two children, one child of each live.
        let mut tracker = ParentTracker::new();
        for p in 0..live {
            let parent = format!("live{p}");
            tracker.admit(&parent, 2, t0).expect("admit");
            tracker.leased(&parent, 2, 0, u64::from(p), t0);
        }
        g.bench_with_input(BenchmarkId::new("parent_tracker", live), &live, |b, _| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                let now = t0 + Duration::from_micros(i);
                let parent: Arc<str> = Arc::from(format!("p{i}"));
                tracker.admit(&parent, 1, now).expect("admit");
                tracker.leased(&parent, 1, 0, i, now);
                let end = LeaseEnd {
                    remote_request_id: parent.clone(),
                    parent_request_id: parent,
                    child_index: 0,
                    n: 1,
                    kind: EndKind::Pulled,
                    blocks: Arc::from(vec![1]),
                    other_groups: Arc::from(vec![]),
                    consumers_seen: 1,
                    expected_consumers: 1,
                    generation: i,
                    leased_at: now,
                    ended_at: now,
                };
                assert!(tracker.on_end(&end, now).is_some(), "the parent completed");
            });
        });
        assert_eq!(tracker.len(), live as usize);
    }
    g.finish();
}

criterion_group!(benches, lease_notify, with_live_leases);
criterion_main!(benches);
