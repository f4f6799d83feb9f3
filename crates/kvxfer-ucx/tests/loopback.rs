//! A target and an initiator in one process: reads land byte-exact, bounds are enforced,
//! over UCX's tcp and shared-memory transports.

use std::sync::Arc;

use kvxfer_ucx::{GetPiece, Span, UcxConfig, UcxInitiator, UcxTarget};

fn run(tls: &str, peer_failure_handling: bool) {
    let config = UcxConfig { tls: Some(tls.to_owned()), peer_failure_handling, ..UcxConfig::default() };
    let src: Arc<Vec<u8>> =
        Arc::new((0..1 << 20).map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8).collect());
    let mut dst_buf = vec![0u8; 1 << 20];
    let src_span = Span { ptr: src.as_ptr().cast_mut(), len: src.len() };
    let dst_span = Span { ptr: dst_buf.as_mut_ptr(), len: dst_buf.len() };
    // SAFETY: `src` is kept alive by the target (keep_alive) and never written; `dst_buf`
    // outlives the initiator (dropped at the end of this function, after it) and is only
    // read after the gets completed.
    let target = unsafe { UcxTarget::start(&config, vec![src_span], src.clone()) }.expect("target");
    // SAFETY: see above: dst_buf outlives the initiator.
    let initiator = unsafe { UcxInitiator::start(&config, vec![dst_span], Arc::new(())) }.expect("initiator");
    let (tx, rx) = crossbeam_channel::bounded(1);
    initiator.connect("peer", target.info().clone(), Box::new(move |r| tx.send(r).expect("send")));
    let transports = rx.recv().expect("reply").expect("connect");
    // UCX >= 1.14 names the endpoint's transports ("<transport>/<device>"), each one of those
    // asked for; older UCX cannot say.
    if cfg!(ucx_ep_transports) {
        assert!(!transports.is_empty(), "UCX named no transport for {tls}");
        for t in &transports {
            let name = t.split('/').next().unwrap_or_default();
            assert!(tls.split(',').any(|asked| asked == name), "{t} is not one of {tls}");
        }
    } else {
        assert!(transports.is_empty(), "{transports:?}");
    }

    let pieces = vec![
        GetPiece { local: dst_span.ptr, remote_region: 0, remote_offset: 4096, len: 65536 },
        GetPiece {
            // SAFETY: 100_000 is inside dst_buf (1 MiB).
            local: unsafe { dst_span.ptr.add(100_000) },
            remote_region: 0,
            remote_offset: 500_000,
            len: 300_000,
        },
    ];
    let (tx, rx) = crossbeam_channel::bounded(1);
    // SAFETY: both destinations are inside the registered dst_buf and untouched until done.
    unsafe { initiator.get("peer", pieces, Box::new(move |r| tx.send(r).expect("send"))) };
    assert_eq!(rx.recv().expect("reply").expect("get"), 365_536);
    assert_eq!(&dst_buf[..65536], &src[4096..4096 + 65536]);
    assert_eq!(&dst_buf[100_000..400_000], &src[500_000..800_000]);

    // Out of the peer's region: refused before anything is issued.
    let (tx, rx) = crossbeam_channel::bounded(1);
    let bad =
        vec![GetPiece { local: dst_span.ptr, remote_region: 0, remote_offset: (1 << 20) - 10, len: 11 }];
    // SAFETY: as above.
    unsafe { initiator.get("peer", bad, Box::new(move |r| tx.send(r).expect("send"))) };
    let err = rx.recv().expect("reply").expect_err("out of bounds");
    assert!(err.to_string().contains("outside the peer's region"), "{err}");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let bad = vec![GetPiece { local: dst_span.ptr, remote_region: 3, remote_offset: 0, len: 1 }];
    // SAFETY: as above.
    unsafe { initiator.get("peer", bad, Box::new(move |r| tx.send(r).expect("send"))) };
    assert!(rx.recv().expect("reply").is_err());
    let (tx, rx) = crossbeam_channel::bounded(1);
    // SAFETY: as above.
    unsafe { initiator.get("nobody", vec![], Box::new(move |r| tx.send(r).expect("send"))) };
    assert!(rx.recv().expect("reply").expect_err("unknown peer").to_string().contains("no endpoint"));

    // A disconnect from another thread, through a `Disconnector`, closes the endpoint (and
    // its rkeys): the initiator holds none afterwards and reads from the peer fail.
    wait_until("one endpoint", || initiator.open_endpoints() == 1);
    let disconnector = initiator.disconnector();
    std::thread::spawn(move || disconnector.disconnect("peer")).join().expect("disconnect");
    wait_until("no endpoint", || initiator.open_endpoints() == 0);
    let (tx, rx) = crossbeam_channel::bounded(1);
    let piece = vec![GetPiece { local: dst_span.ptr, remote_region: 0, remote_offset: 0, len: 1 }];
    // SAFETY: as above.
    unsafe { initiator.get("peer", piece, Box::new(move |r| tx.send(r).expect("send"))) };
    assert!(rx.recv().expect("reply").expect_err("disconnected").to_string().contains("no endpoint"));
    drop(initiator);
    drop(target);
    drop(dst_buf);
}

