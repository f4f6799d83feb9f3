"""A vLLM instance reduced to what a KV connector sees, driven step by step.

``Instance`` holds one scheduler-side and one worker-side ``KvxferConnector`` (rank 0) and
numpy KV caches shaped like vLLM's FlashAttention layout, per layer
``(2, num_blocks, block_size, heads, head_dim)``. ``step()`` does what vLLM's engine does
once per step: the scheduler builds the connector metadata, which is pickled and unpickled
(the process split), the worker binds it, starts loading, waits for saves, reports finished
requests and load errors, and the scheduler takes that output. Block allocation is the
test's: it names the blocks.
"""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np

from kvxfer.vllm import KvxferConnector
from vllm_base_mirror import (
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


def vllm_config(kv_role: str, engine_id: str, extra: Optional[dict[str, Any]] = None, tp_size: int = 1) -> Any:
    """The parts of ``VllmConfig`` the connector reads."""
    kv = SimpleNamespace(
        kv_role=kv_role,
        engine_id=engine_id,
        kv_connector="KvxferConnector",
        kv_connector_module_path="kvxfer.vllm",
        kv_connector_extra_config={"kvxfer_host": "127.0.0.1", "kvxfer_port": 0, **(extra or {})},
    )
    return SimpleNamespace(
        kv_transfer_config=kv,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
    )


def caches(num_blocks: int, seed: Optional[int]) -> dict[str, np.ndarray]:
    """Per-layer KV caches: random contents from ``seed``, or zeros."""
    shape = (2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    out = {}
    for layer in range(LAYERS):
        if seed is None:
            out[f"model.layers.{layer}.attn"] = np.zeros(shape, dtype=np.float16)
        else:
            rng = np.random.default_rng(seed + layer)
            out[f"model.layers.{layer}.attn"] = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.float16)
    return out


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
    ) -> None:
        config = vllm_config(kv_role, engine_id, extra)
        self.caches = caches(num_blocks, seed)
        self.sched = KvxferConnector(config, KVConnectorRole.SCHEDULER, None)
        self.worker = KvxferConnector(config, KVConnectorRole.WORKER, None)
        self.worker.register_kv_caches(self.caches)
        handshake = self.worker.get_handshake_metadata()
        if handshake is not None:
            self.sched.set_xfer_handshake_metadata({0: handshake})
        self.finished_ids: set[str] = set()
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.next_block = 0
        self.allocated: dict[str, list[int]] = {}

    def step(self) -> KVConnectorOutput:
        """One engine step."""
        meta = self.sched.build_connector_meta(SchedulerOutput(finished_req_ids=set(self.finished_ids)))
        meta = pickle.loads(pickle.dumps(meta))
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for layer in self.caches:
            w.wait_for_layer_load(layer)
            w.save_kv_layer(layer, self.caches[layer], None)
        w.wait_for_save()
        sending, recving = w.get_finished(set(self.finished_ids))
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.finished_ids = set()
        out = KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=errors)
        self.sched.update_connector_output(out)
        self.sending |= sending or set()
        self.recving |= recving or set()
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
    def finish_prefill(self, request: Request, blocks: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
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

    def allocate(self, request: Request, count: int, load_async: bool = True) -> list[int]:
        """Allocates blocks for ``count`` external tokens and tells the connector."""
        n = -(-count // BLOCK_SIZE) if count else 0
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.allocated[request.request_id] = ids
        if load_async and count:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.sched.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(i) for i in ids],)), count)
        return ids

    def abort(self, request: Request) -> bool:
        """The request is aborted: ``request_finished``; returns whether freeing waits."""
        request.status = RequestStatus.FINISHED_ABORTED
        delay, _ = self.sched.request_finished(request, self.allocated.get(request.request_id, []))
        self.finished_ids.add(request.request_id)
        return delay

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def shutdown(self) -> None:
        self.worker.shutdown()
