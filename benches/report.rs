//! A benchmark run over every block size, reported as a table, CSV or JSON lines (with the
//! baselines and their ratios), and plotted when asked.

use serde_json::json;

use crate::baselines::{median, memcpy_gib_per_s, percentile, rtt_distribution};
use crate::cli::RunArgs;
use crate::measure::run_block_size;
use crate::plot::{human, svg_plot, PlotRow};
use crate::source::LeaseSource;

/// `--baseline` over UCX: GiB/s of `--iters` raw get runs of the same bytes from the same
/// prefill process (`None` for TCP runs or without the `ucx` feature).
fn raw_ucx_baseline(
    run: &RunArgs,
    source: &mut dyn LeaseSource,
    block: u64,
) -> Result<Option<Vec<f64>>, String> {
    #[cfg(feature = "ucx")]
    if run.baseline && run.transport.to_string() == "ucx" {
        let config = crate::ucx_baseline::raw_config(&run.ucx_tls, run.ucx_peer_failure);
        let per_child =
            u64::from(crate::measure::blocks_per_child(run, block)?) * block * u64::from(run.segments());
        let children = u64::from(run.n.max(1)) * u64::from(run.parents.max(1));
        let total = per_child * children;
        let info = source.raw_ucx_target(&config, total)?;
        return crate::ucx_baseline::raw_ucx_get_gib_per_s(&config, info, total, per_child, run.iters)
            .map(Some);
    }
    let _ = (run, source, block);
    Ok(None)
}

/// The many-requests workload when `--concurrency` or `--rate` was given, else the bulk
/// sweep; once per run of a cost-growth sweep.
pub(crate) fn bench_any(
    run: &RunArgs,
    source: &mut dyn LeaseSource,
    processes: &str,
) -> Result<bool, String> {
    let mut all_ok = true;
    // One run, or each run of a cost-growth sweep (`--sweep-n`, `--sweep-blocks-per-child`).
    for run in &run.sweep()? {
        all_ok &= if !run.workload.any() {
            bench(run, source, processes)?
        } else {
            crate::workload::bench_many(run, source, processes)?
        };
    }
    Ok(all_ok)
}

