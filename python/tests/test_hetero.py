"""Heterogeneous layouts through the binding, over TCP on 127.0.0.1: KV caches of several
KV-cache groups (vLLM's nested ``remote_block_ids``), prefill and decode engines of
different tensor-parallel sizes (head-slice reads, ``submit_ranks``), and the refusals of
what does not fit, each naming what differs."""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from conftest import random_cache

# Group 0 (full attention): two layers of 256-byte K and V blocks; group 1 (sliding
# window): one layer of 128-byte blocks and fewer of them.
FULL = (2, 32, 4, 2, 16)
WINDOW = (2, 16, 4, 1, 16)


def grouped_caches(seed: int) -> dict[str, np.ndarray]:
    if seed < 0:
        return {"l0": np.zeros(FULL, np.float16), "l1": np.zeros(FULL, np.float16), "w0": np.zeros(WINDOW, np.float16)}
    return {"l0": random_cache(seed, FULL), "l1": random_cache(seed + 1, FULL), "w0": random_cache(seed + 2, WINDOW)}


GROUPS = [["l0", "l1"], ["w0"]]


def same(a: np.ndarray, ia: list[int], b: np.ndarray, ib: list[int]) -> bool:
    return all(np.array_equal(a[kv, ia].view(np.uint16), b[kv, ib].view(np.uint16)) for kv in range(2))


def test_two_groups_are_leased_handed_off_nested_and_pulled_group_by_group():
    src, dst = grouped_caches(10), grouped_caches(-1)
    memory = kvxfer.kv_cache_memory(src, groups=GROUPS)
    assert (memory.num_groups, memory.group_num_blocks, memory.num_segments) == (2, [32, 16], 6)
    with kvxfer.PrefillAgent(memory, engine_id="hybrid") as prefill, kvxfer.DecodeAgent(
        kvxfer.kv_cache_memory(dst, groups=GROUPS)
    ) as decode:
        # remote[child][group]; the children share their first blocks (a shared prompt).
        remote = [[[1, 2, 3], [4, 5]], [[1, 2, 9], [6]]]
        handoffs = prefill.lease_parent("G", remote)
        assert [h.num_groups for h in handoffs] == [2, 2]
        assert handoffs[1].group_block_ids == remote[1] and handoffs[1].remote_block_ids == remote[1][0]
        params = [h.to_params() for h in handoffs]
        assert params[0]["remote_block_ids"] == remote[0], "nested remote_block_ids, as vLLM writes them"
        for p in params:
            assert kvxfer.Handoff.from_params(p).to_params() == p, "the nested dict round-trips"
        local = [[[20, 21, 22], [1, 2]], [[23, 24, 25], [3]]]
        reports = decode.submit(params, local).wait(timeout=30)
        assert [r["outcome"] for r in reports] == ["done", "done"]
        assert [r["local_blocks"] for r in reports] == local, "reports give the local blocks back per group"
        for i in range(2):
            for layer in ("l0", "l1"):
                assert same(src[layer], remote[i][0], dst[layer], local[i][0]), (i, layer)
            assert same(src["w0"], remote[i][1], dst["w0"], local[i][1]), i
        ends = sorted(prefill.wait_ends(2, timeout=10), key=lambda e: e["child_index"])
        assert [e["kind"] for e in ends] == ["pulled", "pulled"]
        assert [e["group_blocks"] for e in ends] == remote
        # A single lease of two groups, armed from minted params (the connector's path).
        minted = dict(params[0], remote_request_id="A", kvxfer_parent_request_id="A", kvxfer_n=1)
        minted["kvxfer_child_index"] = 0
        minted["remote_block_ids"] = [[7, 8], [9]]
        minted["kvxfer_lease_token"] = "ab" * 16
        armed = prefill.arm(minted)
        assert armed.group_block_ids == [[7, 8], [9]]
        pull = decode.submit([minted], [[[10, 11], [12]]])
        assert pull.wait(timeout=30)[0]["outcome"] == "done"
        assert same(src["l1"], [7, 8], dst["l1"], [10, 11]) and same(src["w0"], [9], dst["w0"], [12])
        assert prefill.wait_ends(1, timeout=10)[0]["kind"] == "pulled"


