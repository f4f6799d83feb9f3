//! The handshake both agents build: a decode agent's `Hello`, a prefill agent's `HelloAck`
//! (identity, layout — every KV-cache group's — compatibility hash over all of them, and the
//! transports offered), and the warning an
//! agent without a cluster key logs once.

use kvxfer_core::groups_compat_hash;
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1;

use crate::AgentConfig;

/// The TCP offer every agent makes in its handshake.
pub(crate) fn tcp_offer() -> v1::TransportOffer {
    v1::TransportOffer { transport: v1::Transport::Tcp as i32, connection_info: vec![] }
}

/// A decode agent's UCX offer: it only reads, so it carries no connection info.
#[cfg(feature = "ucx")]
pub(crate) fn ucx_reader_offer() -> v1::TransportOffer {
    v1::TransportOffer { transport: v1::Transport::Ucx as i32, connection_info: vec![] }
}

/// The `Hello` a decode agent sends (nonce and `authenticated` are set per connection by
/// the handshake).
pub(crate) fn hello(
    config: &AgentConfig,
    memory: &KvMemory,
    transports: Vec<v1::TransportOffer>,
) -> v1::Hello {
    v1::Hello {
        protocol_version: config.protocol_version,
        engine_id: config.engine_id.clone(),
        agent_name: config.agent_name.clone(),
        compat_hash: groups_compat_hash(memory.group_layouts()),
        layout: Some(memory.layout().to_wire()),
        other_group_layouts: memory.group_layouts().skip(1).map(|l| l.to_wire()).collect(),
        kv_shape: None,
        transports,
        nonce: Vec::new(),
        authenticated: false,
        control_only: false,
    }
}

/// The `HelloAck` a prefill agent answers a compatible hello with (`authenticated` is set
/// per connection).
pub(crate) fn hello_ack(
    config: &AgentConfig,
    memory: &KvMemory,
    transports: Vec<v1::TransportOffer>,
    incarnation: u64,
) -> v1::HelloAck {
    v1::HelloAck {
        protocol_version: config.protocol_version,
        engine_id: config.engine_id.clone(),
        agent_name: config.agent_name.clone(),
        compat_hash: groups_compat_hash(memory.group_layouts()),
        layout: Some(memory.layout().to_wire()),
        other_group_layouts: memory.group_layouts().skip(1).map(|l| l.to_wire()).collect(),
        kv_shape: None,
        transports,
        incarnation,
        authenticated: false,
    }
}

/// Logs, once per agent, that it runs without a cluster key.
pub(crate) fn warn_unauthenticated(role: &str, agent: &str) {
    tracing::warn!(
        agent,
        "{role} agent has no cluster key: peers are not authenticated (any peer that can connect \
         may handshake, and over UCX read whole registered regions); set {} or {}",
        crate::CLUSTER_KEY_ENV,
        crate::CLUSTER_KEY_FILE_ENV
    );
}
