//! The blocking facade, for hosts without a tokio runtime (an inference server's Python
//! threads, C callers): each agent owns a small runtime ([`AgentRuntime`]:
//! `AgentConfig::worker_threads` workers, or with 0 a current-thread runtime on one driver
//! thread; threads named `kvxfer-{agent}`) and runs the async agent of the crate root on it
//! — the same code, not a second implementation.
//!
//! Calls that wait never start a runtime on the caller's thread (they poll the agent's
//! futures with a plain executor while the agent's runtime drives them), so none of them
//! panics inside a tokio runtime; `start` refuses to run there ([`Error::InsideRuntime`]),
//! since a host with a runtime should use the async agents. Dropping an agent shuts it down
//! gracefully (bounded by `AgentConfig::shutdown_grace`) and then stops its runtime — also
//! when the drop happens inside a tokio runtime (an async task owned it): the shutdown then
//! runs on a short-lived `kvxfer-teardown` thread instead of blocking the caller.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use futures::StreamExt;
use kvxfer_core::{
    BlockId, CancelOutcome, ChildHandoff, LeaseEnd, LeaseRequest, ParentStatus, PrefillResult,
};
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1;
use tokio::runtime::Handle;

pub use crate::runtime::AgentRuntime;
use crate::runtime::{in_runtime, refuse_in_runtime, wait};
use crate::{
    AgentConfig, ChildReport, DecodeStats, Error, LeaseEnds, PrefillStats, PullCanceller, PullReport,
    Reclaimed,
};

/// A prefill worker's agent with its own runtime (see [`crate::PrefillAgent`]).
#[derive(Debug)]
pub struct PrefillAgent {
    agent: Option<crate::PrefillAgent>,
    runtime: Option<AgentRuntime>,
}

impl PrefillAgent {
    /// Starts an agent over `memory`, listening on `listen` (port 0 picks a free port).
    /// Refused inside a tokio runtime ([`Error::InsideRuntime`]): use
    /// [`crate::PrefillAgent::start`] there.
    pub fn start(config: AgentConfig, listen: &str, memory: KvMemory) -> Result<Self, Error> {
        refuse_in_runtime("kvxfer::blocking::PrefillAgent::start", "kvxfer::PrefillAgent::start(..).await")?;
        let runtime = crate::runtime::build(&config.agent_name, config.worker_threads)?;
        let agent = crate::PrefillAgent::start_blocking(runtime.handle().clone(), config, listen, memory)?;
        Ok(PrefillAgent { agent: Some(agent), runtime: Some(runtime) })
    }

    /// The async agent this one wraps.
    pub fn as_async(&self) -> &crate::PrefillAgent {
        // Present until drop.
        self.agent.as_ref().unwrap_or_else(|| unreachable!("the agent lives until drop"))
    }

    /// See [`crate::PrefillAgent::advertised_host`].
    pub fn advertised_host(&self) -> &str {
        self.as_async().advertised_host()
    }

    /// See [`crate::PrefillAgent::incarnation`].
    pub fn incarnation(&self) -> u64 {
        self.as_async().incarnation()
    }

    /// See [`crate::PrefillAgent::drain`].
    pub fn drain(&self) {
        self.as_async().drain();
    }

    /// See [`crate::PrefillAgent::undrain`].
    pub fn undrain(&self) {
        self.as_async().undrain();
    }

    /// See [`crate::PrefillAgent::is_draining`].
    pub fn is_draining(&self) -> bool {
        self.as_async().is_draining()
    }

    /// See [`crate::PrefillAgent::local_addr`].
    pub fn local_addr(&self) -> SocketAddr {
        self.as_async().local_addr()
    }

    /// See [`crate::PrefillAgent::offers_ucx`].
    pub fn offers_ucx(&self) -> bool {
        self.as_async().offers_ucx()
    }

    /// See [`crate::PrefillAgent::memory`].
    pub fn memory(&self) -> &Arc<KvMemory> {
        self.as_async().memory()
    }

    /// See [`crate::PrefillAgent::lease`].
    pub fn lease(&self, req: LeaseRequest) -> Result<ChildHandoff, Error> {
        self.as_async().lease(req)
    }

