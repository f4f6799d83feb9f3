//! The prefill side's UCX thread: maps the regions, publishes the worker address and one
//! rkey per region, and progresses until stopped.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;

use super::error::UcxError;
use super::handles::{note_emulated_regions, setup, Signal};
use crate::{RegionInfo, Span, TargetInfo, UcxConfig};

type TargetReady = Sender<Result<(TargetInfo, Signal), UcxError>>;

/// The prefill side's thread: maps the regions, publishes rkeys, progresses until stopped.
pub(crate) fn run_target(
    config: &UcxConfig,
    regions: Vec<Span>,
    keep_alive: Arc<dyn Any + Send + Sync>,
    stop: &AtomicBool,
    ready: TargetReady,
) {
    // SAFETY: the caller of `UcxTarget::start` keeps the spans valid until the target is
    // dropped; the maps are dropped in this thread before `keep_alive`.
    let (ctx, worker, maps) = match unsafe { setup(config, &regions, true) } {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    note_emulated_regions(config, &maps);
    let info = (|| -> Result<TargetInfo, UcxError> {
        Ok(TargetInfo {
            worker_address: worker.address()?,
            regions: maps
                .iter()
                .map(|m| Ok(RegionInfo { base: m.base, len: m.len, rkey: m.packed_rkey()? }))
                .collect::<Result<_, UcxError>>()?,
        })
    })();
    let signal = Signal::new(&worker);
    let ok = match info {
        Ok(info) => ready.send(Ok((info, signal.clone()))).is_ok(),
        Err(e) => {
            let _ = ready.send(Err(e));
            false
        }
    };
    while ok && !stop.load(Ordering::Acquire) {
        worker.progress_all();
        worker.wait(Duration::from_millis(100));
    }
    signal.disarm();
    drop(maps);
    drop(worker);
    drop(ctx);
    drop(keep_alive);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::{GetPiece, UcxBuffer, UcxInitiator};

    /// UCX 1.13 serves gets from memory it only registered with active messages, which the
    /// target's worker must progress; from memory it allocated ([`UcxBuffer`]) a peer on the
    /// same host copies by itself. So once connected, gets complete while the target's
    /// worker is never progressed again (with registered memory they hang: this test then
    /// fails at its hang guard).
    #[test]
    fn gets_from_ucx_allocated_memory_complete_without_the_target_progressing() {
        const LEN: usize = 1 << 20;
        let config = UcxConfig {
            tls: Some("posix,sysv,cma,self".into()),
            peer_failure_handling: false,
            ..UcxConfig::default()
        };
        let buffer = UcxBuffer::alloc(&config, LEN).expect("allocate");
        assert!(buffer.len() >= LEN);
        // SAFETY: the buffer holds LEN bytes and only this test uses it; nothing reads it
        // while this slice lives.
        let src = unsafe { std::slice::from_raw_parts_mut(buffer.as_ptr(), LEN) };
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i.wrapping_mul(2_654_435_761) >> 13) as u8;
        }
        let span = Span { ptr: buffer.as_ptr(), len: LEN };
        // SAFETY: the buffer outlives the maps (dropped below, after them).
        let (ctx, worker, maps) = unsafe { setup(&config, &[span], true) }.expect("setup");
        let info = TargetInfo {
            worker_address: worker.address().expect("address"),
            regions: vec![RegionInfo {
                base: maps[0].base,
                len: maps[0].len,
                rkey: maps[0].packed_rkey().expect("rkey"),
            }],
        };
        let mut dst = vec![0u8; LEN];
        let dst_span = Span { ptr: dst.as_mut_ptr(), len: LEN };
        // SAFETY: `dst` outlives the initiator (joined below before `dst` is read) and only
        // the get below writes it.
        let initiator =
            unsafe { UcxInitiator::start(&config, vec![dst_span], Arc::new(())) }.expect("initiator");
        let (tx, rx) = crossbeam_channel::bounded(1);
        initiator.connect("peer", info, Box::new(move |r| drop(tx.send(r))));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            worker.progress_all();
            if let Ok(r) = rx.try_recv() {
                r.expect("connect");
                break;
            }
            assert!(Instant::now() < deadline, "connect hung");
            worker.wait(Duration::from_millis(1));
        }
        // From here on the target's worker is not progressed until the gets are done.
        let (tx, rx) = crossbeam_channel::bounded(1);
        let pieces = vec![GetPiece { local: dst_span.ptr, remote_region: 0, remote_offset: 0, len: LEN }];
        // SAFETY: the destination is the registered `dst`, untouched until `done` ran.
        unsafe { initiator.get("peer", pieces, Box::new(move |r| drop(tx.send(r)))) };
        let got = rx.recv_timeout(Duration::from_secs(30));
        let finished = Arc::new(AtomicBool::new(false));
        let closer = {
            let finished = finished.clone();
            std::thread::spawn(move || {
                drop(initiator);
                finished.store(true, Ordering::Release);
            })
        };
        // The initiator's endpoint close may want answers: progress the target until it ends.
        while !finished.load(Ordering::Acquire) {
            worker.progress_all();
            worker.wait(Duration::from_millis(1));
        }
        closer.join().expect("initiator dropped");
        assert_eq!(
            got.expect("the get completed without the target's worker progressing").expect("get"),
            LEN as u64
        );
        // SAFETY: as above: only read now, the buffer is still alive.
        let src = unsafe { std::slice::from_raw_parts(buffer.as_ptr(), LEN) };
        assert!(dst == src, "bytes differ");
        drop(maps);
        drop(worker);
        drop(ctx);
        drop(buffer);
    }
}
