//! kvxfer's zero-copy UCX data path.
//!
//! A [`UcxTarget`] (prefill side) maps the KV-cache regions the worker already owns with
//! `ucp_mem_map`, packs an rkey per region and publishes them with its worker address
//! ([`TargetInfo`], carried in the handshake). A [`UcxInitiator`] (decode side) maps its own
//! regions, creates an endpoint per peer from that address, unpacks the rkeys, and reads
//! with `ucp_get_nbx` straight into its registered blocks. Regions inside a [`UcxBuffer`]
//! (memory UCX allocated) are served through shared memory, one-sided; others, with UCX
//! 1.13 over shared memory, by the target's thread answering emulated gets.
//!
//! UCX workers are single-threaded here (`UCS_THREAD_MODE_SINGLE`): a target's or
//! initiator's worker, endpoints, rkeys and memory maps live on one thread that owns them,
//! progresses the worker, and sleeps on the worker's event fd (`ucp_worker_arm` + `poll`)
//! when idle; other threads talk to it through a channel and wake it with
//! `ucp_worker_signal`. That thread releases them in a fixed order — rkeys, endpoints,
//! memory maps, worker — so no rkey outlives its endpoint, no endpoint its worker, and no
//! mapped region its completions. The *context* is not always the thread's own: targets
//! share the process's context for their transport set with [`UcxBuffer`] allocations (only
//! if UCX reports it thread-safe, `UCS_THREAD_MODE_MULTI`; else each target has its own and
//! `UcxBuffer::alloc` fails), so it is cleaned up (`ucp_cleanup`) by whichever holder lets
//! go of it last — a target's thread, or the thread dropping the last `UcxBuffer` — and an
//! allocation is unmapped by its buffer's drop, not by the targets that serve it. An
//! initiator's context is its own, created and cleaned up on its thread.

mod host;
mod raw;

pub use host::is_local_address;

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

pub use raw::{ucx_transports, ucx_version, UcxError, UcxVersion, MAX_RKEY_LEN, MAX_WORKER_ADDRESS_LEN};

/// UCX settings of an agent.
#[derive(Debug, Clone)]
pub struct UcxConfig {
    /// UCX transports to use (`UCX_TLS`, e.g. `"tcp"` or `"posix,cma,self"`); `None`: UCX's
    /// default (or the `UCX_TLS` environment variable).
    pub tls: Option<String>,
    /// Ask UCX to report a dead peer as an error on its endpoint
    /// (`UCP_ERR_HANDLING_MODE_PEER`). UCX 1.13's shared-memory transports (posix, sysv,
    /// cma) cannot do that, so with it on, reads between processes on one host go over tcp;
    /// with it off they use shared memory / CMA, and a dead peer surfaces as failed reads.
    pub peer_failure_handling: bool,
    /// With `peer_failure_handling` on: connect to a peer on this host
    /// ([`UcxInitiator::connect_on_host`] with `same_host`) without it, so UCX may read over
    /// shared memory / CMA (it will not with peer-failure handling, UCX 1.22 as 1.13); a
    /// dead peer on this host then surfaces as failed reads. Peers on other hosts keep it.
    /// On by default; [`UcxConfig::default`] is thus "peer-failure handling across hosts".
    pub same_host_shared_memory: bool,
    /// Check every one-sided read against a CRC-32C the prefill side takes when it pins the
    /// blocks. Off by default: UCX's transports carry their own integrity checks, the
    /// pin's `held` answer already tells a read that outlived its pin, and the two extra
    /// passes over the data halved shared-memory throughput on the 2-core test machine (see
    /// BENCHMARKING.md). On: end-to-end proof for a fabric or peer you do not trust.
    pub verify_payloads: bool,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            tls: None,
            peer_failure_handling: true,
            same_host_shared_memory: true,
            verify_payloads: false,
        }
    }
}

