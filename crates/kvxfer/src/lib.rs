//! kvxfer: a KV-cache transfer engine for disaggregated LLM serving.
//!
//! A prefill worker starts a [`PrefillAgent`] over its registered KV cache and leases each
//! child's blocks ([`PrefillAgent::lease`]); the [`PrefillResult`] carries one
//! [`ChildHandoff`] per child to the decode worker, whose [`DecodeAgent`] pulls every child
//! straight into local blocks ([`DecodeAgent::submit`]) and notifies. Every lease ends
//! exactly once — pulled, released or expired — and the prefill owner hears which on
//! [`PrefillAgent::events`] (or the [`PrefillAgent::lease_ends`] stream).
//!
//! # Async or blocking
//!
//! The agents at the crate root are async and run on the caller's tokio runtime
//! ([`PrefillAgent::start`] uses the current one, [`PrefillAgent::start_on`] a given
//! [`tokio::runtime::Handle`]). A pull's per-child reports are a `Stream` and its whole
//! report a `Future` ([`PullHandle`]); [`PrefillAgent::shutdown`] and
//! [`DecodeAgent::shutdown`] close gracefully, and dropping an agent never blocks: it
//! signals the shutdown and a task finishes it. [`blocking`] has the same agents with a
//! runtime of their own, for hosts without tokio (Python, C).
//!
//! # In a cluster
//!
//! With the `cluster` feature, [`AgentConfig`]'s `cluster` section turns on etcd discovery
//! (prefill agents register, decode agents resolve and watch engines) and Prometheus metrics;
//! see the `cluster` module.
//!
//! # Threads
//!
//! | agent | async (host's runtime) | blocking |
//! | --- | --- | --- |
//! | prefill, TCP | none: tasks on the host's runtime | `worker_threads` runtime workers (default 2; 0: one thread driving a current-thread runtime) |
//! | decode, TCP | none | `worker_threads` runtime workers (or with 0 one driver thread) |
//! | + UCX | + 1 progress thread per agent (`kvxfer-ucx-target` / `kvxfer-ucx-initiator`) | same |
//!
//! Transient ones: starting UCX runs on the runtime's blocking pool (tokio keeps such a
//! thread idle for 10 s), and dropping a UCX object on a runtime thread hands it to a short
//! `kvxfer-teardown` thread (its drop joins UCX's thread). A blocking agent's runtime also
//! has tokio's blocking pool (used for name resolution of non-IP addresses only).
#![deny(unsafe_code)]
// Errors are returned once per failed call, never on a per-block path; keeping them unboxed
// lets callers match on the nested variants directly.
#![allow(clippy::result_large_err)]
// The data path's unsafe code lives in kvxfer-mem, kvxfer-tcp and kvxfer-ucx. This crate's
// eleven unsafe blocks (`grep -rnoE '\bunsafe \{' src`, tests aside): the TCP read
// (`Connection::read_into_then_notify` or `read_group_into`) and `KvMemory::copy_block` into
// destination blocks the pull has claimed (`decode/pull.rs`), `Connection::read_scatter`
// into the claimed blocks of a head-slice pull (`decode/ranks.rs`), and seven in the UCX
// glue (`ucx.rs`: zeroing and wrapping UCX-allocated memory in `ucx_region`, starting the
// target and the initiator over the regions, `UcxInitiator::get`, the CRC of a completed
// read of whole blocks or of head slices),
// each with a SAFETY note.

pub mod blocking;
#[cfg(feature = "cluster")]
pub mod cluster;
#[cfg(feature = "cluster")]
mod cluster_config;
mod config;
mod crc_precompute;
mod decode;
mod error;
mod front_door;
mod hello;
mod prefill;
mod runtime;
#[cfg(feature = "ucx")]
mod ucx;

pub use config::{AgentConfig, TransportChoice};
pub use decode::{
    ChildReport, DataPath, DecodeAgent, DecodeStats, PullCanceller, PullHandle, PullReport, Reclaimed,
};
pub use error::{Error, SubmitError};
pub use kvxfer_core::pull::{Advice, ChildOutcome, MismatchField, PullError};
#[cfg(feature = "ucx")]
pub use kvxfer_ucx::{ucx_transports, ucx_version, UcxConfig, UcxVersion};
pub use prefill::{LeaseEnds, PrefillAgent, PrefillStats};
pub use runtime::wait_for_teardown;
#[cfg(feature = "ucx")]
pub use ucx::ucx_region;

pub use kvxfer_core::{
    BlockId, BlockLayout, ChildHandoff, ChildState, EndKind, KvTransferParams, LeaseEnd, LeaseRequest,
    LeaseToken, ParentStatus, PrefillResult, Segment,
};
pub use kvxfer_mem::{KvMemory, Region};
pub use kvxfer_tcp::handshake::{CLUSTER_KEY_ENV, CLUSTER_KEY_FILE_ENV};
pub use kvxfer_tcp::{AuthError, ClusterKey, KeyError, Limits, ServerStats};

/// Makes UCX write its own log messages to stderr, so a program's stdout (JSON, CSV) stays
/// clean: UCX logs to stdout by default and reads `UCX_LOG_FILE` only when the library is
/// loaded, so when it is unset this re-executes the current program once with
/// `UCX_LOG_FILE=stderr`. Call it first thing in `main`. Without the `ucx` feature, or when
/// `UCX_LOG_FILE` is already set, it does nothing.
pub fn ucx_log_to_stderr() {
    #[cfg(all(feature = "ucx", unix))]
    if std::env::var_os("UCX_LOG_FILE").is_none() {
        use std::os::unix::process::CommandExt;
        if let Ok(exe) = std::env::current_exe() {
            let err = std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .env("UCX_LOG_FILE", "stderr")
                .exec();
            // Only reached when exec failed: carry on with UCX logging to stdout.
            tracing::warn!(error = %err, "could not re-execute with UCX_LOG_FILE=stderr");
        }
    }
}
