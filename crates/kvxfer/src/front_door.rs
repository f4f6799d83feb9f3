//! A prefill agent's front door: the thread its connections are accepted on and their
//! handshakes run on, at a lowered CPU priority, until the peer proved what it must
//! (`AgentConfig::front_door_nice`). Connections that never prove anything — a flood of
//! them, or of slow ones — then get the CPU the served connections leave over instead of
//! an equal share of the agent's runtime; admitted connections are handed to that runtime.

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tracing::{debug, warn};

/// The thread's name (as `ps -L` and `/proc/*/task/*/comm` show it; at most 15 bytes).
pub(crate) const THREAD_NAME: &str = "kvxfer-accept";

/// Runs `accept` on a thread of its own (a current-thread runtime) whose nice value is
/// raised by `nice`; the thread ends when `accept` returns, dropping the handshakes still
/// under way, then `token`. `Err(accept)` when the runtime or the thread could not be
/// started: the caller runs it elsewhere.
pub(crate) fn spawn<F>(nice: i32, token: TaskTrackerToken, accept: F) -> Result<(), F>
where
    F: Future<Output = ()> + Send + 'static,
{
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            warn!(error = %e, "the front-door runtime did not start; handshakes run on the agent's runtime");
            return Err(accept);
        }
    };
    // The future is handed back if the thread cannot start.
    let slot = std::sync::Arc::new(std::sync::Mutex::new(Some(accept)));
    let theirs = slot.clone();
    let started = std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || {
        let accept = theirs.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(accept) = accept else { return };
        lower_priority(nice);
        rt.block_on(accept);
        // Dropping the runtime drops the handshakes under way.
        drop(rt);
        drop(token);
    });
    match started {
        Ok(_) => Ok(()),
        Err(e) => {
            warn!(error = %e, "the front-door thread did not start; handshakes run on the agent's runtime");
            let accept = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
            // The thread never ran, so the future is still there.
            accept.map_or(Ok(()), Err)
        }
    }
}

/// Raises the calling thread's nice value by `by` (at most to 19): Linux keeps a nice value
/// per thread.
fn lower_priority(by: i32) {
    if by <= 0 {
        return;
    }
    let me = Some(rustix::thread::gettid());
    let now = rustix::process::getpriority_process(me).unwrap_or(0);
    let to = now.saturating_add(by).min(19);
    match rustix::process::setpriority_process(me, to) {
        Ok(()) => debug!(nice = to, "front door at a lowered priority"),
        Err(e) => debug!(error = %e, "could not lower the front door's priority"),
    }
}

/// A token cancelled when the runtime of `handle` drops the task holding it (the runtime
/// shut down) or when `stop` is cancelled: a front door outliving its agent's runtime stops
/// accepting.
pub(crate) fn runtime_gone(handle: &tokio::runtime::Handle, stop: &CancellationToken) -> CancellationToken {
    let gone = CancellationToken::new();
    let guard = gone.clone().drop_guard();
    let stop = stop.clone();
    handle.spawn(async move {
        let _guard = guard;
        stop.cancelled().await;
    });
    gone
}
