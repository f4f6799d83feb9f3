//! The frame decoder on arbitrary bytes: errors are values, never panics, and every frame
//! it accepts re-encodes to bytes that decode to the same frame. The buffered reader
//! (`FrameReader`), fed the same bytes in pieces of a size the input picks, yields the same
//! frames as the one-shot decoder.
#![no_main]

use kvxfer_tcp::frame::{decode_all, Frame, FrameError, FrameReader};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;

const MAX: u32 = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    let decoded = decode_all(data, MAX);
    if let Ok((frames, used)) = &decoded {
        assert!(*used <= data.len());
        let mut out = Vec::new();
        for f in frames {
            f.encode(&mut out);
        }
        let (again, used_again) = decode_all(&out, u32::MAX).expect("re-encoded frames decode");
        assert_eq!(used_again, out.len());
        assert_eq!(&again, frames);
        let _ = frames.iter().map(Frame::frame_type).count();
    }

    // The same bytes through the buffered reader, written in pieces.
    let piece = data.first().map_or(1, |&b| usize::from(b) + 1);
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let read: Vec<Result<Frame, FrameError>> = runtime.block_on(async {
        let (mut w, mut r) = tokio::io::duplex(4096);
        let bytes = data.to_vec();
        let writer = async move {
            for chunk in bytes.chunks(piece) {
                if w.write_all(chunk).await.is_err() {
                    return;
                }
            }
        };
        // Owns its end: once it stops reading, the writer's next write fails instead of
        // waiting for room.
        let reading = async move {
            let mut reader = FrameReader::new();
            let mut got = Vec::new();
            loop {
                match reader.read_frame(&mut r, MAX).await {
                    Ok(f) => got.push(Ok(f)),
                    Err(FrameError::Closed) => return got,
                    Err(e) => {
                        got.push(Err(e));
                        return got;
                    }
                }
            }
        };
        let (got, ()) = tokio::join!(reading, writer);
        got
    });
    let ok: Vec<&Frame> = read.iter().filter_map(|r| r.as_ref().ok()).collect();
    match &decoded {
        // Whole frames, then maybe a piece of one: the reader yields them, then (for the
        // piece) an unexpected end.
        Ok((frames, used)) => {
            assert_eq!(ok, frames.iter().collect::<Vec<_>>());
            assert_eq!(read.last().is_some_and(Result::is_err), *used < data.len());
        }
        // The one-shot decoder stopped at a bad frame: the reader yields the frames before
        // it and then fails.
        Err(_) => assert!(read.last().is_some_and(Result::is_err)),
    }
});
