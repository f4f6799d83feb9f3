//! The prefill side's lease table.
//!
//! Every lease ends exactly once — pulled, released or expired — and its blocks are handed
//! back exactly once, through [`LeaseTable::ended`], only when no read of them is in flight.
//!
//! Concurrency: the table is split into shards, each a `Mutex` over a map of leases and an
//! ordered deadline index. A lease lives in the shard its id hashes to (a hash keyed from the
//! table's seed, so a peer choosing ids cannot aim them at one shard), so operations on
//! different leases rarely contend, and each shard's deadline index is a `BTreeMap` keyed by
//! `(deadline, sequence)`: expiry pops from the front (O(log n) per expired lease, never a
//! scan), and a heartbeat moves one entry, so an old lease that was extended never holds
//! back younger ones. Ended leases go to one channel, drained by the owner.
//!
//! Ended leases leave a record of how they ended, a SHA-256 of their token (never the
//! token) and which consumers had notified, so a notify, heartbeat or cancel retried after
//! its first answer was lost is answered "already pulled / released / expired" — but only
//! when it carries the lease's token: without it, an ended id looks exactly like a live one
//! with a wrong token. A record lives at least [`LeaseConfig::ended_record_retention`]; only
//! the table-wide hard cap [`LeaseConfig::max_ended_records`] drops one earlier (oldest
//! first, counted in [`LeaseStats::ended_records_evicted`]).
//!
//! Tokens are kept and compared as SHA-256 hashes only, live leases included: every lookup
//! hashes the presented token exactly once, before it looks at the id, and compares hashes
//! in constant time, so unknown, live and ended ids cost the same hashing and comparing.
//! What still differs is the hash-map lookup itself (a hit compares the id's bytes, a miss
//! may not) — tens of nanoseconds, against the microsecond of the hash.
//!
//! Deadline arithmetic saturates: a ttl or maximum lifetime too large for an `Instant`
//! (`Duration::MAX`: "no maximum") means "about a century from now" for deadlines, and no
//! hard deadline at all for the maximum lifetime.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;
use sha2::{Digest, Sha256};

use crate::error::{LeaseError, MAX_IDS_SHOWN};

/// Longest request id a lease may have, in bytes: every frame naming a lease (notify,
/// cancel) must fit a prefill agent's small-frame cap (`Limits::max_small_frame_len`,
/// 16 KiB by default) with its token and the consumer id.
pub const MAX_REQUEST_ID_LEN: usize = 4096;
use crate::crcs::BlockCrcs;
use crate::handoff::{ChildHandoff, EngineInfo};
use crate::ids::{child_request_id, fnv1a, LeaseToken, FNV_OFFSET};
use crate::plan::BlockRange;
use crate::BlockId;

/// What a deadline too far in the future for an `Instant` becomes (about a century).
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The refusal of `ranges` naming blocks at or past `num_blocks` (at most
/// [`MAX_IDS_SHOWN`] of them), if any does.
fn out_of_range(id: &str, ranges: &[BlockRange], num_blocks: u32) -> Option<ReadRefused> {
    let ids: Vec<BlockId> = ranges
        .iter()
        .filter(|r| u64::from(r.start) + u64::from(r.count) > u64::from(num_blocks))
        .flat_map(|r| r.iter_u64().filter(|&b| b >= u64::from(num_blocks)))
        .map(|b| u32::try_from(b).unwrap_or(u32::MAX))
        .take(MAX_IDS_SHOWN)
        .collect();
    (!ids.is_empty()).then(|| ReadRefused::OutOfRange { request: id.to_owned(), ids, num_blocks })
}

/// The smallest block `blocks` names more than once, if any. A strictly increasing list
/// (what an engine's allocator usually hands out) is checked in one pass without copying.
fn repeated_block(blocks: &[BlockId]) -> Option<BlockId> {
    if blocks.windows(2).all(|w| w[0] < w[1]) {
        return None;
    }
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// `now + d`, saturating at [`FAR_FUTURE`] from now (and at `now` on a platform whose
/// `Instant` cannot even hold that).
fn deadline_after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d).or_else(|| now.checked_add(FAR_FUTURE)).unwrap_or(now)
}

/// Settings of a [`LeaseTable`].
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Lease time-to-live when a request does not name one (vLLM: 30 s).
    pub default_ttl: Duration,
    /// Blocks in the prefill side's layout (its first KV-cache group); leases and reads
    /// outside it are refused.
    pub num_blocks: u32,
    /// Blocks of each KV-cache group after the first (empty: one group). The table keys
    /// reads by *flat* ids: group 0 first, then each further group after the ones before it
    /// ([`Self::group_base`]).
    pub other_group_blocks: Vec<u32>,
    /// Who serves these leases; copied into every hand-off.
    pub engine: EngineInfo,
    /// Number of shards (rounded up to a power of two, at least 1).
    pub shards: usize,
    /// Longest a lease can live, from the moment it is made: heartbeats never extend it
    /// past this, and a larger ttl is clamped to it (the hand-off states the clamped ttl).
    /// Bounds how long a decode peer that keeps heartbeating can hold blocks.
    pub max_lifetime: Duration,
    /// Largest `n` (children of one parent) a lease may name; more is refused with
    /// [`LeaseError::TooManyChildren`], so per-parent bookkeeping stays bounded.
    pub max_children: u32,
    /// Shortest time the record of an ended lease is kept (so a notify or cancel retried
    /// after its first answer was lost is answered from it), unless
    /// [`Self::max_ended_records`] forces an earlier eviction. Older records are dropped as
    /// new ones arrive.
    pub ended_record_retention: Duration,
    /// Hard cap on the records of ended leases, for the whole table (split evenly over the
    /// shards). When it is reached the oldest record goes first; dropping one younger than
    /// the retention is counted ([`LeaseStats::ended_records_evicted`]).
    pub max_ended_records: usize,
}

impl LeaseConfig {
    /// Default maximum lease lifetime: 10 minutes.
    pub const DEFAULT_MAX_LIFETIME: Duration = Duration::from_secs(600);
    /// Default bound on `n`: 1024 children per parent.
    pub const DEFAULT_MAX_CHILDREN: u32 = 1024;
    /// Default retention of ended-lease records: 60 s. A decode agent retries a notify or
    /// cancel whose answer was lost within about 3 × its io timeout (10 s by default) of
    /// the first attempt, so this is twice that.
    pub const DEFAULT_ENDED_RECORD_RETENTION: Duration = Duration::from_secs(60);
    /// Default hard cap on ended-lease records: 65 536 per table (about 200 bytes each), so
    /// a retention of 60 s holds under about 1 000 lease ends a second.
    pub const DEFAULT_MAX_ENDED_RECORDS: usize = 1 << 16;

    /// A config with vLLM's default lease of 30 s, 16 shards, leases living at most
    /// 10 minutes, at most 1024 children per parent, and ended-lease records kept 60 s
    /// (at most 65 536).
    pub fn new(engine: EngineInfo, num_blocks: u32) -> Self {
        LeaseConfig {
            default_ttl: Duration::from_secs(30),
            num_blocks,
            other_group_blocks: Vec::new(),
            engine,
            shards: 16,
            max_lifetime: Self::DEFAULT_MAX_LIFETIME,
            max_children: Self::DEFAULT_MAX_CHILDREN,
            ended_record_retention: Self::DEFAULT_ENDED_RECORD_RETENTION,
            max_ended_records: Self::DEFAULT_MAX_ENDED_RECORDS,
        }
    }

    /// Number of KV-cache groups.
    pub fn num_groups(&self) -> usize {
        1 + self.other_group_blocks.len()
    }

    /// Blocks of group `group` (`None` past the last group).
    pub fn group_blocks(&self, group: usize) -> Option<u32> {
        match group {
            0 => Some(self.num_blocks),
            g => self.other_group_blocks.get(g - 1).copied(),
        }
    }

