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

/// Tracks every parent request with leases: n, and each child's state. A parent is
/// forgotten once all its children have ended (and its status returned one last time).
#[derive(Debug, Default)]
pub struct ParentTracker {
    parents: HashMap<String, ParentStatus>,
}

impl ParentTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `parent` has `n` children (idempotent; the first `n` seen wins).
    pub fn track(&mut self, parent: &str, n: u32) {
        if !self.parents.contains_key(parent) {
            let children = vec![ChildState::Pending; n as usize];
            self.parents.insert(parent.to_owned(), ParentStatus { children });
        }
    }

    /// Applies a lease ending. Returns the parent's final status when this ending completed it
    /// (the parent is then forgotten).
    pub fn on_end(&mut self, end: &LeaseEnd) -> Option<ParentStatus> {
        self.set(&end.parent_request_id, end.child_index, end.kind.into())
    }

    /// Sets one child's state; returns the final status when the parent completed.
    pub fn set(&mut self, parent: &str, child: u32, state: ChildState) -> Option<ParentStatus> {
        let status = self.parents.get_mut(parent)?;
        let slot = status.children.get_mut(child as usize)?;
        *slot = state;
        if status.is_complete() {
            self.parents.remove(parent)
        } else {
            None
        }
    }

    /// The status of a parent that still has pending children.
    pub fn status(&self, parent: &str) -> Option<&ParentStatus> {
        self.parents.get(parent)
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
