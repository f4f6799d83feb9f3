//! Runtimes and threads: the small runtime of a blocking agent, and dropping values whose
//! drop may block or is UCX teardown (a UCX object joins its thread; UCX-allocated memory
//! is unmapped) off the runtime's threads, tracked for [`wait_for_teardown`].

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, Runtime};

use crate::Error;

/// The runtime a blocking agent owns (and the Python binding's agents): with
/// `worker_threads` ≥ 1 a multi-thread runtime of that many workers; with 0 a current-thread
/// runtime that one thread of its own drives, so the agent's tasks, timers and sockets all
/// run on that thread and a hand-off wakes no other worker. Other threads stay as they are
/// in both modes: a prefill agent's front door (`kvxfer-accept`), tokio's blocking pool
/// (pin CRCs, starting UCX) and UCX's progress thread. Threads are named `name`.
#[derive(Debug)]
pub struct AgentRuntime {
    handle: Handle,
    /// `None` once stopped.
    kind: Option<Kind>,
}

#[derive(Debug)]
enum Kind {
    Multi(Runtime),
    /// The driver thread runs `block_on` until `stop` fires (or is dropped), then hands the
    /// runtime back through its join handle.
    Current {
        stop: tokio::sync::oneshot::Sender<()>,
        driver: std::thread::JoinHandle<Runtime>,
    },
}

impl AgentRuntime {
    /// Starts the runtime: `worker_threads` workers, or with 0 one driver thread of a
    /// current-thread runtime. Threads are named `name`.
    pub fn start(name: &str, worker_threads: usize) -> std::io::Result<Self> {
        if worker_threads > 0 {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(worker_threads)
                .thread_name(name)
                .enable_all()
                .build()?;
            return Ok(AgentRuntime { handle: rt.handle().clone(), kind: Some(Kind::Multi(rt)) });
        }
        // The name also goes to the runtime's blocking-pool threads.
        let rt = tokio::runtime::Builder::new_current_thread().thread_name(name).enable_all().build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let driver = std::thread::Builder::new().name(name.to_owned()).spawn(move || {
            // Returns once `stop` fires or is dropped; the tasks stay in the runtime, for
            // its owner to shut down.
            rt.block_on(async {
                let _ = stopped.await;
            });
            rt
        })?;
        Ok(AgentRuntime { handle, kind: Some(Kind::Current { stop, driver }) })
    }

    /// A handle to spawn on and enter.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Whether the calling thread is this runtime's driver (a current-thread runtime's one
    /// thread), where nothing may wait for the runtime.
    pub fn on_driver(&self) -> bool {
        matches!(&self.kind, Some(Kind::Current { driver, .. }) if driver.thread().id() == std::thread::current().id())
    }

    /// Runs `fut` to completion on the calling thread while the runtime drives its I/O and
    /// timers. Call it from a thread outside any runtime.
    ///
    /// # Panics
    /// On the runtime's own driver thread, where it could never finish.
    pub fn block_on<F: std::future::Future>(&self, fut: F) -> F::Output {
        assert!(
            !self.on_driver(),
            "AgentRuntime::block_on on the runtime's own driver thread would never finish"
        );
        wait(&self.handle, fut)
    }

    /// Stops the runtime. From a plain thread it waits up to `timeout` for its tasks to
    /// stop (a current-thread runtime's driver first finishes the poll it is in). Inside a
    /// runtime it does not wait: tasks are cancelled in the background (a current-thread
    /// runtime's driver is joined on a `kvxfer-teardown` thread, see
    /// [`wait_for_teardown`]; on the driver itself, by the driver as it ends).
    pub fn shutdown_timeout(mut self, timeout: Duration) {
        self.stop(timeout);
    }