/// Polls `cond` (the initiator's thread updates what it reads) until it holds; panics
/// after 10 s.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

#[test]
fn get_over_ucx_tcp() {
    run("tcp", true);
}

#[test]
fn get_over_ucx_shared_memory() {
    run("posix,cma,self", false);
}

#[test]
fn unknown_transport_is_a_clear_error() {
    let config = UcxConfig { tls: Some("no_such_transport".into()), ..UcxConfig::default() };
    let buf = vec![0u8; 4096];
    let span = Span { ptr: buf.as_ptr().cast_mut(), len: buf.len() };
    // SAFETY: `buf` outlives the attempt (start fails or the target is dropped at once).
    let r = unsafe { UcxTarget::start(&config, vec![span], Arc::new(())) };
    if let Ok(t) = &r {
        // UCX may accept an unknown name and fall back; then at least it must be usable.
        assert!(!t.info().worker_address.is_empty());
    }
}

/// A Disconnect followed by a Connect to the same peer in one command batch used to close
/// the new endpoint (the pending close was by peer name). The UCX thread is held inside the
/// first connect's completion while both commands queue, so they land in one batch.
#[test]
fn disconnect_then_connect_in_one_batch_keeps_the_new_endpoint() {
    let config = UcxConfig { tls: Some("tcp".into()), peer_failure_handling: true, ..UcxConfig::default() };
    let src: Arc<Vec<u8>> = Arc::new((0..65536u32).map(|i| (i % 251) as u8).collect());
    let mut dst_buf = vec![0u8; 65536];
    let src_span = Span { ptr: src.as_ptr().cast_mut(), len: src.len() };
    let dst_span = Span { ptr: dst_buf.as_mut_ptr(), len: dst_buf.len() };
    // SAFETY: `src` is kept alive by the target and never written; `dst_buf` outlives the
    // initiator and is read only after the get completed.
    let target = unsafe { UcxTarget::start(&config, vec![src_span], src.clone()) }.expect("target");
    // SAFETY: as above.
    let initiator = unsafe { UcxInitiator::start(&config, vec![dst_span], Arc::new(())) }.expect("initiator");
    let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(0);
    let (tx, rx) = crossbeam_channel::bounded(1);
    initiator.connect(
        "peer",
        target.info().clone(),
        Box::new(move |r| {
            tx.send(r).expect("send");
            // Hold the UCX thread until the next two commands are queued.
            let _ = gate_rx.recv();
        }),
    );
    rx.recv().expect("reply").expect("first connect");
    initiator.disconnect("peer");
    let (tx, rx) = crossbeam_channel::bounded(1);
    initiator.connect("peer", target.info().clone(), Box::new(move |r| tx.send(r).expect("send")));
    gate_tx.send(()).expect("release the UCX thread");
    rx.recv().expect("reply").expect("second connect");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let pieces = vec![GetPiece { local: dst_span.ptr, remote_region: 0, remote_offset: 0, len: 65536 }];
    // SAFETY: the destination is the registered dst_buf, untouched until done.
    unsafe { initiator.get("peer", pieces, Box::new(move |r| tx.send(r).expect("send"))) };
    assert_eq!(rx.recv().expect("reply").expect("the new endpoint reads"), 65536);
    assert_eq!(&dst_buf[..], &src[..]);
    drop(initiator);
    drop(target);
    drop(dst_buf);
}

