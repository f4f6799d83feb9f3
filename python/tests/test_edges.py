"""Paths no scripted connector run reaches: releasing leases without pulling, wrong Python
types, cancelling twice, calls after shutdown, agents dropped with pulls in flight, and
every blocking call releasing the GIL (shown by another thread unblocking it, not by time)."""

from __future__ import annotations

import gc
import secrets
import threading
import time

import numpy as np
import pytest

import kvxfer
from conftest import SHAPE, arm_waits, blocks_equal, eventually, random_cache, unarmed


@pytest.fixture
def patient_prefill(src):
    """A prefill agent whose reads of unarmed leases wait up to a minute for the arm."""
    agent = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), engine_id="prefill-engine", arm_wait=60.0)
    yield agent
    agent.shutdown()


def in_thread(fn) -> threading.Thread:
    """Runs ``fn`` on another thread a moment from now — by then the calling thread is
    (almost always) blocked in the call under test, so ``fn`` runs only if that call
    released the GIL. Were it to run first, the call would return at once: the pause can
    weaken such a test, never make it fail wrongly."""

    def later() -> None:
        time.sleep(0.2)
        fn()

    t = threading.Thread(target=later)
    t.start()
    return t


def once_blocked(fn) -> threading.Thread:
    """Runs ``fn`` on another thread after a pause, so the calling thread is already blocked
    in the call it makes next. If that call held the GIL, ``fn`` could not run before the
    call gave up (its timeout) and the test fails; a helper that ran first would pass it
    whatever the call did with the GIL."""

    def later() -> None:
        time.sleep(0.2)
        fn()

    return in_thread(later)


# ---- DecodeAgent.release


def test_release_frees_a_lease_without_pulling_it(prefill, decode):
    kept, pulled = [h.to_params() for h in prefill.lease_parent("R", [[1], [2]])]
    assert decode.release([kept], wait=True) == [True]
    assert decode.release([kept], wait=True) == [True], "released already: still released"
    assert decode.submit([pulled], [[5]]).wait(timeout=30)[0]["outcome"] == "done"
    assert decode.release([pulled], wait=True) == [False], "pulled: not released"
    ends = {e["remote_request_id"]: e for e in prefill.wait_ends(2, timeout=10)}
    assert (ends["0_R"]["kind"], ends["1_R"]["kind"]) == ("released", "pulled")
    assert ends["0_R"]["life_seconds"] >= 0.0
    stats = decode.stats()
    assert (stats["leases_released"], stats["releases_refused"], stats["pulls"]) == (2, 1, 1), stats
    assert prefill.stats()["leases"]["expired"] == 0


def test_release_without_waiting_returns_at_once_and_the_lease_ends_released(prefill, decode):
    params = prefill.lease("A", 0, 1, [3]).to_params()
    assert decode.release([params]) is None
    assert [e["kind"] for e in prefill.wait_ends(1, timeout=10)] == ["released"]


def test_release_of_an_unknown_token_or_an_unreachable_agent_is_refused(src, decode):
    # A wrong token waits for an arm like an unknown id: a short arm wait keeps this fast.
    prefill = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), engine_id="prefill-engine", arm_wait=0.05)
    params = prefill.lease("B", 0, 1, [3]).to_params()
    forged = dict(params, kvxfer_lease_token=secrets.token_hex(16))
    gone = dict(params, remote_port=1)  # nothing listens on port 1
    assert decode.release([forged, gone], wait=True) == [False, False]
    assert prefill.stats()["leases"]["live"] == 1, "the lease itself is untouched"
    assert decode.stats()["releases_refused"] == 2
    prefill.shutdown()


def test_release_of_a_bad_dict_is_a_params_error_naming_it(decode):
    with pytest.raises(kvxfer.ParamsError) as e:
        decode.release([{"remote_request_id": "x"}])
    assert str(e.value).startswith("children[0]: ")


