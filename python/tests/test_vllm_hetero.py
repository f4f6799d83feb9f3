"""The vLLM connector with heterogeneous layouts, driven through scripted scheduler/worker
steps (vllm_sim.py): a hybrid model's KV-cache groups (nested ``remote_block_ids``, pulled
group by group), and prefill and decode instances of different tensor-parallel sizes (one
worker per rank in this process; HND caches; ``submit_ranks``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvxfer.vllm import KvxferConnector
from kvxfer.vllm import worker as kvxfer_worker
from kvxfer.vllm.common import bindable
from vllm_real import Request, SchedulerOutput
from vllm_sim import BLOCK_SIZE, Instance, full_heads, layer_names, same_blocks, same_group_blocks

PROMPT = list(range(10))  # 10 tokens: 3 blocks of 4


def prefill_request(rid: str, n: int = 1, **params) -> Request:
    p = {"do_remote_decode": True, **params}
    if n > 1:
        p["kvxfer_n"] = n
    return Request(rid, list(PROMPT), kv_transfer_params=p)


def leases(inst: Instance, rank: int = 0) -> dict[str, int]:
    s = inst.workers[rank].stats()["prefill"]["leases"]
    return {k: s[k] for k in ("pulled", "released", "expired", "live")}


def test_a_hybrid_model_hands_off_one_block_list_per_group_and_pulls_every_group():
    prefill = Instance("kv_producer", "hybrid-prefill", seed=3, groups=2)
    decode = Instance("kv_consumer", "hybrid-decode", groups=2)
    try:
        assert prefill.worker.worker.prefill is not None
        # Children of a parent (n = 2) sharing their first block in each group.
        remote = {0: [[1, 2, 3], [20, 21, 22]], 1: [[1, 5, 6], [20, 24, 25]]}
        minted = [prefill.finish_prefill(prefill_request(f"{i}_R", n=2), remote[i])[1] for i in range(2)]
        assert minted[0]["remote_block_ids"] == remote[0], "nested remote_block_ids, one list per group"
        prefill.step()
        children = [Request(f"{i}_D", list(PROMPT), kv_transfer_params=minted[-1]) for i in range(2)]
        local = [decode.add_decode(c) for c in children]
        assert all(len(loc) == 2 for loc in local), "local blocks per group"
        decode.run_until("both children received", lambda: len(decode.recving) == 2, others=(prefill,))
        assert not decode.load_errors
        for i in range(2):
            assert same_group_blocks(prefill.caches, remote[i], decode.caches, local[i], 2), f"child {i}"
        assert decode.stats()["decode"]["pulls"] == 1
        prefill.run_until("blocks handed back", lambda: len(prefill.sending) == 2)
        assert leases(prefill) == {"pulled": 2, "released": 0, "expired": 0, "live": 0}

        # A prefix hit on the decode side: only the last block of each group is pulled.
        _, params = prefill.finish_prefill(prefill_request("P"), [[7, 8, 9], [30, 31, 32]])
        prefill.step()
        req = Request("DP", list(PROMPT), kv_transfer_params=params)
        decode.sched.on_new_request(req)
        count, _ = decode.sched.get_num_new_matched_tokens(req, 8)
        tail = decode.allocate(req, count)
        assert [len(g) for g in tail] == [1, 1]
        decode.run_until("DP received", lambda: "DP" in decode.recving, others=(prefill,))
        assert same_group_blocks(prefill.caches, [[9], [32]], decode.caches, tail, 2)
        prefill.run_until("P handed back", lambda: "P" in prefill.sending)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_hybrid_hand_off_into_a_single_group_instance_is_recomputed_not_raised():
    prefill = Instance("kv_producer", "hybrid-prefill-b", seed=4, groups=2)
    decode = Instance("kv_consumer", "plain-decode")
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [[1, 2, 3], [4, 5, 6]])
        prefill.step()
        local = decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        decode.run_until("D reported", lambda: "D" in decode.recving, others=(prefill,))
        assert decode.load_errors == set(local), "its blocks are reported for recompute"
        assert decode.stats()["submit_failures"] == 1
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_prefill_and_decode_of_different_tp_sizes_pull_through_the_connector(prefill_tp, decode_tp):
    prefill = Instance(
        "kv_producer",
        f"tp{prefill_tp}-prefill",
        seed=5,
        tp_size=prefill_tp,
        hnd=True,
        extra={"kvxfer_decode_tp_size": decode_tp},
    )
    decode = Instance("kv_consumer", f"tp{decode_tp}-decode", tp_size=decode_tp, hnd=True)
    try:
        for w in prefill.workers + decode.workers:
            assert w.worker.kv_shape is not None
        _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
        assert params["tp_size"] == prefill_tp
        assert params["kvxfer_expected_consumers"] == max(1, decode_tp // prefill_tp)
        prefill.step()  # every prefill rank arms its lease
        local = decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        decode.run_until("D received on every decode rank", lambda: "D" in decode.recving, others=(prefill,))
        assert not decode.load_errors
        # Every decode rank's heads of every block, joined: the prefill ranks' heads, joined.
        assert same_blocks(full_heads(prefill.rank_caches), [5, 6, 7], full_heads(decode.rank_caches), local)
        for w in decode.workers:
            assert w.stats()["decode"]["children_done"] == 1
        prefill.run_until("R handed back by every prefill rank", lambda: "R" in prefill.sending)
        for r in range(prefill_tp):
            assert leases(prefill, r) == {"pulled": 1, "released": 0, "expired": 0, "live": 0}, f"prefill rank {r}"
    finally:
        prefill.shutdown()
        decode.shutdown()


def not_this_node(skip: int = 0) -> str:
    """A documentation address (RFC 5737) this machine does not have (some sandboxes do
    give their interface one): how a rank on another node of a multi-node tensor-parallel
    prefill sees the configured kvxfer_host."""
    found = [a for a in ("198.51.100.1", "203.0.113.1", "198.51.100.2", "192.0.2.1") if not bindable(a)]
    if len(found) <= skip:
        pytest.skip("every documentation address tried is one of this machine's")
    return found[skip]


def test_a_rank_that_cannot_listen_on_kvxfer_host_names_its_nodes_address(monkeypatch):
    """Multi-node TP: ``kvxfer_host`` names one node; a rank elsewhere listens on and names
    its node's ``VLLM_HOST_IP`` (here 127.0.0.1), each rank's host travels in the hand-off,
    and a TP 2 decode pulls every rank's heads. Before, the rank could not start (it bound
    ``kvxfer_host``: EADDRNOTAVAIL)."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    far = not_this_node()
    prefill = Instance("kv_producer", "far-prefill", seed=8, tp_size=2, hnd=True, extra={"kvxfer_host": far})
    decode = Instance("kv_consumer", "far-decode", tp_size=2, hnd=True)
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
        assert params["remote_host"] == "127.0.0.1" and params["kvxfer_rank_hosts"] == ["127.0.0.1"] * 2, params
        prefill.step()
        local = decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        decode.run_until("D received on every decode rank", lambda: "D" in decode.recving, others=(prefill,))
        assert not decode.load_errors
        assert same_blocks(full_heads(prefill.rank_caches), [5, 6, 7], full_heads(decode.rank_caches), local)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_rank_without_any_address_to_listen_on_says_which_keys_to_set(monkeypatch):
    far = not_this_node()
    monkeypatch.setenv("VLLM_HOST_IP", not_this_node(skip=1))  # set, but not this node's either
    with pytest.raises(ValueError, match=rf"rank 0 cannot listen on kvxfer_host '{re.escape(far)}'.*VLLM_HOST_IP"):
        Instance("kv_producer", "lost-prefill", tp_size=2, hnd=True, extra={"kvxfer_host": far})
    # One rank (no other node to be on): VLLM_HOST_IP is never taken over kvxfer_host — a
    # NAT or virtual address needs kvxfer_listen_host, and start-up says so.
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    with pytest.raises(ValueError, match=r"rank 0 cannot listen on .*kvxfer_listen_host"):
        Instance("kv_producer", "nat-prefill", extra={"kvxfer_host": far})


