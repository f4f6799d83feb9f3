//! Each Python-facing agent runs kvxfer's async agent on a tokio runtime of its own (the
//! binding's threads, not Python's; `worker_threads=0`: one thread driving a current-thread
//! runtime, see `kvxfer::blocking::AgentRuntime`): [`Hosted`] holds the two, hands out the agent while it
//! lives, and shuts both down — gracefully, with the GIL released — on `shutdown()`, or on a
//! thread of its own when the Python object is collected without one.

use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvxfer::blocking::AgentRuntime;
use pyo3::prelude::*;
use tokio::runtime::Handle;

use crate::errors::{raise, AgentClosedError, TransportError};

/// Builds an agent's runtime: `threads` workers (0: one thread driving a current-thread
/// runtime) named `kvxfer-py-{name}`.
pub(crate) fn runtime(py: Python<'_>, name: &str, threads: usize) -> PyResult<AgentRuntime> {
    AgentRuntime::start(&format!("kvxfer-py-{name}"), threads)
        .map_err(|e| raise::<TransportError>(py, format!("starting the runtime of agent {name}: {e}"), &[]))
}

/// An async agent and the runtime it runs on.
pub(crate) struct Hosted<A: Send + Sync + 'static> {
    live: RwLock<Option<(Arc<A>, AgentRuntime)>>,
    what: &'static str,
}

impl<A: Send + Sync + 'static> Hosted<A> {
    /// Hosts `agent` on `rt`; `what` names it in errors ("prefill agent").
    pub(crate) fn new(agent: A, rt: AgentRuntime, what: &'static str) -> Self {
        Hosted { live: RwLock::new(Some((Arc::new(agent), rt))), what }
    }

    /// The agent and its runtime's handle, unless it was shut down.
    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<(Arc<A>, Handle)> {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        match &*live {
            Some((a, rt)) => Ok((a.clone(), rt.handle().clone())),
            None => Err(raise::<AgentClosedError>(py, format!("the {} was shut down", self.what), &[])),
        }
    }

    /// Whether it was shut down.
    pub(crate) fn is_closed(&self) -> bool {
        self.live.read().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// Shuts the agent down with `shutdown` (its graceful shutdown), then stops the runtime.
    /// Blocks (the caller releases the GIL); later calls return at once.
    pub(crate) fn shutdown<F, Fut>(&self, shutdown: F)
    where
        F: FnOnce(Arc<A>) -> Fut,
        Fut: Future<Output = ()>,
    {
        let taken = self.live.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((agent, rt)) = taken {
            rt.block_on(shutdown(agent.clone()));
            drop(agent);
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }

    /// For `Drop` of the Python object: the same shutdown on a thread of its own, so the
    /// garbage collector never blocks on the network.
    pub(crate) fn shutdown_detached<F, Fut>(&self, shutdown: F)
    where
        F: FnOnce(Arc<A>) -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        let taken = self.live.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((agent, rt)) = taken {
            let close = move || {
                rt.block_on(shutdown(agent.clone()));
                drop(agent);
                rt.shutdown_timeout(Duration::from_secs(2));
            };
            // If no thread can be started, the runtime is dropped here: its tasks stop.
            let _ = std::thread::Builder::new().name("kvxfer-py-close".into()).spawn(close);
        }
    }
}
