"""The two processes of test_two_process.py (importable by name, as ``spawn`` needs): a vLLM
prefill instance and a vLLM decode instance, each a process of its own with the kvxfer
connector (scheduler and worker side) and numpy KV caches, exchanging only the
``kv_transfer_params`` a router would forward."""

from __future__ import annotations

import traceback
from typing import Any

from vllm_real import Request
from vllm_sim import Instance, caches, same_blocks

PROMPT = list(range(10))
SEED = 11
NUM_BLOCKS = 64


def child_blocks(n: int) -> dict[int, list[int]]:
    """Child i's prefill blocks: two prompt blocks shared by all, one of its own."""
    return {i: [1, 2, 10 + i] for i in range(n)}


def prefill_main(conn: Any, n: int) -> None:
    """Finishes the children of parent R, sends the last child's params (what vLLM's output
    path keeps), then steps until every lease ended and reports the lease counters."""
    try:
        inst = Instance("kv_producer", "prefill-engine", num_blocks=NUM_BLOCKS, seed=SEED)
        params = None
        for i, blocks in child_blocks(n).items():
            req = Request(f"{i}_R", list(PROMPT), kv_transfer_params={"do_remote_decode": True, "kvxfer_n": n})
            _, params = inst.finish_prefill(req, blocks)
        conn.send(params)
        inst.run_until("every child's blocks handed back", lambda: len(inst.sending) == n, timeout=60)
        conn.send({"sending": sorted(inst.sending), "leases": inst.stats()["prefill"]["leases"]})
        inst.shutdown()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send({"error": traceback.format_exc()})


def decode_main(conn: Any, n: int) -> None:
    """Receives the params, forks the decode parent into n children, pulls, and checks every
    child's bytes against the prefill process's caches (same seed)."""
    try:
        params = conn.recv()
        inst = Instance("kv_consumer", "decode-engine", num_blocks=NUM_BLOCKS)
        children = [Request(f"{i}_D", list(PROMPT), kv_transfer_params=params) for i in range(n)]
        local = [inst.add_decode(c) for c in children]
        inst.run_until("every child received", lambda: len(inst.recving) == n, timeout=60)
        expected = caches(NUM_BLOCKS, SEED)
        verified = [same_blocks(expected, child_blocks(n)[i], inst.caches, local[i]) for i in range(n)]
        conn.send(
            {
                "verified": verified,
                "recving": sorted(inst.recving),
                "load_errors": sorted(inst.load_errors),
                "decode": inst.stats()["decode"],
            }
        )
        inst.shutdown()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send({"error": traceback.format_exc()})
