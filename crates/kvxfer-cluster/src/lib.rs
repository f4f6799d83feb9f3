//! kvxfer in a cluster: engine discovery through etcd leases, and Prometheus metrics.
//!
//! # Discovery
//!
//! ## Key layout
//!
//! Each engine rank that serves KV blocks (a prefill agent) owns one key:
//!
//! ```text
//! /<namespace>/v1/engines/<engine_id>/<rank>
//! ```
//!
//! - `namespace`: one deployment (several may share an etcd); `engine_id`: the id hand-offs
//!   carry (`remote_engine_id`); both printable ASCII without `/`, spaces, `.` or `..`
//!   ([`Namespace`], [`EngineId`]).
//! - `rank`: the tensor-parallel rank, canonical decimal (`0`, `1`, ... no leading zeros).
//! - `v1` is the key layout's version: a future layout lives beside it under `v2`.
//!
//! A directory lists and watches the prefix `/<namespace>/v1/engines/`. Anything under it
//! that is not `<engine_id>/<rank>` is ignored (and counted).
//!
//! ## Value
//!
//! Compact JSON ([`EngineRecord`]), at most 4 KiB:
//!
//! ```text
//! {"v":1,"addr":{"host":"10.0.0.7","port":5559},"transports":["tcp","ucx"],
//!  "compat_hash":"0123456789abcdef","protocol_version":2,
//!  "incarnation":"9f86d081884c7d65","agent":"prefill-0"}
//! ```
//!
//! - `v`: the record format version, read first. Another version is ignored (counted as
//!   `unsupported_version`), never half-parsed. Fields added within a version must be
//!   optional; readers ignore fields they do not know.
//! - `addr`: host (an IP literal — IPv6 without brackets — or a DNS name) and port apart,
//!   so no address parsing is needed. [`AdvertiseAddr`]'s `Display` gives the connect string
//!   (`[::1]:5559`).
//! - `transports`: lowercase tokens; unknown ones are kept (a newer agent's offer).
//! - `compat_hash`, `incarnation`: 64-bit values as exactly 16 hex digits (JSON numbers lose
//!   precision above 2^53 in many readers). The incarnation is random per agent process.
//! - `protocol_version`: the wire protocol the agent speaks.
//!
//! ## Leases and TTL
//!
//! A [`Registration`] grants an etcd lease (TTL configurable, 2 s — etcd's default minimum
//! — or more), puts the key on it, and keeps it alive every TTL/3, at least every second
//! ([`MAX_KEEPALIVE_INTERVAL`]), from a background task:
//!
//! - One etcd member at a time: the endpoints are tried in turn and the first that answers
//!   a linearizable read is used for the whole session (grant, puts, keep-alives, watch);
//!   a failed session moves to the next member ([`EtcdStatus::endpoint`] says which).
//!   etcd-client itself spreads requests over every endpoint, so one dead member broke
//!   sessions however healthy the others were.
//! - The TTL is also how long etcd may be unreachable before a live engine's key expires:
//!   a keep-alive unanswered for an interval ends the session, and while
//!   the lease may still be alive reconnections are retried every 200 ms at most, so a stall
//!   or failover of up to about TTL − 1.5 s leaves the key (and the decode side) untouched.
//!
//! - [`Registration::shutdown`] revokes the lease: the key is deleted at once.
//! - A crash (or dropping the `Registration`) stops the keep-alives: etcd deletes the key
//!   when the lease runs out, at most TTL after the last keep-alive (plus etcd's expiry
//!   check, every 500 ms). NIXL's etcd keys outlive a crashed agent; these do not.
//! - etcd unreachable: retries with exponential backoff and jitter (100 ms doubling to 2 s
//!   by default, [`EtcdConfig`]); the status says `Degraded` with the last error. On
//!   reconnection the lease is checked (`LeaseTimeToLive`): still alive (a short outage, or
//!   etcd restarted with its data) → kept; gone → a new lease is granted. Either way the key
//!   is put again.
//! - A keep-alive answered with TTL 0 (expired or revoked) → new lease and put at once.
//! - The registration watches its own key: deleted under its live lease (by hand) → put
//!   back at once.
//! - One live process per engine rank: every put is a transaction that puts only if the key
//!   is absent or holds this registration's own record. Before its first put a
//!   registration that finds another incarnation's key watches that key's lease: not
//!   renewed (a crashed predecessor), it runs out and the restart registers — within about
//!   the TTL of the crash; renewed (a live process with the same engine id and rank), the
//!   newcomer gives up with [`RegistrationError::EngineTaken`] (state
//!   [`EtcdState::Failed`], [`Registration::failure`]) and the first keeps its key. A key on
//!   no lease never expires: refused at once. After the first put, a process back from a
//!   stall longer than its TTL never overwrites the replacement that registered meanwhile:
//!   another incarnation's record (found then, or put over ours) is a conflict — an error
//!   in the log, [`RegistrationStats::conflicts`], status `Degraded` — and the key is taken
//!   again only once it is free.
//!
//! ## Draining
//!
//! An engine drains — takes no new hand-offs while the ones it made are pulled and end as
//! usual — while [`Registration::drain`] is in force or its drain key exists:
//!
//! ```text
//! /<namespace>/v1/drain/<engine_id>      (any value; delete it to undrain)
//! ```
//!
//! The registration watches that key and puts its record again with `"draining":true`
//! ([`EngineRecord::draining`]; the field is left out when false, so a serving engine's
//! record is unchanged): the same key, lease and incarnation, so directories report it as
//! an `Updated` event whose [`DirectoryEvent::invalidates`] is false (connections stay),
//! and routers reading [`EngineDirectory::resolve`] / [`EngineDirectory::entries`] stop
//! sending it prefills. Refusing new hand-offs is the owner's part: a kvxfer prefill agent
//! refuses new leases (`kvxfer::Error::Draining`).
//!
//! ## Invalidation
//!
//! An [`EngineDirectory`] lists the prefix (in pages, all at the first page's revision),
//! then watches it from the revision after the listing's, so no change between the two is
//! lost. Its cache maps (engine id, rank) →
//! entry; [`EngineDirectory::resolve`] reads only the cache (never etcd). Subscribers
//! ([`EngineDirectory::subscribe`]) get, right after the cache changed:
//!
//! - `Added` — a new rank;
//! - `Updated { old, new }` — a rank's record changed: a new incarnation (the agent
//!   restarted — even on the same address), or a new address, transports, layout or
//!   protocol. Connections pooled for `old` must be dropped at once.
//! - `Removed` — the key was deleted (shutdown, lease expiry after a crash), or its value
//!   stopped being a usable record. Connections to it must be dropped, and pulls naming it
//!   fail at once instead of waiting for an I/O timeout.
//!
//! The same record put again (a re-registration on a new lease) is no event. The cache
//! also remembers the incarnations that went (deleted or replaced), under the same lock:
//! [`EngineDirectory::check_handoff`] judges a hand-off from it without lagging the events.
//! At most [`DirectoryOptions::max_entries`] ranks are cached; further new ones are ignored
//! and counted (`limit`).
//! Values that are malformed, of another format version, under an unparsable key, or (when
//! the directory was given an expected layout hash) of another layout are ignored with a
//! rate-limited warning and a counter; the watcher never stops for them.
//!
//! On any failure (etcd down or restarted, watch cancelled or compacted) the directory keeps
//! answering from its cache, reports `Degraded` (and stops judging restarts by the cache:
//! [`EngineDirectory::is_current`]), and retries with backoff; when it gets
//! through it lists again and emits `Removed`/`Updated`/`Added` for whatever changed
//! meanwhile, then watches from the new listing's revision.
//!
//! # Metrics
//!
//! [`Metrics`] holds kvxfer's Prometheus families; agents plug their existing counters in as
//! snapshot closures read at scrape time (no cost on the data path) and observe the latency
//! histograms (and failed children by error kind) directly. [`MetricsServer`] serves them at
//! `GET /metrics`: the Prometheus text format 0.0.4, or OpenMetrics when the scraper's
//! `Accept` header asks for it.
//!
//! # Runtime
//!
//! Everything here runs on a tokio runtime handle given at start (an agent's own runtime, or
//! the host's); `start` functions return at once and never wait for etcd.
#![forbid(unsafe_code)]