/// Memory allocated by UCX for a target's regions (`ucp_mem_map` with
/// `UCP_MEM_MAP_ALLOCATE`, from the process's shared context for the transports of the
/// [`UcxConfig`] it was allocated with).
///
/// Why: UCX 1.13 serves a `ucp_get_nbx` from memory it merely registered with *active
/// messages* over its shared-memory transports (the target's thread copies every fragment
/// into a reply; its CMA transport is never chosen for gets). Memory it allocated itself
/// lies in shared memory (sysv or posix) that a peer on the same host maps, so the peer's
/// gets are plain copies on the peer's side and the target's thread stays idle. A
/// [`UcxTarget`] started with the same transports serves any region inside such a buffer
/// that way; other regions are registered as before.
///
/// The contents start unspecified (UCX may fall back to heap memory). The memory is
/// released when the buffer is dropped, so keep it alive (for instance in a target's
/// `keep_alive`) until every target serving it is dropped. The drop unmaps it, and the
/// last holder of the shared context also cleans that up (`ucp_cleanup`): do not let it
/// run while the process exits (kvxfer's regions hand it to a tracked teardown thread).
///
/// Shared-memory rkeys outlive the target: a peer's initiator that unpacked an rkey of
/// this memory has the shared-memory segment mapped into its own process until it closes
/// that endpoint ([`UcxInitiator::disconnect`]), so the pages stay allocated after this
/// buffer is dropped or this process exits, and the peer's raw gets through the rkey keep
/// succeeding — reading stale bytes — with no error from UCX. kvxfer's own reads are
/// checked by their pin, and its decode side disconnects a peer it forgets.
pub struct UcxBuffer {
    ctx: Arc<raw::Context>,
    memh: usize,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is an allocation of a thread-safe context (see `raw::Context`) and
// its address; access to the bytes is the user's business, as for any raw allocation.
unsafe impl Send for UcxBuffer {}
// SAFETY: as above; `&UcxBuffer` only hands out the address and length.
unsafe impl Sync for UcxBuffer {}

impl UcxBuffer {
    /// Allocates at least `len` bytes (a whole number of pages) for the transports of
    /// `config`.
    ///
    /// Fails if UCX gives no thread-safe context (a UCX built without multi-threading
    /// support): the memory could then not be shared with targets' threads, so use ordinary
    /// memory (served by emulated gets) instead.
    pub fn alloc(config: &UcxConfig, len: usize) -> Result<Self, UcxError> {
        let ctx = match raw::Context::shared(config)? {
            raw::SharedContext::Shared(ctx) => ctx,
            raw::SharedContext::SingleThreaded(_) => return Err(UcxError::not_thread_safe()),
        };
        let (ptr, len, memh) = ctx.allocate(len)?;
        Ok(UcxBuffer { ctx, memh: memh as usize, ptr, len })
    }

    /// The start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes (what UCX allocated: at least what was asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: an empty allocation is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for UcxBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxBuffer").field("len", &self.len).finish_non_exhaustive()
    }
}

impl Drop for UcxBuffer {
    fn drop(&mut self) {
        // SAFETY: the handle came from `allocate` on this context and is freed once; the
        // owner's contract (struct docs) is that no target serves the memory any more.
        unsafe { self.ctx.free(self.memh as ucx_sys::ucp_mem_h) };
    }
}

/// One registered region of a target, as the initiator needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Start address in the target's address space.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// The packed rkey.
    pub rkey: Vec<u8>,
}

/// What an initiator needs to read a target's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetInfo {
    /// The target worker's address.
    pub worker_address: Vec<u8>,
    /// One entry per registered region.
    pub regions: Vec<RegionInfo>,
}

/// A span of memory to register: start address and length.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    /// Start address.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

// SAFETY: a Span is an address and a length handed to the UCX thread; the memory contract
// is on `UcxTarget::start` / `UcxInitiator::start`.
unsafe impl Send for Span {}

/// One contiguous read: `len` bytes from `remote_offset` in the peer's region
/// `remote_region` into local address `local`.
#[derive(Debug, Clone, Copy)]
pub struct GetPiece {
    /// Destination address in a region this initiator registered.
    pub local: *mut u8,
    /// Index of the peer's region.
    pub remote_region: usize,
    /// Offset in that region.
    pub remote_offset: u64,
    /// Bytes.
    pub len: usize,
}

// SAFETY: as for Span: the destination contract is on `UcxInitiator::get`.
unsafe impl Send for GetPiece {}

/// A completion callback, run on the UCX thread.
pub type Done<T> = Box<dyn FnOnce(Result<T, UcxError>) + Send>;

