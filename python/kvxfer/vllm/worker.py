"""The connector's worker half: registers the KV cache, runs this rank's prefill and decode
agents, and applies each step's metadata at the point of the step vLLM intends.

- ``bind_connector_metadata`` (before the forward): retracts leases whose request will not
  hand them off, so their blocks can be reused by this very step.
- ``start_load_kv``: submits the step's pulls, cancels aborted ones, releases leases given
  up without pulling and heartbeats queued ones (asynchronous: vLLM keeps the requests
  waiting until ``get_finished`` reports them).
- ``wait_for_save`` (after the forward): arms the leases minted for this step's finished
  prompts — their blocks hold the prompt's KV now — copying them to the host buffer first
  when the cache is staged.
- ``get_finished``: ended leases (blocks back to vLLM) and finished pulls (copied into the
  device cache first when staged).

GPU caches are served through host staging (``kv_buffer_device: "cpu"``, as vLLM's own
NixlConnector does, and the fallback): a host copy of every layer is registered, vLLM's copy
op (``set_host_xfer_buffer_ops``) moves a prefill's blocks device→host before arming and a
decode's blocks host→device before reporting them loaded. With ``kvxfer_device_direct`` and
a UCX with CUDA transports, the CUDA cache is registered as it is (device memory: only UCX
moves it; ``BlockCopier`` copies siblings' blocks with torch on the device)."""

from __future__ import annotations

import ctypes
import inspect
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import kvxfer

from ..params import every_rank, rank_view
from .common import FORGET_AFTER, Settings, all_ids, int_or_none, logger, host_port, nested, rank_addresses
from .metadata import KvxferConnectorMetadata, KvxferHandshakeMetadata


def layout_tag(kv_layout: str, t: Any) -> str:
    """How a layer's bytes are ordered: the configured layout name and the tensor's
    dimensions (by position) from the largest stride to the smallest, e.g. ``auto:0,1,3,2``.
    Two caches with the same block sizes but another order (vLLM's LBNHC and LBHNC, NHD and
    HND) hold other bytes at the same offsets: a pull between them would be silent garbage."""
    shape = tuple(int(d) for d in t.shape)
    if hasattr(t, "stride") and callable(t.stride):
        strides = tuple(int(x) for x in t.stride())
    else:
        strides = tuple(int(x) for x in getattr(t, "strides", ()) or ())
    if len(strides) != len(shape):
        return f"{kv_layout}:?"
    dims = [i for i in range(len(shape)) if shape[i] > 1]
    order = sorted(dims, key=lambda i: (-strides[i], i))
    return f"{kv_layout}:{','.join(str(i) for i in order)}"


def same_order(a: str, b: str) -> bool:
    """Whether two ``layout_tag`` values order the dimensions both have alike (a dimension of
    size 1, e.g. heads split over TP ranks, has no order of its own)."""
    name_a, _, dims_a = a.partition(":")
    name_b, _, dims_b = b.partition(":")
    if name_a != name_b:
        return False
    if "?" in (dims_a, dims_b):
        return True
    la, lb = dims_a.split(","), dims_b.split(",")
    common = set(la) & set(lb)
    return [d for d in la if d in common] == [d for d in lb if d in common]



def _block_keys(local_blocks: Any) -> set[tuple[int, int]]:
    """(group, block id) of every block of a report's (or a reclaim's) local blocks: a flat
    list is group 0; a list of lists, one per KV-cache group."""
    if local_blocks and isinstance(local_blocks[0], (list, tuple)):
        return {(g, int(b)) for g, ids in enumerate(local_blocks) for b in ids}
    return {(0, int(b)) for b in local_blocks or ()}


class HeldLoads:
    """Decode requests whose pull ended ``failed_blocks_held``: a one-sided (UCX) read into
    their blocks could not be stopped, so vLLM must neither recompute into them nor free
    them yet. A request is ready (to be reported as a failed load) once the decode agent
    has reclaimed every one of its blocks (``DecodeAgent.poll_reclaimed``), matched by its
    parent and its (group, block) ids only — never by elimination, so no request is
    reported while a block of its own may still be written. Reclaimed blocks may come
    before their request's report; blocks no request claims are forgotten after
    ``FORGET_AFTER``, with a warning."""

    def __init__(self) -> None:
        # request id -> (the pull's parent, its (group, block) keys, its report, since).
        self._held: dict[str, tuple[str, set[tuple[int, int]], dict[str, Any], float]] = {}
        # parent -> (last reclaimed at, keys reclaimed and not yet matched).
        self._reclaimed: dict[str, tuple[float, set[tuple[int, int]]]] = {}
        self._warned: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._held or self._reclaimed)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, rid: str, report: dict[str, Any], now: float) -> None:
        """Request ``rid``'s pull reported ``failed_blocks_held`` (``report``)."""
        parent = str(report.get("parent_request_id", ""))
        self._held[rid] = (parent, _block_keys(report["local_blocks"]), report, now)

    def reclaimed(self, parent: str, local_blocks: Any, now: float) -> None:
        """The agent reclaimed ``local_blocks`` of a pull of ``parent``."""
        _, keys = self._reclaimed.get(parent, (now, set()))
        self._reclaimed[parent] = (now, keys | _block_keys(local_blocks))

    def ready(self, now: float) -> list[tuple[str, dict[str, Any]]]:
        """The held requests all of whose blocks are back, with their reports (forgotten
        here)."""
        out = []
        for rid, (parent, keys, report, since) in list(self._held.items()):
            freed = self._reclaimed.get(parent)
            if freed is None or not keys <= freed[1]:
                if now - since >= FORGET_AFTER and rid not in self._warned:
                    self._warned.add(rid)
                    logger.warning(
                        "kvxfer: the blocks of %s are still held after %.0f s: the read UCX could not stop "
                        "has not completed (the request waits for its KV until it does)",
                        rid,
                        now - since,
                    )
                continue
            freed[1].difference_update(keys)
            del self._held[rid]
            self._warned.discard(rid)
            logger.info("kvxfer: the blocks of %s are free again; reported as a failed load", rid)
            out.append((rid, report))
        for parent, (last, keys) in list(self._reclaimed.items()):
            if not keys:
                del self._reclaimed[parent]
            elif now - last >= FORGET_AFTER:
                logger.warning(
                    "kvxfer: %d reclaimed block(s) of %s matched no held request; forgotten", len(keys), parent
                )
                del self._reclaimed[parent]
        return out

