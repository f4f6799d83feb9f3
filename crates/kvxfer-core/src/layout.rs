//! Block layouts and compatibility hashes.

use kvxfer_proto::v1;

use crate::error::LayoutError;
use crate::ids::{fnv1a, FNV_OFFSET};
use crate::BlockId;

/// One segment of every block (a layer, or a layer's K or V): block `b` of this segment
/// is `block_len` bytes at `b * stride` in the segment's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Bytes of one block in this segment.
    pub block_len: u64,
    /// Distance between consecutive blocks; at least `block_len`.
    pub stride: u64,
}

impl Segment {
    /// A segment whose blocks are packed (`stride == block_len`).
    pub fn packed(block_len: u64) -> Self {
        Segment { block_len, stride: block_len }
    }

    /// Whether consecutive blocks are adjacent in memory, so a run of them is one range.
    pub fn is_packed(&self) -> bool {
        self.stride == self.block_len
    }
}

/// How a KV cache is laid out in blocks: `num_blocks` blocks, each made of one piece per
/// segment. Checked on construction, so a value of this type is always well formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    num_blocks: u32,
    segments: Vec<Segment>,
    dtype: String,
    block_tokens: u32,
}

impl BlockLayout {
    /// A layout; refuses empty segment lists, zero-length blocks and strides shorter than a block.
    pub fn new(
        num_blocks: u32,
        segments: Vec<Segment>,
        dtype: impl Into<String>,
        block_tokens: u32,
    ) -> Result<Self, LayoutError> {
        if segments.is_empty() {
            return Err(LayoutError::NoSegments);
        }
        for (index, s) in segments.iter().enumerate() {
            if s.block_len == 0 || s.block_len > s.stride {
                return Err(LayoutError::BadSegment { index, block_len: s.block_len, stride: s.stride });
            }
            s.stride.checked_mul(u64::from(num_blocks)).ok_or(LayoutError::Overflow)?;
        }
        let layout = BlockLayout { num_blocks, segments, dtype: dtype.into(), block_tokens };
        layout
            .segments
            .iter()
            .try_fold(0u64, |acc, s| acc.checked_add(s.block_len))
            .ok_or(LayoutError::Overflow)?;
        Ok(layout)
    }

