#!/usr/bin/env python3
"""The device check (run by scripts/gpu-check.sh): two processes on one GPU — a prefill with a
vLLM-shaped KV cache (layers x blocks, bf16, FlashAttention's (2, blocks, block_size, heads,
head_dim) per layer) and a decode — pull n children's blocks with kvxfer, first with the
CUDA caches registered as they are (UCX moves device memory: cuda_ipc on one GPU), then
through host staging (pinned host copies registered, device<->host copies around the pull).
Every pulled byte is compared with the prefill's on the device. Prints one JSON line per
mode with GiB/s, against torch's device-to-device copy of the same blocks, and the path UCX
chose.

    python scripts/gpu_check.py                 # CUDA, the sizes below
    python scripts/gpu_check.py --device cpu    # the same logic on host memory (tests)

The prefill process is this script with ``--role prefill``; it talks JSON lines over its
stdin/stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import kvxfer

GIB = float(1 << 30)


def cache_shape(a: argparse.Namespace) -> tuple[int, ...]:
    return (2, a.blocks, a.block_size, a.heads, a.head_dim)


def source_cache(a: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The prefill's cache: every layer's bits from a seeded generator, so the decode can make
    the same tensors to compare with."""
    out = {}
    for layer in range(a.layers):
        g = torch.Generator(device=a.device).manual_seed(1000 + layer)
        bits = torch.randint(-(1 << 15), 1 << 15, cache_shape(a), dtype=torch.int32, generator=g, device=a.device)
        out[f"model.layers.{layer}.self_attn.attn"] = bits.to(torch.int16).view(torch.bfloat16)
    return out


def children_blocks(a: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """Remote blocks (a shared prompt, then each child's own) and the decode's local blocks
    (distinct per child, as vLLM allocates them)."""
    prompt = list(range(a.prompt_blocks))
    remote = [prompt + [a.prompt_blocks + i * a.own_blocks + j for j in range(a.own_blocks)] for i in range(a.n)]
    per_child = a.prompt_blocks + a.own_blocks
    local = [[i * per_child + j for j in range(per_child)] for i in range(a.n)]
    return remote, local


def sync(a: argparse.Namespace) -> None:
    if a.device == "cuda":
        torch.cuda.synchronize()


def host_copy(cache: dict[str, torch.Tensor], a: argparse.Namespace) -> dict[str, torch.Tensor]:
    pin = a.device == "cuda"
    return {k: torch.zeros(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin) for k, v in cache.items()}


def copy_blocks(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], blocks: list[int]) -> None:
    idx = torch.tensor(blocks, dtype=torch.long)
    for k in dst:
        i = idx.to(src[k].device)
        dst[k][:, i.to(dst[k].device)] = src[k][:, i].to(dst[k].device, non_blocking=True)


