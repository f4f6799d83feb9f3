//! The decode side's pull of one prefill result, as a sans-IO state machine (quinn-proto
//! style): events in, actions out, `now` as an argument.
//!
//! A [`PullMachine`] is built from a [`ResultPlan`] and the children being pulled. The driver
//! (the engine's pull task) feeds it what happened — the handshake finished
//! ([`PullMachine::connected`]), a read finished ([`PullMachine::read_finished`]), the caller
//! cancelled a child ([`PullMachine::cancel`]), a notify or cancel was answered
//! ([`PullMachine::control_answered`]), time passed ([`PullMachine::handle_timeout`]) — and
//! carries out the [`Action`]s it asks for, in order, from [`PullMachine::poll_action`]: start
//! or abort a read, copy shared blocks between siblings, notify or cancel a lease, heartbeat,
//! report a child, finish.
//!
//! The decisions it owns:
//! - Each child with wire runs reads them (each distinct remote block of the result once, as
//!   the plan says); a read is started only while somebody needs it: its child, or a sibling
//!   that depends on it and is neither cancelled nor decided. A read nobody needs any more is
//!   aborted when the transport can abort it (TCP), else left to finish (a UCX get).
//! - A child is decided only when nothing can still touch its local blocks: every read that
//!   writes one of them or that it depends on has ended, and every sibling copy from or into
//!   them has been made or dropped. Sibling copies are made as soon as their sources are all
//!   read, so **no report hands back blocks a copy still reads or writes**.
//! - How it ends: blocks overlapping a read the transport could not stop →
//!   [`ChildOutcome::FailedBlocksHeld`]; cancelled → [`ChildOutcome::Cancelled`]; a read it
//!   depends on failed → [`ChildOutcome::Failed`] (a sibling's failure as
//!   [`PullError::SiblingFailed`]); otherwise [`ChildOutcome::Done`] after its notify.
//!   Every lease gets exactly one notify or cancel, unless the peer is unreachable.
//! - Heartbeats of every undecided lease every `heartbeat_every` while reads are under way.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::plan::ResultPlan;
use crate::BlockId;

/// What a serving engine should do about a failed child ([`PullError::advice`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Advice {
    /// Transient: get a fresh hand-off (run the prefill again, possibly on another prefill
    /// worker) and pull that. The old hand-off is spent: the pull released its lease.
    RetryFreshHandoff,
    /// This prefill/decode pair cannot transfer (configuration: layouts, versions, keys,
    /// transports, or a misbehaving peer): compute the prefill locally, and fix the setup.
    Recompute,
    /// The request cannot be served here (the decode agent is shutting down): fail it, or
    /// send it to another decode worker. (Local blocks that do not fit are refused before
    /// any I/O, by `submit`.)
    FailRequest,
}

/// Which value of a handshake two peers disagree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MismatchField {
    /// The protocol version.
    ProtocolVersion,
    /// The compatibility hash of the block layout (block bytes, segments, dtype, tokens per
    /// block).
    CompatHash,
}

