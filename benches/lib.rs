//! Helpers shared by kvxfer's criterion benches.
#![forbid(unsafe_code)]

use kvxfer_core::{EngineInfo, LeaseConfig, LeaseTable};

/// A lease table over `num_blocks` blocks with a fixed seed, as the benches use it.
pub fn bench_table(num_blocks: u32) -> LeaseTable {
    let engine = EngineInfo {
        engine_id: "bench".into(),
        host: "127.0.0.1".into(),
        port: 1,
        tp_size: 1,
        incarnation: 0,
    };
    LeaseTable::new(LeaseConfig::new(engine, num_blocks), [9; 32])
}