/// Bytes from a peer are length-checked before they reach `ucp_ep_create` and
/// `ucp_ep_rkey_unpack`, and a region that wraps the address space is refused, each with a
/// clear error (and no endpoint is made).
#[test]
fn malformed_target_info_is_refused_before_it_reaches_ucx() {
    let config = UcxConfig { tls: Some("tcp".into()), peer_failure_handling: true, ..UcxConfig::default() };
    let src: Arc<Vec<u8>> = Arc::new(vec![7u8; 4096]);
    let mut dst_buf = vec![0u8; 4096];
    let src_span = Span { ptr: src.as_ptr().cast_mut(), len: src.len() };
    let dst_span = Span { ptr: dst_buf.as_mut_ptr(), len: dst_buf.len() };
    // SAFETY: `src` is kept alive by the target; `dst_buf` outlives the initiator.
    let target = unsafe { UcxTarget::start(&config, vec![src_span], src.clone()) }.expect("target");
    // SAFETY: as above.
    let initiator = unsafe { UcxInitiator::start(&config, vec![dst_span], Arc::new(())) }.expect("initiator");
    let good = target.info().clone();
    let connect = |info: kvxfer_ucx::TargetInfo| {
        let (tx, rx) = crossbeam_channel::bounded(1);
        initiator.connect("peer", info, Box::new(move |r| tx.send(r).expect("send")));
        rx.recv().expect("reply")
    };
    let mut empty_address = good.clone();
    empty_address.worker_address.clear();
    let mut huge_address = good.clone();
    huge_address.worker_address = vec![0; kvxfer_ucx::MAX_WORKER_ADDRESS_LEN + 1];
    let mut empty_rkey = good.clone();
    empty_rkey.regions[0].rkey.clear();
    let mut huge_rkey = good.clone();
    huge_rkey.regions[0].rkey = vec![0; kvxfer_ucx::MAX_RKEY_LEN + 1];
    let mut wrapping = good.clone();
    wrapping.regions[0].base = u64::MAX - 100;
    for (info, what) in [
        (empty_address, "worker address is 0 bytes"),
        (huge_address, "worker address is 65537 bytes"),
        (empty_rkey, "rkey of region 0 is 0 bytes"),
        (huge_rkey, "rkey of region 0 is 16385 bytes"),
        (wrapping, "wraps around the address space"),
    ] {
        let err = connect(info).expect_err(what);
        assert!(err.to_string().contains(what), "{err}");
    }
    // Nothing was connected, and the good info still works.
    let (tx, rx) = crossbeam_channel::bounded(1);
    // SAFETY: no piece, nothing is written.
    unsafe { initiator.get("peer", vec![], Box::new(move |r| tx.send(r).expect("send"))) };
    assert!(rx.recv().expect("reply").is_err(), "no endpoint was made");
    connect(good).expect("the real info connects");
    drop(initiator);
    drop(target);
    drop(dst_buf);
}

/// A UCX worker (tcp) that answers nothing until a thread progresses it: a target that is
/// alive but has not yet handled our wire-up request.
struct IdleWorker {
    ctx: ucx_sys::ucp_context_h,
    worker: ucx_sys::ucp_worker_h,
    address: Vec<u8>,
}

impl IdleWorker {
    fn new() -> IdleWorker {
        use std::ptr::{null, null_mut};
        use ucx_sys as sys;
        let mut cfg: *mut sys::ucp_config_t = null_mut();
        // SAFETY: default prefix and file; `cfg` is valid for a write.
        assert_eq!(unsafe { sys::ucp_config_read(null(), null(), &mut cfg) }, sys::UCS_OK);
        // SAFETY: `cfg` is a live config; both strings are NUL-terminated.
        assert_eq!(unsafe { sys::ucp_config_modify(cfg, c"TLS".as_ptr(), c"tcp".as_ptr()) }, sys::UCS_OK);
        let params = sys::ucp_params_t {
            field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
            features: u64::from(sys::UCP_FEATURE_RMA),
            ..Default::default()
        };
        let mut ctx: sys::ucp_context_h = null_mut();
        // SAFETY: params initialised for its mask, live config, `ctx` valid for a write.
        assert_eq!(unsafe { sys::ucp_init(&params, cfg, &mut ctx) }, sys::UCS_OK);
        // SAFETY: `cfg` came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(cfg) };
        let wparams = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut worker: sys::ucp_worker_h = null_mut();
        // SAFETY: live context, initialised params, `worker` valid for a write.
        assert_eq!(unsafe { sys::ucp_worker_create(ctx, &wparams, &mut worker) }, sys::UCS_OK);
        let mut addr: *mut sys::ucp_address_t = null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; out-pointers valid for writes.
        assert_eq!(unsafe { sys::ucp_worker_get_address(worker, &mut addr, &mut len) }, sys::UCS_OK);
        // SAFETY: UCX returned `len` readable bytes at `addr`, copied before release.
        let address = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker; released once.
        unsafe { sys::ucp_worker_release_address(worker, addr) };
        IdleWorker { ctx, worker, address }
    }

