//! Shared harness of the engine's integration tests: agents on 127.0.0.1 (free ports),
//! patterned prefill memory, verification, and waiting for lease ends.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::time::{Duration, Instant};

use kvxfer::{AgentConfig, BlockId, BlockLayout, DecodeAgent, KvMemory, LeaseEnd, PrefillAgent};
use kvxfer_mem::pattern;

pub const BLOCK: u64 = 4096;

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A prefill agent over `blocks` patterned blocks, with lease ttl `ttl`.
pub fn prefill(blocks: u32, ttl: Duration) -> PrefillAgent {
    let config = AgentConfig::new("prefill").lease_ttl(ttl).io_timeout(Duration::from_secs(5));
    prefill_with(config, BlockLayout::single(blocks, BLOCK).expect("layout"))
}

pub fn prefill_with(config: AgentConfig, layout: BlockLayout) -> PrefillAgent {
    init_tracing();
    let n = layout.num_blocks();
    let mem = KvMemory::alloc(layout).expect("alloc");
    // SAFETY: nothing is leased yet; no agent holds this memory.
    unsafe { pattern::fill_blocks(&mem, 0..n) }.expect("fill");
    PrefillAgent::start(config, "127.0.0.1:0", mem).expect("prefill agent")
}

/// A decode agent with `blocks` zeroed local blocks.
pub fn decode(blocks: u32) -> DecodeAgent {
    let config = AgentConfig::new("decode").io_timeout(Duration::from_secs(5));
    decode_with(config, BlockLayout::single(blocks, BLOCK).expect("layout"))
}

pub fn decode_with(config: AgentConfig, layout: BlockLayout) -> DecodeAgent {
    init_tracing();
    DecodeAgent::start(config, KvMemory::alloc(layout).expect("alloc")).expect("decode agent")
}

/// Whether local blocks hold the bytes of the remote blocks they were pulled from.
pub fn verify(decode: &DecodeAgent, remote: &[BlockId], local: &[BlockId]) -> bool {
    // SAFETY: callers verify only children whose pull has reported.
    let bad = unsafe { pattern::check_blocks(decode.memory(), remote, local) }.expect("in layout");
    bad.is_none()
}

/// Receives `count` lease ends, or panics after `timeout`.
pub fn wait_ends(prefill: &PrefillAgent, count: usize, timeout: Duration) -> Vec<LeaseEnd> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < count {
        let left = deadline.saturating_duration_since(Instant::now());
        match prefill.events().recv_timeout(left) {
            Ok(e) => out.push(e),
            Err(_) => panic!("only {} of {count} lease ends within {timeout:?}: {out:?}", out.len()),
        }
    }
    out.sort_by_key(|e| e.child_index);
    out
}

/// Asserts no further lease end arrives within `quiet`.
pub fn assert_no_more_ends(prefill: &PrefillAgent, quiet: Duration) {
    if let Ok(e) = prefill.events().recv_timeout(quiet) {
        panic!("unexpected extra lease end: {e:?}");
    }
}

/// A small deterministic shuffle (xorshift), so failures reproduce.
pub fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

/// Waits up to 5 s for `cond` (counters updated by another thread after a reply was sent).
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}