    fn stop(&mut self, timeout: Duration) {
        let on_driver = self.on_driver();
        match self.kind.take() {
            None => {}
            Some(Kind::Multi(rt)) => {
                if in_runtime() {
                    rt.shutdown_background();
                } else {
                    rt.shutdown_timeout(timeout);
                }
            }
            Some(Kind::Current { stop, driver }) => {
                let _ = stop.send(());
                if on_driver {
                    // A task on the driver cannot join it: its `block_on` returns after this
                    // poll and the thread drops the runtime (and its tasks) as it ends.
                    return;
                }
                let join = move || {
                    // The driver cannot panic (tokio catches task panics); if it did, its
                    // runtime went with it.
                    if let Ok(rt) = driver.join() {
                        rt.shutdown_timeout(timeout);
                    }
                };
                if in_runtime() {
                    spawn_teardown(join);
                } else {
                    join();
                }
            }
        }
    }
}

impl Drop for AgentRuntime {
    /// As [`AgentRuntime::shutdown_timeout`] with 2 s, for a runtime its owner did not shut
    /// down (an agent that failed to start).
    fn drop(&mut self) {
        self.stop(Duration::from_secs(2));
    }
}

/// Runs `fut` to completion on the calling thread, with `handle`'s runtime driving its I/O
/// and timers.
pub(crate) fn wait<F: std::future::Future>(handle: &Handle, fut: F) -> F::Output {
    let _enter = handle.enter();
    futures::executor::block_on(fut)
}

/// Starts a blocking agent's runtime (see [`AgentRuntime`]), threads named after the agent.
pub(crate) fn build(name: &str, threads: usize) -> Result<AgentRuntime, Error> {
    AgentRuntime::start(&format!("kvxfer-{name}"), threads)
        .map_err(|source| Error::Io { what: format!("starting the runtime of agent {name}"), source })
}

/// `now + d`, or a year from now when that does not fit in an `Instant` (a caller's
/// "wait for ever", e.g. `Duration::MAX`, must not panic).
pub(crate) fn instant_after(now: std::time::Instant, d: std::time::Duration) -> std::time::Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(std::time::Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Whether the calling thread is inside a tokio runtime (where blocking would stall it).
pub(crate) fn in_runtime() -> bool {
    Handle::try_current().is_ok()
}

/// Refuses a blocking call made from inside a tokio runtime, naming the async call to use.
pub(crate) fn refuse_in_runtime(call: &'static str, instead: &'static str) -> Result<(), Error> {
    if in_runtime() {
        return Err(Error::InsideRuntime { call, instead });
    }
    Ok(())
}

/// Shuts a blocking agent's runtime down: waits (bounded) for its tasks from a plain
/// thread, never blocks inside an async context.
pub(crate) fn shutdown(rt: AgentRuntime) {
    rt.shutdown_timeout(Duration::from_secs(2));
}

/// A value whose drop may block or is UCX teardown (a UCX target or initiator joins its
/// thread; a `UcxBuffer` unmaps its memory and may clean up its context): dropped on a
/// short-lived `kvxfer-teardown` thread, which [`wait_for_teardown`] waits for, when the
/// drop would otherwise run on a runtime thread; in place on any other thread.
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
pub(crate) struct DropOffRuntime<T: Send + 'static>(Option<T>);

#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
impl<T: Send + 'static> DropOffRuntime<T> {
    /// Wraps `value`.
    pub(crate) fn new(value: T) -> Self {
        DropOffRuntime(Some(value))
    }

    /// The value.
    pub(crate) fn get(&self) -> Option<&T> {
        self.0.as_ref()
    }
}

impl<T: Send + 'static> Drop for DropOffRuntime<T> {
    fn drop(&mut self) {
        let Some(value) = self.0.take() else { return };
        if in_runtime() {
            // If the thread cannot start, the closure (and the value) drops here instead.
            spawn_teardown(move || drop(value));
        }
    }
}

/// Teardown threads still running (`kvxfer-teardown`), and a condition variable signalled
/// as each one ends.
static TEARDOWNS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// Counts one teardown thread until dropped (also when its thread could not start and the
/// closure holding it is dropped at once).
struct TeardownTicket;

