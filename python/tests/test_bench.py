"""``python -m kvxfer.bench`` runs its workload end to end (a small one here) and reports
what kvxfer-bench reports, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_benchmark_moves_and_verifies_its_workload():
    cmd = [sys.executable, "-m", "kvxfer.bench", "--block-bytes", "64K,256K", "--total-bytes", "4M"]
    out = subprocess.run(cmd + ["--iters", "1", "--warmup", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["block_bytes"] for r in rows] == [64 << 10, 256 << 10]
    for r in rows:
        assert r["verified"] is True and r["bytes"] == 4 << 20
        assert r["gib_per_s"] > 0 and r["p50_us"] > 0 and r["cpu_s_per_gib"] > 0
        assert r["prefill"]["pulled"] == r["n"] and r["prefill"]["expired"] == 0


def test_the_latency_benchmark_pairs_each_hand_off_with_a_raw_round_trip():
    cmd = [sys.executable, "-m", "kvxfer.bench", "--latency", "--block-bytes", "64K", "--iters", "30", "--warmup", "2"]
    out = subprocess.run(
        cmd + ["--json", "--worker-threads", "0", "--notify-with-read"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["mode"] == "latency" and row["processes"] == "2" and row["raw_responder"] == "python"
    assert 0 < row["raw_rtt_p10_us"] <= row["raw_rtt_p50_us"] and 0 < row["handoff_p10_us"] <= row["handoff_p50_us"]
    assert row["handoff_vs_raw_rtt_paired_p50"] > 0
    # Counted CPU of the decode process per hand-off (submit to report), and its switches.
    assert row["decode_cpu_us_per_handoff"] > 0 and row["decode_context_switches_per_handoff"] >= 0
    # Split by thread: the caller in submit and in wait, the rest the agent's runtime.
    split = [row[k] for k in ("decode_caller_submit_cpu_us", "decode_caller_wait_cpu_us", "decode_runtime_cpu_us")]
    assert split[0] > 0 and split[1] >= 0
    assert abs(sum(split) - row["decode_cpu_us_per_handoff"]) <= 0.5, (split, row["decode_cpu_us_per_handoff"])
    # Every lease of the run was pulled, none released or expired.
    assert row["prefill"] == {"leased": 32, "pulled": 32, "released": 0, "expired": 0}
    # Every pulled block was checked, and each lone child's notify rode behind its read.
    assert row["verified"] is True and row["notifies_with_read"] == 32
