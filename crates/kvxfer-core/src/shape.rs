//! KV-cache shapes: what a transfer plan needs to know about one engine rank's KV cache.
//!
//! A shape describes, for one tensor-parallel rank of an engine, its KV-cache groups (each
//! with its own segments and block count, e.g. full attention and sliding window), and for
//! every segment the element layout inside a block, in HND order: the KV heads this rank
//! holds, then the block's tokens, then the head dimension. Head `h` of a block is
//! therefore one contiguous run of `block_tokens * head_dim * dtype_bytes` bytes, which is
//! what lets a plan read a head slice of a block as one range.
//!
//! How heads split over ranks follows vLLM: with at least as many KV heads as ranks, rank
//! `r` holds heads `r * K / tp .. (r + 1) * K / tp`; with fewer (GQA with few KV heads), each
//! head is replicated on `tp / K` consecutive ranks and rank `r` holds head `r * K / tp`.
//! MLA keeps one latent per token and layer, replicated on every rank (one "head").
//!
//! [`KvShapeSpec`] is the plain description (what a handshake would carry);
//! [`KvShape::new`] checks it, so a [`KvShape`] is always consistent.

use crate::error::ShapeError;
use crate::layout::{BlockLayout, Segment};

/// How a model's KV heads are held by an engine's tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvHeads {
    /// Multi-head or grouped-query attention with `total` KV heads, split over the ranks
    /// (or, with fewer heads than ranks, each replicated on `tp_size / total` ranks).
    Split {
        /// KV heads of the model (all ranks together).
        total: u32,
    },
    /// Multi-head latent attention: one latent per token and layer, replicated on every
    /// rank.
    Latent,
}

/// A range of KV heads `first .. first + count` (model-wide head indices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadRange {
    /// First head.
    pub first: u32,
    /// Number of heads.
    pub count: u32,
}

impl HeadRange {
    /// One past the last head.
    pub fn end(&self) -> u32 {
        self.first + self.count
    }

    /// Whether head `h` is in the range.
    pub fn contains(&self, h: u32) -> bool {
        h >= self.first && h < self.end()
    }
}

/// One segment of a group as described (a layer's K, V, or MLA latent cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSpec {
    /// Elements per head and token.
    pub head_dim: u32,
    /// Bytes between consecutive blocks in the segment's region; `None` for packed blocks.
    pub stride: Option<u64>,
}

impl SegmentSpec {
    /// A segment whose blocks are packed.
    pub fn packed(head_dim: u32) -> Self {
        SegmentSpec { head_dim, stride: None }
    }
}

/// One KV-cache group as described: its own block ids and segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    /// Blocks of this group on this rank.
    pub num_blocks: u32,
    /// The group's segments, in layer order (the same order on every peer).
    pub segments: Vec<SegmentSpec>,
}

/// The plain description of one engine rank's KV cache; [`KvShape::new`] checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvShapeSpec {
    /// Tensor-parallel size of the engine.
    pub tp_size: u32,
    /// This rank.
    pub tp_rank: u32,
    /// How KV heads are split over the ranks.
    pub heads: KvHeads,
    /// Tokens per block (every group).
    pub block_tokens: u32,
    /// Element type name (e.g. "bf16").
    pub dtype: String,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// The KV-cache groups.
    pub groups: Vec<GroupSpec>,
}

/// One segment of a checked shape: its block length on this rank and its stride.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentShape {
    head_dim: u32,
    head_bytes: u64,
    block_len: u64,
    stride: u64,
}

impl SegmentShape {
    /// Elements per head and token.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Bytes of one head in one block: `block_tokens * head_dim * dtype_bytes`.
    pub fn head_bytes(&self) -> u64 {
        self.head_bytes
    }
    /// Bytes of one block on this rank (all its heads).
    pub fn block_len(&self) -> u64 {
        self.block_len
    }
    /// Bytes between consecutive blocks.
    pub fn stride(&self) -> u64 {
        self.stride
    }
}

/// One rank's KV cache, checked: heads split evenly, sizes non-zero, strides long enough,
/// nothing overflows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvShape {
    spec: KvShapeSpec,
    heads_per_rank: u32,
    segments: Vec<Vec<SegmentShape>>,
    layouts: Vec<BlockLayout>,
}