def test_different_tp_sizes_without_hnd_caches_are_recomputed_naming_the_layout():
    prefill = Instance("kv_producer", "nhd-prefill", seed=6, tp_size=2)
    decode = Instance("kv_consumer", "nhd-decode")
    try:
        assert decode.worker.worker.kv_shape is None, "NHD blocks do not hold whole heads: no shape"
        _, params = prefill.finish_prefill(prefill_request("R"), [1, 2, 3])
        prefill.step()
        req = Request("D", list(PROMPT), kv_transfer_params=params)
        local = decode.add_decode(req)
        decode.run_until("D reported", lambda: "D" in decode.recving, others=(prefill,))
        assert decode.load_errors == set(local)
        assert decode.stats()["submit_failures"] == 1
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_decode_block_of_two_prefill_blocks_is_pulled_through_the_connector():
    prefill = Instance("kv_producer", "bs4-prefill", seed=8, hnd=True)
    decode = Instance("kv_consumer", "bs8-decode", hnd=True, block_size=2 * BLOCK_SIZE)
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [5, 6, 7])
        assert params["kvxfer_block_size"] == BLOCK_SIZE
        prefill.step()
        local = decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        assert len(local) == 2, "10 tokens: two local blocks of 8 for three remote blocks of 4"
        decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
        assert not decode.load_errors
        for name, src in prefill.caches.items():
            dst = decode.caches[name]
            for j, remote in enumerate([[5, 6], [7]]):
                for q, b in enumerate(remote):
                    got = dst[:, local[j], :, q * BLOCK_SIZE : (q + 1) * BLOCK_SIZE]
                    assert np.array_equal(got.view(np.uint16), src[:, b].view(np.uint16)), (name, j, q)
        prefill.run_until("R handed back", lambda: "R" in prefill.sending)
        assert leases(prefill) == {"pulled": 1, "released": 0, "expired": 0, "live": 0}

        # A prefix hit of one local block (8 tokens): the last remote block only.
        _, params = prefill.finish_prefill(prefill_request("P"), [1, 2, 3])
        prefill.step()
        req = Request("DP", list(PROMPT), kv_transfer_params=params)
        decode.sched.on_new_request(req)
        count, _ = decode.sched.get_num_new_matched_tokens(req, 2 * BLOCK_SIZE)
        tail = decode.allocate(req, count)
        decode.run_until("DP received", lambda: "DP" in decode.recving, others=(prefill,))
        assert not decode.load_errors
        for name, src in prefill.caches.items():
            got = decode.caches[name][:, tail[0], :, :BLOCK_SIZE]
            assert np.array_equal(got.view(np.uint16), src[:, 3].view(np.uint16)), name
        prefill.run_until("P handed back", lambda: "P" in prefill.sending)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_mla_prefill_tp1_to_decode_tp2_every_rank_gets_the_whole_latent():
    """MLA's latent is replicated on every rank: each decode rank reads it whole, once, and
    the lease ends after both decode ranks."""
    prefill = Instance("kv_producer", "mla-prefill", seed=9, mla=True, extra={"kvxfer_decode_tp_size": 2})
    decode = Instance("kv_consumer", "mla-decode", tp_size=2, mla=True)
    try:
        assert all(w.worker.kv_shape is not None for w in decode.workers)
        _, params = prefill.finish_prefill(prefill_request("R"), [4, 2, 9])
        assert params["kvxfer_expected_consumers"] == 2
        prefill.step()
        local = decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        decode.run_until("D received on both ranks", lambda: "D" in decode.recving, others=(prefill,))
        assert not decode.load_errors
        for rank_caches in decode.rank_caches:
            for name, src in prefill.caches.items():
                assert np.array_equal(rank_caches[name][local].view(np.uint16), src[[4, 2, 9]].view(np.uint16)), name
        prefill.run_until("R handed back", lambda: "R" in prefill.sending)
        assert leases(prefill) == {"pulled": 1, "released": 0, "expired": 0, "live": 0}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_sliding_window_group_with_null_blocks_is_leased_without_them_and_pulled_aligned():
    # vLLM swaps the blocks that slid out of a window for its null block (id 0), so the
    # window group's list starts with repeats of it: leased as they were, the lease table
    # refuses the repeats (duplicate_block) and the request is recomputed.
    prefill = Instance("kv_producer", "window-prefill", seed=5, groups=2)
    decode = Instance("kv_consumer", "window-decode", groups=2)
    try:
        _, params = prefill.finish_prefill(prefill_request("W"), [[1, 2, 3], [0, 0, 22]])
        assert params["remote_block_ids"] == [[1, 2, 3], [22]]
        assert params["kvxfer_skipped_blocks"] == [0, 2]
        prefill.step()
        assert prefill.worker.stats()["arm_failures"] == 0
        req = Request("WD", list(PROMPT), kv_transfer_params=params)
        local = decode.add_decode(req)
        assert [len(g) for g in local] == [3, 3]
        decode.run_until("WD received", lambda: "WD" in decode.recving, others=(prefill,))
        assert not decode.load_errors
        # The window group's first two local blocks are outside the window: not written.
        assert same_group_blocks(prefill.caches, [[1, 2, 3], [22]], decode.caches, [local[0], local[1][2:]], 2)
        prefill.run_until("W handed back", lambda: "W" in prefill.sending)
        assert leases(prefill) == {"pulled": 1, "released": 0, "expired": 0, "live": 0}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_the_tail_keeps_positions_past_the_skipped_head():
    tail = kvxfer_worker.tail
    # No skip: as before.
    assert tail([1, 2, 3], [7, 8, 9]) == ([1, 2, 3], [7, 8, 9])
    assert tail([1, 2, 3], [9]) == ([3], [9])
    # Two positions skipped remotely: the local blocks there are left alone.
    assert tail([22], [7, 8, 9], 1, 2) == ([22], [9])
    assert tail([21, 22], [8, 9], 1, 2) == ([21, 22], [8, 9])
    # A prefix hit past the skipped head pulls the tail only.
    assert tail([21, 22, 23], [9], 1, 2) == ([23], [9])
    # Block ratio 2 (two remote blocks per local one), aligned and straddling the edge.
    assert tail([23, 24], [8, 9], 2, 2) == ([23, 24], [9])
    # A local block straddling the edge: its slot outside the window gets the first block in it.
    assert tail([22, 23, 24], [7, 8], 2, 1) == ([22, 22, 23, 24], [7, 8])
    assert tail([21, 22], [7, 8], 2, 1) == ([21, 21, 22], [7, 8])
    assert tail([23, 24, 25], [8, 9], 4, 5) == ([23, 23, 24, 25], [9])
    with pytest.raises(ValueError, match="not a count"):
        tail([1], [7], 1, -1)
    # A hand-off that skips blocks but lists none after them (only a malformed one can):
    # refused as bad params, not an IndexError out of the connector.
    with pytest.raises(ValueError, match="none inside it"):
        tail([], [7, 8], 2, 3)
    assert tail([], [7], 1, 3) == ([], []), "every local block outside the window"


