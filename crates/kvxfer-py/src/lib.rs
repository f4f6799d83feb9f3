//! The Python binding of kvxfer: module `kvxfer._kvxfer`, wrapped by the pure-Python
//! package in `python/kvxfer/` (type stubs, the vLLM connector, the benchmark).
//!
//! - `memory`: `Segment` and `Memory` — Python-owned buffers (numpy arrays, CPU torch
//!   tensors, duck-typed) registered as a block layout, kept alive while registered.
//! - `prefill`: `PrefillAgent` — lease, arm (the two-phase lease), cancel, lease ends.
//! - `decode`: `DecodeAgent` and `Pull` — non-blocking pulls of children given as
//!   `kv_transfer_params` dicts, per-child reports, cancels, queued-lease heartbeats.
//! - `params`: `Handoff` and the dict ↔ `KvTransferParams` conversion.
//! - `shape`: `KvShape` — a rank's TP size and rank, heads and head dim, for pairing
//!   engines of different tensor-parallel or block sizes.
//! - `errors`: the exception classes mirroring the Rust error enums.
//!
//! Each agent runs kvxfer's async agent on a tokio runtime of its own (`host`); every call
//! that waits releases the GIL. Nothing here panics on Python input: every failure is a
//! Python exception.

// kvxfer's `Error` is returned unboxed (see the kvxfer crate); the closures that start
// agents with the GIL released return it as is.
#![allow(clippy::result_large_err)]

use pyo3::prelude::*;

mod decode;
mod errors;
mod host;
mod keeper;
mod memory;
mod params;
mod prefill;
mod shape;

/// Logs kvxfer's tracing events to stderr, filtered by `filter` (`RUST_LOG` syntax, e.g.
/// "info" or "kvxfer=debug"); `RUST_LOG` wins when set. Returns False if logging was
/// already set up.
#[pyfunction]
#[pyo3(signature = (filter = "info"))]
fn enable_logging(filter: &str) -> bool {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // No colour codes in a log written to a file or a pipe (vLLM's logs usually are).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init()
        .is_ok()
}

/// The wire protocol version this build speaks.
#[pyfunction]
fn protocol_version() -> u32 {
    kvxfer_proto::PROTOCOL_VERSION
}

/// The module `kvxfer._kvxfer`.
#[pymodule]
fn _kvxfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<memory::Segment>()?;
    m.add_class::<memory::Memory>()?;
    m.add_class::<params::Handoff>()?;
    m.add_class::<shape::KvShape>()?;
    m.add_class::<prefill::PrefillAgent>()?;
    m.add_class::<decode::DecodeAgent>()?;
    m.add_class::<decode::Pull>()?;
    m.add_function(wrap_pyfunction!(enable_logging, m)?)?;
    m.add_function(wrap_pyfunction!(protocol_version, m)?)?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
