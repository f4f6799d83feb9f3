//! RAII handles of the UCX objects both sides own: the context, the worker (and the
//! [`Signal`] that wakes it from other threads), and memory maps; and [`setup`], which makes
//! all three. Each handle releases its object in `Drop`; the thread loops drop them in the
//! order UCX needs (maps, worker, then their `Arc` of the context, which a shared context's
//! last holder — maybe another thread, or a `UcxBuffer`'s drop — cleans up).

use std::ffi::{c_void, CString};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use ucx_sys as sys;

use super::error::{check, UcxError};
use crate::{Span, UcxConfig};

/// A UCX context (`ucp_context_h`) with RMA and wakeup features, with the memory it
/// allocated itself ([`Context::allocate`]). Either the process's shared context for a
/// transport set ([`Context::shared`]: created with `mt_workers_shared` and used by the
/// workers and allocations of any thread only once UCX reported it thread-safe), or a
/// private one, used only by the thread that made it.
pub(crate) struct Context {
    raw: sys::ucp_context_h,
    /// The regions this context allocated and still holds. The lock also serialises
    /// kvxfer's context-level calls (map, unmap, rkey pack) across threads.
    allocations: Mutex<Vec<Allocated>>,
}

// SAFETY: a context is used from several threads only when it is the shared context of a
// transport set, and `Context::shared` shares one only after `ucp_context_query` reported
// `UCS_THREAD_MODE_MULTI` (UCX then guards its context-level state for workers and calls on
// several threads); kvxfer's own context-level calls (map, unmap, rkey pack) are also
// serialised by `allocations`' lock. A private context (the initiator's, or a target's
// when UCX gives no thread-safe one) is created, used and dropped on one thread. Workers
// made from either stay on their owning threads.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

/// A region a context allocated: where it is and its memory handle.
#[derive(Clone, Copy)]
struct Allocated {
    base: usize,
    len: usize,
    memh: usize,
}

/// What [`Context::shared`] gives.
pub(crate) enum SharedContext {
    /// The process's thread-safe context for the transport set.
    Shared(Arc<Context>),
    /// UCX made the context without thread safety (its thread mode is not
    /// `UCS_THREAD_MODE_MULTI`, e.g. a UCX built without `--enable-mt`): not shared, usable
    /// as a private context of the calling thread.
    SingleThreaded(Context),
}

impl Context {
    /// A context with the transports of `config`; `multi_threaded` asks UCX for one its
    /// workers on several threads may share (`mt_workers_shared`; check the mode UCX gave
    /// with [`Context::thread_mode`]).
    /// A context of the calling thread only (not shared).
    pub(crate) fn private(config: &UcxConfig) -> Result<Self, UcxError> {
        Context::new(config, false)
    }