# ---- wrong Python types: TypeError / OverflowError / kvxfer errors, never a panic


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda p, d: d.submit("not a list", [[1]]), TypeError),
        (lambda p, d: d.submit([p.lease("T", 0, 1, [1]).to_params()], [["a"]]), TypeError),
        (lambda p, d: d.submit([p.lease("T", 0, 1, [1]).to_params()], [[-1]]), OverflowError),
        (lambda p, d: d.submit([p.lease("T", 0, 1, [1]).to_params()], None), TypeError),
        (lambda p, d: d.heartbeat(None), TypeError),
        (lambda p, d: d.release("abc"), TypeError),
        (lambda p, d: d.cancel(42), TypeError),
        (lambda p, d: d.wait_reports(timeout="soon"), TypeError),
        (lambda p, d: d.wait_reports(timeout=-1.0), kvxfer.ConfigError),
        (lambda p, d: p.lease("T", 0, 1, "12"), TypeError),
        (lambda p, d: p.lease("T", 0, -1, [1]), OverflowError),
        (lambda p, d: p.lease(7, 0, 1, [1]), TypeError),
        (lambda p, d: p.lease("T", 0, 1, [1], ttl=float("inf")), kvxfer.ConfigError),
                (lambda p, d: p.lease_parent("T", [1, 2]), TypeError),
        (lambda p, d: p.arm(None), kvxfer.ParamsError),
        (lambda p, d: p.cancel(3.5), kvxfer.ParamsError),
        (lambda p, d: p.wait_ends(count=-1), OverflowError),
        (lambda p, d: p.poll_ends(max="all"), TypeError),
        (lambda p, d: kvxfer.Handoff.from_params([]), kvxfer.ParamsError),
        (lambda p, d: kvxfer.DecodeAgent("memory"), TypeError),
        (lambda p, d: kvxfer.PrefillAgent(kvxfer.kv_cache_memory([random_cache(5)]), 5600), TypeError),
        (lambda p, d: kvxfer.PrefillAgent(kvxfer.kv_cache_memory([random_cache(5)]), "no port"), kvxfer.KvxferError),
        (lambda p, d: kvxfer.DecodeAgent(kvxfer.kv_cache_memory([random_cache(5)]), worker_threads=-2), OverflowError),
        (lambda p, d: kvxfer.kv_cache_memory("caches"), kvxfer.RegistrationError),
        (lambda p, d: kvxfer.kv_cache_memory(42), kvxfer.RegistrationError),
        (lambda p, d: kvxfer.kv_cache_memory([object()]), kvxfer.RegistrationError),
        (lambda p, d: kvxfer.kv_cache_memory({"layer.0": [1, 2, 3]}), kvxfer.RegistrationError),
        (lambda p, d: kvxfer.kv_cache_memory([np.zeros(SHAPE, dtype=np.float16)], kv_layout="sideways"), kvxfer.KvxferError),
    ],
)
def test_wrong_types_are_python_exceptions(prefill, decode, call, error):
    # pytest.raises(error) does not catch pyo3's PanicException (a BaseException): a panic
    # across the boundary fails the test.
    with pytest.raises(error):
        call(prefill, decode)


# ---- cancelling twice


def test_cancelling_a_child_twice_reports_it_once_and_releases_once(patient_prefill, decode):
    minted = unarmed(patient_prefill, "C", [1])
    pull = decode.submit([minted], [[2]])
    eventually("the read waits for the arm", lambda: arm_waits(patient_prefill) == 1)
    pull.cancel_child(0)
    pull.cancel_child(0)
    assert decode.cancel("C") is True, "the pull still has it"
    # Cancels reach the pull task asynchronously: arm only once its cancel waits for the arm
    # too, or the read could finish first.
    eventually("the cancel waits for the arm", lambda: arm_waits(patient_prefill) == 2)
    patient_prefill.arm(minted)
    reports = pull.wait(timeout=30)
    assert [(r["outcome"], r.get("released")) for r in reports] == [("cancelled", True)], reports
    pull.cancel_child(0)  # after its report: ignored
    assert decode.cancel("nobody") is False
    assert [e["kind"] for e in patient_prefill.wait_ends(1, timeout=10)] == ["released"]
    assert patient_prefill.cancel(minted) == "already_released"
    assert len(decode.poll_reports()) == 1, "one report per child"
    assert decode.stats()["children_cancelled"] == 1


# ---- calls after shutdown