    /// Progresses the worker on a thread of its own until `stop` is set.
    fn progress_until(&self, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<()> {
        let worker = self.worker as usize;
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                // SAFETY: the worker outlives this thread (joined before it is destroyed),
                // and only this thread uses it meanwhile.
                unsafe { ucx_sys::ucp_worker_progress(worker as ucx_sys::ucp_worker_h) };
            }
        })
    }
}

impl Drop for IdleWorker {
    fn drop(&mut self) {
        // SAFETY: live handles, no thread progresses the worker any more; worker first.
        unsafe {
            ucx_sys::ucp_worker_destroy(self.worker);
            ucx_sys::ucp_cleanup(self.ctx);
        }
    }
}

/// `connect` reports an endpoint only once the target has answered its wire-up. Until then
/// the target may hold its reply queued for us, and UCX 1.13 aborts the target's process if
/// this side vanishes meanwhile (ARCHITECTURE.md, UCX notes) — so an endpoint handed out
/// (and a read started, or this process killed) before that point puts the target at risk.
#[test]
fn connect_reports_an_endpoint_only_once_the_target_answered_its_wire_up() {
    let config = UcxConfig { tls: Some("tcp".into()), peer_failure_handling: true, ..UcxConfig::default() };
    let target = IdleWorker::new();
    let mut dst_buf = vec![0u8; 4096];
    let dst_span = Span { ptr: dst_buf.as_mut_ptr(), len: dst_buf.len() };
    // SAFETY: `dst_buf` outlives the initiator and nothing is read into it.
    let initiator = unsafe { UcxInitiator::start(&config, vec![dst_span], Arc::new(())) }.expect("initiator");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let info = kvxfer_ucx::TargetInfo { worker_address: target.address.clone(), regions: vec![] };
    initiator.connect("idle", info, Box::new(move |r| tx.send(r).expect("send")));
    // The target has not handled our wire-up request (nothing progresses it), so the connect
    // cannot have finished, however long it is given.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(rx.try_recv().is_err(), "the connect reported before the target answered its wire-up");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let progress = target.progress_until(stop.clone());
    rx.recv_timeout(std::time::Duration::from_secs(30)).expect("connect answered").expect("connect");
    drop(initiator);
    stop.store(true, std::sync::atomic::Ordering::Release);
    progress.join().expect("progress thread");
    drop(target);
    drop(dst_buf);
}

/// An initiator stopped while a target has not answered its wire-up (it never progresses)
/// shuts down cleanly: the connect fails, the endpoint's graceful close gives up after its
/// bound, and that unanswered close request is released — destroying the worker with it
/// unreleased trips UCX 1.13's assertion (`ucp_ep.c:382 ... UCP_REQUEST_FLAG_RELEASED`)
/// and aborts this process.
#[test]
fn an_initiator_stopped_during_an_unanswered_wire_up_shuts_down_cleanly() {
    let config = UcxConfig { tls: Some("tcp".into()), peer_failure_handling: true, ..UcxConfig::default() };
    let target = IdleWorker::new();
    let mut dst_buf = vec![0u8; 4096];
    let dst_span = Span { ptr: dst_buf.as_mut_ptr(), len: dst_buf.len() };
    // SAFETY: `dst_buf` outlives the initiator and nothing is read into it.
    let initiator = unsafe { UcxInitiator::start(&config, vec![dst_span], Arc::new(())) }.expect("initiator");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let info = kvxfer_ucx::TargetInfo { worker_address: target.address.clone(), regions: vec![] };
    initiator.connect("silent", info, Box::new(move |r| drop(tx.send(r))));
    drop(initiator);
    let answer = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("connect answered");
    assert!(answer.is_err(), "a connect the target never answered reported an endpoint");
    drop(target);
    drop(dst_buf);
}
