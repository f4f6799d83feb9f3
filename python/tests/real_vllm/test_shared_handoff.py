"""The shared prompt hand-off (the default, ``kvxfer_share_prompt``) on real vLLM 0.33's
scheduler, only the forward faked (``engine_sim.py``, as ``test_scheduler_0_33.py``).

The n children of a parallel-sampling parent compute the same prompt KV: the first child to
finish holds one lease for the parent, every child's params name it, the other children's
blocks are freed at once (their leases retracted: counted released), and on the decode side
the children naming that lease are served by one pull (a local copy of its blocks for the
others). So whichever child's params a router keeps — the first (Dynamo), the last (vLLM's
non-streaming merge) or all (kvxfer's router) — nothing is left to expire.

Run: ``/var/cache/kvxfer/vllm-0.33.0-py3.11/bin/python -m pytest -q
python/tests/real_vllm/test_shared_handoff.py``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

pytest.importorskip("vllm")
import vllm  # noqa: E402

if not vllm.__version__.startswith("0.33."):
    pytest.skip(f"written against vLLM 0.33 (this is {vllm.__version__})", allow_module_level=True)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from engine_sim import SAMPLED_TOKEN, Engine, cpu_attention_layouts, default_attention_layouts  # noqa: E402
from test_scheduler_0_33 import (  # noqa: E402
    DECODE_EXTRA,
    DECODE_TOKENS,
    Pair,
    Snapshot,
    prompt_for,
    router_hop,
    run_decode,
)

# The default: no kvxfer_share_prompt key.
SHARED_PREFILL_EXTRA = {"kvxfer_host": "127.0.0.1", "kvxfer_arm_wait": 30.0}
# The connector counters the shared hand-off moves by design.
SHARED_COUNTERS = ("shared_children", "shared_pulls")
N = 4


@pytest.fixture(scope="module", params=["sync", "async"])
def pair(request: pytest.FixtureRequest, model_dir: str):
    asynchronous = request.param == "async"
    layouts = default_attention_layouts() if asynchronous else cpu_attention_layouts()
    prefill = Engine(
        model_dir,
        "kv_producer",
        async_scheduling=asynchronous,
        extra_config=SHARED_PREFILL_EXTRA,
        attention_layouts=layouts,
    )
    decode = Engine(
        model_dir, "kv_consumer", async_scheduling=asynchronous, extra_config=DECODE_EXTRA, attention_layouts=layouts
    )
    yield Pair(request.param, prefill, decode)
    prefill.shutdown()
    decode.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama-shared")))


def counters(pair: Pair) -> dict[str, int]:
    """The shared hand-off's connector counters, prefill and decode sides together."""
    out = {k: 0 for k in SHARED_COUNTERS}
    for engine in (pair.prefill, pair.decode):
        for stats in (engine.connector.stats(), engine.worker_stats()):
            for k in SHARED_COUNTERS:
                out[k] += int(stats.get(k, 0))
    return out


def others(snapshot: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k not in SHARED_COUNTERS} for s in snapshot]


def step_both(pair: Pair, done: Any, what: str) -> None:
    """Steps the decode engine, then the prefill engine, until ``done()`` (a guard against a
    hang, not a timed assertion)."""
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        pair.decode.step()
        pair.prefill.step()
        time.sleep(0.001)


def settle(pair: Pair, before: Snapshot) -> None:
    """Both engines idle, every block back in both pools, no lease live or expired, no
    connector counter moved but the shared hand-off's."""
    step_both(pair, lambda: pair.prefill.idle() and pair.decode.idle(), "both engines to free every request")
    for engine in (pair.prefill, pair.decode):
        assert engine.free_blocks() == engine.free_blocks_at_start, "vLLM did not get every block back"
    delta = before.lease_delta(pair)
    assert delta["live"] == 0 and delta["expired"] == 0, delta
    after = Snapshot.of(pair)
    assert others(after.prefill_connectors) == others(before.prefill_connectors), "a prefill counter moved"
    assert others(after.decode_connectors) == others(before.decode_connectors), "a decode counter moved"


def run_prefill_outputs(pair: Pair, request_id: str, prompt: list[int], params: dict[str, Any], max_tokens: int = 1):
    """A prefill request with ``params`` run to its end; (engine ids, the finished output)."""
    engine = pair.prefill
    ids = engine.add_request(request_id, prompt, n=N, max_tokens=max_tokens, kv_transfer_params=params)
    outputs = engine.run_until(lambda: not engine.has_unfinished_requests(), f"prefill {request_id}")
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 1 and len(finished[0].outputs) == N
    return ids, finished[0]


