"""The vLLM connector driven through scripted scheduler/worker steps (see vllm_sim.py): a
prefill and one or two decode instances in this process, talking over TCP on 127.0.0.1
(free ports: the workers tell the schedulers their ports through vLLM's handshake
metadata)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

import kvxfer.vllm
from kvxfer.vllm import KvxferConnector, KvxferConnectorMetadata
from vllm_real import KVCacheBlocks, KVConnectorRole, Request, RequestStatus
from vllm_sim import BLOCK_SIZE, Instance, same_blocks, vllm_config

PROMPT = list(range(10))  # 10 tokens: 3 blocks of 4


@pytest.fixture
def prefill():
    inst = Instance("kv_producer", "prefill-engine", seed=7, extra={"kvxfer_lease_ttl": 30})
    yield inst
    inst.shutdown()


@pytest.fixture
def decode():
    inst = Instance("kv_consumer", "decode-engine")
    yield inst
    inst.shutdown()


# The latency options: one thread per agent's runtime, and the notify behind the read.
# The notify rides behind a TCP read: this option set is on the TCP data path.
ONE_THREAD = {"kvxfer_worker_threads": 0, "kvxfer_notify_with_read": True, "kvxfer_transport": "tcp"}


def prefill_request(rid: str, n: int = 1) -> Request:
    params = {"do_remote_decode": True}
    if n > 1:
        params["kvxfer_n"] = n
    return Request(rid, list(PROMPT), kv_transfer_params=params)


def ends_by_kind(inst: Instance) -> dict[str, int]:
    leases = inst.stats()["prefill"]["leases"]
    return {k: leases[k] for k in ("pulled", "released", "expired", "unrecognized", "live")}


@pytest.mark.parametrize("options", [{}, ONE_THREAD], ids=["defaults", "one_thread_notify_with_read"])
def test_n1_one_child_pulled_and_its_blocks_freed(options):
    prefill = Instance("kv_producer", "prefill-engine", seed=7, extra={"kvxfer_lease_ttl": 30, **options})
    decode = Instance("kv_consumer", "decode-engine", extra=options)
    try:
        n1_one_child_pulled(prefill, decode)
        # A lone child's read settles it: with the option its notify rode behind the read.
        with_read = decode.stats()["decode"]["notifies_with_read"]
        assert with_read == (1 if options else 0)
    finally:
        decode.shutdown()
        prefill.shutdown()


def n1_one_child_pulled(prefill: Instance, decode: Instance) -> None:
    delay, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
    assert delay is True, "the blocks stay allocated until the lease ends"
    assert params["remote_request_id"] == "R" and params["kvxfer_n"] == 1
    assert params["kvxfer_incarnation"] == prefill.worker.worker.prefill.incarnation
    prefill.step()  # the worker arms the lease
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    local = decode.add_decode(req)
    assert len(local) == 3
    decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
    assert not decode.load_errors
    assert same_blocks(prefill.caches, [5, 6, 7], decode.caches, local)
    prefill.run_until("R's blocks handed back", lambda: "R" in prefill.sending)
    assert ends_by_kind(prefill) == {"pulled": 1, "released": 0, "expired": 0, "unrecognized": 0, "live": 0}


def test_n4_every_child_has_its_own_handoff_and_is_pulled(prefill, decode):
    # Children share the prompt's first two blocks (prefix caching) and own the third.
    blocks = {i: [1, 2, 10 + i] for i in range(4)}
    minted = [prefill.finish_prefill(prefill_request(f"{i}_R", n=4), blocks[i])[1] for i in range(4)]
    for i, p in enumerate(minted):
        assert (p["remote_request_id"], p["kvxfer_parent_request_id"], p["kvxfer_child_index"], p["kvxfer_n"]) == (
            f"{i}_R",
            "R",
            i,
            4,
        )
        assert len({p["kvxfer_lease_token"] for p in minted}) == 4
    # vLLM's output path keeps the last child's params: they list every sibling.
    last = minted[-1]
    assert [c["remote_request_id"] for c in last["kvxfer_children"]] == ["0_R", "1_R", "2_R", "3_R"]
    prefill.step()
    # The decode instance forks the parent D into children i_D, all holding `last`.
    children = [Request(f"{i}_D", list(PROMPT), kv_transfer_params=last) for i in range(4)]
    local = [decode.add_decode(c) for c in children]
    decode.run_until("every child received", lambda: len(decode.recving) == 4, others=(prefill,))
    assert not decode.load_errors
    for i in range(4):
        assert same_blocks(prefill.caches, blocks[i], decode.caches, local[i]), f"child {i}"
    stats = decode.stats()["decode"]
    assert stats["pulls"] == 1, "children of one parent arriving together are one pull"
    assert stats["bytes_pulled"] < stats["bytes_delivered"], "shared prompt blocks crossed the wire once"
    prefill.run_until("every child's blocks handed back", lambda: len(prefill.sending) == 4)
    assert ends_by_kind(prefill) == {"pulled": 4, "released": 0, "expired": 0, "unrecognized": 0, "live": 0}


def test_n4_children_on_two_decode_workers_are_pulled_as_subsets(prefill, decode):
    other = Instance("kv_consumer", "decode-engine-b")
    try:
        blocks = {i: [1, 2, 10 + i] for i in range(4)}
        minted = [prefill.finish_prefill(prefill_request(f"{i}_R", n=4), blocks[i])[1] for i in range(4)]
        prefill.step()
        # The router sends each child on its own (n = 1): 0 and 1 to one worker, 2 and 3 to the other.
        where = {0: decode, 1: decode, 2: other, 3: other}
        local = {}
        for i, inst in where.items():
            child = {k: v for k, v in minted[i].items() if k != "kvxfer_children"}
            local[i] = inst.add_decode(Request(f"D{i}", list(PROMPT), kv_transfer_params=child))
        decode.run_until(
            "all four received", lambda: len(decode.recving) + len(other.recving) == 4, others=(other, prefill)
        )
        for i, inst in where.items():
            assert same_blocks(prefill.caches, blocks[i], inst.caches, local[i]), f"child {i}"
        prefill.run_until("all handed back", lambda: len(prefill.sending) == 4)
        assert ends_by_kind(prefill) == {"pulled": 4, "released": 0, "expired": 0, "unrecognized": 0, "live": 0}
    finally:
        other.shutdown()


def test_a_notification_before_the_lease_is_armed_waits_for_it(prefill, decode):
    """vLLM #43509: the decode side can be faster than the prefill worker's next step."""
    _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
    # The prefill worker has not stepped: nothing is armed yet. The decode side pulls anyway.
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    local = decode.add_decode(req)
    decode.step()
    server = lambda: prefill.stats()["prefill"]["server"]  # noqa: E731
    deadline = time.monotonic() + 10
    while server()["arm_waits"] == 0:
        assert time.monotonic() < deadline, "the pull's read never reached the prefill agent"
        time.sleep(0.005)
    prefill.step()  # now the lease is armed
    decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
    assert same_blocks(prefill.caches, [3, 4, 5], decode.caches, local)
    prefill.run_until("R handed back", lambda: "R" in prefill.sending)
    assert ends_by_kind(prefill)["pulled"] == 1
    assert server()["arm_wait_expired"] == 0
    assert prefill.stats()["prefill"]["leases"]["unrecognized"] == 0


