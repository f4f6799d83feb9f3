//! The decode side's UCX thread: endpoints, rkeys and gets, all on one worker; and the
//! gets themselves (pieces checked against the peer's regions, then issued with
//! `ucp_get_nbx`, each completion counted into its job).

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use tracing::warn;
use ucx_sys as sys;

use super::endpoint::{PeerEp, Wireup};
use super::error::UcxError;
use super::handles::{setup, Signal};
use crate::{Command, Done, GetPiece, Span, UcxConfig};

/// Checks every piece of a get against the peer's regions before any is issued: the region
/// exists, and `base + offset + len` neither overflows nor leaves it.
fn check_pieces(peer: &PeerEp, pieces: &[GetPiece]) -> Result<(), UcxError> {
    for p in pieces {
        let (base, len) = *peer.regions.get(p.remote_region).ok_or_else(|| {
            UcxError::other("ucp_get_nbx", format!("peer has no region {}", p.remote_region))
        })?;
        let end = p.remote_offset.checked_add(p.len as u64);
        let addr_end = base.checked_add(p.remote_offset).and_then(|a| a.checked_add(p.len as u64));
        if end.is_none_or(|e| e > len) || addr_end.is_none() {
            return Err(UcxError::other(
                "ucp_get_nbx",
                format!(
                    "{}+{} outside the peer's region {} of {len} bytes",
                    p.remote_offset, p.len, p.remote_region
                ),
            ));
        }
    }
    Ok(())
}

/// A get under way: the endpoint it was issued on, pieces outstanding, first error, and
/// who to tell.
struct Job {
    /// The generation of the endpoint (not the peer's name: a read that never completes must
    /// not hold up a new endpoint to the same peer).
    ep: u64,
    outstanding: usize,
    error: Option<UcxError>,
    bytes: u64,
    done: Option<Done<u64>>,
}

/// UCX's completion callback of a get piece: counts it into its job.
///
/// # Safety
/// `request` is a completed request of ours and `user_data` the boxed [`Job`] that issued
/// it, called on the worker's owning thread.
unsafe extern "C" fn get_done(request: *mut c_void, status: sys::ucs_status_t, user_data: *mut c_void) {
    // SAFETY: `user_data` is the boxed Job that issued this request; jobs are dropped only
    // after their last request completed, and callbacks run on the owning thread.
    let job = unsafe { &mut *(user_data as *mut Job) };
    job.outstanding -= 1;
    if status != sys::UCS_OK && job.error.is_none() {
        job.error = Some(UcxError::status("ucp_get_nbx", status));
    }
    // SAFETY: a completed request owned by us, freed once.
    unsafe { sys::ucp_request_free(request) };
}

/// Issues every piece of a get, after checking all of them (so a bad piece fails the get
/// before anything is issued). Pieces completed at once are counted immediately.
fn issue(peer: &PeerEp, job: &mut Box<Job>, pieces: &[GetPiece]) -> Result<(), UcxError> {
    if peer.failed.load(Ordering::Acquire) {
        return Err(UcxError::other("ucp_get_nbx", "the endpoint to this peer has failed"));
    }
    check_pieces(peer, pieces)?;
    for p in pieces {
        let (base, _) = peer.regions[p.remote_region];
        let job_ptr: *mut Job = &mut **job;
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            user_data: job_ptr.cast(),
            ..Default::default()
        };
        param.cb.send = Some(get_done);
        // SAFETY: live endpoint and rkey (the peer is kept until no job uses it); the
        // destination is registered, in bounds and exclusively ours (contract of
        // `UcxInitiator::get`); the remote range is inside the peer's region and
        // `base + offset` does not overflow (`check_pieces`);
        // `job` is boxed, so `user_data` stays valid until the callback.
        let req = unsafe {
            sys::ucp_get_nbx(
                peer.ep,
                p.local.cast(),
                p.len,
                base + p.remote_offset,
                peer.rkeys[p.remote_region].0,
                &param,
            )
        };
        if req.is_null() {
            job.bytes += p.len as u64;
        } else if sys::UCS_PTR_IS_ERR(req) {
            return Err(UcxError::status("ucp_get_nbx", sys::UCS_PTR_STATUS(req)));
        } else {
            job.outstanding += 1;
            job.bytes += p.len as u64;
        }
    }
    Ok(())
}