def child_params(pair: Pair, ids: list[str]) -> dict[str, dict[str, Any]]:
    """What each prefill child's ``request_finished`` returned, from the engine core's
    outputs (the params a router that keeps one child's would see)."""
    out = {}
    for o in pair.prefill.core_outputs:
        if o.request_id in ids and o.kv_transfer_params:
            out[o.request_id] = o.kv_transfer_params
    return out


DYNAMO_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def shared_prefill(pair: Pair, tag: str) -> tuple[list[int], dict[str, Any], int, torch.Tensor]:
    """A prefill request with Dynamo's params and n = N, run to its end: (prompt, the params
    the decode gets, how many blocks the shared lease holds, their bytes)."""
    prompt = prompt_for(tag, 40)
    _, output = run_prefill_outputs(pair, f"req-{tag}", prompt, DYNAMO_PARAMS)
    params = router_hop(output.kv_transfer_params)
    holder_params, holder_sent = pair.prefill.sent_words[params["remote_request_id"]]
    return prompt, params, len(holder_params["remote_block_ids"]), holder_sent


def check_every_child_has_the_prompt(pair: Pair, holder_sent: torch.Tensor, decode_ids: list[str], count: int) -> None:
    """Each decode child's blocks, as reported loaded, hold the shared lease's bytes."""
    for rid in decode_ids:
        assert rid in pair.decode.recv_words, f"{rid} was never reported loaded"
        blocks, received = pair.decode.recv_words[rid]
        assert len(blocks) >= count
        assert torch.equal(received[:, :count], holder_sent), f"{rid}: its blocks differ from the shared lease's"


@pytest.mark.parametrize(
    "prefill_params",
    [
        {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": N},
        # What Dynamo's vLLM worker sends (no kvxfer_n): the fan-out is recognised by id.
        {"do_remote_decode": True, "do_remote_prefill": False},
    ],
    ids=["kvxfer-router", "dynamo"],
)
def test_one_lease_per_parent_whichever_childs_params_the_router_keeps(pair: Pair, prefill_params) -> None:
    before = Snapshot.of(pair)
    shared_before = counters(pair)
    tag = f"shared-{pair.mode}-{len(prefill_params)}"
    prompt = prompt_for(tag, 40)
    ids, output = run_prefill_outputs(pair, f"req-{tag}", prompt, prefill_params)
    by_child = child_params(pair, ids)
    assert sorted(by_child) == sorted(ids), "every child returns params"
    leases = {p["remote_request_id"] for p in by_child.values()}
    assert len(leases) == 1, f"the children name {len(leases)} leases, not one: {leases}"
    (lease,) = leases
    assert all(p.get("kvxfer_shared") for p in by_child.values())
    assert "kvxfer_children" not in output.kv_transfer_params
    # Three siblings' blocks were freed at once; one lease holds the prompt.
    assert counters(pair)["shared_children"] - shared_before["shared_children"] == N - 1
    # The siblings' leases are retracted before the next step's forward (the engine keeps
    # stepping: the holder waits for its lease to end).
    for _ in range(3):
        pair.prefill.step()
    delta = before.lease_delta(pair)
    assert (delta["live"], delta["released"]) == (1, N - 1), delta
    holder_params, holder_sent = pair.prefill.sent_words[lease]
    # The decode request carries one child's params (the first's, as Dynamo keeps).
    first = router_hop(by_child[ids[0]])
    decode_ids, outputs = run_decode(pair, f"dec-{tag}", prompt, N, first)
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == [[SAMPLED_TOKEN] * DECODE_TOKENS] * N
    # One pull read the lease; the three other decode children got a copy of its blocks.
    pulls = [rid for rid in decode_ids if pair.decode.pulled_lease(rid) == lease]
    assert len(pulls) == N, "every decode child was told to load the shared lease"
    check_every_child_has_the_prompt(pair, holder_sent, decode_ids, len(holder_params["remote_block_ids"]))
    assert set(decode_ids) <= pair.decode.finished_recving()
    settle(pair, before)
    assert counters(pair)["shared_pulls"] - shared_before["shared_pulls"] == N - 1
    assert before.lease_delta(pair) == dict(leased=N, pulled=1, released=N - 1, expired=0, retracted=0, live=0)
    decode_stats = pair.decode.worker_stats()["decode"]
    assert decode_stats is not None
    # Every child finished: the prefill scheduler keeps nothing of the parent (a long-running
    # engine would otherwise hold each parent's hand-offs until they age out).
    sched = pair.prefill.connector.scheduler
    assert not [p for p in sched._siblings if tag in p], sched._siblings


def test_a_decode_child_aborted_before_the_pull_does_not_end_the_lease_for_the_others(pair: Pair) -> None:
    before = Snapshot.of(pair)
    tag = f"shared-abort-{pair.mode}"
    prompt, params, count, holder_sent = shared_prefill(pair, tag)
    # Child 0 (the one that would pull) and child 2 are aborted before they are scheduled.
    decode_ids, _ = run_decode(pair, f"dec-{tag}", prompt, N, params, abort_children=(0, 2))
    check_every_child_has_the_prompt(pair, holder_sent, [decode_ids[i] for i in (1, 3)], count)
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=N, pulled=1, released=N - 1, expired=0, retracted=0, live=0)


