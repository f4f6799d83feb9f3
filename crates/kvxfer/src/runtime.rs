//! The small tokio runtime each agent owns.

use tokio::runtime::Runtime;

use crate::Error;

/// Builds a multi-thread runtime with `threads` workers named after the agent.
pub(crate) fn build(name: &str, threads: usize) -> Result<Runtime, Error> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(format!("kvxfer-{name}"))
        .enable_all()
        .build()
        .map_err(|source| Error::Io { what: format!("starting the runtime of agent {name}"), source })
}

/// Shuts a runtime down without blocking inside an async context: tasks are dropped, which
/// closes every connection they own.
pub(crate) fn shutdown(rt: Runtime) {
    if tokio::runtime::Handle::try_current().is_ok() {
        rt.shutdown_background();
    } else {
        rt.shutdown_timeout(std::time::Duration::from_secs(2));
    }
}