def prefill_main(a: argparse.Namespace) -> None:
    """The prefill process: answers ``{"op": "lease", "round": r}`` with the children's params
    (after staging their blocks in ``staged`` mode) and ``{"op": "ends"}`` with the lease ends."""
    cache = source_cache(a)
    registered = cache
    if a.mode == "staged":
        registered = host_copy(cache, a)
    memory = kvxfer.kv_cache_memory(registered)
    agent = kvxfer.PrefillAgent(memory, engine_id="gpu-check-prefill", transport="ucx", ucx_tls=a.ucx_tls)
    remote, _ = children_blocks(a)
    print(json.dumps({"ready": True, "device_memory": a.mode == "direct" and a.device == "cuda"}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "lease":
            staging_s = 0.0
            if a.mode == "staged":
                t = time.perf_counter()
                copy_blocks(registered, cache, sorted({b for r in remote for b in r}))
                sync(a)
                staging_s = time.perf_counter() - t
            handoffs = agent.lease_parent(f"gpu-check-{cmd['round']}", remote)
            print(json.dumps({"params": [h.to_params() for h in handoffs], "staging_s": staging_s}), flush=True)
        elif cmd["op"] == "ends":
            ends = agent.wait_ends(cmd["count"], timeout=60)
            print(json.dumps({"ends": sorted(e["kind"] for e in ends)}), flush=True)
        elif cmd["op"] == "quit":
            break
    agent.shutdown()


def run_mode(a: argparse.Namespace, mode: str) -> dict[str, Any]:
    prefill = subprocess.Popen(
        [sys.executable, __file__, *sys.argv[1:], "--role", "prefill", "--mode", mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def ask(cmd: dict[str, Any]) -> dict[str, Any]:
        assert prefill.stdin is not None and prefill.stdout is not None
        prefill.stdin.write(json.dumps(cmd) + "\n")
        prefill.stdin.flush()
        line = prefill.stdout.readline()
        if not line:
            raise SystemExit(f"the prefill process ended ({prefill.wait()})")
        return json.loads(line)

    try:
        assert prefill.stdout is not None
        ready = json.loads(prefill.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise SystemExit("the prefill process did not start")
        expected = source_cache(a)
        cache = {k: torch.zeros(v.shape, dtype=v.dtype, device=a.device) for k, v in expected.items()}
        registered = host_copy(cache, a) if mode == "staged" else cache
        decode = kvxfer.DecodeAgent(
            kvxfer.kv_cache_memory(registered), engine_id="gpu-check-decode", transport="ucx", ucx_tls=a.ucx_tls
        )
        remote, local = children_blocks(a)
        all_local = sorted({b for l in local for b in l})
        rates, paths, pull_s, staging = [], set(), [], []
        try:
            for r in range(a.rounds):
                for k in cache:
                    cache[k].zero_()
                lease = ask({"op": "lease", "round": r})
                before = decode.stats()["bytes_pulled"]
                sync(a)
                t = time.perf_counter()
                reports = decode.submit(lease["params"], local).wait(timeout=120)
                if mode == "staged":
                    copy_blocks(cache, registered, all_local)
                    sync(a)
                elapsed = time.perf_counter() - t
                bad = [x for x in reports if x["outcome"] != "done"]
                if bad:
                    raise SystemExit(f"{mode}: children not pulled: {bad}")
                moved = sum(x["bytes_delivered"] for x in reports)
                wire = decode.stats()["bytes_pulled"] - before
                rates.append(moved / elapsed / GIB)
                pull_s.append(elapsed)
                staging.append(lease["staging_s"])
                paths.update(str(x["path"]) for x in reports)
                # Every byte, on the device: child i's local blocks hold the prefill's remote ones.
                for i in range(a.n):
                    ri = torch.tensor(remote[i], device=a.device)
                    li = torch.tensor(local[i], device=a.device)
                    for k in cache:
                        # As bits: random bf16 bits include NaNs, which never compare equal.
                        got, want = cache[k][:, li].view(torch.int16), expected[k][:, ri].view(torch.int16)
                        if not torch.equal(got, want):
                            raise SystemExit(f"{mode}: child {i}, {k}: pulled bytes differ from the prefill's")
            ends = ask({"op": "ends", "count": a.n * a.rounds})["ends"]
            if ends != ["pulled"] * (a.n * a.rounds):
                raise SystemExit(f"{mode}: lease ends {ends}")
            info = kvxfer.ucx_info(a.ucx_tls)
        finally:
            decode.shutdown()
        # Torch's device-to-device copy of the same blocks (the copy floor on this device).
        copy_rates = []
        for _ in range(a.rounds):
            sync(a)
            t = time.perf_counter()
            for i in range(a.n):
                ri = torch.tensor(remote[i], device=a.device)
                li = torch.tensor(local[i], device=a.device)
                for k in cache:
                    cache[k][:, li] = expected[k][:, ri]
            sync(a)
            copy_rates.append(moved / (time.perf_counter() - t) / GIB)
        return {
            "mode": mode,
            "device": a.device,
            "device_memory_registered": bool(ready.get("device_memory")),
            "layers": a.layers,
            "block_bytes_per_layer": 2 * a.block_size * a.heads * a.head_dim * 2,
            "n": a.n,
            "blocks_per_child": a.prompt_blocks + a.own_blocks,
            "bytes_delivered": moved,
            "bytes_over_ucx": wire,
            "gib_s_median": round(statistics.median(rates), 2),
            "pull_ms_median": round(1000 * statistics.median(pull_s), 2),
            "prefill_staging_ms_median": round(1000 * statistics.median(staging), 2),
            "torch_copy_gib_s_median": round(statistics.median(copy_rates), 2),
            "ratio_vs_torch_copy": round(statistics.median(rates) / statistics.median(copy_rates), 3),
            "paths": sorted(paths),
            "ucx_loaded": info.get("loaded_version"),
            "ucx_transports_here": info.get("transports"),
            "verified": True,
        }
    finally:
        try:
            ask({"op": "quit"})
        except (SystemExit, BrokenPipeError, json.JSONDecodeError, ValueError):
            pass
        prefill.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per layer's cache")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--n", type=int, default=4, help="children")
    ap.add_argument("--prompt-blocks", type=int, default=48, help="prompt blocks every child shares")
    ap.add_argument("--own-blocks", type=int, default=4, help="blocks of each child's own")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="direct,staged")
    ap.add_argument("--ucx-tls", default=None, help="UCX's transports (default UCX's choice)")
    ap.add_argument("--role", default="decode", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="direct", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.n * (a.prompt_blocks + a.own_blocks) > a.blocks or a.prompt_blocks + a.n * a.own_blocks > a.blocks:
        raise SystemExit("--blocks is too small for the children's blocks")
    if a.role == "prefill":
        prefill_main(a)
        return
    for mode in a.modes.split(","):
        print(json.dumps(run_mode(a, mode)), flush=True)


if __name__ == "__main__":
    main()
