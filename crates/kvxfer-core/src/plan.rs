//! Transfer plans: which remote blocks go to which local blocks, coalesced into runs that
//! are contiguous on both sides, and, for a whole prefill result, which remote blocks cross
//! the wire once and which are local copies for siblings that share them.

use std::collections::HashMap;

use crate::error::{PlanError, Side, MAX_IDS_SHOWN};
use crate::BlockId;

/// A run of consecutive block ids `start .. start + count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockRange {
    /// First block.
    pub start: BlockId,
    /// Number of blocks.
    pub count: u32,
}

impl BlockRange {
    /// The ids in the range (ids past `u32::MAX` are not produced).
    pub fn iter(&self) -> impl Iterator<Item = BlockId> {
        let end = self.start.saturating_add(self.count);
        self.start..end
    }

    /// The ids in the range as `u64`, so a range running past `u32::MAX` is seen whole.
    pub fn iter_u64(&self) -> impl Iterator<Item = u64> {
        u64::from(self.start)..u64::from(self.start) + u64::from(self.count)
    }
}

/// `count` blocks from remote `remote_start..` to local `local_start..`, consecutive on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRun {
    /// First remote block.
    pub remote_start: BlockId,
    /// First local block.
    pub local_start: BlockId,
    /// Number of blocks.
    pub count: u32,
}

impl BlockRun {
    /// The remote side of the run.
    pub fn remote(&self) -> BlockRange {
        BlockRange { start: self.remote_start, count: self.count }
    }
}

fn check_range(ids: &[BlockId], num_blocks: u32, side: Side) -> Result<(), PlanError> {
    let bad: Vec<BlockId> = ids.iter().copied().filter(|&b| b >= num_blocks).take(MAX_IDS_SHOWN).collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(PlanError::OutOfRange { side, ids: bad, num_blocks })
    }
}

/// Pairs `remote[i] -> local[i]` and merges neighbours that are consecutive on both sides.
/// Ids outside either layout are refused, naming them.
pub fn coalesce(
    remote: &[BlockId],
    local: &[BlockId],
    remote_blocks: u32,
    local_blocks: u32,
) -> Result<Vec<BlockRun>, PlanError> {
    if remote.len() != local.len() {
        return Err(PlanError::LengthMismatch { remote: remote.len(), local: local.len() });
    }
    check_range(remote, remote_blocks, Side::Remote)?;
    check_range(local, local_blocks, Side::Local)?;
    Ok(coalesce_pairs(remote.iter().copied().zip(local.iter().copied())))
}

/// Merges `(remote, local)` pairs, in order, into runs consecutive on both sides.
pub fn coalesce_pairs(pairs: impl IntoIterator<Item = (BlockId, BlockId)>) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = Vec::new();
    for (r, l) in pairs {
        if let Some(last) = runs.last_mut() {
            let next_r = u64::from(last.remote_start) + u64::from(last.count);
            let next_l = u64::from(last.local_start) + u64::from(last.count);
            if u64::from(r) == next_r && u64::from(l) == next_l {
                last.count += 1;
                continue;
            }
        }
        runs.push(BlockRun { remote_start: r, local_start: l, count: 1 });
    }
    runs
}

/// One child's part of a [`ResultPlan`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChildPlan {
    /// Runs this child reads over the wire (with its own lease token).
    pub wire: Vec<BlockRun>,
    /// Local copies `(source local block, destination local block)` made after every wire
    /// read of the result finished: this child's remote block was read for a sibling into
    /// another local block.
    pub copies: Vec<(BlockId, BlockId)>,
    /// Children whose wire reads this child's blocks depend on (including itself when it
    /// reads anything); if one of them fails, this child's local blocks are invalid too.
    pub depends_on: Vec<usize>,
}

/// The plan for a whole prefill result: each distinct remote block crosses the wire once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultPlan {
    /// One entry per child, in child order.
    pub children: Vec<ChildPlan>,
}