/// Why one child of a pull failed. Each variant says (in its docs and in
/// [`PullError::advice`]) what a serving engine should do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PullError {
    /// No connection to the prefill agent could be opened (refused, unreachable, timed
    /// out). Advice: retry from a fresh hand-off (another prefill worker).
    #[error("no connection to the peer: {detail} (kind=connect)")]
    Connect {
        /// The prefill agent's address.
        peer: String,
        /// What failed, naming the address.
        detail: String,
    },
    /// The handshake failed because the two agents are not compatible: protocol versions or
    /// layout compatibility hashes differ. Advice: recompute (this pair will never
    /// transfer; fix the deployment).
    #[error("incompatible peer: handshake with {peer} refused: {message} (kind=incompatible)")]
    Incompatible {
        /// The prefill agent's address.
        peer: String,
        /// Which value differs.
        field: MismatchField,
        /// This agent's value (protocol version, or compatibility hash).
        local: u64,
        /// The peer's value, when it sent it (its `HelloAck`); a refusal by the peer names
        /// both values in `message` only.
        remote: Option<u64>,
        /// The refusal, naming both sides' values.
        message: String,
    },
    /// The peer refused the handshake for another reason (it is over its connection
    /// limits, or sent something malformed). Advice: retry from a fresh hand-off.
    #[error("handshake refused by the peer: {peer}: {message} (kind=handshake_refused)")]
    HandshakeRefused {
        /// The prefill agent's address.
        peer: String,
        /// The peer's message.
        message: String,
    },
    /// The authenticated handshake failed: no cluster key on one side, different keys, or
    /// a replayed handshake. Advice: recompute (and fix the cluster keys).
    #[error("authentication with the peer failed: {detail} (kind=authentication)")]
    Authentication {
        /// The prefill agent's address.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// The agent at the hand-off's address is another prefill process than the one that
    /// made the hand-off (it restarted: its leases are gone). Advice: retry from a fresh
    /// hand-off.
    #[error(
        "stale hand-off: {peer} is engine {found_engine} incarnation {}, but the \
         hand-off names engine {expected_engine} incarnation {} (the prefill worker restarted; its \
         leases are gone) (kind=peer_restarted)",
        crate::log::Incarnation(*found_incarnation),
        fmt_incarnation(*expected_incarnation)
    )]
    PeerRestarted {
        /// The prefill agent's address.
        peer: String,
        /// The engine id the hand-off names.
        expected_engine: String,
        /// The incarnation the hand-off names (0: not stated).
        expected_incarnation: u64,
        /// The engine id found at the address.
        found_engine: String,
        /// The incarnation found at the address.
        found_incarnation: u64,
    },
    /// The prefill side has no live lease with this id and token (never made, or ended long
    /// ago, or a wrong token: the peer does not say which). Advice: retry from a fresh
    /// hand-off.
    #[error("no such lease at the peer: {peer} refused the read of {remote_request_id}: {message} (kind=lease_unknown)")]
    LeaseUnknown {
        /// The prefill agent's address.
        peer: String,
        /// The lease's request id.
        remote_request_id: String,
        /// The peer's message.
        message: String,
    },
    /// The lease has ended (expired, released, or pulled by other consumers) before it was
    /// read. Advice: retry from a fresh hand-off (and heartbeat sooner, if it expired).
    #[error("lease ended before it was read: {peer} refused the read of {remote_request_id}: {message} (kind=lease_ended)")]
    LeaseEnded {
        /// The prefill agent's address.
        peer: String,
        /// The lease's request id.
        remote_request_id: String,
        /// The peer's message.
        message: String,
    },
    /// The peer refused a request for another reason (over a limit, blocks outside the
    /// lease). Advice: retry from a fresh hand-off.
    #[error("request not served: {detail} (kind=refused)")]
    Refused {
        /// The prefill agent's address.
        peer: String,
        /// The refusal, with the peer's error code and message.
        detail: String,
    },
    /// A payload failed its integrity check (CRC-32C, length, or an answer to another read).
    /// Nothing of it was used. Advice: retry from a fresh hand-off (and check the network).
    #[error("corrupt payload: {detail} (kind=integrity)")]
    Integrity {
        /// The prefill agent's address.
        peer: String,
        /// What differed.
        detail: String,
    },
    /// The peer stopped answering or moving bytes within the I/O timeout (or a read's
    /// overall deadline). Advice: retry from a fresh hand-off.
    #[error("no progress from the peer: {detail} (kind=timeout)")]
    Timeout {
        /// The prefill agent's address.
        peer: String,
        /// What timed out.
        detail: String,
    },
    /// The connection broke mid-exchange (reset, closed). Advice: retry from a fresh
    /// hand-off.
    #[error("connection lost: {detail} (kind=connection_lost)")]
    ConnectionLost {
        /// The prefill agent's address.
        peer: String,
        /// What happened.
        detail: String,
    },
    /// The peer broke the protocol (an unexpected frame or answer). Advice: recompute.
    #[error("protocol error: {detail} (kind=protocol)")]
    Protocol {
        /// The prefill agent's address.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The hand-off names remote blocks outside the prefill agent's layout. Advice:
    /// recompute (the hand-off is wrong).
    #[error("remote blocks out of range: block ids {ids:?} are outside the prefill layout of {num_blocks} blocks (kind=remote_blocks_out_of_range)")]
    RemoteBlocksOutOfRange {
        /// The offending ids (at most 16).
        ids: Vec<BlockId>,
        /// Blocks in the prefill layout.
        num_blocks: u32,
    },
    /// The data path the configuration asks for is not available with this peer (UCX
    /// required but not offered, or its endpoint could not be made). Advice: recompute (and
    /// fix the transport settings).
    #[error("data path unavailable: {detail} (kind=transport_unavailable)")]
    TransportUnavailable {
        /// The prefill agent's address.
        peer: String,
        /// What is missing.
        detail: String,
    },
    /// A one-sided (UCX) read failed or made no progress. Advice: retry from a fresh
    /// hand-off.
    #[error("UCX read failed: {detail} (kind=ucx_read)")]
    UcxRead {
        /// The prefill agent's address.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// A one-sided read finished, but the prefill side had dropped its pin before (its hold
    /// time passed) or the unpin got no answer: the bytes cannot be trusted. Advice: retry
    /// from a fresh hand-off.
    #[error("pin not held through the read: {detail} (kind=pin_not_held)")]
    PinNotHeld {
        /// The prefill agent's address.
        peer: String,
        /// What happened to the pin.
        detail: String,
    },
    /// Discovery (etcd) says the engine rank the hand-off names cannot be pulled from: the
    /// process that made the hand-off deregistered or its registration expired (it shut down
    /// or crashed: its leases are gone), or — for a hand-off that names only the engine id —
    /// no such rank is registered (yet). Nothing was sent to the engine. Advice: retry from a
    /// fresh hand-off.
    #[error(
        "engine unknown to discovery: engine {engine} rank {rank}: {detail} (kind=engine_not_registered)"
    )]
    EngineNotRegistered {
        /// The engine id the hand-off names.
        engine: String,
        /// The engine rank pulled from.
        rank: u32,
        /// What discovery knows, naming the incarnation and the namespace.
        detail: String,
    },
    /// This child's blocks depend on a read made for a sibling (shared prompt blocks), and
    /// that read failed. Advice: the cause's.
    #[error("shared blocks were read for sibling {sibling}, which failed: {cause} (kind=sibling_failed)")]
    SiblingFailed {
        /// The sibling's child index.
        sibling: u32,
        /// Why the sibling's read failed.
        cause: Box<PullError>,
    },
    /// The decode agent shut down before the child's blocks were read. Advice: fail the
    /// request (or retry on another decode worker).
    #[error("the decode agent shut down before the pull finished (kind=shutdown)")]
    Shutdown,
    /// The caller's local block lists do not fit the plan made with the prefill ranks'
    /// shapes (not `ceil(remote / block_ratio)` blocks per group): nothing was read and no
    /// lease was touched (other decode ranks may still read it). Advice: fail the request.
    #[error("local block lists do not fit the plan: {detail} (kind=local_blocks)")]
    LocalBlocks {
        /// What does not fit.
        detail: String,
    },
}

