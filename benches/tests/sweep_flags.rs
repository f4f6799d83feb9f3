//! `--sweep-n` / `--sweep-blocks-per-child`: one run per (n, blocks per child, block size),
//! each with the bytes the pair names, every byte verified; without blocks per child, a
//! bulk n sweep keeps `--total-bytes`.

mod support;

use std::process::Command;

use support::{json_lines, BIN};

fn bench(args: &[&str]) -> Vec<serde_json::Value> {
    json_lines(
        Command::new(BIN).args(["--transport", "tcp", "--iters", "1", "--warmup", "0", "--json"]).args(args),
    )
}

#[test]
fn every_n_and_blocks_per_child_pair_is_one_verified_run() {
    let rows = bench(&["--block-bytes", "16K,64K", "--sweep-n", "1,4", "--sweep-blocks-per-child", "1,3"]);
    let mut expected = Vec::new();
    for n in [1u64, 4] {
        for bpc in [1u64, 3] {
            for block in [16u64 << 10, 64 << 10] {
                expected.push((n, block, n * bpc * block));
            }
        }
    }
    let got: Vec<(u64, u64, u64)> = rows
        .iter()
        .map(|r| {
            assert_eq!(r["verified"], true, "{r}");
            let field = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {r}"));
            (field("n"), field("block_bytes"), field("bytes"))
        })
        .collect();
    assert_eq!(got, expected);
}

#[test]
fn an_n_sweep_alone_keeps_the_total_bytes() {
    let rows = bench(&["--block-bytes", "16K", "--total-bytes", "256K", "--sweep-n", "1,2,16"]);
    let got: Vec<(u64, u64)> =
        rows.iter().map(|r| (r["n"].as_u64().expect("n"), r["bytes"].as_u64().expect("bytes"))).collect();
    assert_eq!(got, vec![(1, 256 << 10), (2, 256 << 10), (16, 256 << 10)]);
    assert!(rows.iter().all(|r| r["verified"] == true), "{rows:?}");
}