/// An endpoint whose wire-up is under way. Its connect's `done` runs when the wire-up
/// finishes (or fails, or takes longer than [`WIREUP_TIMEOUT`]); `done` is `None` once the
/// connect was answered without the endpoint (timed out, disconnected, aborted, stopping),
/// and the endpoint is then closed when its wire-up finishes, not before.
///
/// Why wait: until the target's reply to our wire-up request has gone out, UCX 1.13's
/// target holds it queued on a transport endpoint to us (over tcp: until we accept and
/// acknowledge its connection, which needs our worker progressed). If our endpoint is
/// closed or this process dies in that window, the target fails that endpoint, purges the
/// queued reply, and aborts on an assertion (`ucp_request.c:684 ... got REP message`; see
/// ARCHITECTURE.md, UCX notes).
struct Wiring {
    peer: String,
    ep: PeerEp,
    wireup: Wireup,
    deadline: Instant,
    done: Option<Done<Vec<String>>>,
}

impl Wiring {
    /// Answers the connect (if not answered yet) with `error`; the endpoint is kept until
    /// its wire-up finishes.
    fn give_up(&mut self, error: impl FnOnce() -> UcxError) {
        if let Some(done) = self.done.take() {
            done(Err(error()));
        }
    }
}

type InitiatorReady = Sender<Result<Signal, UcxError>>;

/// What the initiator's thread shares with its handle: the stop flag, the command queue,
/// and the count of endpoints it holds open (for `UcxInitiator::open_endpoints`).
pub(crate) struct InitiatorLoop<'a> {
    pub(crate) stop: &'a AtomicBool,
    pub(crate) commands: &'a Receiver<Command>,
    pub(crate) endpoints: &'a AtomicUsize,
}

