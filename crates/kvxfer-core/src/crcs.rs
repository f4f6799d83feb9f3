//! CRC-32C values of a lease's blocks computed once, off the read path, after the lease was
//! made (its blocks are final then: the owner does not write leased blocks): a TCP read of
//! whole blocks then combines them into its payload's CRC instead of reading the payload
//! twice. The values are only stored here; the prefill agent computes them (opt-in,
//! `AgentConfig::precompute_crcs`) and the TCP server reads them through the read's
//! [`crate::ReadGuard::block_crcs`].
//!
//! A block rewritten after its lease was made breaks the owner's contract; its stored CRC
//! then describes the old bytes and the decode side's check fails (as it may whenever the
//! contract is broken while a read is under way).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::BlockId;

/// The stored CRC-32Cs of one lease's blocks: per KV-cache group, per block, per segment.
/// Empty until [`Self::publish`]; each value is set once, when computed, so a reader sees
/// some blocks' values and not (yet) others' — it falls back to reading the bytes for those.
#[derive(Default)]
pub struct BlockCrcs {
    groups: OnceLock<Box<[GroupCrcs]>>,
}

impl std::fmt::Debug for BlockCrcs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.groups.get() {
            None => f.write_str("BlockCrcs(not started)"),
            Some(g) => {
                let (done, all) = g.iter().fold((0, 0), |(d, a), g| (d + g.computed(), a + g.values.len()));
                write!(f, "BlockCrcs({done}/{all} computed)")
            }
        }
    }
}

impl BlockCrcs {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Publishes the (empty) values of every group, `groups[g]` for group `g`; the first call
    /// wins. Returns the published groups, whose values are then filled in.
    pub fn publish(&self, groups: Vec<GroupCrcs>) -> &[GroupCrcs] {
        self.groups.get_or_init(|| groups.into_boxed_slice())
    }

    /// Group `group`'s values, once published.
    pub fn group(&self, group: usize) -> Option<&GroupCrcs> {
        self.groups.get().and_then(|g| g.get(group))
    }
}

/// One KV-cache group's stored CRC-32Cs: per block of the lease (sorted, deduplicated), per
/// segment, the CRC of that block's bytes in that segment.
pub struct GroupCrcs {
    blocks: Box<[BlockId]>,
    segments: usize,
    /// `blocks.len() * segments` values; 0 while not computed, else `1 << 32 | crc`.
    values: Box<[AtomicU64]>,
}

impl GroupCrcs {
    /// No values yet for `blocks` (group-local ids, any order, repeats allowed) in a group of
    /// `segments` segments.
    pub fn new(blocks: &[BlockId], segments: usize) -> Self {
        let mut blocks = blocks.to_vec();
        blocks.sort_unstable();
        blocks.dedup();
        let values = (0..blocks.len() * segments).map(|_| AtomicU64::new(0)).collect();
        GroupCrcs { blocks: blocks.into_boxed_slice(), segments, values }
    }

    /// The blocks, sorted and deduplicated: what [`Self::set`] and [`Self::get`] index.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Segments per block.
    pub fn segments(&self) -> usize {
        self.segments
    }

    /// The index of `block` in [`Self::blocks`].
    pub fn index_of(&self, block: BlockId) -> Option<usize> {
        self.blocks.binary_search(&block).ok()
    }

    /// Stores the CRC-32C of the block at `index`, segment `segment` (ignored out of range).
    pub fn set(&self, index: usize, segment: usize, crc: u32) {
        if segment < self.segments {
            if let Some(v) = self.values.get(index * self.segments + segment) {
                v.store(1 << 32 | u64::from(crc), Ordering::Release);
            }
        }
    }

    /// The stored CRC-32C of the block at `index`, segment `segment`; `None` while not
    /// computed.
    pub fn get(&self, index: usize, segment: usize) -> Option<u32> {
        if segment >= self.segments {
            return None;
        }
        let v = self.values.get(index * self.segments + segment)?.load(Ordering::Acquire);
        // The low 32 bits are the CRC.
        (v >> 32 != 0).then_some(v as u32)
    }

    /// How many values are stored.
    pub fn computed(&self) -> usize {
        self.values.iter().filter(|v| v.load(Ordering::Relaxed) >> 32 != 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_found_by_block_and_segment_once_set() {
        let crcs = BlockCrcs::new();
        assert!(crcs.group(0).is_none(), "not published");
        let g = &crcs.publish(vec![GroupCrcs::new(&[9, 3, 3, 7], 2)])[0];
        assert_eq!(g.blocks(), &[3, 7, 9]);
        let i = g.index_of(7).expect("leased");
        assert_eq!(g.index_of(8), None);
        assert_eq!(g.get(i, 1), None);
        g.set(i, 1, 0);
        g.set(i, 2, 5);
        assert_eq!(g.get(i, 1), Some(0), "a CRC of 0 is a value");
        assert_eq!(g.get(i, 0), None);
        assert_eq!(g.get(i, 2), None);
        assert_eq!(g.computed(), 1);
        assert!(crcs.group(1).is_none());
    }
}
