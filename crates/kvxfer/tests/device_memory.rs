//! Device memory (a CUDA KV cache, `Region::borrowed_device`) on a machine without a GPU:
//! host memory flagged as device memory, so the CPU-side logic is what is tested — every
//! path that would read or write its bytes on the CPU (TCP reads, CRCs, local copies) is
//! refused with an error, and UCX moves every byte. A CPU access that slipped through would
//! hit kvxfer-mem's guard (a panic) and fail the test. What UCX's CUDA transports do with
//! real device memory is `scripts/gpu-check.sh`'s to show.

mod support;

use std::ptr::NonNull;
use std::sync::Arc;

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{AgentConfig, BlockLayout, Error, KvMemory, Region, TransportChoice};
use kvxfer_mem::pattern;
use support::*;

const BLOCKS: u32 = 16;

/// `host` seen as device memory: one region over its bytes, keeping `host` alive.
fn as_device(host: &Arc<KvMemory>) -> KvMemory {
    let layout = host.layout().clone();
    let r = &host.regions()[0];
    let ptr = NonNull::new(r.as_ptr()).expect("non-null");
    // SAFETY: the region keeps `host` (which owns the bytes) alive; nothing but UCX touches
    // the bytes through it (the accessors of a device region refuse the CPU).
    let region = unsafe { Region::borrowed_device(ptr, r.len(), Some(Box::new(host.clone()))) };
    KvMemory::new(layout, vec![region]).expect("device memory")
}

fn layout() -> BlockLayout {
    BlockLayout::single(BLOCKS, BLOCK).expect("layout")
}

