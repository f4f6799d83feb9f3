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

/// Which UCX this build uses: a dict with `built` (whether the binding has the UCX data
/// path), and where it has: `built_version` and `built_from` (the UCX it was compiled
/// against), `loaded_version` (the libucp this process loaded), `usable` (whether they
/// match: kvxfer refuses to start UCX on another major.minor), `error` (why not, or why UCX
/// did not start), and `transports` — the `"<transport>/<device>"` resources a UCX context
/// with `ucx_tls` (default: UCX's own choice, or `UCX_TLS`) finds on this host.
#[pyfunction]
#[pyo3(signature = (ucx_tls = None))]
fn ucx_info<'py>(py: Python<'py>, ucx_tls: Option<&str>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("built", cfg!(feature = "ucx"))?;
    #[cfg(feature = "ucx")]
    {
        let v = kvxfer::ucx_version();
        d.set_item("built_version", v.built)?;
        d.set_item("built_from", v.built_from)?;
        d.set_item("loaded_version", &v.runtime)?;
        d.set_item("usable", v.matches_build())?;
        let config = kvxfer::UcxConfig { tls: ucx_tls.map(str::to_owned), ..kvxfer::UcxConfig::default() };
        match py.detach(|| kvxfer::ucx_transports(&config)) {
            Ok(t) => {
                d.set_item("transports", t)?;
                d.set_item("error", py.None())?;
            }
            Err(e) => {
                d.set_item("transports", Vec::<String>::new())?;
                d.set_item("error", e.to_string())?;
            }
        }
    }
    #[cfg(not(feature = "ucx"))]
    let _ = ucx_tls;
    Ok(d)
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
    m.add_function(wrap_pyfunction!(ucx_info, m)?)?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
