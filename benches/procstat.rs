//! What this process holds, read from `/proc/self`: resident memory (now and peak) and open
//! file descriptors — for the many-requests workload's "no growth with concurrency" figures;
//! and the CPU time and context switches it used (the whole process, or one thread).

/// A field of `/proc/self/status` (e.g. `VmRSS`, `Cpus_allowed_list`), its value trimmed;
/// `None` when unreadable or absent.
fn status_field(field: &str) -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| Some(l.strip_prefix(field)?.strip_prefix(':')?.trim().to_owned()))
}

/// A `kB` field of `/proc/self/status` (e.g. `VmRSS`, `VmHWM`), in KiB; 0 when unreadable.
fn status_kib(field: &str) -> u64 {
    status_field(field).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// Resident memory now, KiB.
pub(crate) fn rss_kib() -> u64 {
    status_kib("VmRSS")
}

/// Peak resident memory since the process started or since [`reset_peak_rss`], KiB.
pub(crate) fn peak_rss_kib() -> u64 {
    status_kib("VmHWM")
}

/// Resets the peak resident memory to the current one (Linux ≥ 4.0: writing `5` to
/// `/proc/self/clear_refs`); `false` when the kernel refused.
pub(crate) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Open file descriptors of this process (entries of `/proc/self/fd`, less the one the
/// listing itself holds); 0 when unreadable.
pub(crate) fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count().saturating_sub(1) as u64).unwrap_or(0)
}

/// Involuntary context switches of every thread of this process so far (the sum of
/// `nonvoluntary_ctxt_switches` over `/proc/self/task/*/status`; threads that exited are not
/// counted): how often the scheduler took the CPU from a runnable thread.
pub(crate) fn involuntary_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

/// This process's resource usage (every thread, those that exited included).
fn rusage() -> libc::rusage {
    // SAFETY: getrusage writes one rusage struct; zeroed is a valid initial value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    u
}

/// Resource usage of this process: user + system CPU seconds.
pub(crate) fn cpu_seconds() -> f64 {
    let u = rusage();
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Context switches of this process so far, voluntary (a thread waited: a futex, a socket
/// with nothing to read, epoll) and involuntary together, every thread included.
pub(crate) fn context_switches() -> u64 {
    let u = rusage();
    u64::try_from(u.ru_nvcsw.saturating_add(u.ru_nivcsw)).unwrap_or(0)
}

/// CPU time of the calling thread so far, nanoseconds (user + system).
pub(crate) fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0)
}

/// CPU seconds every CPU of this machine has been busy so far (`/proc/stat`'s `cpu` line:
/// user, nice, system, irq and softirq; idle, iowait and steal left out): every process and
/// every kernel thread, the `ksoftirqd` threads that finish loopback TCP's receive work
/// included, which neither process's own counters see. `None` where `/proc/stat` is
/// unreadable. Resolution: one clock tick (10 ms) per CPU.
pub(crate) fn machine_busy_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).map_while(|v| v.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal ...
    let busy = [0, 1, 2, 5, 6].iter().map(|&i| ticks.get(i).copied()).sum::<Option<u64>>()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| busy as f64 / hz as f64)
}

/// The CPUs this process may run on (`Cpus_allowed_list` of `/proc/self/status`, e.g.
/// `0-1`, or `1` when pinned), empty when unreadable.
pub(crate) fn cpus_allowed() -> String {
    status_field("Cpus_allowed_list").unwrap_or_default()
}

#[cfg(test)]
mod tests {
    /// The machine's busy CPU grows by at least what this thread burns (others only add).
    #[test]
    fn the_machine_counts_at_least_this_threads_cpu() {
        let before = super::machine_busy_seconds().expect("/proc/stat");
        let t0 = super::thread_cpu_ns();
        let mut x = 0u64;
        while super::thread_cpu_ns() - t0 < 300_000_000 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let grew = super::machine_busy_seconds().expect("/proc/stat") - before;
        // 0.3 s burnt, less the ticks' rounding and what a VM's hypervisor took meanwhile
        // (counted as steal, which the busy figure leaves out, where the guest's own thread
        // clock does not).
        assert!(grew >= 0.2, "the machine counted {grew} s busy while this thread burnt 0.3 s");
    }
}
