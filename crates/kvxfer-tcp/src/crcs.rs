//! The CRC-32C precompute of a lease's blocks (opt-in: `AgentConfig::precompute_crcs`): each
//! block's CRC per segment is computed once, after the lease was made and away from the
//! connections' runtime, into the lease's [`BlockCrcs`]; a read of whole blocks then combines
//! the stored values into its payload's CRC ([`crate::read`]) and reads each byte once, to
//! send it. Values not stored yet (a read that came before the precompute got to its
//! blocks) are computed from the bytes while sending, as without a precompute.

use kvxfer_core::{BlockId, GroupCrcs, ReadGuard};
use kvxfer_mem::{Chunk, KvMemory};

/// Bytes checksummed between two looks at whether the lease ended (a lock of its shard).
const CHECK_EVERY: u64 = 8 << 20;

/// Computes the CRC-32Cs of the blocks a lease holds — `groups[g]` are its blocks of KV-cache
/// group `g` — into the store of the lease `hold` holds ([`kvxfer_core::LeaseTable::hold`],
/// which keeps the blocks from being handed back while this reads them). Stops early when the
/// lease ends (nothing will read the values). Returns the bytes checksummed. Blocking: run it
/// off the runtime (it reads every byte of the lease).
pub fn compute_block_crcs(mem: &KvMemory, hold: &ReadGuard, groups: &[Vec<BlockId>]) -> u64 {
    let Some(store) = hold.block_crcs() else { return 0 };
    let mut ours = Vec::with_capacity(groups.len());
    for (g, blocks) in groups.iter().enumerate() {
        let segments = mem.group(g).map_or(0, |m| m.layout().segments().len());
        ours.push(GroupCrcs::new(blocks, segments));
    }
    let published = store.publish(ours);
    // Looked at first: a lease that ended while queued is skipped at once.
    let (mut done, mut since_check) = (0u64, CHECK_EVERY);
    for (g, values) in published.iter().enumerate() {
        let Some(m) = mem.group(g) else { continue };
        for (index, &block) in values.blocks().iter().enumerate() {
            if !m.layout().contains(block) {
                continue;
            }
            if since_check >= CHECK_EVERY {
                if hold.lease_ended() {
                    return done;
                }
                since_check = 0;
            }
            for (segment, seg) in m.layout().segments().iter().enumerate() {
                let c = Chunk {
                    region: segment,
                    offset: (u64::from(block) * seg.stride) as usize,
                    len: seg.block_len as usize,
                };
                // SAFETY: `hold` keeps the lease's blocks from being handed back, and
                // `block` is one of them (in this group's layout, checked above); the owner
                // does not write leased blocks (the access contract of kvxfer-mem).
                let bytes = unsafe { m.chunk(c) };
                values.set(index, segment, kvxfer_mem::crc32c_append(0, bytes));
                done += seg.block_len;
                since_check += seg.block_len;
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use kvxfer_core::plan::BlockRun;
    use kvxfer_core::{BlockCrcs, GroupCrcs, LeaseRequest};
    use kvxfer_mem::{Chunk, KvMemory};
    use tokio::net::TcpListener;

    use super::compute_block_crcs;
    use crate::handshake::tests::{ctx, hello};
    use crate::{admit_any, serve_connection, ClientError, Connection, Limits};

    /// The precompute stores each leased block's CRC per segment (the CRC of its bytes)
    /// and does nothing once the lease ended.
    #[test]
    fn the_precompute_stores_every_leased_blocks_crc_and_stops_once_the_lease_ended() {
        let c = ctx(None);
        let mem = crate::read::tests::patterned(4, &[(64, 0), (40, 24)], 5);
        let crcs = Arc::new(BlockCrcs::new());
        let req = LeaseRequest::new("P", 0, 1, vec![3, 1]).with_crcs(crcs.clone());
        let (h, generation) = c.table.lease_with_generation(req, std::time::Instant::now()).expect("lease");
        let hold = c.table.hold(h.remote_request_id(), generation).expect("live");
        let groups: Vec<Vec<u32>> = h.groups().map(<[u32]>::to_vec).collect();
        assert_eq!(compute_block_crcs(&mem, &hold, &groups), 2 * (64 + 40));
        let g = crcs.group(0).expect("published");
        assert_eq!(g.blocks(), &[1, 3]);
        for (i, &b) in g.blocks().iter().enumerate() {
            for (s, seg) in mem.layout().segments().iter().enumerate() {
                let c = Chunk {
                    region: s,
                    offset: (u64::from(b) * seg.stride) as usize,
                    len: seg.block_len as usize,
                };
                // SAFETY: nothing writes this memory.
                assert_eq!(g.get(i, s), Some(kvxfer_mem::crc32c_append(0, unsafe { mem.chunk(c) })));
            }
        }

        let crcs = Arc::new(BlockCrcs::new());
        let req = LeaseRequest::new("Q", 0, 1, vec![0]).with_crcs(crcs.clone());
        let (h, generation) = c.table.lease_with_generation(req, std::time::Instant::now()).expect("lease");
        let hold = c.table.hold(h.remote_request_id(), generation).expect("live");
        c.table.cancel(h.remote_request_id(), h.token().as_bytes(), std::time::Instant::now());
        assert_eq!(compute_block_crcs(&mem, &hold, &[vec![0]]), 0, "ended before it started");
    }

    /// Reads served while the precompute has not started, has done part of the lease, or
    /// all of it: every payload arrives whole and passes the decode side's CRC check, the
    /// stored values covering exactly what they were computed for. A stored value that does
    /// not describe the bytes (a block written after its lease) fails the check.
    #[tokio::test]
    async fn reads_before_during_and_after_the_precompute_pass_the_crc_check() {
        let mut c = ctx(None);
        c.memory = Arc::new(kvxfer_mem::pattern::alloc_filled(c.memory.layout().clone()).expect("memory"));
        let c = Arc::new(c);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let serving = c.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(serve_connection(s, serving.clone(), admit_any()));
            }
        });
        let crcs = Arc::new(BlockCrcs::new());
        let req = LeaseRequest::new("P", 0, 1, vec![0, 1, 2, 3]).with_crcs(crcs.clone());
        let (h, generation) = c.table.lease_with_generation(req, std::time::Instant::now()).expect("lease");
        let mut conn = Connection::connect(&addr, &hello(), Limits::default()).await.expect("connect");
        let dest = KvMemory::alloc(c.memory.layout().clone()).expect("dest");
        let runs = [BlockRun { remote_start: 0, local_start: 0, count: 4 }];
        let (id, token) = (h.remote_request_id().to_owned(), h.token().as_bytes().to_vec());
        let precomputed = || c.counters.crc_bytes_precomputed.load(Ordering::Relaxed);
        let read = async |conn: &mut Connection| {
            // SAFETY: `dest` is this test's alone; the runs are inside its layout.
            let r = unsafe { conn.read_into(&id, &token, &runs, &dest) }.await;
            // SAFETY: no read is under way.
            let (want, got) = unsafe { (c.memory.crc32c([(0, 4)]), dest.crc32c([(0, 4)])) };
            r.map(|n| {
                assert_eq!(n, 256);
                assert_eq!(got, want, "byte for byte");
            })
        };

        read(&mut conn).await.expect("before the precompute started");
        assert_eq!(precomputed(), 0);

        // Half done: blocks 1 and 2 stored.
        let g = &crcs.publish(vec![GroupCrcs::new(&[0, 1, 2, 3], 1)])[0];
        for b in [1u32, 2] {
            // SAFETY: nothing writes this memory.
            let bytes = unsafe { c.memory.chunk(Chunk { region: 0, offset: b as usize * 64, len: 64 }) };
            g.set(b as usize, 0, kvxfer_mem::crc32c_append(0, bytes));
        }
        read(&mut conn).await.expect("part way");
        assert_eq!(precomputed(), 128);

        // Done (the precompute fills in the rest; its values equal the ones set above).
        let hold = c.table.hold(h.remote_request_id(), generation).expect("live");
        compute_block_crcs(&c.memory, &hold, &[vec![0, 1, 2, 3]]);
        drop(hold);
        read(&mut conn).await.expect("all stored");
        assert_eq!(precomputed(), 128 + 256);

        // A stored value that does not describe the bytes: the decode side's check fails.
        g.set(3, 0, 0x1234_5678);
        let err = read(&mut conn).await.expect_err("a wrong stored CRC");
        assert!(matches!(err, ClientError::Integrity { .. }), "{err:?}");
    }
}
