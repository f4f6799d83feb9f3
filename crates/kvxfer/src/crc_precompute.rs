//! The prefill agent's CRC-32C precompute ([`crate::AgentConfig::precompute_crcs`]): a
//! thread of the agent's own (`kvxfer-crc`) computes the CRC-32C of every block of each new
//! lease, per segment, into the lease's store; TCP reads of whole blocks then combine the
//! stored values instead of checksumming the payload while sending it
//! ([`kvxfer_tcp::compute_block_crcs`]). Leases are taken in the order they were made;
//! a read that comes before its blocks' values checksums those blocks while sending, as
//! without the precompute.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crossbeam_channel::Sender;
use kvxfer_core::{BlockCrcs, BlockId, ChildHandoff, LeaseRequest, LeaseTable};
use kvxfer_mem::KvMemory;
use kvxfer_tcp::ServerCounters;
use tracing::warn;

/// A lease made with a CRC store whose precompute is not started yet: started once its
/// hand-off is going to be returned ([`Precompute::start`]) — a held lease cannot be
/// retracted ([`LeaseTable::hold`]).
pub(crate) struct Pending {
    id: Arc<str>,
    generation: u64,
    groups: Vec<Vec<BlockId>>,
}

impl Pending {
    pub(crate) fn new(h: &ChildHandoff, generation: u64) -> Self {
        Pending {
            id: Arc::from(h.remote_request_id()),
            generation,
            groups: h.groups().map(<[BlockId]>::to_vec).collect(),
        }
    }
}

/// The queue of the precompute thread (which ends when this is dropped, after the leases
/// queued: each is skipped at once if it ended meanwhile).
pub(crate) struct Precompute {
    jobs: Sender<(kvxfer_core::ReadGuard, Vec<Vec<BlockId>>)>,
}

impl Precompute {
    /// Starts the thread over `memory`; `None` (logged) if the thread cannot be started.
    pub(crate) fn start(memory: Arc<KvMemory>, counters: Arc<ServerCounters>) -> Option<Self> {
        let (jobs, queue) = crossbeam_channel::unbounded::<(kvxfer_core::ReadGuard, Vec<Vec<BlockId>>)>();
        let spawned = std::thread::Builder::new().name("kvxfer-crc".into()).spawn(move || {
            for (hold, groups) in queue {
                if !hold.lease_ended() {
                    let bytes = kvxfer_tcp::compute_block_crcs(&memory, &hold, &groups);
                    counters.crc_bytes_at_lease.fetch_add(bytes, Ordering::Relaxed);
                }
            }
        });
        match spawned {
            Ok(_) => Some(Precompute { jobs }),
            Err(e) => {
                warn!("could not start the CRC-32C precompute thread, reads checksum while sending: {e}");
                None
            }
        }
    }

    /// Gives `req` a CRC store (to be filled once the lease is made and started).
    pub(crate) fn prepare(req: &mut LeaseRequest) {
        if req.crcs.is_none() {
            req.crcs = Some(Arc::new(BlockCrcs::new()));
        }
    }

    /// Queues the precompute of a lease made with a store: held now (`None`: it ended
    /// already, nothing to do), its blocks handed back only after the thread is done with
    /// them.
    pub(crate) fn queue(&self, table: &Arc<LeaseTable>, p: Pending) {
        if let Some(hold) = table.hold(&p.id, p.generation) {
            // Sent back only when the thread is gone (then dropped here: the hold ends).
            let _ = self.jobs.send((hold, p.groups));
        }
    }
}