def test_an_aborted_request_releases_its_lease_rather_than_letting_it_expire(prefill, decode):
    _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    decode.add_decode(req)
    decode.step()  # the pull starts; its read waits for the arm
    assert decode.abort(req) is True, "blocks of a pull under way are freed only once it reports"
    decode.step()  # the worker cancels the child
    prefill.step()  # arm: the waiting cancel is answered
    decode.run_until("D reported", lambda: "D" in decode.recving, others=(prefill,))
    assert not decode.load_errors, "an aborted request's blocks are not load errors"
    prefill.run_until("R handed back", lambda: "R" in prefill.sending)
    ends = ends_by_kind(prefill)
    assert (ends["released"], ends["expired"], ends["pulled"]) == (1, 0, 0), ends
    assert decode.stats()["decode"]["children_cancelled"] == 1


def test_an_aborted_prefill_request_leases_nothing(prefill):
    req = prefill_request("R")
    req.status = type(req.status).FINISHED_ABORTED
    assert prefill.sched.request_finished(req, [1, 2]) == (False, None)
    prefill.step()
    assert prefill.stats()["prefill"]["leases"]["leased"] == 0


def test_a_request_aborted_in_the_queue_releases_its_lease(prefill, decode):
    _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
    prefill.step()
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    decode.add_decode(req, allocate=False)
    decode.abort(req)
    decode.step()  # the worker releases the lease without pulling
    prefill.run_until("R released", lambda: "R" in prefill.sending, others=(decode,))
    assert ends_by_kind(prefill) == {"pulled": 0, "released": 1, "expired": 0, "unrecognized": 0, "live": 0}
    decode.run_until("the release answered", lambda: decode.stats()["decode"]["leases_released"] == 1)
    stats = decode.stats()["decode"]
    assert (stats["pulls"], stats["releases_refused"]) == (0, 0), stats