def test_group_counts_that_do_not_match_are_refused_before_any_io():
    src = grouped_caches(20)
    with kvxfer.PrefillAgent(kvxfer.kv_cache_memory(src, groups=GROUPS)) as prefill, kvxfer.DecodeAgent(
        kvxfer.kv_cache_memory({"l0": np.zeros(FULL, np.float16)})
    ) as one_group:
        with pytest.raises(kvxfer.LeaseError) as e:
            prefill.lease("X", 0, 1, [[1], [2], [3]])  # three lists for two groups
        assert "group" in str(e.value)
        with pytest.raises(kvxfer.LeaseError):
            prefill.lease("X", 0, 1, [[1], [40]])  # group 1 has 16 blocks
        h = prefill.lease("G", 0, 1, [[1], [2]])
        with pytest.raises(kvxfer.SubmitError) as e:
            one_group.submit([h.to_params()], [[5]])
        assert e.value.kind == "group_count"
        assert "2" in str(e.value) and "1" in str(e.value)
        assert prefill.cancel(h) == "released"
    with pytest.raises(kvxfer.RegistrationError, match="nope"):
        kvxfer.kv_cache_memory(src, groups=[["l0"], ["nope"]])
    m = kvxfer.kv_cache_memory({"l0": src["l0"]})
    with pytest.raises(kvxfer.LayoutError, match="twice"):
        kvxfer.Memory.grouped([m, m])
    with pytest.raises(kvxfer.LayoutError, match="no groups"):
        kvxfer.Memory.grouped([])


# ---- tensor parallelism: HND caches (heads before tokens in a block) ----

HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 16, 4, 24


def hnd_cache(heads: int, seed: int = -1) -> np.ndarray:
    shape = (2, NUM_BLOCKS, heads, BLOCK, HEAD_DIM)
    return np.zeros(shape, np.float16) if seed < 0 else random_cache(seed, shape)


def shaped_memory(cache: np.ndarray) -> kvxfer.Memory:
    return kvxfer.kv_cache_memory([cache], kv_layout="kv_first_hnd")


def heads_equal(src: np.ndarray, remote: list[int], dst: np.ndarray, local: list[int], first: int, count: int) -> bool:
    return all(
        np.array_equal(dst[kv, local].view(np.uint16), src[kv, remote, first : first + count].view(np.uint16))
        for kv in range(2)
    )