fn fmt_incarnation(i: u64) -> String {
    if i == 0 {
        "not stated".to_owned()
    } else {
        crate::log::Incarnation(i).to_string()
    }
}

impl PullError {
    /// The snake-case name of the variant (`lease_unknown`, `timeout`, ...): the `kind` the
    /// Python binding's `PullError` carries and the label metrics count failures by.
    pub fn kind(&self) -> &'static str {
        match self {
            PullError::Connect { .. } => "connect",
            PullError::Incompatible { .. } => "incompatible",
            PullError::HandshakeRefused { .. } => "handshake_refused",
            PullError::Authentication { .. } => "authentication",
            PullError::PeerRestarted { .. } => "peer_restarted",
            PullError::LeaseUnknown { .. } => "lease_unknown",
            PullError::LeaseEnded { .. } => "lease_ended",
            PullError::Refused { .. } => "refused",
            PullError::Integrity { .. } => "integrity",
            PullError::Timeout { .. } => "timeout",
            PullError::ConnectionLost { .. } => "connection_lost",
            PullError::Protocol { .. } => "protocol",
            PullError::RemoteBlocksOutOfRange { .. } => "remote_blocks_out_of_range",
            PullError::TransportUnavailable { .. } => "transport_unavailable",
            PullError::UcxRead { .. } => "ucx_read",
            PullError::PinNotHeld { .. } => "pin_not_held",
            PullError::EngineNotRegistered { .. } => "engine_not_registered",
            PullError::SiblingFailed { .. } => "sibling_failed",
            PullError::Shutdown => "shutdown",
            PullError::LocalBlocks { .. } => "local_blocks",
        }
    }

    /// The fixed words every message of this kind starts with, the text the troubleshooting
    /// guide is searched by. Each kind's are its own, and none starts another's. (A sibling's
    /// failure quotes its cause: its message holds two `kind=`, the last one its own.)
    pub fn summary(&self) -> &'static str {
        match self {
            PullError::Connect { .. } => "no connection to the peer",
            PullError::Incompatible { .. } => "incompatible peer",
            PullError::HandshakeRefused { .. } => "handshake refused by the peer",
            PullError::Authentication { .. } => "authentication with the peer failed",
            PullError::PeerRestarted { .. } => "stale hand-off",
            PullError::LeaseUnknown { .. } => "no such lease at the peer",
            PullError::LeaseEnded { .. } => "lease ended before it was read",
            PullError::Refused { .. } => "request not served",
            PullError::Integrity { .. } => "corrupt payload",
            PullError::Timeout { .. } => "no progress from the peer",
            PullError::ConnectionLost { .. } => "connection lost",
            PullError::Protocol { .. } => "protocol error",
            PullError::RemoteBlocksOutOfRange { .. } => "remote blocks out of range",
            PullError::TransportUnavailable { .. } => "data path unavailable",
            PullError::UcxRead { .. } => "UCX read failed",
            PullError::PinNotHeld { .. } => "pin not held through the read",
            PullError::EngineNotRegistered { .. } => "engine unknown to discovery",
            PullError::SiblingFailed { .. } => "shared blocks were read for sibling",
            PullError::Shutdown => "the decode agent shut down before the pull finished",
            PullError::LocalBlocks { .. } => "local block lists do not fit the plan",
        }
    }

    /// What a serving engine should do about this failure.
    pub fn advice(&self) -> Advice {
        match self {
            PullError::Connect { .. }
            | PullError::HandshakeRefused { .. }
            | PullError::PeerRestarted { .. }
            | PullError::LeaseUnknown { .. }
            | PullError::LeaseEnded { .. }
            | PullError::Refused { .. }
            | PullError::Integrity { .. }
            | PullError::Timeout { .. }
            | PullError::ConnectionLost { .. }
            | PullError::UcxRead { .. }
            | PullError::PinNotHeld { .. }
            | PullError::EngineNotRegistered { .. } => Advice::RetryFreshHandoff,
            PullError::Incompatible { .. }
            | PullError::Authentication { .. }
            | PullError::Protocol { .. }
            | PullError::RemoteBlocksOutOfRange { .. }
            | PullError::TransportUnavailable { .. } => Advice::Recompute,
            PullError::Shutdown | PullError::LocalBlocks { .. } => Advice::FailRequest,
            PullError::SiblingFailed { cause, .. } => cause.advice(),
        }
    }

    /// Whether a fresh hand-off is worth trying ([`Advice::RetryFreshHandoff`]).
    pub fn is_retryable(&self) -> bool {
        self.advice() == Advice::RetryFreshHandoff
    }

    /// The failure at the root: the cause of a sibling's failure, else this one.
    pub fn root_cause(&self) -> &PullError {
        match self {
            PullError::SiblingFailed { cause, .. } => cause.root_cause(),
            other => other,
        }
    }
}

