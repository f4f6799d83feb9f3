//! What the layers above share and the layers below need: a level of the many-requests
//! workload and what it measured (run by `workload`, drawn by `plot`).

use serde_json::Value;

/// One level of the workload.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Level {
    /// This many parents in flight, each started when one finishes.
    Closed(u32),
    /// Parents arriving at this rate per second, at most `cap` in flight.
    Open { rate: f64, cap: u32 },
}

/// What one (block size, level) measured.
pub(crate) struct Loaded {
    pub(crate) block: u64,
    pub(crate) level: Level,
    /// How the pulls were submitted, from the agent the run used: on the bench's own runtime
    /// (`--async-submit`), and whether that runtime is a current-thread one.
    pub(crate) async_submit: bool,
    pub(crate) current_thread: bool,
    pub(crate) requests: u64,
    pub(crate) requests_per_s: f64,
    pub(crate) gib_per_s: f64,
    /// Per-child hand-off latency quantiles, us: p50, p99, p999, max.
    pub(crate) child_us: [f64; 4],
    /// Per-request latency (start → last child's completion) quantiles, us: p50, p99.
    pub(crate) request_us: [f64; 2],
    pub(crate) cpu_us_per_request: f64,
    /// Context switches (voluntary and involuntary) of this process, and of `serve`, per
    /// request in the window.
    pub(crate) switches_per_request: f64,
    pub(crate) prefill_switches_per_request: Option<f64>,
    /// `--baseline`: the raw TCP run's sending and receiving CPU per request, µs (the same
    /// bytes per request).
    pub(crate) raw_tcp_us_per_request: Option<[f64; 2]>,
    /// This machine's busy CPU per request over the measured window, µs (every process and
    /// kernel thread; `None` where `/proc/stat` is unreadable), and over the raw run.
    pub(crate) machine_cpu_us_per_request: Option<f64>,
    pub(crate) raw_tcp_machine_cpu_us_per_request: Option<f64>,
    /// Mean time of the lease calls per parent (in two processes, control round trips to
    /// `serve`, `--lease-batch` parents each): the submitting thread's own cost.
    pub(crate) lease_call_us: f64,
    /// Open loop: submission time (when the submit call started) − scheduled arrival, us:
    /// p50, p99, max.
    pub(crate) submit_lag_us: [f64; 3],
    /// Per-child latency from the parent's submission (not its start), us: p50, p99, p999 —
    /// the engine's part of the hand-off, without the submitting thread's lateness.
    pub(crate) service_us: [f64; 3],
    /// Open loop: arrivals that found the in-flight cap reached and waited for a slot.
    pub(crate) cap_waits: u64,
    /// How long after the window's end its CPU and context-switch readings were taken, us.
    pub(crate) end_reading_late_us: f64,
    /// Open loop: most arrivals waiting at once.
    pub(crate) max_backlog: u64,
    pub(crate) prefill_cpu_us_per_request: Option<f64>,
    /// Involuntary context switches of this process's threads per measured second: how
    /// often the machine took the CPU from a runnable thread (a loaded machine's tail).
    pub(crate) preempted_per_s: f64,
    pub(crate) rss_before_mib: f64,
    pub(crate) rss_peak_mib: f64,
    pub(crate) kv_mib: f64,
    pub(crate) fds_before: u64,
    pub(crate) fds_max: u64,
    pub(crate) verified: Option<bool>,
    pub(crate) prefill: Value,
}

impl Loaded {
    /// The level's x value in tables and plots: C (closed) or parents/s offered (open).
    pub(crate) fn x(&self) -> f64 {
        match self.level {
            Level::Closed(c) => f64::from(c),
            Level::Open { rate, .. } => rate,
        }
    }
}