    /// The flat id of block 0 of `group`: the blocks of the groups before it (`None` past
    /// the last group, or when it does not fit a block id).
    pub fn group_base(&self, group: usize) -> Option<BlockId> {
        if group >= self.num_groups() {
            return None;
        }
        let before: u64 = (0..group).filter_map(|g| self.group_blocks(g)).map(u64::from).sum();
        BlockId::try_from(before).ok()
    }

    /// Whether every group's blocks together fit the flat id space (every flat id, and one
    /// past the last, is a block id). A table whose groups do not fit refuses every lease
    /// and grouped read; `PrefillAgent::start` refuses such memory.
    pub fn flat_ids_fit(&self) -> bool {
        let all: u64 = (0..self.num_groups()).filter_map(|g| self.group_blocks(g)).map(u64::from).sum();
        all <= u64::from(BlockId::MAX)
    }

    /// Blocks of every group together: the flat id space (saturating at `u32::MAX`).
    pub fn flat_blocks(&self) -> u32 {
        let all: u64 = (0..self.num_groups()).filter_map(|g| self.group_blocks(g)).map(u64::from).sum();
        u32::try_from(all).unwrap_or(u32::MAX)
    }
}

/// What to lease: one child's blocks.
#[derive(Debug, Clone)]
pub struct LeaseRequest {
    /// The parent request id (before parallel-sampling fan-out).
    pub parent_request_id: String,
    /// This child's index, below `n`.
    pub child_index: u32,
    /// The parent's number of children.
    pub n: u32,
    /// The prefill blocks holding this child's KV cache (its first KV-cache group).
    pub blocks: Vec<BlockId>,
    /// The blocks of each further KV-cache group (empty for a single-group cache).
    pub other_groups: Vec<Vec<BlockId>>,
    /// Distinct consumers that must notify before the lease ends as pulled.
    pub expected_consumers: u32,
    /// Lease time-to-live; the table's default when `None`.
    pub ttl: Option<Duration>,
    /// Where CRC-32Cs of the blocks will be stored once computed (after the lease is
    /// made, [`LeaseTable::hold`]): every read of the lease is handed it
    /// ([`ReadGuard::block_crcs`]). `None`: nothing is precomputed.
    pub crcs: Option<Arc<BlockCrcs>>,
}

impl LeaseRequest {
    /// A request for one consumer and the default ttl.
    pub fn new(parent: impl Into<String>, child_index: u32, n: u32, blocks: Vec<BlockId>) -> Self {
        LeaseRequest {
            parent_request_id: parent.into(),
            child_index,
            n,
            blocks,
            other_groups: Vec::new(),
            expected_consumers: 1,
            ttl: None,
            crcs: None,
        }
    }

    /// A request for a cache of several KV-cache groups: `groups[g]` are the blocks of
    /// group `g` (vLLM's nested `remote_block_ids`). One consumer, the default ttl.
    pub fn grouped(
        parent: impl Into<String>,
        child_index: u32,
        n: u32,
        mut groups: Vec<Vec<BlockId>>,
    ) -> Self {
        let first = if groups.is_empty() { Vec::new() } else { groups.remove(0) };
        let mut r = Self::new(parent, child_index, n, first);
        r.other_groups = groups;
        r
    }

    /// Sets the number of consumers (decode ranks) that must notify.
    pub fn consumers(mut self, expected: u32) -> Self {
        self.expected_consumers = expected;
        self
    }

    /// Sets the time-to-live.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Sets where the blocks' precomputed CRC-32Cs are stored ([`Self::crcs`]).
    pub fn with_crcs(mut self, crcs: Arc<BlockCrcs>) -> Self {
        self.crcs = Some(crcs);
        self
    }
}

/// How a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EndKind {
    /// Every expected consumer notified.
    Pulled,
    /// Cancelled by the decode side or the owner.
    Released,
    /// The deadline passed with consumers missing.
    Expired,
}

/// A lease that ended and whose blocks are now the owner's again. Delivered once per lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEnd {
    /// The request id the lease was made under.
    pub remote_request_id: Arc<str>,
    /// The parent request id.
    pub parent_request_id: Arc<str>,
    /// The child index.
    pub child_index: u32,
    /// The parent's n.
    pub n: u32,
    /// How it ended.
    pub kind: EndKind,
    /// The blocks to hand back, as leased (the first KV-cache group's).
    pub blocks: Arc<[BlockId]>,
    /// The blocks of each further KV-cache group, as leased (empty for one group).
    pub other_groups: Arc<[Vec<BlockId>]>,
    /// Distinct consumers that had notified.
    pub consumers_seen: u32,
    /// Consumers that were expected.
    pub expected_consumers: u32,
    /// Which lease of this request id it was: increases with every lease of the same id
    /// (what [`LeaseTable::lease_with_generation`] returned), so an end that arrives after
    /// the id was leased again is recognised as the earlier lease's.
    pub generation: u64,
    /// When the lease was made (the `now` of the lease call).
    pub leased_at: Instant,
    /// When it ended (the `now` of the operation that ended it; a draining lease is
    /// delivered later, once its last read finished).
    pub ended_at: Instant,
}

/// Result of [`LeaseTable::notify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyOutcome {
    /// Counted; this many consumers are still expected.
    Counted {
        /// Consumers still expected.
        remaining: u32,
    },
    /// The last expected consumer: the lease ended as pulled (blocks follow on [`LeaseTable::ended`]).
    Pulled,
    /// This consumer already notified; nothing changed.
    Duplicate,
    /// No lease (live or recently ended) has this id; nothing changed.
    Unrecognized,
    /// The token is wrong; nothing changed.
    BadToken,
    /// The lease had already ended (a retried notification whose first answer was lost, or
    /// one that came too late); nothing changed. Only told to a holder of the token.
    AlreadyEnded {
        /// How it ended.
        kind: EndKind,
        /// This consumer's notification had been counted before it ended.
        counted: bool,
    },
}

/// Result of [`LeaseTable::heartbeat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatOutcome {
    /// The lease now ends no earlier than this.
    Extended {
        /// The new deadline.
        deadline: Instant,
    },
    /// No lease (live or recently ended) has this id.
    Unrecognized,
    /// The token is wrong; nothing changed.
    BadToken,
    /// The lease had already ended, as `EndKind` says; nothing changed. Only told to a
    /// holder of the token.
    AlreadyEnded(EndKind),
}

/// Result of [`LeaseTable::cancel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The lease ended as released.
    Released,
    /// No lease (live or recently ended) has this id.
    Unrecognized,
    /// The token is wrong; nothing changed.
    BadToken,
    /// The lease had already ended, as `EndKind` says (a retried cancel whose first answer
    /// was lost says `Released`); nothing changed. Only told to a holder of the token.
    AlreadyEnded(EndKind),
}

/// Result of [`LeaseTable::retract`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetractOutcome {
    /// The lease is gone, and no end is ever delivered for it.
    Retracted,
    /// A read of the lease was in flight, so its hand-off had escaped after all: it was
    /// released instead, and its end is delivered on [`LeaseTable::ended`] as usual.
    Released,
    /// The lease had already ended; its end is (or was) delivered as usual.
    AlreadyEnded(EndKind),
    /// No live lease has this id.
    Unrecognized,
    /// The token is wrong; nothing changed.
    BadToken,
}