def test_a_request_allocated_but_aborted_before_its_pull_was_sent_releases_its_lease(prefill, decode):
    _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
    prefill.step()
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    decode.add_decode(req)  # blocks allocated; the pull goes to the worker at the next step
    assert decode.abort(req) is False, "nothing was sent: the blocks are freed at once"
    prefill.run_until("R released", lambda: "R" in prefill.sending, others=(decode,))
    assert ends_by_kind(prefill) == {"pulled": 0, "released": 1, "expired": 0, "unrecognized": 0, "live": 0}
    assert decode.stats()["decode"]["pulls"] == 0


def test_a_prompt_wholly_in_the_local_prefix_cache_releases_its_lease(prefill, decode):
    _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
    prefill.step()
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    decode.sched.on_new_request(req)
    assert decode.sched.get_num_new_matched_tokens(req, len(PROMPT)) == (0, False)
    decode.allocate(req, 0, load_async=False)
    prefill.run_until("R released", lambda: "R" in prefill.sending, others=(decode,))
    assert ends_by_kind(prefill) == {"pulled": 0, "released": 1, "expired": 0, "unrecognized": 0, "live": 0}
    decode.run_until("the release answered", lambda: decode.stats()["decode"]["leases_released"] == 1)


def test_a_malformed_params_dict_from_the_router_does_not_stop_the_worker(prefill):
    """A queued request's bad params are logged and counted; its good neighbour still
    pulls, and the bad request's heartbeat and release fail alone."""
    decode = Instance("kv_consumer", "decode-engine-hb", extra={"kvxfer_heartbeat_interval": 0})
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
        prefill.step()
        bad = dict(params, remote_request_id="X", kvxfer_lease_token="not hex")
        queued = Request("Q", list(PROMPT), kv_transfer_params=bad)
        decode.add_decode(queued, allocate=False)  # heartbeated while it waits: refused alone
        good = Request("D", list(PROMPT), kv_transfer_params=params)
        decode.add_decode(good, allocate=False)
        decode.run_until("the good lease heartbeated", lambda: decode.stats()["decode"]["keeper_extended"] >= 1)
        assert decode.stats()["bad_params"] >= 1
        decode.abort(queued)  # released without pulling: refused alone too
        local = decode.allocate(good, len(PROMPT))
        decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
        assert same_blocks(prefill.caches, [3, 4, 5], decode.caches, local)
        assert "Q" not in decode.recving and not decode.load_errors
    finally:
        decode.shutdown()


