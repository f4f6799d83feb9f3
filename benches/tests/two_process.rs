//! The prefill and decode agents in two processes (`kvxfer-bench serve` and `pull`), so
//! UCX's shared-memory / CMA transports really cross address spaces. Every destination block
//! verified (the last pull into it).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer-bench");

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `serve` on a free port of 127.0.0.1 and returns it with its control address.
fn serve(extra: &[&str]) -> (Serve, String) {
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--runs", "1"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("serve prints its address");
    let addr = line.trim().rsplit(' ').next().expect("address").to_owned();
    (Serve(child), addr)
}

fn pull(addr: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(BIN)
        .args(["pull", "--peer", addr, "--block-bytes", "64K,1M", "--total-bytes", "16M", "--n", "4"])
        .args(["--iters", "2", "--warmup", "0", "--json"])
        .args(extra)
        .output()
        .expect("run pull");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "pull failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().map(|l| serde_json::from_str(l).expect("json line")).collect()
}

/// Runs `serve` with `serve_args` and `pull` with `transport_args` and checks every row;
/// the prefill side's KV cache must be in `memory`.
fn two_processes_with(serve_args: &[&str], transport_args: &[&str], memory: &str) {
    let (_serve, addr) = serve(serve_args);
    let rows = pull(&addr, transport_args);
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["verified"], true, "{r}");
        assert_eq!(r["prefill"]["memory"], memory, "{r}");
        assert_eq!(r["processes"], "2");
        assert_eq!(r["bytes"], 16 << 20);
        assert!(r["gib_per_s"].as_f64().expect("number") > 0.0);
        // The prefill process counted what it served: 2 iterations of 16 MiB per block size.
        assert_eq!(r["prefill"]["bytes_served"], 2 * (16 << 20), "{r}");
        assert_eq!(r["prefill"]["pulled"], 8, "{r}");
        // Both processes say which libucp they loaded (null without the `ucx` feature).
        assert_eq!(r["ucx_version"], r["prefill"]["ucx_version"], "{r}");
        assert_eq!(r["ucx_version"].is_string(), cfg!(feature = "ucx"), "{r}");
    }
}

fn two_processes(transport_args: &[&str]) {
    let ucx = transport_args.contains(&"ucx");
    two_processes_with(transport_args, transport_args, if ucx { "ucx_region" } else { "heap" });
}

#[test]
fn tcp_across_two_processes() {
    two_processes(&["--transport", "tcp"]);
}

/// `serve`'s default transport (auto) serves a TCP run from the heap, as the raw TCP
/// baseline sends, even where UCX could allocate the memory.
#[test]
fn an_auto_serve_serves_tcp_from_the_heap() {
    two_processes_with(&[], &["--transport", "tcp"], "heap");
}

