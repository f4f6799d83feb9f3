//! `PrefillResult` validation on arbitrary wire input: refusals are values, and a result
//! it accepts is complete (children 0..n, each once) and survives the wire and vLLM's
//! kv_transfer_params form unchanged.
#![no_main]

use kvxfer_core::{KvTransferParams, PrefillResult};
use kvxfer_proto::v1;
use kvxfer_proto::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(wire) = v1::PrefillResult::decode(data) else { return };
    let Ok(result) = PrefillResult::from_wire(wire) else { return };
    let n = result.n();
    let mut seen: Vec<u32> = result.children().iter().map(|c| c.child_index()).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..n).collect::<Vec<_>>(), "an accepted result holds children 0..n once each");
    let again = PrefillResult::from_wire(result.to_wire()).expect("an accepted result round-trips");
    assert_eq!(again, result);
    for c in result.children() {
        let params = KvTransferParams::from_handoff(c);
        let back = params.to_handoff().expect("params made from a hand-off convert back");
        assert_eq!(&back, c);
        let json = KvTransferParams::from_json(&params.to_json()).expect("our JSON parses");
        assert_eq!(json, params);
    }
});
