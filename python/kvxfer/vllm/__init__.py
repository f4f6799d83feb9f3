"""kvxfer's KV connector for vLLM v1 (``KVConnectorBase_V1``).

Switch with one flag on both the prefill and the decode instance::

    --kv-transfer-config '{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer.vllm","kv_role":"kv_both"}'

:class:`KvxferConnector` is a thin class: vLLM creates it once in the scheduler process
(role SCHEDULER: :class:`~kvxfer.vllm.scheduler.KvxferScheduler`) and once per worker
(role WORKER: :class:`~kvxfer.vllm.worker.KvxferWorker`), and each call goes to that half.

- **Hand-offs live when they leave.** The scheduler mints a request's hand-off (its id and a
  random 128-bit lease token) when the step that computes the prompt's last token is
  scheduled; the workers arm the lease right after that step's forward. The params
  ``request_finished`` returns are live before vLLM emits them — the offline ``LLM`` API
  needs no further step — and a minted lease whose request does not hand it off (aborted,
  preempted) is retracted. When the lease ends (pulled, released or expired) the worker
  reports the request in ``get_finished``'s sending set and vLLM frees its blocks.
- **n > 1: one shared prompt hand-off** (``kvxfer_share_prompt``, on by default). vLLM forks a
  parallel-sampling parent ``R`` into children ``f"{i}_{R}"`` whose prompt KV is the same
  bytes: the first child to finish holds one lease for the parent, every child's params name
  it (``kvxfer_shared``), and the other children's blocks are freed at once (their leases
  retracted: released; ``shared_children``). Any router's choice of params then works —
  Dynamo's (the first output's), vLLM's (the last), kvxfer's (all). On the decode side the
  children naming the shared lease are served by one pull, the others given a copy of its
  blocks (``shared_pulls``); a child aborted before then does not end it for the others.
- **Per-child hand-offs** (children that generated more than one token on the prefill, or
  ``kvxfer_share_prompt`` false). When
  the prefill request's ``kv_transfer_params`` carry ``kvxfer_n`` (set by the router,
  ``python -m kvxfer.proxy``), each child gets its own hand-off (``kvxfer_parent_request_id``,
  ``kvxfer_child_index``, ``kvxfer_n``) and each child's params also list every sibling's
  (``kvxfer_children``), so the params vLLM's output path keeps (one child's) carry all n.
  On the decode side a forked child ``f"{i}_{D}"`` whose params list several children pulls
  the entry whose ``kvxfer_child_index`` is i, never a sibling's (none: computed locally,
  ``no_own_handoff``); params of one child are pulled by the request holding them, whatever
  its id looks like; one lease is pulled by one local request at most (``handoff_taken``,
  ``duplicate_pulls``).
- **Decode.** ``get_num_new_matched_tokens`` asks for the prompt's tokens asynchronously;
  ``update_state_after_alloc`` records the local blocks; the worker submits the pull in
  ``start_load_kv``, grouping children of one parent (blocks siblings share cross the wire
  once). Reports arrive in ``get_finished``; a failed child's blocks are reported by
  ``get_block_ids_with_load_errors`` (vLLM's recompute-or-fail policy applies). Leases of
  requests still waiting in the queue are heartbeated every ``lease_ttl / 6`` (a sixth of
  the TTL a hand-off states, ``kvxfer_lease_ttl_ms``, when that is sooner); a request
  aborted before its pull, or whose blocks all hit the local prefix cache, releases its
  lease at once; a request vLLM's API server refuses before admitting it
  (``notify_kv_transfer_request_rejected``) releases every lease its params list.
- **Hybrid models** (``SupportsHMA``): one memory group per ``kv_cache_groups[g]``, nested
  ``remote_block_ids``; a sliding-window group's leading null blocks are not leased
  (``kvxfer_skipped_blocks``).
- **GPU caches**: staged through registered host memory with vLLM's copy op
  (``set_host_xfer_buffer_ops``) — asked for with ``"kv_buffer_device": "cpu"``, and the
  fallback otherwise (logged with the reason). With ``kvxfer_device_direct: true`` and a UCX
  that has CUDA transports (the libucx-cu12 wheel where CUDA is), a CUDA cache is registered
  as it is instead: UCX reads and writes its blocks (``cuda_ipc`` on one node), nothing is
  copied through the host, and shared-prompt siblings are copied by torch on the device.
  Opt-in until ``scripts/gpu-check.sh`` has run on a GPU: not yet run on a GPU.
- **Bad input** from the router is logged and counted (``bad_params``), never raised.

Configuration (``kv_connector_extra_config``): ``kvxfer_host`` (the host hand-offs name;
default ``$VLLM_HOST_IP`` or 127.0.0.1 — a loopback host is warned about at start-up; a
TP rank (TP > 1) on another node, where it is not a local address, names its node's
``$VLLM_HOST_IP`` instead, when that is one of the node's addresses),
``kvxfer_port`` (base port; TP rank r of data-parallel engine d, vLLM's
``data_parallel_index``, listens on
``port + d * tp_size + r``; default 0: the OS picks, and the port travels in vLLM's
handshake metadata, so several instances share a host), ``kvxfer_listen_host`` (default
``kvxfer_host``), ``kvxfer_lease_ttl`` (s, 30), ``kvxfer_arm_wait`` (s, 5),
``kvxfer_heartbeat_interval`` (s, ``lease_ttl / 6``), ``kvxfer_io_timeout`` (s, 10),
``kvxfer_worker_threads`` (2; 0: one thread driving each agent's runtime, the lowest
one-block latency), ``kvxfer_notify_with_read`` (False; True: one round trip for a child whose
own read settles it — over TCP, no block shared with a sibling; see ``kvxfer.DecodeAgent``),
``kvxfer_transport`` (``"auto"``: UCX where both engines have it, else TCP; ``"tcp"``,
``"ucx"`` force one; the start-up log names the path, each pull's report and the
``vllm:kvxfer_pulls_ucx`` / ``_tcp`` and ``vllm:kvxfer_ucx_pulls{transports=...}`` series the
path taken), ``kvxfer_ucx_tls`` (UCX's transports, ``UCX_TLS`` syntax; default UCX's own
choice), ``kvxfer_device_direct`` (False; True: a CUDA cache registered as it is, see
above), ``kvxfer_cluster_key`` (hex; else ``KVXFER_CLUSTER_KEY``),
``kvxfer_kv_layout`` (default ``"auto"``: from the tensors' shapes and strides),
``kvxfer_decode_tp_size``, ``kvxfer_total_kv_heads``, ``kvxfer_host_staging`` (stage through
host memory even for a CPU cache), ``kvxfer_share_prompt`` (True: one shared prompt hand-off
per parallel-sampling parent; False: one lease per child). Different TP sizes and block sizes between prefill and
decode need caches whose blocks hold whole heads (HND) or MLA; see the table in
docs/src/guides/heterogeneous.md.

vLLM is imported lazily: without it this package still imports (the base classes fall back
to plain stand-ins).
"""

