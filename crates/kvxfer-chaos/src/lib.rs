//! Fault injection for kvxfer's reliability tests and its soak run.
//!
//! - [`proxy`]: a TCP proxy on 127.0.0.1 that sits between a decode and a prefill agent
//!   and delays, cuts, resets, truncates, corrupts or black-holes the byte stream at a
//!   chosen offset.
//! - The `kvxfer-node` binary: a prefill or decode agent in its own process, driven over
//!   stdin/stdout, so tests can `kill -9` one side mid-pull.
//! - The `kvxfer-soak` binary: thousands of parents with random n, cancels, skipped
//!   children and peer restarts, then the books must balance.
//! - The `kvxfer-hostile` binary: many hostile connections (silent, slow-loris, half-open,
//!   floods, oversized hellos, pins, log floods) against a prefill agent in a child process
//!   while a legitimate decode agent pulls; reports its latency against a quiet baseline and
//!   the prefill's RSS, descriptors, CPU time, counters and log volume.
#![forbid(unsafe_code)]

pub mod proxy;

pub use proxy::{Direction, Fault, FaultKind, FaultProxy, ProxyStats};