    /// A single packed segment: the simplest layout (tests, examples, the bench).
    pub fn single(num_blocks: u32, block_bytes: u64) -> Result<Self, LayoutError> {
        Self::new(num_blocks, vec![Segment::packed(block_bytes)], "u8", 16)
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The segments, in layout order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Element type name.
    pub fn dtype(&self) -> &str {
        &self.dtype
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// Bytes of one whole block (all segments).
    pub fn block_bytes(&self) -> u64 {
        // Checked in `new`.
        self.segments.iter().map(|s| s.block_len).sum()
    }

    /// Bytes a segment's region must have to hold every block.
    pub fn region_len(&self, segment: usize) -> Option<u64> {
        let s = self.segments.get(segment)?;
        if self.num_blocks == 0 {
            return Some(0);
        }
        Some(s.stride * u64::from(self.num_blocks - 1) + s.block_len)
    }

    /// Whether `id` names a block of this layout.
    pub fn contains(&self, id: BlockId) -> bool {
        id < self.num_blocks
    }

    /// The ids in `ids` outside this layout (at most 16 listed).
    pub fn out_of_range(&self, ids: impl IntoIterator<Item = BlockId>) -> Vec<BlockId> {
        ids.into_iter().filter(|&id| !self.contains(id)).take(crate::error::MAX_IDS_SHOWN).collect()
    }

    /// Hash of everything two peers must agree on to move blocks between them: per-segment
    /// block lengths, dtype and tokens per block. Not the block count or strides, which are
    /// each side's own business. Stable across builds (FNV-1a).
    pub fn compat_hash(&self) -> u64 {
        let mut h = fnv1a(b"kvxfer-layout-v1", FNV_OFFSET);
        h = fnv1a(&(self.segments.len() as u64).to_le_bytes(), h);
        for s in &self.segments {
            h = fnv1a(&s.block_len.to_le_bytes(), h);
        }
        h = fnv1a(&(self.dtype.len() as u64).to_le_bytes(), h);
        h = fnv1a(self.dtype.as_bytes(), h);
        fnv1a(&self.block_tokens.to_le_bytes(), h)
    }

    /// The wire form.
    pub fn to_wire(&self) -> v1::BlockLayout {
        v1::BlockLayout {
            num_blocks: self.num_blocks,
            segments: self
                .segments
                .iter()
                .map(|s| v1::SegmentLayout { block_len: s.block_len, stride: s.stride })
                .collect(),
            dtype: self.dtype.clone(),
            block_tokens: self.block_tokens,
        }
    }

    /// Parses the wire form.
    pub fn from_wire(w: &v1::BlockLayout) -> Result<Self, LayoutError> {
        Self::new(
            w.num_blocks,
            w.segments.iter().map(|s| Segment { block_len: s.block_len, stride: s.stride }).collect(),
            w.dtype.clone(),
            w.block_tokens,
        )
    }
}

/// The compatibility hash of a cache of several KV-cache groups (`layouts[g]` is group
/// `g`): with one group, exactly its [`BlockLayout::compat_hash`] (so single-group peers see
/// no change); with more, a hash over the group count and every group's hash, in order.
pub fn groups_compat_hash<'a>(layouts: impl IntoIterator<Item = &'a BlockLayout>) -> u64 {
    let hashes: Vec<u64> = layouts.into_iter().map(BlockLayout::compat_hash).collect();
    if let [one] = hashes.as_slice() {
        return *one;
    }
    let mut h = fnv1a(b"kvxfer-groups-v1", FNV_OFFSET);
    h = fnv1a(&(hashes.len() as u64).to_le_bytes(), h);
    for g in hashes {
        h = fnv1a(&g.to_le_bytes(), h);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_malformed_layouts() {
        assert_eq!(BlockLayout::new(4, vec![], "bf16", 16), Err(LayoutError::NoSegments));
        assert!(matches!(
            BlockLayout::new(4, vec![Segment { block_len: 8, stride: 4 }], "bf16", 16),
            Err(LayoutError::BadSegment { index: 0, .. })
        ));
        assert!(matches!(
            BlockLayout::new(4, vec![Segment::packed(0)], "bf16", 16),
            Err(LayoutError::BadSegment { .. })
        ));
        assert_eq!(
            BlockLayout::new(u32::MAX, vec![Segment::packed(u64::MAX / 2)], "bf16", 16),
            Err(LayoutError::Overflow)
        );
    }

    #[test]
    fn compat_hash_covers_what_peers_share_only() {
        let a =
            BlockLayout::new(10, vec![Segment::packed(64), Segment::packed(64)], "bf16", 16).expect("valid");
        let more_blocks = BlockLayout::new(
            99,
            vec![Segment { block_len: 64, stride: 128 }, Segment::packed(64)],
            "bf16",
            16,
        )
        .expect("valid");
        assert_eq!(a.compat_hash(), more_blocks.compat_hash());
        assert_eq!(groups_compat_hash([&a]), a.compat_hash());
        assert_eq!(groups_compat_hash([&a, &a]), groups_compat_hash([&more_blocks, &a]));
        let other_dtype =
            BlockLayout::new(10, vec![Segment::packed(64), Segment::packed(64)], "fp8", 16).expect("valid");
        assert_ne!(a.compat_hash(), other_dtype.compat_hash());
        let one_segment = BlockLayout::new(10, vec![Segment::packed(128)], "bf16", 16).expect("valid");
        assert_ne!(a.compat_hash(), one_segment.compat_hash());
        assert_ne!(groups_compat_hash([&a, &one_segment]), groups_compat_hash([&one_segment, &a]));
        assert_ne!(groups_compat_hash([&a, &a]), a.compat_hash());
        assert_eq!(a.block_bytes(), 128);
        assert_eq!(more_blocks.region_len(0), Some(128 * 98 + 64));
    }

    #[test]
    fn wire_round_trip() {
        let a = BlockLayout::new(7, vec![Segment { block_len: 3, stride: 5 }], "bf16", 32).expect("valid");
        assert_eq!(BlockLayout::from_wire(&a.to_wire()), Ok(a.clone()));
        assert_eq!(a.out_of_range([1, 7, 9, 6]), vec![7, 9]);
    }
}