def test_a_window_edge_inside_a_decode_block_of_two_prefill_blocks_is_pulled_aligned():
    # Block ratio 2 with one null block: the window's edge falls inside the first local block
    # of the window group; its slot outside the window gets a copy of the first block inside.
    prefill = Instance("kv_producer", "swr-prefill", seed=11, hnd=True, groups=2)
    decode = Instance("kv_consumer", "swr-decode", hnd=True, groups=2, block_size=2 * BLOCK_SIZE)
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [[5, 6, 7], [0, 21, 22]])
        assert params["kvxfer_skipped_blocks"] == [0, 1]
        prefill.step()
        local = decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        decode.run_until("D received", lambda: "D" in decode.recving, others=(prefill,))
        assert not decode.load_errors
        # (local block, slot) ← remote block, per group; slot 0 of the window group's first
        # local block is outside the window.
        expected = [[(0, 0, 5), (0, 1, 6), (1, 0, 7)], [(0, 1, 21), (1, 0, 22)]]
        for g, names in enumerate(layer_names(2)):
            for name in names:
                src, dst = prefill.caches[name], decode.caches[name]
                for j, q, b in expected[g]:
                    got = dst[:, local[g][j], :, q * BLOCK_SIZE : (q + 1) * BLOCK_SIZE]
                    assert np.array_equal(got.view(np.uint16), src[:, b].view(np.uint16)), (name, j, q)
        prefill.run_until("R handed back", lambda: "R" in prefill.sending)
        assert leases(prefill) == {"pulled": 1, "released": 0, "expired": 0, "live": 0}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_caches_ordering_a_blocks_bytes_otherwise_are_never_pulled_into_each_other():
    """Same block sizes, other byte order (tokens-then-heads vs heads-then-tokens): the
    hand-off states the prefill's layout, the decode refuses to pull (a load error: vLLM
    recomputes) and releases the lease at once instead of reading garbage."""
    prefill = Instance("kv_producer", "nhd-prefill", seed=6)
    decode = Instance("kv_consumer", "hnd-decode", hnd=True)
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [1, 2, 3])
        assert params["kvxfer_kv_layout"] == prefill.workers[0].worker.layout
        prefill.step()
        local = decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        decode.run_until("D reported", lambda: "D" in decode.recving, others=(prefill,))
        assert decode.load_errors == set(local)
        prefill.run_until("R released", lambda: "R" in prefill.sending, others=(decode,))
        assert prefill.stats()["prefill"]["leases"]["released"] == 1
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_failed_pull_into_a_hybrid_cache_is_reported_per_request_not_by_block_ids():
    """Block ids repeat across KV-cache groups, so vLLM refuses (RuntimeError, the engine
    stops) flat invalid block ids from a model of several groups: such failures go out as
    ``failed_recving`` through ``get_transfer_results``, and no block ids."""
    prefill = Instance("kv_producer", "plain-prefill-c", seed=4)
    decode = Instance("kv_consumer", "hybrid-decode-c", groups=2)
    try:
        _, params = prefill.finish_prefill(prefill_request("R"), [1, 2, 3])
        prefill.step()
        decode.add_decode(Request("D", list(PROMPT), kv_transfer_params=params))
        meta = decode.sched.build_connector_meta(SchedulerOutput(set()))
        (w,) = decode.workers
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(set())
        assert results.failed_recving == {"D"} and "D" in results.finished_recving
        assert w.get_block_ids_with_load_errors() == set()
        assert decode.stats()["submit_failures"] == 1
    finally:
        prefill.shutdown()
        decode.shutdown()
