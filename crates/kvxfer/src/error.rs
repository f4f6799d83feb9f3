//! The engine's error type.

use kvxfer_core::{BlockId, HandoffError, PlanError};

/// Any error of the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// From the sans-IO core (leases, hand-offs, layouts, plans, params).
    #[error(transparent)]
    Core(#[from] kvxfer_core::Error),
    /// From registered memory.
    #[error(transparent)]
    Mem(#[from] kvxfer_mem::MemError),
    /// From a connection to a peer.
    #[error(transparent)]
    Transport(#[from] kvxfer_tcp::ClientError),
    /// A pull was refused before any I/O.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The UCX data path could not start.
    #[cfg(feature = "ucx")]
    #[error(transparent)]
    Ucx(#[from] kvxfer_ucx::UcxError),
    /// Discovery or metrics could not start (a name etcd keys cannot hold, a bad address,
    /// a registration TTL out of range, the metrics address not bindable).
    #[cfg(feature = "cluster")]
    #[error(transparent)]
    Cluster(#[from] kvxfer_cluster::Error),
    /// A cluster key was configured but could not be loaded.
    #[error(transparent)]
    Key(#[from] kvxfer_tcp::KeyError),
    /// Something this build or machine cannot do (e.g. UCX requested without the `ucx` feature).
    #[error("{0}")]
    Unsupported(String),
    /// A blocking call ([`crate::blocking`]) was made from inside a tokio runtime, where it
    /// would stall the runtime's thread: use the async agent there.
    #[error(
        "{call} was called from inside a tokio runtime, where blocking would stall it; use {instead} there"
    )]
    InsideRuntime {
        /// The blocking call.
        call: &'static str,
        /// The async call to use instead.
        instead: &'static str,
    },
    /// `AgentConfig::kv_shape` does not describe the registered memory (or is itself
    /// inconsistent).
    #[error("the configured KV-cache shape does not fit the memory: {0}")]
    ShapeMismatch(String),
    /// The prefill agent is draining ([`crate::PrefillAgent::drain`], or the engine's etcd
    /// drain key): it makes no new leases, while the ones it made are still pulled and end
    /// as usual. Send the request to another engine.
    #[error(
        "engine {engine_id} is draining: it takes no new hand-offs (its existing leases are still \
         pulled); prefill this request on another engine"
    )]
    Draining {
        /// The engine id.
        engine_id: String,
    },
    /// Binding the listener or starting the runtime failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl From<kvxfer_core::LeaseError> for Error {
    fn from(e: kvxfer_core::LeaseError) -> Self {
        Error::Core(e.into())
    }
}

impl From<HandoffError> for Error {
    fn from(e: HandoffError) -> Self {
        Error::Core(e.into())
    }
}

/// Why [`crate::DecodeAgent::submit`] refused a pull, before any I/O.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The prefill result is not exactly the children `0..n` (names what is missing).
    #[error("{0} (kind=incomplete_result)")]
    Result(#[from] HandoffError),
    /// Not one list of local blocks per child.
    #[error("prefill result for {parent} has {n} children but {given} lists of local blocks were given (kind=local_block_lists)")]
    LocalBlockLists {
        /// The parent request id.
        parent: String,
        /// Children.
        n: u32,
        /// Lists given.
        given: usize,
    },
    /// A selected child index is not below n, or is selected twice.
    #[error("prefill result for {parent} with n = {n}: child {index} is out of range or selected twice (kind=bad_child)")]
    BadChild {
        /// The parent request id.
        parent: String,
        /// Children.
        n: u32,
        /// The index.
        index: u32,
    },
    /// No child selected.
    #[error("prefill result for {parent}: no child selected (kind=nothing_selected)")]
    NothingSelected {
        /// The parent request id.
        parent: String,
    },
    /// A child's local blocks do not fit the plan (count, layout, conflicting destinations).
    #[error("prefill result for {parent}: {source} (kind=plan)")]
    Plan {
        /// The parent request id.
        parent: String,
        /// What is wrong.
        #[source]
        source: PlanError,
    },
    /// The results do not fit together (the per-rank results of
    /// [`crate::DecodeAgent::submit_ranks`], or this agent has no KV-cache shape for them, or
    /// the KV-cache groups' blocks cannot be numbered with block ids).
    #[error("prefill results for {parent}: {detail} (kind=unfit)")]
    Unfit {
        /// The parent request id.
        parent: String,
        /// What is wrong.
        detail: String,
    },
    /// A hand-off, or the local block lists given for it, do not name one block list per
    /// KV-cache group of this agent's memory.
    #[error(
        "prefill result for {parent}: child {child} lists {handoff} KV-cache group(s) and {given} local list(s) \
         were given; this agent's memory has {local} group(s) (kind=group_count)"
    )]
    GroupCount {
        /// The parent request id.
        parent: String,
        /// The child index.
        child: u32,
        /// Groups the hand-off lists.
        handoff: usize,
        /// Local block lists given for it.
        given: usize,
        /// Groups of the local memory.
        local: usize,
    },
    /// The children do not all come from one prefill engine.
    #[error("prefill result for {parent}: children come from several engines ({engines:?}); submit one result per engine (kind=mixed_engines)")]
    MixedEngines {
        /// The parent request id.
        parent: String,
        /// The engines named.
        engines: Vec<String>,
    },
    /// The agent is shutting down and takes no new pulls.
    #[error("prefill result for {parent}: the decode agent is shutting down (kind=shutting_down)")]
    ShuttingDown {
        /// The parent request id.
        parent: String,
    },
    /// A hand-off names only the engine id (no host or port), and this agent runs no
    /// discovery to resolve it (`AgentConfig::cluster`, the `cluster` feature).
    #[error(
        "prefill result for {parent}: the hand-offs name only engine {engine} (no host or port), and this \
         decode agent runs no discovery to resolve it (kind=no_address)"
    )]
    NoAddress {
        /// The parent request id.
        parent: String,
        /// The engine id named.
        engine: String,
    },
    /// Local blocks already being written by another pull.
    #[error(
        "prefill result for {parent}: local blocks {blocks:?} are destinations of a pull still under way (kind=local_blocks_busy)"
    )]
    LocalBlocksBusy {
        /// The parent request id.
        parent: String,
        /// The busy blocks (at most 16).
        blocks: Vec<BlockId>,
    },
}