/// Why a read was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadRefused {
    /// No lease has this id.
    #[error("no lease for request {0}")]
    Unknown(String),
    /// The token is wrong.
    #[error("wrong lease token for request {0}")]
    BadToken(String),
    /// The lease has ended (only said to a holder of its token).
    #[error("the lease for request {0} has ended")]
    Ended(String),
    /// A range names no blocks (`count == 0`).
    #[error("read for request {request}: range {index} (starting at block {start}) names no blocks")]
    EmptyRange {
        /// The request id.
        request: String,
        /// Index of the range in the request.
        index: usize,
        /// Its first block.
        start: BlockId,
    },
    /// Block ids outside the layout.
    #[error("read for request {request}: block ids {ids:?} are outside the layout of {num_blocks} blocks")]
    OutOfRange {
        /// The request id.
        request: String,
        /// Offending ids (at most 16).
        ids: Vec<BlockId>,
        /// Blocks in the layout.
        num_blocks: u32,
    },
    /// The read names a KV-cache group the layout does not have.
    #[error("read for request {request}: KV-cache group {group} does not exist (the layout has {groups})")]
    NoSuchGroup {
        /// The request id.
        request: String,
        /// The group named.
        group: u32,
        /// Groups of the layout.
        groups: usize,
    },
    /// Block ids in the layout but not in this lease.
    #[error("read for request {request}: block ids {ids:?} are not part of its lease")]
    NotLeased {
        /// The request id.
        request: String,
        /// Offending ids (at most 16).
        ids: Vec<BlockId>,
    },
    /// The read names no blocks, or more blocks than the lease holds.
    #[error("read for request {request}: {requested} blocks requested, lease holds {leased}")]
    BadSize {
        /// The request id.
        request: String,
        /// Blocks requested.
        requested: u64,
        /// Blocks leased.
        leased: usize,
    },
}

/// Counters of a [`LeaseTable`]. `leased == pulled + released + expired + retracted + live`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Leases made.
    pub leased: u64,
    /// Leases ended as pulled.
    pub pulled: u64,
    /// Leases ended as released.
    pub released: u64,
    /// Leases ended as expired.
    pub expired: u64,
    /// Leases withdrawn before their hand-off was published ([`LeaseTable::retract`]); no
    /// end is delivered for them.
    pub retracted: u64,
    /// Leases not yet ended.
    pub live: u64,
    /// Ended leases whose blocks wait for reads in flight.
    pub draining: u64,
    /// Notifications, heartbeats and cancels for ids with no live lease.
    pub unrecognized: u64,
    /// Operations with a wrong token.
    pub bad_token: u64,
    /// Notifications from a consumer that had already notified.
    pub duplicate: u64,
    /// Reads refused for any reason.
    pub reads_refused: u64,
    /// Notifications, heartbeats and cancels with the right token for a lease that had
    /// already ended (answered from the ended-lease record; nothing changed).
    pub already_ended: u64,
    /// Ended-lease records dropped before [`LeaseConfig::ended_record_retention`] because
    /// [`LeaseConfig::max_ended_records`] was reached (a retry may then be answered
    /// "unrecognized").
    pub ended_records_evicted: u64,
}