def test_a_shut_down_decode_agent_keeps_its_reports_and_refuses_new_work(prefill):
    dst = np.zeros(SHAPE, dtype=np.float16)
    decode = kvxfer.DecodeAgent(kvxfer.kv_cache_memory([dst]), queue_reports=True)
    params = prefill.lease("S", 0, 1, [4]).to_params()
    pull = decode.submit([params], [[6]])
    assert pull.wait(timeout=30)[0]["outcome"] == "done"
    decode.shutdown()
    decode.shutdown()
    assert decode.closed
    assert [r["remote_request_id"] for r in decode.poll_reports()] == ["S"], "taken after shutdown"
    assert decode.wait_reports(timeout=0.01) == []
    assert [r["outcome"] for r in pull.poll()] == ["done"] and pull.poll() == []
    assert pull.done and pull.wait(timeout=1)[0]["outcome"] == "done"
    for call in (
        lambda: decode.submit([params], [[7]]),
        lambda: decode.heartbeat([params]),
        lambda: decode.release([params]),
        decode.stats,
        decode.poll_reclaimed,
    ):
        with pytest.raises(kvxfer.AgentClosedError):
            call()
    decode.cancel("S")  # reported already: ignored
    pull.cancel_child(0)


def test_a_shut_down_prefill_agent_still_delivers_ends_and_refuses_new_work(src):
    agent = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]))
    h = agent.lease("E", 0, 1, [1])
    agent.shutdown()
    assert [e["kind"] for e in agent.wait_ends(1, timeout=10)] == ["released"]
    assert agent.wait_ends(1, timeout=0.01) == []
    for call in (lambda: agent.cancel(h), lambda: agent.arm(h.to_params()), agent.stats, lambda: agent.lease_parent("F", [[1]])):
        with pytest.raises(kvxfer.AgentClosedError):
            call()


# ---- agents going away with pulls in flight


def quick_decode(**kw) -> kvxfer.DecodeAgent:
    """A decode agent that gives up on reads and cancels fast: a cancel of a lease not armed
    yet waits for the arm on the prefill side, bounded by this agent's io timeout."""
    return kvxfer.DecodeAgent(
        kvxfer.kv_cache_memory([np.zeros(SHAPE, dtype=np.float16)]), io_timeout=0.3, shutdown_grace=0.0, **kw
    )


def test_every_pull_has_reported_when_shutdown_returns(src):
    # The last reports used to be lost when the runtime stopped before the task moving them
    # into their Pull ran (5 of 160 pulls never reported in a loop like this one).
    with kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), engine_id="prefill-engine", arm_wait=0.05) as prefill:
        for round in range(20):
            decode = quick_decode()
            pulls = [decode.submit([unarmed(prefill, f"S{round}_{j}", [j])], [[j]]) for j in range(4)]
            decode.shutdown()
            assert all(p.done for p in pulls), f"round {round}: {[p.done for p in pulls]}"
            for p in pulls:
                report = p.wait(timeout=0)[0]
                assert report["outcome"] in ("failed", "cancelled"), report


def test_a_decode_agent_collected_mid_pull_still_reports_every_child(patient_prefill):
    decode = quick_decode()
    pulls = [decode.submit([unarmed(patient_prefill, f"D{j}", [j])], [[j]]) for j in range(4)]
    del decode
    gc.collect()
    for p in pulls:
        assert p.wait(timeout=30)[0]["outcome"] in ("failed", "cancelled")


def test_a_prefill_agent_gone_mid_pull_fails_the_child_with_advice(decode):
    prefill = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([random_cache(6)]), engine_id="prefill-engine", arm_wait=60.0)
    pull = decode.submit([unarmed(prefill, "G", [1])], [[2]])
    prefill.shutdown()  # the waiting read's connection closes
    report = pull.wait(timeout=30)[0]
    assert report["outcome"] == "failed", report
    assert report["error"].advice in ("retry_fresh_handoff", "recompute"), report["error"]


# ---- every blocking call releases the GIL: another Python thread unblocks it


def test_wait_ends_releases_the_gil(prefill):
    h = prefill.lease("W", 0, 1, [1])
    t = once_blocked(lambda: prefill.cancel(h))
    assert [e["kind"] for e in prefill.wait_ends(1, timeout=10)] == ["released"]
    t.join()


def test_wait_reports_releases_the_gil(patient_prefill, decode):
    minted = unarmed(patient_prefill, "R", [1])
    decode.submit([minted], [[2]])
    t = once_blocked(lambda: patient_prefill.arm(minted))
    reports = decode.wait_reports(timeout=10)
    t.join()
    assert [r["outcome"] for r in reports] == ["done"]


