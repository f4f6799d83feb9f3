"""The Python API: leases and pulls of numpy-backed KV caches over TCP on 127.0.0.1."""

from __future__ import annotations

import gc
import secrets
import threading
import time
import weakref

import numpy as np
import pytest

import kvxfer
from conftest import SHAPE, arm_waits, blocks_equal, eventually, random_cache, unarmed


def test_a_parent_with_four_children_is_pulled_and_every_lease_ends_pulled(prefill, decode, src, dst):
    blocks = [[1, 2, 10 + i] for i in range(4)]
    handoffs = prefill.lease_parent("R", blocks)
    assert [h.remote_request_id for h in handoffs] == ["0_R", "1_R", "2_R", "3_R"]
    params = [h.to_params() for h in handoffs]
    assert params[2]["kvxfer_child_index"] == 2 and params[2]["kvxfer_n"] == 4
    local = [[20, 21, 22], [23, 24, 25], [26, 27, 28], [29, 30, 31]]
    reports = decode.submit(params, local).wait(timeout=30)
    assert [r["outcome"] for r in reports] == ["done"] * 4
    assert [r["child_index"] for r in reports] == [0, 1, 2, 3]
    for i in range(4):
        assert blocks_equal(src, blocks[i], dst, local[i])
    ends = prefill.wait_ends(4, timeout=10)
    assert sorted(e["kind"] for e in ends) == ["pulled"] * 4
    leases = prefill.stats()["leases"]
    assert (leases["pulled"], leases["expired"], leases["unrecognized"]) == (4, 0, 0)
    stats = decode.stats()
    assert stats["notifies_with_read"] == 0, "off by default"
    # The four children's reads went out pipelined, in one batch, none made again.
    assert (stats["read_batches"], stats["reads_batched"], stats["reads_after_broken_batch"]) == (1, 4, 0)


def test_agents_on_one_thread_each_with_the_notify_behind_the_read_pull_every_child_once(src, dst):
    # worker_threads=0: each agent's runtime is one thread; notify_with_read: one round trip
    # per child whose own read settles it (children 0 and 2 share block 1: not those reads).
    prefill = kvxfer.PrefillAgent(
        kvxfer.kv_cache_memory([src]), engine_id="prefill-engine", worker_threads=0, transport="tcp"
    )
    decode = kvxfer.DecodeAgent(
        kvxfer.kv_cache_memory([dst]), engine_id="decode-engine", worker_threads=0, notify_with_read=True, transport="tcp"
    )
    try:
        blocks = [[1, 3], [4, 5], [1, 6], [7]]
        local = [[20, 21], [22, 23], [24, 25], [26]]
        for round_ in range(3):
            handoffs = prefill.lease_parent(f"ONE-{round_}", blocks)
            reports = decode.submit([h.to_params() for h in handoffs], local).wait(timeout=30)
            assert [r["outcome"] for r in reports] == ["done"] * 4
            for i in range(4):
                assert blocks_equal(src, blocks[i], dst, local[i])
        ends = prefill.wait_ends(12, timeout=10)
        assert sorted(e["kind"] for e in ends) == ["pulled"] * 12
        leases = prefill.stats()["leases"]
        assert (leases["pulled"], leases["released"], leases["expired"]) == (12, 0, 0)
        # Children 1 and 3 share no block: their notifies rode behind their reads.
        assert decode.stats()["notifies_with_read"] == 6
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_a_subset_of_children_is_pulled_alone_and_the_rest_by_another_pull(prefill, decode, src, dst):
    params = [h.to_params() for h in prefill.lease_parent("P", [[1], [2], [3]])]
    first = decode.submit([params[2]], [[9]])
    assert first.children == ["2_P"]
    assert first.wait(timeout=30)[0]["child_index"] == 2, "reports name the prefill side's child index"
    rest = decode.submit([params[1], params[0]], [[8], [7]])
    assert [r["remote_request_id"] for r in rest.wait(timeout=30)] == ["0_P", "1_P"]
    assert blocks_equal(src, [3, 2, 1], dst, [9, 8, 7])
    assert sorted(e["kind"] for e in prefill.wait_ends(3, timeout=10)) == ["pulled"] * 3
    queued = decode.poll_reports()
    assert sorted(r["remote_request_id"] for r in queued) == ["0_P", "1_P", "2_P"]
    assert decode.poll_reports() == [], "each queued report is taken once"