impl TeardownTicket {
    fn new() -> Self {
        *TEARDOWNS.0.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        TeardownTicket
    }
}

impl Drop for TeardownTicket {
    fn drop(&mut self) {
        let mut n = TEARDOWNS.0.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.saturating_sub(1);
        TEARDOWNS.1.notify_all();
    }
}

/// Runs `f` on a short-lived `kvxfer-teardown` thread, counted until it ends (see
/// [`wait_for_teardown`]); runs it here if no thread can be started.
pub(crate) fn spawn_teardown(f: impl FnOnce() + Send + 'static) {
    let ticket = TeardownTicket::new();
    let run = move || {
        f();
        drop(ticket);
    };
    let parked = Arc::new(Mutex::new(Some(run)));
    let theirs = parked.clone();
    let spawned = std::thread::Builder::new().name("kvxfer-teardown".into()).spawn(move || {
        let taken = theirs.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(run) = taken {
            run();
        }
    });
    if spawned.is_err() {
        let taken = parked.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(run) = taken {
            run();
        }
    }
}

/// Waits, up to `timeout`, until every teardown the agents left to threads of their own
/// has finished — UCX workers destroyed and their threads joined after an agent was dropped
/// or shut down on a runtime thread, and UCX-allocated memory (`ucx_region`)
/// released after its last owner let go of it there. Returns whether none is left. Call it
/// before the process exits after dropping agents from async code: UCX's own exit handlers
/// must not run while one of its workers is still being destroyed (that can crash the
/// exit). The blocking agents' `Drop` calls it (bounded by 10 s).
pub fn wait_for_teardown(timeout: Duration) -> bool {
    let deadline = instant_after(Instant::now(), timeout);
    let mut n = TEARDOWNS.0.lock().unwrap_or_else(PoisonError::into_inner);
    while *n > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        n = TEARDOWNS.1.wait_timeout(n, left).unwrap_or_else(|p| p.into_inner()).0;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::runtime::RuntimeFlavor;

    #[test]
    fn zero_workers_is_a_current_thread_runtime_on_a_driver_thread_of_its_own() {
        let rt = AgentRuntime::start("kvxfer-flavor", 0).expect("runtime");
        assert_eq!(rt.handle().runtime_flavor(), RuntimeFlavor::CurrentThread);
        assert!(!rt.on_driver());
        // Tasks run on the driver thread, named after the runtime, and timers fire.
        let on = rt.block_on(async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            rt.handle().spawn(async { std::thread::current().name().map(str::to_owned) }).await.expect("task")
        });
        assert_eq!(on.as_deref(), Some("kvxfer-flavor"));
        rt.shutdown_timeout(Duration::from_secs(2));

        let rt = AgentRuntime::start("kvxfer-flavor", 2).expect("runtime");
        assert_eq!(rt.handle().runtime_flavor(), RuntimeFlavor::MultiThread);
        drop(rt);
    }

    #[test]
    fn a_current_thread_runtime_stopped_from_its_own_driver_or_a_task_elsewhere_does_not_hang() {
        // Stopped from a task on its own driver: no self-join; the driver ends by itself.
        let rt = AgentRuntime::start("kvxfer-self-stop", 0).expect("runtime");
        let handle = rt.handle().clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let parked = Arc::new(Mutex::new(Some(rt)));
        let theirs = parked.clone();
        handle.spawn(async move {
            let rt = theirs.lock().unwrap_or_else(PoisonError::into_inner).take();
            let was_driver = rt.as_ref().is_some_and(AgentRuntime::on_driver);
            drop(rt);
            let _ = tx.send(was_driver);
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true));
        // Stopped from a task of another runtime: joined on a teardown thread.
        let other = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        let rt = AgentRuntime::start("kvxfer-other-stop", 0).expect("runtime");
        other.block_on(async move { rt.shutdown_timeout(Duration::from_secs(2)) });
        assert!(wait_for_teardown(Duration::from_secs(10)));
    }
}