#[derive(Default)]
struct Counters {
    leased: AtomicU64,
    pulled: AtomicU64,
    released: AtomicU64,
    expired: AtomicU64,
    retracted: AtomicU64,
    already_ended: AtomicU64,
    draining: AtomicU64,
    reads_in_flight: AtomicU64,
    unrecognized: AtomicU64,
    bad_token: AtomicU64,
    duplicate: AtomicU64,
    reads_refused: AtomicU64,
    ended_records_evicted: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Lease {
    /// SHA-256 of the token (the token itself is not kept): every check hashes the
    /// presented token and compares hashes.
    token_hash: [u8; 32],
    parent: Arc<str>,
    child_index: u32,
    n: u32,
    /// Group 0's blocks, as leased.
    blocks: Arc<[BlockId]>,
    /// The further groups' blocks, as leased.
    other_groups: Arc<[Vec<BlockId>]>,
    /// Every group's blocks as flat ids (the same `Arc` as `blocks` for one group): what
    /// reads are checked against.
    flat: Arc<[BlockId]>,
    /// Sorted, deduplicated copy of `flat`, made on the first read when `blocks` is not
    /// already sorted (leasing stays cheap; reads check membership by binary search).
    sorted: Option<Box<[BlockId]>>,
    expected: u32,
    /// Consumers that notified.
    consumers: Vec<Box<str>>,
    ttl: Duration,
    deadline: Instant,
    /// `max_lifetime` after the lease was made: heartbeats never extend `deadline` past it
    /// (`None`: no maximum, or one too far away for an `Instant`).
    max_deadline: Option<Instant>,
    seq: u64,
    readers: u32,
    ended: Option<EndKind>,
    /// When it was made.
    leased_at: Instant,
    /// When it ended (the `now` of the operation that ended it).
    ended_at: Option<Instant>,
    /// Its blocks' precomputed CRC-32Cs, handed to every read.
    crcs: Option<Arc<BlockCrcs>>,
}

impl Lease {
    /// The lease's blocks, sorted and deduplicated (sorting once, on first use).
    fn sorted_blocks(&mut self) -> &[BlockId] {
        if self.sorted.is_none() && !self.flat.windows(2).all(|w| w[0] < w[1]) {
            let mut s = self.flat.to_vec();
            s.sort_unstable();
            s.dedup();
            self.sorted = Some(s.into_boxed_slice());
        }
        self.sorted.as_deref().unwrap_or(&self.flat)
    }
}

/// Maps keyed by request id use foldhash with a random per-process seed: much faster than
/// SipHash on short ids, and still keyed so ids cannot be chosen to collide.
type IdMap<V> = HashMap<Arc<str>, V, foldhash::fast::RandomState>;

/// What is kept of an ended lease: how it ended, a SHA-256 of its token, hashes of the
/// consumers that had notified, when it ended, and its key in `Shard::recent_order`.
struct Tombstone {
    kind: EndKind,
    token_hash: [u8; 32],
    consumers: Box<[u64]>,
    ended_at: Instant,
    order: u64,
}

fn token_hash(token: &[u8]) -> [u8; 32] {
    #[cfg(test)]
    tests::TOKEN_HASHES.with(|c| c.set(c.get() + 1));
    Sha256::digest(token).into()
}

/// Constant-time comparison of two token hashes.
fn hashes_match(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn consumer_hash(consumer: &str) -> u64 {
    fnv1a(consumer.as_bytes(), FNV_OFFSET)
}

struct Shard {
    leases: IdMap<Lease>,
    deadlines: BTreeMap<(Instant, u64), Arc<str>>,
    /// Records of recently ended leases, so a late or retried request with the lease's
    /// token can be told how it ended. Kept at least `ended_record_retention` unless the
    /// shard's share of `max_ended_records` is reached.
    recent: IdMap<Tombstone>,
    /// The ids of `recent`, in the order their records were made (key: `Tombstone::order`).
    /// A record removed because its id was leased again leaves no entry behind.
    recent_order: BTreeMap<u64, Arc<str>>,
    next_record: u64,
    rng: ChaCha12Rng,
    next_seq: u64,
}

/// The lease table. Shared by every connection of a prefill agent (`Arc<LeaseTable>`).
pub struct LeaseTable {
    shards: Box<[Mutex<Shard>]>,
    shard_mask: u64,
    /// Keyed hash choosing a lease's shard, seeded from the table's seed: a peer that picks
    /// request ids cannot predict their shards, so it cannot crowd one shard's share of the
    /// ended-lease records to evict other leases' records early.
    shard_hasher: foldhash::quality::FixedState,
    config: LeaseConfig,
    engine: Arc<EngineInfo>,
    ended_tx: Sender<LeaseEnd>,
    ended_rx: Receiver<LeaseEnd>,
    /// Called after every end is sent on `ended_tx` (the driver's wake-up).
    end_hook: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Called after every new lease (made or armed), outside the shard lock.
    lease_hook: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    counters: Counters,
    /// Each shard's share of `LeaseConfig::max_ended_records` (at least 1).
    records_per_shard: usize,
    /// Set by [`Self::release_all`]: no lease is made afterwards.
    closed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for LeaseTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseTable").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

/// Outcome of looking a lease up by id and token, expiring it first if its deadline passed.
enum Found<'a> {
    Live(&'a mut Lease),
    /// Neither a lease nor an ended-lease record has this id.
    Missing,
    /// The lease ended (the token matched): how, and whether the consumer asked about had
    /// notified.
    Ended {
        kind: EndKind,
        counted: bool,
    },
    /// A lease or ended-lease record has this id, but not this token.
    BadToken,
}

impl LeaseTable {
    /// A table whose tokens come from a ChaCha generator seeded with `seed` (the engine seeds
    /// it from the OS; tests pass a fixed seed). The key of the hash that picks each id's
    /// shard is drawn from the same generator.
    pub fn new(config: LeaseConfig, seed: [u8; 32]) -> Self {
        let shards = config.shards.max(1).next_power_of_two();
        let (ended_tx, ended_rx) = crossbeam_channel::unbounded();
        let mut master = ChaCha12Rng::from_seed(seed);
        let shards: Box<[Mutex<Shard>]> = (0..shards)
            .map(|_| {
                Mutex::new(Shard {
                    leases: IdMap::default(),
                    deadlines: BTreeMap::new(),
                    recent: IdMap::default(),
                    recent_order: BTreeMap::new(),
                    next_record: 0,
                    rng: ChaCha12Rng::from_rng(&mut master),
                    next_seq: 0,
                })
            })
            .collect();
        let shard_hasher = foldhash::quality::FixedState::with_seed(master.next_u64());
        LeaseTable {
            shard_mask: shards.len() as u64 - 1,
            shard_hasher,
            records_per_shard: config.max_ended_records.div_ceil(shards.len()).max(1),
            shards,
            engine: Arc::new(config.engine.clone()),
            config,
            ended_tx,
            ended_rx,
            end_hook: std::sync::OnceLock::new(),
            lease_hook: std::sync::OnceLock::new(),
            counters: Counters::default(),
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The table's settings.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    fn shard_of(&self, id: &str) -> usize {
        (self.shard_hasher.hash_one(id) & self.shard_mask) as usize
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        // A panic while holding a shard lock cannot leave a lease half-updated in a way that
        // breaks exactly-once (each update is a single map operation), so poisoning is ignored.
        self.shards[index].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks everything about `req` that does not depend on the table's contents (child
    /// index, `n` against `max_children`, blocks in range and none listed twice in one
    /// group, consumers): what [`Self::lease`] checks before it looks for a live lease of
    /// the same id. Returns the request id.
    pub fn validate(&self, req: &LeaseRequest) -> Result<String, LeaseError> {
        let id = child_request_id(&req.parent_request_id, req.child_index, req.n);
        if id.len() > MAX_REQUEST_ID_LEN {
            let start = id.chars().take(32).collect();
            return Err(LeaseError::IdTooLong { start, len: id.len(), max: MAX_REQUEST_ID_LEN });
        }
        if req.n > self.config.max_children {
            return Err(LeaseError::TooManyChildren { request: id, n: req.n, max: self.config.max_children });
        }
        if req.n == 0 || req.child_index >= req.n {
            return Err(LeaseError::BadChildIndex { request: id, index: req.child_index, n: req.n });
        }
        if req.blocks.is_empty() && req.other_groups.iter().all(Vec::is_empty) {
            return Err(LeaseError::NoBlocks(id));
        }
        if req.expected_consumers == 0 {
            return Err(LeaseError::NoConsumers(id));
        }
        let groups = 1 + req.other_groups.len();
        if groups != self.config.num_groups() {
            return Err(LeaseError::GroupCount {
                request: id,
                expected: self.config.num_groups(),
                got: groups,
            });
        }
        if self.config.num_groups() > 1 && !self.config.flat_ids_fit() {
            return Err(LeaseError::GroupCount {
                request: id,
                expected: self.config.num_groups(),
                got: groups,
            });
        }
        for (group, blocks) in std::iter::once(&req.blocks).chain(&req.other_groups).enumerate() {
            let num_blocks = self.config.group_blocks(group).unwrap_or(0);
            if blocks.iter().any(|&b| b >= num_blocks) {
                let ids = blocks.iter().copied().filter(|&b| b >= num_blocks).take(MAX_IDS_SHOWN);
                return Err(LeaseError::BlocksOutOfRange { request: id, ids: ids.collect(), num_blocks });
            }
            if let Some(block) = repeated_block(blocks) {
                let group = u32::try_from(group).unwrap_or(u32::MAX);
                return Err(LeaseError::DuplicateBlock { request: id, group, block });
            }
        }
        Ok(id)
    }

    /// Registers a lease and only then returns its hand-off, with a fresh 128-bit token.
    /// A ttl above [`LeaseConfig::max_lifetime`] is clamped to it.
    pub fn lease(&self, req: LeaseRequest, now: Instant) -> Result<ChildHandoff, LeaseError> {
        self.lease_with_generation(req, now).map(|(h, _)| h)
    }

    /// [`Self::lease`], also returning the lease's generation: it increases with every
    /// lease of the same request id and is repeated in the lease's [`LeaseEnd`], so a
    /// tracker can tell an end of this lease from a late end of an earlier one.
    pub fn lease_with_generation(
        &self,
        req: LeaseRequest,
        now: Instant,
    ) -> Result<(ChildHandoff, u64), LeaseError> {
        let id = self.validate(&req)?;
        self.insert(id, req, None, now)
    }

    /// Registers a lease whose request id and token were chosen elsewhere, and returns its
    /// hand-off and generation: the two-phase lease of an engine whose scheduler process
    /// hands the id and token out (vLLM's `request_finished`) before the worker that holds
    /// the KV memory makes the lease (its next step). Checks everything [`Self::lease`]
    /// checks, and also that `id` is the request id `req` names
    /// ([`crate::child_request_id`]), that the token is not all zeros, and that it is not
    /// the token of an ended lease of the same id still on record (arming that again would
    /// bring an ended lease back: its decode side may already have been told it ended).
    /// Wakes the lease hook ([`Self::set_lease_hook`]), like every new lease.
    pub fn arm(
        &self,
        id: &str,
        req: LeaseRequest,
        token: LeaseToken,
        now: Instant,
    ) -> Result<(ChildHandoff, u64), LeaseError> {
        let expected = self.validate(&req)?;
        if expected != id {
            return Err(LeaseError::IdMismatch { given: id.to_owned(), expected });
        }
        if token.as_bytes().iter().all(|&b| b == 0) {
            return Err(LeaseError::ZeroToken(expected));
        }
        self.insert(expected, req, Some(token), now)
    }

    /// The deadline a lease made at `now` with time-to-live `ttl` gets (`None`: the default
    /// ttl; clamped to the maximum lifetime) — what a driver compares with the deadline its
    /// timer is armed for, to wake the timer only when a new lease would expire first.
    pub fn deadline_for(&self, ttl: Option<Duration>, now: Instant) -> Instant {
        deadline_after(now, self.ttl_for(ttl))
    }

    /// A lease's time-to-live: the one asked for, or the default, clamped to the maximum
    /// lifetime.
    fn ttl_for(&self, ttl: Option<Duration>) -> Duration {
        ttl.unwrap_or(self.config.default_ttl).min(self.config.max_lifetime)
    }

    /// Inserts a lease (a fresh token, or the one given) and only then builds its hand-off.
    fn insert(
        &self,
        id: String,
        req: LeaseRequest,
        given: Option<LeaseToken>,
        now: Instant,
    ) -> Result<(ChildHandoff, u64), LeaseError> {
        let ttl = self.ttl_for(req.ttl);
        let deadline = deadline_after(now, ttl);
        let max_deadline = now.checked_add(self.config.max_lifetime);
        let key: Arc<str> = Arc::from(id);
        let parent: Arc<str> = Arc::from(req.parent_request_id);
        let blocks: Arc<[BlockId]> = Arc::from(req.blocks);
        let other_groups: Arc<[Vec<BlockId>]> = Arc::from(req.other_groups);
        let flat = if other_groups.is_empty() {
            blocks.clone()
        } else {
            // Every group's blocks together fit block ids (checked in `validate`), and
            // every id is below its group's count, so no flat id overflows.
            let mut flat = blocks.to_vec();
            for (g, ids) in other_groups.iter().enumerate() {
                let base = self.config.group_base(g + 1).unwrap_or(0);
                flat.extend(ids.iter().map(|&b| base + b));
            }
            Arc::from(flat)
        };
        let given_hash = given.as_ref().map(|t| token_hash(t.as_bytes()));

        let mut shard = self.lock(self.shard_of(&key));
        // Checked under the shard lock: `release_all` sets the flag before it visits any
        // shard, so a lease is either made before its visit (and released by it) or refused.
        if self.closed.load(Ordering::Acquire) {
            return Err(LeaseError::Closed(key.to_string()));
        }
        if shard.leases.contains_key(&key) {
            return Err(LeaseError::AlreadyLeased(key.to_string()));
        }
        if let (Some(hash), Some(record)) = (&given_hash, shard.recent.get(&key)) {
            if hashes_match(&record.token_hash, hash) {
                return Err(LeaseError::TokenReused(key.to_string()));
            }
        }
        if let Some(old) = shard.recent.remove(&key) {
            shard.recent_order.remove(&old.order);
        }
        let (token, hash) = match (given, given_hash) {
            (Some(t), Some(h)) => (t, h),
            _ => {
                let t = LeaseToken::generate(&mut shard.rng);
                (t, token_hash(t.as_bytes()))
            }
        };
        let seq = shard.next_seq;
        shard.next_seq += 1;
        shard.deadlines.insert((deadline, seq), key.clone());
        shard.leases.insert(
            key.clone(),
            Lease {
                token_hash: hash,
                parent: parent.clone(),
                child_index: req.child_index,
                n: req.n,
                blocks: blocks.clone(),
                other_groups: other_groups.clone(),
                flat,
                sorted: None,
                expected: req.expected_consumers,
                consumers: Vec::new(),
                ttl,
                deadline,
                max_deadline,
                seq,
                readers: 0,
                ended: None,
                leased_at: now,
                ended_at: None,
                crcs: req.crcs,
            },
        );
        drop(shard);
        bump(&self.counters.leased);
        if let Some(hook) = self.lease_hook.get() {
            hook();
        }
        let handoff = ChildHandoff::issued(
            parent,
            req.child_index,
            req.n,
            key,
            token,
            blocks,
            other_groups,
            self.engine.clone(),
            req.expected_consumers,
            ttl,
        );
        Ok((handoff, seq))
    }

    /// Whether a live, draining or recently ended lease of `id` holds `token` — false for an
    /// id nobody leased (yet) and for a wrong token alike. For a server that lets a request
    /// for a lease not armed yet wait until it is ([`Self::arm`]); it changes and counts
    /// nothing, and hashes the presented token once, whatever the id.
    pub fn knows(&self, id: &str, token: &[u8]) -> bool {
        let presented = token_hash(token);
        let shard = self.lock(self.shard_of(id));
        match shard.leases.get(id) {
            Some(l) => hashes_match(&l.token_hash, &presented),
            None => shard.recent.get(id).is_some_and(|t| hashes_match(&t.token_hash, &presented)),
        }
    }

    /// Looks up `id` with `token`, expiring it first when its deadline is at or before
    /// `now`. The token is checked before anything else is told: a live lease, a draining
    /// one and an ended-lease record all answer `BadToken` to a wrong token. `consumer`, if
    /// given, is looked up among the notifiers of an ended lease.
    ///
    /// The presented token is hashed once, before the lookup, whatever the id turns out to
    /// be; an unknown id is compared against a hash of zeros, so every path hashes once and
    /// compares 32 bytes in constant time.
    fn find<'s>(
        &self,
        shard: &'s mut Shard,
        id: &str,
        token: &[u8],
        consumer: Option<&str>,
        now: Instant,
    ) -> Found<'s> {
        let presented = token_hash(token);
        let expired = match shard.leases.get(id) {
            None => {
                let record = shard.recent.get(id);
                let matched = hashes_match(record.map_or(&[0u8; 32], |t| &t.token_hash), &presented);
                return match record {
                    None => Found::Missing,
                    Some(_) if !matched => Found::BadToken,
                    Some(t) => Found::Ended {
                        kind: t.kind,
                        counted: consumer.is_some_and(|c| t.consumers.contains(&consumer_hash(c))),
                    },
                };
            }
            Some(l) if !hashes_match(&l.token_hash, &presented) => return Found::BadToken,
            Some(l) => match l.ended {
                Some(kind) => {
                    let counted = consumer.is_some_and(|c| l.consumers.iter().any(|n| &**n == c));
                    return Found::Ended { kind, counted };
                }
                None => l.deadline <= now,
            },
        };
        if expired {
            let counted = consumer
                .is_some_and(|c| shard.leases.get(id).is_some_and(|l| l.consumers.iter().any(|n| &**n == c)));
            self.end(shard, id, EndKind::Expired, now);
            return Found::Ended { kind: EndKind::Expired, counted };
        }
        match shard.leases.get_mut(id) {
            Some(l) => Found::Live(l),
            None => Found::Missing,
        }
    }

    /// Ends the live lease `id` at `now`: counts it, removes its deadline, and hands its
    /// blocks back now, or when its last read finishes.
    fn end(&self, shard: &mut Shard, id: &str, kind: EndKind, now: Instant) {
        let Some(lease) = shard.leases.get_mut(id) else { return };
        debug_assert!(lease.ended.is_none(), "a lease ends once");
        if lease.ended.is_some() {
            return;
        }
        lease.ended = Some(kind);
        lease.ended_at = Some(now);
        let (deadline, seq, readers) = (lease.deadline, lease.seq, lease.readers);
        shard.deadlines.remove(&(deadline, seq));
        bump(match kind {
            EndKind::Pulled => &self.counters.pulled,
            EndKind::Released => &self.counters.released,
            EndKind::Expired => &self.counters.expired,
        });
        if readers == 0 {
            self.hand_back(shard, id);
        } else {
            bump(&self.counters.draining);
        }
    }

    /// Drops the records of `shard` that ended at least `ended_record_retention` before
    /// `now`, oldest first.
    fn prune_records(&self, shard: &mut Shard, now: Instant) {
        let retention = self.config.ended_record_retention;
        while let Some(entry) = shard.recent_order.first_entry() {
            let old_enough = shard
                .recent
                .get(entry.get())
                .is_none_or(|t| now.checked_duration_since(t.ended_at).is_some_and(|age| age >= retention));
            if !old_enough {
                break;
            }
            let id = entry.remove();
            shard.recent.remove(&id);
        }
    }

    /// Removes the ended lease `id` and leaves its record: first dropping records past their
    /// retention, then, at the shard's cap, the oldest one (counted when it was younger than
    /// the retention).
    fn hand_back(&self, shard: &mut Shard, id: &str) {
        let Some((key, lease)) = shard.leases.remove_entry(id) else { return };
        let (Some(kind), Some(ended_at)) = (lease.ended, lease.ended_at) else { return };
        self.prune_records(shard, ended_at);
        while shard.recent.len() >= self.records_per_shard {
            let Some((_, old)) = shard.recent_order.pop_first() else { break };
            if shard.recent.remove(&old).is_some() {
                bump(&self.counters.ended_records_evicted);
            }
        }
        let order = shard.next_record;
        shard.next_record += 1;
        let tombstone = Tombstone {
            kind,
            token_hash: lease.token_hash,
            consumers: lease.consumers.iter().map(|c| consumer_hash(c)).collect(),
            ended_at,
            order,
        };
        if let Some(replaced) = shard.recent.insert(key.clone(), tombstone) {
            // Not expected (a lease removes its id's record when it is made), but never
            // leave an order entry without its record.
            shard.recent_order.remove(&replaced.order);
        }
        shard.recent_order.insert(order, key.clone());
        let consumers_seen = lease.consumers.len() as u32;
        let end = LeaseEnd {
            remote_request_id: key,
            parent_request_id: lease.parent,
            child_index: lease.child_index,
            n: lease.n,
            kind,
            blocks: lease.blocks,
            other_groups: lease.other_groups,
            consumers_seen,
            expected_consumers: lease.expected,
            generation: lease.seq,
            leased_at: lease.leased_at,
            ended_at,
        };
        // The receiver lives in `self`, so the channel is never disconnected.
        let _ = self.ended_tx.send(end);
        if let Some(hook) = self.end_hook.get() {
            hook();
        }
    }

    /// A consumer finished pulling `id`. The lease ends as pulled when every expected
    /// consumer has notified. Unknown ids, wrong tokens, duplicates and notifications of
    /// ended leases change nothing; the last are answered from the ended-lease record.
    pub fn notify(&self, id: &str, token: &[u8], consumer: &str, now: Instant) -> NotifyOutcome {
        let mut shard = self.lock(self.shard_of(id));
        let lease = match self.find(&mut shard, id, token, Some(consumer), now) {
            Found::Live(l) => l,
            Found::Missing => {
                bump(&self.counters.unrecognized);
                return NotifyOutcome::Unrecognized;
            }
            Found::Ended { kind, counted } => {
                bump(&self.counters.already_ended);
                return NotifyOutcome::AlreadyEnded { kind, counted };
            }
            Found::BadToken => {
                bump(&self.counters.bad_token);
                return NotifyOutcome::BadToken;
            }
        };
        if lease.consumers.iter().any(|c| &**c == consumer) {
            bump(&self.counters.duplicate);
            return NotifyOutcome::Duplicate;
        }
        lease.consumers.push(consumer.into());
        let remaining = lease.expected.saturating_sub(lease.consumers.len() as u32);
        if remaining > 0 {
            return NotifyOutcome::Counted { remaining };
        }
        self.end(&mut shard, id, EndKind::Pulled, now);
        NotifyOutcome::Pulled
    }

    /// Extends a live lease to `max(deadline, min(now + 2/3 ttl, made + max_lifetime))`:
    /// never shortened, never past the lease's maximum lifetime.
    pub fn heartbeat(&self, id: &str, token: &[u8], now: Instant) -> HeartbeatOutcome {
        let mut shard = self.lock(self.shard_of(id));
        let lease = match self.find(&mut shard, id, token, None, now) {
            Found::Live(l) => l,
            Found::Missing => {
                bump(&self.counters.unrecognized);
                return HeartbeatOutcome::Unrecognized;
            }
            Found::Ended { kind, .. } => {
                bump(&self.counters.already_ended);
                return HeartbeatOutcome::AlreadyEnded(kind);
            }
            Found::BadToken => {
                bump(&self.counters.bad_token);
                return HeartbeatOutcome::BadToken;
            }
        };
        let old = (lease.deadline, lease.seq);
        let two_thirds = lease.ttl.checked_mul(2).map_or(lease.ttl / 3 * 2, |t| t / 3);
        let extended = deadline_after(now, two_thirds);
        let new = lease.deadline.max(lease.max_deadline.map_or(extended, |max| extended.min(max)));
        lease.deadline = new;
        if new != old.0 {
            if let Some(key) = shard.deadlines.remove(&old) {
                shard.deadlines.insert((new, old.1), key);
            }
        }
        HeartbeatOutcome::Extended { deadline: new }
    }

    /// Releases a live lease at once (the decode side or the owner dropped the child).
    pub fn cancel(&self, id: &str, token: &[u8], now: Instant) -> CancelOutcome {
        let mut shard = self.lock(self.shard_of(id));
        match self.find(&mut shard, id, token, None, now) {
            Found::Live(_) => {}
            Found::Missing => {
                bump(&self.counters.unrecognized);
                return CancelOutcome::Unrecognized;
            }
            Found::Ended { kind, .. } => {
                bump(&self.counters.already_ended);
                return CancelOutcome::AlreadyEnded(kind);
            }
            Found::BadToken => {
                bump(&self.counters.bad_token);
                return CancelOutcome::BadToken;
            }
        }
        self.end(&mut shard, id, EndKind::Released, now);
        CancelOutcome::Released
    }

    /// Withdraws a lease whose hand-off was never published (the owner's call that made it
    /// failed before returning it): the lease is removed with no end event and no
    /// ended-lease record, and counted as retracted, so
    /// `leased == pulled + released + expired + retracted + live` still holds.
    ///
    /// The deadline is not consulted: a lease not yet ended is retracted even if its
    /// deadline has passed. A lease that has already ended (the expiry driver got to it
    /// first) is left alone and its end is delivered as usual (`AlreadyEnded`). A lease with
    /// a read in flight — which means its token had escaped after all — is released
    /// instead (ending at `now`), and its end follows its last read (`Released`).
    pub fn retract(&self, id: &str, token: &[u8], now: Instant) -> RetractOutcome {
        let presented = token_hash(token);
        let mut shard = self.lock(self.shard_of(id));
        let Some(lease) = shard.leases.get(id) else {
            return match shard.recent.get(id) {
                Some(t) if hashes_match(&t.token_hash, &presented) => RetractOutcome::AlreadyEnded(t.kind),
                Some(_) => RetractOutcome::BadToken,
                None => RetractOutcome::Unrecognized,
            };
        };
        if !hashes_match(&lease.token_hash, &presented) {
            return RetractOutcome::BadToken;
        }
        if let Some(kind) = lease.ended {
            return RetractOutcome::AlreadyEnded(kind);
        }
        if lease.readers > 0 {
            self.end(&mut shard, id, EndKind::Released, now);
            return RetractOutcome::Released;
        }
        let key = (lease.deadline, lease.seq);
        shard.deadlines.remove(&key);
        shard.leases.remove(id);
        bump(&self.counters.retracted);
        RetractOutcome::Retracted
    }

    /// Ends every lease whose deadline is at or before `now`; returns how many ended. Also
    /// drops ended-lease records past their retention. Costs O(log n) per expired lease or
    /// dropped record; unexpired leases and younger records are not visited.
    pub fn expire(&self, now: Instant) -> usize {
        let mut count = 0;
        for index in 0..self.shards.len() {
            let mut shard = self.lock(index);
            while let Some(entry) = shard.deadlines.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let key = entry.get().clone();
                self.end(&mut shard, &key, EndKind::Expired, now);
                count += 1;
            }
            self.prune_records(&mut shard, now);
        }
        count
    }

    /// The earliest deadline of any live lease: when the driver should call [`Self::expire`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        (0..self.shards.len())
            .filter_map(|i| self.lock(i).deadlines.first_key_value().map(|(k, _)| k.0))
            .min()
    }

    /// Leases that ended and whose blocks are free again, each delivered once. Receive from
    /// it (blocking or not) to learn how each lease ended.
    pub fn ended(&self) -> &Receiver<LeaseEnd> {
        &self.ended_rx
    }

    /// Sets a function called right after each end is sent on [`Self::ended`] — an async
    /// driver's wake-up (e.g. notifying a task), so nobody has to block on the channel. It
    /// runs on the thread that ended the lease, under a shard lock: it must be quick and
    /// must not call into the table. Only the first hook set is kept (returns false after).
    pub fn set_end_hook(&self, hook: impl Fn() + Send + Sync + 'static) -> bool {
        self.end_hook.set(Box::new(hook)).is_ok()
    }

    /// Sets a function called right after each new lease is in the table ([`Self::lease`]
    /// or [`Self::arm`]), on the thread that made it, outside any lock: a server's wake-up
    /// for requests waiting for a lease to be armed. It must be quick. Only the first hook
    /// set is kept (returns false after).
    pub fn set_lease_hook(&self, hook: impl Fn() + Send + Sync + 'static) -> bool {
        self.lease_hook.set(Box::new(hook)).is_ok()
    }

    /// Ends every live lease as released (the owner shuts down): each end is delivered on
    /// [`Self::ended`] as usual — at once, or when its last read finishes. Returns how many
    /// ended. The table is closed from then on: [`Self::lease`] refuses with
    /// [`LeaseError::Closed`], so no lease is left without an end.
    pub fn release_all(&self, now: Instant) -> usize {
        // No lease is made from here on (checked under each shard's lock by `lease`).
        self.closed.store(true, Ordering::Release);
        let mut count = 0;
        for index in 0..self.shards.len() {
            let mut shard = self.lock(index);
            let live: Vec<Arc<str>> =
                shard.leases.iter().filter(|(_, l)| l.ended.is_none()).map(|(id, _)| id.clone()).collect();
            for id in live {
                self.end(&mut shard, &id, EndKind::Released, now);
                count += 1;
            }
        }
        count
    }

    /// Reads (and pins) in flight: read guards not yet dropped.
    pub fn reads_in_flight(&self) -> u64 {
        self.counters.reads_in_flight.load(Ordering::Relaxed)
    }

    /// [`Self::begin_read`] of `ranges` of KV-cache group `group` (group-local block ids):
    /// refuses a group the layout does not have and ids outside the group (naming the
    /// group's block count) before anything else is looked at, then reads the same blocks
    /// as flat ids. Group 0 is exactly [`Self::begin_read`].
    pub fn begin_group_read(
        self: &Arc<Self>,
        id: &str,
        token: &[u8],
        group: u32,
        ranges: &[BlockRange],
        now: Instant,
    ) -> Result<ReadGuard, ReadRefused> {
        if group == 0 && self.config.num_groups() == 1 {
            return self.begin_read(id, token, ranges, now);
        }
        let refused = |r: ReadRefused| {
            bump(&self.counters.reads_refused);
            Err(r)
        };
        let g = group as usize;
        // Groups whose flat ids do not fit have no leases: no group is read.
        let fits = self.config.flat_ids_fit();
        let (Some(num_blocks), Some(base), true) =
            (self.config.group_blocks(g), self.config.group_base(g), fits)
        else {
            let groups = self.config.num_groups();
            return refused(ReadRefused::NoSuchGroup { request: id.to_owned(), group, groups });
        };
        if let Some(r) = out_of_range(id, ranges, num_blocks) {
            return refused(r);
        }
        // In the group, so below `base + num_blocks`, which fits a block id.
        let flat: Vec<BlockRange> =
            ranges.iter().map(|r| BlockRange { start: base + r.start, count: r.count }).collect();
        self.begin_read(id, token, &flat, now)
    }

    /// Starts a read of `ranges` of lease `id`. While the returned guard lives, the lease's
    /// blocks are not handed back even if the lease ends. Refused for unknown leases, wrong
    /// tokens, ended leases (said only with the right token), ranges naming no blocks, and
    /// blocks outside the layout or the lease.
    pub fn begin_read(
        self: &Arc<Self>,
        id: &str,
        token: &[u8],
        ranges: &[BlockRange],
        now: Instant,
    ) -> Result<ReadGuard, ReadRefused> {
        let index = self.shard_of(id);
        let mut shard = self.lock(index);
        let refused = |r: ReadRefused| {
            bump(&self.counters.reads_refused);
            Err(r)
        };
        let lease = match self.find(&mut shard, id, token, None, now) {
            Found::Live(l) => l,
            Found::Missing => return refused(ReadRefused::Unknown(id.to_owned())),
            Found::Ended { .. } => return refused(ReadRefused::Ended(id.to_owned())),
            Found::BadToken => {
                bump(&self.counters.bad_token);
                return refused(ReadRefused::BadToken(id.to_owned()));
            }
        };
        // A range of no blocks would pass every per-block check below while its start
        // points anywhere: refused first.
        if let Some((index, r)) = ranges.iter().enumerate().find(|(_, r)| r.count == 0) {
            return refused(ReadRefused::EmptyRange { request: id.to_owned(), index, start: r.start });
        }
        let requested: u64 = ranges.iter().map(|r| u64::from(r.count)).sum();
        if requested == 0 || requested > lease.flat.len() as u64 {
            let leased = lease.flat.len();
            return refused(ReadRefused::BadSize { request: id.to_owned(), requested, leased });
        }
        let num_blocks = self.config.flat_blocks();
        if let Some(r) = out_of_range(id, ranges, num_blocks) {
            return refused(r);
        }
        let held = lease.sorted_blocks();
        let not_leased: Vec<BlockId> = ranges
            .iter()
            .flat_map(BlockRange::iter)
            .filter(|b| held.binary_search(b).is_err())
            .take(MAX_IDS_SHOWN)
            .collect();
        if !not_leased.is_empty() {
            return refused(ReadRefused::NotLeased { request: id.to_owned(), ids: not_leased });
        }
        bump(&self.counters.reads_in_flight);
        Ok(self.guard(index, id, lease, true))
    }

    /// A guard over `lease`'s blocks (one more reader of it); `counted` when it is a read
    /// in flight.
    fn guard(self: &Arc<Self>, shard: usize, id: &str, lease: &mut Lease, counted: bool) -> ReadGuard {
        lease.readers += 1;
        ReadGuard {
            table: Arc::clone(self),
            shard,
            key: Arc::from(id),
            seq: lease.seq,
            max_deadline: lease.max_deadline,
            crcs: lease.crcs.clone(),
            counted,
        }
    }

    /// Holds the blocks of the live lease `id` of generation `generation` (as
    /// [`Self::lease_with_generation`] or [`Self::arm`] returned it) like a read does — its
    /// blocks are not handed back before the guard drops, even if it ends — for the lease's
    /// owner to read them itself (the CRC-32C precompute). Not counted as a read in flight.
    /// `None` when that lease is no longer live (ended, retracted, or replaced).
    ///
    /// A held lease that is retracted is released instead ([`Self::retract`]): hold a lease
    /// only once its hand-off is going to be returned.
    pub fn hold(self: &Arc<Self>, id: &str, generation: u64) -> Option<ReadGuard> {
        let index = self.shard_of(id);
        let mut shard = self.lock(index);
        let lease = shard.leases.get_mut(id).filter(|l| l.seq == generation && l.ended.is_none())?;
        Some(self.guard(index, id, lease, false))
    }

    /// Checks the table's private bookkeeping against itself: every live lease has exactly
    /// one deadline entry and every deadline entry a live lease; an ended lease stays only
    /// while it has readers; tombstones are bounded; the counters balance. Fuzzing only
    /// (reached through `kvxfer_core::fuzzing`).
    #[cfg(fuzzing)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let (mut live, mut draining) = (0u64, 0u64);
        for i in 0..self.shards.len() {
            let shard = self.lock(i);
            let mut live_here = 0;
            for (id, l) in &shard.leases {
                if self.shard_of(id) != i {
                    return Err(format!("{id} is in shard {i}, hashes to {}", self.shard_of(id)));
                }
                match l.ended {
                    None => {
                        live_here += 1;
                        if shard.deadlines.get(&(l.deadline, l.seq)).map(|k| &**k) != Some(&**id) {
                            return Err(format!("live lease {id} has no deadline entry"));
                        }
                    }
                    Some(kind) if l.readers == 0 => {
                        return Err(format!("{id} ended {kind:?} without readers but was not handed back"))
                    }
                    Some(_) => draining += 1,
                }
            }
            if shard.deadlines.len() != live_here {
                return Err(format!(
                    "shard {i}: {} deadlines for {live_here} live leases",
                    shard.deadlines.len()
                ));
            }
            if let Some((id, _)) =
                shard.recent.iter().find(|(id, t)| shard.recent_order.get(&t.order) != Some(*id))
            {
                return Err(format!("shard {i}: the record of {id} has no order entry"));
            }
            if shard.recent.len() != shard.recent_order.len() || shard.recent.len() > self.records_per_shard {
                return Err(format!(
                    "shard {i}: {} records, {} in order, bound {}",
                    shard.recent.len(),
                    shard.recent_order.len(),
                    self.records_per_shard
                ));
            }
            live += live_here as u64;
        }
        let s = self.stats();
        if s.live != live || s.draining != draining {
            return Err(format!("counters say {s:?}, tables hold {live} live and {draining} draining"));
        }
        if s.leased != s.pulled + s.released + s.expired + s.retracted + s.live {
            return Err(format!("books do not balance: {s:?}"));
        }
        Ok(())
    }

