"""kvxfer's KV connector for vLLM v1 (``KVConnectorBase_V1``).

Switch with one flag on both the prefill and the decode instance::

    --kv-transfer-config '{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer.vllm","kv_role":"kv_both"}'

How it maps onto vLLM:

- **Two-phase lease.** ``request_finished`` runs in the scheduler process, the KV memory
  lives in the worker processes. The scheduler side mints ``remote_request_id`` (the
  request's own id) and a random 128-bit lease token into the request's
  ``kv_transfer_params`` and returns ``delay_free=True``; every worker arms its lease with
  exactly that id and token at its next step (``PrefillAgent.arm``, from the connector
  metadata). A decode peer faster than the arm waits (bounded, ``kvxfer_arm_wait``) instead
  of being told the lease is unknown, so vLLM's early-notification race cannot happen. When
  the lease ends (pulled, released or expired) the worker reports the request in
  ``get_finished``'s sending set and vLLM frees its blocks.
- **n > 1.** vLLM forks a parallel-sampling parent ``R`` into children ``f"{i}_{R}"``. Each
  child's ``request_finished`` gets its own hand-off (``kvxfer_parent_request_id``,
  ``kvxfer_child_index``, ``kvxfer_n``) when the prefill request's ``kv_transfer_params``
  carry ``kvxfer_n`` (set by the router), and each child's params also list the hand-offs
  of every sibling finished so far (``kvxfer_children``), so the params vLLM's output path
  keeps (the last child's) carry all n. Without ``kvxfer_n`` every child is leased as a
  parent of its own, and vLLM returns only the last one's params: the decode side then pulls
  that one lease once and computes the other children's prompts locally (the other leases
  end by expiry). On the decode side a request ``f"{i}_{D}"`` pulls only child i's
  hand-off: the ``kvxfer_children`` entry (or the entry of a list of per-child params,
  vLLM's own form; current vLLM already hands child i entry i) whose ``kvxfer_child_index``
  is i, or params that are child i's. It never takes a sibling's (a child without a
  hand-off of its own computes locally, counted as ``no_own_handoff``), and one lease is
  pulled by one local request at most (a second is computed locally, ``handoff_taken``; a
  second pull reaching the worker is refused as a load error, ``duplicate_pulls``). A request that is not a forked child pulls the one child's
  params it carries (subset pulls), so children on different decode workers work.
- **Decode.** ``get_num_new_matched_tokens`` asks for the prompt's tokens asynchronously;
  ``update_state_after_alloc`` records the local blocks; the worker submits the pull at its
  next step, grouping children of one parent (blocks siblings share cross the wire once).
  Reports arrive in ``get_finished`` (receiving set); a failed child's blocks are reported by
  ``get_block_ids_with_load_errors`` (vLLM's recompute-or-fail policy applies). Leases of
  requests still waiting in the decode queue are heartbeated every ``lease_ttl / 6``.
- **Bad input.** Malformed params from the router are logged and counted (``bad_params``),
  never raised out of the scheduler or the worker; pull params sent to a ``kv_producer``
  instance are computed locally (``misrouted``).
- **Hybrid models.** With several KV-cache groups (``kv_cache_config.kv_cache_groups``, e.g.
  full attention and sliding window) each group's layers are registered as one memory group;
  ``request_finished``'s per-group block ids become nested ``remote_block_ids`` (one list per
  group), and the decode side pulls every group into its per-group local blocks (a prefix
  hit trims each group's list to its tail). A sliding-window group's list starts with vLLM's
  null block (id 0) in place of the blocks that slid out of the window: those entries are
  dropped from the hand-off and the lease (a lease holds each real block once), their count
  travels as ``kvxfer_skipped_blocks``, and the decode side leaves its local blocks at those
  positions alone (a local block straddling the window's edge — possible only with a block
  ratio — gets a copy of the first block inside the window in its slots outside it). Without a ``kv_cache_config`` (older vLLM) a
  request with blocks in more than one group is computed locally (``bad_params``).
- **Aborts.** A decode request aborted while its pull runs is cancelled (its lease ends
  released) and its blocks are freed when the pull reports. One aborted before its pull
  started, or whose blocks all hit the local prefix cache, is released without pulling
  (``DecodeAgent.release``: the prefill side frees its blocks now, not at the lease's
  expiry; counted in the decode agent's ``leases_released`` / ``releases_refused``).

Configuration (``kv_connector_extra_config``): ``kvxfer_host`` (the host hand-offs name;
default ``$VLLM_HOST_IP`` or 127.0.0.1), ``kvxfer_port`` (base port; TP rank r of data-parallel
rank d listens on ``port + d * tp_size + r``; default 5600), ``kvxfer_listen_host`` (default
``kvxfer_host``), ``kvxfer_lease_ttl`` (s, 30), ``kvxfer_arm_wait`` (s, 5),
``kvxfer_heartbeat_interval`` (s, ``lease_ttl / 6``), ``kvxfer_io_timeout`` (s, 10),
``kvxfer_worker_threads`` (2), ``kvxfer_cluster_key`` (hex; else ``KVXFER_CLUSTER_KEY``).
``kvxfer_kv_layout`` (the cache layout, see ``kvxfer.kvcache``: ``"kv_first_hnd"`` /
``"blocks_first_hnd"`` for ``VLLM_KV_CACHE_LAYOUT=HND``; default ``"auto"``),
``kvxfer_decode_tp_size`` (the decode engine's TP size, for the prefill leases' expected
consumers; default the own TP size; a request's ``kvxfer_decode_tp_size`` param wins),
``kvxfer_total_kv_heads`` (default ``model_config.get_total_num_kv_heads()``).

Tensor parallelism: with equal TP sizes rank r pulls from rank r. With different ones, every
worker states its KV shape (``kvxfer.KvShape``: TP size and rank from the parallel config, KV
heads from the model config, head dim, dtype and block size from the registered cache), the
hand-off lists every prefill rank's address (``kvxfer_rank_ports`` / ``_hosts`` /
``_incarnations``), and each decode rank pulls with ``DecodeAgent.submit_ranks``: its head
slice of every block from the prefill rank holding it (decode TP larger; each prefill lease
ends after all its decode ranks), or its blocks assembled from several prefill ranks (prefill
TP larger). This needs blocks that hold whole heads: HND caches or MLA; in vLLM's default NHD
layout no shape is stated and differing TP sizes are refused (the request is recomputed).
A decode block size that is a multiple ``k`` of the prefill one (hand-offs state
``kvxfer_block_size``) is pulled the same way, ``k`` remote blocks into each local block.

vLLM is imported lazily: without it this module still imports (the base classes fall back
to plain stand-ins), which is what the tests use.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional

import kvxfer

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _Base,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _Metadata,
    )

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorHandshakeMetadata as _HandshakeMetadata,
        )
    except ImportError:  # vLLM before out-of-band handshake metadata

        class _HandshakeMetadata:  # type: ignore[no-redef]
            """Stand-in for vLLM's ``KVConnectorHandshakeMetadata``."""

    HAVE_VLLM = True
    logger = logging.getLogger("vllm.kv_connector.kvxfer")
