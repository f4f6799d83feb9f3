//! Arbitrary read and pin ranges against a lease table and registered memory, as the
//! server serves them: `begin_read` must accept exactly the valid requests (every range
//! non-empty, inside the layout and the lease, no more blocks than leased), and for every
//! accepted one the memory layer's chunks (the bytes written for a read, the CRC of a pin)
//! must stay inside the regions and add up to the payload length. The bug it guards: a
//! zero-count range far outside the layout passed every check and panicked in `Region`.
#![no_main]

use std::sync::Arc;
use std::time::Instant;

use kvxfer_core::plan::BlockRange;
use kvxfer_core::{BlockLayout, EngineInfo, LeaseConfig, LeaseRequest, LeaseTable, Segment};
use kvxfer_mem::KvMemory;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    // A small layout: 1..=32 blocks, one or two segments, packed or strided.
    let num_blocks = u32::from(data[0] % 32) + 1;
    let mut segments = vec![Segment::packed(u64::from(data[1] % 16) + 1)];
    if data[2] & 1 == 1 {
        let block_len = u64::from(data[2] >> 4) + 1;
        segments.push(Segment { block_len, stride: block_len + u64::from(data[3] % 8) });
    }
    let layout = BlockLayout::new(num_blocks, segments, "u8", 16).expect("small layouts are valid");
    let mem = KvMemory::alloc(layout.clone()).expect("small memory");
    let engine = EngineInfo { engine_id: "e".into(), host: "127.0.0.1".into(), port: 1, tp_size: 1, incarnation: 0 };
    let table = Arc::new(LeaseTable::new(LeaseConfig::new(engine, num_blocks), [5; 32]));
    let now = Instant::now();
    // Lease a window of the layout.
    let first = u32::from(data[3]) % num_blocks;
    let leased: Vec<u32> = (first..num_blocks.min(first + 1 + u32::from(data[0] >> 5) * 4)).collect();
    let h = table.lease(LeaseRequest::new("R", 0, 1, leased.clone()), now).expect("lease");
    let token = *h.token().as_bytes();
    // The rest: ranges of (start, count), 8 bytes each, from a mix of small and arbitrary
    // values; a request is up to 4 ranges.
    let words: Vec<u32> = data[4..]
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            match b[0] & 3 {
                0 => u32::from(b[1] % 40),
                1 => u32::MAX - u32::from(b[1] % 4),
                _ => u32::from_le_bytes(b),
            }
        })
        .collect();
    for request in words.chunks(8) {
        let ranges: Vec<BlockRange> =
            request.chunks(2).map(|p| BlockRange { start: p[0], count: p.get(1).copied().unwrap_or(0) }).collect();
        let total: u64 = ranges.iter().map(|r| u64::from(r.count)).sum();
        let valid = !ranges.is_empty()
            && ranges.iter().all(|r| {
                r.count > 0 && r.iter_u64().all(|b| u32::try_from(b).is_ok_and(|b| leased.binary_search(&b).is_ok()))
            })
            && total <= leased.len() as u64;
        match table.begin_read("R", &token, &ranges, now) {
            Ok(guard) => {
                assert!(valid, "accepted an invalid read {ranges:?} of lease {leased:?}");
                let mut bytes = 0u64;
                for r in &ranges {
                    for c in mem.run_chunks(r.start, r.count) {
                        // SAFETY: nobody writes this memory; `chunk` asserts the bounds.
                        bytes += unsafe { mem.chunk(c) }.len() as u64;
                    }
                }
                assert_eq!(bytes, total * layout.block_bytes());
                // SAFETY: as above.
                let _ = unsafe { mem.crc32c(ranges.iter().map(|r| (r.start, r.count))) };
                drop(guard);
            }
            Err(e) => assert!(!valid, "refused a valid read {ranges:?} of lease {leased:?}: {e}"),
        }
    }
    assert_eq!(table.stats().live, 1);
});
