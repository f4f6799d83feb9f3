//! The unsafe part: UCX handles and the two thread loops that own them.
//!
//! - `error`: [`UcxError`] and the status check of every UCX call.
//! - `handles`: RAII handles of the context (shared per transport set, with the memory it
//!   allocates), the worker (and the [`Signal`] that wakes it), memory maps, and `setup`,
//!   which makes them.
//! - `endpoint`: an initiator's endpoint to one target with its rkeys, and the checks of a
//!   peer's target info.
//! - `target`: the prefill side's thread loop ([`run_target`]).
//! - `initiator`: the decode side's thread loop ([`run_initiator`]) and its gets.
//! - `version`: the UCX loaded ([`ucx_version`]) and the check, before any context is
//!   made, that it is the version built against.

mod endpoint;
mod error;
mod handles;
mod initiator;
mod target;
mod version;

pub use endpoint::{MAX_RKEY_LEN, MAX_WORKER_ADDRESS_LEN};
pub use error::UcxError;
pub(crate) use handles::{Context, SharedContext, Signal};
pub(crate) use initiator::{run_initiator, InitiatorLoop};
pub(crate) use target::run_target;
pub use version::{ucx_version, UcxVersion};

/// The transports UCX may use with `config` (its transport set and the `UCX_*` environment),
/// as `"<transport>/<device>"` names: what a context made for it finds on this host.
pub fn ucx_transports(config: &crate::UcxConfig) -> Result<Vec<String>, UcxError> {
    Context::private(config)?.resources()
}
