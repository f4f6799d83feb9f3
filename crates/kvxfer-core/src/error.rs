//! Error types of the core: one narrow enum per concern, wrapped by [`Error`].

use crate::BlockId;

/// Any error of the core.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A lease could not be made.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// A hand-off or prefill result is malformed or incomplete.
    #[error(transparent)]
    Handoff(#[from] HandoffError),
    /// A transfer plan could not be built.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A block layout is malformed.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// `kv_transfer_params` could not be read or turned into a hand-off.
    #[error(transparent)]
    Params(#[from] ParamsError),
}

/// Why [`crate::LeaseTable::lease`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// A lease with this id is still live (or still draining reads).
    #[error("a lease for request {0} is already live")]
    AlreadyLeased(String),
    /// Block ids outside the registered layout.
    #[error("lease for request {request}: block ids {ids:?} are outside the layout of {num_blocks} blocks")]
    BlocksOutOfRange {
        /// The request id.
        request: String,
        /// The offending ids (at most 16 shown).
        ids: Vec<BlockId>,
        /// Blocks in the layout.
        num_blocks: u32,
    },
    /// A lease must have at least one block.
    #[error("lease for request {0} names no blocks")]
    NoBlocks(String),
    /// `expected_consumers` must be at least 1.
    #[error("lease for request {0}: expected_consumers must be at least 1")]
    NoConsumers(String),
    /// `n` is larger than `LeaseConfig::max_children`.
    #[error("lease for request {request}: n = {n} children is more than the {max} allowed (LeaseConfig::max_children)")]
    TooManyChildren {
        /// The request id.
        request: String,
        /// The parent's n.
        n: u32,
        /// The configured maximum.
        max: u32,
    },
    /// The child index is not below `n`, or `n` is 0.
    #[error("lease for request {request}: child index {index} is not below n = {n}")]
    BadChildIndex {
        /// The request id.
        request: String,
        /// The child index given.
        index: u32,
        /// The parent's n.
        n: u32,
    },
}

/// Why a hand-off or prefill result was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandoffError {
    /// A lease token was not 16 bytes.
    #[error("lease token must be 16 bytes, got {0}")]
    BadTokenLength(usize),
    /// A lease token in hex was not 32 hex digits.
    #[error("lease token must be 32 hex digits, got {0:?}")]
    BadTokenHex(String),
    /// A required field is empty or missing.
    #[error("hand-off field {0} is missing or empty")]
    MissingField(&'static str),
    /// `n` must be at least 1.
    #[error("prefill result for {parent}: n must be at least 1")]
    ZeroChildren {
        /// The parent request id.
        parent: String,
    },
    /// A prefill result does not list exactly the children 0..n.
    #[error(
        "prefill result for {parent} with n = {n} is incomplete: missing children {missing:?}, \
         duplicated {duplicated:?}, out of range {out_of_range:?}, of other parents {foreign:?}"
    )]
    IncompleteResult {
        /// The parent request id.
        parent: String,
        /// The parent's n.
        n: u32,
        /// Child indices in 0..n with no hand-off.
        missing: Vec<u32>,
        /// Child indices listed more than once.
        duplicated: Vec<u32>,
        /// Child indices not below n.
        out_of_range: Vec<u32>,
        /// Remote request ids of children naming another parent or another n.
        foreign: Vec<String>,
    },
    /// `expected_consumers` was 0.
    #[error("hand-off {0}: expected_consumers must be at least 1")]
    NoConsumers(String),
    /// The remote port does not fit in 16 bits.
    #[error("hand-off {request}: remote port {port} is not a TCP port")]
    BadPort {
        /// The request id.
        request: String,
        /// The port given.
        port: u32,
    },
}

/// Which side of a transfer a block id belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefill (source) side.
    Remote,
    /// The decode (destination) side.
    Local,
}

/// Why a transfer plan could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// Remote and local block lists differ in length.
    #[error("{remote} remote blocks but {local} local blocks")]
    LengthMismatch {
        /// Remote blocks.
        remote: usize,
        /// Local blocks.
        local: usize,
    },
    /// Block ids outside a layout.
    #[error("{side:?} block ids {ids:?} are outside the layout of {num_blocks} blocks")]
    OutOfRange {
        /// Which side.
        side: Side,
        /// The offending ids (at most 16 shown).
        ids: Vec<BlockId>,
        /// Blocks in that layout.
        num_blocks: u32,
    },
    /// The same local block is the destination of two different remote blocks.
    #[error("local block {local} is the destination of remote blocks {first} and {second}")]
    ConflictingDestination {
        /// The local block.
        local: BlockId,
        /// The first remote block.
        first: BlockId,
        /// The second remote block.
        second: BlockId,
    },
}

/// Why a block layout is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// No segments.
    #[error("a block layout needs at least one segment")]
    NoSegments,
    /// A segment's block length is 0 or larger than its stride.
    #[error("segment {index}: block_len {block_len} must be non-zero and at most stride {stride}")]
    BadSegment {
        /// Segment index.
        index: usize,
        /// Bytes per block.
        block_len: u64,
        /// Distance between blocks.
        stride: u64,
    },
    /// The layout's total size overflows.
    #[error("layout size overflows u64")]
    Overflow,
    /// The layout message was absent.
    #[error("block layout missing from the message")]
    Missing,
}

/// Why `kv_transfer_params` could not be read or used. Every variant names the field.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParamsError {
    /// The JSON did not parse into the dict's shape; `field` is the path to the value that
    /// failed (`.` when the text is not a JSON object at all).
    #[error("kv_transfer_params: field {field}: {source}")]
    Json {
        /// Path to the offending value, e.g. `remote_port` or `remote_block_ids[1]`.
        field: String,
        /// serde's message.
        #[source]
        source: serde_json::Error,
    },
    /// A field needed to pull is null or missing.
    #[error("kv_transfer_params: field {0} is required to pull")]
    Missing(&'static str),
    /// A field holds a value kvxfer cannot use.
    #[error("kv_transfer_params: field {field}: {source}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why its value is unusable.
        #[source]
        source: Box<HandoffError>,
    },
    /// `remote_block_ids` lists more than one KV-cache group (a hybrid model). Until
    /// per-group layouts exist, only one group can be pulled: flattening would lose which
    /// pool each id indexes.
    #[error(
        "kv_transfer_params: field {field} has {groups} KV-cache groups; kvxfer pulls a single group \
         (per-group layouts are not supported yet)"
    )]
    TooManyGroups {
        /// The field (`remote_block_ids`).
        field: &'static str,
        /// Groups listed.
        groups: usize,
    },
}

impl ParamsError {
    /// `e` about the value of `field`.
    pub(crate) fn invalid(field: &'static str, e: HandoffError) -> Self {
        ParamsError::Invalid { field, source: Box::new(e) }
    }
}

/// At most this many offending ids are kept in an error.
pub(crate) const MAX_IDS_SHOWN: usize = 16;
