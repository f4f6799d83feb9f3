//! The per-child hand-off and the prefill result that carries one per child.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvxfer_proto::v1;

use crate::error::HandoffError;
use crate::ids::LeaseToken;
use crate::BlockId;

/// Where a lease can be pulled from.
///
/// A hand-off may name **only the engine id** (`host` empty and `port` 0; on the wire
/// `remote_host = ""` and `remote_port = 0`, in `kv_transfer_params` both absent or null):
/// a decode agent running discovery (the `cluster` feature) then resolves the address from
/// the engine's registration when it pulls, and one without discovery refuses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The prefill engine's id.
    pub engine_id: String,
    /// Host the prefill agent listens on; empty when the hand-off names only the engine id.
    pub host: String,
    /// Port the prefill agent listens on; 0 when the hand-off names only the engine id.
    pub port: u16,
    /// Tensor-parallel size of the prefill engine.
    pub tp_size: u32,
    /// Random per prefill agent process (every start draws a new one); 0 = not stated. A
    /// hand-off whose incarnation differs from the agent now at `host:port` was issued by an
    /// earlier process, even when the engine id is the same.
    pub incarnation: u64,
}

impl EngineInfo {
    /// `host:port` for connecting, with an IPv6 literal in brackets (`[::1]:5559`).
    /// Meaningless for a hand-off that names only the engine id ([`Self::names_address`]).
    pub fn addr(&self) -> String {
        join_host_port(&self.host, self.port)
    }

    /// Whether it names a host and port; `false`: only the engine id (to be resolved
    /// through discovery).
    pub fn names_address(&self) -> bool {
        !self.host.is_empty()
    }
}

/// `host:port`, bracketing an IPv6 literal (`[::1]:5559`); a host already in brackets is
/// kept as it is.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A ttl in whole milliseconds as hand-offs carry it, rounded up (a positive ttl never
/// reads as 0, which [`ChildHandoff::from_wire`] refuses), saturating.
pub(crate) fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// A host as hand-offs carry it: an IPv6 literal without brackets (`[::1]` becomes `::1`).
fn unbracket(host: String) -> String {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(inner) if inner.contains(':') => inner.to_owned(),
        _ => host,
    }
}

/// What a decode worker needs to pull one child and to tell the prefill side it is done.
///
/// On the prefill side the only way to get one is [`crate::LeaseTable::lease`], which
/// registers the lease first; on the decode side one is parsed from the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildHandoff {
    parent_request_id: Arc<str>,
    child_index: u32,
    n: u32,
    remote_request_id: Arc<str>,
    token: LeaseToken,
    blocks: Arc<[BlockId]>,
    other_groups: Arc<[Vec<BlockId>]>,
    engine: Arc<EngineInfo>,
    expected_consumers: u32,
    ttl: Duration,
}

impl ChildHandoff {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn issued(
        parent_request_id: Arc<str>,
        child_index: u32,
        n: u32,
        remote_request_id: Arc<str>,
        token: LeaseToken,
        blocks: Arc<[BlockId]>,
        other_groups: Arc<[Vec<BlockId>]>,
        engine: Arc<EngineInfo>,
        expected_consumers: u32,
        ttl: Duration,
    ) -> Self {
        ChildHandoff {
            parent_request_id,
            child_index,
            n,
            remote_request_id,
            token,
            blocks,
            other_groups,
            engine,
            expected_consumers,
            ttl,
        }
    }

