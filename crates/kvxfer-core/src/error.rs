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
    /// A KV-cache shape (one rank's description) is malformed.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A prefill and a decode KV-cache shape that no transfer plan can serve.
    #[error(transparent)]
    Compat(#[from] CompatError),
    /// A decode rank's transfer plan could not be built.
    #[error(transparent)]
    RankPlan(#[from] RankPlanError),
}

/// Why [`crate::LeaseTable::lease`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// A lease with this id is still live (or still draining reads).
    #[error("a lease for request {0} is already live (kind=already_leased)")]
    AlreadyLeased(String),
    /// Block ids outside the registered layout.
    #[error("lease for request {request}: block ids {ids:?} are outside the layout of {num_blocks} blocks (kind=blocks_out_of_range)")]
    BlocksOutOfRange {
        /// The request id.
        request: String,
        /// The offending ids (at most 16 shown).
        ids: Vec<BlockId>,
        /// Blocks in the layout.
        num_blocks: u32,
    },
    /// A lease must have at least one block.
    #[error("lease for request {0} names no blocks (kind=no_blocks)")]
    NoBlocks(String),
    /// One KV-cache group's block list names the same block more than once (its end would
    /// hand the block back twice). Different children may share blocks; one child may not
    /// list one twice.
    #[error("lease for request {request}: block {block} of KV-cache group {group} is listed more than once (kind=duplicate_block)")]
    DuplicateBlock {
        /// The request id.
        request: String,
        /// The KV-cache group whose list repeats it (0: the first or only group).
        group: u32,
        /// The block named twice (the smallest such id).
        block: BlockId,
    },
    /// Not one block list per KV-cache group of the layout (or more groups' blocks than
    /// block ids can number).
    #[error("lease for request {request}: {got} KV-cache group block lists given, the layout has {expected} groups (kind=group_count)")]
    GroupCount {
        /// The request id.
        request: String,
        /// Groups of the layout.
        expected: usize,
        /// Block lists given.
        got: usize,
    },
    /// `expected_consumers` must be at least 1.
    #[error("lease for request {0}: expected_consumers must be at least 1 (kind=no_consumers)")]
    NoConsumers(String),
    /// `n` is larger than `LeaseConfig::max_children`.
    #[error("lease for request {request}: n = {n} children is more than the {max} allowed (LeaseConfig::max_children) (kind=too_many_children)")]
    TooManyChildren {
        /// The request id.
        request: String,
        /// The parent's n.
        n: u32,
        /// The configured maximum.
        max: u32,
    },
    /// The child index is not below `n`, or `n` is 0.
    #[error("lease for request {request}: child index {index} is not below n = {n} (kind=bad_child_index)")]
    BadChildIndex {
        /// The request id.
        request: String,
        /// The child index given.
        index: u32,
        /// The parent's n.
        n: u32,
    },
    /// A child of a parent whose other leases (still tracked) named another `n`.
    #[error("lease of a child of {parent} with n = {n}: its other leased children have n = {tracked} (kind=child_count_mismatch)")]
    ChildCountMismatch {
        /// The parent request id.
        parent: String,
        /// The `n` of this lease.
        n: u32,
        /// The `n` of the parent's tracked leases.
        tracked: u32,
    },
    /// The table was closed ([`crate::LeaseTable::release_all`]: the prefill agent is
    /// shutting down); no lease is made after that, so none is left without an end.
    #[error("lease for request {0}: the prefill agent is shutting down (kind=closed)")]
    Closed(String),
    /// [`crate::LeaseTable::arm`]: the request id given is not the one the parent, child
    /// index and `n` name (`"{index}_{parent}"` for `n > 1`, the parent's own id for `n == 1`).
    #[error("arming lease {given}: parent, child index and n name request {expected} (kind=id_mismatch)")]
    IdMismatch {
        /// The id the lease was to be armed under.
        given: String,
        /// The id the parent, child index and `n` name.
        expected: String,
    },
    /// The request id is longer than [`crate::MAX_REQUEST_ID_LEN`]: its notify and cancel
    /// frames would not fit a prefill agent's small-frame cap.
    #[error("lease for request {start}…: the request id is {len} bytes; at most {max} are accepted (kind=id_too_long)")]
    IdTooLong {
        /// The id's first characters.
        start: String,
        /// Its length in bytes.
        len: usize,
        /// [`crate::MAX_REQUEST_ID_LEN`].
        max: usize,
    },
    /// [`crate::LeaseTable::arm`]: a token of all zeros (never minted).
    #[error("arming lease {0}: the lease token is all zeros (not minted) (kind=zero_token)")]
    ZeroToken(String),
    /// [`crate::LeaseTable::arm`]: this token is the token of an ended lease of the same id
    /// still on record; arming it again would bring an ended lease back.
    #[error("arming lease {0}: this token belongs to a lease of the same id that already ended (kind=token_reused)")]
    TokenReused(String),
}