impl KvShape {
    /// Checks a description.
    pub fn new(spec: KvShapeSpec) -> Result<Self, ShapeError> {
        if spec.tp_size == 0 {
            return Err(ShapeError::Zero("tp_size"));
        }
        if spec.tp_rank >= spec.tp_size {
            return Err(ShapeError::RankOutOfRange { tp_rank: spec.tp_rank, tp_size: spec.tp_size });
        }
        let heads_per_rank = match spec.heads {
            KvHeads::Latent => 1,
            KvHeads::Split { total: 0 } => return Err(ShapeError::Zero("total_kv_heads")),
            KvHeads::Split { total } if total >= spec.tp_size && total % spec.tp_size == 0 => {
                total / spec.tp_size
            }
            KvHeads::Split { total } if total < spec.tp_size && spec.tp_size.is_multiple_of(total) => 1,
            KvHeads::Split { total } => {
                return Err(ShapeError::HeadsNotDivisible { total_kv_heads: total, tp_size: spec.tp_size })
            }
        };
        if spec.block_tokens == 0 {
            return Err(ShapeError::Zero("block_tokens"));
        }
        if spec.dtype_bytes == 0 {
            return Err(ShapeError::Zero("dtype_bytes"));
        }
        if spec.dtype.is_empty() {
            return Err(ShapeError::Zero("dtype"));
        }
        if spec.groups.is_empty() {
            return Err(ShapeError::NoGroups);
        }
        let mut segments = Vec::with_capacity(spec.groups.len());
        let mut layouts = Vec::with_capacity(spec.groups.len());
        for (group, g) in spec.groups.iter().enumerate() {
            if g.segments.is_empty() {
                return Err(ShapeError::NoSegments { group });
            }
            let mut shapes = Vec::with_capacity(g.segments.len());
            for (segment, s) in g.segments.iter().enumerate() {
                if s.head_dim == 0 {
                    return Err(ShapeError::ZeroHeadDim { group, segment });
                }
                let head_bytes = u64::from(spec.block_tokens)
                    .checked_mul(u64::from(s.head_dim))
                    .and_then(|x| x.checked_mul(u64::from(spec.dtype_bytes)))
                    .ok_or(ShapeError::Overflow)?;
                let block_len =
                    head_bytes.checked_mul(u64::from(heads_per_rank)).ok_or(ShapeError::Overflow)?;
                let stride = s.stride.unwrap_or(block_len);
                if stride < block_len {
                    return Err(ShapeError::StrideTooShort { group, segment, stride, block_len });
                }
                shapes.push(SegmentShape { head_dim: s.head_dim, head_bytes, block_len, stride });
            }
            let layout = BlockLayout::new(
                g.num_blocks,
                shapes.iter().map(|s| Segment { block_len: s.block_len, stride: s.stride }).collect(),
                spec.dtype.clone(),
                spec.block_tokens,
            )
            .map_err(|_| ShapeError::Overflow)?;
            segments.push(shapes);
            layouts.push(layout);
        }
        Ok(KvShape { spec, heads_per_rank, segments, layouts })
    }