    /// The parent request id.
    pub fn parent_request_id(&self) -> &str {
        &self.parent_request_id
    }
    /// This child's index.
    pub fn child_index(&self) -> u32 {
        self.child_index
    }
    /// The parent's number of children.
    pub fn n(&self) -> u32 {
        self.n
    }
    /// The id the prefill side expects back.
    pub fn remote_request_id(&self) -> &str {
        &self.remote_request_id
    }
    /// The lease token.
    pub fn token(&self) -> &LeaseToken {
        &self.token
    }
    /// The prefill blocks to pull (of the first KV-cache group: all of them for a
    /// single-group cache).
    pub fn remote_block_ids(&self) -> &[BlockId] {
        &self.blocks
    }
    /// Number of KV-cache groups the hand-off lists blocks for (1 for a single-group cache).
    pub fn num_groups(&self) -> usize {
        1 + self.other_groups.len()
    }
    /// The prefill blocks of KV-cache group `group` (`None` past the last group).
    pub fn group_block_ids(&self, group: usize) -> Option<&[BlockId]> {
        match group {
            0 => Some(&self.blocks),
            g => self.other_groups.get(g - 1).map(Vec::as_slice),
        }
    }
    /// Every group's block list, group 0 first (vLLM's nested `remote_block_ids`).
    pub fn groups(&self) -> impl Iterator<Item = &[BlockId]> + '_ {
        std::iter::once(&*self.blocks).chain(self.other_groups.iter().map(Vec::as_slice))
    }
    /// Where to pull from.
    pub fn engine(&self) -> &EngineInfo {
        &self.engine
    }
    /// Consumers that must notify.
    pub fn expected_consumers(&self) -> u32 {
        self.expected_consumers
    }
    /// The lease's time-to-live (the decode side heartbeats every ttl/6 while pulling).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The same hand-off naming only the engine id (no host or port): for deployments
    /// where decode agents resolve engines through discovery, so a hand-off never carries an
    /// address that may have been reused by the time it is pulled.
    pub fn engine_only(&self) -> Self {
        let mut h = self.clone();
        let e = &self.engine;
        h.engine = Arc::new(EngineInfo {
            engine_id: e.engine_id.clone(),
            host: String::new(),
            port: 0,
            tp_size: e.tp_size,
            incarnation: e.incarnation,
        });
        h
    }

    /// The wire form.
    pub fn to_wire(&self) -> v1::ChildHandoff {
        v1::ChildHandoff {
            parent_request_id: self.parent_request_id.to_string(),
            child_index: self.child_index,
            n: self.n,
            remote_request_id: self.remote_request_id.to_string(),
            lease_token: self.token.as_bytes().to_vec(),
            remote_block_ids: self.blocks.to_vec(),
            remote_engine_id: self.engine.engine_id.clone(),
            remote_host: self.engine.host.clone(),
            remote_port: u32::from(self.engine.port),
            expected_consumers: self.expected_consumers,
            lease_ttl_ms: ttl_ms(self.ttl),
            tp_size: self.engine.tp_size,
            incarnation: self.engine.incarnation,
            other_group_block_ids: self
                .other_groups
                .iter()
                .map(|ids| v1::GroupBlockIds { block_ids: ids.clone() })
                .collect(),
        }
    }

    /// Parses the wire form: every field a pull needs present and well formed.
    pub fn from_wire(w: v1::ChildHandoff) -> Result<Self, HandoffError> {
        if w.remote_request_id.is_empty() {
            return Err(HandoffError::MissingField("remote_request_id"));
        }
        if w.parent_request_id.is_empty() {
            return Err(HandoffError::MissingField("parent_request_id"));
        }
        // Neither host nor port: the hand-off names only the engine id (resolved through
        // discovery), which must then be there.
        let engine_only = w.remote_host.is_empty() && w.remote_port == 0;
        if engine_only && w.remote_engine_id.is_empty() {
            return Err(HandoffError::MissingField("remote_engine_id"));
        }
        if w.remote_host.is_empty() && !engine_only {
            return Err(HandoffError::MissingField("remote_host"));
        }
        if w.remote_block_ids.is_empty() && w.other_group_block_ids.iter().all(|g| g.block_ids.is_empty()) {
            return Err(HandoffError::MissingField("remote_block_ids"));
        }
        if w.expected_consumers == 0 {
            return Err(HandoffError::NoConsumers(w.remote_request_id));
        }
        if w.lease_ttl_ms == 0 {
            return Err(HandoffError::ZeroTtl(w.remote_request_id));
        }
        let port = u16::try_from(w.remote_port)
            .ok()
            .filter(|&p| p != 0 || engine_only)
            .ok_or(HandoffError::BadPort { request: w.remote_request_id.clone(), port: w.remote_port })?;
        let token = LeaseToken::from_wire(&w.lease_token)?;
        Ok(ChildHandoff {
            parent_request_id: Arc::from(w.parent_request_id),
            child_index: w.child_index,
            n: w.n,
            remote_request_id: Arc::from(w.remote_request_id),
            token,
            blocks: Arc::from(w.remote_block_ids),
            other_groups: w.other_group_block_ids.into_iter().map(|g| g.block_ids).collect(),
            engine: Arc::new(EngineInfo {
                engine_id: w.remote_engine_id,
                host: unbracket(w.remote_host),
                port,
                tp_size: w.tp_size,
                incarnation: w.incarnation,
            }),
            expected_consumers: w.expected_consumers,
            ttl: Duration::from_millis(w.lease_ttl_ms),
        })
    }
}

