//! The prefill side's UCX thread: maps the regions, publishes the worker address and one
//! rkey per region, and progresses until stopped.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;

use super::error::UcxError;
use super::handles::{setup, Signal};
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
    let (ctx, worker, maps) = match unsafe { setup(config, &regions) } {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
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