impl LeaseError {
    /// The snake-case name of the variant (`already_leased`, `id_too_long`, ...): the `kind`
    /// its message ends with and the Python binding's `LeaseError` carries.
    pub fn kind(&self) -> &'static str {
        match self {
            LeaseError::AlreadyLeased(_) => "already_leased",
            LeaseError::BlocksOutOfRange { .. } => "blocks_out_of_range",
            LeaseError::NoBlocks(_) => "no_blocks",
            LeaseError::DuplicateBlock { .. } => "duplicate_block",
            LeaseError::GroupCount { .. } => "group_count",
            LeaseError::NoConsumers(_) => "no_consumers",
            LeaseError::TooManyChildren { .. } => "too_many_children",
            LeaseError::BadChildIndex { .. } => "bad_child_index",
            LeaseError::ChildCountMismatch { .. } => "child_count_mismatch",
            LeaseError::Closed(_) => "closed",
            LeaseError::IdMismatch { .. } => "id_mismatch",
            LeaseError::IdTooLong { .. } => "id_too_long",
            LeaseError::ZeroToken(_) => "zero_token",
            LeaseError::TokenReused(_) => "token_reused",
        }
    }
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
    /// A lease ttl of 0 ms: the lease is over before a pull could start, and a decode side
    /// would heartbeat it at its floor rate.
    #[error("hand-off {0}: the lease ttl is 0 ms")]
    ZeroTtl(String),
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
    /// A field needed to pull is null, missing or empty.
    #[error("kv_transfer_params: field {0} is required to pull (it is missing, null or empty)")]
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
}

impl ParamsError {
    /// `e` about the value of `field`.
    pub(crate) fn invalid(field: &'static str, e: HandoffError) -> Self {
        ParamsError::Invalid { field, source: Box::new(e) }
    }
}

/// At most this many offending ids are kept in an error.
pub(crate) const MAX_IDS_SHOWN: usize = 16;

/// Why a KV-cache shape ([`crate::KvShapeSpec`]) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShapeError {
    /// A field that must be non-zero (or non-empty) is not.
    #[error("KV shape: {0} must be non-zero")]
    Zero(&'static str),
    /// The rank is not below the tensor-parallel size.
    #[error("KV shape: tp_rank {tp_rank} is not below tp_size {tp_size}")]
    RankOutOfRange {
        /// The rank given.
        tp_rank: u32,
        /// The tensor-parallel size.
        tp_size: u32,
    },
    /// The KV heads cannot be split evenly (or replicated evenly) over the ranks.
    #[error(
        "KV shape: {total_kv_heads} KV heads cannot be split over tp_size {tp_size} \
         (one must divide the other)"
    )]
    HeadsNotDivisible {
        /// Total KV heads of the model.
        total_kv_heads: u32,
        /// The tensor-parallel size.
        tp_size: u32,
    },
    /// No KV-cache groups.
    #[error("KV shape: needs at least one KV-cache group")]
    NoGroups,
    /// A group without segments.
    #[error("KV shape: group {group} has no segments")]
    NoSegments {
        /// The group index.
        group: usize,
    },
    /// A segment's head dimension is 0.
    #[error("KV shape: group {group} segment {segment}: head_dim must be non-zero")]
    ZeroHeadDim {
        /// The group index.
        group: usize,
        /// The segment index.
        segment: usize,
    },
    /// A segment's stride is shorter than its block.
    #[error("KV shape: group {group} segment {segment}: stride {stride} is shorter than a block of {block_len} bytes")]
    StrideTooShort {
        /// The group index.
        group: usize,
        /// The segment index.
        segment: usize,
        /// The stride given.
        stride: u64,
        /// Bytes of one block of the segment on this rank.
        block_len: u64,
    },
    /// Sizes overflow.
    #[error("KV shape: sizes overflow u64")]
    Overflow,
}