/// A prefill result with exactly one hand-off for each child `0..n`, in index order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillResult {
    parent_request_id: String,
    n: u32,
    children: Vec<ChildHandoff>,
}

impl PrefillResult {
    /// Checks that `children` are exactly the children `0..n` of `parent`, naming what is
    /// missing, duplicated, out of range or of another parent.
    pub fn new(
        parent_request_id: impl Into<String>,
        n: u32,
        children: Vec<ChildHandoff>,
    ) -> Result<Self, HandoffError> {
        let parent = parent_request_id.into();
        if n == 0 {
            return Err(HandoffError::ZeroChildren { parent });
        }
        let mut by_index: BTreeMap<u32, ChildHandoff> = BTreeMap::new();
        let (mut duplicated, mut out_of_range, mut foreign) = (Vec::new(), Vec::new(), Vec::new());
        for child in children {
            if *child.parent_request_id != *parent || child.n != n {
                foreign.push(child.remote_request_id.to_string());
            } else if child.child_index >= n {
                out_of_range.push(child.child_index);
            } else {
                match by_index.entry(child.child_index) {
                    std::collections::btree_map::Entry::Occupied(_) => duplicated.push(child.child_index),
                    std::collections::btree_map::Entry::Vacant(v) => {
                        v.insert(child);
                    }
                }
            }
        }
        // Bounded: at most as many entries as were listed, so a huge `n` allocates nothing.
        let missing: Vec<u32> = if by_index.len() as u64 == u64::from(n) {
            Vec::new()
        } else {
            (0..n).filter(|i| !by_index.contains_key(i)).take(64).collect()
        };
        if !missing.is_empty() || !duplicated.is_empty() || !out_of_range.is_empty() || !foreign.is_empty() {
            duplicated.dedup();
            return Err(HandoffError::IncompleteResult {
                parent,
                n,
                missing,
                duplicated,
                out_of_range,
                foreign,
            });
        }
        Ok(PrefillResult { parent_request_id: parent, n, children: by_index.into_values().collect() })
    }

    /// Parses and validates the wire form.
    pub fn from_wire(w: v1::PrefillResult) -> Result<Self, HandoffError> {
        let children = w.children.into_iter().map(ChildHandoff::from_wire).collect::<Result<Vec<_>, _>>()?;
        Self::new(w.parent_request_id, w.n, children)
    }

    /// The wire form.
    pub fn to_wire(&self) -> v1::PrefillResult {
        v1::PrefillResult {
            parent_request_id: self.parent_request_id.clone(),
            n: self.n,
            children: self.children.iter().map(ChildHandoff::to_wire).collect(),
        }
    }

    /// The same result with every hand-off naming only the engine id
    /// ([`ChildHandoff::engine_only`]).
    pub fn engine_only(&self) -> Self {
        PrefillResult {
            parent_request_id: self.parent_request_id.clone(),
            n: self.n,
            children: self.children.iter().map(ChildHandoff::engine_only).collect(),
        }
    }

    /// The parent request id.
    pub fn parent_request_id(&self) -> &str {
        &self.parent_request_id
    }
    /// Number of children.
    pub fn n(&self) -> u32 {
        self.n
    }
    /// The hand-offs, child 0 first.
    pub fn children(&self) -> &[ChildHandoff] {
        &self.children
    }
}
