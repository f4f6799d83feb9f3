//! Runtimes and threads: the small runtime of a blocking agent, and dropping values whose
//! drop may block or is UCX teardown (a UCX object joins its thread; UCX-allocated memory
//! is unmapped) off the runtime's threads, tracked for [`wait_for_teardown`].

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

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

/// A value whose drop may block or is UCX teardown (a UCX target or initiator joins its
/// thread; a `UcxBuffer` unmaps its memory and may clean up its context): dropped on a
/// short-lived `kvxfer-teardown` thread, which [`wait_for_teardown`] waits for, when the
/// drop would otherwise run on a runtime thread; in place on any other thread.
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
            spawn_teardown(move || drop(value));
        }
    }
}

/// Teardown threads still running (`kvxfer-teardown`), and a condition variable signalled
/// as each one ends.
static TEARDOWNS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// Counts one teardown thread until dropped (also when its thread could not start and the
/// closure holding it is dropped at once).
struct TeardownTicket;

impl TeardownTicket {
    fn new() -> Self {
        *TEARDOWNS.0.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        TeardownTicket
    }
}

impl Drop for TeardownTicket {
    fn drop(&mut self) {
        let mut n = TEARDOWNS.0.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.saturating_sub(1);
        TEARDOWNS.1.notify_all();
    }
}

/// Runs `f` on a short-lived `kvxfer-teardown` thread, counted until it ends (see
/// [`wait_for_teardown`]); runs it here if no thread can be started.
pub(crate) fn spawn_teardown(f: impl FnOnce() + Send + 'static) {
    let ticket = TeardownTicket::new();
    let run = move || {
        f();
        drop(ticket);
    };
    let parked = Arc::new(Mutex::new(Some(run)));
    let theirs = parked.clone();
    let spawned = std::thread::Builder::new().name("kvxfer-teardown".into()).spawn(move || {
        let taken = theirs.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(run) = taken {
            run();
        }
    });
    if spawned.is_err() {
        let taken = parked.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(run) = taken {
            run();
        }
    }
}

/// Waits, up to `timeout`, until every teardown the agents left to threads of their own
/// has finished — UCX workers destroyed and their threads joined after an agent was dropped
/// or shut down on a runtime thread, and UCX-allocated memory (`ucx_region`)
/// released after its last owner let go of it there. Returns whether none is left. Call it
/// before the process exits after dropping agents from async code: UCX's own exit handlers
/// must not run while one of its workers is still being destroyed (that can crash the
/// exit). The blocking agents' `Drop` calls it (bounded by 10 s).
pub fn wait_for_teardown(timeout: Duration) -> bool {
    let deadline = instant_after(Instant::now(), timeout);
    let mut n = TEARDOWNS.0.lock().unwrap_or_else(PoisonError::into_inner);
    while *n > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        n = TEARDOWNS.1.wait_timeout(n, left).unwrap_or_else(|p| p.into_inner()).0;
    }
    true
}
