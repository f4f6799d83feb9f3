//! Per parent request: its n children and how each one's lease stands.

use std::collections::HashMap;

use crate::lease::{EndKind, LeaseEnd};

/// Where one child's lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChildState {
    /// Not leased yet, or leased and not ended.
    Pending,
    /// Pulled by every expected consumer.
    Pulled,
    /// Released by a cancel.
    Released,
    /// Expired.
    Expired,
}

impl From<EndKind> for ChildState {
    fn from(k: EndKind) -> Self {
        match k {
            EndKind::Pulled => ChildState::Pulled,
            EndKind::Released => ChildState::Released,
            EndKind::Expired => ChildState::Expired,
        }
    }
}

/// A parent's children and their states.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentStatus {
    /// One state per child, child 0 first.
    pub children: Vec<ChildState>,
}

impl ParentStatus {
    /// Indices of the children still pending.
    pub fn pending(&self) -> Vec<u32> {
        self.indices(ChildState::Pending)
    }

    /// Indices of the children in `state`.
    pub fn indices(&self, state: ChildState) -> Vec<u32> {
        (0u32..).zip(&self.children).filter(|(_, s)| **s == state).map(|(i, _)| i).collect()
    }

    /// Whether every child has ended.
    pub fn is_complete(&self) -> bool {
        self.children.iter().all(|s| *s != ChildState::Pending)
    }
}

/// One tracked parent: each child's state, and which children have ever had a lease.
#[derive(Debug)]
struct Entry {
    status: ParentStatus,
    leased: Vec<bool>,
}

/// Tracks every parent request with leases: n, and each child's state. Only leases that
/// exist are tracked ([`Self::leased`] is called once the lease table accepted a lease, so
/// `n` is bounded by `LeaseConfig::max_children`). A parent is forgotten once all its
/// children have ended (its status returned one last time), or when the only leases it had
/// were retracted.
#[derive(Debug, Default)]
pub struct ParentTracker {
    parents: HashMap<String, Entry>,
}

impl ParentTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that child `child` of `parent` (which has `n` children; the first `n` seen
    /// wins) was leased: its state is pending again, also if an earlier lease of it ended.
    /// Returns `false` (and records nothing) when `child` is not below the recorded `n`.
    pub fn leased(&mut self, parent: &str, n: u32, child: u32) -> bool {
        if !self.parents.contains_key(parent) {
            if child >= n {
                return false;
            }
            let children = vec![ChildState::Pending; n as usize];
            let leased = vec![false; n as usize];
            self.parents.insert(parent.to_owned(), Entry { status: ParentStatus { children }, leased });
        }
        let Some(entry) = self.parents.get_mut(parent) else { return false };
        let i = child as usize;
        if i >= entry.leased.len() {
            return false;
        }
        entry.status.children[i] = ChildState::Pending;
        entry.leased[i] = true;
        true
    }

    /// Undoes [`Self::leased`] for a lease retracted before its hand-off was published:
    /// the child is pending (not leased) again, and a parent left with no lease that was
    /// ever published is forgotten.
    pub fn retracted(&mut self, parent: &str, child: u32) {
        let Some(entry) = self.parents.get_mut(parent) else { return };
        let i = child as usize;
        if i < entry.leased.len() {
            entry.leased[i] = false;
            entry.status.children[i] = ChildState::Pending;
        }
        if !entry.leased.iter().any(|&l| l) {
            self.parents.remove(parent);
        }
    }

    /// Applies a lease ending. Returns the parent's final status when this ending completed it
    /// (the parent is then forgotten).
    pub fn on_end(&mut self, end: &LeaseEnd) -> Option<ParentStatus> {
        self.set(&end.parent_request_id, end.child_index, end.kind.into())
    }

    /// Sets one child's state; returns the final status when the parent completed.
    pub fn set(&mut self, parent: &str, child: u32, state: ChildState) -> Option<ParentStatus> {
        let entry = self.parents.get_mut(parent)?;
        let slot = entry.status.children.get_mut(child as usize)?;
        *slot = state;
        if entry.status.is_complete() {
            self.parents.remove(parent).map(|e| e.status)
        } else {
            None
        }
    }

    /// The status of a parent that still has pending children.
    pub fn status(&self, parent: &str) -> Option<&ParentStatus> {
        self.parents.get(parent).map(|e| &e.status)
    }

    /// Number of parents with pending children.
    pub fn len(&self) -> usize {
        self.parents.len()
    }

    /// Whether no parent has pending children.
    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_leased_children_are_tracked_and_a_re_lease_is_pending_again() {
        let mut t = ParentTracker::new();
        assert!(!t.leased("P", 2, 5), "a child index past n records nothing");
        assert!(t.is_empty());
        assert!(t.leased("P", 2, 0));
        assert!(t.leased("P", 2, 1));
        assert_eq!(t.set("P", 0, ChildState::Released), None);
        assert!(t.leased("P", 2, 0));
        assert_eq!(t.status("P").map(ParentStatus::pending), Some(vec![0, 1]));
        // Retracting one of two leases keeps the parent; retracting the last forgets it.
        t.retracted("P", 1);
        assert!(t.status("P").is_some());
        t.retracted("P", 0);
        assert!(t.is_empty());
    }
}