/// Measures every block size of `run` and reports each; `Ok(false)` when a check failed.
pub(crate) fn bench(run: &RunArgs, source: &mut dyn LeaseSource, processes: &str) -> Result<bool, String> {
    let transport = run.transport.to_string();
    let mut all_ok = true;
    let mut plot_rows = Vec::new();
    if !run.json && run.csv {
        println!("transport,processes,block_bytes,bytes,gib_per_s,blocks_per_s,p50_us,p99_us,max_us,cpu_s_per_gib,verified,raw_tcp_gib_per_s,memcpy_gib_per_s,ratio_vs_raw_tcp,ratio_vs_memcpy,cpu_s_per_gib_both,raw_tcp_cpu_s_per_gib,ratio_cpu_vs_raw_tcp");
    } else if !run.json {
        println!(
            "{:>9} {:>10} {:>9} {:>12} {:>10} {:>10} {:>10} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9}",
            "block",
            "bytes",
            "GiB/s",
            "blocks/s",
            "p50 us",
            "p99 us",
            "max us",
            "CPU s/GiB",
            "verified",
            "vs rawTCP",
            "vs memcpy",
            "CPU both",
            "CPU vs raw"
        );
    }
    for &block in &run.block_bytes {
        let mut m = run_block_size(run, source, block)?;
        // Raw TCP: the median of the runs interleaved with kvxfer's iterations.
        let (raw, mem) = if run.baseline {
            (Some(median(m.raw_tcp_runs.clone())), Some(memcpy_gib_per_s(run.total_bytes)))
        } else {
            (None, None)
        };
        let rtt_dist = rtt_distribution(&mut m.raw_rtt_us);
        let raw_ucx = raw_ucx_baseline(run, source, block)?;
        let rtt = run.baseline.then(|| percentile(&m.raw_rtt_us, 0.5));
        all_ok &= m.verified != Some(false);
        // `pull --memory` names what `serve` was told (bench-two-process.sh passes it on):
        // a figure is never reported under memory it was not measured from.
        if let Some(asked) = run.memory {
            if m.prefill["memory"] != asked.name() {
                return Err(format!(
                    "--memory asked for {}, the prefill side serves from {}",
                    asked.name(),
                    m.prefill["memory"]
                ));
            }
        }
        let ratio = |b: Option<f64>| b.map(|b| m.gib_per_s / b);
        // CPU against CPU on the same bytes: both agents (both processes) against the raw
        // runs' sending and receiving threads, the median of the runs.
        let raw_median = |f: fn(&[f64; 2]) -> f64| median(m.raw_tcp_cpu_runs.iter().map(f).collect());
        let raw_cpu = run.baseline.then(|| raw_median(|r| r[0] + r[1]));
        let (raw_send, raw_receive) = (raw_median(|r| r[0]), raw_median(|r| r[1]));
        let cpu_both = m.cpu_s_per_gib_both();
        let cpu_ratio = raw_cpu.filter(|&r| r > 0.0).map(|r| cpu_both / r);
        let per_parent_gib = m.bytes as f64 / f64::from(run.parents.max(1)) / f64::from(1u32 << 30);
        let pieces_per_parent = u64::from(run.n.max(1))
            * u64::from(crate::measure::blocks_per_child(run, block)?)
            * u64::from(run.segments());
        plot_rows.push(PlotRow { block, kvxfer: m.gib_per_s, raw_tcp: raw, memcpy: mem });
        if run.json {
            let mut j = json!({
                "transport": transport, "ucx_verify_payloads": run.ucx_verify_payloads, "ucx_version": crate::source::ucx_runtime_version(), "processes": processes, "block_bytes": block, "bytes": m.bytes,
                "n": run.n, "parents": run.parents, "iters": run.iters, "connections": run.connections,
                "expected_consumers": run.expected_consumers, "notify_with_read": run.notify_with_read,
                "gib_per_s": m.gib_per_s, "blocks_per_s": m.blocks_per_s, "p50_us": m.p50_us, "p99_us": m.p99_us,
                "max_us": m.max_us, "cpu_s_per_gib": m.cpu_s_per_gib, "verified": m.verified, "prefill": m.prefill,
                // Counted CPU (user + system, every thread): this process (the decode agents;
                // one process: both agents), `serve`'s (the prefill agent's), both together,
                // and both per parent handed off; context switches per parent.
                "decode_cpu_s_per_gib": m.cpu_s_per_gib, "prefill_cpu_s_per_gib": m.prefill_cpu_s_per_gib,
                "cpu_s_per_gib_both": cpu_both, "cpu_us_per_parent_both": cpu_both * per_parent_gib * 1e6,
                "context_switches_per_parent": m.switches_per_parent,
                "prefill_context_switches_per_parent": m.prefill_switches_per_parent,
                // The cache's shape (`--layers`, `--kv-split`): pieces one parent moves
                // (children x blocks x regions) and both agents' CPU per piece.
                "layers": run.layers, "kv_split": run.kv_split, "segments": run.segments(),
                "pieces_per_parent": pieces_per_parent,
                "cpu_us_per_piece_both": cpu_both * per_parent_gib * 1e6 / pieces_per_parent.max(1) as f64,
                "async_submit": run.async_submit, "current_thread": run.current_thread,
                // This machine's busy CPU (every process and kernel thread, from /proc/stat):
                // covers `serve` where it runs on this machine, and the kernel threads that
                // finish loopback TCP's receive work, which neither process's counters see.
                "machine_cpu_s_per_gib": m.machine_cpu_s_per_gib,
                // The CPUs this process may run on (`prefill.cpus`: serve's), e.g. pinned by
                // bench-two-process.sh --pull-cpus / --serve-cpus.
                "cpus": crate::procstat::cpus_allowed(),
                // Submit → report: the hand-off without the bench's lease request.
                "submit_p10_us": m.submit_us[0], "submit_p50_us": m.submit_us[1], "submit_p99_us": m.submit_us[2],
            });
            if run.baseline {
                j["raw_tcp_gib_per_s"] = json!(raw);
                // Where the raw runs ran (two processes: from `serve` to `pull`, as kvxfer's
                // bytes move) and their write size (kvxfer's server's).
                j["raw_tcp_processes"] = json!(processes);
                j["raw_tcp_write_bytes"] = json!(crate::baselines::RAW_WRITE_BYTES);
                j["memcpy_gib_per_s"] = json!(mem);
                j["ratio_vs_raw_tcp"] = json!(ratio(raw));
                j["ratio_vs_memcpy"] = json!(ratio(mem));
                j["raw_tcp_cpu_s_per_gib"] = json!(raw_cpu);
                j["raw_tcp_cpu_us_per_parent"] = json!(raw_cpu.map(|r| r * per_parent_gib * 1e6));
                j["ratio_cpu_vs_raw_tcp"] = json!(cpu_ratio);
                // Each end: the sending (prefill side) and receiving (decode side) threads.
                j["raw_tcp_send_cpu_s_per_gib"] = json!(raw_send);
                // The machine's busy CPU against the same over the raw runs: CPU against CPU
                // where the processes' own counters miss the kernel's deferred work.
                // The median of the runs' figures, when their windows together are long
                // enough for /proc/stat's 10 ms ticks (each run's alone may not be).
                let resolved = m.raw_tcp_window_secs >= crate::baselines::MIN_MACHINE_WINDOW_SECS;
                let raw_machine = (resolved && !m.raw_tcp_machine_cpu_runs.is_empty())
                    .then(|| median(m.raw_tcp_machine_cpu_runs.clone()));
                j["raw_tcp_machine_cpu_s_per_gib"] = json!(raw_machine);
                j["ratio_machine_cpu_vs_raw_tcp"] =
                    json!(m.machine_cpu_s_per_gib.zip(raw_machine.filter(|&r| r > 0.0)).map(|(k, r)| k / r));
                j["raw_tcp_receive_cpu_s_per_gib"] = json!(raw_receive);
                if let Some(prefill) = m.prefill_cpu_s_per_gib {
                    j["prefill_cpu_vs_raw_send"] = json!(prefill / raw_send.max(1e-12));
                    j["decode_cpu_vs_raw_receive"] = json!(m.cpu_s_per_gib / raw_receive.max(1e-12));
                }
                // memcpy is one CPU-bound thread: its CPU per GiB is its time per GiB.
                j["memcpy_cpu_s_per_gib"] = json!(mem.map(|g| 1.0 / g));
                j["raw_tcp_rtt_one_block_p50_us"] = json!(rtt);
                j["p10_us"] = json!(m.p10_us);
                j["p10_vs_raw_rtt_p10"] = json!(m.p10_us / percentile(&m.raw_rtt_us, 0.1));
                // Each iteration against the raw run right after it (listed up to 20 iterations).
                let per_iter: Vec<f64> =
                    m.iter_gib_per_s.iter().zip(&m.raw_tcp_runs).map(|(k, r)| k / r).collect();
                let mut sorted = per_iter.clone();
                sorted.sort_by(f64::total_cmp);
                j["ratio_vs_raw_tcp_per_iter_p50"] = json!(percentile(&sorted, 0.5));
                if run.iters <= 20 {
                    j["iter_gib_per_s"] = json!(m.iter_gib_per_s);
                    j["raw_tcp_runs"] = json!(m.raw_tcp_runs);
                    j["raw_tcp_cpu_runs"] = json!(m.raw_tcp_cpu_runs);
                    j["raw_tcp_machine_cpu_runs"] = json!(m.raw_tcp_machine_cpu_runs);
                    j["ratio_vs_raw_tcp_per_iter"] = json!(per_iter);
                }
                // Taken between kvxfer's iterations; the spread says how far to trust the ratio.
                j["raw_tcp_rtt_one_block_us"] = rtt_dist;
                // Where the round trips ran: to a responder in the prefill process (two
                // processes: `serve`, as kvxfer's hand-off crosses them).
                j["raw_rtt_processes"] = json!(processes);
                j["p50_vs_raw_rtt_p50"] = json!(rtt.map(|r| m.p50_us / r));
                j["submit_p50_vs_raw_rtt_p50"] = json!(rtt.map(|r| m.submit_us[1] / r));
                // Each hand-off over the raw round trip taken right after its iteration.
                j["submit_vs_raw_rtt_paired"] =
                    json!(m.paired_ratio.map(|[p10, p50, p90]| json!({"p10": p10, "p50": p50, "p90": p90})));
                if let Some(mut rates) = raw_ucx {
                    rates.sort_by(f64::total_cmp);
                    let median = percentile(&rates, 0.5);
                    j["raw_ucx_get_gib_per_s"] = json!(median);
                    j["raw_ucx_get_runs"] = json!(rates);
                    j["ratio_vs_raw_ucx_get"] = json!(m.gib_per_s / median);
                }
            }
            println!("{j}");
        } else if run.csv {
            let o = |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_default();
            println!(
                "{transport},{processes},{block},{},{:.4},{:.0},{:.1},{:.1},{:.1},{:.4},{},{},{},{},{},{:.4},{},{}",
                m.bytes,
                m.gib_per_s,
                m.blocks_per_s,
                m.p50_us,
                m.p99_us,
                m.max_us,
                m.cpu_s_per_gib,
                m.verified.map(|v| v.to_string()).unwrap_or_default(),
                o(raw),
                o(mem),
                o(ratio(raw)),
                o(ratio(mem)),
                cpu_both,
                o(raw_cpu),
                o(cpu_ratio)
            );
        } else {
            let o = |v: Option<f64>| v.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into());
            println!(
                "{:>9} {:>10} {:>9.3} {:>12.0} {:>10.0} {:>10.0} {:>10.0} {:>9.3} {:>8} {:>9} {:>9} {:>9.3} {:>9}",
                human(block),
                human(m.bytes),
                m.gib_per_s,
                m.blocks_per_s,
                m.p50_us,
                m.p99_us,
                m.max_us,
                m.cpu_s_per_gib,
                m.verified.map(|v| v.to_string()).unwrap_or_else(|| "skipped".into()),
                o(ratio(raw)),
                o(ratio(mem)),
                cpu_both,
                o(cpu_ratio)
            );
        }
    }
    if let Some(path) = &run.plot {
        svg_plot(path, &transport, &plot_rows)?;
    }
    Ok(all_ok)
}
