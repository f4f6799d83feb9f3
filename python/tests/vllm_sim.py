"""A vLLM instance reduced to what a KV connector sees, driven step by step.

``Instance`` holds one scheduler-side and one worker-side ``KvxferConnector`` (rank 0) and
numpy KV caches shaped like vLLM's FlashAttention layout, per layer
``(2, num_blocks, block_size, heads, head_dim)``. ``step()`` does what vLLM's engine does
once per step: the scheduler builds the connector metadata, which is pickled and unpickled
(the process split), the worker binds it, starts loading, waits for saves, reports finished
requests and load errors, and the scheduler takes that output. Block allocation is the
test's: it names the blocks.

Options for heterogeneous layouts: ``groups=2`` makes a hybrid model (group 0: the
attention layers, group 1: one sliding-window layer; hand-offs list one block list per
group), ``tp_size`` runs one worker per tensor-parallel rank (each its own slice of the
heads; a request finishes when every rank reported it, as vLLM's output aggregator does),
``hnd`` lays blocks out heads-first (``VLLM_KV_CACHE_LAYOUT=HND``, what head slices need).
"""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np

from kvxfer.vllm import KvxferConnector
from vllm_real import (
    KVCacheBlock,
    KVCacheBlocks,
    KVConnectorOutput,
    KVConnectorRole,
    Request,
    RequestStatus,
    SchedulerOutput,
)

BLOCK_SIZE = 4
HEADS = 2
HEAD_DIM = 8
LAYERS = 2


def vllm_config(
    kv_role: str,
    engine_id: str,
    extra: Optional[dict[str, Any]] = None,
    tp_size: int = 1,
    block_size: int = BLOCK_SIZE,
    mla: bool = False,
) -> Any:
    """The parts of ``VllmConfig`` the connector reads (``HEADS`` KV heads in the model)."""
    kv = SimpleNamespace(
        kv_role=kv_role,
        engine_id=engine_id,
        kv_connector="KvxferConnector",
        kv_connector_module_path="kvxfer.vllm",
        kv_connector_extra_config={
            "kvxfer_host": "127.0.0.1",
            "kvxfer_port": 0,
            # These instances test per-child hand-offs; the shared prompt hand-off (the
            # default) is tested on vLLM's own scheduler (real_vllm/test_shared_handoff.py).
            "kvxfer_share_prompt": False,
            **(extra or {}),
        },
    )
    return SimpleNamespace(
        kv_transfer_config=kv,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=SimpleNamespace(
            use_mla=mla, get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HEAD_DIM
        ),
    )


def layer_names(groups: int) -> list[list[str]]:
    """Layer names per KV-cache group: the attention layers, then (hybrid) one window layer."""
    names = [[f"model.layers.{layer}.attn" for layer in range(LAYERS)]]
    if groups > 1:
        names.append([f"model.layers.{LAYERS}.window"])
    return names


def caches(
    num_blocks: int,
    seed: Optional[int],
    *,
    groups: int = 1,
    heads: int = HEADS,
    hnd: bool = False,
    block_size: int = BLOCK_SIZE,
    mla: bool = False,
) -> dict[str, np.ndarray]:
    """Per-layer KV caches: random contents from ``seed``, or zeros. MLA: one latent of
    ``4 * HEAD_DIM`` per token, ``(num_blocks, block_size, 4 * HEAD_DIM)``."""
    shape = (2, num_blocks, heads, block_size, HEAD_DIM) if hnd else (2, num_blocks, block_size, heads, HEAD_DIM)
    if mla:
        shape = (num_blocks, block_size, 4 * HEAD_DIM)
    out = {}
    for layer, name in enumerate(n for g in layer_names(groups) for n in g):
        if seed is None:
            out[name] = np.zeros(shape, dtype=np.float16)
        else:
            rng = np.random.default_rng(seed + layer)
            out[name] = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.float16)
    return out


