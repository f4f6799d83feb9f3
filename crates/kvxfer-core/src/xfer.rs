//! Transfer plans between engines whose KV caches differ in tensor parallelism and block
//! size, with several KV-cache groups.
//!
//! [`TransferPair::new`] checks a prefill shape against a decode rank's shape and refuses
//! only what no plan can serve ([`CompatError`] names the field and both values). Then
//! [`TransferPair::plan`] maps every destination byte of the decode rank's requested blocks
//! to the prefill rank, remote block and byte it comes from:
//!
//! - **Decode TP ≥ prefill TP**: decode rank `d` reads its head slice of every block from
//!   prefill rank `d / (decode_tp / prefill_tp)`, the one rank holding those heads.
//! - **Prefill TP > decode TP**: decode rank `d` is served by prefill ranks
//!   `d * r .. (d + 1) * r` (`r = prefill_tp / decode_tp`) and assembles each block from
//!   their slices. A head that several of them hold (GQA with fewer KV heads than prefill
//!   ranks, or MLA's replicated latent) is read once, from the first; a rank left with
//!   nothing to read is *notify-only*: its lease gets a notification but no read.
//! - **Block ratio `k`** (decode block tokens = `k` × prefill block tokens): remote block
//!   `i` of a group lands in local block `i / k` at token slot `i % k`. In HND order every
//!   head of a decode block holds `k` prefill blocks' worth of that head's tokens, so each
//!   remote block scatters head by head straight into place (no staging, no permute).
//!
//! Each prefill rank is notified by [`expected_consumers`] decode ranks: `decode_tp /
//! prefill_tp` when decode is wider, else exactly one.
//!
//! A plan is kept factored — per group the block pairing as [`PairRun`]s, per source rank
//! and segment the byte [`Slice`]s of one block pair — so building it costs O(blocks +
//! segments × heads), never per byte; [`RankPlan::pieces`] expands it lazily into
//! [`Piece`]s, each contiguous on both sides.

use std::fmt;
use std::ops::Range;

use crate::error::{CompatError, CompatField, RankPlanError, Side, MAX_IDS_SHOWN};
use crate::shape::{HeadRange, KvHeads, KvShape};
use crate::BlockId;

/// How many decode ranks will notify each prefill rank's lease of a request: the
/// `expected_consumers` to lease with. `decode_tp / prefill_tp` when the decode engine is
/// wider (each prefill rank serves that many head slices), else 1 (each prefill rank belongs
/// to exactly one decode rank, which reads it or only notifies it). Refuses TP sizes that do
/// not divide one another.
pub fn expected_consumers(prefill_tp: u32, decode_tp: u32) -> Result<u32, CompatError> {
    check_tp(prefill_tp, decode_tp)?;
    Ok(if decode_tp > prefill_tp { decode_tp / prefill_tp } else { 1 })
}

fn check_tp(prefill: u32, decode: u32) -> Result<(), CompatError> {
    let (lo, hi) = (prefill.min(decode), prefill.max(decode));
    if lo == 0 || hi % lo != 0 {
        return Err(CompatError::TpNotDivisible { prefill, decode });
    }
    Ok(())
}

struct HeadsShown(KvHeads);

impl fmt::Display for HeadsShown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            KvHeads::Split { total } => write!(f, "{total} split KV heads"),
            KvHeads::Latent => f.write_str("an MLA latent"),
        }
    }
}

/// A prefill engine's shape and one decode rank's shape, checked compatible: what that
/// decode rank's plans are built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPair {
    prefill: KvShape,
    decode: KvShape,
    block_ratio: u32,
}