def test_tp1_to_tp2_each_decode_rank_pulls_its_head_slice_and_the_lease_ends_after_both():
    src = hnd_cache(HEADS, seed=30)
    dsts = [hnd_cache(HEADS // 2), hnd_cache(HEADS // 2)]
    assert kvxfer.kv_cache_heads([src], kv_layout="kv_first_hnd") == (HEADS, HEAD_DIM)
    prefill = kvxfer.PrefillAgent(
        shaped_memory(src), engine_id="p-tp1", kv_shape=kvxfer.KvShape(tp_size=1, tp_rank=0, total_kv_heads=HEADS)
    )
    decodes = [
        kvxfer.DecodeAgent(
            shaped_memory(dsts[r]),
            engine_id="d-tp2",
            kv_shape=kvxfer.KvShape(tp_size=2, tp_rank=r, total_kv_heads=HEADS),
        )
        for r in range(2)
    ]
    try:
        assert [d.consumer_id for d in decodes] == ["d-tp2/0", "d-tp2/1"]
        remote = [[3, 7, 1], [3, 7, 11]]
        # Two decode ranks read each prefill lease: it ends after both have notified.
        params = [h.to_params() for h in prefill.lease_parent("T", remote, expected_consumers=2)]
        assert params[0]["tp_size"] == 1
        local = [[[0, 1, 2]], [[5, 6, 7]]]
        first = decodes[0].submit_ranks([params], local).wait(timeout=30)
        assert [r["outcome"] for r in first] == ["done", "done"]
        assert all(r["acknowledged"] for r in first), "rank 0's notifications reached the prefill side"
        assert prefill.poll_ends() == [], "one of two consumers notified: the leases still live"
        assert prefill.stats()["leases"]["live"] == 2
        second = decodes[1].submit_ranks([params], local).wait(timeout=30)
        assert [r["outcome"] for r in second] == ["done", "done"]
        for r in range(2):
            for i in range(2):
                assert heads_equal(src, remote[i], dsts[r], local[i][0], 2 * r, 2), (r, i)
        ends = prefill.wait_ends(2, timeout=10)
        assert [(e["kind"], e["consumers_seen"]) for e in ends] == [("pulled", 2), ("pulled", 2)]
        # Each rank pulled only its half of every block.
        half = 2 * len(remote) * 3 * (HEADS // 2) * BLOCK * HEAD_DIM * 2
        assert [d.stats()["bytes_pulled"] for d in decodes] == [half, half]
        assert prefill.stats()["leases"]["expired"] == 0
        # Queued-lease heartbeats and releases reach a prefill engine of another TP size
        # (the keeper's and the agent's handshakes carry the shape).
        queued = [prefill.lease("W", 0, 1, [9], expected_consumers=2).to_params()]
        assert decodes[1].heartbeat(queued, wait=True, timeout=10) == ["extended"]
        assert decodes[0].release(queued, wait=True, timeout=10) == [True]
        assert prefill.wait_ends(1, timeout=10)[0]["kind"] == "released"
    finally:
        for a in decodes + [prefill]:
            a.shutdown()


def test_tp2_to_tp1_a_decode_rank_assembles_blocks_from_both_prefill_ranks():
    srcs = [hnd_cache(HEADS // 2, seed=40), hnd_cache(HEADS // 2, seed=41)]
    dst = hnd_cache(HEADS)
    prefills = [
        kvxfer.PrefillAgent(
            shaped_memory(srcs[r]),
            engine_id="p-tp2",
            kv_shape=kvxfer.KvShape(tp_size=2, tp_rank=r, total_kv_heads=HEADS),
        )
        for r in range(2)
    ]
    decode = kvxfer.DecodeAgent(shaped_memory(dst), kv_shape=kvxfer.KvShape(total_kv_heads=HEADS))
    try:
        remote = [[2, 4], [6]]
        # Every prefill rank leases the same blocks of its own cache; the decode rank gets
        # every rank's hand-offs, in rank order.
        ranks = [[h.to_params() for h in p.lease_parent("U", remote)] for p in prefills]
        assert ranks[1][0]["tp_size"] == 2
        local = [[10, 11], [12]]
        reports = decode.submit_ranks(ranks, local).wait(timeout=30)
        assert [r["outcome"] for r in reports] == ["done", "done"]
        assert [r["remote_request_id"] for r in reports] == ["0_U", "1_U"]
        for i in range(2):
            for r in range(2):
                assert np.array_equal(
                    dst[:, local[i], 2 * r : 2 * r + 2].view(np.uint16), srcs[r][:, remote[i]].view(np.uint16)
                ), (i, r)
        for p in prefills:
            assert sorted(e["kind"] for e in p.wait_ends(2, timeout=10)) == ["pulled", "pulled"]
    finally:
        for a in prefills + [decode]:
            a.shutdown()


def test_shapes_that_do_not_fit_are_refused_naming_the_field():
    cache = hnd_cache(HEADS)

    def refused(field: str, **kw) -> str:
        with pytest.raises(kvxfer.LayoutError) as e:
            kvxfer.PrefillAgent(shaped_memory(cache), kv_shape=kvxfer.KvShape(**kw))
        assert e.value.field == field, str(e.value)
        assert f"kv_shape.{field}" in str(e.value)
        return str(e.value)

    msg = refused("head_dim", total_kv_heads=HEADS, head_dim=32)
    assert "512-byte blocks" in msg, msg
    refused("head_dim", total_kv_heads=3)  # 512 bytes are not 4 tokens × 3 heads × 2 bytes × d
    refused("dtype", total_kv_heads=HEADS, dtype="float32")
    refused("block_tokens", total_kv_heads=HEADS, block_tokens=16)
    refused("dtype_bytes", total_kv_heads=HEADS, dtype="float16", dtype_bytes=0)
    for field, kw in [
        ("total_kv_heads", dict(tp_size=2, total_kv_heads=3)),
        ("tp_rank", dict(tp_size=2, tp_rank=2, total_kv_heads=4)),
        ("total_kv_heads", dict(attention="gqa")),
        ("attention", dict(attention="sparse", total_kv_heads=4)),
    ]:
        with pytest.raises(kvxfer.LayoutError) as e:
            kvxfer.KvShape(**kw)
        assert e.value.field == field, str(e.value)
    with pytest.raises(kvxfer.ConfigError) as e:
        kvxfer.PrefillAgent(shaped_memory(cache), tp_size=4, kv_shape=kvxfer.KvShape(total_kv_heads=HEADS))
    assert e.value.field == "tp_size"
    # A decode agent without a shape cannot plan head slices.
    with kvxfer.PrefillAgent(shaped_memory(cache), kv_shape=kvxfer.KvShape(total_kv_heads=HEADS)) as prefill:
        with kvxfer.DecodeAgent(shaped_memory(hnd_cache(HEADS))) as plain:
            params = [prefill.lease("V", 0, 1, [1]).to_params()]
            with pytest.raises(kvxfer.SubmitError) as e:
                plain.submit_ranks([params], [[1]])
            assert e.value.kind == "unfit" and "kv_shape" in str(e.value)
            assert prefill.cancel(params[0]) == "released"


def test_a_peer_of_another_head_dim_is_refused_by_the_handshake_naming_it():
    src = hnd_cache(HEADS, seed=50)
    # The decode side: the same heads, of dim 8 (TP 2: 2 heads per rank).
    other = np.zeros((2, NUM_BLOCKS, 2, BLOCK, 8), np.float16)
    with kvxfer.PrefillAgent(shaped_memory(src), kv_shape=kvxfer.KvShape(total_kv_heads=HEADS)) as prefill:
        with kvxfer.DecodeAgent(
            kvxfer.kv_cache_memory([other], kv_layout="kv_first_hnd"),
            kv_shape=kvxfer.KvShape(tp_size=2, tp_rank=0, total_kv_heads=HEADS),
        ) as decode:
            params = [prefill.lease("H", 0, 1, [1], expected_consumers=2).to_params()]
            report = decode.submit_ranks([params], [[1]]).wait(timeout=30)[0]
            assert report["outcome"] == "failed"
            assert "head_dim" in str(report["error"]), report["error"]
            assert prefill.cancel(params[0]) in ("released", "already_released")


def rank_heads(total: int, tp: int, r: int) -> list[int]:
    """The KV heads rank ``r`` of ``tp`` holds, as vLLM splits them (replicated when fewer
    heads than ranks)."""
    if total >= tp:
        per = total // tp
        return list(range(r * per, (r + 1) * per))
    return [r * total // tp]


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,total_heads,ratio",
    [
        (1, 2, 4, 1),  # head slices
        (2, 1, 4, 1),  # blocks assembled from two ranks
        (4, 2, 2, 1),  # GQA: each head replicated on two prefill ranks, read once
        (1, 1, 4, 2),  # a decode block of two prefill blocks
        (1, 2, 4, 2),  # both
    ],
)
def test_tp_and_block_ratios_through_the_binding_every_byte_from_the_right_head(
    prefill_tp, decode_tp, total_heads, ratio
):
    """The model's whole cache is built first; each prefill rank holds its heads of it, and
    every decode rank must end up with its heads of the remote blocks, ``ratio`` remote
    blocks per local block (token slots in order)."""
    full = random_cache(60, (2, NUM_BLOCKS, total_heads, BLOCK, HEAD_DIM))
    srcs = [np.ascontiguousarray(full[:, :, rank_heads(total_heads, prefill_tp, r)]) for r in range(prefill_tp)]
    dsts = [
        np.zeros((2, NUM_BLOCKS, len(rank_heads(total_heads, decode_tp, d)), BLOCK * ratio, HEAD_DIM), np.float16)
        for d in range(decode_tp)
    ]
    prefills = [
        kvxfer.PrefillAgent(
            shaped_memory(srcs[r]),
            engine_id="p",
            kv_shape=kvxfer.KvShape(tp_size=prefill_tp, tp_rank=r, total_kv_heads=total_heads),
        )
        for r in range(prefill_tp)
    ]
    decodes = [
        kvxfer.DecodeAgent(
            shaped_memory(dsts[d]),
            engine_id="d",
            kv_shape=kvxfer.KvShape(tp_size=decode_tp, tp_rank=d, total_kv_heads=total_heads),
        )
        for d in range(decode_tp)
    ]
    try:
        consumers = decode_tp // prefill_tp if decode_tp > prefill_tp else 1
        remote = [[9, 2, 17, 4, 11], [9, 2, 5]]  # five and three blocks: a partly filled last local block
        local = [list(range(1, 1 + -(-5 // ratio))), list(range(10, 10 + -(-3 // ratio)))]
        ranks = [[h.to_params() for h in p.lease_parent("M", remote, expected_consumers=consumers)] for p in prefills]
        pulls = [d.submit_ranks(ranks, local) for d in decodes]
        for d, pull in enumerate(pulls):
            assert [r["outcome"] for r in pull.wait(timeout=30)] == ["done", "done"], f"decode rank {d}"
            heads = rank_heads(total_heads, decode_tp, d)
            for i in range(2):
                for j, lb in enumerate(local[i]):
                    for q in range(ratio):
                        if j * ratio + q >= len(remote[i]):
                            break
                        want = full[:, remote[i][j * ratio + q]][:, heads]
                        got = dsts[d][:, lb, :, q * BLOCK : (q + 1) * BLOCK]
                        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (d, i, j, q)
        for r, p in enumerate(prefills):
            ends = p.wait_ends(2, timeout=10)
            assert [(e["kind"], e["consumers_seen"]) for e in ends] == [("pulled", consumers)] * 2, f"prefill rank {r}"
            assert p.stats()["leases"]["expired"] == 0
    finally:
        for a in decodes + prefills:
            a.shutdown()


def test_mla_tp1_to_tp2_each_decode_rank_reads_the_whole_latent_once():
    src = random_cache(70, (NUM_BLOCKS, BLOCK, 32))
    dsts = [np.zeros_like(src), np.zeros_like(src)]
    prefill = kvxfer.PrefillAgent(
        kvxfer.kv_cache_memory([src], kv_layout="mla"), kv_shape=kvxfer.KvShape(attention="mla")
    )
    decodes = [
        kvxfer.DecodeAgent(
            kvxfer.kv_cache_memory([dsts[d]], kv_layout="mla"),
            kv_shape=kvxfer.KvShape(tp_size=2, tp_rank=d, attention="mla"),
        )
        for d in range(2)
    ]
    try:
        params = [prefill.lease("L", 0, 1, [3, 8], expected_consumers=2).to_params()]
        for d in decodes:
            assert d.submit_ranks([params], [[0, 1]]).wait(timeout=30)[0]["outcome"] == "done"
        for d in range(2):
            assert np.array_equal(dsts[d][[0, 1]].view(np.uint16), src[[3, 8]].view(np.uint16))
        assert [d.stats()["bytes_pulled"] for d in decodes] == [2 * BLOCK * 32 * 2] * 2
        end = prefill.wait_ends(1, timeout=10)[0]
        assert (end["kind"], end["consumers_seen"]) == ("pulled", 2)
    finally:
        for a in decodes + [prefill]:
            a.shutdown()