    /// The description this shape was checked from.
    pub fn spec(&self) -> &KvShapeSpec {
        &self.spec
    }
    /// Tensor-parallel size of the engine.
    pub fn tp_size(&self) -> u32 {
        self.spec.tp_size
    }
    /// This rank.
    pub fn tp_rank(&self) -> u32 {
        self.spec.tp_rank
    }
    /// How KV heads are split over the ranks.
    pub fn kv_heads(&self) -> KvHeads {
        self.spec.heads
    }
    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.spec.block_tokens
    }
    /// Element type name.
    pub fn dtype(&self) -> &str {
        &self.spec.dtype
    }
    /// Bytes per element.
    pub fn dtype_bytes(&self) -> u32 {
        self.spec.dtype_bytes
    }
    /// Number of KV-cache groups.
    pub fn num_groups(&self) -> usize {
        self.segments.len()
    }
    /// Blocks of group `group` (`None` past the last group).
    pub fn num_blocks(&self, group: usize) -> Option<u32> {
        self.spec.groups.get(group).map(|g| g.num_blocks)
    }
    /// The segments of group `group` (empty past the last group).
    pub fn segments(&self, group: usize) -> &[SegmentShape] {
        self.segments.get(group).map_or(&[], Vec::as_slice)
    }
    /// Heads every rank holds.
    pub fn heads_per_rank(&self) -> u32 {
        self.heads_per_rank
    }
    /// The heads rank `rank` of this engine holds (`None` if there is no such rank).
    pub fn heads_of_rank(&self, rank: u32) -> Option<HeadRange> {
        (rank < self.spec.tp_size).then(|| self.heads_of(rank))
    }
    /// The heads this rank holds.
    pub fn local_heads(&self) -> HeadRange {
        self.heads_of(self.spec.tp_rank)
    }
    pub(crate) fn heads_of(&self, rank: u32) -> HeadRange {
        let first = match self.spec.heads {
            KvHeads::Latent => 0,
            // In u64: rank * total may not fit in u32; the quotient is below `total`.
            KvHeads::Split { total } => {
                (u64::from(rank) * u64::from(total) / u64::from(self.spec.tp_size)) as u32
            }
        };
        HeadRange { first, count: self.heads_per_rank }
    }
    /// Group `group` as a [`BlockLayout`] (one segment per layer, this rank's block
    /// lengths and strides): what registers the group's memory (`KvMemory`).
    pub fn block_layout(&self, group: usize) -> Option<&BlockLayout> {
        self.layouts.get(group)
    }
}

impl KvShapeSpec {
    /// The wire form (what a handshake carries).
    pub fn to_wire(&self) -> kvxfer_proto::v1::KvShape {
        use kvxfer_proto::v1;
        let (total_kv_heads, latent) = match self.heads {
            KvHeads::Split { total } => (total, false),
            KvHeads::Latent => (0, true),
        };
        v1::KvShape {
            tp_size: self.tp_size,
            tp_rank: self.tp_rank,
            total_kv_heads,
            latent,
            block_tokens: self.block_tokens,
            dtype: self.dtype.clone(),
            dtype_bytes: self.dtype_bytes,
            groups: self
                .groups
                .iter()
                .map(|g| v1::KvShapeGroup {
                    num_blocks: g.num_blocks,
                    segments: g
                        .segments
                        .iter()
                        .map(|s| v1::KvShapeSegment { head_dim: s.head_dim, stride: s.stride.unwrap_or(0) })
                        .collect(),
                })
                .collect(),
        }
    }