impl ResultPlan {
    /// Plans `children[i] = (remote blocks, local blocks)` for a result whose siblings may
    /// share remote blocks. The first child (in index order) naming a remote block reads it;
    /// a later child with the same local block shares it; one with a different local block
    /// gets a local copy. A local block that would receive two different remote blocks is
    /// refused.
    pub fn build(
        children: &[(&[BlockId], &[BlockId])],
        remote_blocks: u32,
        local_blocks: u32,
    ) -> Result<Self, PlanError> {
        Self::build_with(children, remote_blocks, local_blocks, true)
    }

    /// [`ResultPlan::build`] for destination memory the CPU cannot copy within (device
    /// memory): a remote block that lands in two different local blocks crosses the wire
    /// once per local block, so no plan step is a local copy.
    pub fn build_without_copies(
        children: &[(&[BlockId], &[BlockId])],
        remote_blocks: u32,
        local_blocks: u32,
    ) -> Result<Self, PlanError> {
        Self::build_with(children, remote_blocks, local_blocks, false)
    }

    fn build_with(
        children: &[(&[BlockId], &[BlockId])],
        remote_blocks: u32,
        local_blocks: u32,
        local_copies: bool,
    ) -> Result<Self, PlanError> {
        // remote block -> (child that reads it, local block it lands in)
        let mut first: HashMap<BlockId, (usize, BlockId)> = HashMap::new();
        // Without local copies: (remote, local) pair -> the child whose read lands it.
        let mut landed: HashMap<(BlockId, BlockId), usize> = HashMap::new();
        // local block -> remote block it receives
        let mut dest: HashMap<BlockId, BlockId> = HashMap::new();
        let mut plans = Vec::with_capacity(children.len());
        for (index, (remote, local)) in children.iter().enumerate() {
            if remote.len() != local.len() {
                return Err(PlanError::LengthMismatch { remote: remote.len(), local: local.len() });
            }
            check_range(remote, remote_blocks, Side::Remote)?;
            check_range(local, local_blocks, Side::Local)?;
            let mut wire_pairs = Vec::new();
            let mut plan = ChildPlan::default();
            for (&r, &l) in remote.iter().zip(local.iter()) {
                if let Some(&prev) = dest.get(&l) {
                    if prev != r {
                        return Err(PlanError::ConflictingDestination { local: l, first: prev, second: r });
                    }
                } else {
                    dest.insert(l, r);
                }
                if !local_copies {
                    // Each distinct (remote, local) pair crosses the wire once, read by the
                    // first child naming it; a later child naming it shares that read.
                    match landed.get(&(r, l)) {
                        None => {
                            landed.insert((r, l), index);
                            wire_pairs.push((r, l));
                            push_unique(&mut plan.depends_on, index);
                        }
                        Some(&owner) => push_unique(&mut plan.depends_on, owner),
                    }
                    continue;
                }
                match first.get(&r) {
                    None => {
                        first.insert(r, (index, l));
                        wire_pairs.push((r, l));
                        push_unique(&mut plan.depends_on, index);
                    }
                    Some(&(owner, src)) => {
                        push_unique(&mut plan.depends_on, owner);
                        if src != l {
                            plan.copies.push((src, l));
                        }
                    }
                }
            }
            plan.wire = coalesce_pairs(wire_pairs);
            plans.push(plan);
        }
        Ok(ResultPlan { children: plans })
    }

    /// Blocks that cross the wire.
    pub fn wire_blocks(&self) -> u64 {
        self.children.iter().flat_map(|c| c.wire.iter()).map(|r| u64::from(r.count)).sum()
    }
}