def test_an_armed_lease_is_pulled_with_the_minted_id_and_token(prefill, decode, src, dst):
    host, port = prefill.address
    minted = {
        "do_remote_prefill": True,
        "remote_block_ids": [4, 5],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "1_Q",
        "remote_host": host,
        "remote_port": port,
        "kvxfer_lease_token": secrets.token_hex(16),
        "kvxfer_parent_request_id": "Q",
        "kvxfer_child_index": 1,
        "kvxfer_n": 2,
    }
    pull = decode.submit([minted], [[6, 7]])  # before the arm: the read waits for it
    h = prefill.arm(minted)
    assert (h.remote_request_id, h.token, h.incarnation) == ("1_Q", minted["kvxfer_lease_token"], prefill.incarnation)
    assert pull.wait(timeout=30)[0]["outcome"] == "done"
    assert blocks_equal(src, [4, 5], dst, [6, 7])
    assert prefill.wait_ends(1, timeout=10)[0]["kind"] == "pulled"
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.arm(minted)
    assert e.value.kind == "token_reused", "an ended lease cannot be armed again with its token"
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.arm(dict(minted, remote_engine_id="another-engine"))
    assert e.value.kind == "wrong_engine"
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.arm(dict(minted, remote_request_id="Q"))
    assert e.value.kind == "id_mismatch" and "1_Q" in str(e.value)


def test_cancelling_a_child_releases_its_lease(prefill, decode):
    params = [h.to_params() for h in prefill.lease_parent("C", [[1], [2]])]
    h = kvxfer.Handoff.from_params(params[1])
    assert prefill.cancel(h) == "released"
    assert prefill.cancel(params[1]) == "already_released"
    reports = decode.submit(params, [[3], [4]]).wait(timeout=30)
    assert reports[0]["outcome"] == "done"
    err = reports[1]["error"]
    assert reports[1]["outcome"] == "failed" and isinstance(err, kvxfer.PullError)
    assert err.kind == "lease_ended" and err.advice == "retry_fresh_handoff" and err.retryable
    # The message a log shows: its kind's own first words, and its kind at the end.
    assert str(err).startswith("lease ended before it was read: ") and str(err).endswith("(kind=lease_ended)")
    assert reports[1]["local_blocks"] == [4]
    kinds = sorted(e["kind"] for e in prefill.wait_ends(2, timeout=10))
    assert kinds == ["pulled", "released"]


def test_finished_pulls_are_not_kept_by_the_agent(prefill, decode):
    """A decode worker serves pulls for as long as it runs: the agent keeps track of the live
    ones (for `cancel`), not of every pull it ever made."""
    for i in range(300):
        params = [h.to_params() for h in prefill.lease_parent(f"T{i}", [[i % 32]])]
        assert decode.submit(params, [[i % 32]]).wait(timeout=30)[0]["outcome"] == "done"
        decode.poll_reports()
    assert decode._tracked_pulls <= 128, decode._tracked_pulls
    # A pull under way is still found by its child's id (its hand-off not armed yet, so it
    # waits), also when a finished pull of the same id is still held.
    finished = decode.submit([h.to_params() for h in prefill.lease_parent("T-live", [[5]])], [[5]])
    assert finished.wait(timeout=30)[0]["outcome"] == "done"
    waiting = unarmed(prefill, "T-live", [6])
    pull = decode.submit([waiting], [[6]])
    assert decode.cancel("T-live")
    assert pull.wait(timeout=30)[0]["outcome"] == "cancelled"
    del finished


def test_a_draining_agent_refuses_new_leases_while_its_leases_are_pulled(prefill, decode, src, dst):
    before = [h.to_params() for h in prefill.lease_parent("D", [[1], [2]])]
    assert not prefill.draining
    prefill.drain()
    assert prefill.draining
    for refused in (lambda: prefill.lease_parent("N", [[3]]), lambda: prefill.lease("M", 0, 1, [4])):
        with pytest.raises(kvxfer.LeaseError) as e:
            refused()
        assert e.value.kind == "draining" and "is draining" in str(e.value)
    reports = decode.submit(before, [[5], [6]]).wait(timeout=30)
    assert [r["outcome"] for r in reports] == ["done", "done"]
    assert blocks_equal(src, [1, 2], dst, [5, 6])
    assert sorted(e["kind"] for e in prefill.wait_ends(2, timeout=10)) == ["pulled", "pulled"]
    # An arm is not refused: its id and token were published before the drain (vLLM's
    # scheduler mints them, the worker arms a step later); refusing it would fail a request
    # already in flight.
    minted = unarmed(prefill, "DA", [3])
    pull = decode.submit([minted], [[9]])
    prefill.arm(minted)
    assert pull.wait(timeout=30)[0]["outcome"] == "done"
    assert blocks_equal(src, [3], dst, [9])
    assert prefill.wait_ends(1, timeout=10)[0]["kind"] == "pulled"
    prefill.undrain()
    assert not prefill.draining
    again = [h.to_params() for h in prefill.lease_parent("A", [[7]])]
    assert decode.submit(again, [[8]]).wait(timeout=30)[0]["outcome"] == "done"


