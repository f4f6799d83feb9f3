//! kvxfer-bench: the transfer benchmark, with the machine's ceilings measured in the same run.
//!
//! ```text
//! kvxfer-bench --transport tcp --block-bytes 64K,2M --baseline --json     # one process
//! kvxfer-bench serve --listen 127.0.0.1:7300                              # prefill process
//! kvxfer-bench pull --peer 127.0.0.1:7300 --transport ucx --block-bytes 64K,2M
//! ```
//! Every destination block is checked at the end against the pattern its source was filled
//! with (the last pull into it, every byte) unless `--no-verify`.
//! Agents authenticate each other with the cluster key in `KVXFER_CLUSTER_KEY` (hex) or
//! `KVXFER_CLUSTER_KEY_FILE` when one is set (both processes of a two-process run need it).
//!
//! Layout: `cli` (options, agent configuration), `source` (where leases come from: an agent
//! in this process or a `serve` process), `serve` (the prefill process of a two-process
//! run), `measure` (one block size), `hetero` (`--prefill-tp` / `--decode-tp` /
//! `--block-ratio`: head-slice pulls beside the whole-block path), `baselines` (raw TCP and memcpy), `report` (table, CSV
//! or JSON lines per block size), `plot` (the SVG).
#![allow(missing_docs)]

mod baselines;
mod cli;
mod hetero;
mod measure;
mod plot;
mod procstat;
mod report;
mod serve;
mod source;
mod types;
#[cfg(feature = "ucx")]
mod ucx_baseline;
mod workload;

use std::process::ExitCode;

use clap::Parser;
use kvxfer::AgentConfig;

use crate::cli::{metrics_config, ucx_config, Cli, Memory, Mode};
use crate::report::bench_any as bench;
use crate::serve::serve;
use crate::source::{LocalSource, RemoteSource};

fn main() -> ExitCode {
    kvxfer::ucx_log_to_stderr();
    let cli = Cli::parse();
    let result = match &cli.mode {
        Some(Mode::Serve(args)) => serve(args).map(|()| true),
        Some(Mode::Pull { peer, run }) => {
            if (run.prefill_tp, run.decode_tp, run.block_ratio) != (1, 1, 1) {
                Err("--prefill-tp / --decode-tp / --block-ratio are measured in one process".into())
            } else if run.expected_consumers > 1 {
                Err("--expected-consumers > 1 is measured in one process (several decode agents)".into())
            } else {
                RemoteSource::connect(peer).and_then(|mut source| {
                    let r = bench(run, &mut source, "2");
                    source.quit();
                    r
                })
            }
        }
        None if (cli.run.prefill_tp, cli.run.decode_tp, cli.run.block_ratio) != (1, 1, 1) => {
            hetero::bench_hetero(&cli.run)
        }
        None => Memory::resolve(cli.run.memory, cli.run.transport).and_then(|memory| {
            ucx_config(
                AgentConfig::new("bench-prefill")
                    .transport(cli.run.transport)
                    .worker_threads(cli.run.worker_threads)
                    .precompute_crcs(cli.run.precompute_crcs),
                &cli.run.ucx_tls,
                cli.run.ucx_peer_failure,
            )
            .and_then(|config| metrics_config(config, &cli.run.metrics))
            .and_then(|config| {
                bench(&cli.run, &mut LocalSource { config, memory, agent: None, raw_ucx: None }, "1")
            })
        }),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("kvxfer-bench: verification FAILED");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("kvxfer-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
