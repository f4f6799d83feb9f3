//! The sans-IO core of kvxfer.
//!
//! Everything here is plain data and state machines: no sockets, no threads, no clock reads.
//! Time is an argument (`now: Instant`); randomness for lease tokens comes from a seeded
//! generator the caller provides. The engine crate drives it with real I/O.
//!
//! - [`LeaseTable`]: the prefill side's leases, exactly-once endings, read guards, expiry.
//! - [`ParentTracker`]: per parent request, which children are pending / pulled / released / expired.
//! - [`ChildHandoff`] / [`PrefillResult`]: the per-child hand-off and its validation.
//! - [`BlockLayout`] and [`plan`]: block layouts, compatibility hashes, coalesced transfer plans.
//! - [`pull`]: one decode-side pull as a sans-IO state machine ([`pull::PullMachine`]), and
//!   the typed errors of its children ([`pull::PullError`]).
//! - [`KvTransferParams`]: vLLM's `kv_transfer_params` dict, read and written with serde.
//! - [`KvShape`] and [`xfer`]: one rank's KV-cache shape (groups, heads per rank, HND block
//!   layout), the prefill/decode compatibility check, and per-decode-rank transfer plans for
//!   different tensor-parallel sizes, block sizes and KV-cache groups.
#![forbid(unsafe_code)]

mod crcs;
mod error;
mod handoff;
mod ids;
mod layout;
mod lease;
pub mod log;
mod params;
mod parent;
pub mod plan;
pub mod pull;
mod shape;
pub mod xfer;

pub use crcs::{BlockCrcs, GroupCrcs};
pub use error::{
    CompatError, CompatField, Error, HandoffError, LayoutError, LeaseError, ParamsError, PlanError,
    RankPlanError, ShapeError, Side,
};
pub use handoff::{join_host_port, ChildHandoff, EngineInfo, PrefillResult};
pub use ids::{child_request_id, LeaseToken};
pub use layout::{groups_compat_hash, BlockLayout, Segment};
pub use lease::{
    CancelOutcome, EndKind, HeartbeatOutcome, LeaseConfig, LeaseEnd, LeaseRequest, LeaseStats, LeaseTable,
    NotifyOutcome, ReadGuard, ReadRefused, RetractOutcome, MAX_REQUEST_ID_LEN,
};
pub use params::{KvTransferParams, RemoteBlockIds};
pub use parent::{ChildState, ParentStatus, ParentTracker};
pub use shape::{GroupSpec, HeadRange, KvHeads, KvShape, KvShapeSpec, SegmentShape, SegmentSpec};
pub use xfer::{expected_consumers, RankPlan, TransferPair};

/// Internals for the fuzz targets in `fuzz/` (built with `cfg(fuzzing)` by cargo fuzz);
/// absent from every other build.
#[cfg(fuzzing)]
pub mod fuzzing {
    /// Checks a lease table's private bookkeeping (see `LeaseTable::check_invariants`).
    pub fn check_lease_table(table: &crate::LeaseTable) -> Result<(), String> {
        table.check_invariants()
    }
}

/// A block id: an index into a [`BlockLayout`].
pub type BlockId = u32;