def test_a_pull_waiting_for_its_arm_can_be_cancelled(prefill, decode):
    minted = unarmed(prefill, "W", [4])
    pull = decode.submit([minted], [[5]])
    eventually("the read waits for the arm", lambda: arm_waits(prefill) == 1)
    pull.cancel_child(0)
    # The cancel reaches the pull task asynchronously: arm once it waits for the arm too
    # (else the read could finish first and the child be pulled).
    eventually("the cancel waits for the arm", lambda: arm_waits(prefill) == 2)
    prefill.arm(minted)
    report = pull.wait(timeout=30)[0]
    assert report["outcome"] == "cancelled" and report["released"] is True
    assert prefill.wait_ends(1, timeout=10)[0]["kind"] == "released"
    with pytest.raises(kvxfer.SubmitError):
        pull.cancel_child(3)


def test_waits_release_the_gil(prefill, decode):
    """While Pull.wait blocks (its read waits for an arm), other Python threads run."""
    minted = unarmed(prefill, "G", [1])
    pull = decode.submit([minted], [[2]])
    ticks = []
    armed = threading.Event()

    def other_thread():
        # Runs once the main thread blocks in Pull.wait (the pause), and only if that wait
        # released the GIL: else the wait gives up first (TimeoutError) and the test fails.
        time.sleep(0.2)
        ticks.append(1)
        prefill.arm(minted)
        armed.set()

    t = threading.Thread(target=other_thread)
    t.start()
    assert pull.wait(timeout=10)[0]["outcome"] == "done"
    t.join()
    assert armed.is_set() and ticks == [1]


def test_registered_memory_lives_as_long_as_the_agent(src):
    dst = np.zeros(SHAPE, dtype=np.float16)
    alive = weakref.ref(dst)
    decode = kvxfer.DecodeAgent(kvxfer.kv_cache_memory([dst]))
    del dst
    gc.collect()
    assert alive() is not None, "the agent keeps its memory alive"
    with kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src])) as prefill:
        params = prefill.lease("K", 0, 1, [3]).to_params()
        assert decode.submit([params], [[4]]).wait(timeout=30)[0]["outcome"] == "done"
        assert blocks_equal(src, [3], alive(), [4])
    decode.shutdown()
    del decode
    gc.collect()
    assert alive() is None, "and lets it go once the agent is gone"


def test_queued_lease_heartbeats(prefill, decode):
    params = prefill.lease("H", 0, 1, [1], ttl=30).to_params()
    assert decode.heartbeat([params], wait=True) == ["extended"]
    prefill.cancel(params)
    assert decode.heartbeat([params], wait=True) == ["already_released"]
    stats = decode.stats()
    assert (stats["keeper_extended"], stats["keeper_ended"]) == (1, 1)


def test_queued_lease_heartbeats_keep_no_connection_to_a_prefill_agent_that_went_away(decode, src):
    """A prefill engine restarted on another port leaves no pooled heartbeat connection
    behind in a decode agent that runs for days."""
    for i in range(3):
        prefill = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), transport="tcp")
        params = prefill.lease(f"K{i}", 0, 1, [1], ttl=30).to_params()
        assert decode.heartbeat([params], wait=True) == ["extended"]
        assert decode.stats()["keeper_connections"] == 1, "the gone agents' connections were dropped"
        prefill.shutdown()  # closes the keeper's connection; no heartbeat goes there again


def test_a_shut_down_agent_refuses_calls(src):
    agent = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]))
    agent.shutdown()
    agent.shutdown()
    assert agent.closed
    with pytest.raises(kvxfer.AgentClosedError):
        agent.lease("X", 0, 1, [1])


def test_the_ends_of_leases_a_shutdown_released_are_still_reported():
    agent = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([random_cache(2)]))
    agent.lease("L", 0, 1, [1])
    agent.shutdown()
    ends = agent.poll_ends()
    assert [(e["remote_request_id"], e["kind"], e["blocks"]) for e in ends] == [("L", "released", [1])]
    assert agent.poll_ends() == []
