"""kvxfer's vLLM connector driven by real vLLM 0.33 on a CPU, only the forward pass faked.

A prefill engine (``kv_producer``) and a decode engine (``kv_consumer``) are built from
vLLM's own pieces (``engine_sim.py``): its scheduler creates the scheduler-side connector,
its connector factory the worker-side one, its allocator the KV-cache tensors; each step
crosses vLLM's serialization and runs the model runner's connector hooks in vLLM's own
order; requests are fanned out by ``ParentRequest`` and their outputs read through
``OutputProcessor``. Every test runs with the synchronous ``Scheduler`` (the CPU attention
backend's KV-cache layout) and with ``AsyncScheduler`` (vLLM's default layout order, its
batch queue of two steps).

Run: ``/var/cache/kvxfer/vllm-0.33.0-py3.11/bin/python -m pytest -q
python/tests/real_vllm/test_scheduler_0_33.py``.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import pytest

pytest.importorskip("vllm")
import vllm  # noqa: E402

if not vllm.__version__.startswith("0.33."):
    pytest.skip(f"written against vLLM 0.33 (this is {vllm.__version__})", allow_module_level=True)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from engine_sim import (  # noqa: E402
    SAMPLED_TOKEN,
    Engine,
    cpu_attention_layouts,
    default_attention_layouts,
    make_vllm_config,
)
from tiny_model import make_tiny_model  # noqa: E402

from kvxfer.vllm import KvxferConnector, KvxferConnectorMetadata  # noqa: E402

# Per-child hand-offs (kvxfer_share_prompt off): what these tests check per child; the shared
# prompt hand-off, the default, is tested in test_shared_handoff.py on the same scheduler.
PREFILL_EXTRA = {"kvxfer_host": "127.0.0.1", "kvxfer_arm_wait": 30.0, "kvxfer_share_prompt": False}
DECODE_EXTRA = {"kvxfer_host": "127.0.0.1"}
DECODE_TOKENS = 2


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@dataclass
class Pair:
    mode: str
    prefill: Engine
    decode: Engine


@pytest.fixture(scope="module", params=["sync", "async"])
def pair(request: pytest.FixtureRequest, model_dir: str):
    asynchronous = request.param == "async"
    layouts = default_attention_layouts() if asynchronous else cpu_attention_layouts()
    prefill = Engine(
        model_dir, "kv_producer", async_scheduling=asynchronous, extra_config=PREFILL_EXTRA, attention_layouts=layouts
    )
    decode = Engine(
        model_dir, "kv_consumer", async_scheduling=asynchronous, extra_config=DECODE_EXTRA, attention_layouts=layouts
    )
    assert type(prefill.scheduler).__name__ == ("AsyncScheduler" if asynchronous else "Scheduler")
    yield Pair(request.param, prefill, decode)
    prefill.shutdown()
    decode.shutdown()


# ---------------------------------------------------------------------- helpers


def prompt_for(tag: str, length: int = 40) -> list[int]:
    rng = random.Random(tag)
    return [rng.randrange(0, 256) for _ in range(length)]


@dataclass
class Snapshot:
    """Counters before a test, to compare with after."""

    leases: dict[str, int]
    server: dict[str, int]
    prefill_connectors: list[dict[str, Any]]
    decode_connectors: list[dict[str, Any]]

    @classmethod
    def of(cls, pair: Pair) -> "Snapshot":
        agent = pair.prefill.worker_stats()["prefill"]
        return cls(
            dict(agent["leases"]),
            dict(agent["server"]),
            [_own_counters(pair.prefill.connector.stats()), _own_counters(pair.prefill.worker_stats())],
            [_own_counters(pair.decode.connector.stats()), _own_counters(pair.decode.worker_stats())],
        )

    def lease_delta(self, pair: Pair) -> dict[str, int]:
        now = pair.prefill.worker_stats()["prefill"]["leases"]
        return {k: now[k] - self.leases[k] for k in ("leased", "pulled", "released", "expired", "retracted", "live")}

    def arm_waits(self, pair: Pair) -> int:
        return pair.prefill.worker_stats()["prefill"]["server"]["arm_waits"] - self.server["arm_waits"]


def _own_counters(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if isinstance(v, int)}


def eventually(what: str, cond: Any, timeout: float = 30.0) -> None:
    """Waits until ``cond()`` holds (a guard against a hang, not a timed assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def run_prefill(pair: Pair, request_id: str, prompt: list[int], n: int) -> tuple[list[str], Any]:
    """A prefill request as the router sends it, run until the user sees its output (the
    offline API's loop); returns the engine core's request ids and the ``RequestOutput``."""
    engine = pair.prefill
    params = {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": n}
    ids = engine.add_request(request_id, prompt, n=n, max_tokens=1, kv_transfer_params=params)
    outputs = engine.run_until(lambda: not engine.has_unfinished_requests(), f"prefill {request_id}")
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 1, outputs
    assert len(finished[0].outputs) == n
    assert finished[0].kv_transfer_params is not None, "the prefill's RequestOutput carries no kv_transfer_params"
    return ids, finished[0]


def router_hop(params: dict[str, Any]) -> dict[str, Any]:
    """The params as they reach the decode instance (JSON through the router)."""
    return json.loads(json.dumps(params))


def run_decode(
    pair: Pair,
    request_id: str,
    prompt: list[int],
    n: int,
    params: dict[str, Any],
    *,
    step_prefill: bool = True,
    abort_children: tuple[int, ...] = (),
) -> tuple[list[str], list[Any]]:
    """The decode request (the prefill's params), run until its children finish; the
    prefill engine keeps stepping (a server's busy loop) unless ``step_prefill`` is off."""
    engine = pair.decode
    ids = engine.add_request(request_id, prompt, n=n, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    if abort_children:
        engine.abort([ids[i] for i in abort_children])
    outputs: list[Any] = []
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"timed out waiting for decode {request_id}"
        outputs.extend(engine.step())
        if step_prefill:
            pair.prefill.step()
        time.sleep(0.001)
    return ids, outputs


def settle(pair: Pair, before: Snapshot) -> None:
    """Steps both engines until nothing is left, then checks what every test must leave:
    every block back in both block pools, no lease live or expired, no read that waited
    for an arm, no connector counter moved."""
    deadline = time.monotonic() + 60
    while not (pair.prefill.idle() and pair.decode.idle()):
        assert time.monotonic() < deadline, "timed out waiting for both engines to free every request"
        pair.prefill.step()
        pair.decode.step()
        time.sleep(0.001)
    for engine in (pair.prefill, pair.decode):
        assert engine.free_blocks() == engine.free_blocks_at_start, "vLLM did not get every block back"
    delta = before.lease_delta(pair)
    assert delta["live"] == 0, delta
    assert delta["expired"] == 0, f"a lease expired: {delta}"
    assert before.arm_waits(pair) == 0, "a read waited for its lease to be armed"
    after = Snapshot.of(pair)
    assert after.prefill_connectors == before.prefill_connectors, "a prefill connector counter moved"
    assert after.decode_connectors == before.decode_connectors, "a decode connector counter moved"


def check_blocks(pair: Pair, prefill_id: str, decode_id: str, prompt: list[int]) -> None:
    """The decode request's blocks, as its pull left them, hold the prefill's bytes (whole
    blocks, as the lease held them), and its prompt slots hold what the forward wrote."""
    params, sent = pair.prefill.sent_words[prefill_id]
    assert decode_id in pair.decode.recv_words, f"{decode_id} was never reported loaded"
    blocks, received = pair.decode.recv_words[decode_id]
    count = len(params["remote_block_ids"])
    assert len(blocks) >= count
    assert torch.equal(received[:, :count], sent), f"{decode_id}: the pulled blocks differ from {prefill_id}'s"
    assert pair.decode.worker.expected_prompt_mismatches(received, prompt) == 0
    assert pair.prefill.worker.expected_prompt_mismatches(sent, prompt) == 0


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("n, length", [(1, 32), (4, 40), (1, 300)], ids=["n1", "n4", "n1-chunked"])
def test_each_decode_child_pulls_its_own_hand_off(pair: Pair, n: int, length: int) -> None:
    """300 tokens take two prefill chunks (256 tokens a step): the lease is minted at the
    last one."""
    before = Snapshot.of(pair)
    tag = f"handoff-{pair.mode}-{n}-{length}"
    prompt = prompt_for(tag, length)
    prefill_ids, output = run_prefill(pair, f"req-{tag}", prompt, n)
    chunks = [r.scheduled[prefill_ids[0]] for r in pair.prefill.records if prefill_ids[0] in r.scheduled]
    assert sum(chunks) == length and (len(chunks) > 1) == (length > 256), chunks
    params = output.kv_transfer_params
    if n > 1:
        children = params["kvxfer_children"]
        assert sorted(c["kvxfer_child_index"] for c in children) == list(range(n))
        assert {c["remote_request_id"] for c in children} == set(prefill_ids)
    else:
        assert params["remote_request_id"] == prefill_ids[0]
    decode_ids, outputs = run_decode(pair, f"dec-{tag}", prompt, n, router_hop(params))
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == [[SAMPLED_TOKEN] * DECODE_TOKENS] * n
    for i, decode_id in enumerate(decode_ids):
        assert pair.decode.pulled_lease(decode_id) == prefill_ids[i]
        check_blocks(pair, prefill_ids[i], decode_id, prompt)
    assert set(decode_ids) <= pair.decode.finished_recving()
    settle(pair, before)
    assert set(prefill_ids) <= pair.prefill.finished_sending()
    assert before.lease_delta(pair) == dict(leased=n, pulled=n, released=0, expired=0, retracted=0, live=0)


def test_offline_prefill_takes_no_step_after_its_output(pair: Pair) -> None:
    """The offline ``LLM`` API steps the prefill engine only until its outputs are done:
    the hand-offs must be live by then. The prefill agent waits up to 30 s for an arm
    (``kvxfer_arm_wait``); no read may have waited at all."""
    before = Snapshot.of(pair)
    tag = f"offline-{pair.mode}"
    prompt = prompt_for(tag)
    prefill_ids, output = run_prefill(pair, f"req-{tag}", prompt, 2)
    steps = pair.prefill.steps
    decode_ids, _ = run_decode(pair, f"dec-{tag}", prompt, 2, router_hop(output.kv_transfer_params), step_prefill=False)
    assert pair.prefill.steps == steps, "the prefill engine was stepped"
    eventually("both leases to end pulled", lambda: before.lease_delta(pair)["pulled"] == 2)
    assert before.arm_waits(pair) == 0, "the decode's reads waited for the leases to be armed"
    for i, decode_id in enumerate(decode_ids):
        check_blocks(pair, prefill_ids[i], decode_id, prompt)
    # Only now does the prefill engine step again: it learns the leases ended and frees.
    settle(pair, before)
    assert set(prefill_ids) <= pair.prefill.finished_sending()
    assert before.lease_delta(pair) == dict(leased=2, pulled=2, released=0, expired=0, retracted=0, live=0)


def test_decode_child_aborted_before_its_pull_releases_its_lease(pair: Pair) -> None:
    before = Snapshot.of(pair)
    tag = f"abort-decode-{pair.mode}"
    prompt = prompt_for(tag)
    prefill_ids, output = run_prefill(pair, f"req-{tag}", prompt, 4)
    params = router_hop(output.kv_transfer_params)
    decode_ids, _ = run_decode(pair, f"dec-{tag}", prompt, 4, params, abort_children=(2,))
    assert pair.decode.pulled_lease(decode_ids[2]) is None
    assert decode_ids[2] not in pair.decode.finished_recving()
    for i in (0, 1, 3):
        assert pair.decode.pulled_lease(decode_ids[i]) == prefill_ids[i]
        check_blocks(pair, prefill_ids[i], decode_ids[i], prompt)
    settle(pair, before)
    # The released lease's request is reported finished sending too: its blocks are freed.
    assert set(prefill_ids) <= pair.prefill.finished_sending()
    assert before.lease_delta(pair) == dict(leased=4, pulled=3, released=1, expired=0, retracted=0, live=0)


def test_prefill_aborted_after_its_last_token_step_retracts_its_lease(pair: Pair) -> None:
    """The abort lands while the step computing the prompt's last token runs (after the
    forward armed the lease): the lease is retracted and vLLM never hears of it."""
    before = Snapshot.of(pair)
    engine = pair.prefill
    tag = f"abort-prefill-{pair.mode}"
    params = {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": 1}
    (rid,) = engine.add_request(f"req-{tag}", prompt_for(tag), max_tokens=1, kv_transfer_params=params)
    engine.abort_during_next_step([rid])
    armed_before = len([m for m in engine.sent_metadata if rid in m.to_arm])
    engine.run_until(lambda: rid not in engine.scheduler.requests, f"{rid} to be freed")
    assert len([m for m in engine.sent_metadata if rid in m.to_arm]) == armed_before + 1, "no lease was armed"
    assert before.lease_delta(pair)["leased"] == 1
    settle(pair, before)
    eventually("the lease to end", lambda: before.lease_delta(pair)["released"] == 1)
    # Steps after the end reached the worker (a plain request): still never reported.
    engine.add_request(f"plain-{tag}", prompt_for(f"plain-{tag}"), max_tokens=2)
    settle(pair, before)
    assert rid not in engine.finished_sending()
    assert not [o for o in engine.core_outputs if o.request_id == rid and o.kv_transfer_params]
    assert before.lease_delta(pair) == dict(leased=1, pulled=0, released=1, expired=0, retracted=0, live=0)


@pytest.mark.parametrize("randomized", [True, False], ids=["internal-id", "client-id"])
def test_a_client_id_that_looks_like_a_child_pulls_its_own_hand_off(
    pair: Pair, randomized: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not randomized:
        monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    before = Snapshot.of(pair)
    prompt = prompt_for(f"client-id-{pair.mode}-{randomized}")
    prefill_ids, output = run_prefill(pair, "1_router-req", prompt, 1)
    decode_ids, _ = run_decode(pair, "1_router-req", prompt, 1, router_hop(output.kv_transfer_params))
    if not randomized:
        assert prefill_ids == decode_ids == ["1_router-req"]
    assert pair.decode.pulled_lease(decode_ids[0]) == prefill_ids[0]
    check_blocks(pair, prefill_ids[0], decode_ids[0], prompt)
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=1, pulled=1, released=0, expired=0, retracted=0, live=0)


def test_metadata_survives_vllm_serialization(pair: Pair) -> None:
    before = Snapshot.of(pair)
    tag = f"serial-{pair.mode}"
    prompt = prompt_for(tag)
    prefill_ids, output = run_prefill(pair, f"req-{tag}", prompt, 2)
    params = router_hop(output.kv_transfer_params)
    # The handshake metadata reached the scheduler side: the params name the real agent.
    agent = pair.prefill.worker.connector.worker.prefill
    assert params["remote_port"] == agent.port and params["kvxfer_incarnation"] == agent.incarnation
    decode_ids = pair.decode.add_request(f"dec-{tag}", prompt, n=2, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    for rid in decode_ids:  # the EngineCoreRequest crossed as msgpack
        assert pair.decode.scheduler.requests[rid].kv_transfer_params == params
    pair.decode.run_until(lambda: not pair.decode.has_unfinished_requests(), "decode")
    settle(pair, before)
    for engine in (pair.prefill, pair.decode):
        assert len(engine.sent_metadata) == len(engine.worker.received_metadata)
        for sent, received in zip(engine.sent_metadata, engine.worker.received_metadata):
            assert type(sent) is type(received) is KvxferConnectorMetadata
            assert vars(sent) == vars(received)
    assert any(set(prefill_ids) & set(m.to_arm) for m in pair.prefill.worker.received_metadata)
    assert all(any(rid in m.to_recv for m in pair.decode.worker.received_metadata) for rid in decode_ids)


_PROMETHEUS: dict[str, Any] = {}


def test_stats_go_through_vllm_logging_and_prometheus(pair: Pair) -> None:
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    labels = {"model_name": "tiny", "engine": "0"}
    if "prom" not in _PROMETHEUS:  # registered once per process (prometheus' global registry)
        _PROMETHEUS["prom"] = KVConnectorProm(pair.prefill.vllm_config, list(labels), {0: list(labels.values())})
    prom = _PROMETHEUS["prom"]

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(f"vllm:kvxfer_{name}_total", labels) or 0.0

    for engine in (pair.prefill, pair.decode):
        engine.kv_logging.log(log_fn=lambda *args: None)  # ends the interval so far
    start = {e: len(e.kv_connector_stats) for e in (pair.prefill, pair.decode)}
    counters = {k: sample(k) for k in ("leases_made", "leases_pulled", "pulls_done", "pulled_bytes")}
    before = Snapshot.of(pair)
    tag = f"stats-{pair.mode}"
    prompt = prompt_for(tag)
    _, output = run_prefill(pair, f"req-{tag}", prompt, 2)
    run_decode(pair, f"dec-{tag}", prompt, 2, router_hop(output.kv_transfer_params))
    settle(pair, before)

    lines: list[str] = []
    for engine in (pair.prefill, pair.decode):
        engine.kv_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        for payload in engine.kv_connector_stats[start[engine] :]:
            prom.observe(payload, 0)
    metrics = [dict(re.findall(r"(\w+)=([\d.]+)", line)) for line in lines]
    assert len(metrics) == 2 and all(line.startswith("KV Transfer metrics: ") for line in lines), lines
    prefill, decode = metrics
    assert float(prefill["leases_pulled"]) == 2 and float(prefill["pulls_done"]) == 0
    assert float(prefill["leases_made"]) == 2, "every lease made is counted, and ends once"
    assert float(decode["pulls_done"]) == 2 and float(decode["pulled_MiB"]) > 0
    assert sample("leases_pulled") - counters["leases_pulled"] == 2
    assert sample("leases_made") - counters["leases_made"] == 2
    assert sample("pulls_done") - counters["pulls_done"] == 2
    assert sample("pulled_bytes") > counters["pulled_bytes"]


@pytest.mark.parametrize("n", [1, 4])
def test_a_decode_request_refused_before_admission_releases_every_lease(pair: Pair, n: int) -> None:
    """vLLM's API server refuses a request (say, a prompt too long) after the prefill ran:
    ``notify_kv_transfer_request_rejected`` hands the engine core a pre-aborted request
    under the client's id with the request's params, so the connector frees what they pin
    on the prefill side — every child's lease, not only the one the params are about."""
    before = Snapshot.of(pair)
    tag = f"refused-{pair.mode}-{n}"
    prompt = prompt_for(tag)
    prefill_ids, output = run_prefill(pair, f"req-{tag}", prompt, n)
    pair.decode.notify_rejected(f"cmpl-{tag}", router_hop(output.kv_transfer_params))
    pair.decode.step()  # the release goes out with the next step's metadata
    eventually(f"{n} leases to be released", lambda: before.lease_delta(pair)["released"] == n, timeout=10)
    settle(pair, before)
    assert set(prefill_ids) <= pair.prefill.finished_sending()
    assert before.lease_delta(pair) == dict(leased=n, pulled=0, released=n, expired=0, retracted=0, live=0)


def test_a_prompt_seen_before_hits_both_prefix_caches_and_pulls_the_tail(pair: Pair) -> None:
    """The same prompt twice: the second prefill computes only its last block (two come
    from its prefix cache, and its lease holds all three), and the second decode finds two
    blocks in its own prefix cache and pulls the last one only."""
    tag = f"prefix-{pair.mode}"
    prompt = prompt_for(tag)
    for round in range(2):
        before = Snapshot.of(pair)
        prefill_ids, output = run_prefill(pair, f"req-{tag}-{round}", prompt, 1)
        pulls = len(pair.decode.kv_connector_stats)
        decode_ids, _ = run_decode(pair, f"dec-{tag}-{round}", prompt, 1, router_hop(output.kv_transfer_params))
        check_blocks(pair, prefill_ids[0], decode_ids[0], prompt)
        settle(pair, before)
        assert before.lease_delta(pair) == dict(leased=1, pulled=1, released=0, expired=0, retracted=0, live=0)
        computed = [r.scheduled[prefill_ids[0]] for r in pair.prefill.records if prefill_ids[0] in r.scheduled]
        pulled = [b for stats in pair.decode.kv_connector_stats[pulls:] for b in stats["bytes"]]
        block_bytes = pair.decode.worker.block_words([0]).numel() * 4
        if round == 0:
            assert computed == [40] and pulled == [3 * block_bytes]
        else:
            assert computed == [40 - 32] and pulled == [block_bytes], (computed, pulled)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_is_a_load_error_vllm_acts_on(pair: Pair, model_dir: str, policy: str) -> None:
    """A pull that cannot reach its prefill agent (the router named a port nothing listens
    on): the blocks are reported as load errors in the step that reports the request
    loaded, and vLLM applies its policy — the request fails, or is computed locally. The
    real hand-off is then pulled by a retry."""
    import socket

    before = Snapshot.of(pair)
    tag = f"failed-{pair.mode}-{policy}"
    prompt = prompt_for(tag)
    prefill_ids, output = run_prefill(pair, f"req-{tag}", prompt, 1)
    params = router_hop(output.kv_transfer_params)
    decode = Engine(
        model_dir,
        "kv_consumer",
        async_scheduling=pair.mode == "async",
        extra_config=DECODE_EXTRA,
        attention_layouts=default_attention_layouts() if pair.mode == "async" else cpu_attention_layouts(),
        kv_load_failure_policy=policy,
    )
    closed = socket.socket()  # bound, never listening: connections to it are refused
    try:
        closed.bind(("127.0.0.1", 0))
        broken = dict(params, remote_port=closed.getsockname()[1])
        (rid,) = decode.add_request(f"dec-{tag}", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=broken)
        outputs = decode.run_until(lambda: not decode.has_unfinished_requests(), f"{rid} to finish")
        failed = [r for r in decode.records if rid in r.finished_recving]
        assert len(failed) == 1 and failed[0].invalid_block_ids, "the load errors came apart from the report"
        finish = [o.finish_reason for o in decode.core_outputs if o.request_id == rid and o.finish_reason]
        if policy == "fail":
            assert [str(f) for f in finish] == ["error"], finish
        else:
            assert [str(f) for f in finish] == ["length"], finish
            (final,) = [o for o in outputs if o.finished]
            assert final.outputs[0].token_ids == [SAMPLED_TOKEN] * DECODE_TOKENS
            recomputed = [r.scheduled[rid] for r in decode.records if rid in r.scheduled]
            assert recomputed[0] == len(prompt), recomputed
        decode.run_until(decode.idle, "the failed decode engine to free everything")
        assert decode.free_blocks() == decode.free_blocks_at_start
    finally:
        closed.close()
        decode.shutdown()
    decode_ids, _ = run_decode(pair, f"dec-{tag}-retry", prompt, 1, params)
    check_blocks(pair, prefill_ids[0], decode_ids[0], prompt)
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=1, pulled=1, released=0, expired=0, retracted=0, live=0)


@pytest.mark.parametrize("length", [32, 40])
def test_a_prefill_that_generates_several_tokens_hands_off_its_prompt(pair: Pair, length: int) -> None:
    """A prefill request asked for three tokens (the offline API with do_remote_decode and
    its own max_tokens): its outputs' KV fills blocks past the prompt's (at 32 tokens, a
    new one), but the hand-off is the prompt's blocks, armed before the output leaves —
    the decode allocates blocks for the prompt only, and no prefill step follows."""
    before = Snapshot.of(pair)
    engine = pair.prefill
    tag = f"several-{pair.mode}-{length}"
    prompt = prompt_for(tag, length)
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    (rid,) = engine.add_request(f"req-{tag}", prompt, max_tokens=3, kv_transfer_params=params)
    outputs = engine.run_until(lambda: not engine.has_unfinished_requests(), f"prefill {rid}")
    (final,) = [o for o in outputs if o.finished]
    assert final.outputs[0].token_ids == [SAMPLED_TOKEN] * 3
    handoff = router_hop(final.kv_transfer_params)
    assert len(handoff["remote_block_ids"]) == -(-length // 16), handoff["remote_block_ids"]
    steps = engine.steps
    decode_ids, _ = run_decode(pair, f"dec-{tag}", prompt, 1, handoff, step_prefill=False)
    assert engine.steps == steps
    eventually("the lease to end pulled", lambda: before.lease_delta(pair)["pulled"] == 1)
    assert before.arm_waits(pair) == 0, "the decode's read waited for the lease to be armed"
    check_blocks(pair, rid, decode_ids[0], prompt)
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=1, pulled=1, released=0, expired=0, retracted=0, live=0)


@pytest.mark.parametrize("n", [1, 2])
def test_a_prefill_request_preempted_after_its_lease_was_minted_hands_off_a_fresh_one(
    pair: Pair, model_dir: str, n: int
) -> None:
    """A prefill engine of eight blocks: a long request's next block preempts the prefill
    request (a child of it for n = 2) after the step that computed its prompt minted and
    armed its lease. The lease is retracted; the request is recomputed, and its new
    last-token step mints a lease under an id of its own that the worker can arm — the
    params the user gets name it, and the decode pulls it."""
    prefill = Engine(
        model_dir,
        "kv_producer",
        async_scheduling=pair.mode == "async",
        extra_config=PREFILL_EXTRA,
        attention_layouts=default_attention_layouts() if pair.mode == "async" else cpu_attention_layouts(),
        num_blocks=9,
        max_model_len=128,
    )
    try:
        sub = Pair(pair.mode, prefill, pair.decode)
        before = Snapshot.of(sub)
        tag = f"preempted-{pair.mode}-{n}"
        prompt = prompt_for(tag, 60)
        # n = 2: the long request stops at 64 tokens (4 blocks) — the finished child's lease
        # keeps its 4 blocks until the decode pulls, after its sibling finished too.
        long_prompt, long_tokens = (63, 20) if n == 1 else (47, 17)
        prefill.add_request(f"long-{tag}", prompt_for(f"long-{tag}", long_prompt), max_tokens=long_tokens)
        params = {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": n}
        prefill_ids = prefill.add_request(f"req-{tag}", prompt, n=n, max_tokens=3, kv_transfer_params=params)
        outputs = prefill.run_until(lambda: not prefill.has_unfinished_requests(), "both prefill requests")
        (final,) = [o for o in outputs if o.finished and o.kv_transfer_params]
        preempted = {rid for r in prefill.records for rid in r.preempted}
        assert preempted & set(prefill_ids), "no prefill request was preempted"
        handoff = router_hop(final.kv_transfer_params)
        entries = handoff.get("kvxfer_children") or [handoff]
        leases = {e["kvxfer_child_index"]: e["remote_request_id"] for e in entries}
        for i, rid in enumerate(prefill_ids):
            assert (leases[i] == rid) == (rid not in preempted), leases
        decode_ids, _ = run_decode(sub, f"dec-{tag}", prompt, n, handoff)
        for i, decode_id in enumerate(decode_ids):
            assert pair.decode.pulled_lease(decode_id) == leases[i]
            check_blocks(sub, prefill_ids[i], decode_id, prompt)
        settle(sub, before)
        retracted = len(preempted & set(prefill_ids))
        assert before.lease_delta(sub) == dict(
            leased=n + retracted, pulled=n, released=retracted, expired=0, retracted=0, live=0
        )
    finally:
        prefill.shutdown()


def test_a_lease_re_minted_at_finish_is_reported_under_a_deferred_finalize(pair: Pair, model_dir: str) -> None:
    """The model runner's order with a speculative config (``defer_finalize``): the step's
    finished transfers are asked for before ``wait_for_save``. A prefill request that
    finishes more than half a lease TTL after its prompt's step re-mints its lease in
    ``request_finished``; that lease is armed in the step whose ``finished_req_ids`` names
    the request, after vLLM asked for finished transfers. Its end must still be reported
    (``finished_sending``), or vLLM never frees the request's blocks."""
    prefill = Engine(
        model_dir,
        "kv_producer",
        async_scheduling=pair.mode == "async",
        extra_config={**PREFILL_EXTRA, "kvxfer_lease_ttl": 2.0},
        attention_layouts=default_attention_layouts() if pair.mode == "async" else cpu_attention_layouts(),
        defer_finalize=True,
    )
    try:
        sub = Pair(pair.mode, prefill, pair.decode)
        before = Snapshot.of(sub)
        tag = f"deferred-{pair.mode}"
        prompt = prompt_for(tag, 40)
        params = {"do_remote_decode": True, "do_remote_prefill": False}
        # Another request keeps the engine busy: the step that arms the re-minted lease runs
        # a forward (a step without one asks for finished transfers after wait_for_save).
        prefill.add_request(f"busy-{tag}", prompt_for(f"busy-{tag}", 20), max_tokens=40)
        (rid,) = prefill.add_request(f"req-{tag}", prompt, max_tokens=3, kv_transfer_params=params)
        outputs = prefill.run_until(lambda: before.lease_delta(sub)["leased"] == 1, "the prompt's lease")
        time.sleep(1.1)  # past half the TTL: request_finished re-mints
        deadline = time.monotonic() + 60
        while not any(o.finished and o.kv_transfer_params for o in outputs):
            assert time.monotonic() < deadline, f"timed out waiting for prefill {rid}"
            outputs += prefill.step()
        assert prefill.has_unfinished_requests(), "the busy request ended first"
        (final,) = [o for o in outputs if o.finished and o.kv_transfer_params]
        handoff = router_hop(final.kv_transfer_params)
        assert handoff["remote_request_id"] != rid, "the lease was not re-minted at request_finished"
        # The engine core's busy loop steps on while finished requests are to be told to
        # the workers: the step that names this one finished arms its new lease.
        prefill.run_until(lambda: before.lease_delta(sub)["leased"] == 2, "the re-minted lease armed")
        decode_ids, _ = run_decode(sub, f"dec-{tag}", prompt, 1, handoff)
        check_blocks(sub, rid, decode_ids[0], prompt)
        settle(sub, before)
        assert rid in prefill.finished_sending()
        assert before.lease_delta(sub) == dict(leased=2, pulled=1, released=1, expired=0, retracted=0, live=0)
    finally:
        prefill.shutdown()


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_pipeline_parallelism_is_refused_at_start_up_naming_it(model_dir: str, kv_role: str) -> None:
    """vLLM's connector factory makes the connector with the engine's own config: with two
    pipeline stages (each holding only its layers' KV cache) the connector refuses to start,
    saying why, instead of having every decode stage read one prefill stage's lease."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = make_vllm_config(model_dir, kv_role, async_scheduling=False, extra_config=DECODE_EXTRA)
    config.parallel_config.pipeline_parallel_size = 2
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
            KVConnectorFactory.create_connector(config=config, role=role, kv_cache_config=None)
    config.parallel_config.pipeline_parallel_size = 1
    assert isinstance(KvxferConnector(config, KVConnectorRole.SCHEDULER, None), KvxferConnector)


def test_host_staging_moves_blocks_with_vllms_copy_op(pair: Pair, model_dir: str) -> None:
    """Both engines stage through registered host memory (``kvxfer_host_staging``, the GPU
    path run on a CPU): the blocks go device→host before the arm and host→device before
    the decode's request is reported loaded, through the op vLLM handed the connector."""
    layouts = default_attention_layouts() if pair.mode == "async" else cpu_attention_layouts()
    staged = dict(kvxfer_host_staging=True)
    sub = Pair(
        pair.mode,
        Engine(
            model_dir,
            "kv_producer",
            async_scheduling=pair.mode == "async",
            extra_config={**PREFILL_EXTRA, **staged},
            attention_layouts=layouts,
        ),
        Engine(
            model_dir,
            "kv_consumer",
            async_scheduling=pair.mode == "async",
            extra_config={**DECODE_EXTRA, **staged},
            attention_layouts=layouts,
        ),
    )
    try:
        for engine in (sub.prefill, sub.decode):
            assert engine.worker.connector.worker.staging is not None
        before = Snapshot.of(sub)
        tag = f"staged-{pair.mode}"
        prompt = prompt_for(tag)
        prefill_ids, output = run_prefill(sub, f"req-{tag}", prompt, 2)
        decode_ids, _ = run_decode(sub, f"dec-{tag}", prompt, 2, router_hop(output.kv_transfer_params))
        for i, decode_id in enumerate(decode_ids):
            check_blocks(sub, prefill_ids[i], decode_id, prompt)
        settle(sub, before)
        assert before.lease_delta(sub) == dict(leased=2, pulled=2, released=0, expired=0, retracted=0, live=0)
    finally:
        sub.prefill.shutdown()
        sub.decode.shutdown()


@pytest.mark.parametrize("case", ["other-layout", "larger-blocks"])
def test_a_hand_off_the_decode_can_never_pull_is_refused_and_its_lease_released(
    pair: Pair, model_dir: str, case: str
) -> None:
    """The prefill engine resolved the other KV-cache layout (LBNHC against LBHNC): a
    block's bytes are ordered otherwise; or its blocks hold 32 tokens where the decode's
    hold 16 (a decode block cannot take a part of a prefill block). The decode refuses the
    pull (a load error, vLLM's fail policy fails the request) and releases the lease at
    once — for larger blocks over a control-only connection, since the handshake refuses
    the layouts."""
    same = default_attention_layouts() if pair.mode == "async" else cpu_attention_layouts()
    other = cpu_attention_layouts() if pair.mode == "async" else default_attention_layouts()
    prefill = Engine(
        model_dir,
        "kv_producer",
        async_scheduling=pair.mode == "async",
        extra_config=PREFILL_EXTRA,
        attention_layouts=other if case == "other-layout" else same,
        block_size=32 if case == "larger-blocks" else 16,
    )
    try:
        assert (prefill.layout != pair.decode.layout) == (case == "other-layout")
        sub = Pair(pair.mode, prefill, pair.decode)
        before = Snapshot.of(sub)
        tag = f"{case}-{pair.mode}"
        prompt = prompt_for(tag)
        _, output = run_prefill(sub, f"req-{tag}", prompt, 1)
        (rid,), _ = run_decode(sub, f"dec-{tag}", prompt, 1, router_hop(output.kv_transfer_params))
        finish = [str(o.finish_reason) for o in pair.decode.core_outputs if o.request_id == rid and o.finish_reason]
        assert finish == ["error"], finish
        decode_counters = before.decode_connectors
        before.decode_connectors = Snapshot.of(sub).decode_connectors  # the refusal is counted
        settle(sub, before)
        assert before.decode_connectors != decode_counters
        assert before.lease_delta(sub) == dict(leased=1, pulled=0, released=1, expired=0, retracted=0, live=0)
    finally:
        prefill.shutdown()


def test_a_decode_request_queued_behind_a_full_batch_keeps_a_short_lived_lease(pair: Pair, model_dir: str) -> None:
    """The prefill instance leases for two seconds (``kvxfer_lease_ttl``), the decode
    instance keeps its default (30 s, so a heartbeat every 5 s by its own setting) and runs
    one request at a time: the hand-off waits 4.5 s in the queue behind a running request.
    Its heartbeats follow the TTL the hand-off states; the lease is pulled, not expired."""
    asynchronous = pair.mode == "async"
    layouts = default_attention_layouts() if asynchronous else cpu_attention_layouts()
    sub = Pair(
        pair.mode,
        Engine(
            model_dir,
            "kv_producer",
            async_scheduling=asynchronous,
            extra_config={**PREFILL_EXTRA, "kvxfer_lease_ttl": 2.0},
            attention_layouts=layouts,
        ),
        Engine(
            model_dir,
            "kv_consumer",
            async_scheduling=asynchronous,
            extra_config=DECODE_EXTRA,
            attention_layouts=layouts,
            max_num_seqs=1,
        ),
    )
    try:
        before = Snapshot.of(sub)
        tag = f"queued-{pair.mode}"
        prompt = prompt_for(tag)
        prefill_ids, output = run_prefill(sub, f"req-{tag}", prompt, 1)
        (running,) = sub.decode.add_request(f"running-{tag}", prompt_for(f"running-{tag}"), max_tokens=400)
        (rid,) = sub.decode.add_request(
            f"dec-{tag}", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=router_hop(output.kv_transfer_params)
        )
        queued_until = time.monotonic() + 4.5
        while time.monotonic() < queued_until:
            sub.decode.step()
            sub.prefill.step()
            time.sleep(0.005)
        assert rid not in sub.decode.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        sub.decode.abort([running])
        sub.decode.run_until(lambda: not sub.decode.has_unfinished_requests(), f"{rid}")
        finish = [str(o.finish_reason) for o in sub.decode.core_outputs if o.request_id == rid and o.finish_reason]
        assert finish == ["length"], finish
        check_blocks(sub, prefill_ids[0], rid, prompt)
        settle(sub, before)
        assert before.lease_delta(sub) == dict(leased=1, pulled=1, released=0, expired=0, retracted=0, live=0)
    finally:
        sub.prefill.shutdown()
        sub.decode.shutdown()


def test_a_decode_child_aborted_while_its_pull_runs_frees_everything(pair: Pair) -> None:
    """The abort lands during the step whose worker submitted the pull: the pull is
    cancelled (or has already finished), vLLM frees the child's blocks once the worker
    reports it, and its lease ends one way or the other — never left to expire."""
    before = Snapshot.of(pair)
    tag = f"abort-in-flight-{pair.mode}"
    prompt = prompt_for(tag)
    prefill_ids, output = run_prefill(pair, f"req-{tag}", prompt, 2)
    engine = pair.decode
    decode_ids = engine.add_request(
        f"dec-{tag}", prompt, n=2, max_tokens=DECODE_TOKENS, kv_transfer_params=router_hop(output.kv_transfer_params)
    )
    engine.abort_during_next_step([decode_ids[1]])
    engine.run_until(lambda: not engine.has_unfinished_requests(), "the other child")
    assert engine.pulled_lease(decode_ids[1]) == prefill_ids[1], "the aborted child's pull was not submitted"
    check_blocks(pair, prefill_ids[0], decode_ids[0], prompt)
    settle(pair, before)
    assert decode_ids[1] in engine.finished_recving()
    delta = before.lease_delta(pair)
    assert delta["leased"] == 2 and delta["pulled"] + delta["released"] == 2 and delta["pulled"] >= 1, delta
