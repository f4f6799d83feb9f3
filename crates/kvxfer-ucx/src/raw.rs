//! The unsafe part: UCX handles and the two thread loops that own them.

use std::any::Any;
use std::ffi::{c_void, CStr, CString};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use tracing::{debug, warn};
use ucx_sys as sys;

use crate::{Command, Done, GetPiece, RegionInfo, Span, TargetInfo, UcxConfig};

/// A UCX failure: the call and UCX's own status text.
#[derive(Debug, Clone, thiserror::Error)]
#[error("UCX {op}: {message}")]
pub struct UcxError {
    op: &'static str,
    status: i32,
    message: String,
}

impl UcxError {
    fn status(op: &'static str, status: sys::ucs_status_t) -> Self {
        // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string
        // for every status value.
        let text = unsafe { CStr::from_ptr(sys::ucs_status_string(status)) };
        UcxError { op, status: i32::from(status), message: text.to_string_lossy().into_owned() }
    }

    fn other(op: &'static str, message: impl Into<String>) -> Self {
        UcxError { op, status: 0, message: message.into() }
    }

    pub(crate) fn thread(e: &std::io::Error) -> Self {
        Self::other("thread", format!("could not start the UCX thread: {e}"))
    }

    pub(crate) fn thread_died() -> Self {
        Self::other("thread", "the UCX thread has stopped")
    }

    /// The UCX status code (0 when the error is not a UCX status).
    pub fn code(&self) -> i32 {
        self.status
    }
}

fn check(op: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::status(op, status))
    }
}

/// A UCX context (`ucp_context_h`) with RMA and wakeup features.
struct Context(sys::ucp_context_h);

impl Context {
    fn new(config: &UcxConfig) -> Result<Self, UcxError> {
        let mut cfg: *mut sys::ucp_config_t = null_mut();
        // SAFETY: null prefix and file name select the defaults; `cfg` is valid for a write.
        check("ucp_config_read", unsafe { sys::ucp_config_read(null(), null(), &mut cfg) })?;
        let result = (|| {
            if let Some(tls) = &config.tls {
                let value = CString::new(tls.as_str())
                    .map_err(|_| UcxError::other("ucp_config_modify", "TLS contains a NUL byte"))?;
                // SAFETY: `cfg` came from ucp_config_read and both strings are NUL-terminated.
                check("ucp_config_modify(TLS)", unsafe {
                    sys::ucp_config_modify(cfg, c"TLS".as_ptr(), value.as_ptr())
                })?;
            }
            let params = sys::ucp_params_t {
                field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
                features: u64::from(sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP),
                ..Default::default()
            };
            let mut ctx: sys::ucp_context_h = null_mut();
            // SAFETY: `params` is initialised for the fields in its mask, `cfg` is a live
            // config, `ctx` is valid for a write.
            check("ucp_init", unsafe { sys::ucp_init(&params, cfg, &mut ctx) })?;
            Ok(Context(ctx))
        })();
        // SAFETY: `cfg` came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(cfg) };
        result
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context is live, and every worker and memory map made from it was
        // dropped before it (field order in the thread loops).
        unsafe { sys::ucp_cleanup(self.0) };
    }
}

/// A worker (`ucp_worker_h`), single-threaded, with its event fd.
struct Worker {
    raw: sys::ucp_worker_h,
    efd: i32,
}

