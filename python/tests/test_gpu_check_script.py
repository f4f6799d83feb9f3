"""scripts/gpu_check.py, the device check's work, run here on host memory (``--device cpu``):
its two processes, leases, pulls over UCX, byte checks and report — so the run on a GPU
machine (scripts/gpu-check.sh) does not fail on the script's own logic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the check's caches are torch tensors")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_the_device_check_pulls_and_verifies_both_modes_on_host_memory():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--layers", "2", "--blocks", "64", "--prompt-blocks", "8",
         "--own-blocks", "2", "--rounds", "2", "--ucx-tls", "posix,cma,self"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["direct", "staged"]
    for r in rows:
        assert r["verified"] is True and r["bytes_delivered"] == 4 * 10 * 2 * 65536, r
        assert r["gib_s_median"] > 0 and r["torch_copy_gib_s_median"] > 0, r
        assert r["paths"] and all(p.startswith("ucx(") for p in r["paths"]), r
    assert rows[1]["prefill_staging_ms_median"] > 0, "staging copies the leased blocks to host memory"