/// A field of a KV-cache shape that prefill and decode disagree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompatField {
    /// Element type name.
    Dtype,
    /// Bytes per element.
    DtypeBytes,
    /// Split KV heads on one side, an MLA latent on the other.
    Attention,
    /// Total KV heads of the model.
    TotalKvHeads,
    /// Number of KV-cache groups.
    Groups,
    /// Number of segments (layers, K/V) of a group.
    Segments {
        /// The group index.
        group: usize,
    },
    /// Head dimension of a segment.
    HeadDim {
        /// The group index.
        group: usize,
        /// The segment index.
        segment: usize,
    },
    /// Tensor-parallel sizes.
    TpSize,
    /// Tokens per block.
    BlockTokens,
}

impl std::fmt::Display for CompatField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompatField::Dtype => f.write_str("dtype"),
            CompatField::DtypeBytes => f.write_str("dtype_bytes"),
            CompatField::Attention => f.write_str("attention"),
            CompatField::TotalKvHeads => f.write_str("total_kv_heads"),
            CompatField::Groups => f.write_str("groups"),
            CompatField::Segments { group } => write!(f, "groups[{group}].segments"),
            CompatField::HeadDim { group, segment } => {
                write!(f, "groups[{group}].segments[{segment}].head_dim")
            }
            CompatField::TpSize => f.write_str("tp_size"),
            CompatField::BlockTokens => f.write_str("block_tokens"),
        }
    }
}

/// Why a prefill and a decode KV-cache shape cannot be paired: only what no transfer plan
/// can serve. Every variant names the field and both sides' values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CompatError {
    /// A field both sides must share differs.
    #[error("KV caches differ in {field}: prefill {prefill}, decode {decode}")]
    Differs {
        /// The field.
        field: CompatField,
        /// The prefill side's value.
        prefill: String,
        /// The decode side's value.
        decode: String,
    },
    /// Neither tensor-parallel size divides the other.
    #[error("tp_size: prefill {prefill} and decode {decode} do not divide one another")]
    TpNotDivisible {
        /// Prefill tensor-parallel size.
        prefill: u32,
        /// Decode tensor-parallel size.
        decode: u32,
    },
    /// Decode blocks hold fewer tokens than prefill blocks (a prefill block would have to
    /// be split over decode blocks: not supported).
    #[error("block_tokens: decode {decode} is smaller than prefill {prefill}")]
    DecodeBlockSmaller {
        /// Prefill tokens per block.
        prefill: u32,
        /// Decode tokens per block.
        decode: u32,
    },
    /// Decode blocks are not a whole number of prefill blocks.
    #[error("block_tokens: decode {decode} is not a multiple of prefill {prefill}")]
    BlockRatioNotInteger {
        /// Prefill tokens per block.
        prefill: u32,
        /// Decode tokens per block.
        decode: u32,
    },
}

impl CompatError {
    /// The field the two sides disagree on.
    pub fn field(&self) -> CompatField {
        match self {
            CompatError::Differs { field, .. } => *field,
            CompatError::TpNotDivisible { .. } => CompatField::TpSize,
            CompatError::DecodeBlockSmaller { .. } | CompatError::BlockRatioNotInteger { .. } => {
                CompatField::BlockTokens
            }
        }
    }
}