impl Worker {
    fn new(ctx: &Context) -> Result<Self, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut raw: sys::ucp_worker_h = null_mut();
        // SAFETY: live context, initialised params, `raw` valid for a write.
        check("ucp_worker_create", unsafe { sys::ucp_worker_create(ctx.0, &params, &mut raw) })?;
        let mut efd = -1;
        // SAFETY: live worker created with the wakeup feature; `efd` valid for a write.
        if let Err(e) = check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(raw, &mut efd) }) {
            // SAFETY: the worker was just created and has no endpoints.
            unsafe { sys::ucp_worker_destroy(raw) };
            return Err(e);
        }
        Ok(Worker { raw, efd })
    }

    fn progress(&self) -> u32 {
        // SAFETY: live worker, used only from its owning thread.
        unsafe { sys::ucp_worker_progress(self.raw) }
    }

    fn progress_all(&self) {
        while self.progress() > 0 {}
    }

    /// Sleeps until the worker has events or `timeout` passes.
    fn wait(&self, timeout: Duration) {
        // SAFETY: live worker on its owning thread.
        let armed = unsafe { sys::ucp_worker_arm(self.raw) };
        if armed != sys::UCS_OK {
            return; // UCS_ERR_BUSY: events are pending, progress again.
        }
        let mut pfd = libc::pollfd { fd: self.efd, events: libc::POLLIN, revents: 0 };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, ms) };
    }

    fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr: *mut sys::ucp_address_t = null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; out-pointers valid for writes.
        check("ucp_worker_get_address", unsafe {
            sys::ucp_worker_get_address(self.raw, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`, copied before release.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker; released once.
        unsafe { sys::ucp_worker_release_address(self.raw, addr) };
        Ok(bytes)
    }

    /// Runs a non-blocking request to completion.
    fn wait_request(&self, req: sys::ucs_status_ptr_t, deadline: Instant) -> Result<(), UcxError> {
        if req.is_null() {
            return Ok(());
        }
        if sys::UCS_PTR_IS_ERR(req) {
            return Err(UcxError::status("request", sys::UCS_PTR_STATUS(req)));
        }
        loop {
            self.progress_all();
            // SAFETY: `req` is a live request pointer returned by UCX (checked above).
            let st = unsafe { sys::ucp_request_check_status(req) };
            if st != sys::UCS_INPROGRESS {
                // SAFETY: completed request, freed once.
                unsafe { sys::ucp_request_free(req) };
                return check("request", st);
            }
            if Instant::now() > deadline {
                return Err(UcxError::other("request", "did not complete in time"));
            }
            self.wait(Duration::from_millis(1));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: live worker; all its endpoints were closed before (thread loop order).
        unsafe { sys::ucp_worker_destroy(self.raw) };
    }
}

/// Wakes a worker thread from any thread (`ucp_worker_signal` is thread-safe). Disarmed by
/// the owning thread before the worker is destroyed.
#[derive(Clone)]
pub(crate) struct Signal(Arc<Mutex<Option<usize>>>);

impl Signal {
    fn new(worker: &Worker) -> Self {
        Signal(Arc::new(Mutex::new(Some(worker.raw as usize))))
    }

    pub(crate) fn wake(&self) {
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = *guard {
            // SAFETY: the worker is live while the slot holds it: the owning thread clears
            // the slot (under this lock) before destroying the worker.
            unsafe { sys::ucp_worker_signal(w as sys::ucp_worker_h) };
        }
    }

    fn disarm(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// A registered region (`ucp_mem_map` over memory someone else owns).
struct MemMap {
    ctx: sys::ucp_context_h,
    memh: sys::ucp_mem_h,
    base: u64,
    len: u64,
}

impl MemMap {
    /// # Safety
    /// `span` stays valid until this map is dropped.
    unsafe fn new(ctx: &Context, span: Span) -> Result<Self, UcxError> {
        if span.len == 0 {
            return Err(UcxError::other("ucp_mem_map", "cannot register an empty region"));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH),
            address: span.ptr.cast(),
            length: span.len,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = null_mut();
        // SAFETY: live context; the span is valid (caller); `memh` valid for a write.
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(ctx.0, &params, &mut memh) })?;
        Ok(MemMap { ctx: ctx.0, memh, base: span.ptr as u64, len: span.len as u64 })
    }

    fn packed_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let mut buf: *mut c_void = null_mut();
        let mut size = 0usize;
        // SAFETY: live context and memory handle; out-pointers valid.
        check("ucp_rkey_pack", unsafe { sys::ucp_rkey_pack(self.ctx, self.memh, &mut buf, &mut size) })?;
        // SAFETY: UCX returned `size` readable bytes, copied before release.
        let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: buffer from ucp_rkey_pack, released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(bytes)
    }
}

impl Drop for MemMap {
    fn drop(&mut self) {
        // SAFETY: live handle of a live context (contexts outlive their maps); no request
        // uses the region any more (all gets completed before shutdown).
        let st = unsafe { sys::ucp_mem_unmap(self.ctx, self.memh) };
        if st != sys::UCS_OK {
            warn!(status = st, "ucp_mem_unmap failed");
        }
    }
}

/// An unpacked remote key.
struct Rkey(sys::ucp_rkey_h);

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: live rkey; dropped before its endpoint is closed and after its last get.
        unsafe { sys::ucp_rkey_destroy(self.0) };
    }
}

/// An endpoint to one target with its rkeys. `failed` is set by UCX's error callback.
struct PeerEp {
    ep: sys::ucp_ep_h,
    /// Whether the endpoint has peer-failure handling (needed for a forced close).
    peer_failure: bool,
    rkeys: Vec<Rkey>,
    regions: Vec<(u64, u64)>,
    failed: Box<AtomicBool>,
}

unsafe extern "C" fn ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the `failed` flag of a PeerEp, which outlives its endpoint.
    let failed = unsafe { &*(arg as *const AtomicBool) };
    failed.store(true, Ordering::Release);
    debug!(status, "UCX endpoint error");
}

/// Largest worker address accepted from a peer. UCX's addresses are a few hundred bytes
/// (a few KiB with many devices); anything larger is not one.
pub const MAX_WORKER_ADDRESS_LEN: usize = 64 * 1024;
/// Largest packed rkey accepted from a peer (UCX's are tens to hundreds of bytes).
pub const MAX_RKEY_LEN: usize = 16 * 1024;

/// Checks what can be checked of a peer's target info before any of it reaches UCX: the
/// worker address and every rkey are non-empty and not oversized, and every region's
/// `base + len` fits in 64 bits. The contents of an address or rkey are opaque to us
/// (`ucp_ep_create` and `ucp_ep_rkey_unpack` take no length), so a malformed one of a
/// plausible length still reaches UCX's own parser: only peers that passed the handshake
/// should be connected to.
pub(crate) fn check_target_info(info: &TargetInfo) -> Result<(), UcxError> {
    let len = info.worker_address.len();
    if len == 0 || len > MAX_WORKER_ADDRESS_LEN {
        return Err(UcxError::other(
            "ucp_ep_create",
            format!(
                "peer's worker address is {len} bytes (must be 1..={MAX_WORKER_ADDRESS_LEN}); not connecting"
            ),
        ));
    }
    for (i, r) in info.regions.iter().enumerate() {
        let len = r.rkey.len();
        if len == 0 || len > MAX_RKEY_LEN {
            return Err(UcxError::other(
                "ucp_ep_rkey_unpack",
                format!(
                    "peer's rkey of region {i} is {len} bytes (must be 1..={MAX_RKEY_LEN}); not connecting"
                ),
            ));
        }
        if r.base.checked_add(r.len).is_none() {
            return Err(UcxError::other(
                "connect",
                format!("peer's region {i} ({:#x} + {} bytes) wraps around the address space", r.base, r.len),
            ));
        }
    }
    Ok(())
}

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

impl PeerEp {
    fn connect(worker: &Worker, info: &TargetInfo, peer_failure: bool) -> Result<Self, UcxError> {
        check_target_info(info)?;
        let failed = Box::new(AtomicBool::new(false));
        let params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            address: info.worker_address.as_ptr().cast(),
            err_mode: if peer_failure {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: sys::ucp_err_handler_t {
                cb: Some(ep_error),
                arg: (&*failed as *const AtomicBool).cast_mut().cast(),
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = null_mut();
        // SAFETY: live worker; the address bytes (non-empty, bounded: checked above) live
        // across the call; the error handler's argument (boxed) lives as long as the endpoint.
        check("ucp_ep_create", unsafe { sys::ucp_ep_create(worker.raw, &params, &mut ep) })?;
        let mut peer = PeerEp { ep, peer_failure, rkeys: Vec::new(), regions: Vec::new(), failed };
        for r in &info.regions {
            let mut rkey: sys::ucp_rkey_h = null_mut();
            // SAFETY: live endpoint; the packed buffer (non-empty, bounded: checked above)
            // lives across the call.
            let st = unsafe { sys::ucp_ep_rkey_unpack(peer.ep, r.rkey.as_ptr().cast(), &mut rkey) };
            if let Err(e) = check("ucp_ep_rkey_unpack", st) {
                peer.close(worker);
                return Err(e);
            }
            peer.rkeys.push(Rkey(rkey));
            peer.regions.push((r.base, r.len));
        }
        Ok(peer)
    }

    /// Destroys the rkeys, then closes the endpoint once: gracefully (flush, and tell the
    /// peer so its side is removed cleanly — UCX 1.13 can abort in wire-up when a peer's
    /// endpoint just vanishes), or forcefully when the peer has already failed. A graceful
    /// close that does not finish in time is left to the worker's destruction.
    fn close(mut self, worker: &Worker) {
        self.rkeys.clear();
        let force = self.peer_failure && self.failed.load(Ordering::Acquire);
        let param = if force {
            sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
                ..Default::default()
            }
        } else {
            sys::ucp_request_param_t::default()
        };
        // SAFETY: live endpoint, closed exactly once here; its rkeys are already destroyed.
        let req = unsafe { sys::ucp_ep_close_nbx(self.ep, &param) };
        if let Err(e) = worker.wait_request(req, Instant::now() + Duration::from_secs(2)) {
            debug!(error = %e, force, "closing a UCX endpoint");
        }
    }
}

impl PeerEp {
    /// Closes the endpoint with reads possibly in flight: forcefully where UCX allows it
    /// (peer-failure handling on), so UCX completes them with an error (running their
    /// callbacks); gracefully otherwise. The rkeys, no longer used by any request, are
    /// destroyed after it.
    fn abort(mut self, worker: &Worker) {
        let rkeys = std::mem::take(&mut self.rkeys);
        let param = if self.peer_failure {
            sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
                ..Default::default()
            }
        } else {
            sys::ucp_request_param_t::default()
        };
        // SAFETY: live endpoint, closed exactly once here.
        let req = unsafe { sys::ucp_ep_close_nbx(self.ep, &param) };
        if let Err(e) = worker.wait_request(req, Instant::now() + Duration::from_secs(2)) {
            debug!(error = %e, "aborting a UCX endpoint");
        }
        worker.progress_all();
        drop(rkeys);
    }
}

/// A get under way: pieces outstanding, first error, and who to tell.
struct Job {
    peer: String,
    outstanding: usize,
    error: Option<UcxError>,
    bytes: u64,
    done: Option<Done<u64>>,
}

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

/// What a target and an initiator both start with: a context, a worker, and their regions
/// mapped.
///
/// # Safety
/// Every span stays valid until the returned maps are dropped.
unsafe fn setup(config: &UcxConfig, regions: &[Span]) -> Result<(Context, Worker, Vec<MemMap>), UcxError> {
    let ctx = Context::new(config)?;
    let worker = Worker::new(&ctx)?;
    let mut maps = Vec::with_capacity(regions.len());
    for &span in regions {
        // SAFETY: forwarded contract.
        maps.push(unsafe { MemMap::new(&ctx, span) }?);
    }
    Ok((ctx, worker, maps))
}

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

type InitiatorReady = Sender<Result<Signal, UcxError>>;

/// The decode side's thread: endpoints, rkeys and gets, all on one worker.
pub(crate) fn run_initiator(
    config: &UcxConfig,
    regions: Vec<Span>,
    keep_alive: Arc<dyn Any + Send + Sync>,
    stop: &AtomicBool,
    commands: &Receiver<Command>,
    ready: InitiatorReady,
) {
    // SAFETY: as in run_target, for the initiator's own regions.
    let (ctx, worker, maps) = match unsafe { setup(config, &regions) } {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let signal = Signal::new(&worker);
    let mut peers: std::collections::HashMap<String, PeerEp> = std::collections::HashMap::new();
    let mut jobs: Vec<Box<Job>> = Vec::new();
    // Endpoints a Disconnect took out of `peers`, closed once no read uses them. Held by
    // value (not by peer name), so a Connect to the same peer in the same batch keeps its
    // new endpoint.
    let mut closing: Vec<(String, PeerEp)> = Vec::new();
    let mut stop_since: Option<Instant> = None;
    let mut leak = false;
    if ready.send(Ok(signal.clone())).is_ok() {
        loop {
            while let Ok(cmd) = commands.try_recv() {
                match cmd {
                    Command::Connect { peer, info, done } => {
                        if jobs.iter().any(|j| j.peer == peer) {
                            done(Err(UcxError::other("connect", "reads to this peer are still in flight")));
                            continue;
                        }
                        if let Some(old) = peers.remove(&peer) {
                            old.close(&worker);
                        }
                        match PeerEp::connect(&worker, &info, config.peer_failure_handling) {
                            Ok(ep) => {
                                peers.insert(peer, ep);
                                done(Ok(()));
                            }
                            Err(e) => done(Err(e)),
                        }
                    }
                    Command::Get { peer, pieces, done } => {
                        let Some(ep) = peers.get(&peer) else {
                            done(Err(UcxError::other("get", format!("no endpoint to {peer}"))));
                            continue;
                        };
                        let mut job =
                            Box::new(Job { peer, outstanding: 0, error: None, bytes: 0, done: Some(done) });
                        if let Err(e) = issue(ep, &mut job, &pieces) {
                            // Pieces already issued still complete into this job: keep it
                            // until they do, and report this error then.
                            warn!(error = %e, "UCX get failed to issue");
                            job.error = Some(e);
                        }
                        jobs.push(job);
                    }
                    Command::Disconnect { peer } => {
                        if let Some(ep) = peers.remove(&peer) {
                            closing.push((peer, ep));
                        }
                    }
                    Command::Abort { peer } => {
                        // The live endpoint and any disconnected one still finishing reads.
                        let (doomed, rest): (Vec<_>, Vec<_>) =
                            closing.drain(..).partition(|(p, _)| *p == peer);
                        closing = rest;
                        let eps = peers.remove(&peer).into_iter().chain(doomed.into_iter().map(|(_, ep)| ep));
                        for ep in eps {
                            warn!(%peer, "aborting the UCX endpoint: reads in flight are cancelled");
                            ep.abort(&worker);
                        }
                    }
                }
            }
            worker.progress_all();
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
            for (peer, ep) in closing.drain(..) {
                if jobs.iter().any(|j| j.peer == peer) {
                    still_closing.push((peer, ep));
                } else {
                    ep.close(&worker);
                }
            }
            closing = still_closing;
            if stop.load(Ordering::Acquire) {
                if jobs.is_empty() {
                    break;
                }
                let since = *stop_since.get_or_insert_with(Instant::now);
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
            if jobs.is_empty() {
                worker.wait(Duration::from_millis(100));
            } else {
                // Transfers in flight: wait briefly on the event fd (tcp) without spinning.
                worker.wait(Duration::from_millis(1));
            }
        }
    }
    signal.disarm();
    if leak {
        std::mem::forget((jobs, peers, closing, maps, worker, ctx, keep_alive));
        return;
    }
    for (_, ep) in peers.drain().chain(closing.drain(..)) {
        ep.close(&worker);
    }
    drop(maps);
    drop(worker);
    drop(ctx);
    drop(keep_alive);
}

/// How long a stopping initiator waits for reads in flight before leaking instead.
const STUCK_READ_GRACE: Duration = Duration::from_secs(5);