impl TransferPair {
    /// Pairs the shape of a prefill engine (any of its ranks: they differ only in
    /// `tp_rank`) with the shape of the decode rank that will pull. Refuses, naming the
    /// field and both values: different attention (split heads vs MLA latent), total KV
    /// heads, dtype or element size, group count, segment count of a group, head dimension
    /// of a segment; TP sizes that do not divide one another; decode blocks smaller than, or
    /// not a multiple of, prefill blocks.
    pub fn new(prefill: &KvShape, decode: &KvShape) -> Result<Self, CompatError> {
        fn differs(field: CompatField, p: impl fmt::Display, d: impl fmt::Display) -> CompatError {
            CompatError::Differs { field, prefill: p.to_string(), decode: d.to_string() }
        }
        match (prefill.kv_heads(), decode.kv_heads()) {
            (KvHeads::Split { total: p }, KvHeads::Split { total: d }) if p != d => {
                return Err(differs(CompatField::TotalKvHeads, p, d));
            }
            (p @ KvHeads::Split { .. }, d @ KvHeads::Latent)
            | (p @ KvHeads::Latent, d @ KvHeads::Split { .. }) => {
                return Err(differs(CompatField::Attention, HeadsShown(p), HeadsShown(d)));
            }
            _ => {}
        }
        if prefill.dtype() != decode.dtype() {
            return Err(differs(CompatField::Dtype, prefill.dtype(), decode.dtype()));
        }
        if prefill.dtype_bytes() != decode.dtype_bytes() {
            return Err(differs(CompatField::DtypeBytes, prefill.dtype_bytes(), decode.dtype_bytes()));
        }
        if prefill.num_groups() != decode.num_groups() {
            return Err(differs(CompatField::Groups, prefill.num_groups(), decode.num_groups()));
        }
        for group in 0..prefill.num_groups() {
            let (ps, ds) = (prefill.segments(group), decode.segments(group));
            if ps.len() != ds.len() {
                return Err(differs(CompatField::Segments { group }, ps.len(), ds.len()));
            }
            for (segment, (p, d)) in ps.iter().zip(ds).enumerate() {
                if p.head_dim() != d.head_dim() {
                    return Err(differs(CompatField::HeadDim { group, segment }, p.head_dim(), d.head_dim()));
                }
            }
        }
        check_tp(prefill.tp_size(), decode.tp_size())?;
        let (pb, db) = (prefill.block_tokens(), decode.block_tokens());
        if db < pb {
            return Err(CompatError::DecodeBlockSmaller { prefill: pb, decode: db });
        }
        if db % pb != 0 {
            return Err(CompatError::BlockRatioNotInteger { prefill: pb, decode: db });
        }
        Ok(TransferPair { prefill: prefill.clone(), decode: decode.clone(), block_ratio: db / pb })
    }

    /// The prefill shape.
    pub fn prefill(&self) -> &KvShape {
        &self.prefill
    }
    /// The decode rank's shape.
    pub fn decode(&self) -> &KvShape {
        &self.decode
    }
    /// Decode block tokens / prefill block tokens (≥ 1).
    pub fn block_ratio(&self) -> u32 {
        self.block_ratio
    }
    /// The `expected_consumers` of every prefill rank's lease (see [`expected_consumers`]).
    pub fn expected_consumers(&self) -> u32 {
        let (p, d) = (self.prefill.tp_size(), self.decode.tp_size());
        if d > p {
            d / p
        } else {
            1
        }
    }
    /// The prefill ranks this decode rank reads from or notifies: every one of them gets
    /// exactly one notification from it per request.
    pub fn source_ranks(&self) -> Range<u32> {
        let (p, d, rank) = (self.prefill.tp_size(), self.decode.tp_size(), self.decode.tp_rank());
        if d >= p {
            let first = rank / (d / p);
            first..first + 1
        } else {
            let r = p / d;
            rank * r..(rank + 1) * r
        }
    }

    /// Which heads this decode rank reads from which source rank (in rank order), and the
    /// source ranks it reads nothing from.
    fn assign_heads(&self) -> (Vec<(u32, HeadRange)>, Vec<u32>) {
        let need = self.decode.local_heads();
        // Heads below `next` are already read from an earlier source rank. Source ranks
        // hold ascending head ranges, so what is left of a rank's heads is one range.
        let mut next = need.first;
        let (mut reads, mut notify_only) = (Vec::new(), Vec::new());
        for p in self.source_ranks() {
            let have = self.prefill.heads_of(p);
            let (lo, hi) = (have.first.max(next), have.end().min(need.end()));
            if lo < hi {
                reads.push((p, HeadRange { first: lo, count: hi - lo }));
                next = hi;
            } else {
                notify_only.push(p);
            }
        }
        debug_assert_eq!(next, need.end(), "the source ranks cover the decode rank's heads");
        (reads, notify_only)
    }