def test_every_decode_child_aborted_releases_the_shared_lease_once(pair: Pair) -> None:
    before = Snapshot.of(pair)
    tag = f"shared-abort-all-{pair.mode}"
    prompt, params, _, _ = shared_prefill(pair, tag)
    run_decode(pair, f"dec-{tag}", prompt, N, params, abort_children=tuple(range(N)))
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=N, pulled=0, released=N, expired=0, retracted=0, live=0)


def test_children_that_generated_more_than_one_token_keep_their_own_hand_offs(pair: Pair) -> None:
    """A prefill that sampled two tokens per child computed KV that differs per child past
    the prompt: per-child leases, as before (each listed in ``kvxfer_children``)."""
    before = Snapshot.of(pair)
    tag = f"per-child-{pair.mode}"
    prompt = prompt_for(tag, 40)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": N}
    ids, output = run_prefill_outputs(pair, f"req-{tag}", prompt, params, max_tokens=2)
    by_child = child_params(pair, ids)
    assert len({p["remote_request_id"] for p in by_child.values()}) == N
    assert not any(p.get("kvxfer_shared") for p in by_child.values())
    decode_ids, _ = run_decode(pair, f"dec-{tag}", prompt, N, router_hop(output.kv_transfer_params))
    for i, rid in enumerate(decode_ids):
        assert pair.decode.pulled_lease(rid) == ids[i]
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=N, pulled=N, released=0, expired=0, retracted=0, live=0)


def test_the_pulling_child_aborted_mid_pull_still_serves_its_siblings(pair: Pair) -> None:
    """Decode child 0 reads the shared lease; it is aborted right after the step that sent
    its pull: the read goes on (not cancelled), its siblings get their copy, and the lease
    ends pulled."""
    before = Snapshot.of(pair)
    tag = f"shared-abort-puller-{pair.mode}"
    prompt, params, count, holder_sent = shared_prefill(pair, tag)
    engine = pair.decode
    ids = engine.add_request(f"dec-{tag}", prompt, n=N, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    deadline = time.monotonic() + 60
    while not any(ids[0] in getattr(m, "to_recv", {}) for m in engine.worker.received_metadata):
        assert time.monotonic() < deadline, "the pull was never sent"
        engine.step()
    engine.abort([ids[0]])
    step_both(pair, lambda: not engine.has_unfinished_requests(), "the decode children")
    check_every_child_has_the_prompt(pair, holder_sent, ids[1:], count)
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=N, pulled=1, released=N - 1, expired=0, retracted=0, live=0)


def test_children_allocated_after_the_puller_is_gone_compute_their_prompt(pair: Pair, model_dir: str) -> None:
    """A decode engine with blocks for two children at a time: children 0 and 1 take the
    shared hand-off (one pull, one copy), children 2 and 3 get blocks only once those have
    finished — nothing left to copy from, so they compute their prompt (counted
    ``shared_recomputed``) instead of failing on a lease already read."""
    small = Engine(
        model_dir,
        "kv_consumer",
        async_scheduling=pair.mode == "async",
        extra_config=DECODE_EXTRA,
        attention_layouts=default_attention_layouts() if pair.mode == "async" else cpu_attention_layouts(),
        num_blocks=8,
        max_model_len=96,
    )
    try:
        tight = Pair(pair.mode, pair.prefill, small)
        before = Snapshot.of(tight)
        tag = f"shared-tight-{pair.mode}"
        prompt, params, _, _ = shared_prefill(pair, tag)
        decode_ids, outputs = run_decode(tight, f"dec-{tag}", prompt, N, params)
        final = [o for o in outputs if o.finished]
        assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == [[SAMPLED_TOKEN] * DECODE_TOKENS] * N
        stats = small.connector.stats()
        assert stats["shared_recomputed"] >= 1, stats
        assert stats["submit_failures"] == 0 and not any(r.invalid_block_ids for r in small.records), stats
        step_both(tight, small.idle, "the small decode engine to free every request")
        assert small.free_blocks() == small.free_blocks_at_start
        delta = before.lease_delta(tight)
        assert delta == dict(leased=N, pulled=1, released=N - 1, expired=0, retracted=0, live=0), delta
    finally:
        small.shutdown()