    fn new(config: &UcxConfig, multi_threaded: bool) -> Result<Self, UcxError> {
        super::version::check_version()?;
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
            let mut field_mask = sys::UCP_PARAM_FIELD_FEATURES;
            if multi_threaded {
                field_mask |= sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED;
            }
            let params = sys::ucp_params_t {
                field_mask: u64::from(field_mask),
                features: u64::from(sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP),
                mt_workers_shared: i32::from(multi_threaded),
                ..Default::default()
            };
            let mut ctx: sys::ucp_context_h = null_mut();
            // SAFETY: `params` is initialised for the fields in its mask, `cfg` is a live
            // config, `ctx` is valid for a write.
            check("ucp_init", unsafe { sys::ucp_init(&params, cfg, &mut ctx) })?;
            Ok(Context { raw: ctx, allocations: Mutex::new(Vec::new()) })
        })();
        // SAFETY: `cfg` came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(cfg) };
        result
    }

    /// The thread mode UCX gave this context (`ucp_params_t` says the mode asked for with
    /// `mt_workers_shared` may not be the one granted).
    fn thread_mode(&self) -> Result<sys::ucs_thread_mode_t, UcxError> {
        let mut attr = sys::ucp_context_attr_t {
            field_mask: u64::from(sys::UCP_ATTR_FIELD_THREAD_MODE),
            ..Default::default()
        };
        // SAFETY: live context; `attr` is valid for writes of its masked fields.
        check("ucp_context_query", unsafe { sys::ucp_context_query(self.raw, &mut attr) })?;
        Ok(attr.thread_mode)
    }

    /// The process's shared context for `config`'s transports: the one already in use for
    /// them (by a target or allocations), else a new one — if UCX makes it thread-safe.
    /// Memory allocated from it ([`Context::allocate`]) is what a target of the same
    /// transports can serve one-sided. Transport lists name the same set when they hold
    /// the same transports, in any order or repeated ([`transport_set`]).
    pub(crate) fn shared(config: &UcxConfig) -> Result<SharedContext, UcxError> {
        type SharedContexts = Mutex<Vec<(Option<String>, Weak<Context>)>>;
        static SHARED: OnceLock<SharedContexts> = OnceLock::new();
        let key = transport_set(config.tls.as_deref());
        let mut shared = SHARED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        shared.retain(|(_, ctx)| ctx.strong_count() > 0);
        if let Some(ctx) = shared.iter().find(|(tls, _)| *tls == key).and_then(|(_, c)| c.upgrade()) {
            return Ok(SharedContext::Shared(ctx));
        }
        let ctx = Context::new(config, true)?;
        let mode = ctx.thread_mode()?;
        if mode != sys::UCS_THREAD_MODE_MULTI {
            return Ok(SharedContext::SingleThreaded(ctx));
        }
        let ctx = Arc::new(ctx);
        shared.push((key, Arc::downgrade(&ctx)));
        Ok(SharedContext::Shared(ctx))
    }

    /// Allocates `len` bytes with `ucp_mem_map(UCP_MEM_MAP_ALLOCATE)`: UCX places them in
    /// memory its shared-memory transports can map into a peer (sysv or posix shared
    /// memory), so a peer's `ucp_get_nbx` from them is a copy on the peer's side rather
    /// than an active message this process must serve. Returns the address and the memory
    /// handle; [`Context::free`] releases them.
    pub(crate) fn allocate(&self, len: usize) -> Result<(*mut u8, usize, sys::ucp_mem_h), UcxError> {
        if len == 0 {
            return Err(UcxError::other("ucp_mem_map", "cannot allocate an empty region"));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            ),
            address: null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut allocations = self.allocations.lock().unwrap_or_else(|p| p.into_inner());
        let mut memh: sys::ucp_mem_h = null_mut();
        // SAFETY: live context; a null address with ALLOCATE asks UCX to choose one;
        // `memh` valid for a write.
        check("ucp_mem_map(ALLOCATE)", unsafe { sys::ucp_mem_map(self.raw, &params, &mut memh) })?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: u64::from(sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: `memh` was just mapped; `attr` is valid for writes of its masked fields.
        let queried = check("ucp_mem_query", unsafe { sys::ucp_mem_query(memh, &mut attr) });
        if let Err(e) = queried.and_then(|()| {
            if attr.address.is_null() || attr.length < len {
                Err(UcxError::other("ucp_mem_map(ALLOCATE)", "UCX returned less memory than asked for"))
            } else {
                Ok(())
            }
        }) {
            // SAFETY: the handle was mapped above and is released once, unused.
            unsafe { sys::ucp_mem_unmap(self.raw, memh) };
            return Err(e);
        }
        let base = attr.address.cast::<u8>();
        allocations.push(Allocated { base: base as usize, len: attr.length, memh: memh as usize });
        Ok((base, attr.length, memh))
    }

    /// Releases memory from [`Context::allocate`].
    ///
    /// # Safety
    /// `memh` came from `allocate` on this context and is freed once; nothing (no region
    /// handed to a target, no peer's read in flight on a live target) uses the memory any
    /// more.
    pub(crate) unsafe fn free(&self, memh: sys::ucp_mem_h) {
        let mut allocations = self.allocations.lock().unwrap_or_else(|p| p.into_inner());
        allocations.retain(|a| a.memh != memh as usize);
        // SAFETY: per the contract, a live handle of this context, released once.
        let st = unsafe { sys::ucp_mem_unmap(self.raw, memh) };
        if st != sys::UCS_OK {
            warn!(status = st, "ucp_mem_unmap of an allocation failed");
        } else {
            debug!("UCX allocation released");
        }
    }

    /// The memory handle of this context's allocation that holds all of `span`, if any.
    fn allocation_holding(&self, span: Span) -> Option<sys::ucp_mem_h> {
        let (start, end) = (span.ptr as usize, (span.ptr as usize).checked_add(span.len)?);
        let allocations = self.allocations.lock().unwrap_or_else(|p| p.into_inner());
        allocations
            .iter()
            .find(|a| a.base <= start && end <= a.base + a.len)
            .map(|a| a.memh as sys::ucp_mem_h)
    }

    /// The transport resources this context may use, as UCX prints them
    /// (`ucp_context_print_info`): `"<transport>/<device>"` per resource, e.g.
    /// `"posix/memory"`, `"tcp/lo"`, `"cuda_ipc/cuda"`.
    pub(crate) fn resources(&self) -> Result<Vec<String>, UcxError> {
        let mut buf: *mut std::ffi::c_char = null_mut();
        let mut size: libc::size_t = 0;
        // SAFETY: both out-pointers are valid for writes while the stream is open.
        let stream = unsafe { libc::open_memstream(&mut buf, &mut size) };
        if stream.is_null() {
            return Err(UcxError::other("open_memstream", std::io::Error::last_os_error().to_string()));
        }
        // SAFETY: live context; `stream` is an open FILE (libc's and UCX's are the same C
        // library's FILE).
        unsafe { sys::ucp_context_print_info(self.raw, stream.cast()) };
        // SAFETY: closing the stream flushes it and sets `buf`/`size`; it is not used after.
        unsafe { libc::fclose(stream) };
        if buf.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: open_memstream's buffer holds `size` bytes (plus a NUL) until freed below.
        let text = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) };
        let text = String::from_utf8_lossy(text).into_owned();
        // SAFETY: the buffer was allocated by open_memstream with malloc and is freed once.
        unsafe { libc::free(buf.cast()) };
        Ok(parse_resources(&text))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context is live, and every worker, memory map and allocation made
        // from it was dropped before it (the thread loops drop their maps and worker before
        // their `Arc` of it; an allocation holds an `Arc` until it is freed).
        unsafe { sys::ucp_cleanup(self.raw) };
    }
}