/// How one child's pull ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildOutcome {
    /// Every block is in place and the prefill side was notified.
    Done {
        /// Bytes written into this child's local blocks (wire or local copy).
        bytes_delivered: u64,
        /// Whether the prefill side counted the notification (false: its lease had already
        /// ended, e.g. expired, after the data was read under the lease, or the peer could
        /// not be reached).
        acknowledged: bool,
    },
    /// The pull failed; these local blocks hold no valid data and are the caller's again.
    Failed {
        /// Why ([`PullError::advice`] says what to do).
        error: PullError,
        /// The child's local blocks, now invalid.
        invalid_local_blocks: Vec<BlockId>,
    },
    /// The caller cancelled the child; its lease was released (if the cancel got through).
    Cancelled {
        /// Whether the prefill side released the lease on our cancel.
        released: bool,
        /// The child's local blocks, not valid.
        invalid_local_blocks: Vec<BlockId>,
    },
    /// The pull failed and a one-sided read into these blocks could not be stopped: the
    /// transport (UCX) may still write them. They hold no valid data and must be neither
    /// reused nor freed until the agent hands them back as reclaimed (when the read finally
    /// completes). If it never completes, they are never handed back.
    FailedBlocksHeld {
        /// Why.
        error: PullError,
        /// The child's local blocks, held until reclaimed.
        held_local_blocks: Vec<BlockId>,
    },
}

impl ChildOutcome {
    /// The error of a failed child.
    pub fn error(&self) -> Option<&PullError> {
        match self {
            ChildOutcome::Failed { error, .. } | ChildOutcome::FailedBlocksHeld { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// One child of a pull, as the machine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullChild {
    /// The child's index in its parent request (for messages about siblings).
    pub child_index: u32,
    /// Its local destination blocks (in the order of its remote blocks).
    pub local_blocks: Vec<BlockId>,
}

/// Settings of one pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullConfig {
    /// How often undecided leases are heartbeated while reads are under way.
    pub heartbeat_every: Duration,
    /// Bytes of one local block (for `bytes_delivered`).
    pub block_bytes: u64,
}

/// How a read ended, as the driver tells [`PullMachine::read_finished`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadResult {
    /// Every byte landed (and was checked): the payload bytes read.
    Ok {
        /// Payload bytes.
        bytes: u64,
    },
    /// The read failed; nothing writes its destination blocks any more.
    Failed(PullError),
    /// The read was stopped on [`Action::AbortRead`]; nothing writes its blocks any more.
    Aborted,
    /// The read failed but the transport may still write its destination blocks (a
    /// one-sided read that could not be stopped): they stay held.
    Abandoned(PullError),
}

/// The answer to an [`Action::Notify`] or [`Action::CancelLease`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlAnswer {
    /// Notify: the prefill side counted it (or had, on an earlier attempt). Cancel: it
    /// released the lease.
    Acknowledged,
    /// The prefill side answered, but did not count it / release the lease.
    NotAcknowledged,
    /// The peer cannot be reached at all: later notifies and cancels of this pull are
    /// skipped.
    Unreachable,
}

/// Totals of a finished pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullSummary {
    /// Payload bytes read over the wire.
    pub wire_bytes: u64,
    /// Bytes delivered into the local blocks of children that are done.
    pub delivered_bytes: u64,
    /// Children (positions) reported [`ChildOutcome::FailedBlocksHeld`].
    pub held_children: Vec<usize>,
    /// Their local blocks, sorted: not to be released until the stuck reads complete.
    pub held_blocks: Vec<BlockId>,
}