    /// See [`crate::PrefillAgent::arm`].
    pub fn arm(
        &self,
        remote_request_id: &str,
        req: LeaseRequest,
        token: kvxfer_core::LeaseToken,
    ) -> Result<ChildHandoff, Error> {
        self.as_async().arm(remote_request_id, req, token)
    }

    /// See [`crate::PrefillAgent::lease_parent`].
    pub fn lease_parent(
        &self,
        parent: &str,
        blocks: Vec<Vec<BlockId>>,
        expected_consumers: u32,
        ttl: Option<Duration>,
    ) -> Result<PrefillResult, Error> {
        self.as_async().lease_parent(parent, blocks, expected_consumers, ttl)
    }

    /// See [`crate::PrefillAgent::cancel`].
    pub fn cancel(&self, h: &ChildHandoff) -> CancelOutcome {
        self.as_async().cancel(h)
    }

    /// See [`crate::PrefillAgent::events`].
    pub fn events(&self) -> &Receiver<LeaseEnd> {
        self.as_async().events()
    }

    /// See [`crate::PrefillAgent::lease_ends`].
    pub fn lease_ends(&self) -> LeaseEnds {
        self.as_async().lease_ends()
    }

    /// See [`crate::PrefillAgent::parent_status`].
    pub fn parent_status(&self, parent: &str) -> Option<ParentStatus> {
        self.as_async().parent_status(parent)
    }

    /// See [`crate::PrefillAgent::stats`].
    pub fn stats(&self) -> PrefillStats {
        self.as_async().stats()
    }

    /// See [`crate::PrefillAgent::registration_status`].
    #[cfg(feature = "cluster")]
    pub fn registration_status(&self) -> Option<crate::cluster::EtcdStatus> {
        self.as_async().registration_status()
    }

    /// See [`crate::PrefillAgent::wait_registered`]; blocks the calling thread.
    #[cfg(feature = "cluster")]
    pub fn wait_registered(
        &self,
        timeout: Duration,
    ) -> Result<crate::cluster::EtcdStatus, Option<crate::cluster::EtcdStatus>> {
        match &self.runtime {
            Some(rt) if !in_runtime() => wait(rt.handle(), self.as_async().wait_registered(timeout)),
            // Inside a runtime it cannot wait: it says where the registration stands now.
            _ => {
                let now = self.registration_status();
                now.clone().filter(|s| s.state == crate::cluster::EtcdState::Connected).ok_or(now)
            }
        }
    }

    /// See [`crate::PrefillAgent::metrics_addr`].
    #[cfg(feature = "cluster")]
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.as_async().metrics_addr()
    }

    /// Shuts the agent down gracefully (see [`crate::PrefillAgent::shutdown`]) and waits
    /// for it, and for the teardown of its UCX objects on a thread of their own (bounded by
    /// 10 s), so the process may exit as soon as this returns. Inside a tokio runtime it
    /// only starts the shutdown (and returns at once).
    pub fn shutdown(&self) {
        if let (Some(agent), Some(rt)) = (&self.agent, &self.runtime) {
            if in_runtime() {
                rt.handle().spawn(agent.shutdown_task());
            } else {
                wait(rt.handle(), agent.shutdown());
                if !crate::runtime::wait_for_teardown(Duration::from_secs(10)) {
                    tracing::warn!("a UCX teardown still runs 10 s after the shutdown; exiting now may crash in UCX's exit handlers");
                }
            }
        }
    }
}

impl Drop for PrefillAgent {
    fn drop(&mut self) {
        tear_down(self.agent.take(), self.runtime.take(), |agent, handle| wait(handle, agent.shutdown()));
    }
}