/// `--baseline` in two processes: the raw TCP runs go from the `serve` process to `pull`.
#[test]
fn raw_tcp_baseline_across_two_processes() {
    let (_serve, addr) = serve(&["--transport", "tcp"]);
    let rows = pull(&addr, &["--transport", "tcp", "--baseline"]);
    assert_eq!(rows.len(), 2);
    let mut rounds = 0;
    for r in &rows {
        assert_eq!(r["verified"], true, "{r}");
        assert_eq!(r["raw_tcp_processes"], "2", "{r}");
        let runs = r["raw_tcp_runs"].as_array().expect("raw runs");
        assert_eq!(runs.len(), 2, "{r}");
        assert!(runs.iter().all(|v| v.as_f64().is_some_and(|g| g.is_finite() && g > 0.0)), "{r}");
        // Each raw run stands beside its iteration: the ratio is kvxfer's rate over it.
        let per_iter = r["ratio_vs_raw_tcp_per_iter"].as_array().expect("per-iteration ratios");
        let iters = r["iter_gib_per_s"].as_array().expect("iterations");
        for ((ratio, kv), raw) in per_iter.iter().zip(iters).zip(runs) {
            let (ratio, kv, raw) = (ratio.as_f64(), kv.as_f64(), raw.as_f64());
            assert_eq!(ratio, kv.zip(raw).map(|(k, r)| k / r), "{r}");
        }
        // The raw round trips were answered by `serve`, every one of them (counted there,
        // over both block sizes so far).
        assert_eq!(r["raw_rtt_processes"], "2", "{r}");
        rounds += r["raw_tcp_rtt_one_block_us"]["samples"].as_u64().expect("rtt samples");
        assert!(rounds > 0, "{r}");
        assert_eq!(r["prefill"]["raw_rtt_rounds_served"], rounds, "{r}");
        // Counted CPU: each process's share, both together, and the raw runs' (the sending
        // threads counted in `serve`, the receiving ones here) on the same bytes.
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
        let (decode, prefill, both) =
            (f("decode_cpu_s_per_gib"), f("prefill_cpu_s_per_gib"), f("cpu_s_per_gib_both"));
        assert!(decode > 0.0 && prefill > 0.0, "{r}");
        assert!((both - (decode + prefill)).abs() < 1e-9, "{r}");
        let raw_cpu = r["raw_tcp_cpu_runs"].as_array().expect("raw CPU runs");
        assert_eq!(raw_cpu.len(), 2, "{r}");
        // [sending end, receiving end]: each copies every byte once through the kernel.
        let ends_counted = |v: &serde_json::Value| {
            let ends =
                v.as_array().map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect::<Vec<_>>());
            ends.is_some_and(|e| e.len() == 2 && e.iter().all(|c| c.is_finite() && *c > 0.005))
        };
        assert!(raw_cpu.iter().all(ends_counted), "{r}");
        assert_eq!(r["ratio_cpu_vs_raw_tcp"].as_f64(), Some(both / f("raw_tcp_cpu_s_per_gib")), "{r}");
        assert!(
            f("context_switches_per_parent") >= 0.0 && f("prefill_context_switches_per_parent") >= 0.0,
            "{r}"
        );
        // The machine's busy CPU (both processes on this machine, kernel threads included)
        // over kvxfer's iterations and over each raw run, and the ratio of the two; null for
        // windows too short for /proc/stat's ticks (these runs' are).
        let finite =
            |v: &serde_json::Value| v.is_null() || v.as_f64().is_some_and(|c| c.is_finite() && c >= 0.0);
        let machine_runs = r["raw_tcp_machine_cpu_runs"].as_array().expect("raw machine CPU runs");
        assert!(machine_runs.iter().all(finite), "{r}");
        for k in ["machine_cpu_s_per_gib", "raw_tcp_machine_cpu_s_per_gib", "ratio_machine_cpu_vs_raw_tcp"] {
            assert!(finite(&r[k]), "{k}: {r}");
        }
        if let (Some(m), Some(raw)) =
            (r["machine_cpu_s_per_gib"].as_f64(), r["raw_tcp_machine_cpu_s_per_gib"].as_f64())
        {
            if raw > 0.0 {
                assert!((f("ratio_machine_cpu_vs_raw_tcp") - m / raw).abs() < 1e-9, "{r}");
            }
        }
    }
}

#[cfg(feature = "ucx")]
#[test]
fn ucx_over_tcp_across_two_processes() {
    two_processes(&["--transport", "ucx", "--ucx-tls", "tcp", "--ucx-peer-failure"]);
}

#[cfg(feature = "ucx")]
#[test]
fn ucx_over_shared_memory_across_two_processes() {
    two_processes(&["--transport", "ucx", "--ucx-tls", "posix,sysv,cma,self"]);
}

/// `--memory heap`: UCX serves the KV cache from host memory it only registered (what an
/// engine's own tensors are), over shared memory, between two processes.
#[cfg(feature = "ucx")]
#[test]
fn ucx_over_shared_memory_from_heap_memory_across_two_processes() {
    let args = ["--transport", "ucx", "--ucx-tls", "posix,sysv,cma,self", "--memory", "heap"];
    two_processes_with(&args, &args, "heap");
}

/// `--baseline` over UCX from either memory: the raw get baseline (which reads the kind kvxfer
/// serves from, `--memory`) runs from the `serve` process, and its ratio is kvxfer's rate over it.
#[cfg(feature = "ucx")]
#[test]
fn the_raw_ucx_get_baseline_runs_from_either_memory() {
    for memory in ["heap", "ucx"] {
        let args = ["--transport", "ucx", "--ucx-tls", "posix,sysv,cma,self", "--memory", memory];
        let (_serve, addr) = serve(&args);
        let rows = pull(&addr, &[&args[..], &["--baseline"]].concat());
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(r["verified"], true, "{r}");
            assert_eq!(r["prefill"]["memory"], if memory == "heap" { "heap" } else { "ucx_region" }, "{r}");
            let raw = r["raw_ucx_get_gib_per_s"].as_f64().expect("raw get figure");
            assert!(raw.is_finite() && raw > 0.0, "{r}");
            assert_eq!(
                r["ratio_vs_raw_ucx_get"].as_f64(),
                Some(r["gib_per_s"].as_f64().expect("rate") / raw),
                "{r}"
            );
        }
    }
}