class LayoutMismatch(ValueError):
    """The prefill's KV cache orders a block's bytes otherwise than this one."""


def _device_type(t: Any) -> str:
    device = getattr(t, "device", None)
    return str(getattr(device, "type", device or "cpu"))


def platform_copies_blocks() -> bool:
    """Whether vLLM's current platform implements the block copies its copy op calls."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return all(
        callable(getattr(current_platform, name, None)) for name in ("insert_blocks_to_device", "swap_out_blocks_to_host")
    )


class HostStaging:
    """Host copies of a device KV cache, and the copy op between the two."""

    def __init__(self, device_caches: dict[str, Any], group_layers: Optional[list[list[str]]]) -> None:
        import torch

        self.device = device_caches
        # Same shape and dtype per layer; block b of a layer is index b of its first dim,
        # which is what vLLM's copy op indexes. Layers sharing a tensor share the copy.
        shared: dict[tuple[Any, ...], Any] = {}
        self.host: dict[str, Any] = {}
        for name, t in device_caches.items():
            key = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key not in shared:
                shared[key] = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
            self.host[name] = shared[key]
        self.groups = group_layers or [list(device_caches)]
        self.copy_op: Optional[Callable[..., None]] = None

    def copy(self, block_ids: Any, direction: str) -> None:
        """Copies blocks (flat, or one list per KV-cache group) "d2h" or "h2d"."""
        lists = block_ids if nested(block_ids) else [block_ids]
        for names, ids in zip(self.groups, lists):
            ids = [int(b) for b in ids]
            if not ids:
                continue
            dev = {n: self.device[n] for n in names}
            host = {n: self.host[n] for n in names}
            src, dst = (dev, host) if direction == "d2h" else (host, dev)
            if self.copy_op is not None:
                self.copy_op(src, dst, ids, ids, direction)
            else:
                self._index_copy(src, dst, ids)

    @staticmethod
    def _index_copy(src: dict[str, Any], dst: dict[str, Any], ids: list[int]) -> None:
        import torch

        for name, s in src.items():
            d = dst[name]
            index = torch.tensor(ids, dtype=torch.long, device=s.device)
            d[index.to(d.device)] = s[index].to(d.device)


class BlockCopier:
    """Copies whole blocks inside the registered KV cache: every byte a block owns in every
    layer (the segments ``kv_cache_segments`` finds), block ``src`` to block ``dst``. How a
    decode child gets the prompt KV a sibling's pull of their shared hand-off read, with
    nothing more on the wire. Host memory is copied by numpy; a CUDA cache registered as it
    is (``on_device``) by torch on its device — the CPU never touches device memory."""

    def __init__(self, groups: list[list[Any]], storages: Optional[dict[int, Any]] = None) -> None:
        import numpy as np

        # The segments keep their buffers alive (the registered cache's tensors).
        self.segments = groups
        self.on_device = storages is not None
        # Per KV-cache group, per segment: its blocks as the rows of a byte matrix over the
        # buffer (block b is ``block_bytes`` bytes at ``offset + b * stride``).
        self.groups: list[list[Any]] = []
        for segments in groups:
            views = []
            for seg in segments:
                rows = (seg.length - seg.offset - seg.block_bytes) // seg.stride + 1 if seg.stride else 1
                if storages is not None:
                    # A uint8 tensor over the whole storage the segment lies in, on its device.
                    flat = storages[seg.address]
                    views.append(flat.as_strided((rows, seg.block_bytes), (seg.stride, 1), seg.offset))
                    continue
                buffer = np.frombuffer((ctypes.c_uint8 * seg.length).from_address(seg.address), dtype=np.uint8)
                first = buffer[seg.offset :]
                views.append(
                    np.lib.stride_tricks.as_strided(first, shape=(rows, seg.block_bytes), strides=(seg.stride, 1))
                )
            self.groups.append(views)

    @classmethod
    def over(cls, kv_caches: dict[str, Any], settings: Settings, on_device: bool = False) -> "BlockCopier":
        """A copier over the cache as ``KvxferWorker`` registers it; ``on_device``: torch
        copies on the tensors' device (a CUDA cache registered as it is)."""
        from ..kvcache import kv_cache_segments

        groups = settings.group_layers or [list(kv_caches)]
        out = []
        for names in groups:
            caches = {n: kv_caches[n] for n in names if n in kv_caches}
            segments, _, _, _ = kv_cache_segments(
                caches, kv_layout=settings.kv_layout, num_blocks=settings.num_blocks, block_size=settings.block_size or None
            )
            out.append(segments)
        storages = None
        if on_device:
            import torch

            # Each segment's buffer is a whole tensor storage (kv_cache_segments registers the
            # storage a tensor lies in), named by its start address.
            storages = {}
            for t in kv_caches.values():
                storage = t.untyped_storage()
                flat = torch.empty(0, dtype=torch.uint8, device=t.device)
                flat.set_(storage, 0, (storage.nbytes(),), (1,))
                storages[int(storage.data_ptr())] = flat
        return cls(out, storages)

    def copy(self, group: int, pairs: list[tuple[int, int]]) -> None:
        """Copies block ``src`` onto block ``dst`` for each ``(src, dst)`` of ``group`` (one
        indexed copy per segment; the sources are read before any destination is written)."""
        import numpy as np

        pairs = [(s, d) for s, d in pairs if s != d]
        if not pairs:
            return
        if self.on_device:
            import torch

            devices = set()
            for rows in self.groups[group]:
                src_t = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=rows.device)
                dst_t = torch.tensor([d for _, d in pairs], dtype=torch.long, device=rows.device)
                rows[dst_t] = rows[src_t]
                devices.add(rows.device)
            # The copy is done when the request is reported loaded: wait for the device.
            for device in devices:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            return
        src = np.array([s for s, _ in pairs], dtype=np.intp)
        dst = np.array([d for _, d in pairs], dtype=np.intp)
        for rows in self.groups[group]:
            rows[dst] = rows[src]


