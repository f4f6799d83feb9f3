//! The Python exception classes, mirroring the Rust error enums, and the mapping of
//! `kvxfer::Error` onto them. Attributes (`kind`, `field`, `advice`, ...) are set on the
//! exception instance so Python code can branch without parsing messages.

use kvxfer_core::pull::{Advice, PullError as RustPullError};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::{create_exception, PyTypeInfo};

create_exception!(_kvxfer, KvxferError, PyException, "Base class of every kvxfer error.");
create_exception!(
    _kvxfer,
    ConfigError,
    KvxferError,
    "An agent option or the cluster key is invalid, or this build cannot do what was asked."
);
create_exception!(
    _kvxfer,
    RegistrationError,
    KvxferError,
    "Memory could not be registered: not a writable, C-contiguous host buffer, too short for \
     the layout, or a null/freed pointer."
);
create_exception!(
    _kvxfer,
    LayoutError,
    KvxferError,
    "A block layout is malformed (no segments, a stride shorter than a block, overflow)."
);
create_exception!(
    _kvxfer,
    LeaseError,
    KvxferError,
    "A lease could not be made or armed; `kind` names the reason (e.g. 'already_leased')."
);
create_exception!(
    _kvxfer,
    ParamsError,
    KvxferError,
    "A kv_transfer_params dict could not be read or turned into a hand-off; `field` names \
     its key."
);
create_exception!(
    _kvxfer,
    SubmitError,
    KvxferError,
    "A pull was refused before any I/O; `kind` names the reason (e.g. 'local_blocks_busy')."
);
create_exception!(
    _kvxfer,
    PullError,
    KvxferError,
    "A child's pull failed. Carried (not raised) in failed reports as `report['error']`; \
     `kind` names the failure, `advice` what to do ('retry_fresh_handoff', 'recompute', \
     'fail_request')."
);
create_exception!(
    _kvxfer,
    TransportError,
    KvxferError,
    "Binding a socket, starting a runtime or talking to a peer failed."
);
create_exception!(_kvxfer, AgentClosedError, KvxferError, "The agent was shut down.");

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvxferError", py.get_type::<KvxferError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("RegistrationError", py.get_type::<RegistrationError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("LeaseError", py.get_type::<LeaseError>())?;
    m.add("ParamsError", py.get_type::<ParamsError>())?;
    m.add("SubmitError", py.get_type::<SubmitError>())?;
    m.add("PullError", py.get_type::<PullError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("AgentClosedError", py.get_type::<AgentClosedError>())?;
    Ok(())
}

/// An exception of class `T` with `message` and attributes `attrs`.
pub(crate) fn raise<T: PyTypeInfo>(py: Python<'_>, message: String, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    let err = PyErr::from_type(py.get_type::<T>(), message);
    let value = err.value(py);
    for (name, v) in attrs {
        // Setting an attribute on a fresh exception instance does not fail.
        let _ = value.setattr(*name, v.bind(py));
    }
    err
}

/// A `SubmitError` the binding raises itself, of `kind`: its message ends with the kind, as
/// the engine's submit errors do.
pub(crate) fn submit_error(py: Python<'_>, kind: &str, message: impl std::fmt::Display) -> PyErr {
    raise::<SubmitError>(py, format!("{message} (kind={kind})"), &[("kind", s(py, kind))])
}

/// A string attribute value.
pub(crate) fn s(py: Python<'_>, v: &str) -> Py<PyAny> {
    v.into_pyobject(py).map(|o| o.into_any().unbind()).unwrap_or_else(|_| py.None())
}

/// The `field` of a params error (the `kv_transfer_params` key it names), if any.
fn params_field(e: &kvxfer_core::ParamsError) -> Option<String> {
    use kvxfer_core::ParamsError as P;
    match e {
        P::Missing(f) => Some((*f).to_owned()),
        P::Invalid { field, .. } => Some((*field).to_owned()),
        P::Json { field, .. } => Some(field.clone()),
        _ => None,
    }
}

/// A params error as a Python `ParamsError` (its message prefixed by `context`, e.g. the
/// position of the dict in a list).
pub(crate) fn params_error(py: Python<'_>, context: &str, e: &kvxfer_core::ParamsError) -> PyErr {
    let field = params_field(e).map_or_else(|| py.None(), |f| s(py, &f));
    raise::<ParamsError>(py, format!("{context}{e}"), &[("field", field)])
}

/// A `kvxfer::Error` as the Python exception of its kind.
pub(crate) fn to_py(py: Python<'_>, e: kvxfer::Error) -> PyErr {
    use kvxfer_core::Error as C;
    let msg = e.to_string();
    match &e {
        kvxfer::Error::Core(C::Lease(l)) => raise::<LeaseError>(py, msg, &[("kind", s(py, l.kind()))]),
        kvxfer::Error::Core(C::Params(p)) => params_error(py, "", p),
        kvxfer::Error::Core(C::Handoff(_)) => raise::<ParamsError>(py, msg, &[("field", py.None())]),
        kvxfer::Error::Core(C::Layout(_)) => raise::<LayoutError>(py, msg, &[]),
        kvxfer::Error::Core(C::Plan(_)) => submit_error(py, "plan", msg),
        kvxfer::Error::Core(_) => raise::<KvxferError>(py, msg, &[]),
        kvxfer::Error::Mem(_) => raise::<RegistrationError>(py, msg, &[]),
        kvxfer::Error::Submit(se) => raise::<SubmitError>(py, msg, &[("kind", s(py, se.kind()))]),
        kvxfer::Error::ShapeMismatch(_) => raise::<LayoutError>(py, msg, &[("field", s(py, "shape"))]),
        kvxfer::Error::Key(_) | kvxfer::Error::Unsupported(_) | kvxfer::Error::InsideRuntime { .. } => {
            raise::<ConfigError>(py, msg, &[])
        }
        kvxfer::Error::Transport(_) | kvxfer::Error::Io { .. } => raise::<TransportError>(py, msg, &[]),
        kvxfer::Error::Draining { .. } => raise::<LeaseError>(py, msg, &[("kind", s(py, "draining"))]),
        _ => raise::<KvxferError>(py, msg, &[]),
    }
}

/// The snake-case name of an `Advice`.
pub(crate) fn advice_name(a: Advice) -> &'static str {
    match a {
        Advice::RetryFreshHandoff => "retry_fresh_handoff",
        Advice::Recompute => "recompute",
        Advice::FailRequest => "fail_request",
        _ => "fail_request",
    }
}

/// A child's pull error as a (not raised) Python `PullError` instance.
pub(crate) fn pull_error(
    py: Python<'_>,
    e: &RustPullError,
    remote_request_id: &str,
    child_index: u32,
) -> Py<PyAny> {
    let attrs = [
        ("kind", s(py, e.kind())),
        ("advice", s(py, advice_name(e.advice()))),
        (
            "retryable",
            e.is_retryable()
                .into_pyobject(py)
                .map(|b| b.to_owned().into_any().unbind())
                .unwrap_or_else(|_| py.None()),
        ),
        ("remote_request_id", s(py, remote_request_id)),
        (
            "child_index",
            child_index.into_pyobject(py).map(|i| i.into_any().unbind()).unwrap_or_else(|_| py.None()),
        ),
    ];
    raise::<PullError>(py, e.to_string(), &attrs).into_value(py).into_any()
}