fn push_unique(v: &mut Vec<usize>, x: usize) {
    if !v.contains(&x) {
        v.push(x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesces_runs_contiguous_on_both_sides() {
        let runs = coalesce(&[4, 5, 6, 9, 10, 3], &[0, 1, 2, 3, 5, 6], 16, 16).expect("plan");
        assert_eq!(
            runs,
            vec![
                BlockRun { remote_start: 4, local_start: 0, count: 3 },
                BlockRun { remote_start: 9, local_start: 3, count: 1 },
                BlockRun { remote_start: 10, local_start: 5, count: 1 },
                BlockRun { remote_start: 3, local_start: 6, count: 1 },
            ]
        );
    }

    #[test]
    fn refuses_ids_outside_either_layout_naming_them() {
        assert_eq!(
            coalesce(&[1, 20, 30], &[0, 1, 2], 16, 16),
            Err(PlanError::OutOfRange { side: Side::Remote, ids: vec![20, 30], num_blocks: 16 })
        );
        assert_eq!(
            coalesce(&[1], &[8], 16, 8),
            Err(PlanError::OutOfRange { side: Side::Local, ids: vec![8], num_blocks: 8 })
        );
        assert_eq!(coalesce(&[1, 2], &[0], 16, 16), Err(PlanError::LengthMismatch { remote: 2, local: 1 }));
    }

    #[test]
    fn shared_prompt_blocks_cross_the_wire_once() {
        // Three siblings share prompt blocks 0..3 and each has one block of its own.
        let remote: [&[BlockId]; 3] = [&[0, 1, 2, 10], &[0, 1, 2, 11], &[0, 1, 2, 12]];
        // Child 0 and 1 share local prompt blocks; child 2 has its own local copies.
        let local: [&[BlockId]; 3] = [&[0, 1, 2, 3], &[0, 1, 2, 4], &[5, 6, 7, 8]];
        let pairs: Vec<_> = remote.iter().zip(local.iter()).map(|(r, l)| (*r, *l)).collect();
        let plan = ResultPlan::build(&pairs, 16, 16).expect("plan");
        assert_eq!(plan.wire_blocks(), 6);
        assert_eq!(plan.children[0].wire.len(), 2);
        assert_eq!(plan.children[1].wire, vec![BlockRun { remote_start: 11, local_start: 4, count: 1 }]);
        assert!(plan.children[1].copies.is_empty());
        assert_eq!(plan.children[1].depends_on, vec![0, 1]);
        assert_eq!(plan.children[2].copies, vec![(0, 5), (1, 6), (2, 7)]);
    }

    #[test]
    fn without_copies_a_shared_block_crosses_the_wire_once_per_local_block() {
        let remote: [&[BlockId]; 3] = [&[0, 1, 2, 10], &[0, 1, 2, 11], &[0, 1, 2, 12]];
        let local: [&[BlockId]; 3] = [&[0, 1, 2, 3], &[0, 1, 2, 4], &[5, 6, 7, 8]];
        let pairs: Vec<_> = remote.iter().zip(local.iter()).map(|(r, l)| (*r, *l)).collect();
        let plan = ResultPlan::build_without_copies(&pairs, 16, 16).expect("plan");
        assert!(plan.children.iter().all(|c| c.copies.is_empty()));
        // Child 1 still shares child 0's local blocks 0..3 (nothing to copy); child 2 reads its own.
        assert_eq!(plan.children[1].wire, vec![BlockRun { remote_start: 11, local_start: 4, count: 1 }]);
        assert_eq!(plan.children[1].depends_on, vec![0, 1]);
        assert_eq!(
            plan.children[2].wire,
            vec![
                BlockRun { remote_start: 0, local_start: 5, count: 3 },
                BlockRun { remote_start: 12, local_start: 8, count: 1 }
            ]
        );
        assert_eq!(plan.children[2].depends_on, vec![2]);
        assert_eq!(plan.wire_blocks(), 9);
        // One remote block into local 5, 7, 7: read twice (5 and 7), the third child shares
        // the second's read of block 7 and depends on it.
        let pairs: [(&[BlockId], &[BlockId]); 3] = [(&[4], &[5]), (&[4], &[7]), (&[4], &[7])];
        let plan = ResultPlan::build_without_copies(&pairs, 16, 16).expect("plan");
        assert_eq!(plan.wire_blocks(), 2);
        assert!(plan.children[2].wire.is_empty() && plan.children[2].depends_on == vec![1]);
    }

    #[test]
    fn refuses_two_remote_blocks_into_one_local_block() {
        let pairs: [(&[BlockId], &[BlockId]); 2] = [(&[1], &[0]), (&[2], &[0])];
        assert_eq!(
            ResultPlan::build(&pairs, 16, 16),
            Err(PlanError::ConflictingDestination { local: 0, first: 1, second: 2 })
        );
    }

    #[test]
    fn range_iteration_does_not_overflow() {
        let r = BlockRange { start: u32::MAX - 1, count: 4 };
        assert_eq!(r.iter().count(), 1);
        assert_eq!(r.iter_u64().count(), 4);
    }
}
