//! How a pull of a cache with several KV-cache groups numbers its blocks: one *flat* id
//! space per side, so the core's [`ResultPlan`](kvxfer_core::plan::ResultPlan) and
//! [`PullMachine`](kvxfer_core::pull::PullMachine) plan, deduplicate and track every
//! group's blocks at once, and reads split back into one request per group.
//!
//! Local block `b` of group `g` is flat `local_base[g] + b` (`local_base[g]`: the blocks of
//! the groups before `g` in this agent's memory). Remote block `b` of group `g` is flat
//! `remote_base[g] + b`, with `remote_base[g]` the ids the pull's hand-offs name in the
//! groups before `g` (the highest plus one), so it is known at submit time, before any
//! handshake. A single-group cache has both bases 0: flat ids are the block ids, and the
//! pull is exactly what it was before groups existed.

use kvxfer_core::plan::BlockRun;
use kvxfer_core::{BlockId, ChildHandoff};
use kvxfer_mem::KvMemory;

/// The flat numbering of one pull's blocks (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GroupIds {
    /// Per group, the flat id of local block 0.
    local_base: Vec<BlockId>,
    /// Per group, the flat id of remote block 0.
    remote_base: Vec<BlockId>,
}

impl GroupIds {
    /// The numbering for a pull of `children` into `memory`; `None` when the flat ids of
    /// either side would not fit a block id.
    pub(crate) fn new(memory: &KvMemory, children: &[&ChildHandoff]) -> Option<Self> {
        let mut local_base = Vec::with_capacity(memory.num_groups());
        let mut next = 0u64;
        for layout in memory.group_layouts() {
            local_base.push(BlockId::try_from(next).ok()?);
            next += u64::from(layout.num_blocks());
        }
        BlockId::try_from(next).ok()?;
        let mut remote_base = Vec::with_capacity(memory.num_groups());
        let mut next = 0u64;
        for g in 0..memory.num_groups() {
            remote_base.push(BlockId::try_from(next).ok()?);
            let highest = children.iter().filter_map(|c| c.group_block_ids(g)).flatten().max();
            next += highest.map_or(0, |&b| u64::from(b) + 1);
        }
        BlockId::try_from(next).ok()?;
        Some(GroupIds { local_base, remote_base })
    }

    /// Flat remote ids of one group's blocks.
    pub(crate) fn remote_flat(&self, group: usize, ids: &[BlockId]) -> Vec<BlockId> {
        let base = self.remote_base[group];
        ids.iter().map(|&b| base + b).collect()
    }

    /// Flat local ids of one group's blocks (the caller checked them against the group).
    pub(crate) fn local_flat(&self, group: usize, ids: &[BlockId]) -> Vec<BlockId> {
        let base = self.local_base[group];
        ids.iter().map(|&b| base + b).collect()
    }

    /// The group a flat local id is in, and its id there.
    pub(crate) fn split_local(&self, flat: BlockId) -> (usize, BlockId) {
        let g = self.local_base.partition_point(|&base| base <= flat).saturating_sub(1);
        (g, flat - self.local_base[g])
    }

    /// Flat runs back as group-local runs, one list per group that has any, in group order.
    /// A run crossing a group boundary (consecutive on both sides across it) is cut there;
    /// remote and local cross at the same element, since a plan only pairs blocks of one
    /// group.
    pub(crate) fn split_runs(&self, runs: &[BlockRun]) -> Vec<(u32, Vec<BlockRun>)> {
        let mut out: Vec<(u32, Vec<BlockRun>)> = Vec::new();
        for run in runs {
            let mut run = *run;
            while run.count > 0 {
                let (g, local) = self.split_local(run.local_start);
                let end = self.local_base.get(g + 1).map_or(u64::MAX, |&e| u64::from(e));
                let here = (end - u64::from(run.local_start)).min(u64::from(run.count)) as u32;
                let piece = BlockRun {
                    remote_start: run.remote_start - self.remote_base[g],
                    local_start: local,
                    count: here,
                };
                match out.iter_mut().find(|(group, _)| *group as usize == g) {
                    Some((_, list)) => list.push(piece),
                    None => out.push((g as u32, vec![piece])),
                }
                run.remote_start += here;
                run.local_start += here;
                run.count -= here;
            }
        }
        out.sort_by_key(|(g, _)| *g);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(local: Vec<BlockId>, remote: Vec<BlockId>) -> GroupIds {
        GroupIds { local_base: local, remote_base: remote }
    }

    #[test]
    fn one_group_is_the_identity() {
        let g = ids(vec![0], vec![0]);
        let runs = [BlockRun { remote_start: 3, local_start: 7, count: 4 }];
        assert_eq!(g.split_runs(&runs), vec![(0, runs.to_vec())]);
        assert_eq!(g.remote_flat(0, &[5]), vec![5]);
    }

    #[test]
    fn runs_crossing_a_group_boundary_are_cut_there() {
        // Local: group 0 has 8 blocks, group 1 starts at 8. Remote: group 1 starts at 4.
        let g = ids(vec![0, 8], vec![0, 4]);
        assert_eq!(g.split_local(9), (1, 1));
        assert_eq!(g.split_local(7), (0, 7));
        let runs = [
            BlockRun { remote_start: 2, local_start: 6, count: 4 },
            BlockRun { remote_start: 0, local_start: 0, count: 1 },
        ];
        assert_eq!(
            g.split_runs(&runs),
            vec![
                (
                    0,
                    vec![
                        BlockRun { remote_start: 2, local_start: 6, count: 2 },
                        BlockRun { remote_start: 0, local_start: 0, count: 1 },
                    ]
                ),
                (1, vec![BlockRun { remote_start: 0, local_start: 0, count: 2 }]),
            ]
        );
    }
}
