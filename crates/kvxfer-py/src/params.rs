//! vLLM's `kv_transfer_params` dict across the boundary, and [`Handoff`]. A dict travels
//! as JSON through Python's `json` module and is parsed by the core's
//! `KvTransferParams::from_json` — the same parser, with the same field-naming errors, as
//! every other kvxfer entry point.

use std::time::Duration;

use kvxfer_core::{ChildHandoff, KvTransferParams};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::errors::{params_error, raise, ParamsError};

/// `kv_transfer_params` from a dict (or its JSON text). `context` prefixes error messages
/// (e.g. `"children[2]: "`).
pub(crate) fn from_py(obj: &Bound<'_, PyAny>, context: &str) -> PyResult<KvTransferParams> {
    let py = obj.py();
    let text: String = if let Ok(s) = obj.cast::<PyString>() {
        s.extract::<String>()?
    } else if obj.cast::<PyDict>().is_ok() {
        let json = py.import("json")?;
        match json.call_method1("dumps", (obj,)) {
            Ok(t) => t.extract()?,
            Err(e) => {
                return Err(raise::<ParamsError>(
                    py,
                    format!("{context}kv_transfer_params is not JSON-serializable: {}", e.value(py)),
                    &[("field", py.None())],
                ))
            }
        }
    } else {
        let name = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(raise::<ParamsError>(
            py,
            format!("{context}kv_transfer_params must be a dict (or its JSON text), not {name}"),
            &[("field", py.None())],
        ));
    };
    KvTransferParams::from_json(&text).map_err(|e| params_error(py, context, &e))
}

/// `kv_transfer_params` as a Python dict.
pub(crate) fn to_py<'py>(py: Python<'py>, p: &KvTransferParams) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (p.to_json(),))
}

/// The hand-off a `kv_transfer_params` dict describes.
pub(crate) fn handoff_from_py(obj: &Bound<'_, PyAny>, context: &str) -> PyResult<ChildHandoff> {
    let p = from_py(obj, context)?;
    p.to_handoff().map_err(|e| params_error(obj.py(), context, &e))
}

/// One child's hand-off: what a decode worker needs to pull it and to notify. `to_params()`
/// gives vLLM's `kv_transfer_params` dict for it.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub(crate) struct Handoff {
    pub(crate) inner: ChildHandoff,
}

#[pymethods]
impl Handoff {
    /// Parses a hand-off from its `kv_transfer_params` dict (or JSON text).
    #[staticmethod]
    fn from_params(params: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Handoff { inner: handoff_from_py(params, "")? })
    }

    /// vLLM's `kv_transfer_params` dict for this child (plus kvxfer's `kvxfer_*` keys).
    fn to_params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_py(py, &KvTransferParams::from_handoff(&self.inner))
    }

    /// The id the prefill side expects back.
    #[getter]
    fn remote_request_id(&self) -> &str {
        self.inner.remote_request_id()
    }

    /// The parent request id.
    #[getter]
    fn parent_request_id(&self) -> &str {
        self.inner.parent_request_id()
    }

    /// This child's index.
    #[getter]
    fn child_index(&self) -> u32 {
        self.inner.child_index()
    }

    /// The parent's number of children.
    #[getter]
    fn n(&self) -> u32 {
        self.inner.n()
    }

    /// The lease token, 32 hex digits.
    #[getter]
    fn token(&self) -> String {
        self.inner.token().to_hex()
    }

    /// The prefill blocks to pull.
    #[getter]
    fn remote_block_ids(&self) -> Vec<u32> {
        self.inner.remote_block_ids().to_vec()
    }

    /// The prefill engine's id.
    #[getter]
    fn engine_id(&self) -> &str {
        &self.inner.engine().engine_id
    }

    /// Host of the prefill agent.
    #[getter]
    fn host(&self) -> &str {
        &self.inner.engine().host
    }

    /// Port of the prefill agent.
    #[getter]
    fn port(&self) -> u16 {
        self.inner.engine().port
    }

    /// The prefill agent process's incarnation (0: not stated).
    #[getter]
    fn incarnation(&self) -> u64 {
        self.inner.engine().incarnation
    }

    /// Consumers that must notify before the lease ends as pulled.
    #[getter]
    fn expected_consumers(&self) -> u32 {
        self.inner.expected_consumers()
    }

    /// The lease's time-to-live, in seconds.
    #[getter]
    fn ttl(&self) -> f64 {
        self.inner.ttl().as_secs_f64()
    }

    fn __repr__(&self) -> String {
        format!(
            "Handoff({} child {}/{} of {}, {} blocks at {})",
            self.inner.remote_request_id(),
            self.inner.child_index(),
            self.inner.n(),
            self.inner.parent_request_id(),
            self.inner.remote_block_ids().len(),
            self.inner.engine().addr()
        )
    }
}

/// Longest duration accepted from Python (about a century): any deadline computed from it
/// still fits in an `Instant`.
const MAX_SECONDS: f64 = 100.0 * 365.0 * 24.0 * 3600.0;

/// Seconds (a Python float) as a `Duration`, refusing negative, non-finite and absurdly
/// large values (more than a century).
pub(crate) fn seconds(py: Python<'_>, name: &str, v: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(v).ok().filter(|_| v <= MAX_SECONDS).ok_or_else(|| {
        raise::<crate::errors::ConfigError>(
            py,
            format!("{name} must be a number of seconds between 0 and {MAX_SECONDS:.0}, got {v}"),
            &[],
        )
    })
}