/// The prefill side: registered regions served to UCX initiators.
pub struct UcxTarget {
    info: TargetInfo,
    stop: Arc<AtomicBool>,
    signal: raw::Signal,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UcxTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxTarget").field("regions", &self.info.regions.len()).finish_non_exhaustive()
    }
}

impl UcxTarget {
    /// Maps `regions` and starts the progress thread.
    ///
    /// # Safety
    /// Each span is valid for reads (by remote peers, at any time) until this target is
    /// dropped; `keep_alive` owns or pins that memory and is dropped only after the regions
    /// are unmapped.
    pub unsafe fn start(
        config: &UcxConfig,
        regions: Vec<Span>,
        keep_alive: Arc<dyn Any + Send + Sync>,
    ) -> Result<Self, UcxError> {
        let stop = Arc::new(AtomicBool::new(false));
        let config = config.clone();
        let thread_stop = stop.clone();
        let ((info, signal), thread) = spawn("kvxfer-ucx-target", move |ready| {
            raw::run_target(&config, regions, keep_alive, &thread_stop, ready)
        })?;
        Ok(UcxTarget { info, stop, signal, thread: Some(thread) })
    }

    /// What initiators need: worker address and per-region rkeys.
    pub fn info(&self) -> &TargetInfo {
        &self.info
    }
}

impl Drop for UcxTarget {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.signal.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts the thread that owns a target's or initiator's UCX objects and waits until it has
/// set them up (its `ready` report) or failed.
fn spawn<R: Send + 'static>(
    name: &str,
    body: impl FnOnce(Sender<Result<R, UcxError>>) + Send + 'static,
) -> Result<(R, JoinHandle<()>), UcxError> {
    let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || body(ready_tx))
        .map_err(|e| UcxError::thread(&e))?;
    match ready_rx.recv() {
        Ok(Ok(r)) => Ok((r, thread)),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(UcxError::thread_died())
        }
    }
}

enum Command {
    Connect { peer: String, info: TargetInfo, same_host: bool, done: Done<Vec<String>> },
    Get { peer: String, pieces: Vec<GetPiece>, done: Done<u64> },
    Disconnect { peer: String },
    Abort { peer: String },
}

/// The decode side: reads peers' regions into its own registered regions.
///
/// An endpoint and the rkeys unpacked for it stay until [`UcxInitiator::disconnect`] (or a
/// `connect` replacing it, or the initiator's drop): over shared memory an rkey maps the
/// peer's memory into this process, so disconnect peers you forget (see [`UcxBuffer`]).
pub struct UcxInitiator {
    commands: Sender<Command>,
    stop: Arc<AtomicBool>,
    signal: raw::Signal,
    endpoints: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UcxInitiator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxInitiator").finish_non_exhaustive()
    }
}

impl UcxInitiator {
    /// Maps the local `regions` (destinations of reads) and starts the UCX thread.
    ///
    /// # Safety
    /// Each span is valid for writes until this initiator is dropped; `keep_alive` owns or
    /// pins that memory and is dropped only after the regions are unmapped.
    pub unsafe fn start(
        config: &UcxConfig,
        regions: Vec<Span>,
        keep_alive: Arc<dyn Any + Send + Sync>,
    ) -> Result<Self, UcxError> {
        let (commands, command_rx): (Sender<Command>, Receiver<Command>) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let config = config.clone();
        let thread_stop = stop.clone();
        let endpoints = Arc::new(AtomicUsize::new(0));
        let thread_endpoints = endpoints.clone();
        let (signal, thread) = spawn("kvxfer-ucx-initiator", move |ready| {
            let loop_state = raw::InitiatorLoop {
                stop: &thread_stop,
                commands: &command_rx,
                endpoints: &thread_endpoints,
            };
            raw::run_initiator(&config, regions, keep_alive, loop_state, ready)
        })?;
        Ok(UcxInitiator { commands, stop, signal, endpoints, thread: Some(thread) })
    }

    fn send(&self, c: Command) -> Result<(), Command> {
        self.commands.send(c).map_err(|e| e.0)?;
        self.signal.wake();
        Ok(())
    }