fn refused(r: Result<impl Sized, Error>, what: &str) -> String {
    match r {
        Ok(_) => panic!("{what}: started over device memory"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn options_that_read_device_memory_on_the_cpu_are_refused_at_start() {
    let host = Arc::new(pattern::alloc_filled(layout()).expect("memory"));
    let tcp = AgentConfig::new("p").transport(TransportChoice::Tcp);
    let msg = refused(PrefillAgent::start(tcp.clone(), "127.0.0.1:0", as_device(&host)), "tcp prefill");
    assert!(msg.contains("device memory"), "{msg}");
    let msg = refused(DecodeAgent::start(tcp, as_device(&host)), "tcp decode");
    assert!(msg.contains("device memory"), "{msg}");
    let mut crcs = AgentConfig::new("p");
    crcs.precompute_crcs = true;
    let msg = refused(PrefillAgent::start(crcs, "127.0.0.1:0", as_device(&host)), "precomputed CRCs");
    assert!(msg.contains("device memory") && msg.contains("precompute_crcs"), "{msg}");
    #[cfg(feature = "ucx")]
    {
        let mut verify = AgentConfig::new("p");
        verify.ucx.verify_payloads = true;
        let msg = refused(PrefillAgent::start(verify, "127.0.0.1:0", as_device(&host)), "verified payloads");
        assert!(msg.contains("verify_payloads"), "{msg}");
    }
    #[cfg(not(feature = "ucx"))]
    {
        let msg =
            refused(PrefillAgent::start(AgentConfig::new("p"), "127.0.0.1:0", as_device(&host)), "no UCX");
        assert!(msg.contains("built without"), "{msg}");
    }
}

#[cfg(feature = "ucx")]
mod over_ucx {
    use std::time::Duration;

    use super::*;
    use kvxfer::{ChildOutcome, PullError};

    fn shm(config: AgentConfig) -> AgentConfig {
        let mut c = config.transport(TransportChoice::Auto);
        c.ucx = kvxfer::UcxConfig {
            tls: Some("posix,sysv,cma,self".into()),
            peer_failure_handling: false,
            same_host_shared_memory: true,
            verify_payloads: false,
        };
        keyed(c.io_timeout(Duration::from_secs(5)))
    }

    /// Two children share remote block 1 but land it in different local blocks: on host
    /// memory one read and a CPU copy; on device memory two reads, no copy.
    #[test]
    fn siblings_sharing_a_block_are_pulled_over_ucx_with_no_cpu_copy() {
        init_tracing();
        let src = Arc::new(pattern::alloc_filled(layout()).expect("memory"));
        let dst = Arc::new(KvMemory::alloc(layout()).expect("memory"));
        let prefill =
            PrefillAgent::start(shm(AgentConfig::new("p")), "127.0.0.1:0", as_device(&src)).expect("p");
        let decode = DecodeAgent::start(shm(AgentConfig::new("d")), as_device(&dst)).expect("d");
        assert!(prefill.offers_ucx());
        let remote = [vec![1, 2], vec![1, 3]];
        let local = vec![vec![10, 11], vec![12, 13]];
        let result = prefill.lease_parent("D", remote.to_vec(), 1, None).expect("lease");
        let report = decode.submit(result, local.clone()).expect("submit").wait();
        assert!(report.all_done(), "{report:?}");
        for c in &report.children {
            let path = c.path.as_ref().expect("a path").to_string();
            assert!(path.starts_with("ucx"), "{path}");
        }
        for i in 0..2 {
            // SAFETY: the pull has reported; `dst` is host memory behind the device flag.
            let bad = unsafe { pattern::check_blocks(&dst, &remote[i], &local[i]) }.expect("in layout");
            assert!(bad.is_none(), "child {i}: {bad:?}");
        }
        // Four blocks crossed (block 1 twice), none over TCP.
        let d = decode.stats();
        assert_eq!((d.bytes_pulled_ucx, d.bytes_pulled_tcp), (4 * BLOCK, 0));
        let ends = wait_ends(&prefill, 2, Duration::from_secs(10));
        assert!(ends.iter().all(|e| e.kind == kvxfer::EndKind::Pulled), "{ends:?}");
    }

    #[test]
    fn a_tcp_read_of_device_memory_is_refused_and_a_device_decode_needs_ucx() {
        init_tracing();
        let src = Arc::new(pattern::alloc_filled(layout()).expect("memory"));
        let prefill =
            PrefillAgent::start(shm(AgentConfig::new("p")), "127.0.0.1:0", as_device(&src)).expect("p");
        // A host-memory decode on TCP: the prefill answers its read with an error.
        let tcp =
            keyed(AgentConfig::new("d").transport(TransportChoice::Tcp).io_timeout(Duration::from_secs(5)));
        let decode = DecodeAgent::start(tcp, KvMemory::alloc(layout()).expect("memory")).expect("d");
        let result = prefill.lease_parent("T", vec![vec![4]], 1, None).expect("lease");
        let report = decode.submit(result, vec![vec![5]]).expect("submit").wait();
        match &report.children[0].outcome {
            ChildOutcome::Failed { error, .. } => {
                assert!(error.to_string().contains("device memory"), "{error}")
            }
            other => panic!("a TCP read of device memory was not refused: {other:?}"),
        }
        // A device-memory decode (auto becomes UCX) and a prefill serving TCP only.
        let host = pattern::alloc_filled(layout()).expect("memory");
        let tcp_prefill = PrefillAgent::start(
            keyed(AgentConfig::new("p2").transport(TransportChoice::Tcp)),
            "127.0.0.1:0",
            host,
        )
        .expect("p2");
        let dst = Arc::new(KvMemory::alloc(layout()).expect("memory"));
        let device_decode = DecodeAgent::start(shm(AgentConfig::new("d2")), as_device(&dst)).expect("d2");
        let result = tcp_prefill.lease_parent("U", vec![vec![6]], 1, None).expect("lease");
        let report = device_decode.submit(result, vec![vec![7]]).expect("submit").wait();
        assert!(
            matches!(
                &report.children[0].outcome,
                ChildOutcome::Failed { error: PullError::TransportUnavailable { .. }, .. }
            ),
            "{report:?}"
        );
    }
}