/// `pull --memory` names the memory `serve` was told to use; a `serve` that used another
/// fails the run instead of reporting its figures under the wrong memory.
#[test]
fn a_pull_refuses_figures_from_memory_it_did_not_ask_for() {
    let (_serve, addr) = serve(&["--transport", "tcp", "--memory", "heap"]);
    let out = Command::new(BIN)
        .args(["pull", "--peer", &addr, "--transport", "tcp", "--memory", "ucx", "--block-bytes", "64K"])
        .args(["--total-bytes", "1M", "--iters", "1", "--warmup", "0", "--json"])
        .output()
        .expect("run pull");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("the prefill side serves from \"heap\""), "{stderr}");
}

/// The many-requests workload across two processes: every level reports its figures, and
/// every slot's last pull holds the bytes of the blocks it last read — with the blocking
/// facade, and with the async agent on the bench's own runtime (`--async-submit`, which the
/// many-requests workload once ignored), multi-thread or current-thread.
#[test]
fn many_requests_over_tcp_across_two_processes() {
    for submit in [&[][..], &["--async-submit"], &["--async-submit", "--current-thread"]] {
        many_requests_across_two_processes(submit);
    }
}

fn many_requests_across_two_processes(submit: &[&str]) {
    let (_serve, addr) = serve(&["--transport", "tcp"]);
    let out = Command::new(BIN)
        .args(["pull", "--peer", &addr, "--transport", "tcp", "--block-bytes", "16K", "--n", "2"])
        .args(submit)
        .args([
            "--blocks-per-child",
            "2",
            "--concurrency",
            "1,8",
            "--rate",
            "200",
            "--max-in-flight",
            "8",
            "--lease-batch",
            "3",
            "--duration",
            "0.3",
            "--warmup-secs",
            "0.1",
        ])
        .arg("--json")
        .output()
        .expect("run pull");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "pull failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        stdout.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    for (r, c) in rows.iter().zip([1, 8, 8]) {
        if r["mode"] == "open" {
            // The open loop: 200 parents/s offered, at most 8 in flight.
            assert_eq!(r["offered_per_s"], 200.0, "{r}");
            assert_eq!(r["max_in_flight"], c, "{r}");
            assert!(r["cap_waits"].as_u64().is_some() && r["submit_lag_p99_us"].as_f64().is_some(), "{r}");
        } else {
            assert_eq!(r["mode"], "many", "{r}");
            assert_eq!(r["concurrency"], c, "{r}");
        }
        assert_eq!(r["verified"], true, "{r}");
        assert_eq!(r["async_submit"], !submit.is_empty(), "{r}");
        assert_eq!(r["current_thread"], submit.contains(&"--current-thread"), "{r}");
        assert!(r["requests"].as_u64().unwrap_or(0) > 0, "{r}");
        // The decode side holds c parents of 2 children of 2 blocks of 16 KiB.
        assert_eq!(r["kv_mib"].as_f64(), Some(f64::from(c) * 4.0 * 16.0 / 1024.0), "{r}");
        for k in ["requests_per_s", "p50_us", "p999_us", "cpu_us_per_request", "rss_peak_mib", "fds_max"] {
            assert!(r[k].as_f64().is_some(), "{k} missing: {r}");
        }
        assert!(r["prefill"]["fds"].as_u64().is_some(), "{r}");
        assert!(r["context_switches_per_request"].as_f64().is_some(), "{r}");
        assert!(r["prefill_context_switches_per_request"].as_f64().is_some(), "{r}");
    }
}

