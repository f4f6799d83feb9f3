//! An agent's cluster settings (the `cluster` feature): [`ClusterConfig`] in
//! `AgentConfig::cluster` and its [`DiscoveryConfig`], re-exported by `crate::cluster`. A
//! module of their own below both `config.rs` (which holds them) and `cluster.rs` (which
//! runs them, and reads the rest of the `AgentConfig`).

use std::sync::Arc;
use std::time::Duration;

use kvxfer_cluster::{EtcdConfig, Metrics, Namespace};

use crate::error::Error;

/// The default registration TTL: a crashed prefill process's key is gone at most this long
/// after its last keep-alive, and etcd may be unreachable for up to about 8.5 s (TTL − 1.5 s:
/// a stall, a member failure, a leader election) before a live engine's key expires and
/// decode agents see it leave and return.
pub const DEFAULT_REGISTRATION_TTL: Duration = Duration::from_secs(10);

/// An agent's cluster settings ([`AgentConfig::cluster`](crate::AgentConfig)); the default
/// is everything off.
#[derive(Debug, Clone, Default)]
pub struct ClusterConfig {
    /// etcd discovery: prefill agents register, decode agents watch. `None`: off.
    pub discovery: Option<DiscoveryConfig>,
    /// The process's metrics registry the agent feeds (share one between the agents of a
    /// process). `None`: no metrics, unless `metrics_listen` is set (then the agent makes a
    /// registry of its own).
    pub metrics: Option<Arc<Metrics>>,
    /// Serve the registry at `GET /metrics` on this address (port 0 picks one; the agent's
    /// `metrics_addr()` tells which), from start until shutdown.
    pub metrics_listen: Option<String>,
}

/// Where and under which name agents meet in etcd.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// The etcd endpoints, TLS settings and credentials ([`EtcdConfig::tls`],
    /// [`EtcdConfig::auth`], or [`EtcdConfig::security_from_env`]), timeouts and retry
    /// backoff. A malformed endpoint fails the agent's start; credentials, certificates or
    /// permissions etcd refuses stop its registration or directory at the first answer
    /// (state `Failed`, the reason in `last_error`).
    pub etcd: EtcdConfig,
    /// The deployment's namespace (the first key segment; printable ASCII without `/`).
    pub namespace: String,
    /// The registration lease's TTL (whole seconds, 2 s or more): how long a crashed prefill
    /// process stays registered at most, and — less about 1.5 s — how long etcd may be
    /// unreachable before a live one's key expires and comes back (its pooled connections
    /// dropped on the decode side). Keep-alives go every TTL/3, at least every second.
    /// Default 10 s; 2 s only on one host or in tests (a 1 s etcd stall then flaps every
    /// engine). See the cluster guide's "Choosing the TTL".
    pub registration_ttl: Duration,
}

impl DiscoveryConfig {
    /// Discovery through the etcd at `endpoints` (`http://host:2379`) under `namespace`,
    /// with the default timeouts ([`EtcdConfig::new`]) and a 10 s registration TTL.
    pub fn new<S: Into<String>>(
        endpoints: impl IntoIterator<Item = S>,
        namespace: impl Into<String>,
    ) -> Self {
        Self {
            etcd: EtcdConfig::new(endpoints),
            namespace: namespace.into(),
            registration_ttl: DEFAULT_REGISTRATION_TTL,
        }
    }

    /// Sets the registration TTL.
    pub fn registration_ttl(mut self, ttl: Duration) -> Self {
        self.registration_ttl = ttl;
        self
    }

    pub(crate) fn namespace(&self) -> Result<Namespace, Error> {
        Namespace::new(&self.namespace).map_err(|e| Error::Cluster(e.into()))
    }
}
