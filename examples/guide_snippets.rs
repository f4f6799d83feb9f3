//! The Rust code the book's guides show (docs/src/guides/*.md include the regions between
//! `ANCHOR` lines), here so that it compiles with the tests (`cargo test` builds examples):
//! a guide's code cannot drift from the API. Nothing here listens or runs: `main` does
//! nothing; the functions take what the guides leave to the reader as parameters.

#![allow(dead_code, clippy::too_many_arguments)]

use kvxfer::*;

/// The embedding guide: both halves on the async API.
async fn async_api(
    num_blocks: u32,
    block_bytes: u64,
    blocks_per_child: Vec<Vec<BlockId>>,
    decode_memory: KvMemory,
    local_blocks_per_child: Vec<Vec<BlockId>>,
    aborted_child: ChildHandoff,
) -> Result<(), Box<dyn std::error::Error>> {
    // ANCHOR: async_api
    use futures::StreamExt;
    use kvxfer::*;

    // Prefill worker: register the KV cache (here owned; `Region::borrowed` wraps engine memory).
    let prefill = PrefillAgent::start(
        AgentConfig::new("prefill-0"),
        "0.0.0.0:5559",
        KvMemory::alloc(BlockLayout::single(num_blocks, block_bytes)?)?,
    )
    .await?;
    let result = prefill.lease_parent("cmpl-123", blocks_per_child, /*expected_consumers*/ 1, None)?;
    // ... send result.to_wire() (or one KvTransferParams per child) to the decode worker ...
    // A Stream of lease ends: Pulled / Released / Expired (or prefill.events(): the same
    // ends on a crossbeam receiver).
    let mut ends = prefill.lease_ends();

    // Decode worker:
    let decode = DecodeAgent::start(AgentConfig::new("decode-0"), decode_memory).await?;
    let mut pull = decode.submit(result, local_blocks_per_child)?;
    // Per-child reports, as children finish:
    while let Some(child) = pull.next().await {
        if let ChildOutcome::Failed { error, .. } = &child.outcome {
            match error.advice() {
                Advice::RetryFreshHandoff => { /* prefill again */ }
                Advice::Recompute => { /* compute locally */ }
                _ => { /* fail the request */ }
            }
        }
    }
    // A request aborted before its pull (vLLM aborts requests still in the decode queue):
    // release its child's lease (a `ChildHandoff`) instead of pulling it; `submit_subset`
    // pulls only the children you keep.
    let released: bool = decode.release(&aborted_child).await;
    // (`pull.cancel_child(i)` drops a child mid-pull; a cancel that loses the race to the
    // child's completion is reported Done.)
    decode.shutdown().await; // graceful; dropping never blocks either
    prefill.shutdown().await;
    // With UCX, before the process exits: drop the agents, then let their UCX objects finish
    // tearing down on threads of their own (the wait blocks: off the runtime's threads).
    drop((decode, prefill));
    tokio::task::spawn_blocking(|| kvxfer::wait_for_teardown(std::time::Duration::from_secs(10))).await?;
    // ANCHOR_END: async_api
    let _ = (ends.next().await, released);
    Ok(())
}

/// The embedding guide: the blocking facade.
fn blocking_api(
    memory: KvMemory,
    blocks_per_child: Vec<Vec<BlockId>>,
    decode_memory: KvMemory,
    local_blocks_per_child: Vec<Vec<BlockId>>,
) -> Result<(), Box<dyn std::error::Error>> {
    // ANCHOR: blocking_api
    use kvxfer::blocking::{DecodeAgent, PrefillAgent};

    let prefill = PrefillAgent::start(AgentConfig::new("prefill-0"), "0.0.0.0:5559", memory)?;
    let result = prefill.lease_parent("cmpl-123", blocks_per_child, 1, None)?;
    for end in prefill.events().try_iter() {
        /* free end.blocks: Pulled, Released or Expired */
        let _ = end;
    }
    let decode = DecodeAgent::start(AgentConfig::new("decode-0"), decode_memory)?;
    let report = decode.submit(result, local_blocks_per_child)?.wait();
    // ANCHOR_END: blocking_api
    let _ = report;
    Ok(())
}

/// The embedding guide: shutting down on SIGTERM and SIGINT.
async fn on_signals(
    prefill: PrefillAgent,
    decode: DecodeAgent,
    serve_requests: impl AsyncFn(&PrefillAgent),
) -> std::io::Result<()> {
    // ANCHOR: on_signals
    use tokio::signal::unix::{signal, SignalKind};

    let mut term = signal(SignalKind::terminate())?; // tokio's `signal` feature
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        _ = serve_requests(&prefill) => {}             // your work
    }
    prefill.shutdown().await; // deregisters, then stops serving
    decode.shutdown().await;
    drop((prefill, decode)); // with UCX: then wait for their teardown before exiting
    let _ =
        tokio::task::spawn_blocking(|| kvxfer::wait_for_teardown(std::time::Duration::from_secs(10))).await;
    // ANCHOR_END: on_signals
    Ok(())
}

/// The security guide: the cluster key from the environment.
fn cluster_key() -> Result<AgentConfig, Box<dyn std::error::Error>> {
    // ANCHOR: cluster_key
    let config = AgentConfig::new("prefill-0").cluster_key_from_env()?; // or .cluster_key(ClusterKey::from_hex(..)?)
                                                                        // ANCHOR_END: cluster_key
    Ok(config)
}

/// The cluster guide: etcd discovery and metrics.
#[cfg(feature = "cluster")]
fn cluster() -> AgentConfig {
    use std::sync::Arc;
    use std::time::Duration;
    // ANCHOR: cluster
    use kvxfer::cluster::{DiscoveryConfig, Metrics};

    let metrics = Arc::new(Metrics::new()); // one registry per process
    let config = AgentConfig::new("prefill-0")
        .engine_id("prefill-a")
        .rank(0) // the etcd key's engine id and rank
        .discovery(
            DiscoveryConfig::new(
                ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"], // every member
                "my-deployment",
            )
            .registration_ttl(Duration::from_secs(10)), // see "Choosing the TTL"
        )
        .metrics(metrics.clone()) // feed the registry ...
        .metrics_listen("0.0.0.0:9464"); // ... and serve it at GET /metrics
                                         // ANCHOR_END: cluster
    config
}

/// The cluster guide: etcd over TLS with authentication, settings from the environment.
#[cfg(feature = "cluster")]
fn cluster_secure() -> Result<AgentConfig, Box<dyn std::error::Error>> {
    // ANCHOR: etcd_security
    use kvxfer::cluster::DiscoveryConfig;

    let mut discovery = DiscoveryConfig::new(["https://10.0.0.1:2379"], "prod");
    discovery.etcd = discovery.etcd.security_from_env()?; // KVXFER_ETCD_CA, _CERT, _KEY, _USER, _PASSWORD_FILE
    let config = AgentConfig::new("prefill-0").engine_id("prefill-a").rank(0).discovery(discovery);
    // ANCHOR_END: etcd_security
    Ok(config)
}

fn main() {}