def test_a_failed_pull_reports_its_blocks_as_load_errors(decode):
    prefill = Instance("kv_producer", "prefill-engine", seed=3, extra={"kvxfer_arm_wait": 0.2})
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
        prefill.step()
        forged = dict(params, kvxfer_lease_token="0" * 31 + "1")  # not the lease's token
        req = Request("D", list(PROMPT), kv_transfer_params=forged)
        local = decode.add_decode(req)
        decode.run_until("D reported", lambda: "D" in decode.recving, others=(prefill,))
        assert decode.load_errors == set(local), "vLLM's recompute-or-fail policy applies to these blocks"
        assert decode.stats()["decode"]["children_failed"] == 1
        assert prefill.stats()["prefill"]["server"]["arm_wait_expired"] >= 1
    finally:
        prefill.shutdown()


def test_leases_of_requests_waiting_in_the_decode_queue_are_heartbeated(prefill):
    decode = Instance("kv_consumer", "decode-engine", extra={"kvxfer_heartbeat_interval": 0})
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
        prefill.step()
        req = Request("D", list(PROMPT), kv_transfer_params=params)
        decode.add_decode(req, allocate=False)  # no free blocks yet: it waits in the queue
        decode.run_until("a queued-lease heartbeat", lambda: decode.stats()["decode"]["keeper_extended"] >= 1)
        local = decode.allocate(req, len(PROMPT))
        decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
        assert same_blocks(prefill.caches, [3, 4, 5], decode.caches, local)
        before = decode.stats()["decode"]["keeper_heartbeats"]
        decode.step()
        decode.step()
        assert decode.stats()["decode"]["keeper_heartbeats"] == before, "a pulled request is not heartbeated"
    finally:
        decode.shutdown()


def test_a_local_prefix_hit_pulls_only_the_tail(prefill, decode):
    _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
    prefill.step()
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    decode.sched.on_new_request(req)
    # The first block is in the local prefix cache: 4 tokens computed, 6 to load (2 blocks).
    count, _ = decode.sched.get_num_new_matched_tokens(req, BLOCK_SIZE)
    assert count == len(PROMPT) - BLOCK_SIZE
    local = decode.allocate(req, count)
    assert len(local) == 2
    decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
    assert same_blocks(prefill.caches, [6, 7], decode.caches, local)


# ---- n > 1 when the params do not say which child is which (review of issue 12, finding 1)


def mint_n4(prefill: Instance) -> tuple[dict[int, list[int]], list[dict]]:
    blocks = {i: [1, 2, 10 + i] for i in range(4)}
    minted = [prefill.finish_prefill(prefill_request(f"{i}_R", n=4), blocks[i])[1] for i in range(4)]
    prefill.step()
    return blocks, minted


def own(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "kvxfer_children"}


def test_children_holding_one_siblings_params_pull_it_once_across_steps(prefill, decode):
    """vLLM's stock proxy forwards the params vLLM returned (the last child's, here without
    kvxfer_children) to the decode parent; its children are allocated in two steps. One
    child's params are pulled by the request holding them, whatever its id looks like (a
    request id's ``{i}_`` prefix names a child index only beside the siblings' hand-offs):
    the first child allocated pulls lease 3_R once, the others compute locally. Nothing is
    left unreported."""
    blocks, minted = mint_n4(prefill)
    last = own(minted[3])
    children = [Request(f"{i}_D", list(PROMPT), kv_transfer_params=last) for i in range(4)]
    local = {}
    for i in (0, 3):
        local[i] = decode.add_decode(children[i])
    decode.step()
    for i in (1, 2):
        decode.sched.on_new_request(children[i])
        assert decode.sched.get_num_new_matched_tokens(children[i], 0) == (0, False), f"child {i} computes locally"
    decode.run_until("0_D received", lambda: "0_D" in decode.recving, others=(prefill,))
    assert decode.recving == {"0_D"} and not decode.load_errors
    assert local[3] == [], "lease 3_R is taken by child 0: no blocks allocated for loading"
    assert same_blocks(prefill.caches, blocks[3], decode.caches, local[0])
    assert decode.sched.stats()["handoff_taken"] == 3 and decode.sched.stats()["no_own_handoff"] == 0
    prefill.run_until("3_R handed back", lambda: "3_R" in prefill.sending)
    assert ends_by_kind(prefill)["pulled"] == 1 and ends_by_kind(prefill)["unrecognized"] == 0