/// A worker (`ucp_worker_h`), single-threaded, with its event fd.
pub(super) struct Worker {
    /// The worker handle.
    pub(super) raw: sys::ucp_worker_h,
    efd: i32,
}

impl Worker {
    /// A single-threaded worker of `ctx`, with its event fd.
    fn new(ctx: &Context) -> Result<Self, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut raw: sys::ucp_worker_h = null_mut();
        // SAFETY: live context, initialised params, `raw` valid for a write.
        check("ucp_worker_create", unsafe { sys::ucp_worker_create(ctx.raw, &params, &mut raw) })?;
        let mut efd = -1;
        // SAFETY: live worker created with the wakeup feature; `efd` valid for a write.
        if let Err(e) = check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(raw, &mut efd) }) {
            // SAFETY: the worker was just created and has no endpoints.
            unsafe { sys::ucp_worker_destroy(raw) };
            return Err(e);
        }
        Ok(Worker { raw, efd })
    }

    /// Progresses the worker once; how many events it handled.
    fn progress(&self) -> u32 {
        // SAFETY: live worker, used only from its owning thread.
        unsafe { sys::ucp_worker_progress(self.raw) }
    }

    /// Progresses the worker until it has nothing left to do.
    pub(super) fn progress_all(&self) {
        while self.progress() > 0 {}
    }

    /// Sleeps until the worker has events or `timeout` passes.
    pub(super) fn wait(&self, timeout: Duration) {
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

    /// The worker's address, for a peer to connect to.
    pub(super) fn address(&self) -> Result<Vec<u8>, UcxError> {
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

    /// Runs a non-blocking request (one without a callback) to completion, or until
    /// `deadline`: then it is released unfinished (UCX frees it when it completes; a
    /// request still unreleased when its worker is destroyed trips UCX 1.13's assertion
    /// `ucp_ep.c:382 ... UCP_REQUEST_FLAG_RELEASED` and aborts the process).
    pub(super) fn wait_request(&self, req: sys::ucs_status_ptr_t, deadline: Instant) -> Result<(), UcxError> {
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
                // SAFETY: a live request of ours without a callback, released once; UCX
                // allows releasing one still in flight.
                unsafe { sys::ucp_request_free(req) };
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
    /// A signal that wakes `worker`.
    pub(super) fn new(worker: &Worker) -> Self {
        Signal(Arc::new(Mutex::new(Some(worker.raw as usize))))
    }

    /// Wakes the worker's thread (nothing once disarmed).
    pub(crate) fn wake(&self) {
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = *guard {
            // SAFETY: the worker is live while the slot holds it: the owning thread clears
            // the slot (under this lock) before destroying the worker.
            unsafe { sys::ucp_worker_signal(w as sys::ucp_worker_h) };
        }
    }

    /// Stops waking the worker: called by its owning thread before it destroys it.
    pub(super) fn disarm(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// A registered region: `ucp_mem_map` over memory someone else owns, or a region the
/// context allocated itself (then the map only borrows the allocation's handle).
pub(super) struct MemMap {
    ctx: Arc<Context>,
    memh: sys::ucp_mem_h,
    /// Whether this map made `memh` (and unmaps it when dropped).
    owned: bool,
    /// Start address of the region.
    pub(super) base: u64,
    /// Length of the region in bytes.
    pub(super) len: u64,
}

impl MemMap {
    /// Maps `span`: with the handle of the context's allocation that holds it, if there is
    /// one (so peers read it through shared memory), else a new registration.
    ///
    /// # Safety
    /// `span` stays valid until this map is dropped.
    unsafe fn new(ctx: &Arc<Context>, span: Span) -> Result<Self, UcxError> {
        if span.len == 0 {
            return Err(UcxError::other("ucp_mem_map", "cannot register an empty region"));
        }
        let (base, len) = (span.ptr as u64, span.len as u64);
        if let Some(memh) = ctx.allocation_holding(span) {
            return Ok(MemMap { ctx: ctx.clone(), memh, owned: false, base, len });
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH),
            address: span.ptr.cast(),
            length: span.len,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = null_mut();
        let _serial = ctx.allocations.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: live context; the span is valid (caller); `memh` valid for a write.
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(ctx.raw, &params, &mut memh) })?;
        Ok(MemMap { ctx: ctx.clone(), memh, owned: true, base, len })
    }

    /// The region's packed rkey, for a peer to unpack.
    pub(super) fn packed_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let mut buf: *mut c_void = null_mut();
        let mut size = 0usize;
        let _serial = self.ctx.allocations.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: live context and memory handle (an allocation's handle outlives the map:
        // `run_target`'s keep-alive contract); out-pointers valid.
        check("ucp_rkey_pack", unsafe { sys::ucp_rkey_pack(self.ctx.raw, self.memh, &mut buf, &mut size) })?;
        // SAFETY: UCX returned `size` readable bytes, copied before release.
        let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: buffer from ucp_rkey_pack, released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(bytes)
    }
}

impl Drop for MemMap {
    fn drop(&mut self) {
        if !self.owned {
            return; // The allocation's owner unmaps it (`Context::free`).
        }
        let _serial = self.ctx.allocations.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: live handle of a live context (held by `self.ctx`); no request uses the
        // region any more (all gets completed before shutdown).
        let st = unsafe { sys::ucp_mem_unmap(self.ctx.raw, self.memh) };
        if st != sys::UCS_OK {
            warn!(status = st, "ucp_mem_unmap failed");
        }
    }
}

/// What a target and an initiator both start with: a context, a worker, and their regions
/// mapped. A target (`shared`) uses the process's shared context for its transports, so
/// regions allocated from it ([`Context::allocate`]) are served through shared memory —
/// unless UCX gives no thread-safe context: then, as an initiator always does, it gets a
/// context of its own.
///
/// # Safety
/// Every span stays valid until the returned maps are dropped.
pub(super) unsafe fn setup(
    config: &UcxConfig,
    regions: &[Span],
    shared: bool,
) -> Result<(Arc<Context>, Worker, Vec<MemMap>), UcxError> {
    let ctx = if shared {
        match Context::shared(config)? {
            SharedContext::Shared(ctx) => ctx,
            SharedContext::SingleThreaded(ctx) => {
                warn!(
                    "UCX gave no thread-safe context (not UCS_THREAD_MODE_MULTI): this target uses a \
                     context of its own, so it cannot serve UCX-allocated memory one-sided"
                );
                Arc::new(ctx)
            }
        }
    } else {
        Arc::new(Context::new(config, false)?)
    };
    let worker = Worker::new(&ctx)?;
    let mut maps = Vec::with_capacity(regions.len());
    for &span in regions {
        // SAFETY: forwarded contract.
        maps.push(unsafe { MemMap::new(&ctx, span) }?);
    }
    Ok((ctx, worker, maps))
}

/// Logs a target's regions that are not UCX-allocated memory of its context (registered
/// ordinary memory, or memory allocated for another transport set): a peer on the same
/// host can read those over shared memory only by gets the target's thread emulates (see
/// [`crate::UcxBuffer`]). At warn level the first time in the process, at debug level
/// after. Returns how many there are.
pub(super) fn note_emulated_regions(config: &UcxConfig, maps: &[MemMap]) -> usize {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let emulated = maps.iter().filter(|m| m.owned).count();
    if emulated == 0 || !may_use_shared_memory(config.tls.as_deref()) {
        return emulated;
    }
    let tls = config.tls.as_deref().unwrap_or("UCX's default");
    if WARNED.swap(true, Ordering::Relaxed) {
        debug!(emulated, regions = maps.len(), tls, "UCX target serves regions UCX did not allocate");
    } else {
        warn!(
            emulated,
            regions = maps.len(),
            tls,
            "a UCX target serves regions that are not UCX-allocated memory of its context \
             (kvxfer_ucx::UcxBuffer / kvxfer::ucx_region with the same transports): peers on this \
             host read them by gets this target's thread emulates, several times slower \
             (logged once per process)"
        );
    }
    emulated
}

/// Whether a transport list (`UCX_TLS` syntax; `None`: UCX's default) may use UCX's
/// shared-memory transports.
fn may_use_shared_memory(tls: Option<&str>) -> bool {
    let Some(tls) = tls else { return true };
    let tls = tls.trim();
    tls.starts_with('^')
        || tls.split(',').map(str::trim).any(|t| matches!(t, "all" | "sm" | "shm" | "mm" | "posix" | "sysv"))
}

/// The key of a transport list in the shared-context registry: its transports trimmed,
/// sorted and deduplicated (a leading `^`, "all but", kept in front), so spellings of one
/// set share one context. `None` (UCX's default, or `UCX_TLS`) stays its own key.
fn transport_set(tls: Option<&str>) -> Option<String> {
    let tls = tls?.trim();
    let (prefix, list) = match tls.strip_prefix('^') {
        Some(rest) => ("^", rest),
        None => ("", tls),
    };
    let mut names: Vec<&str> = list.split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
    names.sort_unstable();
    names.dedup();
    Some(format!("{prefix}{}", names.join(",")))
}

/// The `"<transport>/<device>"` of each `resource` line `ucp_context_print_info` prints
/// (`#     resource 0  :  md 0  dev 0  flags -- posix/memory`), without repeats.
pub(crate) fn parse_resources(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines().filter(|l| l.contains("resource")) {
        if let Some(name) = line.split_whitespace().last().filter(|w| w.contains('/')) {
            if !out.iter().any(|o| o == name) {
                out.push(name.to_owned());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::UcxBuffer;

    fn config(tls: &str) -> UcxConfig {
        UcxConfig { tls: Some(tls.into()), peer_failure_handling: false, ..UcxConfig::default() }
    }

    #[test]
    fn spellings_of_one_transport_set_share_a_key() {
        let key = |t: &str| transport_set(Some(t));
        assert_eq!(key("posix,sysv,cma,self"), key("self, cma,sysv,posix,posix"));
        assert_eq!(key("sysv,,posix"), Some("posix,sysv".into()));
        assert_eq!(key("^tcp,cma"), key("^cma,tcp"));
        assert_ne!(key("^tcp"), key("tcp"));
        assert_ne!(key("posix,sysv"), key("posix,sysv,cma"));
        assert_eq!(transport_set(None), None);
    }

    /// Memory allocated for a transport list is served one-sided (with the allocation's
    /// handle, no second registration) by a target whose list names the same transports
    /// in another order; memory UCX did not allocate is counted as served by emulation.
    #[test]
    fn a_target_serves_memory_allocated_under_another_spelling_of_its_transports() {
        const LEN: usize = 64 * 1024;
        let buffer = UcxBuffer::alloc(&config("sysv,posix,cma,self"), LEN).expect("allocate");
        let target_config = config("posix, sysv,self,cma,posix");
        let mut heap = vec![0u8; LEN];
        let spans = [Span { ptr: buffer.as_ptr(), len: LEN }, Span { ptr: heap.as_mut_ptr(), len: LEN }];
        // SAFETY: the buffer and `heap` outlive the maps (dropped below, after them).
        let (ctx, worker, maps) = unsafe { setup(&target_config, &spans, true) }.expect("setup");
        assert!(!maps[0].owned, "the UCX-allocated region was registered again: gets would be emulated");
        assert!(maps[1].owned);
        assert_eq!(note_emulated_regions(&target_config, &maps), 1);
        drop(maps);
        drop(worker);
        drop(ctx);
        drop(buffer);
        drop(heap);
    }

    /// The shared context is used by several threads only if UCX made it thread-safe; the
    /// system UCX (built with `--enable-mt`) does, so `UcxBuffer` works here.
    #[test]
    fn the_shared_context_is_thread_safe_here() {
        match Context::shared(&config("posix,sysv,self")).expect("context") {
            SharedContext::Shared(ctx) => {
                assert_eq!(ctx.thread_mode().expect("query"), sys::UCS_THREAD_MODE_MULTI);
            }
            SharedContext::SingleThreaded(ctx) => {
                panic!("UCX gave thread mode {:?}: not shareable", ctx.thread_mode())
            }
        }
        // A private context asks for no thread safety.
        let private = Context::new(&config("posix,sysv,self"), false).expect("context");
        assert_ne!(private.thread_mode().expect("query"), sys::UCS_THREAD_MODE_MULTI);
    }

    /// The transports a context may use are those asked for, as UCX names them.
    #[test]
    fn a_context_lists_the_transports_it_may_use() {
        let names = Context::private(&config("posix,self")).expect("context").resources().expect("print");
        assert!(names.iter().any(|n| n == "posix/memory"), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("self/memory")), "{names:?}");
        assert!(names.iter().all(|n| n.starts_with("posix/") || n.starts_with("self/")), "{names:?}");
    }

    #[test]
    fn resource_lines_are_parsed() {
        let text = "#\n# UCP context\n#\n#     md 0  :  component 0  posix \n\
                    #     resource 0  :  md 0  dev 0  flags -- posix/memory\n\
                    #     resource 1  :  md 1  dev 1  flags -- tcp/lo\n\
                    #     resource 2  :  md 1  dev 1  flags -- tcp/lo\n";
        assert_eq!(parse_resources(text), ["posix/memory", "tcp/lo"]);
    }
}
