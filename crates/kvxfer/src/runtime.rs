//! Runtimes and threads: the small runtime of a blocking agent, and dropping values whose
//! drop may block (a UCX object joins its thread) off the runtime's threads.

use tokio::runtime::{Handle, Runtime};

use crate::Error;

/// Builds the multi-thread runtime of a blocking agent: `threads` workers named after the
/// agent.
pub(crate) fn build(name: &str, threads: usize) -> Result<Runtime, Error> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(format!("kvxfer-{name}"))
        .enable_all()
        .build()
        .map_err(|source| Error::Io { what: format!("starting the runtime of agent {name}"), source })
}

/// `now + d`, or a year from now when that does not fit in an `Instant` (a caller's
/// "wait for ever", e.g. `Duration::MAX`, must not panic).
pub(crate) fn instant_after(now: std::time::Instant, d: std::time::Duration) -> std::time::Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(std::time::Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Whether the calling thread is inside a tokio runtime (where blocking would stall it).
pub(crate) fn in_runtime() -> bool {
    Handle::try_current().is_ok()
}

/// Refuses a blocking call made from inside a tokio runtime, naming the async call to use.
pub(crate) fn refuse_in_runtime(call: &'static str, instead: &'static str) -> Result<(), Error> {
    if in_runtime() {
        return Err(Error::InsideRuntime { call, instead });
    }
    Ok(())
}

/// Shuts a blocking agent's runtime down: waits (bounded) for its tasks from a plain
/// thread, never blocks inside an async context.
pub(crate) fn shutdown(rt: Runtime) {
    if in_runtime() {
        rt.shutdown_background();
    } else {
        rt.shutdown_timeout(std::time::Duration::from_secs(2));
    }
}

/// A value whose drop may block (a UCX target or initiator joins its thread): dropped on a
/// short-lived thread of its own when the drop would otherwise run on a runtime thread.
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
pub(crate) struct DropOffRuntime<T: Send + 'static>(Option<T>);

#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
impl<T: Send + 'static> DropOffRuntime<T> {
    /// Wraps `value`.
    pub(crate) fn new(value: T) -> Self {
        DropOffRuntime(Some(value))
    }

    /// The value.
    pub(crate) fn get(&self) -> Option<&T> {
        self.0.as_ref()
    }
}

impl<T: Send + 'static> Drop for DropOffRuntime<T> {
    fn drop(&mut self) {
        let Some(value) = self.0.take() else { return };
        if in_runtime() {
            // If the thread cannot start, the closure (and the value) drops here instead.
            let _ = std::thread::Builder::new().name("kvxfer-teardown".into()).spawn(move || drop(value));
        }
    }
}
