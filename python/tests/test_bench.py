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