class KvxferWorker:
    """Worker-side state and hooks (one per vLLM worker process, i.e. per TP rank)."""

    def __init__(self, settings: Settings, counters: dict[str, int]) -> None:
        self.s = settings
        self.counters = counters
        self.prefill: Optional[kvxfer.PrefillAgent] = None
        self.decode: Optional[kvxfer.DecodeAgent] = None
        # How bytes are ordered inside a block (see layout_tag).
        self.layout = ""
        # The KV shape this rank states (None: the cache's blocks do not hold whole heads).
        self.kv_shape: Optional[kvxfer.KvShape] = None
        self.staging: Optional[HostStaging] = None
        # A CUDA cache registered as it is (device memory: UCX only, no host copy).
        self.device_registered = False
        self._phases: dict[str, int] = {"retract": -1, "load": -1, "save": -1}
        # lease id (remote_request_id) -> the vLLM request it holds blocks of.
        self._lease_rid: dict[str, str] = {}
        # Requests whose lease is armed (until it ends).
        self._armed: set[str] = set()
        # Leases that ended before vLLM said their request finished (request id -> ended
        # at): kept until it does, forgotten after FORGET_AFTER.
        self._ended: OrderedDict[str, float] = OrderedDict()
        # Requests vLLM said finished whose leases are still armed (or to be armed this
        # step), with when it said so: kept until the lease ends, however late (every armed
        # lease ends, by expiry at the latest); one whose lease was never armed after all is
        # forgotten after FORGET_AFTER.
        self._finished_seen: dict[str, float] = {}
        # Local request id -> (its pull, its child index there), for cancels.
        self._pulls: dict[str, tuple[kvxfer.Pull, int]] = {}
        # (pull id, child index) -> local request id: where a report goes.
        self._by_child: dict[tuple[int, int], str] = {}
        # remote_request_id -> the local request whose pull reads it (one at most).
        self._pulling: dict[str, str] = {}
        # A shared prompt hand-off (``kvxfer_shared``) named by several local requests is
        # read once, by the first (the primary); the others follow: remote_request_id ->
        # (request id, local blocks) of each, given a copy of the primary's blocks when its
        # pull is done.
        self._followers: dict[str, list[tuple[str, Any]]] = {}
        # Primaries' pulls: request id -> the local blocks pulled into.
        self._pulled: dict[str, Any] = {}
        # Shared hand-offs pulled, while the primary's blocks live: remote_request_id ->
        # the primary's request id (a sibling scheduled later copies from its blocks).
        self._served: dict[str, str] = {}
        # Primaries aborted while siblings follow their pull: not cancelled, freed once done.
        self._aborted_primaries: set[str] = set()
        # Requests named gone (finished, preempted) while their pull ran.
        self._gone_pulling: set[str] = set()
        self.copier: Optional[BlockCopier] = None
        self._load_errors: set[int] = set()
        self._done_recving: set[str] = set()
        # Requests whose pull failed (reported in vLLM's failed_recving as well): gathered,
        # then those of the last get_finished.
        self._failed_recving: set[str] = set()
        self.last_failed_recving: set[str] = set()
        # Requests whose pull ended failed_blocks_held, reported once their blocks are back.
        self._held = HeldLoads()
        # Finished pulls and lease ends since vLLM last read the stats.
        self.transfers: list[dict[str, Any]] = []
        self.lease_ends: list[str] = []
        self.leases_made = 0

    # ------------------------------------------------------------------ start-up

    def tp_rank(self) -> int:
        if "kvxfer_tp_rank" in self.s.extra:
            return int(self.s.extra["kvxfer_tp_rank"])
        try:  # pragma: no cover - needs vLLM's parallel state
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no vLLM, or its groups are not initialized
            return 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Registers the KV cache (host memory, or a host copy of a device cache) and starts
        the agents of this rank."""
        devices = {_device_type(t) for t in kv_caches.values()}
        on_device = devices - {"cpu"}
        staging_asked = self.s.kv_buffer_device == "cpu" or self.s.host_staging
        if on_device - {"cuda"} and not staging_asked:
            raise kvxfer.RegistrationError(
                f"kvxfer: the KV cache is on {', '.join(sorted(on_device))} memory, which kvxfer's data paths "
                f"do not read directly here; set \"kv_buffer_device\": \"cpu\" in --kv-transfer-config "
                f"(host staging: blocks are copied through a registered host buffer; kv_buffer_device is "
                f"{self.s.kv_buffer_device!r} now)"
            )
        if on_device or self.s.host_staging:
            why = self._why_staged(on_device)
            if why is None:
                self.device_registered = True
                logger.info("kvxfer: the CUDA KV cache is registered as it is: UCX reads and writes its blocks, no host copy")
            else:
                if on_device and not staging_asked:
                    logger.warning("kvxfer: staging the %s KV cache through host memory: %s", "/".join(sorted(on_device)), why)
                self.staging = HostStaging(dict(kv_caches), self.s.group_layers)
                kv_caches = self.staging.host
        rank = self.tp_rank()
        first = next(iter(kv_caches.values()), None)
        if first is not None:
            self.layout = layout_tag(self.s.kv_layout, first)
        shape = self.kv_shape = self._kv_shape(kv_caches, rank)
        common = dict(
            engine_id=self.s.engine_id,
            rank=rank,
            kv_shape=shape,
            cluster_key=self.s.cluster_key,
            io_timeout=self.s.io_timeout,
            worker_threads=self.s.worker_threads,
            transport=self.s.transport,
            ucx_tls=self.s.ucx_tls,
        )
        if self.s.is_producer:
            listen, advertise = rank_addresses(self.s, rank)
            self.prefill = kvxfer.PrefillAgent(
                self._memory(kv_caches),
                host_port(listen, self.s.port_of(rank)),
                agent_name=f"vllm-prefill-{rank}",
                tp_size=self.s.tp_size,
                advertise_host=advertise,
                lease_ttl=self.s.lease_ttl,
                arm_wait=self.s.arm_wait,
                **common,
            )
        if self.s.is_consumer:
            self.copier = BlockCopier.over(kv_caches, self.s, on_device=self.device_registered)
            self.decode = kvxfer.DecodeAgent(
                self._memory(kv_caches),
                agent_name=f"vllm-decode-{rank}",
                queue_reports=True,
                notify_with_read=self.s.notify_with_read,
                **common,
            )
        self._log_data_path()

    def _why_staged(self, on_device: set[str]) -> Optional[str]:
        """None when a device (CUDA) cache is registered directly with UCX; else why it is
        staged through host memory (asked for, or UCX cannot read CUDA memory here)."""
        if not on_device:
            return "kvxfer_host_staging is set"
        if self.s.host_staging or self.s.kv_buffer_device == "cpu":
            return "asked for (kv_buffer_device \"cpu\" or kvxfer_host_staging)"
        if not self.s.device_direct:
            return (
                "registering a CUDA cache as it is (UCX's CUDA transports, no host copy) is opt-in until it has "
                "run on a GPU: kvxfer_device_direct: true"
            )
        if self.s.transport == "tcp":
            return "kvxfer_transport is \"tcp\" (only UCX reads device memory)"
        info = kvxfer.ucx_info(self.s.ucx_tls)
        if not info.get("built") or not info.get("usable"):
            return f"UCX is not usable here: {info.get('error') or 'this kvxfer is built without UCX'}"
        cuda = [t for t in info.get("transports") or () if t.startswith(("cuda_copy/", "cuda_ipc/", "gdr_copy/"))]
        if not cuda:
            return f"the loaded UCX finds no CUDA transport (it has {', '.join(info.get('transports') or ()) or 'none'})"
        return None

    def _log_data_path(self) -> None:
        """Says at start-up which data path this rank's agents use, and from which memory."""
        if self.staging is not None:
            memory = "a host copy of the device cache (host staging)"
        elif self.device_registered:
            memory = "the CUDA KV cache as it is (device memory)"
        else:
            memory = "the KV cache"
        if self.s.transport == "tcp":
            logger.info("kvxfer: data path TCP (kvxfer_transport=tcp), reading %s", memory)
            return
        started = [a.offers_ucx for a in (self.prefill,) if a is not None]
        started += [a.has_ucx for a in (self.decode,) if a is not None]
        info = kvxfer.ucx_info(self.s.ucx_tls)
        if started and all(started):
            logger.info(
                "kvxfer: data path UCX %s (libucp %s from %s), registered over %s; TCP where a peer has no UCX",
                ",".join(info.get("transports") or []) or "(transports unknown)",
                info.get("loaded_version"),
                info.get("library") or info.get("loaded_from"),
                memory,
            )
        else:
            logger.warning(
                "kvxfer: UCX did not start (%s); data path TCP (kvxfer_transport=%s)",
                info.get("error") or ("this kvxfer is built without UCX" if not info.get("built") else "see the log"),
                self.s.transport,
            )

    def _memory(self, kv_caches: dict[str, Any]) -> kvxfer.Memory:
        kwargs: dict[str, Any] = {"kv_layout": self.s.kv_layout, "groups": self.s.group_layers}
        accepted = inspect.signature(kvxfer.kv_cache_memory).parameters
        if "num_blocks" in accepted and self.s.num_blocks:
            kwargs["num_blocks"] = self.s.num_blocks
        if "block_size" in accepted and self.s.block_size:
            kwargs["block_size"] = self.s.block_size
        return kvxfer.kv_cache_memory(kv_caches, **kwargs)

    def _kv_shape(self, kv_caches: dict[str, Any], rank: int) -> Optional[kvxfer.KvShape]:
        """This rank's KV shape (TP size and rank, KV heads; head dim, dtype and block size
        come from the registered memory), from vLLM's parallel and model config. Only for
        caches whose blocks hold whole heads, heads outermost (vLLM's LBHNC/HND layouts, the
        CPU build's, MLA): in an NHD layout a head slice of a block is not contiguous, so no
        shape is stated and the TP sizes must match (rank r pulls from rank r)."""
        model = self.s.model_config
        layout = self.s.kv_layout
        mla = bool(getattr(model, "use_mla", False)) or layout == "mla"
        caches = kv_caches
        if self.s.group_layers is not None:
            caches = {n: kv_caches[n] for n in self.s.group_layers[0] if n in kv_caches}
        kwargs: dict[str, Any] = {"kv_layout": layout}
        if self.s.num_blocks:
            kwargs["num_blocks"] = self.s.num_blocks
        try:
            heads, _ = kvxfer.kv_cache_heads(caches, **kwargs)
        except kvxfer.RegistrationError as e:
            if mla:
                raise
            logger.info("kvxfer: no KV shape stated (%s); prefill and decode TP sizes must match", e)
            return None
        if mla:
            return kvxfer.KvShape(tp_size=self.s.tp_size, tp_rank=rank, attention="mla")
        total = self.s.extra.get("kvxfer_total_kv_heads")
        if total is None and hasattr(model, "get_total_num_kv_heads"):
            total = model.get_total_num_kv_heads()
        if total is None:
            total = heads * self.s.tp_size  # as many heads as ranks or more: an even split
        return kvxfer.KvShape(tp_size=self.s.tp_size, tp_rank=rank, total_kv_heads=int(total))

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """vLLM's block-copy op between device and host caches, used when staged. vLLM's CPU
        platform has none (its caches never need staging): when staging is forced there the
        copy is done with torch indexing, as vLLM's GPU platforms do it."""
        if self.staging is None:
            return
        if platform_copies_blocks():
            self.staging.copy_op = copy_operation
        else:
            logger.info("kvxfer: this vLLM platform has no block-copy ops; staging copies with torch")

    def get_handshake_metadata(self) -> Optional[KvxferHandshakeMetadata]:
        """This rank's prefill agent (address, incarnation), for the scheduler side."""
        if self.prefill is None:
            return None
        host, port = self.prefill.address
        return KvxferHandshakeMetadata(self.tp_rank(), host, port, self.prefill.incarnation, self.layout)

    # ------------------------------------------------------------------ per step

    def _once(self, meta: Any, phase: str) -> bool:
        """Whether ``phase`` of ``meta``'s step is still to run (each runs once)."""
        step = getattr(meta, "step", None)
        if not isinstance(meta, KvxferConnectorMetadata) or step is None or step <= self._phases[phase]:
            return False
        self._phases[phase] = step
        return True

    def before_forward(self, meta: Any) -> None:
        """Retracts leases whose request will not hand them off (before their blocks can be
        reused by this step's forward)."""
        if not self._once(meta, "retract") or self.prefill is None:
            return
        rank = self.tp_rank()
        for entry in meta.to_retract:
            # (vLLM request id, minted params); the request no longer waits for this lease:
            # forget everything about it, whether the lease is live or already ended (an
            # ended lease must not be reported for a request vLLM freed, or for its re-mint).
            rid, params = entry if isinstance(entry, tuple) else (None, entry)
            lease = str(params.get("remote_request_id"))
            rid = self._lease_rid.pop(lease, None) or rid
            if rid is not None:
                self._armed.discard(rid)
                self._finished_seen.pop(rid, None)
                self._ended.pop(rid, None)
            try:
                self.prefill.cancel(rank_view(params, rank))
            except kvxfer.KvxferError as e:
                logger.warning("kvxfer: retracting the lease %s: %s", lease, e)

    def load(self, meta: Any) -> None:
        """Submits the step's pulls, cancels, releases and heartbeats (decode side)."""
        if not self._once(meta, "load") or self.decode is None:
            return
        rank = self.tp_rank()
        for rid in getattr(meta, "gone", ()):
            # A primary finished or preempted: its blocks may be given to others from now —
            # unless its pull still runs (an abort): vLLM holds them until the pull reports,
            # and the report gives the followers their copy first.
            if rid in self._pulls:
                self._gone_pulling.add(rid)  # never a source once its pull reports
                continue
            self._pulled.pop(rid, None)
            for remote in [r for r, primary in self._served.items() if primary == rid]:
                del self._served[remote]
        self._submit(meta.to_recv, rank)
        for rid in meta.to_cancel:
            if self._unfollow(rid):
                continue
            pull = self._pulls.get(rid)
            if pull is None:
                continue
            remote = next((r for r, primary in self._pulling.items() if primary == rid), None)
            if remote is not None and self._followers.get(remote):
                # Siblings wait for this pull: it goes on, this request's blocks are freed
                # once it is done (a child's abort never ends the read for the others).
                self._aborted_primaries.add(rid)
                continue
            pull[0].cancel_child(pull[1])
        if meta.to_release:
            self._release([v for p in meta.to_release for v in self._given_back(p, rank)])
        if meta.heartbeats:
            beats = [v for p in meta.heartbeats for v in self._views_or_none(p, rank)]
            if beats:
                self._each_or_alone(self.decode.heartbeat, beats, "heartbeating")

    def save(self, meta: Any) -> None:
        """Arms the leases minted for this step's finished prompts (after the forward)."""
        if not self._once(meta, "save") or self.prefill is None:
            return
        rank = self.tp_rank()
        for rid, params in meta.to_arm.items():
            lease = str(params.get("remote_request_id"))
            try:
                if self.staging is not None:
                    self.staging.copy(params.get("remote_block_ids") or [], "d2h")
                self.prefill.arm(rank_view(params, rank))
                self.leases_made += 1
                logger.debug("kvxfer: armed %s (lease %s, blocks %s)", rid, lease, params.get("remote_block_ids"))
                self._armed.add(rid)
                self._lease_rid[lease] = rid
            except kvxfer.KvxferError as e:
                self.counters["arm_failures"] += 1
                logger.error("kvxfer: arming the lease of %s failed: %s", rid, e)
                kind = getattr(e, "kind", None)
                if kind == "already_leased":
                    # A lease of this id exists and may be read: the blocks go back when
                    # it ends (its end carries this id).
                    self._armed.add(rid)
                    self._lease_rid[lease] = rid
                elif kind != "token_reused":
                    # No lease holds the blocks: hand them back at once. (token_reused: this
                    # very lease was armed and has ended already, and reported.)
                    self._ended[rid] = time.monotonic()
                else:
                    self._finished_seen.pop(rid, None)

    def run_pending(self, meta: Any) -> None:
        """The retract and load phases of ``meta`` if not run yet (a host that skipped a
        hook). Never the arm phase: with a deferred finalize (speculative decoding) vLLM
        asks for finished transfers before ``wait_for_save`` and the draft model's forward,
        and a lease armed then would publish blocks not yet fully written."""
        if meta is not None:
            self.before_forward(meta)
            self.load(meta)

    # ------------------------------------------------------------------ decode helpers

    def block_ratio(self, params: dict[str, Any]) -> int:
        """Prefill blocks per local block: 1 unless the hand-off states another block size
        (``kvxfer_block_size``) that divides this instance's."""
        theirs = params.get("kvxfer_block_size")
        mine = self.s.block_size
        if theirs is None or not mine:
            return 1
        if int_or_none(theirs) is None or theirs < 1:
            raise TypeError(f"kvxfer_block_size is {theirs!r}, not a positive int")
        if mine < theirs or mine % theirs:
            raise ValueError(f"block size: decode {mine} is not a multiple of prefill {theirs} tokens per block")
        return mine // theirs

    def views(self, params: dict[str, Any], rank: int) -> list[dict[str, Any]]:
        """The hand-offs decode rank ``rank`` pulls for ``params``: prefill rank ``rank``'s
        when the TP and block sizes match (rank r pulls from rank r); every prefill rank's,
        in rank order, when they differ (``DecodeAgent.submit_ranks`` reads this rank's head
        slices from the ranks that hold them, ``k`` remote blocks into each local one)."""
        prefill_tp = int_or_none(params.get("tp_size") or 1)
        if prefill_tp is None or prefill_tp < 1:
            raise TypeError(f"tp_size is {params.get('tp_size')!r}, not a positive int")
        theirs = params.get("kvxfer_kv_layout")
        if isinstance(theirs, str) and self.layout and not same_order(theirs, self.layout):
            raise LayoutMismatch(
                f"the KV caches order a block's bytes differently: prefill {theirs}, decode {self.layout} "
                "(layout name: dimensions from the largest stride); run both engines with the same "
                "VLLM_KV_CACHE_LAYOUT and attention backend (and kvxfer_kv_layout)"
            )
        ratio = self.block_ratio(params)
        if prefill_tp == self.s.tp_size and ratio == 1:
            return [rank_view(params, rank)]
        if self.kv_shape is None:
            raise ValueError(
                f"prefill TP size {prefill_tp} and decode TP size {self.s.tp_size} (block ratio {ratio}): pulling "
                "head slices needs the KV shape, stated only for caches whose blocks hold whole heads, heads "
                "outermost (VLLM_KV_CACHE_LAYOUT=LBHNC, vLLM's HND; kvxfer_kv_layout \"kv_first_hnd\" or "
                "\"blocks_first_hnd\" for 5-D caches) and MLA"
            )
        ports = params.get("kvxfer_rank_ports")
        if prefill_tp > 1 and not (isinstance(ports, list) and len(ports) >= prefill_tp):
            raise ValueError(f"the params do not list the ports of all {prefill_tp} prefill ranks (kvxfer_rank_ports)")
        return [rank_view(params, r) for r in range(prefill_tp)]

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
                self.counters["bad_params"] += 1
                logger.error("kvxfer: %s the lease of %s failed: %s", what, p.get("remote_request_id"), e)

    def _given_back(self, params: dict[str, Any], rank: int) -> list[dict[str, Any]]:
        """The leases decode rank ``rank`` gives back for a hand-off it will not pull, whether
        or not it could pull it: prefill ranks ``r`` with ``r % tp_size == rank`` (with equal
        TP sizes, its own rank's), so each prefill rank's lease is given back by one decode
        rank. A release needs no matching layout (``DecodeAgent.release`` falls back to a
        control-only connection)."""
        tp = max(self.s.tp_size, 1)
        return [v for r, v in enumerate(every_rank(params)) if r % tp == rank]

    def _views_or_none(self, params: dict[str, Any], rank: int) -> list[dict[str, Any]]:
        """``views``, or none (logged and counted) for params that cannot be used."""
        try:
            return self.views(params, rank)
        except (ValueError, TypeError) as e:
            self.counters["bad_params"] += 1
            logger.error("kvxfer: the params of %s cannot be used: %s", params.get("remote_request_id"), e)
            return []

    def _release(self, params: list[dict[str, Any]]) -> None:
        """Leases given up without pulling (aborted requests, full local prefix hits):
        released now (``DecodeAgent.release``, not waited for) so the prefill side frees the
        blocks at once instead of at the lease's expiry."""
        if params and self.decode is not None:
            self._each_or_alone(self.decode.release, params, "releasing")

    def _submit(self, to_recv: dict[str, tuple[dict[str, Any], Any]], rank: int) -> None:
        """Submits the step's pulls, children of one parent on one prefill agent together
        (one ``submit_ranks`` over every prefill rank when the TP sizes differ)."""
        assert self.decode is not None
        groups: dict[tuple[Any, ...], list[tuple[str, list[dict[str, Any]], Any, int, Any]]] = {}
        # Hand-offs given back, once the whole step is submitted: a shared one that a
        # sibling later in this step reads is not released under it.
        give_back: list[dict[str, Any]] = []
        for rid, (params, local) in to_recv.items():
            if not all_ids(local):
                # Every block was found in the local prefix cache: nothing to pull. (A shared
                # hand-off is given back by the scheduler once every sibling has settled.)
                if not params.get("kvxfer_shared"):
                    give_back.append(params)
                self._done_recving.add(rid)
                continue
            try:
                views = self.views(params, rank)
                p = views[0]
                remote_id = str(p.get("remote_request_id"))
                holder = self._pulling.get(remote_id) or self._served.get(remote_id)
                if holder is not None and not p.get("kvxfer_shared"):
                    # Two local requests would pull one lease: only one can, the other's
                    # blocks would never be written. vLLM recomputes (or fails) this one.
                    self.counters["duplicate_pulls"] += 1
                    self._fail(rid, local, f"cannot pull {rid}: local request {holder} already pulls {remote_id}")
                    continue
                child_index = int_or_none(p.get("kvxfer_child_index") or 0)
                if child_index is None:
                    raise TypeError(f"kvxfer_child_index is {p.get('kvxfer_child_index')!r}, not an int")
                ratio = self.block_ratio(p)
                remote, pulled_into = pulled_blocks(
                    self.s.num_groups, p.get("remote_block_ids"), local, ratio, p.get("kvxfer_skipped_blocks") or 0
                )
                if not all_ids(pulled_into):
                    # Every local block lies outside the prefill side's sliding window:
                    # given back once the step is submitted, unless another local request
                    # reads the same hand-off.
                    give_back.append(params)
                    self._done_recving.add(rid)
                    continue
                views = [dict(v, remote_block_ids=remote) for v in views]
                hetero = len(views) > 1 or ratio != 1 or int(p.get("tp_size") or 1) != self.s.tp_size
                if holder is not None:
                    self._follow(rid, remote_id, pulled_into, local)
                    continue
            except (LayoutMismatch, ValueError, TypeError) as e:
                # Never pullable here (layouts, block sizes, TP sizes without a KV shape, bad
                # params): the lease is given back now rather than at its expiry.
                give_back.append(params)
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
                    pull = self.decode.submit([m[1][0] for m in members], [m[4] for m in members])
                else:
                    ranks = [[m[1][r] for m in members] for r in range(num_ranks)]
                    pull = self.decode.submit_ranks(ranks, [m[4] for m in members])
            except kvxfer.KvxferError as e:
                for rid, views, local, _, _ in members:
                    remote_id = str(views[0].get("remote_request_id"))
                    self._pulling.pop(remote_id, None)
                    self._fail(rid, local, f"cannot pull {rid}: {e}")
                    self._settle_followers(remote_id, None, f"the pull of the shared hand-off failed: {e}")
                continue
            logger.debug("kvxfer: pull %s submitted for %s", pull.id, [m[0] for m in members])
            for rid, views, _, child_index, pulled_into in members:
                self._pulls[rid] = (pull, child_index)
                self._by_child[(pull.id, child_index)] = rid
                if views[0].get("kvxfer_shared"):
                    self._pulled[rid] = pulled_into
        for params in give_back:
            # Unless another local request reads the same hand-off (a shared one).
            remote_id = str(params.get("remote_request_id"))
            if remote_id not in self._pulling and remote_id not in self._served:
                self._release(self._given_back(params, rank))

    def _follow(self, rid: str, remote_id: str, local: Any, allocated: Any) -> None:
        """Local request ``rid`` names shared hand-off ``remote_id``, which another local
        request pulls (or pulled): it gets a copy of that request's blocks, nothing more
        crosses the wire."""
        if remote_id in self._pulling:
            self._followers.setdefault(remote_id, []).append((rid, local))
            return
        why = self._copy_from(self._served[remote_id], rid, local)
        if why is not None:
            self._fail(rid, allocated, f"cannot give {rid} the shared hand-off {remote_id}: {why}")

    def _unfollow(self, rid: str) -> bool:
        """Drops follower ``rid`` (aborted): reported done at once, its blocks freed."""
        for remote_id, followers in self._followers.items():
            for i, f in enumerate(followers):
                if f[0] == rid:
                    del followers[i]
                    if not followers:
                        del self._followers[remote_id]
                    self._done_recving.add(rid)
                    return True
        return False

    def _copy_from(self, primary: str, rid: str, local: Any) -> Optional[str]:
        """Copies the blocks primary request ``primary`` pulled into ``rid``'s ``local``
        blocks, aligned from the end (per group: both lists end with the prompt's last
        block; a head found in one request's prefix cache is not pulled into it); None when
        done, else why not."""
        theirs = self._pulled.get(primary)
        if theirs is None or self.copier is None:
            return f"local request {primary} no longer holds the blocks it pulled"
        groups = list(zip(theirs, local)) if self.s.num_groups > 1 else [(theirs, local)]
        plans = []
        for src, dst in groups:
            src, dst = [int(b) for b in src], [int(b) for b in dst]
            if len(dst) > len(src):
                return f"local request {primary} pulled {len(src)} blocks, {rid} needs {len(dst)}"
            plans.append(list(zip(src[len(src) - len(dst) :], dst)))
        for g, pairs in enumerate(plans):
            self.copier.copy(g, pairs)
        if self.staging is not None:
            self.staging.copy(local, "h2d")
        self.counters["shared_pulls"] += 1
        self._done_recving.add(rid)
        return None

    def _settle_followers(self, remote_id: str, primary: Optional[str], failed: Optional[str]) -> None:
        """The followers of a shared hand-off's pull, once it ended: each given a copy of
        ``primary``'s blocks, or failed (``failed``: why) — vLLM's load-failure policy."""
        for rid, local in self._followers.pop(remote_id, []):
            why = failed if failed is not None else self._copy_from(str(primary), rid, local)
            if why is not None:
                self.counters["submit_failures"] += 1
                logger.error("kvxfer: cannot give %s the shared hand-off %s: %s", rid, remote_id, why)
                self._load_errors.update(all_ids(local))
                self._failed_recving.add(rid)
                self._done_recving.add(rid)

    def _fail(self, rid: str, local: Any, why: str) -> None:
        self.counters["submit_failures"] += 1
        logger.error("kvxfer: %s", why)
        self._load_errors.update(all_ids(local))
        self._failed_recving.add(rid)
        self._done_recving.add(rid)

    # ------------------------------------------------------------------ completions

    def get_finished(
        self, finished_req_ids: set[str], meta: Any = None
    ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Ended leases of requests vLLM said finished (``finished_sending``) and finished
        pulls (``finished_recving``). ``meta`` is the step's bound metadata: with a
        speculative config vLLM asks before ``wait_for_save`` (a deferred finalize), so the
        leases this step arms afterwards — minted in ``request_finished``, for requests
        this very call names finished — count as armed here."""
        sending: set[str] = set()
        if self.prefill is not None:
            now = time.monotonic()
            to_arm: dict[str, Any] = {}
            if isinstance(meta, KvxferConnectorMetadata) and meta.step is not None and meta.step > self._phases["save"]:
                to_arm = meta.to_arm
            for rid in finished_req_ids or ():
                if rid in self._armed or rid in self._ended or rid in to_arm:
                    self._finished_seen.setdefault(rid, now)
            for end in self.prefill.poll_ends():
                self.lease_ends.append(end["kind"])
                rid = self._lease_rid.pop(end["remote_request_id"], None)
                if rid is None:
                    continue  # a retracted lease: its request never waited for it
                if end["kind"] == "expired":
                    self.counters["leases_expired"] += 1
                    logger.warning("kvxfer: the lease of %s expired before every consumer pulled it", rid)
                self._armed.discard(rid)
                self._ended[rid] = now
            for rid in list(self._ended):
                if rid in self._finished_seen:
                    sending.add(rid)
                    del self._ended[rid]
                    del self._finished_seen[rid]
            # In the order vLLM said so: only the entries older than FORGET_AFTER are looked at.
            stale = []
            for rid, since in self._finished_seen.items():
                if now - since < FORGET_AFTER:
                    break
                if rid not in self._armed and rid not in self._ended:
                    stale.append(rid)
            for rid in stale:
                del self._finished_seen[rid]
            while self._ended:
                oldest, since = next(iter(self._ended.items()))
                if now - since < FORGET_AFTER:
                    break
                del self._ended[oldest]
        if self.decode is not None:
            for r in self.decode.poll_reports():
                rid = self._by_child.pop((r["pull"], r["child_index"]), None)
                if rid is None:
                    continue
                self._pulls.pop(rid, None)
                remote_id = r["remote_request_id"]
                if self._pulling.get(remote_id) == rid:
                    del self._pulling[remote_id]
                held = r["outcome"] == "failed_blocks_held"
                failed = r["outcome"] == "failed" or held
                if held:
                    # Not reported to vLLM yet: it would recompute into (or reuse) blocks a
                    # read may still write. Reported once the agent reclaims them.
                    logger.warning(
                        "kvxfer: pulling %s failed (advice=%s): %s; its blocks stay held until the read "
                        "that could not be stopped completes",
                        rid,
                        r["error"].advice,
                        r["error"],
                    )
                    self._held.hold(rid, r, time.monotonic())
                elif failed:
                    logger.warning("kvxfer: pulling %s failed (advice=%s): %s", rid, r["error"].advice, r["error"])
                    self._load_errors.update(all_ids(r["local_blocks"]))
                    self._failed_recving.add(rid)
                elif self.staging is not None:
                    self.staging.copy(r["local_blocks"], "h2d")
                # Siblings naming the same shared hand-off get a copy of what it read.
                done = r["outcome"] == "done"
                why = None if done else f"its pull by {rid} ended {r['outcome']}: {r.get('error')}"
                self._settle_followers(remote_id, rid, why)
                gone = rid in self._gone_pulling or rid in self._aborted_primaries
                self._gone_pulling.discard(rid)
                self._aborted_primaries.discard(rid)
                if gone:
                    self._pulled.pop(rid, None)
                elif done and rid in self._pulled and self.s.stable_blocks:
                    # Siblings scheduled later copy from its blocks while it lives — only
                    # where vLLM never frees a live request's blocks (no sliding window or
                    # state blocks, which vLLM frees or rewrites as the request runs).
                    self._served[remote_id] = rid
                else:
                    self._pulled.pop(rid, None)
                self.transfers.append(r)
                if not held:
                    self._done_recving.add(rid)
            if self._held:
                now = time.monotonic()
                for rec in self.decode.poll_reclaimed():
                    self._held.reclaimed(rec["parent_request_id"], rec["local_blocks"], now)
                for rid, r in self._held.ready(now):
                    # Every block is back: a failed load, vLLM's load-failure policy applies.
                    self._load_errors.update(all_ids(r["local_blocks"]))
                    self._failed_recving.add(rid)
                    self._done_recving.add(rid)
        recving, self._done_recving = self._done_recving, set()
        self.last_failed_recving, self._failed_recving = self._failed_recving, set()
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed pulls — for one KV-cache group only: block ids repeat across
        groups, so vLLM takes a hybrid model's failures per request (failed_recving)."""
        errors, self._load_errors = self._load_errors, set()
        return errors if self.s.num_groups == 1 else set()

    def shutdown(self) -> None:
        for agent in (self.decode, self.prefill):
            if agent is not None:
                agent.shutdown()


def pulled_blocks(num_groups: int, remote: Any, local: Any, ratio: int = 1, skipped: Any = 0) -> tuple[Any, Any]:
    """The remote blocks to pull and the local blocks they go to (per KV-cache group when
    nested; ``ratio`` remote blocks per local block): where the head of the prompt is in the
    local prefix cache (fewer local blocks), the tail; local blocks at positions the prefill
    side had slid out of its window (``skipped``) are left alone."""
    if num_groups > 1:
        if not (nested(remote) and nested(local) and len(remote) == len(local) == num_groups):
            raise ValueError(f"the hand-off and the local blocks must list {num_groups} KV-cache groups")
        skips = skipped if isinstance(skipped, list) else [skipped] * num_groups
        if len(skips) != num_groups:
            raise ValueError(f"kvxfer_skipped_blocks lists {len(skips)} groups, this model has {num_groups}")
        pairs = [tail(list(r), list(lo), ratio, k) for r, lo, k in zip(remote, local, skips)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    remote = list(remote or [])
    if remote and isinstance(remote[0], list):
        if len(remote) > 1 and any(remote[1:]):
            raise ValueError(f"the hand-off lists {len(remote)} KV-cache groups, this model has one")
        remote = remote[0]
    if isinstance(skipped, list):
        skipped = skipped[0] if skipped else 0
    return tail(remote, list(local), ratio, skipped)


def tail(remote: list[int], local: list[int], ratio: int = 1, skipped: Any = 0) -> tuple[list[int], list[int]]:
    """The remote blocks of one group to pull and the local blocks they go to (``ratio``
    remote blocks per local block): all, or the tail past the local blocks found in the
    prefix cache. ``remote`` lacks its first ``skipped`` positions (null blocks on the
    prefill side, outside its sliding window): local blocks wholly there are not pulled."""
    k = int_or_none(skipped)
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