/// Drops a blocking agent: its graceful shutdown runs to its end (bounded by the agent's
/// own limits), then its runtime stops, then the teardowns it left to threads of their own
/// (UCX objects) are waited for (bounded by 10 s), so a host that exits right after the drop
/// does not run UCX's exit handlers under a worker still being destroyed. Inside a tokio
/// runtime, where that must not block, all of it runs on a short-lived `kvxfer-teardown`
/// thread.
fn tear_down<A: Send + 'static>(agent: Option<A>, runtime: Option<AgentRuntime>, shutdown: fn(&A, &Handle)) {
    let finish = move |agent: Option<A>, runtime: Option<AgentRuntime>| {
        // On a current-thread runtime's own driver (only when no teardown thread could
        // start) nothing could drive the graceful shutdown: the runtime's stop cuts it.
        if let (Some(a), Some(rt)) = (&agent, &runtime) {
            if !rt.on_driver() {
                shutdown(a, rt.handle());
            }
        }
        drop(agent);
        if let Some(rt) = runtime {
            crate::runtime::shutdown(rt);
        }
    };
    if in_runtime() {
        crate::runtime::spawn_teardown(move || finish(agent, runtime));
    } else {
        finish(agent, runtime);
        crate::runtime::wait_for_teardown(Duration::from_secs(10));
    }
}

/// A decode worker's agent with its own runtime (see [`crate::DecodeAgent`]).
#[derive(Debug)]
pub struct DecodeAgent {
    agent: Option<crate::DecodeAgent>,
    runtime: Option<AgentRuntime>,
}

impl DecodeAgent {
    /// Starts an agent that pulls into `memory`. Refused inside a tokio runtime
    /// ([`Error::InsideRuntime`]): use [`crate::DecodeAgent::start`] there.
    pub fn start(config: AgentConfig, memory: KvMemory) -> Result<Self, Error> {
        refuse_in_runtime("kvxfer::blocking::DecodeAgent::start", "kvxfer::DecodeAgent::start(..).await")?;
        let runtime = crate::runtime::build(&config.agent_name, config.worker_threads)?;
        let agent = crate::DecodeAgent::start_blocking(runtime.handle().clone(), config, memory)?;
        Ok(DecodeAgent { agent: Some(agent), runtime: Some(runtime) })
    }

    /// The async agent this one wraps.
    pub fn as_async(&self) -> &crate::DecodeAgent {
        self.agent.as_ref().unwrap_or_else(|| unreachable!("the agent lives until drop"))
    }

    fn handle(&self) -> Handle {
        match &self.runtime {
            Some(rt) => rt.handle().clone(),
            None => unreachable!("the runtime lives until drop"),
        }
    }

    /// See [`crate::DecodeAgent::memory`].
    pub fn memory(&self) -> &Arc<KvMemory> {
        self.as_async().memory()
    }

    /// See [`crate::DecodeAgent::consumer_id`].
    pub fn consumer_id(&self) -> &str {
        self.as_async().consumer_id()
    }

    /// See [`crate::DecodeAgent::reclaimed`].
    pub fn reclaimed(&self) -> &Receiver<Reclaimed> {
        self.as_async().reclaimed()
    }

    /// See [`crate::DecodeAgent::submit`].
    pub fn submit(
        &self,
        result: PrefillResult,
        local_blocks: Vec<Vec<BlockId>>,
    ) -> Result<PullHandle, Error> {
        let h = self.as_async().submit(result, local_blocks)?;
        Ok(PullHandle::new(h, self.handle()))
    }

    /// See [`crate::DecodeAgent::submit_subset`].
    pub fn submit_subset(
        &self,
        result: &PrefillResult,
        selection: Vec<(u32, Vec<BlockId>)>,
    ) -> Result<PullHandle, Error> {
        let h = self.as_async().submit_subset(result, selection)?;
        Ok(PullHandle::new(h, self.handle()))
    }

    /// See [`crate::DecodeAgent::submit_groups`].
    pub fn submit_groups(
        &self,
        result: PrefillResult,
        local_blocks: Vec<Vec<Vec<BlockId>>>,
    ) -> Result<PullHandle, Error> {
        let h = self.as_async().submit_groups(result, local_blocks)?;
        Ok(PullHandle::new(h, self.handle()))
    }

