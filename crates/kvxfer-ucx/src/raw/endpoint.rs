//! The initiator's endpoint to one target, with the target's rkeys (RAII: rkeys are
//! destroyed before their endpoint is closed), and the checks a peer's target info passes
//! before any of it reaches UCX.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::debug;
use ucx_sys as sys;

use super::error::{check, UcxError};
use super::handles::Worker;
use crate::TargetInfo;

/// An unpacked remote key.
pub(super) struct Rkey(pub(super) sys::ucp_rkey_h);

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: live rkey; dropped before its endpoint is closed and after its last get.
        unsafe { sys::ucp_rkey_destroy(self.0) };
    }
}

/// An endpoint to one target with its rkeys. `failed` is set by UCX's error callback.
pub(super) struct PeerEp {
    /// The endpoint handle.
    pub(super) ep: sys::ucp_ep_h,
    /// Whether the endpoint has peer-failure handling (needed for a forced close).
    peer_failure: bool,
    /// One unpacked rkey per region of the target.
    pub(super) rkeys: Vec<Rkey>,
    /// Start address and length of each region of the target.
    pub(super) regions: Vec<(u64, u64)>,
    /// Set by UCX's error callback when the endpoint failed.
    pub(super) failed: Box<AtomicBool>,
}

/// UCX's error callback of an endpoint: marks it failed.
///
/// # Safety
/// `arg` points to the `failed` flag of a live `PeerEp` (UCX passes back the argument
/// given at `ucp_ep_create`).
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

impl PeerEp {
    /// An endpoint to the target `info` describes, with its rkeys unpacked.
    pub(super) fn connect(worker: &Worker, info: &TargetInfo, peer_failure: bool) -> Result<Self, UcxError> {
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

    /// The transports the endpoint uses, as UCX names them (`"<transport>/<device>"`, e.g.
    /// `"posix/memory"`, `"cma/memory"`, `"tcp/lo"`), one per lane, in UCX's order and
    /// without repeats; empty when the loaded UCX cannot say (the query came in UCX 1.14;
    /// the headers built against decide whether it is asked).
    pub(super) fn transports(&self) -> Vec<String> {
        #[cfg(ucx_ep_transports)]
        {
            const MAX: usize = 32;
            let mut entries = [sys::ucp_transport_entry_t {
                transport_name: std::ptr::null(),
                device_name: std::ptr::null(),
            }; MAX];
            let mut attr = sys::ucp_ep_attr_t {
                field_mask: u64::from(sys::UCP_EP_ATTR_FIELD_TRANSPORTS),
                ..Default::default()
            };
            attr.transports.entries = entries.as_mut_ptr();
            attr.transports.num_entries = MAX as u32;
            attr.transports.entry_size = std::mem::size_of::<sys::ucp_transport_entry_t>();
            // SAFETY: live endpoint; `entries` has room for `num_entries` entries of
            // `entry_size` bytes and outlives the call; UCX writes at most that many.
            let st = unsafe { sys::ucp_ep_query(self.ep, &mut attr) };
            if check("ucp_ep_query", st).is_err() {
                return Vec::new();
            }
            let name = |p: *const std::ffi::c_char| {
                if p.is_null() {
                    String::new()
                } else {
                    // SAFETY: UCX's NUL-terminated name, valid while the endpoint is open.
                    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            };
            let mut out: Vec<String> = Vec::new();
            for e in entries.iter().take((attr.transports.num_entries as usize).min(MAX)) {
                let t = format!("{}/{}", name(e.transport_name), name(e.device_name));
                if !out.contains(&t) {
                    out.push(t);
                }
            }
            out
        }
        #[cfg(not(ucx_ep_transports))]
        Vec::new()
    }

    /// Starts the endpoint's wire-up check: a flush, which UCX completes only once the
    /// endpoint is connected both ways (the target's reply to our wire-up request has
    /// arrived, so the target no longer holds it queued). `None`: already wired up.
    pub(super) fn start_wireup(&self) -> Result<Option<Wireup>, UcxError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint; no callback, so UCX keeps no pointer of ours.
        let req = unsafe { sys::ucp_ep_flush_nbx(self.ep, &param) };
        if req.is_null() {
            Ok(None)
        } else if sys::UCS_PTR_IS_ERR(req) {
            Err(UcxError::status("ucp_ep_flush_nbx", sys::UCS_PTR_STATUS(req)))
        } else {
            Ok(Some(Wireup(req)))
        }
    }

    /// Destroys the rkeys, then closes the endpoint once: gracefully (flush, and tell the
    /// peer so its side is removed cleanly — UCX 1.13 can abort in wire-up when a peer's
    /// endpoint just vanishes), or forcefully when the peer has already failed. A graceful
    /// close that does not finish in time is left to the worker's destruction.
    pub(super) fn close(mut self, worker: &Worker) {
        self.rkeys.clear();
        let force = self.peer_failure && self.failed.load(Ordering::Acquire);
        if let Err(e) = self.close_endpoint(worker, force) {
            debug!(error = %e, force, "closing a UCX endpoint");
        }
    }

    /// Closes the endpoint with reads possibly in flight: forcefully where UCX allows it
    /// (peer-failure handling on), so UCX completes them with an error (running their
    /// callbacks); gracefully otherwise. The rkeys, no longer used by any request, are
    /// destroyed after it.
    pub(super) fn abort(mut self, worker: &Worker) {
        let rkeys = std::mem::take(&mut self.rkeys);
        if let Err(e) = self.close_endpoint(worker, self.peer_failure) {
            debug!(error = %e, "aborting a UCX endpoint");
        }
        worker.progress_all();
        drop(rkeys);
    }

    /// Closes the endpoint — forcefully (`UCP_EP_CLOSE_FLAG_FORCE`) when `force`, else
    /// gracefully — and waits up to 2 s for the close to complete. Called once, by
    /// [`PeerEp::close`] or [`PeerEp::abort`], which consume the endpoint.
    fn close_endpoint(&self, worker: &Worker, force: bool) -> Result<(), UcxError> {
        let param = if force {
            sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
                ..Default::default()
            }
        } else {
            sys::ucp_request_param_t::default()
        };
        // SAFETY: live endpoint, closed exactly once: its only callers consume the PeerEp.
        let req = unsafe { sys::ucp_ep_close_nbx(self.ep, &param) };
        worker.wait_request(req, Instant::now() + Duration::from_secs(2))
    }
}

/// An endpoint's wire-up under way: the flush request of [`PeerEp::start_wireup`]. Dropping
/// it releases the request (UCX frees one still in flight when it completes; it has no
/// callback). Dropped before its worker (thread loop order).
pub(super) struct Wireup(sys::ucs_status_ptr_t);

impl Wireup {
    /// `None` while the wire-up runs; then whether it succeeded.
    pub(super) fn poll(&self) -> Option<Result<(), UcxError>> {
        // SAFETY: a live request of ours (released only in Drop).
        let status = unsafe { sys::ucp_request_check_status(self.0) };
        (status != sys::UCS_INPROGRESS).then(|| check("wire-up", status))
    }
}

impl Drop for Wireup {
    fn drop(&mut self) {
        // SAFETY: a request of ours, released once; UCX allows releasing one still in
        // flight (it is freed when it completes, and runs no callback).
        unsafe { sys::ucp_request_free(self.0) };
    }
}