def test_a_client_id_that_looks_like_a_child_pulls_its_own_handoff(prefill, decode):
    """A router that sends each child's hand-off in a decode request of its own may name
    the request anything, e.g. "1_router-req" carrying child 0's params: it pulls them (no
    lease is left to expire because the id looked like child 1's)."""
    blocks, minted = mint_n4(prefill)
    locals_ = {}
    for i in range(4):
        req = Request(f"{(i + 1) % 4}_router-req-{i}", list(PROMPT), kv_transfer_params=own(minted[i]))
        locals_[i] = (req.request_id, decode.add_decode(req))
    decode.run_until("every child received", lambda: len(decode.recving) == 4, others=(prefill,))
    assert not decode.load_errors
    for i in range(4):
        assert same_blocks(prefill.caches, blocks[i], decode.caches, locals_[i][1])
    prefill.run_until("every lease handed back", lambda: len(prefill.sending) == 4)
    assert ends_by_kind(prefill)["pulled"] == 4 and ends_by_kind(prefill)["expired"] == 0


def test_children_with_unnumbered_leases_pull_each_lease_once(prefill, decode):
    """Without kvxfer_n the prefill side leases every child alone (child index 0, n 1); the
    last one's params reach the decode parent's children, allocated one per step: the first
    pulls it, every later one computes locally (its pull would read a lease already read)."""
    finished = [prefill.finish_prefill(prefill_request(f"{i}_R"), [1, 2, 10 + i])[1] for i in range(4)]
    prefill.step()
    last = finished[3]
    assert (last["kvxfer_n"], last["kvxfer_child_index"]) == (1, 0)
    children = [Request(f"{i}_D", list(PROMPT), kv_transfer_params=last) for i in range(4)]
    local = decode.add_decode(children[0])
    decode.step()
    for c in children[1:]:
        decode.sched.on_new_request(c)
        assert decode.sched.get_num_new_matched_tokens(c, 0) == (0, False)
        decode.step()
    decode.run_until("0_D received", lambda: "0_D" in decode.recving, others=(prefill,))
    assert decode.recving == {"0_D"} and not decode.load_errors
    assert same_blocks(prefill.caches, [1, 2, 13], decode.caches, local)
    assert decode.sched.stats()["handoff_taken"] == 3


def test_a_streamed_first_childs_params_pull_only_the_children_they_list(prefill, decode):
    """With streamed output the router can forward the first child's params, which list
    only the siblings minted so far (here child 0 alone): children without an entry of their
    own compute locally instead of taking another child's lease."""
    blocks, minted = mint_n4(prefill)
    first = minted[0]
    assert [c["kvxfer_child_index"] for c in first["kvxfer_children"]] == [0]
    children = [Request(f"{i}_D", list(PROMPT), kv_transfer_params=first) for i in range(4)]
    local = decode.add_decode(children[0])
    for c in children[1:]:
        decode.sched.on_new_request(c)
        assert decode.sched.get_num_new_matched_tokens(c, 0) == (0, False)
    decode.run_until("0_D received", lambda: "0_D" in decode.recving, others=(prefill,))
    assert decode.recving == {"0_D"} and not decode.load_errors
    assert same_blocks(prefill.caches, blocks[0], decode.caches, local)