def test_waiting_heartbeats_and_releases_release_the_gil(patient_prefill, decode):
    beat, freed = unarmed(patient_prefill, "H", [1]), unarmed(patient_prefill, "F", [2])
    t = once_blocked(lambda: patient_prefill.arm(beat))
    assert decode.heartbeat([beat], wait=True, timeout=10) == ["extended"]
    t.join()
    t = once_blocked(lambda: patient_prefill.arm(freed))
    assert decode.release([freed], wait=True, timeout=10) == [True]
    t.join()


def test_shutdown_releases_the_gil_while_pulls_finish(patient_prefill, src):
    dst = np.zeros(SHAPE, dtype=np.float16)
    decode = kvxfer.DecodeAgent(kvxfer.kv_cache_memory([dst]), shutdown_grace=10.0)
    minted = unarmed(patient_prefill, "S", [3])
    pull = decode.submit([minted], [[4]])
    t = once_blocked(lambda: patient_prefill.arm(minted))
    decode.shutdown()  # waits for the pull, which needs the other thread's arm
    t.join()
    assert pull.wait(timeout=1)[0]["outcome"] == "done"
    assert blocks_equal(src, [3], dst, [4])


# ---- a shutdown racing a wait on another thread (review of issue 12, finding 7)


@pytest.mark.parametrize("call", ["heartbeat", "release"])
def test_a_shutdown_racing_a_waiting_call_ends_it_without_a_panic(patient_prefill, dst, call):
    """heartbeat(wait=True) / release(wait=True) blocked on a lease nobody arms while another
    thread shuts the agent down: the wait ends (no answer, or AgentClosedError), never a
    PanicException from a runtime that stopped under it."""
    decode = kvxfer.DecodeAgent(kvxfer.kv_cache_memory([dst]), engine_id="decode-engine", shutdown_grace=0.1)
    minted = unarmed(patient_prefill, "Z", [1])
    outcome: list = []

    def waiting() -> None:
        try:
            outcome.append(getattr(decode, call)([minted], wait=True, timeout=30))
        except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
            outcome.append(e)

    t = in_thread(waiting)
    eventually("the wait reached the prefill agent", lambda: arm_waits(patient_prefill) >= 1)
    decode.shutdown()
    t.join(60)
    assert not t.is_alive(), "the waiting call never returned"
    (got,) = outcome
    if call == "heartbeat":
        assert got in ([], ["error"]), got
    else:
        assert isinstance(got, kvxfer.AgentClosedError) or got == [False], repr(got)


# ---- a params dict read directly and as JSON text: one result


class _Port(int):
    """An int subclass (as an IntEnum is): json.dumps writes it as a number."""


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d,
        lambda d: {**d, "remote_block_ids": tuple(d["remote_block_ids"])},
        lambda d: {**d, "remote_port": str(d["remote_port"])},
        lambda d: {**d, "remote_port": _Port(d["remote_port"])},
        lambda d: {**d, "remote_port": float(d["remote_port"])},
        lambda d: {**d, "remote_port": np.int64(d["remote_port"])},
        lambda d: {**d, "remote_port": True},
        lambda d: {**d, "remote_port": float("nan")},
        lambda d: {**d, "remote_port": 2**70},
        lambda d: {**d, "kvxfer_lease_token": b"\x00" * 16},
        lambda d: {**d, "remote_block_ids": [1, "2"]},
        lambda d: {**d, 7: "an int key"},
        lambda d: {**d, "future_field": {"nested": [1, 2.5, None, {"deep": True}]}},
        lambda d: {k: v for k, v in d.items() if k != "kvxfer_lease_token"},
    ],
)
def test_a_params_dict_reads_as_its_json_text_does(prefill, change):
    """The binding reads a dict of plain JSON types directly, and anything else through
    json.dumps: either way the result, or the error, is the text's."""
    import json

    params = change(prefill.lease("J", 0, 1, [1]).to_params())

    def outcome(arg):
        try:
            return ("ok", kvxfer.Handoff.from_params(arg).to_params())
        except Exception as e:  # noqa: BLE001 - the error itself is compared
            return ("error", type(e), str(e))

    try:
        text = json.dumps(params)
    except (TypeError, ValueError) as e:
        got = outcome(params)
        assert got[0] == "error" and got[1] is kvxfer.ParamsError, (got, e)
        return
    assert outcome(params) == outcome(text)