from __future__ import annotations

from typing import Any, Optional

from .common import HAVE_VLLM, Base, Settings, SupportsHMA, is_loopback, logger
from .metadata import KvxferConnectorMetadata, KvxferHandshakeMetadata
from .scheduler import KvxferScheduler
from .stats import KvxferConnectorStats, KvxferPromMetrics
from .worker import KvxferWorker

__all__ = [
    "HAVE_VLLM",
    "KvxferConnector",
    "KvxferConnectorMetadata",
    "KvxferConnectorStats",
    "KvxferHandshakeMetadata",
    "KvxferPromMetrics",
    "KvxferScheduler",
    "KvxferWorker",
]


def _is_scheduler(role: Any) -> bool:
    return getattr(role, "name", str(role)).upper().endswith("SCHEDULER")


class KvxferConnector(Base, SupportsHMA):
    """vLLM v1 KV connector over kvxfer (see the package docs)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._connector_metadata = None
        self.settings = Settings.from_vllm(vllm_config, kv_cache_config)
        # bad_params: malformed params (logged, never raised); no_own_handoff: forked decode
        # children without a hand-off of their own; handoff_taken: a lease another local
        # request already pulls; duplicate_pulls: the worker's refusals of a second pull of
        # one lease (load errors); misrouted: pull params sent to a kv_producer instance;
        # shared_children: prefill children whose blocks were freed at once because a sibling
        # holds the parent's shared prompt hand-off; shared_pulls: decode children given the
        # prompt KV a sibling's pull read (a local copy, nothing more on the wire);
        # shared_recomputed: decode children allocated after the sibling that read their
        # shared hand-off was gone (their prompt computed locally).
        self._counters = {
            "arm_failures": 0,
            "submit_failures": 0,
            "bad_params": 0,
            "no_own_handoff": 0,
            "handoff_taken": 0,
            "duplicate_pulls": 0,
            "misrouted": 0,
            "leases_expired": 0,
            "shared_children": 0,
            "shared_pulls": 0,
            "shared_recomputed": 0,
        }
        self.scheduler: Optional[KvxferScheduler] = None
        self.worker: Optional[KvxferWorker] = None
        if _is_scheduler(role):
            self.scheduler = KvxferScheduler(self.settings, self._counters)
        else:
            self.worker = KvxferWorker(self.settings, self._counters)
        if self.settings.is_producer and is_loopback(self.settings.host) and _is_scheduler(role):
            logger.warning(
                "kvxfer: hand-offs name %s, a loopback address: decode instances on other hosts cannot reach "
                "this prefill instance; set kvxfer_host in kv_connector_extra_config (or VLLM_HOST_IP)",
                self.settings.host,
            )

    @property
    def is_producer(self) -> bool:
        return self.settings.is_producer

    @property
    def is_consumer(self) -> bool:
        return self.settings.is_consumer

    def _sched(self) -> KvxferScheduler:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker-side connector")
        return self.scheduler

    def _work(self) -> KvxferWorker:
        if self.worker is None:
            raise RuntimeError("a worker-side call on the scheduler-side connector")
        return self.worker

    # ------------------------------------------------------------------ class-level hooks

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """No: the registered cache cannot follow sleep mode's remap yet."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        """HND when this instance's and the peer's TP sizes differ (head slices of a block
        must be contiguous); otherwise any layout registers."""
        config = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
        parallel = getattr(vllm_config, "parallel_config", None)
        tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        peer = extra.get("kvxfer_decode_tp_size") or extra.get("kvxfer_prefill_tp_size")
        if peer is not None and int(peer) != tp:
            return "HND"
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Any:
        return KvxferConnectorStats(data=data) if data is not None else KvxferConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> Any:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        if hasattr(super(), "bind_kv_cache_manager"):
            super().bind_kv_cache_manager(kv_cache_manager)  # type: ignore[misc]
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvxferConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        """``request_finished`` with one block list per KV-cache group (``SupportsHMA``)."""
        return self._sched().request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """Every group: a pull restores all of a request's KV-cache groups."""
        return tuple(range(self.settings.num_groups))

    def get_finished_count(self) -> Optional[int]:
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._sched().set_xfer_handshake_metadata(metadata)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._work().set_host_xfer_buffer_ops(copy_operation)

    def get_handshake_metadata(self) -> Optional[KvxferHandshakeMetadata]:
        return self._work().get_handshake_metadata()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata
        self._work().before_forward(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> Any:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._connector_metadata is not None:
            self._work().load(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: pulls land between steps (asynchronous loading)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing to save per layer: leases are armed once the step's forward is done."""

    def wait_for_save(self) -> None:
        if self._connector_metadata is not None:
            self._work().save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        worker = self._work()
        worker.run_pending(self._connector_metadata)
        return worker.get_finished(finished_req_ids, self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished`` plus the requests whose pull failed (``failed_recving``): vLLM
        takes a hybrid model's load failures only per request (block ids repeat across
        KV-cache groups)."""
        # Only vLLM versions with KVConnectorTransferResults call this hook.
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed = self._work().last_failed_recving
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed if self.settings.num_groups > 1 else set(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Any:
        """Transfers finished since the last call (vLLM's stats logger and ``/metrics``)."""
        worker = self.worker
        if worker is None or not (worker.transfers or worker.lease_ends or worker.leases_made):
            return None
        stats = KvxferConnectorStats()
        stats.record_made(worker.leases_made)
        worker.leases_made = 0
        for r in worker.transfers:
            stats.record(r)
        for kind in worker.lease_ends:
            stats.record_end(kind)
        worker.transfers.clear()
        worker.lease_ends.clear()
        return stats

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, Any]:
        """The agents' counters and the connector's own (for tests and monitoring)."""
        out: dict[str, Any] = dict(self._counters)
        if self.worker is not None and self.worker.prefill is not None:
            out["prefill"] = self.worker.prefill.stats()
        if self.worker is not None and self.worker.decode is not None:
            out["decode"] = self.worker.decode.stats()
        return out


