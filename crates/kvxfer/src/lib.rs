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
pub use decode::{ChildOutcome, ChildReport, DecodeAgent, DecodeStats, PullHandle, PullReport};
pub use error::{Error, SubmitError};
pub use prefill::{PrefillAgent, PrefillStats};

pub use kvxfer_core::{
    BlockId, BlockLayout, ChildHandoff, ChildState, EndKind, KvTransferParams, LeaseEnd, LeaseRequest,
    ParentStatus, PrefillResult, Segment,
};
pub use kvxfer_mem::{KvMemory, Region};
pub use kvxfer_tcp::{Limits, ServerStats};