/// What the driver must do next. Children are positions in the pull (0-based, in the order
/// given to [`PullMachine::new`]), not child indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start reading the child's wire runs (`plan.children[i].wire`) with its lease.
    StartRead(usize),
    /// Stop the child's read (answer with [`ReadResult::Aborted`], or with its real result if
    /// it finished first). Only asked for when reads are abortable.
    AbortRead(usize),
    /// Copy `(source, destination)` local blocks now, before polling the next action.
    Copy {
        /// The child the copies are for.
        child: usize,
        /// The copies.
        copies: Vec<(BlockId, BlockId)>,
    },
    /// Notify the prefill side that the child's lease was pulled; answer with
    /// [`PullMachine::control_answered`].
    Notify(usize),
    /// Cancel (release) the child's lease; answer with [`PullMachine::control_answered`].
    CancelLease(usize),
    /// Heartbeat these children's leases; answer with [`PullMachine::heartbeat_answered`].
    Heartbeat(Vec<usize>),
    /// The child's report: hand its outcome (and its blocks) to the caller.
    Report {
        /// The child.
        child: usize,
        /// How it ended.
        outcome: ChildOutcome,
    },
    /// Every child is reported; the last action.
    Finished(PullSummary),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Read {
    /// The child reads nothing over the wire.
    NoWire,
    NotStarted,
    InFlight {
        aborting: Option<AbortCause>,
    },
    Ok(u64),
    Failed(PullError),
    Cancelled,
    Held(PullError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AbortCause {
    NotNeeded,
    Shutdown,
}

impl Read {
    fn terminal(&self) -> bool {
        !matches!(self, Read::NotStarted | Read::InFlight { .. })
    }
    fn ok(&self) -> bool {
        matches!(self, Read::NoWire | Read::Ok(_))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copies {
    Pending,
    Made,
    Dropped,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Decision {
    Undecided,
    /// Waiting for the answer to its notify or cancel; the outcome to report then.
    AwaitingControl(ChildOutcome),
    Reported,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connecting,
    Connected { abortable: bool },
    Done,
}

/// One pull's decisions (see the module docs).
#[derive(Debug)]
pub struct PullMachine {
    plan: ResultPlan,
    children: Vec<PullChild>,
    config: PullConfig,
    phase: Phase,
    reads: Vec<Read>,
    copies: Vec<Copies>,
    decisions: Vec<Decision>,
    cancelled: Vec<bool>,
    /// Local blocks written by each child's wire read.
    wire_blocks: Vec<HashSet<BlockId>>,
    /// Per child: reads that write its blocks or that it depends on.
    touching_reads: Vec<Vec<usize>>,
    /// Per child: siblings whose copies read or write its blocks.
    touching_copies: Vec<Vec<usize>>,
    /// Per child: siblings depending on its read.
    dependents: Vec<Vec<usize>>,
    held_blocks: HashSet<BlockId>,
    /// Why the pull could not start, if it could not.
    connect_error: Option<PullError>,
    reachable: bool,
    shutting_down: bool,
    next_heartbeat: Option<Instant>,
    heartbeat_outstanding: bool,
    actions: VecDeque<Action>,
    wire_bytes: u64,
    delivered_bytes: u64,
    /// Per child: the answer to a notify sent with its read ([`Self::read_finished_notified`]).
    notified_with_read: Vec<Option<ControlAnswer>>,
    /// Per child, the bytes it delivers when done (empty: local blocks × `block_bytes`).
    child_bytes: Vec<u64>,
}

impl PullMachine {
    /// A pull of `children` (in the order of `plan.children`) with `plan`. Nothing happens
    /// until [`Self::connected`] or [`Self::connect_failed`].
    ///
    /// # Panics
    /// If `plan` and `children` differ in length (a caller bug).
    pub fn new(plan: ResultPlan, children: Vec<PullChild>, config: PullConfig) -> Self {
        assert_eq!(plan.children.len(), children.len(), "one plan entry per child");
        let n = children.len();
        let wire_blocks: Vec<HashSet<BlockId>> = plan
            .children
            .iter()
            .map(|c| c.wire.iter().flat_map(|r| (0..r.count).map(move |k| r.local_start + k)).collect())
            .collect();
        let mut writers: HashMap<BlockId, Vec<usize>> = HashMap::new();
        for (k, blocks) in wire_blocks.iter().enumerate() {
            for &b in blocks {
                writers.entry(b).or_default().push(k);
            }
        }
        let mut copy_users: HashMap<BlockId, Vec<usize>> = HashMap::new();
        for (j, c) in plan.children.iter().enumerate() {
            for &(src, dst) in &c.copies {
                copy_users.entry(src).or_default().push(j);
                copy_users.entry(dst).or_default().push(j);
            }
        }
        let mut touching_reads = Vec::with_capacity(n);
        let mut touching_copies = Vec::with_capacity(n);
        let mut dependents = vec![Vec::new(); n];
        for (i, child) in children.iter().enumerate() {
            let mut reads: Vec<usize> = plan.children[i].depends_on.clone();
            let mut copies: Vec<usize> = Vec::new();
            for b in &child.local_blocks {
                reads.extend(writers.get(b).into_iter().flatten());
                copies.extend(copy_users.get(b).into_iter().flatten().filter(|&&j| j != i));
            }
            reads.sort_unstable();
            reads.dedup();
            copies.sort_unstable();
            copies.dedup();
            touching_reads.push(reads);
            touching_copies.push(copies);
            for &d in &plan.children[i].depends_on {
                if d != i {
                    dependents[d].push(i);
                }
            }
        }
        let reads = plan
            .children
            .iter()
            .map(|c| if c.wire.is_empty() { Read::NoWire } else { Read::NotStarted })
            .collect();
        let copies = plan
            .children
            .iter()
            .map(|c| if c.copies.is_empty() { Copies::Made } else { Copies::Pending })
            .collect();
        PullMachine {
            config,
            phase: Phase::Connecting,
            reads,
            copies,
            decisions: vec![Decision::Undecided; n],
            cancelled: vec![false; n],
            wire_blocks,
            touching_reads,
            touching_copies,
            dependents,
            held_blocks: HashSet::new(),
            connect_error: None,
            reachable: true,
            shutting_down: false,
            next_heartbeat: None,
            heartbeat_outstanding: false,
            actions: VecDeque::new(),
            wire_bytes: 0,
            delivered_bytes: 0,
            notified_with_read: vec![None; n],
            child_bytes: Vec::new(),
            plan,
            children,
        }
    }

    /// Sets the bytes each child delivers when done, in child order — for local blocks of
    /// different sizes (several KV-cache groups); by default its local blocks ×
    /// [`PullConfig::block_bytes`].
    pub fn with_child_bytes(mut self, bytes: Vec<u64>) -> Self {
        self.child_bytes = bytes;
        self
    }

    /// Children in the pull.
    pub fn len(&self) -> usize {
        self.children.len()
    }

    /// Whether the pull has no children (never true for a pull the engine makes).
    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }

    /// The plan the machine was built from.
    pub fn plan(&self) -> &ResultPlan {
        &self.plan
    }

    /// The handshake succeeded: reads may start. `reads_abortable`: whether a read in
    /// flight can be stopped (TCP) or not (a one-sided UCX get).
    pub fn connected(&mut self, now: Instant, reads_abortable: bool) {
        if self.phase != Phase::Connecting {
            return;
        }
        self.phase = Phase::Connected { abortable: reads_abortable };
        self.next_heartbeat = now.checked_add(self.config.heartbeat_every);
        self.progress();
    }

    /// The pull cannot start (handshake failed, stale hand-off, remote ids outside the
    /// peer's layout): every child fails with `error`. `peer_reachable`: whether the peer can
    /// still be told to release the leases (false when it could not be reached at all).
    pub fn connect_failed(&mut self, _now: Instant, error: PullError, peer_reachable: bool) {
        if self.phase != Phase::Connecting {
            return;
        }
        self.reachable &= peer_reachable;
        self.phase = Phase::Connected { abortable: true };
        for r in &mut self.reads {
            if *r == Read::NotStarted {
                *r = Read::Failed(error.clone());
            }
        }
        // Every child fails with this error itself (not as a sibling's failure).
        self.connect_error = Some(error);
        self.progress();
    }

    /// The caller cancelled child `i`: its lease is released as soon as no sibling needs
    /// its read. Ignored once the child is decided.
    pub fn cancel(&mut self, i: usize, _now: Instant) {
        if i >= self.children.len() || self.decisions[i] != Decision::Undecided {
            return;
        }
        self.cancelled[i] = true;
        self.progress();
    }

    /// Child `i`'s read ended.
    pub fn read_finished(&mut self, i: usize, _now: Instant, result: ReadResult) {
        let Some(Read::InFlight { aborting }) = self.reads.get(i).cloned() else { return };
        self.reads[i] = match result {
            ReadResult::Ok { bytes } => {
                self.wire_bytes += bytes;
                Read::Ok(bytes)
            }
            ReadResult::Failed(e) => Read::Failed(e),
            ReadResult::Aborted => match aborting {
                Some(AbortCause::Shutdown) => Read::Failed(PullError::Shutdown),
                _ => Read::Cancelled,
            },
            ReadResult::Abandoned(e) => {
                self.held_blocks.extend(self.wire_blocks[i].iter().copied());
                Read::Held(e)
            }
        };
        self.progress();
    }

    /// Whether child `i`'s notify may go out with its read (one round trip instead of two):
    /// its blocks are written by that read alone and touched by no sibling's copy, so the
    /// read ending settles the child, and nothing else needs its lease.
    pub fn notify_with_read(&self, i: usize) -> bool {
        i < self.children.len()
            && !self.plan.children[i].wire.is_empty()
            && self.plan.children[i].copies.is_empty()
            && self.touching_reads[i] == [i]
            && self.touching_copies[i].is_empty()
    }

    /// Child `i`'s read ended, and the notify sent with it (see [`Self::notify_with_read`])
    /// was answered with `notify` (`None`: the answer was lost). A child that is then done
    /// is reported at once with that answer; without one, its notify is sent on its own as
    /// usual. A child that is not done has its lease cancelled as usual.
    pub fn read_finished_notified(
        &mut self,
        i: usize,
        now: Instant,
        result: ReadResult,
        notify: Option<ControlAnswer>,
    ) {
        if let Some(slot) = self.notified_with_read.get_mut(i) {
            *slot = notify;
        }
        self.read_finished(i, now, result);
    }

    /// The notify or cancel of child `i` was answered.
    pub fn control_answered(&mut self, i: usize, _now: Instant, answer: ControlAnswer) {
        let Some(Decision::AwaitingControl(outcome)) = self.decisions.get(i).cloned() else { return };
        if answer == ControlAnswer::Unreachable {
            self.reachable = false;
        }
        let yes = answer == ControlAnswer::Acknowledged;
        let outcome = match outcome {
            ChildOutcome::Done { bytes_delivered, .. } => {
                ChildOutcome::Done { bytes_delivered, acknowledged: yes }
            }
            ChildOutcome::Cancelled { invalid_local_blocks, .. } => {
                ChildOutcome::Cancelled { released: yes, invalid_local_blocks }
            }
            other => other,
        };
        self.report(i, outcome);
        self.progress();
    }

    /// A heartbeat was answered (or failed); `peer_reachable` false stops heartbeats and
    /// later notifies and cancels.
    pub fn heartbeat_answered(&mut self, _now: Instant, peer_reachable: bool) {
        self.heartbeat_outstanding = false;
        self.reachable &= peer_reachable;
        self.progress();
    }

    /// The agent is shutting down: reads not started are not started (their children fail
    /// with [`PullError::Shutdown`]); reads in flight go on until [`Self::abort_reads`].
    pub fn begin_shutdown(&mut self, _now: Instant) {
        self.shutting_down = true;
        self.progress();
    }

    /// The shutdown grace is over: abortable reads in flight are aborted (their children
    /// fail with [`PullError::Shutdown`]); one-sided reads run to their own bound.
    pub fn abort_reads(&mut self, _now: Instant) {
        self.shutting_down = true;
        if let Phase::Connected { abortable: true } = self.phase {
            for i in 0..self.reads.len() {
                if let Read::InFlight { aborting } = &mut self.reads[i] {
                    if aborting.is_none() {
                        *aborting = Some(AbortCause::Shutdown);
                        self.actions.push_back(Action::AbortRead(i));
                    }
                }
            }
        }
        self.progress();
    }

    /// When [`Self::handle_timeout`] should run next (the next heartbeat), if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.heartbeat_outstanding || !self.reachable || !matches!(self.phase, Phase::Connected { .. }) {
            return None;
        }
        if self.reads.iter().all(Read::terminal) {
            return None;
        }
        self.next_heartbeat
    }

    /// Time passed: heartbeats the undecided leases when one is due.
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some(due) = self.poll_timeout() else { return };
        if now < due {
            return;
        }
        let leases: Vec<usize> =
            (0..self.children.len()).filter(|&i| self.decisions[i] == Decision::Undecided).collect();
        self.next_heartbeat = due.checked_add(self.config.heartbeat_every);
        if !leases.is_empty() {
            self.heartbeat_outstanding = true;
            self.actions.push_back(Action::Heartbeat(leases));
        }
    }

    /// The next thing to do, in order. Carry out each before polling the next (copies in
    /// particular must be made before the reports that follow them).
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether [`Action::Finished`] has been issued.
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Done
    }

    fn undecided(&self, i: usize) -> bool {
        self.decisions[i] == Decision::Undecided
    }

    /// Whether somebody still needs child `k`'s read: the child itself, or a sibling that
    /// depends on it, neither cancelled nor decided.
    fn needed(&self, k: usize) -> bool {
        let wants = |j: usize| !self.cancelled[j] && self.undecided(j);
        wants(k) || self.dependents[k].iter().any(|&j| wants(j))
    }

    fn report(&mut self, i: usize, outcome: ChildOutcome) {
        if let ChildOutcome::Done { bytes_delivered, .. } = &outcome {
            self.delivered_bytes += bytes_delivered;
        }
        self.decisions[i] = Decision::Reported;
        self.actions.push_back(Action::Report { child: i, outcome });
    }

    /// Applies every decision the current state allows, queueing their actions.
    fn progress(&mut self) {
        let Phase::Connected { abortable } = self.phase else { return };
        let n = self.children.len();
        // Reads: start the needed ones, drop or abort the others.
        for k in 0..n {
            match self.reads[k] {
                Read::NotStarted if self.shutting_down => self.reads[k] = Read::Failed(PullError::Shutdown),
                Read::NotStarted if self.needed(k) => {
                    self.reads[k] = Read::InFlight { aborting: None };
                    self.actions.push_back(Action::StartRead(k));
                }
                Read::NotStarted => self.reads[k] = Read::Cancelled,
                Read::InFlight { aborting: None } if abortable && !self.needed(k) => {
                    self.reads[k] = Read::InFlight { aborting: Some(AbortCause::NotNeeded) };
                    self.actions.push_back(Action::AbortRead(k));
                }
                _ => {}
            }
        }
        // Sibling copies: made as soon as every read they depend on is done.
        for j in 0..n {
            if self.copies[j] != Copies::Pending {
                continue;
            }
            let deps = &self.plan.children[j].depends_on;
            if !deps.iter().all(|&d| self.reads[d].terminal()) {
                continue;
            }
            let overlaps_held = self.children[j].local_blocks.iter().any(|b| self.held_blocks.contains(b));
            if deps.iter().all(|&d| self.reads[d].ok()) && !overlaps_held && !self.cancelled[j] {
                self.copies[j] = Copies::Made;
                let copies = self.plan.children[j].copies.clone();
                self.actions.push_back(Action::Copy { child: j, copies });
            } else {
                self.copies[j] = Copies::Dropped;
            }
        }
        // Decisions: a child whose blocks nothing can touch any more.
        for i in 0..n {
            if !self.undecided(i) || !self.settled(i) {
                continue;
            }
            let outcome = self.outcome(i);
            if let (ChildOutcome::Done { bytes_delivered, .. }, Some(answer)) =
                (&outcome, self.notified_with_read[i])
            {
                // Its notify went with its read and was answered.
                let outcome = ChildOutcome::Done {
                    bytes_delivered: *bytes_delivered,
                    acknowledged: answer == ControlAnswer::Acknowledged,
                };
                self.report(i, outcome);
                continue;
            }
            let control = match &outcome {
                ChildOutcome::Done { .. } => Action::Notify(i),
                _ => Action::CancelLease(i),
            };
            if self.reachable {
                self.decisions[i] = Decision::AwaitingControl(outcome);
                self.actions.push_back(control);
            } else {
                self.report(i, outcome);
            }
        }
        if self.decisions.iter().all(|d| *d == Decision::Reported) {
            self.phase = Phase::Done;
            let mut held_children = Vec::new();
            let mut held_blocks: Vec<BlockId> = Vec::new();
            for i in 0..n {
                if self.children[i].local_blocks.iter().any(|b| self.held_blocks.contains(b)) {
                    held_children.push(i);
                    held_blocks.extend(&self.children[i].local_blocks);
                }
            }
            held_blocks.sort_unstable();
            held_blocks.dedup();
            self.actions.push_back(Action::Finished(PullSummary {
                wire_bytes: self.wire_bytes,
                delivered_bytes: self.delivered_bytes,
                held_children,
                held_blocks,
            }));
        }
    }

    /// Whether nothing can touch child `i`'s blocks any more: every read writing them or
    /// that it depends on ended, and every copy from or into them was made or dropped.
    fn settled(&self, i: usize) -> bool {
        self.touching_reads[i].iter().all(|&k| self.reads[k].terminal())
            && self.copies[i] != Copies::Pending
            && self.touching_copies[i].iter().all(|&j| self.copies[j] != Copies::Pending)
    }

    /// Why child `i`'s blocks are not valid, from the reads it depends on (None: all read).
    fn failed_dependency(&self, i: usize) -> Option<PullError> {
        self.plan.children[i].depends_on.iter().find_map(|&d| {
            let cause = match &self.reads[d] {
                Read::Failed(e) | Read::Held(e) => e.clone(),
                // A read is dropped only when no undecided, uncancelled child needs it.
                Read::Cancelled => PullError::Shutdown,
                _ => return None,
            };
            Some(if d == i {
                cause
            } else {
                PullError::SiblingFailed { sibling: self.children[d].child_index, cause: Box::new(cause) }
            })
        })
    }

    fn outcome(&self, i: usize) -> ChildOutcome {
        let local = self.children[i].local_blocks.clone();
        if local.iter().any(|b| self.held_blocks.contains(b)) {
            let error = self.failed_dependency(i).unwrap_or_else(|| {
                // Its blocks are also the destination of a sibling's read that could not stop.
                let (k, cause) = (0..self.reads.len())
                    .find_map(|k| match &self.reads[k] {
                        Read::Held(e) if local.iter().any(|b| self.wire_blocks[k].contains(b)) => {
                            Some((k, e.clone()))
                        }
                        _ => None,
                    })
                    .unwrap_or((i, PullError::Shutdown));
                PullError::SiblingFailed { sibling: self.children[k].child_index, cause: Box::new(cause) }
            });
            return ChildOutcome::FailedBlocksHeld { error, held_local_blocks: local };
        }
        if self.cancelled[i] || self.reads[i] == Read::Cancelled {
            return ChildOutcome::Cancelled { released: false, invalid_local_blocks: local };
        }
        if let Some(error) = self.connect_error.clone().or_else(|| self.failed_dependency(i)) {
            return ChildOutcome::Failed { error, invalid_local_blocks: local };
        }
        let bytes_delivered = match self.child_bytes.get(i) {
            Some(&bytes) => bytes,
            None => local.len() as u64 * self.config.block_bytes,
        };
        ChildOutcome::Done { bytes_delivered, acknowledged: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One error of every kind (the match below fails to compile when a kind is added
    /// without an example here).
    pub(crate) fn one_of_each() -> Vec<PullError> {
        let p = || "10.0.0.1:5000".to_owned();
        let d = || "what happened".to_owned();
        let all = vec![
            PullError::Connect { peer: p(), detail: d() },
            PullError::Incompatible {
                peer: p(),
                field: MismatchField::CompatHash,
                local: 1,
                remote: Some(2),
                message: d(),
            },
            PullError::HandshakeRefused { peer: p(), message: d() },
            PullError::Authentication { peer: p(), detail: d() },
            PullError::PeerRestarted {
                peer: p(),
                expected_engine: "e".into(),
                expected_incarnation: 1,
                found_engine: "e".into(),
                found_incarnation: 2,
            },
            PullError::LeaseUnknown { peer: p(), remote_request_id: "r".into(), message: d() },
            PullError::LeaseEnded { peer: p(), remote_request_id: "r".into(), message: d() },
            PullError::Refused { peer: p(), detail: d() },
            PullError::Integrity { peer: p(), detail: d() },
            PullError::Timeout { peer: p(), detail: d() },
            PullError::ConnectionLost { peer: p(), detail: d() },
            PullError::Protocol { peer: p(), detail: d() },
            PullError::RemoteBlocksOutOfRange { ids: vec![9], num_blocks: 4 },
            PullError::TransportUnavailable { peer: p(), detail: d() },
            PullError::UcxRead { peer: p(), detail: d() },
            PullError::PinNotHeld { peer: p(), detail: d() },
            PullError::EngineNotRegistered { engine: "e".into(), rank: 0, detail: d() },
            PullError::SiblingFailed {
                sibling: 0,
                cause: Box::new(PullError::Timeout { peer: p(), detail: d() }),
            },
            PullError::Shutdown,
            PullError::LocalBlocks { detail: d() },
        ];
        for e in &all {
            match e {
                PullError::Connect { .. }
                | PullError::Incompatible { .. }
                | PullError::HandshakeRefused { .. }
                | PullError::Authentication { .. }
                | PullError::PeerRestarted { .. }
                | PullError::LeaseUnknown { .. }
                | PullError::LeaseEnded { .. }
                | PullError::Refused { .. }
                | PullError::Integrity { .. }
                | PullError::Timeout { .. }
                | PullError::ConnectionLost { .. }
                | PullError::Protocol { .. }
                | PullError::RemoteBlocksOutOfRange { .. }
                | PullError::TransportUnavailable { .. }
                | PullError::UcxRead { .. }
                | PullError::PinNotHeld { .. }
                | PullError::EngineNotRegistered { .. }
                | PullError::SiblingFailed { .. }
                | PullError::Shutdown
                | PullError::LocalBlocks { .. } => {}
            }
        }
        all
    }

    #[test]
    fn every_message_starts_with_its_kinds_own_words_and_ends_with_its_kind() {
        let all = one_of_each();
        let kinds: std::collections::HashSet<_> = all.iter().map(PullError::kind).collect();
        assert_eq!(kinds.len(), all.len(), "one example per kind");
        let mut summaries = std::collections::HashSet::new();
        for e in &all {
            let text = e.to_string();
            assert!(text.starts_with(e.summary()), "{text:?} does not start with {:?}", e.summary());
            assert!(text.ends_with(&format!("(kind={})", e.kind())), "{text:?}");
            assert!(summaries.insert(e.summary()), "{:?} is shared by two kinds", e.summary());
        }
        // No kind's words are a prefix of another's: a search for one never lands on another.
        for a in &summaries {
            for b in &summaries {
                assert!(a == b || !b.starts_with(a), "{a:?} is a prefix of {b:?}");
            }
        }
    }

    #[test]
    fn the_troubleshooting_guide_has_an_entry_for_every_kind_found_by_its_printed_words() {
        let guide = include_str!("../../../docs/src/guides/troubleshooting.md");
        for e in one_of_each() {
            let heading = format!("### {}", e.kind());
            let section = guide
                .split("\n### ")
                .find(|s| s.starts_with(&heading[4..]) && s[heading.len() - 4..].starts_with('\n'))
                .unwrap_or_else(|| panic!("troubleshooting.md has no section {heading:?}"));
            let printed = format!("`{}`", e.summary());
            assert!(
                section.contains(&printed),
                "section {heading:?} does not quote the printed words {printed}"
            );
            assert!(
                section.contains(&format!("kind={}", e.kind())),
                "section {heading:?} does not name kind={}",
                e.kind()
            );
            assert!(section.contains("**Do:**"), "section {heading:?} says no action");
        }
    }
}