    /// Reads the wire form (check it with [`KvShape::new`]).
    pub fn from_wire(w: &kvxfer_proto::v1::KvShape) -> Self {
        KvShapeSpec {
            tp_size: w.tp_size,
            tp_rank: w.tp_rank,
            heads: if w.latent { KvHeads::Latent } else { KvHeads::Split { total: w.total_kv_heads } },
            block_tokens: w.block_tokens,
            dtype: w.dtype.clone(),
            dtype_bytes: w.dtype_bytes,
            groups: w
                .groups
                .iter()
                .map(|g| GroupSpec {
                    num_blocks: g.num_blocks,
                    segments: g
                        .segments
                        .iter()
                        .map(|s| SegmentSpec {
                            head_dim: s.head_dim,
                            stride: (s.stride != 0).then_some(s.stride),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

impl KvShape {
    /// Whether `layouts` (one per group, as registered memory has them) are exactly this
    /// shape's block layouts: block counts, per-segment block lengths and strides, dtype and
    /// tokens per block.
    pub fn matches_layouts<'a>(&self, layouts: impl IntoIterator<Item = &'a BlockLayout>) -> bool {
        let mut n = 0;
        for (g, l) in layouts.into_iter().enumerate() {
            n += 1;
            if self.block_layout(g) != Some(l) {
                return false;
            }
        }
        n == self.num_groups()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tp_size: u32, tp_rank: u32, heads: KvHeads) -> KvShapeSpec {
        KvShapeSpec {
            tp_size,
            tp_rank,
            heads,
            block_tokens: 16,
            dtype: "bf16".into(),
            dtype_bytes: 2,
            groups: vec![GroupSpec { num_blocks: 8, segments: vec![SegmentSpec::packed(128); 2] }],
        }
    }

    #[test]
    fn heads_split_and_replicate_like_vllm() {
        // 8 heads over 4 ranks: two each.
        let s = KvShape::new(spec(4, 3, KvHeads::Split { total: 8 })).expect("shape");
        assert_eq!(s.local_heads(), HeadRange { first: 6, count: 2 });
        assert_eq!(s.segments(0)[0].block_len(), 2 * 16 * 128 * 2);
        // 2 heads over 8 ranks: each head on 4 consecutive ranks.
        let s = KvShape::new(spec(8, 5, KvHeads::Split { total: 2 })).expect("shape");
        assert_eq!(s.local_heads(), HeadRange { first: 1, count: 1 });
        assert_eq!(s.heads_of_rank(3), Some(HeadRange { first: 0, count: 1 }));
        assert_eq!(s.heads_of_rank(8), None);
        // MLA: one latent everywhere.
        let s = KvShape::new(spec(4, 2, KvHeads::Latent)).expect("shape");
        assert_eq!(s.local_heads(), HeadRange { first: 0, count: 1 });
        assert_eq!(s.block_layout(0).map(|l| l.block_bytes()), Some(2 * 16 * 128 * 2));
    }

    #[test]
    fn wire_round_trip() {
        for heads in [KvHeads::Split { total: 8 }, KvHeads::Latent] {
            let mut sp = spec(4, 3, heads);
            sp.groups[0].segments[1].stride = Some(1 << 20);
            assert_eq!(KvShapeSpec::from_wire(&sp.to_wire()), sp);
            let shape = KvShape::new(sp).expect("shape");
            let layouts: Vec<BlockLayout> = shape.block_layout(0).into_iter().cloned().collect();
            assert!(shape.matches_layouts(&layouts));
            assert!(!shape.matches_layouts(&[]));
        }
    }

    #[test]
    fn refuses_inconsistent_descriptions() {
        assert_eq!(
            KvShape::new(spec(4, 1, KvHeads::Split { total: 6 })),
            Err(ShapeError::HeadsNotDivisible { total_kv_heads: 6, tp_size: 4 })
        );
        assert_eq!(
            KvShape::new(spec(4, 1, KvHeads::Split { total: 3 })),
            Err(ShapeError::HeadsNotDivisible { total_kv_heads: 3, tp_size: 4 })
        );
        assert_eq!(
            KvShape::new(spec(2, 2, KvHeads::Latent)),
            Err(ShapeError::RankOutOfRange { tp_rank: 2, tp_size: 2 })
        );
        assert_eq!(KvShape::new(spec(0, 0, KvHeads::Latent)), Err(ShapeError::Zero("tp_size")));
        assert_eq!(
            KvShape::new(spec(1, 0, KvHeads::Split { total: 0 })),
            Err(ShapeError::Zero("total_kv_heads"))
        );
        let mut s = spec(1, 0, KvHeads::Latent);
        s.groups[0].segments[1].stride = Some(100);
        assert_eq!(
            KvShape::new(s),
            Err(ShapeError::StrideTooShort { group: 0, segment: 1, stride: 100, block_len: 16 * 128 * 2 })
        );
        let mut s = spec(1, 0, KvHeads::Latent);
        s.groups.push(GroupSpec { num_blocks: 4, segments: vec![] });
        assert_eq!(KvShape::new(s), Err(ShapeError::NoSegments { group: 1 }));
        let mut s = spec(1, 0, KvHeads::Latent);
        s.groups[0].segments[0].head_dim = 0;
        assert_eq!(KvShape::new(s), Err(ShapeError::ZeroHeadDim { group: 0, segment: 0 }));
        let mut s = spec(1, 0, KvHeads::Latent);
        s.block_tokens = u32::MAX;
        s.dtype_bytes = u32::MAX;
        s.groups[0].segments[0].head_dim = u32::MAX;
        assert_eq!(KvShape::new(s), Err(ShapeError::Overflow));
        let mut s = spec(1, 0, KvHeads::Latent);
        s.groups.clear();
        assert_eq!(KvShape::new(s), Err(ShapeError::NoGroups));
    }
}