    fn segment_maps(&self, group: usize, source: u32, heads: HeadRange) -> Vec<SegmentMap> {
        let remote_first = self.prefill.heads_of(source).first;
        let local_first = self.decode.local_heads().first;
        let k = u64::from(self.block_ratio);
        self.prefill
            .segments(group)
            .iter()
            .map(|seg| {
                // Bytes of one head in one prefill block; a decode block's head holds k of them.
                let c = seg.head_bytes();
                let remote_offset = u64::from(heads.first - remote_first) * c;
                let remote_len = u64::from(heads.count) * c;
                let slices = if k == 1 {
                    // The heads are adjacent on both sides: one slice.
                    vec![Slice {
                        remote_offset,
                        local_offset: u64::from(heads.first - local_first) * c,
                        len: remote_len,
                    }]
                } else {
                    (heads.first..heads.end())
                        .map(|h| Slice {
                            remote_offset: u64::from(h - remote_first) * c,
                            local_offset: u64::from(h - local_first) * k * c,
                            len: c,
                        })
                        .collect()
                };
                SegmentMap { remote_offset, remote_len, slices, slot_step: c }
            })
            .collect()
    }

    /// Plans this decode rank's pull of one request: `groups[g] = (remote blocks, local
    /// blocks)` of KV-cache group `g` (the same lists for every rank of either engine, as
    /// vLLM's schedulers allocate them). Remote block `i` of a group lands in local block
    /// `i / block_ratio`, so the local list must be `ceil(remote / block_ratio)` long. Ids
    /// outside either side's group and local ids listed twice are refused.
    pub fn plan(&self, groups: &[(&[BlockId], &[BlockId])]) -> Result<RankPlan, RankPlanError> {
        let expected = self.prefill.num_groups();
        if groups.len() != expected {
            return Err(RankPlanError::GroupCount { expected, got: groups.len() });
        }
        let k = self.block_ratio;
        let mut runs = Vec::with_capacity(groups.len());
        let mut moves_bytes = false;
        for (group, (remote, local)) in groups.iter().enumerate() {
            if local.len() != remote.len().div_ceil(k as usize) {
                return Err(RankPlanError::BlockCount {
                    group,
                    remote: remote.len(),
                    local: local.len(),
                    ratio: k,
                });
            }
            let remote_blocks = self.prefill.num_blocks(group).unwrap_or(0);
            let local_blocks = self.decode.num_blocks(group).unwrap_or(0);
            check_range(group, remote, remote_blocks, Side::Remote)?;
            check_range(group, local, local_blocks, Side::Local)?;
            check_distinct(group, local, local_blocks)?;
            runs.push(pair_runs(remote, local, k));
            moves_bytes |= !remote.is_empty();
        }
        let (assigned, mut notify_only) = self.assign_heads();
        let reads = if moves_bytes {
            assigned
                .into_iter()
                .map(|(source_rank, heads)| SourceRead {
                    source_rank,
                    heads,
                    segments: (0..groups.len()).map(|g| self.segment_maps(g, source_rank, heads)).collect(),
                })
                .collect()
        } else {
            // Nothing to read (e.g. every block already cached): every source is only notified.
            notify_only.extend(assigned.iter().map(|&(p, _)| p));
            notify_only.sort_unstable();
            Vec::new()
        };
        Ok(RankPlan { decode_rank: self.decode.tp_rank(), block_ratio: k, runs, reads, notify_only })
    }
}

fn check_range(group: usize, ids: &[BlockId], num_blocks: u32, side: Side) -> Result<(), RankPlanError> {
    let bad: Vec<BlockId> = ids.iter().copied().filter(|&b| b >= num_blocks).take(MAX_IDS_SHOWN).collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(RankPlanError::OutOfRange { group, side, ids: bad, num_blocks })
    }
}

/// Refuses a local id listed twice; ids are already checked below `num_blocks`. A bitset
/// over the group's blocks when that is small next to the list, else a sorted copy.
fn check_distinct(group: usize, ids: &[BlockId], num_blocks: u32) -> Result<(), RankPlanError> {
    if ids.len() < 2 {
        return Ok(());
    }
    let words = (num_blocks as usize).div_ceil(64);
    if words > ids.len().saturating_mul(4).max(1024) {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        return match sorted.windows(2).find(|w| w[0] == w[1]) {
            Some(w) => Err(RankPlanError::DuplicateLocal { group, block: w[0] }),
            None => Ok(()),
        };
    }
    let mut seen = vec![0u64; words];
    for &b in ids {
        let (word, bit) = ((b / 64) as usize, 1u64 << (b % 64));
        if seen[word] & bit != 0 {
            return Err(RankPlanError::DuplicateLocal { group, block: b });
        }
        seen[word] |= bit;
    }
    Ok(())
}