def test_a_gap_in_kvxfer_children_is_never_filled_by_a_sibling(prefill, decode):
    """kvxfer_children without child 2 (never minted): child 2 computes locally, child 3
    pulls its own lease (not the third entry of the list)."""
    blocks, minted = mint_n4(prefill)
    gapped = dict(minted[3], kvxfer_children=[own(minted[i]) for i in (0, 1, 3)])
    children = [Request(f"{i}_D", list(PROMPT), kv_transfer_params=gapped) for i in range(4)]
    local = {i: decode.add_decode(children[i]) for i in (0, 1, 3)}
    decode.sched.on_new_request(children[2])
    assert decode.sched.get_num_new_matched_tokens(children[2], 0) == (0, False)
    decode.run_until("three received", lambda: len(decode.recving) == 3, others=(prefill,))
    assert decode.recving == {"0_D", "1_D", "3_D"} and not decode.load_errors
    for i in (0, 1, 3):
        assert same_blocks(prefill.caches, blocks[i], decode.caches, local[i]), f"child {i}"


def test_vllms_per_child_list_form_gives_each_child_its_entry(prefill, decode):
    """Current vLLM hands child i entry i of a list of kv_transfer_params (parallel_sampling.py);
    older ones pass the whole list: both pull every child, children allocated in two steps."""
    blocks, minted = mint_n4(prefill)
    per_child = [own(p) for p in minted]
    children = [
        Request("0_D", list(PROMPT), kv_transfer_params=per_child[0]),  # indexed by vLLM
        Request("1_D", list(PROMPT), kv_transfer_params=per_child[1]),
        Request("2_D", list(PROMPT), kv_transfer_params=per_child),  # the list itself
        Request("3_D", list(PROMPT), kv_transfer_params=per_child),
    ]
    local = {}
    for i in (0, 2):
        local[i] = decode.add_decode(children[i])
    decode.step()
    for i in (1, 3):
        local[i] = decode.add_decode(children[i])
    decode.run_until("every child received", lambda: len(decode.recving) == 4, others=(prefill,))
    assert not decode.load_errors
    for i in range(4):
        assert same_blocks(prefill.caches, blocks[i], decode.caches, local[i]), f"child {i}"
    prefill.run_until("every child's blocks handed back", lambda: len(prefill.sending) == 4)
    assert ends_by_kind(prefill) == {"pulled": 4, "released": 0, "expired": 0, "unrecognized": 0, "live": 0}


def test_a_second_local_pull_of_a_lease_still_read_is_a_load_error(prefill, decode):
    """A request aborted while its pull waits for the arm frees its claim on the lease; a new
    request with the same params arrives before the cancelled pull reports. The worker
    refuses the second pull (load error, vLLM recomputes) and each request gets its own
    report: the aborted one once its pull reports cancelled."""
    _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
    first = Request("DA", list(PROMPT), kv_transfer_params=params)
    decode.add_decode(first)
    decode.step()  # the pull starts; its read waits for the arm
    assert decode.abort(first) is True
    second = Request("DB", list(PROMPT), kv_transfer_params=params)
    local_b = decode.add_decode(second)
    decode.step()  # cancels DA's pull, refuses DB's
    assert "DB" in decode.recving and decode.load_errors == set(local_b)
    assert decode.stats()["duplicate_pulls"] == 1
    prefill.step()  # arm: the waiting cancel is answered
    decode.run_until("DA reported", lambda: "DA" in decode.recving, others=(prefill,))
    assert decode.load_errors == set(local_b), "the cancelled pull's blocks are not load errors"
    prefill.run_until("R handed back", lambda: "R" in prefill.sending)
    assert ends_by_kind(prefill)["released"] == 1


# ---- late lease ends, bad router params, misrouted requests (findings 2, 3, 4)


