//! Per parent request: its n children and how each one's lease stands.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::error::LeaseError;
use crate::lease::{EndKind, LeaseConfig, LeaseEnd};

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

/// One tracked parent: each child's state, the generation of each child's latest lease,
/// how many of those are live, and when a child was last leased.
#[derive(Debug)]
struct Entry {
    status: ParentStatus,
    /// Per child: the generation ([`LeaseEnd::generation`]) of its latest lease; `None`:
    /// never leased (or its only lease was retracted).
    generations: Vec<Option<u64>>,
    /// Children whose latest lease has not ended.
    live: u32,
    /// When a child was last leased.
    last_leased: Instant,
    /// Its key in [`ParentTracker::idle`] while it has no live lease.
    idle_key: Option<(Instant, u64)>,
}

impl Entry {
    fn n(&self) -> u32 {
        self.status.children.len() as u32
    }

    fn is_live(&self, i: usize) -> bool {
        self.generations[i].is_some() && self.status.children[i] == ChildState::Pending
    }
}

/// Tracks every parent request with leases: n, and each child's state. Only leases that
/// exist are tracked ([`Self::leased`] is called once the lease table accepted a lease, so
/// `n` is bounded by `LeaseConfig::max_children`), and every lease of a parent must name
/// the same `n` ([`Self::admit`]).
///
/// Ends carry their lease's generation: an end of an earlier lease of a child that was
/// leased again since (ends arrive asynchronously) changes nothing. A parent is forgotten
/// once all its children have ended (its status returned one last time), when the only
/// leases it had were retracted, or — when some children are never leased (aborted before
/// prefill finished) — once it has no live lease and `forget_after` (the maximum lease
/// lifetime) has passed since its last lease, counted in [`Self::forgotten`]. Time is
/// passed in: the tracker never reads the clock.
#[derive(Debug)]
pub struct ParentTracker {
    parents: HashMap<String, Entry>,
    /// Parents with no live lease, by when they are forgotten (and a tie-breaker).
    idle: BTreeMap<(Instant, u64), String>,
    next_idle: u64,
    forget_after: Duration,
    forgotten: u64,
}

impl Default for ParentTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl ParentTracker {
    /// An empty tracker forgetting incomplete parents [`LeaseConfig::DEFAULT_MAX_LIFETIME`]
    /// after their last lease.
    pub fn new() -> Self {
        Self::with_forget_after(LeaseConfig::DEFAULT_MAX_LIFETIME)
    }

    /// An empty tracker forgetting a parent with no live lease `forget_after` after its last
    /// lease (use the lease table's `max_lifetime`: no lease of it can be live by then).
    pub fn with_forget_after(forget_after: Duration) -> Self {
        ParentTracker {
            parents: HashMap::new(),
            idle: BTreeMap::new(),
            next_idle: 0,
            forget_after,
            forgotten: 0,
        }
    }

    /// Checks, before a child of `parent` with `n` children is leased, that the parent's
    /// tracked leases (if any) name the same `n`. Forgets what is due at `now` first.
    pub fn admit(&mut self, parent: &str, n: u32, now: Instant) -> Result<(), LeaseError> {
        self.forget_due(now);
        match self.parents.get(parent) {
            Some(e) if e.n() != n => {
                Err(LeaseError::ChildCountMismatch { parent: parent.to_owned(), n, tracked: e.n() })
            }
            _ => Ok(()),
        }
    }

    /// Records that child `child` of `parent` (which has `n` children) was leased at `now`
    /// as lease `generation` ([`crate::LeaseTable::lease_with_generation`]): its state is
    /// pending again, also if an earlier lease of it ended (or its end is still on the way).
    /// Returns `false` (and records nothing) when `child` is not below `n`, or the parent is
    /// tracked with another `n` (which [`Self::admit`] refuses beforehand).
    pub fn leased(&mut self, parent: &str, n: u32, child: u32, generation: u64, now: Instant) -> bool {
        self.forget_due(now);
        if child >= n {
            return false;
        }
        let entry = self.parents.entry(parent.to_owned()).or_insert_with(|| Entry {
            status: ParentStatus { children: vec![ChildState::Pending; n as usize] },
            generations: vec![None; n as usize],
            live: 0,
            last_leased: now,
            idle_key: None,
        });
        if entry.n() != n {
            return false;
        }
        let i = child as usize;
        if !entry.is_live(i) {
            entry.live += 1;
        }
        entry.generations[i] = Some(generation);
        entry.status.children[i] = ChildState::Pending;
        entry.last_leased = entry.last_leased.max(now);
        if let Some(key) = entry.idle_key.take() {
            self.idle.remove(&key);
        }
        true
    }