/// Pairs remote block `i` with local block `i / k`, token slot `i % k`, merging neighbours
/// consecutive on both sides. (Pairs come in index order, so a run's next slot is always
/// `i % k`; only the blocks need checking.)
fn pair_runs(remote: &[BlockId], local: &[BlockId], k: u32) -> Vec<PairRun> {
    let mut runs: Vec<PairRun> = Vec::new();
    let kk = k as usize;
    for (i, &r) in remote.iter().enumerate() {
        let (l, slot) = (local[i / kk], (i % kk) as u32);
        if let Some(last) = runs.last_mut() {
            let pos = u64::from(last.first_slot) + u64::from(last.count);
            if u64::from(last.remote_start) + u64::from(last.count) == u64::from(r)
                && u64::from(last.local_start) + pos / u64::from(k) == u64::from(l)
            {
                last.count += 1;
                continue;
            }
        }
        runs.push(PairRun { remote_start: r, local_start: l, first_slot: slot, count: 1 });
    }
    runs
}

/// `count` remote blocks `remote_start..` into consecutive local token slots: element `t`
/// goes to local block `local_start + (first_slot + t) / k`, slot `(first_slot + t) % k`
/// (`k` = block ratio; with `k = 1` this is a run of blocks consecutive on both sides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairRun {
    /// First remote block.
    pub remote_start: BlockId,
    /// Local block of the first element.
    pub local_start: BlockId,
    /// Token slot (in prefill blocks) of the first element in its local block.
    pub first_slot: u32,
    /// Number of remote blocks.
    pub count: u32,
}

impl PairRun {
    /// Element `t` (below `count`) at block ratio `k`: (remote block, local block, slot).
    pub fn element(&self, t: u32, k: u32) -> (BlockId, BlockId, u32) {
        let pos = u64::from(self.first_slot) + u64::from(t);
        let k = u64::from(k.max(1));
        let remote = (u64::from(self.remote_start) + u64::from(t)) as BlockId;
        let local = (u64::from(self.local_start) + pos / k) as BlockId;
        (remote, local, (pos % k) as u32)
    }
}

/// Bytes of one block pair that a source contributes, for one segment: at token slot `j`,
/// slice `s` copies `s.len` bytes from `s.remote_offset` in the remote block to
/// `s.local_offset + j * slot_step` in the local block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentMap {
    /// Where the source's bytes start in the remote block (its heads, one contiguous range).
    pub remote_offset: u64,
    /// Their length.
    pub remote_len: u64,
    /// Where they land, in remote order (one slice per head when the block ratio is > 1,
    /// else one slice).
    pub slices: Vec<Slice>,
    /// Bytes of one head of one prefill block: how far a token slot moves a slice.
    pub slot_step: u64,
}

/// `len` bytes at `remote_offset` in a remote block to `local_offset` in a local block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// Offset in the remote block.
    pub remote_offset: u64,
    /// Offset in the local block (token slot 0).
    pub local_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What a decode rank reads from one prefill rank: the same heads of every block of every
/// group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceRead {
    source_rank: u32,
    heads: HeadRange,
    segments: Vec<Vec<SegmentMap>>,
}

impl SourceRead {
    /// The prefill rank read from.
    pub fn source_rank(&self) -> u32 {
        self.source_rank
    }
    /// The heads read from it (model-wide head indices).
    pub fn heads(&self) -> HeadRange {
        self.heads
    }
    /// Per segment of `group`, what one block pair moves (empty past the last group).
    pub fn segment_maps(&self, group: usize) -> &[SegmentMap] {
        self.segments.get(group).map_or(&[], Vec::as_slice)
    }
}

/// One contiguous copy, repeated over `blocks` consecutive blocks on both sides:
/// `len` bytes at `remote_offset` of block `remote_block + t` (segment `segment` of group
/// `group`, prefill rank `source_rank`) to `local_offset` of local block `local_block + t`,
/// for `t` in `0..blocks`. Never crosses a block boundary on either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The prefill rank.
    pub source_rank: u32,
    /// The KV-cache group.
    pub group: usize,
    /// The segment (same index on both sides).
    pub segment: usize,
    /// First remote block.
    pub remote_block: BlockId,
    /// Offset in the remote block.
    pub remote_offset: u64,
    /// First local block.
    pub local_block: BlockId,
    /// Offset in the local block.
    pub local_offset: u64,
    /// Bytes per block.
    pub len: u64,
    /// Consecutive blocks (1 unless the block ratio is 1).
    pub blocks: u32,
}