impl SubmitError {
    /// The snake-case name of the variant (`local_blocks_busy`, ...): the `kind` its message
    /// ends with and the Python binding's `SubmitError` carries.
    pub fn kind(&self) -> &'static str {
        match self {
            SubmitError::Result(_) => "incomplete_result",
            SubmitError::LocalBlockLists { .. } => "local_block_lists",
            SubmitError::BadChild { .. } => "bad_child",
            SubmitError::NothingSelected { .. } => "nothing_selected",
            SubmitError::Plan { .. } => "plan",
            SubmitError::Unfit { .. } => "unfit",
            SubmitError::GroupCount { .. } => "group_count",
            SubmitError::MixedEngines { .. } => "mixed_engines",
            SubmitError::ShuttingDown { .. } => "shutting_down",
            SubmitError::NoAddress { .. } => "no_address",
            SubmitError::LocalBlocksBusy { .. } => "local_blocks_busy",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One submit error of every kind (`kind()`'s match fails to compile when one is added).
    fn one_of_each() -> Vec<SubmitError> {
        let parent = || "cmpl-1".to_owned();
        vec![
            SubmitError::Result(HandoffError::MissingField("remote_host")),
            SubmitError::LocalBlockLists { parent: parent(), n: 2, given: 1 },
            SubmitError::BadChild { parent: parent(), n: 2, index: 2 },
            SubmitError::NothingSelected { parent: parent() },
            SubmitError::Plan { parent: parent(), source: PlanError::LengthMismatch { remote: 2, local: 1 } },
            SubmitError::Unfit { parent: parent(), detail: "no KV-cache shape".into() },
            SubmitError::GroupCount { parent: parent(), child: 0, handoff: 2, given: 1, local: 2 },
            SubmitError::MixedEngines { parent: parent(), engines: vec!["a".into(), "b".into()] },
            SubmitError::ShuttingDown { parent: parent() },
            SubmitError::NoAddress { parent: parent(), engine: "e".into() },
            SubmitError::LocalBlocksBusy { parent: parent(), blocks: vec![3] },
        ]
    }

    #[test]
    fn every_submit_error_names_its_kind_and_the_troubleshooting_guide_has_it() {
        let guide = include_str!("../../../docs/src/guides/troubleshooting.md");
        let all = one_of_each();
        let kinds: std::collections::HashSet<_> = all.iter().map(SubmitError::kind).collect();
        assert_eq!(kinds.len(), all.len(), "one example per kind");
        for e in &all {
            let tag = format!("(kind={})", e.kind());
            assert!(e.to_string().ends_with(&tag), "{e}");
            assert!(guide.contains(&format!("`{tag}`")), "troubleshooting.md does not list {tag}");
        }
    }
}