except ImportError:
    HAVE_VLLM = False
    logger = logging.getLogger("kvxfer.vllm")

    class _Metadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorMetadata`` when vLLM is not installed."""

    class _HandshakeMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorHandshakeMetadata`` when vLLM is not installed."""

    class _Base:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorBase_V1`` when vLLM is not installed."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role


if TYPE_CHECKING:
    from vllm.v1.request import Request  # noqa: F401

# A child of a parallel-sampling parent: vLLM names it f"{index}_{parent}".
_CHILD_ID = re.compile(r"^(\d+)_(.+)$", re.DOTALL)
_SENDING_STATES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
# How long the scheduler remembers minted siblings of a parent whose other children never
# finished, and the worker leases that ended without vLLM saying their request finished.
_FORGET_AFTER = 600.0


def _status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status))


def _int_or_none(value: Any) -> Optional[int]:
    """``value`` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num_prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or ())
    return int(n)


def _nested(block_ids: Any) -> bool:
    return isinstance(block_ids, (tuple, list)) and bool(block_ids) and isinstance(block_ids[0], (list, tuple))


def _group_blocks(block_ids: Any, num_groups: int) -> Any:
    """``block_ids`` of ``request_finished`` (a list, or one list per KV-cache group) as the
    hand-off lists them: a flat list for one group, one list per group for several (vLLM's
    nested ``remote_block_ids``)."""
    if num_groups > 1:
        if not _nested(block_ids) or len(block_ids) != num_groups:
            given = len(block_ids) if _nested(block_ids) else 1
            raise ValueError(f"{given} block lists for a model of {num_groups} KV-cache groups")
        return [[int(b) for b in g] for g in block_ids]
    if _nested(block_ids):
        if len(block_ids) > 1 and any(len(g) for g in block_ids[1:]):
            raise ValueError(
                "block ids of several KV-cache groups, but the connector was not given the model's "
                "kv_cache_config (its kv_cache_groups register one memory group each)"
            )
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in (block_ids or ())]


def _all_ids(blocks: Any) -> list[int]:
    """Every block id of a flat or per-group list."""
    if _nested(blocks):
        return [int(b) for g in blocks for b in g]
    return [int(b) for b in (blocks or ())]


# vLLM's null block: the block pool's first block, never given to a request's tokens. A
# sliding-window group's block list holds it in place of the blocks that slid out of the
# window (``SlidingWindowManager.remove_skipped_blocks``), so the list starts with repeats.
NULL_BLOCK_ID = 0


def _strip_null_prefix(blocks: Any) -> tuple[Any, Any]:
    """``blocks`` (flat or per group) without the leading null-block entries of each list,
    and how many were dropped (an int, or one per group): a lease holds real blocks only,
    each once, and the decode side keeps its blocks aligned by that count."""
    def strip(ids: list[int]) -> tuple[list[int], int]:
        k = 0
        while k < len(ids) - 1 and ids[k] == NULL_BLOCK_ID:
            k += 1
        return ids[k:], k

    if _nested(blocks):
        pairs = [strip(list(g)) for g in blocks]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return strip(list(blocks))


def _local_blocks(blocks: Any, num_groups: int = 1) -> Any:
    """The newly allocated (not prefix-cached) local blocks of ``KVCacheBlocks``: a list,
    or one list per KV-cache group for several."""
    if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
        groups = [[int(b) for b in g] for g in blocks.get_unhashed_block_ids_all_groups()]
    elif hasattr(blocks, "get_unhashed_block_ids") and num_groups == 1:
        groups = [[int(b) for b in blocks.get_unhashed_block_ids()]]
    else:
        groups = [[int(b) for b in g] for g in blocks.get_block_ids()]
    if num_groups > 1:
        return groups
    return groups[0] if groups else []


class KvxferConnectorMetadata(_Metadata):
    """What the scheduler side tells the workers at one step (pickled to them)."""

    def __init__(self, step: int) -> None:
        self.step = step
        # Prefill: request id -> minted params (rank 0's address), to arm.
        self.to_arm: dict[str, dict[str, Any]] = {}
        # Decode: request id -> (the child's params, local block ids), to pull.
        self.to_recv: dict[str, tuple[dict[str, Any], list[int]]] = {}
        # Decode: request ids whose pull is to be cancelled (the request was aborted).
        self.to_cancel: list[str] = []
        # Decode: params of leases to release without pulling (aborted before the pull).
        self.to_release: list[dict[str, Any]] = []
        # Decode: params of leases of requests waiting in the queue, to heartbeat.
        self.heartbeats: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return (
            f"KvxferConnectorMetadata(step={self.step}, arm={list(self.to_arm)}, recv={list(self.to_recv)}, "
            f"cancel={self.to_cancel}, release={len(self.to_release)}, heartbeats={len(self.heartbeats)})"
        )


class KvxferHandshakeMetadata(_HandshakeMetadata):
    """What a worker rank tells the scheduler side at start-up (vLLM's out-of-band handshake
    metadata): where its prefill agent listens and which process it is, so hand-offs name
    the real port (``kvxfer_port`` 0 lets the OS pick) and state the incarnation."""

    def __init__(self, rank: int, host: str, port: int, incarnation: int) -> None:
        self.rank = rank
        self.host = host
        self.port = port
        self.incarnation = incarnation

    def __repr__(self) -> str:
        return f"KvxferHandshakeMetadata(rank={self.rank}, {self.host}:{self.port}, incarnation={self.incarnation})"


class KvxferConnector(_Base):
    """vLLM v1 KV connector over kvxfer (see the module docs)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if HAVE_VLLM:  # pragma: no cover - needs vLLM
            import inspect

            if len(inspect.signature(_Base.__init__).parameters) > 3:
                super().__init__(vllm_config, role, kv_cache_config)
            else:
                super().__init__(vllm_config, role)  # type: ignore[call-arg]
        else:
            super().__init__(vllm_config, role, kv_cache_config)
        self._connector_metadata = None
        config = vllm_config.kv_transfer_config
        extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
        self._role_name = getattr(role, "name", str(role))
        self._kv_role = getattr(config, "kv_role", "kv_both") or "kv_both"
        self.engine_id = str(extra.get("kvxfer_engine_id") or getattr(config, "engine_id", None) or "kvxfer")
        self.host = str(extra.get("kvxfer_host") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        self.listen_host = str(extra.get("kvxfer_listen_host") or self.host)
        self.base_port = int(extra.get("kvxfer_port", 5600))
        self.lease_ttl = float(extra.get("kvxfer_lease_ttl", 30.0))
        self.arm_wait = float(extra.get("kvxfer_arm_wait", 5.0))
        self.heartbeat_interval = float(extra.get("kvxfer_heartbeat_interval", self.lease_ttl / 6))
        self.io_timeout = float(extra.get("kvxfer_io_timeout", 10.0))
        self.worker_threads = int(extra.get("kvxfer_worker_threads", 2))
        self.cluster_key = extra.get("kvxfer_cluster_key")
        parallel = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
        self._extra = extra
        self._model_config = getattr(vllm_config, "model_config", None)
        # A hybrid model's KV-cache groups (each its own layers and block ids): one memory
        # group each; hand-offs list one block list per group.
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        self.num_groups = max(1, len(groups))
        self._group_layers: Optional[list[list[str]]] = None
        if len(groups) > 1:
            names = [list(getattr(g, "layer_names", None) or ()) for g in groups]
            if not all(names):
                raise ValueError(
                    "kvxfer needs the layer names of every KV-cache group (kv_cache_groups[g].layer_names)"
                )
            self._group_layers = names
        # The decode engine's TP size, for the leases' expected consumers (a wider decode
        # engine reads each prefill rank's lease from several ranks); the request's
        # kvxfer_decode_tp_size wins.
        self.decode_tp_size = int(extra.get("kvxfer_decode_tp_size", self.tp_size))
        self.kv_layout = str(extra.get("kvxfer_kv_layout", "auto"))
        # Tokens per block (hand-offs state it; a decode block of k prefill blocks is pulled
        # with submit_ranks, k remote blocks per local block).
        self.block_size = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 0) or 0)
        # bad_params: malformed params (logged, never raised); no_own_handoff: forked decode
        # children without a hand-off of their own; handoff_taken: a lease another local
        # request already pulls; duplicate_pulls: the worker's refusals of a second pull of
        # one lease (load errors); misrouted: pull params sent to a kv_producer instance.
        self._counters = {
            "arm_failures": 0,
            "submit_failures": 0,
            "bad_params": 0,
            "no_own_handoff": 0,
            "handoff_taken": 0,
            "duplicate_pulls": 0,
            "misrouted": 0,
        }

        # Scheduler side.
        self._step = 0
        self._to_arm: dict[str, dict[str, Any]] = {}
        self._to_recv: dict[str, tuple[dict[str, Any], list[int]]] = {}
        self._recv_inflight: set[str] = set()
        self._handled: set[str] = set()
        self._to_cancel: list[str] = []
        self._to_release: list[dict[str, Any]] = []
        self._queued: dict[str, dict[str, Any]] = {}
        self._selected: dict[str, Optional[dict[str, Any]]] = {}
        # remote_request_id -> the local request that pulls it (one at most).
        self._claimed: dict[str, str] = {}
        self._last_heartbeat = 0.0
        # Prefill ranks' agents as their workers reported them (handshake metadata).
        self._ranks: dict[int, KvxferHandshakeMetadata] = {}
        # parent -> (first minted at, {child index: params}) for kvxfer_children.
        self._minted: OrderedDict[str, tuple[float, dict[int, dict[str, Any]]]] = OrderedDict()

        # Worker side.
        self._prefill: Optional[kvxfer.PrefillAgent] = None
        self._decode: Optional[kvxfer.DecodeAgent] = None
        self._decode_shape: Optional[kvxfer.KvShape] = None
        self._last_step = -1
        self._armed: set[str] = set()
        # Leases that ended before vLLM said their request finished (id -> ended at): kept
        # until it does, forgotten after _FORGET_AFTER (vLLM reports a finished request in
        # the step that arms its lease, so a later report does not come).
        self._ended: OrderedDict[str, float] = OrderedDict()
        # Requests vLLM said finished whose leases are still armed: kept until the lease
        # ends, however late (every armed lease ends, by expiry at the latest).
        self._finished_seen: set[str] = set()
        # Local request id -> (its pull, its child index there), for cancels.
        self._pulls: dict[str, tuple[kvxfer.Pull, int]] = {}
        # (pull id, child index) -> local request id: where a report goes.
        self._by_child: dict[tuple[int, int], str] = {}
        # remote_request_id -> the local request whose pull reads it (one at most).
        self._pulling: dict[str, str] = {}
        self._load_errors: set[int] = set()
        self._done_recving: set[str] = set()

    # ------------------------------------------------------------------ helpers

    @property
    def is_producer(self) -> bool:
        return self._kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self._kv_role in ("kv_consumer", "kv_both")

    def _port_of(self, rank: int) -> int:
        known = self._ranks.get(rank)
        if known is not None:
            return known.port
        if self.base_port == 0:
            return 0
        return self.base_port + self.dp_rank * self.tp_size + rank

    def _tp_rank(self) -> int:
        if "kvxfer_tp_rank" in self._extra:
            return int(self._extra["kvxfer_tp_rank"])
        try:  # pragma: no cover - needs vLLM's parallel state
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no vLLM, or its groups are not initialized
            return 0

    def _for_rank(self, params: dict[str, Any], rank: int) -> dict[str, Any]:
        """A hand-off's params with the address of prefill rank ``rank`` (same TP sizes)."""
        views = self._views(params, rank)
        if len(views) != 1:
            raise ValueError("the prefill and decode TP sizes differ: every prefill rank's hand-off is pulled")
        return views[0]

    def _block_ratio(self, params: dict[str, Any]) -> int:
        """Prefill blocks per local block: 1 unless the hand-off states another block size
        (``kvxfer_block_size``) that divides this instance's."""
        theirs = params.get("kvxfer_block_size")
        if theirs is None or not self.block_size:
            return 1
        if _int_or_none(theirs) is None or theirs < 1:
            raise TypeError(f"kvxfer_block_size is {theirs!r}, not a positive int")
        if self.block_size < theirs or self.block_size % theirs:
            raise ValueError(
                f"block size: decode {self.block_size} is not a multiple of prefill {theirs} tokens per block"
            )
        return self.block_size // theirs

    def _views(self, params: dict[str, Any], rank: int) -> list[dict[str, Any]]:
        """The hand-offs decode rank ``rank`` pulls for ``params``: prefill rank ``rank``'s
        when the TP and block sizes match (rank r pulls from rank r); every prefill rank's,
        in rank order, when they differ (``DecodeAgent.submit_ranks`` reads this rank's head
        slices from the ranks that hold them, ``k`` remote blocks into each local one)."""
        prefill_tp = _int_or_none(params.get("tp_size") or 1)
        if prefill_tp is None or prefill_tp < 1:
            raise TypeError(f"tp_size is {params.get('tp_size')!r}, not a positive int")
        ratio = self._block_ratio(params)
        if prefill_tp == self.tp_size and ratio == 1:
            return [self._rank_view(params, rank)]
        if self._decode_shape is None:
            raise ValueError(
                f"prefill TP size {prefill_tp} and decode TP size {self.tp_size} (block ratio {ratio}): pulling "
                "head slices needs the KV shape, which is registered only for HND caches (kvxfer_kv_layout "
                "\"kv_first_hnd\" or \"blocks_first_hnd\", VLLM_KV_CACHE_LAYOUT=HND) and MLA"
            )
        ports = params.get("kvxfer_rank_ports")
        if prefill_tp > 1 and not (isinstance(ports, list) and len(ports) >= prefill_tp):
            raise ValueError(f"the params do not list the ports of all {prefill_tp} prefill ranks (kvxfer_rank_ports)")
        return [self._rank_view(params, r) for r in range(prefill_tp)]

    @staticmethod
    def _rank_view(params: dict[str, Any], rank: int) -> dict[str, Any]:
        """A hand-off's params as prefill rank ``rank`` serves it (its address and
        incarnation, from the ``kvxfer_rank_*`` lists)."""
        if rank == 0:
            return params
        out = dict(params)
        for key, field in (
            ("kvxfer_rank_hosts", "remote_host"),
            ("kvxfer_rank_ports", "remote_port"),
            ("kvxfer_rank_incarnations", "kvxfer_incarnation"),
        ):
            values = params.get(key)
            if isinstance(values, list) and rank < len(values):
                out[field] = values[rank]
        return out

    def _decode_params(self, request: Any) -> Optional[dict[str, Any]]:
        """The hand-off this decode request pulls, or None (the prompt is computed locally).

        Each lease is pulled by one local request at most, and a forked child ``f"{i}_{D}"``
        never takes a sibling's: it picks the entry with ``kvxfer_child_index == i`` from
        ``kvxfer_children`` (or from a list of per-child params, vLLM's own form), and takes
        a single child's params only if they are child i's. A request that is not a forked
        child pulls the params it holds (a subset pull of one child)."""
        rid = request.request_id
        if rid in self._selected:
            return self._selected[rid]
        chosen: Optional[dict[str, Any]] = None
        try:
            chosen = self._select(rid, getattr(request, "kv_transfer_params", None))
        except (TypeError, ValueError, AttributeError) as e:
            self._counters["bad_params"] += 1
            logger.error("kvxfer: the kv_transfer_params of %s are malformed (%s); computed locally", rid, e)
        if chosen is not None:
            remote = str(chosen.get("remote_request_id"))
            holder = self._claimed.get(remote)
            if holder is not None and holder != rid:
                self._counters["handoff_taken"] += 1
                logger.warning(
                    "kvxfer: the lease of %s is already pulled by local request %s; %s is computed locally",
                    remote,
                    holder,
                    rid,
                )
                chosen = None
            else:
                self._claimed[remote] = rid
        self._selected[rid] = chosen
        return chosen

    def _select(self, rid: str, params: Any) -> Optional[dict[str, Any]]:
        """The entry of ``params`` (a dict, or a list of per-child dicts) request ``rid``
        pulls; raises TypeError / ValueError on malformed params."""
        m = _CHILD_ID.match(rid)
        index = int(m.group(1)) if m else None
        wants_pull = (isinstance(params, dict) and bool(params.get("do_remote_prefill"))) or (
            isinstance(params, list) and any(isinstance(p, dict) and p.get("do_remote_prefill") for p in params)
        )
        if not wants_pull:
            return None
        if not self.is_consumer:
            # A router's mistake: nothing here would ever pull or report it.
            self._counters["misrouted"] += 1
            logger.error(
                "kvxfer: %s asks to pull (do_remote_prefill) but this instance is kv_role=%s; computed locally",
                rid,
                self._kv_role,
            )
            return None
        if isinstance(params, list):
            entries = [p for p in params if isinstance(p, dict) and p.get("do_remote_prefill")]
            if len(entries) != len(params):
                raise TypeError("a list of kv_transfer_params holds entries that are not hand-off dicts")
            if len(entries) == 1 and (index is None or _int_or_none(entries[0].get("kvxfer_n")) in (None, 1)):
                return self._select(rid, entries[0])  # one hand-off: as if given alone
            if index is None:
                raise ValueError(f"{len(entries)} hand-offs for a request that is not a forked child")
            if all(_int_or_none(e.get("kvxfer_n")) in (None, 1) for e in entries):
                # Per-child leases of their own (the prefill side had no kvxfer_n): vLLM's
                # list form, child i takes entry i.
                return self._own(entries[index]) if index < len(entries) else self._none_of_its_own(rid)
            return self._by_index(rid, index, entries)
        assert isinstance(params, dict)
        children = params.get("kvxfer_children")
        if children is not None and not isinstance(children, list):
            raise TypeError(f"kvxfer_children is a {type(children).__name__}, not a list")
        if index is not None and children:
            if not all(isinstance(c, dict) for c in children):
                raise TypeError("kvxfer_children holds entries that are not dicts")
            return self._by_index(rid, index, children)
        if not params.get("kvxfer_lease_token"):
            return None
        own = self._own(params)
        n = _int_or_none(own.get("kvxfer_n"))
        if index is not None and n is not None and n > 1 and _int_or_none(own.get("kvxfer_child_index")) != index:
            # Another child's hand-off (e.g. the last child's params, which vLLM's output path
            # keeps, forwarded to every child of the decode parent): never pulled by child i.
            return self._none_of_its_own(rid)
        return own

    def _by_index(self, rid: str, index: int, entries: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
        for e in entries:
            if _int_or_none(e.get("kvxfer_child_index")) == index:
                return self._own(e)
        return self._none_of_its_own(rid)

    @staticmethod
    def _own(params: dict[str, Any]) -> dict[str, Any]:
        """One child's params (without the sibling list); TypeError if its child index or
        n is not an int."""
        for key in ("kvxfer_child_index", "kvxfer_n"):
            if params.get(key) is not None and _int_or_none(params[key]) is None:
                raise TypeError(f"{key} is {params[key]!r}, not an int")
        return {k: v for k, v in params.items() if k != "kvxfer_children"}

    def _none_of_its_own(self, rid: str) -> None:
        self._counters["no_own_handoff"] += 1
        logger.warning("kvxfer: no hand-off of its own for %s (a sibling's is never taken); computed locally", rid)
        return None

    @staticmethod
    def _child_of(rid: str, params: dict[str, Any]) -> tuple[str, int, int]:
        """(parent, child index, n) of a prefill request."""
        n = _int_or_none(params.get("kvxfer_n"))
        if n is not None and n > 1:
            m = _CHILD_ID.match(rid)
            if m and int(m.group(1)) < n:
                return m.group(2), int(m.group(1)), n
            logger.warning("kvxfer: request %s has kvxfer_n=%s but is not named like a child; leased alone", rid, n)
        return rid, 0, 1

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Any) -> None:
        """Starts heartbeating the lease of a decode request waiting in the queue."""
        params = self._decode_params(request)
        if params is not None and request.request_id not in self._handled:
            self._queued[request.request_id] = params

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._decode_params(request)
        if params is None or request.request_id in self._handled:
            return 0, False
        self._queued.setdefault(request.request_id, params)
        count = _num_prompt_tokens(request) - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        params = self._decode_params(request)
        if params is None or rid in self._handled:
            return
        self._handled.add(rid)
        self._queued.pop(rid, None)
        if num_external_tokens > 0:
            self._to_recv[rid] = (params, _local_blocks(blocks, self.num_groups))
            self._recv_inflight.add(rid)
        else:
            # Everything is in the local prefix cache: nothing to pull, release the lease.
            self._to_release.append(params)

    def build_connector_meta(self, scheduler_output: Any) -> KvxferConnectorMetadata:
        self._step += 1
        meta = KvxferConnectorMetadata(self._step)
        meta.to_arm, self._to_arm = self._to_arm, {}
        meta.to_recv, self._to_recv = self._to_recv, {}
        meta.to_cancel, self._to_cancel = self._to_cancel, []
        meta.to_release, self._to_release = self._to_release, []
        now = time.monotonic()
        if self._queued and now - self._last_heartbeat >= self.heartbeat_interval:
            self._last_heartbeat = now
            meta.heartbeats = list(self._queued.values())
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._recv_inflight.discard(rid)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        self._queued.pop(rid, None)
        decode = self._decode_params(request)
        self._selected.pop(rid, None)
        if decode is not None:
            remote = str(decode.get("remote_request_id"))
            if self._claimed.get(remote) == rid:
                del self._claimed[remote]
            handled = rid in self._handled
            self._handled.discard(rid)
            if rid in self._to_recv:  # allocated, the pull not sent to the worker yet
                self._to_release.append(self._to_recv.pop(rid)[0])
                self._recv_inflight.discard(rid)
                return False, None
            if rid in self._recv_inflight:  # the pull runs: cancel, free when it reports
                self._to_cancel.append(rid)
                return True, None
            if not handled:
                self._to_release.append(decode)  # finished (aborted) in the queue, never pulled
            return False, None
        params = self._prefill_params(rid, getattr(request, "kv_transfer_params", None))
        if params is None or not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if _status_name(request) not in _SENDING_STATES:
            return False, None  # aborted: nothing is leased, the blocks are freed now
        try:
            blocks = _group_blocks(block_ids, self.num_groups)
        except (TypeError, ValueError) as e:
            self._counters["bad_params"] += 1
            logger.error("kvxfer: cannot lease the blocks of %s (%s); freed now, the decode side computes", rid, e)
            return False, None
        blocks, skipped = _strip_null_prefix(blocks)
        if not _all_ids(blocks):
            return False, None
        return True, self._mint(rid, params, blocks, skipped)

    def _prefill_params(self, rid: str, params: Any) -> Optional[dict[str, Any]]:
        """A prefill request's own ``kv_transfer_params`` dict (vLLM's per-child list form:
        the child's entry), or None; malformed params are logged and counted, never raised."""
        if params is None:
            return None
        if isinstance(params, list):
            if not any(isinstance(p, dict) and p.get("do_remote_decode") for p in params):
                return None  # a decode request's params (or nothing for kvxfer)
            m = _CHILD_ID.match(rid)
            index = int(m.group(1)) if m and len(params) > 1 else 0
            params = params[index] if index < len(params) else None
        if not isinstance(params, dict):
            self._counters["bad_params"] += 1
            kind = type(params).__name__
            logger.error("kvxfer: the kv_transfer_params of %s are not a dict (%s); nothing leased", rid, kind)
            return None
        return params

    def _mint(self, rid: str, params: dict[str, Any], blocks: Any, skipped: Any = 0) -> dict[str, Any]:
        """The child's hand-off (minted id and token), queued for the workers to arm.
        ``skipped``: the null-block entries dropped from the head of each block list."""
        parent, index, n = self._child_of(rid, params)
        decode_tp = _int_or_none(params.get("kvxfer_decode_tp_size")) or self.decode_tp_size
        # As kvxfer_core::expected_consumers: a wider decode engine reads every prefill
        # rank's lease from decode_tp / prefill_tp ranks; otherwise one rank per lease.
        consumers = decode_tp // self.tp_size if decode_tp > self.tp_size and decode_tp % self.tp_size == 0 else 1
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.host,
            "remote_port": self._port_of(0),
            "tp_size": self.tp_size,
            "kvxfer_lease_token": secrets.token_hex(16),
            "kvxfer_parent_request_id": parent,
            "kvxfer_child_index": index,
            "kvxfer_n": n,
            "kvxfer_expected_consumers": consumers,
            "kvxfer_lease_ttl_ms": int(self.lease_ttl * 1000),
        }
        if self.block_size:
            out["kvxfer_block_size"] = self.block_size
        if any(skipped if isinstance(skipped, list) else [skipped]):
            out["kvxfer_skipped_blocks"] = skipped
        rank0 = self._ranks.get(0)
        if rank0 is not None:
            out["remote_host"] = rank0.host
            out["kvxfer_incarnation"] = rank0.incarnation
        if self.tp_size > 1:
            out["kvxfer_rank_ports"] = [self._port_of(r) for r in range(self.tp_size)]
            if all(r in self._ranks for r in range(self.tp_size)):
                out["kvxfer_rank_hosts"] = [self._ranks[r].host for r in range(self.tp_size)]
                out["kvxfer_rank_incarnations"] = [self._ranks[r].incarnation for r in range(self.tp_size)]
        self._to_arm[rid] = out
        if n == 1:
            return dict(out)
        now = time.monotonic()
        while self._minted:
            oldest, (since, _) = next(iter(self._minted.items()))
            if now - since < _FORGET_AFTER:
                break
            del self._minted[oldest]
        _, siblings = self._minted.setdefault(parent, (now, {}))
        siblings[index] = out
        result = dict(out)
        result["kvxfer_children"] = [dict(siblings[i]) for i in sorted(siblings)]
        if len(siblings) == n:
            del self._minted[parent]
        return result

    def get_finished_count(self) -> Optional[int]:
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Learns every prefill rank's agent address and incarnation from its worker."""
        for rank, meta in (metadata or {}).items():
            if isinstance(meta, KvxferHandshakeMetadata):
                self._ranks[int(rank)] = meta

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Registers the KV cache (host memory) and starts the agents of this rank."""
        rank = self._tp_rank()
        shape = self._kv_shape(kv_caches, rank)
        common = dict(
            engine_id=self.engine_id,
            rank=rank,
            kv_shape=shape,
            cluster_key=self.cluster_key,
            io_timeout=self.io_timeout,
            worker_threads=self.worker_threads,
        )

        def memory() -> kvxfer.Memory:
            return kvxfer.kv_cache_memory(kv_caches, kv_layout=self.kv_layout, groups=self._group_layers)

        if self.is_producer:
            self._prefill = kvxfer.PrefillAgent(
                memory(),
                f"{self.listen_host}:{self._port_of(rank)}",
                agent_name=f"vllm-prefill-{rank}",
                tp_size=self.tp_size,
                advertise_host=self.host,
                lease_ttl=self.lease_ttl,
                arm_wait=self.arm_wait,
                **common,
            )
        if self.is_consumer:
            self._decode_shape = shape
            self._decode = kvxfer.DecodeAgent(
                memory(),
                agent_name=f"vllm-decode-{rank}",
                queue_reports=True,
                **common,
            )

    def _kv_shape(self, kv_caches: dict[str, Any], rank: int) -> Optional[kvxfer.KvShape]:
        """This rank's KV shape (TP size and rank, KV heads; head dim, dtype and block size
        come from the registered memory), from vLLM's parallel and model config. Only for
        caches whose blocks hold whole heads (HND layouts, MLA): in vLLM's default NHD
        layout a head slice of a block is not contiguous, so no shape is stated and the TP
        sizes must match (rank r pulls from rank r)."""
        model = self._model_config
        mla = bool(getattr(model, "use_mla", False)) or self.kv_layout == "mla"
        if not (mla or self.kv_layout.endswith("_hnd")):
            return None
        caches = kv_caches
        if self._group_layers is not None:
            caches = {n: kv_caches[n] for n in self._group_layers[0] if n in kv_caches}
        heads, _ = kvxfer.kv_cache_heads(caches, kv_layout=self.kv_layout)
        if mla:
            return kvxfer.KvShape(tp_size=self.tp_size, tp_rank=rank, attention="mla")
        total = self._extra.get("kvxfer_total_kv_heads")
        if total is None and hasattr(model, "get_total_num_kv_heads"):
            total = model.get_total_num_kv_heads()
        if total is None:
            total = heads * self.tp_size  # as many heads as ranks or more: an even split
        return kvxfer.KvShape(tp_size=self.tp_size, tp_rank=rank, total_kv_heads=int(total))

    def get_handshake_metadata(self) -> Optional[KvxferHandshakeMetadata]:
        """This rank's prefill agent (address, incarnation), for the scheduler side."""
        if self._prefill is None:
            return None
        host, port = self._prefill.address
        return KvxferHandshakeMetadata(self._tp_rank(), host, port, self._prefill.incarnation)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata
        self._process(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> Any:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._connector_metadata is not None:
            self._process(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: pulls land between steps (asynchronous loading)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing to save: the decode side pulls straight from the registered KV cache."""

    def wait_for_save(self) -> None:
        if self._connector_metadata is not None:
            self._process(self._connector_metadata)

    def _process(self, meta: Any) -> None:
        """Applies one step's metadata once: arms, pulls, cancels, releases, heartbeats."""
        step = getattr(meta, "step", None)
        if not isinstance(meta, KvxferConnectorMetadata) or step is None or step <= self._last_step:
            return
        self._last_step = step
        rank = self._tp_rank()
        if self._prefill is not None:
            for rid, params in meta.to_arm.items():
                try:
                    self._prefill.arm(self._rank_view(params, rank))
                    self._armed.add(rid)
                except kvxfer.KvxferError as e:
                    self._counters["arm_failures"] += 1
                    logger.error("kvxfer: arming the lease of %s failed: %s", rid, e)
                    kind = getattr(e, "kind", None)
                    if kind == "already_leased":
                        # A lease of this id exists and may be read: the blocks go back
                        # when it ends (its end carries this id).
                        self._armed.add(rid)
                    elif kind != "token_reused":
                        # No lease holds the blocks: hand them back at once. (token_reused:
                        # this very lease was armed and has ended already, and reported.)
                        self._ended[rid] = time.monotonic()
        if self._decode is not None:
            self._submit(meta.to_recv, rank)
            for rid in meta.to_cancel:
                pull = self._pulls.get(rid)
                if pull is not None:
                    pull[0].cancel_child(pull[1])
            if meta.to_release:
                self._release([v for p in meta.to_release for v in self._views_or_none(p, rank)])
            if meta.heartbeats:
                beats = [v for p in meta.heartbeats for v in self._views_or_none(p, rank)]
                if beats:
                    self._each_or_alone(self._decode.heartbeat, beats, "heartbeating")

    def _each_or_alone(self, call: Any, params: list[dict[str, Any]], what: str) -> None:
        """``call(params)``; when a dict is malformed (a router's bad params must not stop
        the worker), each dict alone, logging the ones refused."""
        try:
            call(params)
            return
        except kvxfer.KvxferError:
            pass
        for p in params:
            try:
                call([p])
            except kvxfer.KvxferError as e:
                self._counters["bad_params"] += 1
                logger.error("kvxfer: %s the lease of %s failed: %s", what, p.get("remote_request_id"), e)

    def _views_or_none(self, params: dict[str, Any], rank: int) -> list[dict[str, Any]]:
        """``_views``, or none (logged and counted) for params that cannot be used."""
        try:
            return self._views(params, rank)
        except (ValueError, TypeError) as e:
            self._counters["bad_params"] += 1
            logger.error("kvxfer: the params of %s cannot be used: %s", params.get("remote_request_id"), e)
            return []

    def _release(self, params: list[dict[str, Any]]) -> None:
        """Leases given up without pulling (aborted requests, full local prefix hits):
        released now (``DecodeAgent.release``, not waited for) so the prefill side frees the
        blocks at once instead of at the lease's expiry."""
        if params and self._decode is not None:
            self._each_or_alone(self._decode.release, params, "releasing")

    def _submit(self, to_recv: dict[str, tuple[dict[str, Any], Any]], rank: int) -> None:
        """Submits the step's pulls, children of one parent on one prefill agent together
        (one ``submit_ranks`` over every prefill rank when the TP sizes differ)."""
        assert self._decode is not None
        groups: dict[tuple[Any, ...], list[tuple[str, list[dict[str, Any]], Any, int]]] = {}
        for rid, (params, local) in to_recv.items():
            if not _all_ids(local):
                # Every block was found in the local prefix cache: nothing to pull.
                self._release(self._views_or_none(params, rank))
                self._done_recving.add(rid)
                continue
            try:
                views = self._views(params, rank)
                p = views[0]
                remote_id = str(p.get("remote_request_id"))
                holder = self._pulling.get(remote_id)
                if holder is not None:
                    # Two local requests would pull one lease: only one can, the other's
                    # blocks would never be written. vLLM recomputes (or fails) this one.
                    self._counters["duplicate_pulls"] += 1
                    self._fail(rid, local, f"cannot pull {rid}: local request {holder} already pulls {remote_id}")
                    continue
                child_index = _int_or_none(p.get("kvxfer_child_index") or 0)
                if child_index is None:
                    raise TypeError(f"kvxfer_child_index is {p.get('kvxfer_child_index')!r}, not an int")
                ratio = self._block_ratio(p)
                remote, pulled_into = self._pulled_blocks(
                    p.get("remote_block_ids"), local, ratio, p.get("kvxfer_skipped_blocks") or 0
                )
                if not _all_ids(pulled_into):
                    # Every local block lies outside the prefill side's sliding window.
                    self._release(views)
                    self._done_recving.add(rid)
                    continue
                views = [dict(v, remote_block_ids=remote) for v in views]
                hetero = len(views) > 1 or ratio != 1 or int(p.get("tp_size") or 1) != self.tp_size
            except (ValueError, TypeError) as e:
                self._fail(rid, local, f"cannot pull {rid}: {e}")
                continue
            self._pulling[remote_id] = rid
            key = (
                p.get("kvxfer_parent_request_id") or p.get("remote_request_id"),
                p.get("remote_host"),
                p.get("remote_port"),
                len(views),
                hetero,
            )
            groups.setdefault(key, []).append((rid, views, local, child_index, pulled_into))
        for (_, _, _, num_ranks, hetero), members in groups.items():
            try:
                if not hetero:
                    pull = self._decode.submit([m[1][0] for m in members], [m[4] for m in members])
                else:
                    ranks = [[m[1][r] for m in members] for r in range(num_ranks)]
                    pull = self._decode.submit_ranks(ranks, [m[4] for m in members])
            except kvxfer.KvxferError as e:
                for rid, views, local, _, _ in members:
                    self._pulling.pop(str(views[0].get("remote_request_id")), None)
                    self._fail(rid, local, f"cannot pull {rid}: {e}")
                continue
            for rid, _, _, child_index, _ in members:
                self._pulls[rid] = (pull, child_index)
                self._by_child[(pull.id, child_index)] = rid

    def _pulled_blocks(self, remote: Any, local: Any, ratio: int = 1, skipped: Any = 0) -> tuple[Any, Any]:
        """The remote blocks to pull and the local blocks they go to (per KV-cache group when
        nested; ``ratio`` remote blocks per local block): where the head of the prompt is in
        the local prefix cache (fewer local blocks), the tail; local blocks at positions the
        prefill side had slid out of its window (``skipped``) are left alone."""
        if self.num_groups > 1:
            if not (_nested(remote) and _nested(local) and len(remote) == len(local) == self.num_groups):
                raise ValueError(f"the hand-off and the local blocks must list {self.num_groups} KV-cache groups")
            skips = skipped if isinstance(skipped, list) else [skipped] * self.num_groups
            if len(skips) != self.num_groups:
                raise ValueError(f"kvxfer_skipped_blocks lists {len(skips)} groups, this model has {self.num_groups}")
            pairs = [self._tail(list(r), list(l), ratio, k) for r, l, k in zip(remote, local, skips)]
            return [p[0] for p in pairs], [p[1] for p in pairs]
        remote = list(remote or [])
        if remote and isinstance(remote[0], list):
            if len(remote) > 1 and any(remote[1:]):
                raise ValueError(f"the hand-off lists {len(remote)} KV-cache groups, this model has one")
            remote = remote[0]
        if isinstance(skipped, list):
            skipped = skipped[0] if skipped else 0
        return self._tail(remote, list(local), ratio, skipped)

    @staticmethod
    def _tail(remote: list[int], local: list[int], ratio: int = 1, skipped: Any = 0) -> tuple[list[int], list[int]]:
        """The remote blocks of one group to pull and the local blocks they go to (``ratio``
        remote blocks per local block): all, or the tail past the local blocks found in the
        prefix cache. ``remote`` lacks its first ``skipped`` positions (null blocks on the
        prefill side, outside its sliding window): local blocks wholly there are not pulled."""
        k = _int_or_none(skipped)
        if k is None or k < 0:
            raise ValueError(f"kvxfer_skipped_blocks is {skipped!r}, not a count")
        needed = -(-(k + len(remote)) // ratio)
        if len(local) > needed:
            raise ValueError(f"{len(local)} local blocks for {k + len(remote)} remote blocks (block ratio {ratio})")
        start = (needed - len(local)) * ratio  # the first local block's first remote position
        head = max(0, k - start)  # remote positions of the local blocks with no KV remotely
        idle = min(head // ratio, len(local))  # local blocks wholly outside the window
        fill = head % ratio if idle < len(local) else 0
        if fill and not remote:
            raise ValueError(f"{k} remote blocks outside the sliding window and none inside it")
        # A local block straddling the window's edge (block ratio > 1): its slots outside the
        # window get a copy of the first block inside it — attention over the window never
        # reads them (before the window moved past them, the prefill side's were vLLM's null
        # block, just as meaningless).
        return remote[:1] * fill + remote[start + idle * ratio + fill - k :], local[idle:]

    def _fail(self, rid: str, local: Any, why: str) -> None:
        self._counters["submit_failures"] += 1
        logger.error("kvxfer: %s", why)
        self._load_errors.update(_all_ids(local))
        self._done_recving.add(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        if self._connector_metadata is not None:
            self._process(self._connector_metadata)
        sending: set[str] = set()
        if self._prefill is not None:
            now = time.monotonic()
            for rid in finished_req_ids or ():
                if rid in self._armed or rid in self._ended:
                    self._finished_seen.add(rid)
            for end in self._prefill.poll_ends():
                rid = end["remote_request_id"]
                if end["kind"] == "expired":
                    logger.warning("kvxfer: the lease of %s expired", rid)
                self._armed.discard(rid)
                self._ended[rid] = now
            for rid in list(self._ended):
                if rid in self._finished_seen:
                    sending.add(rid)
                    del self._ended[rid]
                    self._finished_seen.discard(rid)
            while self._ended:
                oldest, since = next(iter(self._ended.items()))
                if now - since < _FORGET_AFTER:
                    break
                del self._ended[oldest]
        if self._decode is not None:
            for r in self._decode.poll_reports():
                rid = self._by_child.pop((r["pull"], r["child_index"]), None)
                if rid is None:
                    continue
                self._pulls.pop(rid, None)
                if self._pulling.get(r["remote_request_id"]) == rid:
                    del self._pulling[r["remote_request_id"]]
                if r["outcome"] in ("failed", "failed_blocks_held"):
                    logger.warning("kvxfer: pulling %s failed (%s): %s", rid, r["error"].advice, r["error"])
                    self._load_errors.update(_all_ids(r["local_blocks"]))
                self._done_recving.add(rid)
        recving, self._done_recving = self._done_recving, set()
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for agent in (self._decode, self._prefill):
            if agent is not None:
                agent.shutdown()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, Any]:
        """The agents' counters and the connector's own (for tests and monitoring)."""
        out: dict[str, Any] = dict(self._counters)
        if self._prefill is not None:
            out["prefill"] = self._prefill.stats()
        if self._decode is not None:
            out["decode"] = self._decode.stats()
        return out
