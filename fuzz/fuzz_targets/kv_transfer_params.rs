//! vLLM's kv_transfer_params JSON on arbitrary input: errors are values, and what parses
//! writes back to JSON that parses to the same value (unknown fields kept).
#![no_main]

use kvxfer_core::KvTransferParams;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let Ok(p) = KvTransferParams::from_json(s) else { return };
    let json = p.to_json();
    let again = KvTransferParams::from_json(&json).expect("our own JSON parses");
    assert_eq!(again.to_json(), json);
    // Converting to a hand-off either works or names what is missing; never panics.
    let _ = p.to_handoff();
});
