//! Retry pacing (sans-IO: the caller sleeps) and rate-limited warnings (the caller passes `now`).

use std::time::{Duration, Instant};

/// Exponential backoff with jitter, bounded: attempt `k` waits a random time in
/// `[d/2, d]` with `d = min(initial * 2^k, max)`, so many agents that lost etcd together do
/// not come back in lockstep.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        Self { initial: initial.max(Duration::from_millis(1)), max: max.max(initial), attempt: 0 }
    }

    /// The wait before the next retry; each call doubles the next one up to `max`.
    pub(crate) fn next_delay(&mut self, rng: &mut impl rand::Rng) -> Duration {
        let ceiling = self.initial.saturating_mul(1u32 << self.attempt.min(20)).min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        let extra = rng.random_range(0..=half.as_micros().min(u128::from(u64::MAX)) as u64);
        half + Duration::from_micros(extra)
    }

    /// Back to the shortest wait (after a success).
    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// Lets through at most `per_window` warnings per window (a second, or the interval of
/// [`Self::every`]); counts the rest so the next one that passes can say how many were
/// suppressed.
#[derive(Debug)]
pub(crate) struct WarnLimiter {
    per_window: u32,
    window: Duration,
    window_start: Option<Instant>,
    in_window: u32,
    suppressed: u64,
}

impl WarnLimiter {
    /// At most `per_second` warnings a second.
    pub(crate) fn new(per_second: u32) -> Self {
        Self {
            per_window: per_second,
            window: Duration::from_secs(1),
            window_start: None,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// Warnings while something keeps failing ([`Self::failed`]): one at the first failure,
    /// then at most one per `interval`, each saying how many failures it stands for —
    /// neither silence for ever after the first, nor a line per retry.
    pub(crate) fn every(interval: Duration) -> Self {
        Self { window: interval, ..Self::new(1) }
    }

    /// `Some(suppressed since the last one)` when a warning may be logged now.
    pub(crate) fn allow(&mut self, now: Instant) -> Option<u64> {
        let fresh = self.window_start.is_none_or(|start| now.saturating_duration_since(start) >= self.window);
        if fresh {
            self.window_start = Some(now);
            self.in_window = 0;
        }
        if self.in_window >= self.per_window {
            self.suppressed += 1;
            return None;
        }
        self.in_window += 1;
        Some(std::mem::take(&mut self.suppressed))
    }

    /// A failure at `now`: `Some(failures since the last warning, this one included)` when
    /// a warning is due. `first` (the first failure after a success) always warns.
    pub(crate) fn failed(&mut self, now: Instant, first: bool) -> Option<u64> {
        if first {
            self.window_start = None;
            self.suppressed = 0;
        }
        self.allow(now).map(|suppressed| suppressed + 1)
    }
}

/// How often a warning repeats while etcd stays unreachable.
pub(crate) const REMINDER_INTERVAL: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn backoff_doubles_up_to_the_bound_and_resets() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut ceilings = Vec::new();
        for _ in 0..10 {
            let d = b.next_delay(&mut rng);
            assert!(d <= Duration::from_secs(2), "{d:?}");
            ceilings.push(d);
        }
        assert!(ceilings[0] >= Duration::from_millis(50) && ceilings[0] <= Duration::from_millis(100));
        assert!(ceilings[9] >= Duration::from_secs(1), "{ceilings:?}");
        b.reset();
        assert!(b.next_delay(&mut rng) <= Duration::from_millis(100));
    }

    #[test]
    fn a_lasting_failure_warns_at_first_then_once_per_interval() {
        let t0 = Instant::now();
        let every = Duration::from_secs(60);
        let mut r = WarnLimiter::every(every);
        assert_eq!(r.failed(t0, true), Some(1));
        // Retries every 2 s: silent until the interval has passed.
        for i in 1..30 {
            assert_eq!(r.failed(t0 + Duration::from_secs(2 * i), false), None, "retry {i}");
        }
        assert_eq!(r.failed(t0 + every, false), Some(30), "the reminder counts the silent ones");
        assert_eq!(r.failed(t0 + every + Duration::from_secs(1), false), None);
        // Back, then failing again: a warning at once.
        assert_eq!(r.failed(t0 + every + Duration::from_secs(2), true), Some(1));
    }

    #[test]
    fn warnings_are_limited_per_second_and_suppressions_reported() {
        let t0 = Instant::now();
        let mut w = WarnLimiter::new(2);
        assert_eq!(w.allow(t0), Some(0));
        assert_eq!(w.allow(t0), Some(0));
        assert_eq!(w.allow(t0), None);
        assert_eq!(w.allow(t0 + Duration::from_millis(999)), None);
        assert_eq!(w.allow(t0 + Duration::from_secs(1)), Some(2));
    }
}
