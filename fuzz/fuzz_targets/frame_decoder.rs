//! The frame decoder on arbitrary bytes: errors are values, never panics, and every frame
//! it accepts re-encodes to bytes that decode to the same frame.
#![no_main]

use kvxfer_tcp::frame::{decode_all, Frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((frames, used)) = decode_all(data, 64 * 1024) else { return };
    assert!(used <= data.len());
    let mut out = Vec::new();
    for f in &frames {
        f.encode(&mut out);
    }
    let (again, used_again) = decode_all(&out, u32::MAX).expect("re-encoded frames decode");
    assert_eq!(used_again, out.len());
    assert_eq!(again, frames);
    let _ = frames.iter().map(Frame::frame_type).count();
});