/// Why a decode rank's transfer plan ([`crate::xfer::RankPlan`]) could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RankPlanError {
    /// Not one block list pair per KV-cache group.
    #[error("the KV caches have {expected} groups but {got} block lists were given")]
    GroupCount {
        /// Groups of the shapes.
        expected: usize,
        /// Block list pairs given.
        got: usize,
    },
    /// The local list is not `ceil(remote / block_ratio)` blocks long.
    #[error(
        "group {group}: {remote} remote blocks fill {} local blocks at block ratio {ratio}, but {local} were given",
        remote.div_ceil(*ratio as usize)
    )]
    BlockCount {
        /// The group.
        group: usize,
        /// Remote blocks given.
        remote: usize,
        /// Local blocks given.
        local: usize,
        /// Decode block tokens / prefill block tokens.
        ratio: u32,
    },
    /// Block ids outside a side's group.
    #[error("group {group}: {side:?} block ids {ids:?} are outside the group's {num_blocks} blocks")]
    OutOfRange {
        /// The group.
        group: usize,
        /// Which side.
        side: Side,
        /// The offending ids (at most 16 shown).
        ids: Vec<BlockId>,
        /// Blocks in that side's group.
        num_blocks: u32,
    },
    /// A local block named twice in one group (it would be written twice).
    #[error("group {group}: local block {block} is listed more than once")]
    DuplicateLocal {
        /// The group.
        group: usize,
        /// The block.
        block: BlockId,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One lease error of every kind (`kind()`'s match fails to compile when a kind is added).
    fn one_of_each() -> Vec<LeaseError> {
        let r = || "req-1".to_owned();
        let all = vec![
            LeaseError::AlreadyLeased(r()),
            LeaseError::BlocksOutOfRange { request: r(), ids: vec![9], num_blocks: 4 },
            LeaseError::NoBlocks(r()),
            LeaseError::DuplicateBlock { request: r(), group: 0, block: 1 },
            LeaseError::GroupCount { request: r(), expected: 1, got: 2 },
            LeaseError::NoConsumers(r()),
            LeaseError::TooManyChildren { request: r(), n: 9, max: 8 },
            LeaseError::BadChildIndex { request: r(), index: 4, n: 4 },
            LeaseError::ChildCountMismatch { parent: r(), n: 4, tracked: 2 },
            LeaseError::Closed(r()),
            LeaseError::IdMismatch { given: r(), expected: "0_req-1".into() },
            LeaseError::IdTooLong { start: r(), len: 999, max: 512 },
            LeaseError::ZeroToken(r()),
            LeaseError::TokenReused(r()),
        ];
        for e in &all {
            // No wildcard: a new kind does not compile until it has an example above.
            match e {
                LeaseError::AlreadyLeased(_)
                | LeaseError::BlocksOutOfRange { .. }
                | LeaseError::NoBlocks(_)
                | LeaseError::DuplicateBlock { .. }
                | LeaseError::GroupCount { .. }
                | LeaseError::NoConsumers(_)
                | LeaseError::TooManyChildren { .. }
                | LeaseError::BadChildIndex { .. }
                | LeaseError::ChildCountMismatch { .. }
                | LeaseError::Closed(_)
                | LeaseError::IdMismatch { .. }
                | LeaseError::IdTooLong { .. }
                | LeaseError::ZeroToken(_)
                | LeaseError::TokenReused(_) => {}
            }
        }
        all
    }

    #[test]
    fn every_lease_error_names_its_kind_and_the_troubleshooting_guide_has_it() {
        let guide = include_str!("../../../docs/src/guides/troubleshooting.md");
        let all = one_of_each();
        let kinds: std::collections::HashSet<_> = all.iter().map(LeaseError::kind).collect();
        assert_eq!(kinds.len(), all.len(), "one example per kind");
        for e in &all {
            let tag = format!("(kind={})", e.kind());
            assert!(e.to_string().ends_with(&tag), "{e}");
            assert!(guide.contains(&format!("`{tag}`")), "troubleshooting.md does not list {tag}");
        }
    }
}