    fn end_read(&self, shard_index: usize, key: &str, seq: u64, counted: bool) {
        if counted {
            self.counters.reads_in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        let mut shard = self.lock(shard_index);
        let Some(lease) = shard.leases.get_mut(key) else { return };
        if lease.seq != seq {
            return;
        }
        lease.readers -= 1;
        if lease.readers == 0 && lease.ended.is_some() {
            self.counters.draining.fetch_sub(1, Ordering::Relaxed);
            self.hand_back(&mut shard, key);
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> LeaseStats {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (leased, pulled, released, expired, retracted) =
            (load(&c.leased), load(&c.pulled), load(&c.released), load(&c.expired), load(&c.retracted));
        LeaseStats {
            leased,
            pulled,
            released,
            expired,
            retracted,
            live: leased.saturating_sub(pulled + released + expired + retracted),
            draining: load(&c.draining),
            unrecognized: load(&c.unrecognized),
            bad_token: load(&c.bad_token),
            duplicate: load(&c.duplicate),
            reads_refused: load(&c.reads_refused),
            already_ended: load(&c.already_ended),
            ended_records_evicted: load(&c.ended_records_evicted),
        }
    }
}

/// A read in flight on a lease. While it lives the lease's blocks stay pinned, even if the
/// lease ends; dropping the last guard of an ended lease hands its blocks back.
#[derive(Debug)]
pub struct ReadGuard {
    table: Arc<LeaseTable>,
    shard: usize,
    key: Arc<str>,
    seq: u64,
    max_deadline: Option<Instant>,
    crcs: Option<Arc<BlockCrcs>>,
    /// Counted in `reads_in_flight` (a read or pin; not a [`LeaseTable::hold`]).
    counted: bool,
}

impl ReadGuard {
    /// Where the lease's precomputed CRC-32Cs are stored, if it was made with a store
    /// ([`LeaseRequest::crcs`]); values not computed yet are missing from it.
    pub fn block_crcs(&self) -> Option<&BlockCrcs> {
        self.crcs.as_deref()
    }

    /// Whether the lease ended (or is gone): a holder ([`LeaseTable::hold`]) with work left
    /// for it stops and drops the guard, so the blocks are handed back.
    pub fn lease_ended(&self) -> bool {
        let shard = self.table.lock(self.shard);
        shard.leases.get(&*self.key).is_none_or(|l| l.seq != self.seq || l.ended.is_some())
    }

    /// The request id being read.
    pub fn request_id(&self) -> &str {
        &self.key
    }

    /// The lease's hard deadline: [`LeaseConfig::max_lifetime`] after it was made, which no
    /// heartbeat extends (`None`: no maximum). A server holding this guard for a pin or a
    /// long read should not hold it (much) past this, or the maximum lifetime is moot.
    pub fn expires_no_later_than(&self) -> Option<Instant> {
        self.max_deadline
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        self.table.end_read(self.shard, &self.key, self.seq, self.counted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::EngineInfo;

    thread_local! {
        /// Token hashes computed on this thread (each test runs on its own thread).
        pub(super) static TOKEN_HASHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    fn hashes_during(f: impl FnOnce()) -> u64 {
        let before = TOKEN_HASHES.with(|c| c.get());
        f();
        TOKEN_HASHES.with(|c| c.get()) - before
    }

    /// A table of 8 blocks with a fixed seed.
    fn small_table() -> Arc<LeaseTable> {
        let engine = EngineInfo {
            engine_id: "e".into(),
            host: "127.0.0.1".into(),
            port: 1,
            tp_size: 1,
            incarnation: 0,
        };
        Arc::new(LeaseTable::new(LeaseConfig::new(engine, 8), [3; 32]))
    }

    /// A hold keeps a lease's blocks like a read (its end is delivered when the hold drops)
    /// without counting as a read in flight; it is refused for another generation or an
    /// ended lease; reads are handed the lease's CRC store.
    #[test]
    fn a_hold_keeps_the_blocks_uncounted_and_reads_see_the_crc_store() {
        let t = small_table();
        let t0 = Instant::now();
        let crcs = Arc::new(BlockCrcs::new());
        let req = LeaseRequest::new("L", 0, 1, vec![1, 2]).with_crcs(crcs.clone());
        let (h, generation) = t.lease_with_generation(req, t0).expect("lease");
        assert!(t.hold("L_0", generation + 1).is_none(), "another generation");
        let hold = t.hold(h.remote_request_id(), generation).expect("live");
        assert_eq!(t.reads_in_flight(), 0, "a hold is not a read");
        assert!(!hold.lease_ended());
        let read = t
            .begin_read(h.remote_request_id(), h.token().as_bytes(), &[BlockRange { start: 1, count: 2 }], t0)
            .expect("read");
        assert!(read.block_crcs().is_some_and(|c| std::ptr::eq(c, &*crcs)));
        drop(read);
        t.cancel(h.remote_request_id(), h.token().as_bytes(), t0);
        assert!(hold.lease_ended());
        assert!(t.ended().try_recv().is_err(), "held: not handed back yet");
        assert!(t.hold(h.remote_request_id(), generation).is_none(), "ended");
        drop(hold);
        assert_eq!(t.ended().try_recv().expect("handed back").kind, EndKind::Released);
        assert_eq!(t.stats().draining, 0);
    }

    /// Review finding 8: an unknown id returned at once, a live lease compared 16 bytes and an
    /// ended one hashed the token, so timing told them apart. Every lookup now hashes the
    /// presented token exactly once and compares hashes, whatever the id is.
    #[test]
    fn every_token_check_hashes_the_presented_token_exactly_once() {
        let t = small_table();
        let t0 = Instant::now();
        let live = t.lease(LeaseRequest::new("L", 0, 1, vec![1]), t0).expect("lease");
        let ended = t.lease(LeaseRequest::new("E", 0, 1, vec![2]), t0).expect("lease");
        t.cancel("E", ended.token().as_bytes(), t0);
        let range = [BlockRange { start: 1, count: 1 }];
        for (id, right) in
            [("U", [0u8; 16]), ("L", *live.token().as_bytes()), ("E", *ended.token().as_bytes())]
        {
            for token in [right, [0x5a; 16]] {
                assert_eq!(hashes_during(|| _ = t.notify(id, &token, "c", t0)), 1, "notify {id}");
                assert_eq!(hashes_during(|| _ = t.heartbeat(id, &token, t0)), 1, "heartbeat {id}");
                assert_eq!(hashes_during(|| drop(t.begin_read(id, &token, &range, t0))), 1, "read {id}");
            }
        }
    }
}
