//! vLLM's `kv_transfer_params` dict across the boundary, and [`Handoff`]. A dict of plain
//! JSON types is read into a JSON value directly (no text in between) and parsed by the
//! core's `KvTransferParams::from_value`; anything else, and any dict that fails there,
//! travels as JSON text through Python's `json` module to `KvTransferParams::from_json` —
//! the same parser, with the same field-naming errors, as every other kvxfer entry point.

use std::time::Duration;

use kvxfer_core::{ChildHandoff, KvTransferParams};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::{params_error, raise, ParamsError};

/// Block ids as Python gives them: one list (a single KV-cache group), or one list per
/// group (vLLM's nested form for hybrid models).
pub(crate) enum BlockLists {
    /// One list: a single group.
    Flat(Vec<u32>),
    /// One list per KV-cache group.
    Grouped(Vec<Vec<u32>>),
}

impl BlockLists {
    /// Reads a list of ids, or of lists of ids (told apart by the first entry: a sized,
    /// non-text object is a group's list). Python's own errors (TypeError, OverflowError
    /// for a negative id) pass through.
    pub(crate) fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let nested = obj.get_item(0).is_ok_and(|first| {
            first.hasattr("__len__").unwrap_or(false)
                && first.cast::<PyString>().is_err()
                && first.cast::<pyo3::types::PyBytes>().is_err()
        });
        if nested {
            Ok(BlockLists::Grouped(obj.extract()?))
        } else {
            Ok(BlockLists::Flat(obj.extract()?))
        }
    }

    /// [`Self::extract`] of every entry of a list.
    pub(crate) fn extract_each(objs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Self>> {
        objs.iter().map(Self::extract).collect()
    }

    /// One list per group.
    pub(crate) fn into_groups(self) -> Vec<Vec<u32>> {
        match self {
            BlockLists::Flat(v) => vec![v],
            BlockLists::Grouped(g) => g,
        }
    }
}

/// Nesting deeper than this is left to the JSON path (whose own limits then apply).
const MAX_PLAIN_DEPTH: usize = 32;

/// `obj` as the JSON value `json.dumps` would write for it, when it is made only of the
/// exact built-in types that map one to one (dict with str keys, list, tuple, str, int
/// within 64 bits, finite float, bool, None); `None` for anything else — a subclass, a
/// non-str key, a NaN, a huge int — which the JSON path then handles exactly as before.
fn plain_json(obj: &Bound<'_, PyAny>, depth: usize) -> Option<serde_json::Value> {
    use serde_json::Value;
    if depth > MAX_PLAIN_DEPTH {
        return None;
    }
    if obj.is_none() {
        Some(Value::Null)
    } else if let Ok(s) = obj.cast_exact::<PyString>() {
        Some(Value::String(s.to_cow().ok()?.into_owned()))
    } else if let Ok(b) = obj.cast_exact::<PyBool>() {
        Some(Value::Bool(b.is_true()))
    } else if let Ok(i) = obj.cast_exact::<PyInt>() {
        match i.extract::<i64>() {
            Ok(v) => Some(Value::from(v)),
            Err(_) => i.extract::<u64>().ok().map(Value::from),
        }
    } else if let Ok(d) = obj.cast_exact::<PyDict>() {
        let mut map = serde_json::Map::with_capacity(d.len());
        for (k, v) in d.iter() {
            let k = k.cast_exact::<PyString>().ok()?.to_cow().ok()?.into_owned();
            map.insert(k, plain_json(&v, depth + 1)?);
        }
        Some(Value::Object(map))
    } else if let Ok(l) = obj.cast_exact::<PyList>() {
        l.iter().map(|v| plain_json(&v, depth + 1)).collect::<Option<Vec<_>>>().map(Value::Array)
    } else if let Ok(t) = obj.cast_exact::<PyTuple>() {
        t.iter().map(|v| plain_json(&v, depth + 1)).collect::<Option<Vec<_>>>().map(Value::Array)
    } else if let Ok(f) = obj.cast_exact::<PyFloat>() {
        serde_json::Number::from_f64(f.value()).map(Value::Number)
    } else {
        None
    }
}

/// `kv_transfer_params` from a dict (or its JSON text). `context` prefixes error messages
/// (e.g. `"children[2]: "`).
pub(crate) fn from_py(obj: &Bound<'_, PyAny>, context: &str) -> PyResult<KvTransferParams> {
    let py = obj.py();
    // The direct path: a dict of plain JSON types that parses. Otherwise (or on an error,
    // whose message then comes from the text path as it always has) the text path.
    if obj.cast_exact::<PyDict>().is_ok() {
        if let Some(Ok(p)) = plain_json(obj, 0).map(KvTransferParams::from_value) {
            return Ok(p);
        }
    }
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

    /// The prefill blocks to pull (of group 0 in a cache of several KV-cache groups).
    #[getter]
    fn remote_block_ids(&self) -> Vec<u32> {
        self.inner.remote_block_ids().to_vec()
    }

    /// The prefill blocks to pull, one list per KV-cache group.
    #[getter]
    fn group_block_ids(&self) -> Vec<Vec<u32>> {
        self.inner.groups().map(<[u32]>::to_vec).collect()
    }

    /// Number of KV-cache groups the hand-off lists blocks of.
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    /// Tensor-parallel size of the prefill engine.
    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.engine().tp_size
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