def test_a_lease_ending_long_after_its_request_finished_still_frees_its_blocks(prefill, decode, monkeypatch):
    """The worker forgets old ids it was told finished, but never one whose lease is still
    armed: here everything older than 0 s is forgotten, and the late pull still reaches
    vLLM's sending set."""
    monkeypatch.setattr(kvxfer.vllm.worker, "FORGET_AFTER", 0.0)
    _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
    prefill.step()  # armed; R reported finished to the worker (and forgotten before the fix)
    prefill.step()
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    decode.add_decode(req)
    decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
    prefill.run_until("R's blocks handed back", lambda: "R" in prefill.sending)


def test_malformed_params_never_raise_out_of_the_scheduler(prefill, decode):
    def finished(inst: Instance, rid: str, params) -> tuple:
        req = Request(rid, list(PROMPT), kv_transfer_params=params)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return inst.sched.request_finished(req, [1, 2, 3])

    for bad in ("a string", [{"do_remote_decode": True}, "not a dict"], 7):
        assert finished(prefill, "1_P", bad) == (False, None), bad
    assert prefill.sched.stats()["bad_params"] == 3
    _, good = prefill.finish_prefill(prefill_request("0_R", n=2), [1, 2, 3])
    prefill.step()
    for rid, bad in (
        ("0_D", dict(good, kvxfer_children=["not a dict"])),
        ("1_D", dict(good, kvxfer_children="not a list")),
        ("2_D", [good, "not a dict"]),
        ("3_D", dict(own(good), kvxfer_n="4")),
    ):
        req = Request(rid, list(PROMPT), kv_transfer_params=bad)
        decode.sched.on_new_request(req)
        assert decode.sched.get_num_new_matched_tokens(req, 0) == (0, False), rid
        decode.sched.update_state_after_alloc(req, KVCacheBlocks(([],)), 0)
        assert finished(decode, rid, bad) == (False, None), rid
    assert decode.sched.stats()["bad_params"] == 4
    decode.step()
    assert not decode.load_errors


def test_kv_cache_groups_without_layer_names_are_refused_and_without_a_config_never_raise(prefill):
    config = vllm_config("kv_producer", "prefill-engine")
    groups = SimpleNamespace(kv_cache_groups=[object(), object()])
    with pytest.raises(ValueError, match="layer names"):
        KvxferConnector(config, KVConnectorRole.SCHEDULER, groups)
    req = prefill_request("R")
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    # Without a kv_cache_config (older vLLM) the groups show up in request_finished only.
    assert prefill.sched.request_finished(req, ([1, 2], [3, 4])) == (False, None)
    assert prefill.sched.stats()["bad_params"] == 1


def test_pull_params_sent_to_a_producer_instance_are_computed_locally(prefill):
    """A router's mistake (do_remote_prefill to a kv_producer) must not park the request
    in WAITING_FOR_REMOTE_KVS forever: nothing there would ever pull or report it."""
    other = Instance("kv_producer", "prefill-engine-b")
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
        req = Request("D", list(PROMPT), kv_transfer_params=params)
        other.sched.on_new_request(req)
        assert other.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert other.sched.stats()["misrouted"] == 1
    finally:
        other.shutdown()


def test_an_arm_refused_because_the_lease_exists_keeps_the_blocks_until_it_ends(prefill, decode):
    """Finding 6: an arm failure frees the blocks at once only when no lease holds them."""
    _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
    prefill.worker.worker.prefill.arm(params)  # the lease exists before the worker's own arm
    prefill.step()  # the connector's arm is refused: already leased
    assert prefill.stats()["arm_failures"] == 1
    assert "R" not in prefill.sending, "the blocks of a live lease must not be freed"
    req = Request("D", list(PROMPT), kv_transfer_params=params)
    local = decode.add_decode(req)
    decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
    assert same_blocks(prefill.caches, [5, 6, 7], decode.caches, local)
    prefill.run_until("R handed back once pulled", lambda: "R" in prefill.sending)


