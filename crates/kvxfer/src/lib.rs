//! kvxfer: a KV-cache transfer engine for disaggregated LLM serving.
//!
//! A prefill worker starts a [`PrefillAgent`] over its registered KV cache and leases each
//! child's blocks ([`PrefillAgent::lease`]); the [`PrefillResult`] carries one
//! [`ChildHandoff`] per child to the decode worker, whose [`DecodeAgent`] pulls every child
//! straight into local blocks ([`DecodeAgent::submit`]) and notifies. Every lease ends
//! exactly once — pulled, released or expired — and the prefill owner hears which on
//! [`PrefillAgent::events`].
//!
//! Both agents run their own small tokio runtime, so they can be embedded in any process
//! (an inference server's Python threads included) through a blocking API.
#![deny(unsafe_code)]
// Errors are returned once per failed call, never on a per-block path; keeping them unboxed
// lets callers match on the nested variants directly.
#![allow(clippy::result_large_err)]
// The data path's unsafe code lives in kvxfer-mem and kvxfer-tcp. This crate makes exactly
// two unsafe calls, both in `decode.rs` (`Connection::read_into` and `KvMemory::copy_block`
// into destination blocks the pull has claimed), each allowed at its site with a SAFETY note.

mod config;
mod decode;
mod error;
mod prefill;
mod runtime;

pub use config::{AgentConfig, TransportChoice};
#[cfg(feature = "ucx")]
pub use kvxfer_ucx::UcxConfig;

#[cfg(feature = "ucx")]
mod ucx;
pub use decode::{ChildOutcome, ChildReport, DecodeAgent, DecodeStats, PullHandle, PullReport, Reclaimed};
pub use error::{Error, SubmitError};
pub use prefill::{PrefillAgent, PrefillStats};

pub use kvxfer_core::{
    BlockId, BlockLayout, ChildHandoff, ChildState, EndKind, KvTransferParams, LeaseEnd, LeaseRequest,
    ParentStatus, PrefillResult, Segment,
};
pub use kvxfer_mem::{KvMemory, Region};
pub use kvxfer_tcp::handshake::{CLUSTER_KEY_ENV, CLUSTER_KEY_FILE_ENV};
pub use kvxfer_tcp::{AuthError, ClusterKey, KeyError, Limits, ServerStats};

/// Logs, once per agent, that it runs without a cluster key.
fn warn_unauthenticated(role: &str, agent: &str) {
    tracing::warn!(
        agent,
        "{role} agent has no cluster key: peers are not authenticated (any peer that can connect \
         may handshake, and over UCX read whole registered regions); set {} or {}",
        CLUSTER_KEY_ENV,
        CLUSTER_KEY_FILE_ENV
    );
}

/// The TCP offer every agent makes in its handshake.
fn tcp_offer() -> kvxfer_proto::v1::TransportOffer {
    kvxfer_proto::v1::TransportOffer {
        transport: kvxfer_proto::v1::Transport::Tcp as i32,
        connection_info: vec![],
    }
}

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