/// `--baseline` with many requests: after the level, a raw TCP run of the same bytes from
/// `serve`; each side's counted CPU per request stands beside its end's share of that run.
#[test]
fn many_requests_with_the_raw_tcp_baseline_report_cpu_against_the_kernels_share() {
    let (_serve, addr) = serve(&["--transport", "tcp"]);
    let out = Command::new(BIN)
        .args(["pull", "--peer", &addr, "--transport", "tcp", "--block-bytes", "64K", "--n", "4"])
        .args(["--blocks-per-child", "2", "--concurrency", "8", "--duration", "0.3", "--warmup-secs", "0.1"])
        .args(["--baseline", "--json"])
        .output()
        .expect("run pull");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "pull failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(stdout.lines().next().expect("a row")).expect("json");
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
    let (send, receive) = (f("raw_tcp_send_cpu_us_per_request"), f("raw_tcp_receive_cpu_us_per_request"));
    assert!(send > 0.0 && receive > 0.0, "{r}");
    let both = f("cpu_us_per_request") + f("prefill_cpu_us_per_request");
    assert!((f("cpu_us_per_request_both") - both).abs() < 1e-6, "{r}");
    assert!((f("decode_cpu_us_above_raw_receive") - (f("cpu_us_per_request") - receive)).abs() < 1e-6, "{r}");
    assert!(
        (f("prefill_cpu_us_above_raw_send") - (f("prefill_cpu_us_per_request") - send)).abs() < 1e-6,
        "{r}"
    );
    assert!((f("ratio_cpu_vs_raw_tcp") - both / (send + receive)).abs() < 1e-9, "{r}");
    // The measured window (0.3 s) is long enough for /proc/stat's ticks; the raw run's may
    // not be (then null).
    let machine = f("machine_cpu_us_per_request");
    assert!(machine.is_finite() && machine >= 0.0, "{r}");
    let raw_machine = &r["raw_tcp_machine_cpu_us_per_request"];
    assert!(raw_machine.is_null() || raw_machine.as_f64().is_some_and(|c| c.is_finite() && c >= 0.0), "{r}");
}

/// bench-two-process.sh pins each process where `--serve-cpus` / `--pull-cpus` say (both
/// forms of the flag), takes those flags itself (`pull` would refuse them), and each process
/// reports its CPUs.
#[test]
fn the_two_process_script_pins_each_process() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench-two-process.sh");
    // The first CPU this test may run on (a cpuset may leave out CPU 0).
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let allowed =
        status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).expect("Cpus_allowed_list");
    let cpu =
        allowed.trim().split([',', '-']).next().filter(|c| !c.is_empty()).expect("an allowed CPU").to_owned();
    let out = Command::new("bash")
        .arg(script)
        .args([
            "--serve-cpus",
            &cpu,
            &format!("--pull-cpus={cpu}"),
            "--transport",
            "tcp",
            "--block-bytes",
            "64K",
        ])
        .args(["--total-bytes", "1M", "--iters", "1", "--warmup", "0", "--json"])
        .env("KVXFER_BENCH", BIN)
        .output()
        .expect("run bench-two-process.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "script failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(stdout.lines().next().expect("a row")).expect("json");
    assert_eq!(r["cpus"], cpu.as_str(), "{r}");
    assert_eq!(r["prefill"]["cpus"], cpu.as_str(), "{r}");
    assert_eq!(r["verified"], true, "{r}");
}

/// `pull` at `addr` with `args`, `--json`: its first row (the run must succeed).
fn first_row(addr: &str, args: &[&str]) -> serde_json::Value {
    let out =
        Command::new(BIN).args(["pull", "--peer", addr]).args(args).arg("--json").output().expect("run pull");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "pull failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().next().expect("a row")).expect("json")
}

/// A vLLM-shaped cache (`--layers 4 --kv-split`: 8 regions, one 16 KiB piece of every
/// block in each) across two processes, bulk and many requests: every byte verified, and
/// the rows say how many pieces a parent moved.
#[test]
fn a_vllm_shaped_cache_of_many_regions_is_pulled_piece_by_piece() {
    let shape = ["--transport", "tcp", "--layers", "4", "--kv-split", "--block-bytes", "16K", "--n", "4"];
    let (_serve, addr) = serve(&["--transport", "tcp"]);
    let r =
        first_row(&addr, &[&shape[..], &["--total-bytes", "8M", "--iters", "2", "--warmup", "0"]].concat());
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["segments"], 8, "{r}");
    // 8 MiB per iteration: 4 children of 16 blocks of 8 pieces of 16 KiB.
    assert_eq!(r["bytes"], 8 << 20, "{r}");
    assert_eq!(r["pieces_per_parent"], 4 * 16 * 8, "{r}");
    assert_eq!(r["prefill"]["bytes_served"], 2 * (8 << 20), "{r}");

    let (_serve, addr) = serve(&["--transport", "tcp"]); // `serve --runs 1` served one pull
    let many = ["--blocks-per-child", "2", "--concurrency", "4", "--duration", "0.3", "--warmup-secs", "0.1"];
    let r = first_row(&addr, &[&shape[..], &many[..]].concat());
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["pieces_per_request"], 4 * 2 * 8, "{r}");
    assert!(r["requests"].as_u64().unwrap_or(0) > 0 && r["cpu_us_per_piece"].as_f64().is_some(), "{r}");
}