def test_a_child_that_loads_nothing_does_not_end_the_shared_lease_for_a_sibling_that_reads_it(pair: Pair) -> None:
    """vLLM 0.32's scheduler (the CPU build's engines) loads nothing for a request whose
    local prefix-cache hit, sub-block tail included, covers what the connector offers (it
    calls ``update_state_after_alloc`` with 0 external tokens), while a sibling allocated
    right after it loads; and its siblings may reach the scheduler only after it was
    allocated (the front end adds a parent's children one request at a time), so they name
    the hand-off only then. Both are reproduced on 0.33's scheduler here: the
    ``on_new_request`` hook does nothing and the connector's answer for decode child 0 is
    overridden to 0.
    Child 0 computes its prompt, and the shared lease must stay for its siblings — found
    under load with real engines: child 0 released it, and child 1's read found it ended."""
    before = Snapshot.of(pair)
    tag = f"shared-local-first-{pair.mode}"
    prompt = prompt_for(tag, 40)
    _, output = run_prefill_outputs(
        pair, f"req-{tag}", prompt, {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": N}
    )
    params = router_hop(output.kv_transfer_params)
    holder_params, holder_sent = pair.prefill.sent_words[params["remote_request_id"]]
    connector = pair.decode.scheduler.connector
    real = connector.get_num_new_matched_tokens

    def local_first(request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        answer = real(request, num_computed_tokens)  # it still names the hand-off
        return (0, False) if request.request_id.startswith("0_") else answer

    connector.get_num_new_matched_tokens = local_first
    connector.on_new_request = lambda request: None  # the siblings are not there yet
    try:
        decode_ids, outputs = run_decode(pair, f"dec-{tag}", prompt, N, params)
    finally:
        del connector.get_num_new_matched_tokens
        del connector.on_new_request
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == [[SAMPLED_TOKEN] * DECODE_TOKENS] * N
    check_every_child_has_the_prompt(pair, holder_sent, decode_ids[1:], len(holder_params["remote_block_ids"]))
    settle(pair, before)
    assert before.lease_delta(pair) == dict(leased=N, pulled=1, released=N - 1, expired=0, retracted=0, live=0)


def test_siblings_arriving_after_every_reader_finished_compute_their_prompt(pair: Pair) -> None:
    """Two children of a Dynamo-style request (no kvxfer_n) read the shared hand-off and
    finish; two more requests naming it come later (a frontend that sends children apart,
    or a retry). The scheduler forgot the read once no local request claimed it, so they
    read an ended lease and failed; they now compute their prompt (``shared_recomputed``)."""
    before = Snapshot.of(pair)
    recomputed = int(pair.decode.connector.stats().get("shared_recomputed", 0))
    tag = f"shared-late-{pair.mode}"
    prompt, params, count, holder_sent = shared_prefill(pair, tag)
    first, _ = run_decode(pair, f"dec-{tag}", prompt, 2, params)
    check_every_child_has_the_prompt(pair, holder_sent, first, count)
    late, outputs = run_decode(pair, f"late-{tag}", prompt, 2, params)
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == [[SAMPLED_TOKEN] * DECODE_TOKENS] * 2
    stats = pair.decode.connector.stats()
    assert int(stats["shared_recomputed"]) - recomputed == 2, stats
    assert stats["submit_failures"] == 0 and not any(r.invalid_block_ids for r in pair.decode.records), stats
    step_both(pair, lambda: pair.prefill.idle() and pair.decode.idle(), "both engines to free every request")
    for engine in (pair.prefill, pair.decode):
        assert engine.free_blocks() == engine.free_blocks_at_start, "vLLM did not get every block back"
    assert before.lease_delta(pair) == dict(leased=N, pulled=1, released=N - 1, expired=0, retracted=0, live=0)