/// One decode rank's plan for one request: every destination byte of its requested local
/// blocks, once, from the right prefill rank, block and byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    decode_rank: u32,
    block_ratio: u32,
    runs: Vec<Vec<PairRun>>,
    reads: Vec<SourceRead>,
    notify_only: Vec<u32>,
}

impl RankPlan {
    /// The decode rank this plan is for.
    pub fn decode_rank(&self) -> u32 {
        self.decode_rank
    }
    /// Decode block tokens / prefill block tokens.
    pub fn block_ratio(&self) -> u32 {
        self.block_ratio
    }
    /// Per group, the block pairing (the same for every source rank).
    pub fn runs(&self) -> &[Vec<PairRun>] {
        &self.runs
    }
    /// The prefill ranks read from, in rank order, and what each contributes.
    pub fn reads(&self) -> &[SourceRead] {
        &self.reads
    }
    /// Prefill ranks whose leases must be notified but never read: their heads come from
    /// another rank (replicated heads, MLA), or the request moves no bytes.
    pub fn notify_only(&self) -> &[u32] {
        &self.notify_only
    }
    /// Every prefill rank to notify once the pull is done, in rank order: the ones read and
    /// the notify-only ones.
    pub fn notify_ranks(&self) -> Vec<u32> {
        let mut all: Vec<u32> =
            self.reads.iter().map(|r| r.source_rank).chain(self.notify_only.iter().copied()).collect();
        all.sort_unstable();
        all
    }
    /// Whether the plan moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.reads.is_empty()
    }
    /// Bytes the plan moves (every destination byte once).
    pub fn bytes(&self) -> u64 {
        self.reads
            .iter()
            .map(|read| {
                read.segments
                    .iter()
                    .zip(&self.runs)
                    .map(|(maps, runs)| {
                        let blocks: u64 = runs.iter().map(|r| u64::from(r.count)).sum();
                        blocks * maps.iter().map(|m| m.remote_len).sum::<u64>()
                    })
                    .sum::<u64>()
            })
            .sum()
    }
    /// The plan as contiguous copies: per source rank, per group, per run, per segment,
    /// per block of the run (one piece for a whole run at block ratio 1), per slice. Within
    /// one source, run and segment, pieces come in ascending remote offsets.
    pub fn pieces(&self) -> impl Iterator<Item = Piece> + '_ {
        let k = self.block_ratio;
        self.reads.iter().flat_map(move |read| {
            let source_rank = read.source_rank;
            read.segments.iter().zip(&self.runs).enumerate().flat_map(move |(group, (maps, runs))| {
                runs.iter().flat_map(move |run| {
                    maps.iter().enumerate().flat_map(move |(segment, map)| {
                        let (elements, blocks) = if k == 1 { (1, run.count) } else { (run.count, 1) };
                        (0..elements).flat_map(move |t| {
                            let (remote_block, local_block, slot) = run.element(t, k);
                            map.slices.iter().map(move |s| Piece {
                                source_rank,
                                group,
                                segment,
                                remote_block,
                                remote_offset: s.remote_offset,
                                local_block,
                                local_offset: s.local_offset + u64::from(slot) * map.slot_step,
                                len: s.len,
                                blocks,
                            })
                        })
                    })
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{GroupSpec, KvShapeSpec, SegmentSpec};

    /// head_dim 4, bf16: one head of one block is `8 * block_tokens` bytes.
    fn shape(
        tp_size: u32,
        tp_rank: u32,
        heads: KvHeads,
        block_tokens: u32,
        groups: &[(u32, usize)],
    ) -> KvShape {
        KvShape::new(KvShapeSpec {
            tp_size,
            tp_rank,
            heads,
            block_tokens,
            dtype: "bf16".into(),
            dtype_bytes: 2,
            groups: groups
                .iter()
                .map(|&(num_blocks, segments)| GroupSpec {
                    num_blocks,
                    segments: vec![SegmentSpec::packed(4); segments],
                })
                .collect(),
        })
        .expect("valid shape")
    }

    fn piece(
        source_rank: u32,
        (group, segment): (usize, usize),
        (remote_block, remote_offset): (BlockId, u64),
        (local_block, local_offset): (BlockId, u64),
        len: u64,
        blocks: u32,
    ) -> Piece {
        Piece {
            source_rank,
            group,
            segment,
            remote_block,
            remote_offset,
            local_block,
            local_offset,
            len,
            blocks,
        }
    }

    const FOUR: KvHeads = KvHeads::Split { total: 4 };

    #[test]
    fn tp_1_to_2_reads_each_ranks_head_slice() {
        let prefill = shape(1, 0, FOUR, 2, &[(16, 2)]);
        // Decode rank 1 holds heads 2 and 3: bytes 32..64 of each 64-byte prefill block.
        let pair = TransferPair::new(&prefill, &shape(2, 1, FOUR, 2, &[(16, 2)])).expect("compatible");
        assert_eq!(pair.expected_consumers(), 2);
        assert_eq!(pair.source_ranks(), 0..1);
        let plan = pair.plan(&[(&[5, 6, 7], &[0, 1, 3])]).expect("plan");
        assert_eq!(
            plan.pieces().collect::<Vec<_>>(),
            vec![
                piece(0, (0, 0), (5, 32), (0, 0), 32, 2),
                piece(0, (0, 1), (5, 32), (0, 0), 32, 2),
                piece(0, (0, 0), (7, 32), (3, 0), 32, 1),
                piece(0, (0, 1), (7, 32), (3, 0), 32, 1),
            ]
        );
        assert_eq!(plan.bytes(), 3 * 2 * 32);
        assert!(plan.notify_only().is_empty());
        assert_eq!(plan.notify_ranks(), vec![0]);
    }

    #[test]
    fn tp_2_to_1_assembles_blocks_from_both_ranks() {
        let pair = TransferPair::new(&shape(2, 1, FOUR, 2, &[(16, 1)]), &shape(1, 0, FOUR, 2, &[(16, 1)]))
            .expect("pair");
        assert_eq!(pair.expected_consumers(), 1);
        let plan = pair.plan(&[(&[3], &[9])]).expect("plan");
        assert_eq!(
            plan.pieces().collect::<Vec<_>>(),
            vec![piece(0, (0, 0), (3, 0), (9, 0), 32, 1), piece(1, (0, 0), (3, 0), (9, 32), 32, 1)]
        );
        assert_eq!(
            plan.reads().iter().map(|r| r.heads()).collect::<Vec<_>>(),
            vec![HeadRange { first: 0, count: 2 }, HeadRange { first: 2, count: 2 }]
        );
        assert_eq!(plan.notify_ranks(), vec![0, 1]);
    }

    #[test]
    fn block_ratio_2_scatters_each_head_into_its_token_slot() {
        let two = KvHeads::Split { total: 2 };
        // Prefill: 2 tokens per block, a head is 16 bytes; decode: 4 tokens, a head is 32.
        let pair = TransferPair::new(&shape(1, 0, two, 2, &[(16, 1)]), &shape(1, 0, two, 4, &[(8, 1)]))
            .expect("pair");
        assert_eq!(pair.block_ratio(), 2);
        let plan = pair.plan(&[(&[10, 11, 12], &[3, 4])]).expect("plan");
        assert_eq!(
            plan.runs(),
            &[vec![PairRun { remote_start: 10, local_start: 3, first_slot: 0, count: 3 }]]
        );
        assert_eq!(
            plan.pieces().collect::<Vec<_>>(),
            vec![
                piece(0, (0, 0), (10, 0), (3, 0), 16, 1),
                piece(0, (0, 0), (10, 16), (3, 32), 16, 1),
                piece(0, (0, 0), (11, 0), (3, 16), 16, 1),
                piece(0, (0, 0), (11, 16), (3, 48), 16, 1),
                piece(0, (0, 0), (12, 0), (4, 0), 16, 1),
                piece(0, (0, 0), (12, 16), (4, 32), 16, 1),
            ]
        );
        // Local block 4's second slot has no remote block: left alone.
        assert_eq!(plan.bytes(), 3 * 32);
        assert!(matches!(
            pair.plan(&[(&[10, 11, 12], &[3])]),
            Err(RankPlanError::BlockCount { group: 0, remote: 3, local: 1, ratio: 2 })
        ));
    }

    #[test]
    fn mla_tp_2_to_1_at_block_ratio_4_reads_one_rank_and_notifies_the_other() {
        let prefill = shape(2, 0, KvHeads::Latent, 1, &[(16, 2)]);
        let pair = TransferPair::new(&prefill, &shape(1, 0, KvHeads::Latent, 4, &[(16, 2)])).expect("pair");
        assert_eq!(pair.block_ratio(), 4);
        let plan = pair.plan(&[(&[0, 1, 2, 3, 4], &[7, 9])]).expect("plan");
        assert_eq!(plan.reads().len(), 1);
        assert_eq!(plan.reads()[0].source_rank(), 0);
        assert_eq!(plan.notify_only(), &[1]);
        assert_eq!(
            plan.runs(),
            &[vec![
                PairRun { remote_start: 0, local_start: 7, first_slot: 0, count: 4 },
                PairRun { remote_start: 4, local_start: 9, first_slot: 0, count: 1 },
            ]]
        );
        let pieces: Vec<_> = plan.pieces().filter(|p| p.segment == 1).collect();
        assert_eq!(
            pieces,
            (0..4)
                .map(|i| piece(0, (0, 1), (i, 0), (7, 8 * u64::from(i)), 8, 1))
                .chain([piece(0, (0, 1), (4, 0), (9, 0), 8, 1)])
                .collect::<Vec<_>>()
        );
        // MLA with a wider decode side: every decode rank reads the whole latent once.
        let wide = TransferPair::new(&prefill, &shape(4, 3, KvHeads::Latent, 1, &[(16, 2)])).expect("pair");
        assert_eq!(wide.expected_consumers(), 2);
        let plan = wide.plan(&[(&[2], &[5])]).expect("plan");
        assert_eq!(
            plan.pieces().collect::<Vec<_>>(),
            vec![piece(1, (0, 0), (2, 0), (5, 0), 8, 1), piece(1, (0, 1), (2, 0), (5, 0), 8, 1)]
        );
    }

    #[test]
    fn gqa_replicated_heads_are_read_once() {
        let two = KvHeads::Split { total: 2 };
        // Prefill TP 4 holds heads 0, 0, 1, 1; decode TP 2 rank 1 holds head 1.
        let pair = TransferPair::new(&shape(4, 0, two, 2, &[(8, 1)]), &shape(2, 1, two, 2, &[(8, 1)]))
            .expect("pair");
        assert_eq!(pair.source_ranks(), 2..4);
        let plan = pair.plan(&[(&[1], &[2])]).expect("plan");
        assert_eq!(plan.pieces().collect::<Vec<_>>(), vec![piece(2, (0, 0), (1, 0), (2, 0), 16, 1)]);
        assert_eq!(plan.notify_only(), &[3]);
        assert_eq!(pair.expected_consumers(), 1);
        // Prefill TP 1, decode TP 4: decode ranks 2 and 3 both hold (and each read) head 1.
        let pair = TransferPair::new(&shape(1, 0, two, 2, &[(8, 1)]), &shape(4, 2, two, 2, &[(8, 1)]))
            .expect("pair");
        assert_eq!(pair.expected_consumers(), 4);
        let plan = pair.plan(&[(&[1], &[2])]).expect("plan");
        assert_eq!(plan.pieces().collect::<Vec<_>>(), vec![piece(0, (0, 0), (1, 16), (2, 0), 16, 1)]);
    }

    #[test]
    fn two_groups_have_their_own_blocks() {
        let s = |tp_rank| shape(1, tp_rank, FOUR, 2, &[(16, 2), (4, 1)]);
        let pair = TransferPair::new(&s(0), &s(0)).expect("pair");
        let plan = pair.plan(&[(&[1, 2], &[8, 9]), (&[3], &[0])]).expect("plan");
        assert_eq!(
            plan.pieces().collect::<Vec<_>>(),
            vec![
                piece(0, (0, 0), (1, 0), (8, 0), 64, 2),
                piece(0, (0, 1), (1, 0), (8, 0), 64, 2),
                piece(0, (1, 0), (3, 0), (0, 0), 64, 1),
            ]
        );
        assert_eq!(
            pair.plan(&[(&[1, 2], &[8, 9]), (&[3], &[4])]),
            Err(RankPlanError::OutOfRange { group: 1, side: Side::Local, ids: vec![4], num_blocks: 4 })
        );
        assert_eq!(
            pair.plan(&[(&[1, 20], &[8, 9]), (&[3], &[1])]),
            Err(RankPlanError::OutOfRange { group: 0, side: Side::Remote, ids: vec![20], num_blocks: 16 })
        );
        assert_eq!(
            pair.plan(&[(&[1, 2], &[8, 8]), (&[], &[])]),
            Err(RankPlanError::DuplicateLocal { group: 0, block: 8 })
        );
        assert_eq!(pair.plan(&[(&[1], &[8])]), Err(RankPlanError::GroupCount { expected: 2, got: 1 }));
        // A huge group and a short list: found without a bitset over every block.
        let huge = shape(1, 0, FOUR, 2, &[(1 << 24, 1)]);
        let pair_huge = TransferPair::new(&huge, &huge).expect("pair");
        assert_eq!(
            pair_huge.plan(&[(&[1, 2, 3], &[70_000, 9, 70_000])]),
            Err(RankPlanError::DuplicateLocal { group: 0, block: 70_000 })
        );
        assert!(pair_huge.plan(&[(&[1, 2, 3], &[70_000, 9, 70_001])]).is_ok());
        // Nothing to move: the source is only notified.
        let empty = pair.plan(&[(&[], &[]), (&[], &[])]).expect("plan");
        assert!(empty.is_empty());
        assert_eq!(empty.notify_only(), &[0]);
    }

    #[test]
    fn refusals_name_the_field_and_both_values() {
        let base = shape(2, 0, FOUR, 16, &[(8, 2)]);
        let refuse = |decode: KvShape| TransferPair::new(&base, &decode).expect_err("refused");
        let e = refuse(shape(3, 0, KvHeads::Split { total: 6 }, 16, &[(8, 2)]));
        assert_eq!(e.field(), CompatField::TotalKvHeads);
        assert_eq!(e.to_string(), "KV caches differ in total_kv_heads: prefill 4, decode 6");
        let six = KvHeads::Split { total: 6 };
        let e = TransferPair::new(&shape(2, 0, six, 16, &[(8, 2)]), &shape(3, 0, six, 16, &[(8, 2)]))
            .expect_err("refused");
        assert_eq!(e.field(), CompatField::TpSize);
        assert_eq!(e.to_string(), "tp_size: prefill 2 and decode 3 do not divide one another");
        let e = refuse(shape(2, 0, KvHeads::Latent, 16, &[(8, 2)]));
        assert_eq!(
            e.to_string(),
            "KV caches differ in attention: prefill 4 split KV heads, decode an MLA latent"
        );
        let e = refuse(shape(4, 0, FOUR, 8, &[(8, 2)]));
        assert_eq!(e.to_string(), "block_tokens: decode 8 is smaller than prefill 16");
        let e = refuse(shape(4, 0, FOUR, 24, &[(8, 2)]));
        assert_eq!(e.to_string(), "block_tokens: decode 24 is not a multiple of prefill 16");
        let e = refuse(shape(2, 0, FOUR, 16, &[(8, 2), (8, 1)]));
        assert_eq!(e.to_string(), "KV caches differ in groups: prefill 1, decode 2");
        let e = refuse(shape(2, 0, FOUR, 16, &[(8, 3)]));
        assert_eq!(e.to_string(), "KV caches differ in groups[0].segments: prefill 2, decode 3");
        let mut spec = base.spec().clone();
        spec.groups[0].segments[1].head_dim = 8;
        let e = refuse(KvShape::new(spec).expect("shape"));
        assert_eq!(e.to_string(), "KV caches differ in groups[0].segments[1].head_dim: prefill 4, decode 8");
        let mut spec = base.spec().clone();
        spec.dtype = "fp8".into();
        assert_eq!(refuse(KvShape::new(spec).expect("shape")).field(), CompatField::Dtype);
        let mut spec = base.spec().clone();
        spec.dtype_bytes = 4;
        assert_eq!(refuse(KvShape::new(spec).expect("shape")).field(), CompatField::DtypeBytes);
        assert_eq!(expected_consumers(2, 3), Err(CompatError::TpNotDivisible { prefill: 2, decode: 3 }));
        assert_eq!(expected_consumers(0, 3), Err(CompatError::TpNotDivisible { prefill: 0, decode: 3 }));
        assert_eq!(expected_consumers(8, 2), Ok(1));
        assert_eq!(expected_consumers(2, 8), Ok(4));
    }
}