    /// See [`crate::DecodeAgent::submit_ranks`].
    pub fn submit_ranks(
        &self,
        results: Vec<PrefillResult>,
        local_blocks: Vec<Vec<Vec<BlockId>>>,
    ) -> Result<PullHandle, Error> {
        let h = self.as_async().submit_ranks(results, local_blocks)?;
        Ok(PullHandle::new(h, self.handle()))
    }

    /// Releases a child's lease without pulling it; see [`crate::DecodeAgent::release`].
    pub fn release(&self, child: &ChildHandoff) -> bool {
        wait(&self.handle(), self.as_async().release(child))
    }

    /// See [`crate::DecodeAgent::submit_wire`].
    pub fn submit_wire(
        &self,
        result: v1::PrefillResult,
        local_blocks: Vec<Vec<BlockId>>,
    ) -> Result<PullHandle, Error> {
        let h = self.as_async().submit_wire(result, local_blocks)?;
        Ok(PullHandle::new(h, self.handle()))
    }

    /// See [`crate::DecodeAgent::directory`].
    #[cfg(feature = "cluster")]
    pub fn directory(&self) -> Option<&Arc<crate::cluster::EngineDirectory>> {
        self.as_async().directory()
    }

    /// See [`crate::DecodeAgent::metrics_addr`].
    #[cfg(feature = "cluster")]
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.as_async().metrics_addr()
    }

    /// See [`crate::DecodeAgent::stats`].
    pub fn stats(&self) -> DecodeStats {
        self.as_async().stats()
    }

    /// Shuts the agent down gracefully (see [`crate::DecodeAgent::shutdown`]) and waits for
    /// it. Inside a tokio runtime it only starts the shutdown (and returns at once). The
    /// agent's UCX initiator lives on until the agent is dropped (the drop waits for its
    /// teardown): drop the agent, not only shut it down, before the process exits.
    pub fn shutdown(&self) {
        let Some(agent) = &self.agent else { return };
        if in_runtime() {
            agent.begin_shutdown_detached();
        } else {
            wait(&self.handle(), agent.shutdown());
        }
    }
}

impl Drop for DecodeAgent {
    fn drop(&mut self) {
        tear_down(self.agent.take(), self.runtime.take(), |agent, handle| wait(handle, agent.shutdown()));
    }
}

/// A pull under way on a blocking agent: receive its reports, or cancel children.
pub struct PullHandle {
    inner: Mutex<crate::PullHandle>,
    canceller: PullCanceller,
    count: usize,
    handle: Handle,
}

impl std::fmt::Debug for PullHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullHandle").field("children", &self.count).finish_non_exhaustive()
    }
}

impl PullHandle {
    fn new(inner: crate::PullHandle, handle: Handle) -> Self {
        PullHandle { canceller: inner.canceller(), count: inner.children(), inner: Mutex::new(inner), handle }
    }

    /// The decode side drops child `index` (see [`crate::PullCanceller::cancel_child`]).
    pub fn cancel_child(&self, index: u32) {
        self.canceller.cancel_child(index);
    }

    /// A canceller that outlives this handle.
    pub fn canceller(&self) -> PullCanceller {
        self.canceller.clone()
    }

    /// Children this pull covers.
    pub fn children(&self) -> usize {
        self.count
    }

    /// The next child report, as children finish; `None` after `timeout`, or once every
    /// child has reported.
    pub fn next_report(&self, timeout: Duration) -> Option<ChildReport> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let _enter = self.handle.enter();
        let deadline = tokio::time::Instant::from_std(crate::runtime::instant_after(Instant::now(), timeout));
        futures::executor::block_on(tokio::time::timeout_at(deadline, inner.next())).ok().flatten()
    }

    /// Waits for every child's report.
    pub fn wait(self) -> PullReport {
        self.wait_timed().0
    }

    /// Waits for every child's report, and says when each one reached this caller (same
    /// order as `PullReport::children`; those not taken with [`Self::next_report`] before,
    /// when the whole pull ended — `ChildReport::completed_at` says when each child ended in
    /// the agent): for hand-off latency figures.
    pub fn wait_timed(self) -> (PullReport, Vec<Instant>) {
        let inner = self.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        wait(&self.handle, inner.finished_timed())
    }
}
