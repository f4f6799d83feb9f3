//! `--prefill-tp` / `--decode-tp` / `--block-ratio`: one process, head-slice pulls measured
//! beside the whole-block path, every byte verified.

mod support;

use std::process::Command;

use support::{json_lines, BIN};

fn hetero(prefill_tp: &str, decode_tp: &str, ratio: &str) -> Vec<serde_json::Value> {
    json_lines(
        Command::new(BIN)
            .args(["--prefill-tp", prefill_tp, "--decode-tp", decode_tp, "--block-ratio", ratio])
            .args([
                "--block-bytes",
                "64K",
                "--total-bytes",
                "8M",
                "--n",
                "2",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--json",
            ]),
    )
}

#[test]
fn slice_pulls_are_verified_and_reported_beside_whole_blocks() {
    for (p, d, k) in [("1", "2", "1"), ("2", "1", "1"), ("1", "1", "2")] {
        let rows = hetero(p, d, k);
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(r["verified"], true, "{r}");
        assert_eq!(r["bytes"], 8 << 20, "{r}");
        assert_eq!(r["whole_bytes"], 8 << 20, "{r}");
        assert!(r["slice_gib_per_s"].as_f64().expect("number") > 0.0, "{r}");
        assert!(r["whole_gib_per_s"].as_f64().expect("number") > 0.0, "{r}");
    }
}