def test_a_list_of_one_n1_handoff_is_pulled_whatever_the_request_is_named(prefill, decode):
    """vLLM passes a list through unindexed for n = 1; an id that looks like a child's
    (here "7_X") still pulls the one lease it holds."""
    _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
    prefill.step()
    req = Request("7_X", list(PROMPT), kv_transfer_params=[params])
    local = decode.add_decode(req)
    decode.run_until("7_X received", lambda: "7_X" in decode.recving, others=(prefill,))
    assert not decode.load_errors
    assert same_blocks(prefill.caches, [5, 6, 7], decode.caches, local)


def test_a_queued_request_with_an_unusable_tp_size_never_stops_the_worker(prefill):
    decode = Instance("kv_consumer", "decode-engine-tp", extra={"kvxfer_heartbeat_interval": 0})
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [3, 4, 5])
        prefill.step()
        req = Request("Q", list(PROMPT), kv_transfer_params=dict(params, tp_size=[1]))
        decode.add_decode(req, allocate=False)
        decode.step()  # heartbeats the queued lease: its params are refused, logged, counted
        decode.abort(req)
        decode.step()  # releases it: refused the same way
        assert decode.stats()["bad_params"] == 2
    finally:
        decode.shutdown()


def test_a_retracted_lease_that_already_ended_is_never_reported_finished_sending():
    """A prefill request kept generating past its lease's TTL (the lease expired), then was
    aborted: the scheduler retracts the minted lease and vLLM frees the blocks itself. The
    worker must forget the ended lease: reporting the request as finished sending would hit
    vLLM's assert (the request is gone), or free the blocks of a re-minted lease."""
    inst = Instance("kv_producer", "retract-engine", seed=5, extra={"kvxfer_lease_ttl": 0.2})
    try:
        sched = inst.sched.scheduler
        params = sched._mint("R", {"do_remote_decode": True}, [3, 4, 5])
        arm = KvxferConnectorMetadata(10_000)
        arm.to_arm = {"R": params}
        w = inst.worker
        w.bind_connector_metadata(arm)
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_finished(set()) == (None, None)
        w.clear_connector_metadata()
        time.sleep(0.6)  # the lease runs out (no decode side pulls it)
        deadline = time.monotonic() + 20
        while "R" not in w.worker._ended:  # the worker saw the lease end
            assert time.monotonic() < deadline, "the lease never expired"
            w.get_finished(set())
            time.sleep(0.05)
        assert inst.stats()["prefill"]["leases"]["expired"] == 1
        retract = KvxferConnectorMetadata(10_001)
        retract.to_retract = [("R", params)]
        w.bind_connector_metadata(retract)
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_finished({"R"}) == (None, None), "a retracted request was reported finished sending"
        w.clear_connector_metadata()
        assert w.get_finished({"R"}) == (None, None)
    finally:
        inst.shutdown()


def test_a_dense_models_data_parallel_engines_take_ports_by_their_index():
    """vLLM runs each data-parallel engine of a dense model as an independent rank: its
    ``reconfigure_for_independent_dp_rank`` sets ``data_parallel_rank`` to 0 on every engine
    and keeps the engine's place in ``data_parallel_index``. With a fixed ``kvxfer_port`` each
    engine must listen on its own port (``port + index * tp_size + rank``)."""
    ParallelConfig = pytest.importorskip("vllm.config").ParallelConfig
    from types import SimpleNamespace

    from kvxfer.vllm.common import Settings

    ports = []
    for engine in range(2):
        parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=engine)
        if not hasattr(parallel, "reconfigure_for_independent_dp_rank"):
            pytest.skip("this vLLM has no independent data-parallel ranks")
        parallel.reconfigure_for_independent_dp_rank()
        assert parallel.data_parallel_rank == 0
        transfer = SimpleNamespace(kv_role="kv_producer", engine_id="e", kv_connector_extra_config={"kvxfer_port": 20000})
        config = SimpleNamespace(kv_transfer_config=transfer, parallel_config=parallel)
        ports.append(Settings.from_vllm(config, None).port_of(0))
    assert ports == [20000, 20001]
