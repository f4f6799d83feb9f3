//! The error of every UCX call, and the check that turns a UCX status into it.

use std::ffi::CStr;

use ucx_sys as sys;

/// A UCX failure: the call and UCX's own status text.
#[derive(Debug, Clone, thiserror::Error)]
#[error("UCX {op}: {message}")]
pub struct UcxError {
    op: &'static str,
    status: i32,
    message: String,
}

impl UcxError {
    pub(super) fn status(op: &'static str, status: sys::ucs_status_t) -> Self {
        // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string
        // for every status value.
        let text = unsafe { CStr::from_ptr(sys::ucs_status_string(status)) };
        UcxError { op, status: i32::from(status), message: text.to_string_lossy().into_owned() }
    }

    pub(super) fn other(op: &'static str, message: impl Into<String>) -> Self {
        UcxError { op, status: 0, message: message.into() }
    }

    /// The same error with `context` appended to its message (what was asked, what exists).
    #[must_use]
    pub fn with_context(mut self, context: impl std::fmt::Display) -> Self {
        self.message = format!("{}; {context}", self.message);
        self
    }

    pub(crate) fn thread(e: &std::io::Error) -> Self {
        Self::other("thread", format!("could not start the UCX thread: {e}"))
    }

    pub(crate) fn not_thread_safe() -> Self {
        Self::other(
            "ucp_init",
            "UCX gave no thread-safe context (thread mode is not UCS_THREAD_MODE_MULTI; a UCX built \
             without multi-threading support?), so UCX-allocated memory cannot be shared with UCX \
             targets: use ordinary memory (peers' gets from it are emulated by the target's thread)",
        )
    }

    pub(crate) fn thread_died() -> Self {
        Self::other("thread", "the UCX thread has stopped")
    }

    /// The UCX status code (0 when the error is not a UCX status).
    pub fn code(&self) -> i32 {
        self.status
    }
}

/// `Ok` for `UCS_OK`, else the error of `op` with UCX's status text.
pub(super) fn check(op: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::status(op, status))
    }
}