def full_heads(rank_caches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """HND caches of every TP rank joined along the heads axis: the model's whole cache."""
    return {name: np.concatenate([c[name] for c in rank_caches], axis=2) for name in rank_caches[0]}


def same_group_blocks(
    src: dict[str, np.ndarray], remote: list[list[int]], dst: dict[str, np.ndarray], local: list[list[int]], groups: int
) -> bool:
    """``same_blocks`` per KV-cache group: group g's layers, ``remote[g]`` and ``local[g]``."""
    names = layer_names(groups)
    return all(
        same_blocks({n: src[n] for n in names[g]}, remote[g], {n: dst[n] for n in names[g]}, local[g])
        for g in range(groups)
    )


def same_blocks(src: dict[str, np.ndarray], remote: list[int], dst: dict[str, np.ndarray], local: list[int]) -> bool:
    """Whether every layer's K and V of ``local`` blocks in ``dst`` equal ``remote`` in ``src``."""
    for name, s in src.items():
        d = dst[name]
        for kv in range(2):
            if not np.array_equal(d[kv, local].view(np.uint16), s[kv, remote].view(np.uint16)):
                return False
    return True


class Instance:
    """One vLLM instance (scheduler + worker rank 0) with a kvxfer connector."""

    def __init__(
        self,
        kv_role: str,
        engine_id: str,
        *,
        num_blocks: int = 64,
        seed: Optional[int] = None,
        extra: Optional[dict[str, Any]] = None,
        groups: int = 1,
        tp_size: int = 1,
        hnd: bool = False,
        block_size: int = BLOCK_SIZE,
        mla: bool = False,
    ) -> None:
        extra = dict(extra or {})
        if hnd:
            extra.setdefault("kvxfer_kv_layout", "kv_first_hnd")
        self.groups = groups
        self.block_size = block_size
        kv_cache_config = None
        if groups > 1:
            kv_cache_config = SimpleNamespace(
                kv_cache_groups=[SimpleNamespace(layer_names=names) for names in layer_names(groups)]
            )
        self.sched = KvxferConnector(
            vllm_config(kv_role, engine_id, extra, tp_size, block_size, mla), KVConnectorRole.SCHEDULER, kv_cache_config
        )
        self.rank_caches = [
            caches(
                num_blocks,
                None if seed is None else seed + 100 * r,
                groups=groups,
                heads=HEADS // tp_size,
                hnd=hnd,
                block_size=block_size,
                mla=mla,
            )
            for r in range(tp_size)
        ]
        self.caches = self.rank_caches[0]
        self.workers = []
        for r in range(tp_size):
            config = vllm_config(kv_role, engine_id, dict(extra, kvxfer_tp_rank=r), tp_size, block_size, mla)
            w = KvxferConnector(config, KVConnectorRole.WORKER, kv_cache_config)
            w.register_kv_caches(self.rank_caches[r])
            self.workers.append(w)
        self.worker = self.workers[0]
        handshakes = {r: w.get_handshake_metadata() for r, w in enumerate(self.workers)}
        if handshakes[0] is not None:
            self.sched.set_xfer_handshake_metadata(handshakes)
        # Finished ids reported by how many ranks (vLLM's KV output aggregation).
        self._reported: dict[tuple[str, str], int] = {}
        self.finished_ids: set[str] = set()
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.next_block = 0
        self.allocated: dict[str, Any] = {}

    def step(self) -> KVConnectorOutput:
        """One engine step."""
        meta = self.sched.build_connector_meta(SchedulerOutput(finished_req_ids=set(self.finished_ids)))
        meta = pickle.dumps(meta)
        sending: set[str] = set()
        recving: set[str] = set()
        errors: set[int] = set()
        for w, cache in zip(self.workers, self.rank_caches):
            w.bind_connector_metadata(pickle.loads(meta))
            w.start_load_kv(None)
            for layer in cache:
                w.wait_for_layer_load(layer)
                w.save_kv_layer(layer, cache[layer], None)
            w.wait_for_save()
            s, r = w.get_finished(set(self.finished_ids))
            for kind, ids, out in (("send", s, sending), ("recv", r, recving)):
                for rid in ids or ():
                    seen = self._reported.get((kind, rid), 0) + 1
                    if seen == len(self.workers):
                        self._reported.pop((kind, rid), None)
                        out.add(rid)
                    else:
                        self._reported[(kind, rid)] = seen
            errors |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        sending_or_none = sending or None
        recving_or_none = recving or None
        self.finished_ids = set()
        out = KVConnectorOutput(
            finished_sending=sending_or_none, finished_recving=recving_or_none, invalid_block_ids=errors
        )
        self.sched.update_connector_output(out)
        self.sending |= sending
        self.recving |= recving
        self.load_errors |= errors
        return out

    def run_until(self, what: str, cond: Callable[[], bool], others: tuple["Instance", ...] = (), timeout: float = 20.0) -> None:
        """Steps this instance (and ``others``) until ``cond()``; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()
            for o in others:
                o.step()
            time.sleep(0.002)

    # ---- prefill side
    def finish_prefill(self, request: Request, blocks: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        """The request produced its one token (max_tokens=1): ``request_finished``."""
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = self.sched.request_finished(request, blocks)
        self.finished_ids.add(request.request_id)
        return delay, params

    # ---- decode side
    def add_decode(self, request: Request, *, allocate: bool = True) -> list[int]:
        """A request with ``kv_transfer_params`` arrives; with ``allocate``, its blocks are
        allocated at once (else it waits in the queue). Returns its local blocks."""
        self.sched.on_new_request(request)
        count, load_async = self.sched.get_num_new_matched_tokens(request, 0)
        if not allocate:
            return []
        return self.allocate(request, count, load_async)

    def allocate(self, request: Request, count: int, load_async: bool = True) -> Any:
        """Allocates blocks for ``count`` external tokens (in every KV-cache group) and tells
        the connector. Returns the ids: a list, or one list per group (hybrid)."""
        n = -(-count // self.block_size) if count else 0
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        # Group g's blocks: the same positions, their own ids (offset per group).
        per_group = [[b + 7 * g for b in ids] for g in range(self.groups)]
        self.allocated[request.request_id] = per_group if self.groups > 1 else ids
        if load_async and count:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        blocks = KVCacheBlocks(tuple([KVCacheBlock(i) for i in g] for g in per_group))
        self.sched.update_state_after_alloc(request, blocks, count)
        return self.allocated[request.request_id]

    def abort(self, request: Request) -> bool:
        """The request is aborted: ``request_finished``; returns whether freeing waits."""
        request.status = RequestStatus.FINISHED_ABORTED
        delay, _ = self.sched.request_finished(request, self.allocated.get(request.request_id, []))
        self.finished_ids.add(request.request_id)
        return delay

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