    /// Undoes [`Self::leased`] for a lease retracted before its hand-off was published:
    /// the child is pending (not leased) again, and a parent left with no lease that was
    /// ever published is forgotten.
    pub fn retracted(&mut self, parent: &str, child: u32) {
        let Some(entry) = self.parents.get_mut(parent) else { return };
        let i = child as usize;
        if i < entry.generations.len() {
            if entry.is_live(i) {
                entry.live -= 1;
            }
            entry.generations[i] = None;
            entry.status.children[i] = ChildState::Pending;
        }
        if entry.generations.iter().all(Option::is_none) {
            self.remove(parent);
        } else if entry.live == 0 {
            self.schedule_forget(parent);
        }
    }

    /// Applies a lease ending received at `now`. Returns the parent's final status when this
    /// ending completed it (the parent is then forgotten). An end of an earlier lease of a
    /// child leased again since, a repeated end, or an end of a parent no longer tracked
    /// changes nothing.
    pub fn on_end(&mut self, end: &LeaseEnd, now: Instant) -> Option<ParentStatus> {
        self.forget_due(now);
        let parent = &*end.parent_request_id;
        let entry = self.parents.get_mut(parent)?;
        let i = end.child_index as usize;
        if entry.generations.get(i).copied().flatten() != Some(end.generation) || !entry.is_live(i) {
            return None;
        }
        entry.status.children[i] = end.kind.into();
        entry.live -= 1;
        if entry.status.is_complete() {
            return self.remove(parent).map(|e| e.status);
        }
        if entry.live == 0 {
            self.schedule_forget(parent);
            self.forget_due(now);
        }
        None
    }

    /// Puts a parent with no live lease in the queue of parents to forget.
    fn schedule_forget(&mut self, parent: &str) {
        let Some(entry) = self.parents.get_mut(parent) else { return };
        if entry.idle_key.is_some() {
            return;
        }
        // No `Instant` that far away: never forgotten by age (only by completing).
        let Some(at) = entry.last_leased.checked_add(self.forget_after) else { return };
        let key = (at, self.next_idle);
        self.next_idle += 1;
        entry.idle_key = Some(key);
        self.idle.insert(key, parent.to_owned());
    }

    /// Forgets every idle parent whose time came by `now`, counting each.
    fn forget_due(&mut self, now: Instant) {
        while let Some(entry) = self.idle.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let parent = entry.remove();
            if self.parents.remove(&parent).is_some() {
                self.forgotten += 1;
            }
        }
    }

    fn remove(&mut self, parent: &str) -> Option<Entry> {
        let entry = self.parents.remove(parent)?;
        if let Some(key) = entry.idle_key {
            self.idle.remove(&key);
        }
        Some(entry)
    }

    /// The status of a parent that still has pending children.
    pub fn status(&self, parent: &str) -> Option<&ParentStatus> {
        self.parents.get(parent).map(|e| &e.status)
    }

    /// Parents forgotten before every child ended: some children were never leased, and
    /// `forget_after` passed since the last lease with none of them live.
    pub fn forgotten(&self) -> u64 {
        self.forgotten
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
    use std::sync::Arc;

    fn end(parent: &str, child: u32, generation: u64, kind: EndKind) -> LeaseEnd {
        LeaseEnd {
            remote_request_id: Arc::from(format!("{child}_{parent}")),
            parent_request_id: Arc::from(parent),
            child_index: child,
            n: 2,
            kind,
            blocks: Arc::from(vec![1]),
            other_groups: Arc::from(vec![]),
            consumers_seen: 0,
            expected_consumers: 1,
            generation,
            leased_at: Instant::now(),
            ended_at: Instant::now(),
        }
    }

    #[test]
    fn only_leased_children_are_tracked_and_a_re_lease_is_pending_again() {
        let mut t = ParentTracker::new();
        let now = Instant::now();
        assert!(!t.leased("P", 2, 5, 0, now), "a child index past n records nothing");
        assert!(t.is_empty());
        assert!(t.leased("P", 2, 0, 0, now));
        assert!(t.leased("P", 2, 1, 1, now));
        assert_eq!(t.on_end(&end("P", 0, 0, EndKind::Released), now), None);
        assert_eq!(t.on_end(&end("P", 0, 0, EndKind::Released), now), None, "a repeated end");
        assert!(t.leased("P", 2, 0, 2, now));
        assert_eq!(t.status("P").map(ParentStatus::pending), Some(vec![0, 1]));
        // Retracting one of two leases keeps the parent; retracting the last forgets it.
        t.retracted("P", 1);
        assert!(t.status("P").is_some());
        t.retracted("P", 0);
        assert!(t.is_empty());
        assert_eq!(t.forgotten(), 0);
    }
}