/// The decode side's thread: endpoints, rkeys and gets, all on one worker.
pub(crate) fn run_initiator(
    config: &UcxConfig,
    regions: Vec<Span>,
    keep_alive: Arc<dyn Any + Send + Sync>,
    InitiatorLoop { stop, commands, endpoints }: InitiatorLoop<'_>,
    ready: InitiatorReady,
) {
    // SAFETY: as in run_target, for the initiator's own regions.
    let (ctx, worker, maps) = match unsafe { setup(config, &regions, false) } {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let signal = Signal::new(&worker);
    // The live endpoint of each peer, with its generation (counted from 1 per initiator).
    let mut peers: std::collections::HashMap<String, (u64, PeerEp)> = std::collections::HashMap::new();
    let mut generation = 0u64;
    let mut jobs: Vec<Box<Job>> = Vec::new();
    // Endpoints a Disconnect (or a Connect replacing them) took out of `peers`, closed once no
    // read uses them. Held by value with their generation, so a Connect to the same peer keeps
    // its new endpoint, and reads still in flight on an old one (even one that never
    // completes) hold up only that one.
    let mut closing: Vec<(String, u64, PeerEp)> = Vec::new();
    // Endpoints made by a Connect whose wire-up has not finished.
    let mut wiring: Vec<Wiring> = Vec::new();
    let mut stop_since: Option<Instant> = None;
    let mut leak = false;
    if ready.send(Ok(signal.clone())).is_ok() {
        loop {
            while let Ok(cmd) = commands.try_recv() {
                match cmd {
                    Command::Connect { peer, info, same_host, done } => {
                        if wiring.iter().any(|w| w.peer == peer && w.done.is_some()) {
                            done(Err(UcxError::other("connect", "a connect to this peer is under way")));
                            continue;
                        }
                        // The old endpoint is closed once its reads finish (at once if none).
                        if let Some((g, old)) = peers.remove(&peer) {
                            closing.push((peer.clone(), g, old));
                        }
                        let peer_failure =
                            config.peer_failure_handling && !(same_host && config.same_host_shared_memory);
                        let ep = match PeerEp::connect(&worker, &info, peer_failure) {
                            Ok(ep) => ep,
                            Err(e) => {
                                done(Err(e));
                                continue;
                            }
                        };
                        // Answered once the endpoint is wired up both ways (see `Wiring`).
                        match ep.start_wireup() {
                            Ok(None) => {
                                generation += 1;
                                let transports = ep.transports();
                                peers.insert(peer, (generation, ep));
                                done(Ok(transports));
                            }
                            Ok(Some(wireup)) => wiring.push(Wiring {
                                peer,
                                ep,
                                wireup,
                                deadline: Instant::now() + WIREUP_TIMEOUT,
                                done: Some(done),
                            }),
                            Err(e) => {
                                ep.close(&worker);
                                done(Err(e));
                            }
                        }
                    }
                    Command::Get { peer, pieces, done } => {
                        let Some((g, ep)) = peers.get(&peer) else {
                            done(Err(UcxError::other("get", format!("no endpoint to {peer}"))));
                            continue;
                        };
                        let mut job =
                            Box::new(Job { ep: *g, outstanding: 0, error: None, bytes: 0, done: Some(done) });
                        if let Err(e) = issue(ep, &mut job, &pieces) {
                            // Pieces already issued still complete into this job: keep it
                            // until they do, and report this error then.
                            warn!(error = %e, "UCX get failed to issue");
                            job.error = Some(e);
                        }
                        jobs.push(job);
                    }
                    Command::Disconnect { peer } => {
                        for w in wiring.iter_mut().filter(|w| w.peer == peer) {
                            w.give_up(|| {
                                UcxError::other("connect", "disconnected before the wire-up finished")
                            });
                        }
                        if let Some((g, ep)) = peers.remove(&peer) {
                            closing.push((peer, g, ep));
                        }
                    }
                    Command::Abort { peer } => {
                        // The live endpoint and any disconnected one still finishing reads.
                        let (doomed, rest): (Vec<_>, Vec<_>) =
                            closing.drain(..).partition(|(p, _, _)| *p == peer);
                        closing = rest;
                        let eps = peers
                            .remove(&peer)
                            .map(|(_, ep)| ep)
                            .into_iter()
                            .chain(doomed.into_iter().map(|(_, _, ep)| ep));
                        for ep in eps {
                            warn!(%peer, "aborting the UCX endpoint: reads in flight are cancelled");
                            ep.abort(&worker);
                        }
                        // No read uses an endpoint still wiring up: it is closed (not forced)
                        // once its wire-up finishes.
                        for w in wiring.iter_mut().filter(|w| w.peer == peer) {
                            w.give_up(|| UcxError::other("connect", "aborted before the wire-up finished"));
                        }
                    }
                }
            }
            worker.progress_all();
            // Answer connects whose wire-up finished; close given-up endpoints once theirs did.
            let now = Instant::now();
            let mut still_wiring = Vec::with_capacity(wiring.len());
            for mut w in wiring.drain(..) {
                match w.wireup.poll() {
                    None => {
                        if now > w.deadline {
                            w.give_up(|| {
                                UcxError::other(
                                    "connect",
                                    format!("the peer did not finish the wire-up in {WIREUP_TIMEOUT:?}"),
                                )
                            });
                        }
                        still_wiring.push(w);
                    }
                    Some(result) => {
                        let Wiring { peer, ep, wireup, done, .. } = w;
                        drop(wireup);
                        match (done, result) {
                            (Some(done), Ok(())) => {
                                generation += 1;
                                let transports = ep.transports();
                                if let Some((g, old)) = peers.insert(peer.clone(), (generation, ep)) {
                                    closing.push((peer, g, old));
                                }
                                done(Ok(transports));
                            }
                            (Some(done), Err(e)) => {
                                ep.close(&worker);
                                done(Err(e));
                            }
                            (None, _) => ep.close(&worker),
                        }
                    }
                }
            }
            wiring = still_wiring;
            // Finish jobs whose pieces all completed.
            jobs.retain_mut(|job| {
                if job.outstanding > 0 {
                    return true;
                }
                if let Some(done) = job.done.take() {
                    match job.error.take() {
                        None => done(Ok(job.bytes)),
                        Some(e) => done(Err(e)),
                    }
                }
                false
            });
            // Close endpoints nobody reads from any more.
            let mut still_closing = Vec::with_capacity(closing.len());
            for (peer, g, ep) in closing.drain(..) {
                if jobs.iter().any(|j| j.ep == g) {
                    still_closing.push((peer, g, ep));
                } else {
                    ep.close(&worker);
                }
            }
            closing = still_closing;
            endpoints.store(peers.len() + closing.len() + wiring.len(), Ordering::Release);
            if stop.load(Ordering::Acquire) {
                for w in &mut wiring {
                    w.give_up(|| UcxError::other("connect", "the UCX initiator is stopping"));
                }
                if jobs.is_empty() && wiring.is_empty() {
                    break;
                }
                let since = *stop_since.get_or_insert_with(Instant::now);
                if jobs.is_empty() && since.elapsed() > WIREUP_GRACE_AT_STOP {
                    // Wire-ups that did not finish in time: their endpoints are closed below
                    // anyway (the peer is gone or stuck).
                    break;
                }
                if since.elapsed() > STUCK_READ_GRACE {
                    // UCX still owns reads that will not finish. Destroying the worker or
                    // unmapping could let UCX write into (or call back into) freed memory,
                    // so everything of this initiator is leaked instead.
                    warn!(
                        jobs = jobs.len(),
                        "UCX reads still in flight at shutdown; leaking the UCX worker and its memory"
                    );
                    leak = true;
                    break;
                }
            }
            if jobs.is_empty() && wiring.iter().all(|w| w.done.is_none()) {
                worker.wait(Duration::from_millis(100));
            } else {
                // Transfers or connects under way: wait briefly on the event fd without
                // spinning. (A wire-up needs the target's new tcp connection to us accepted,
                // and a waiting UCX 1.13 initiator was not seen woken for it here.)
                worker.wait(Duration::from_millis(1));
            }
        }
    }
    signal.disarm();
    // Commands sent before the stop but after the loop's last look are answered, not dropped
    // with their `done` never called (a connect made just before the initiator's drop).
    while let Ok(cmd) = commands.try_recv() {
        match cmd {
            Command::Connect { done, .. } => {
                done(Err(UcxError::other("connect", "the UCX initiator is stopping")))
            }
            Command::Get { done, .. } => done(Err(UcxError::other("get", "the UCX initiator is stopping"))),
            Command::Disconnect { .. } | Command::Abort { .. } => {}
        }
    }
    if leak {
        std::mem::forget((jobs, peers, closing, wiring, maps, worker, ctx, keep_alive));
        return;
    }
    let unwired = wiring.drain(..).map(|w| {
        drop(w.wireup);
        w.ep
    });
    for ep in
        peers.drain().map(|(_, (_, ep))| ep).chain(closing.drain(..).map(|(_, _, ep)| ep)).chain(unwired)
    {
        ep.close(&worker);
    }
    endpoints.store(0, Ordering::Release);
    drop(maps);
    drop(worker);
    drop(ctx);
    drop(keep_alive);
}

/// How long a stopping initiator waits for reads in flight before leaking instead.
const STUCK_READ_GRACE: Duration = Duration::from_secs(5);

/// How long a stopping initiator (with no reads in flight) waits for wire-ups under way
/// before closing their endpoints anyway.
const WIREUP_GRACE_AT_STOP: Duration = Duration::from_secs(1);

/// How long a connect waits for its endpoint's wire-up before it fails (the endpoint is
/// still kept until the wire-up finishes).
const WIREUP_TIMEOUT: Duration = Duration::from_secs(5);