mod backoff;
mod directory;
mod error;
mod etcd;
mod http;
mod metrics;
mod names;
mod record;
mod registration;
pub mod testing;

pub use directory::{
    DirectoryEvent, DirectoryEvents, DirectoryOptions, DirectoryStats, EngineDirectory, EngineEntry,
    IgnoreReason, DEFAULT_MAX_ENTRIES,
};
pub use error::{
    ConfigError, Error, EtcdError, EtcdOp, MetricsError, NameError, RecordError, RegistrationError,
    ResolveError,
};
pub use etcd::{EtcdAuth, EtcdConfig, EtcdState, EtcdStatus, EtcdTls, StatusWatch};
pub use http::MetricsServer;
pub use metrics::{
    ChildPullOutcome, DecodeSnapshot, Format, HandoffOutcome, Metrics, PerTransport, PrefillSnapshot,
    SourceGuard, Transport, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE,
};
pub use names::{
    drain_key, engines_prefix, AgentName, EngineId, EngineKey, Namespace, TransportName, KEY_LAYOUT,
};
pub use record::{AdvertiseAddr, EngineRecord, Host, MAX_RECORD_LEN, MAX_TRANSPORTS, RECORD_VERSION};
pub use registration::{
    Registration, RegistrationConfig, RegistrationStats, MAX_KEEPALIVE_INTERVAL, MAX_LEASE_TTL, MIN_LEASE_TTL,
};