    /// Endpoints the initiator holds open: one per connected peer, plus those still wiring
    /// up or closing (as of its thread's last pass; updated after every command).
    pub fn open_endpoints(&self) -> usize {
        self.endpoints.load(Ordering::Acquire)
    }

    /// A handle that disconnects peers of this initiator ([`UcxInitiator::disconnect`]) from
    /// any thread, for an owner of one peer's endpoint that does not hold the initiator
    /// (e.g. a peer record that closes its endpoint when dropped).
    pub fn disconnector(&self) -> Disconnector {
        Disconnector { commands: self.commands.clone(), signal: self.signal.clone() }
    }

    /// Creates (or replaces) the endpoint to `peer` and unpacks its rkeys; `done` runs once
    /// the endpoint is wired up both ways, with the transports it uses as UCX names them
    /// (`"<transport>/<device>"`; empty where UCX < 1.14 cannot say) (so the target holds nothing of its wire-up
    /// queued: see ARCHITECTURE.md, UCX notes), or with an error if that takes over 5 s
    /// (the endpoint is then closed once its wire-up ends). Reads can be issued once `done`
    /// reported `Ok`. An endpoint it replaces is closed once the reads issued on it finish —
    /// a read that never completes holds up only its own endpoint, never a new one. The
    /// worker address and rkeys are length-checked first (non-empty, at most
    /// [`MAX_WORKER_ADDRESS_LEN`] / [`MAX_RKEY_LEN`] bytes) and every region's `base + len`
    /// must fit in 64 bits; their contents are opaque to kvxfer and parsed by UCX itself
    /// (UCX takes no length for them), so connect only to peers that passed the handshake.
    pub fn connect(&self, peer: &str, info: TargetInfo, done: Done<Vec<String>>) {
        self.connect_on_host(peer, info, false, done);
    }

    /// [`UcxInitiator::connect`] to a peer that is (`same_host`) or may not be on this host:
    /// see [`UcxConfig::same_host_shared_memory`].
    pub fn connect_on_host(&self, peer: &str, info: TargetInfo, same_host: bool, done: Done<Vec<String>>) {
        if let Err(Command::Connect { done, .. }) =
            self.send(Command::Connect { peer: peer.to_owned(), info, same_host, done })
        {
            done(Err(UcxError::thread_died()));
        }
    }

    /// Reads every piece from `peer`; `done` gets the bytes read, or the first error.
    ///
    /// # Safety
    /// Every `piece.local .. piece.local + piece.len` lies inside a region registered with
    /// [`UcxInitiator::start`], and nobody else reads or writes it until `done` runs.
    pub unsafe fn get(&self, peer: &str, pieces: Vec<GetPiece>, done: Done<u64>) {
        if let Err(Command::Get { done, .. }) =
            self.send(Command::Get { peer: peer.to_owned(), pieces, done })
        {
            done(Err(UcxError::thread_died()));
        }
    }

    /// Takes the endpoint to `peer` out of use now (a later `get` fails until the next
    /// `connect`) and closes it once no read from it is in flight (after a failure, or when
    /// the peer restarted). A `connect` to the same peer right after it gets a new endpoint
    /// that this close does not touch.
    pub fn disconnect(&self, peer: &str) {
        let _ = self.send(Command::Disconnect { peer: peer.to_owned() });
    }

    /// Closes the endpoint to `peer` now, forcefully: reads in flight from it complete with
    /// an error (their `done` runs). For a peer that stopped answering.
    pub fn abort(&self, peer: &str) {
        let _ = self.send(Command::Abort { peer: peer.to_owned() });
    }
}

/// Disconnects peers of a [`UcxInitiator`] from any thread ([`UcxInitiator::disconnector`]);
/// does nothing once the initiator has stopped.
#[derive(Clone)]
pub struct Disconnector {
    commands: Sender<Command>,
    signal: raw::Signal,
}

impl std::fmt::Debug for Disconnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disconnector").finish_non_exhaustive()
    }
}

impl Disconnector {
    /// As [`UcxInitiator::disconnect`].
    pub fn disconnect(&self, peer: &str) {
        if self.commands.send(Command::Disconnect { peer: peer.to_owned() }).is_ok() {
            self.signal.wake();
        }
    }
}

impl Drop for UcxInitiator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.signal.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
