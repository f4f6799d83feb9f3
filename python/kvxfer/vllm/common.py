"""What both halves of the connector share: vLLM's base classes (or stand-ins when vLLM is
not installed), the connector's settings, and the helpers that read block lists and
hand-off params."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Optional

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as Base,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as MetadataBase,
    )

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    except ImportError:  # vLLM before the hybrid memory allocator hook

        class SupportsHMA:  # type: ignore[no-redef]
            """Stand-in for vLLM's ``SupportsHMA`` marker."""

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorHandshakeMetadata as HandshakeMetadataBase,
        )
    except ImportError:  # vLLM before out-of-band handshake metadata

        class HandshakeMetadataBase:  # type: ignore[no-redef]
            """Stand-in for vLLM's ``KVConnectorHandshakeMetadata``."""

    HAVE_VLLM = True
    logger = logging.getLogger("vllm.kv_connector.kvxfer")
except ImportError:
    HAVE_VLLM = False
    logger = logging.getLogger("kvxfer.vllm")

    class MetadataBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorMetadata`` when vLLM is not installed."""

    class HandshakeMetadataBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorHandshakeMetadata`` when vLLM is not installed."""

    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``SupportsHMA`` marker when vLLM is not installed."""

    class Base:  # type: ignore[no-redef]
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


# A child of a parallel-sampling parent: vLLM names it f"{index}_{parent}".
CHILD_ID = re.compile(r"^(\d+)_(.+)$", re.DOTALL)
# vLLM's null block: the block pool's first block, never given to a request's tokens. A
# sliding-window group's block list holds it in place of the blocks that slid out of the
# window, so the list starts with repeats.
NULL_BLOCK_ID = 0
# How long state about requests that never came back is kept (minted siblings of a parent
# whose other children never finished, leases that ended before vLLM said their request
# finished).
FORGET_AFTER = 600.0


def int_or_none(value: Any) -> Optional[int]:
    """``value`` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def flag(extra: dict[str, Any], key: str, default: bool = False) -> bool:
    """A boolean setting of ``kv_connector_extra_config``: a bool, or its text as a command
    line gives it ("true"/"false", "1"/"0", "yes"/"no"); anything else is refused."""
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", "", "none"):
        return False
    raise ValueError(f"{key} must be true or false, not {value!r}")


def status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status))


def num_prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or ())
    return int(n)


def nested(block_ids: Any) -> bool:
    """Whether ``block_ids`` is one list per KV-cache group."""
    return isinstance(block_ids, (tuple, list)) and bool(block_ids) and isinstance(block_ids[0], (list, tuple))


def all_ids(blocks: Any) -> list[int]:
    """Every block id of a flat or per-group list."""
    if nested(blocks):
        return [int(b) for g in blocks for b in g]
    return [int(b) for b in (blocks or ())]


def group_blocks(block_ids: Any, num_groups: int) -> Any:
    """``block_ids`` (a list, or one list per KV-cache group) as a hand-off lists them: a
    flat list for one group, one list per group for several (vLLM's nested
    ``remote_block_ids``)."""
    if num_groups > 1:
        if not nested(block_ids) or len(block_ids) != num_groups:
            given = len(block_ids) if nested(block_ids) else 1
            raise ValueError(f"{given} block lists for a model of {num_groups} KV-cache groups")
        return [[int(b) for b in g] for g in block_ids]
    if nested(block_ids):
        if len(block_ids) > 1 and any(len(g) for g in block_ids[1:]):
            raise ValueError(
                "block ids of several KV-cache groups, but the connector was not given the model's "
                "kv_cache_config (its kv_cache_groups register one memory group each)"
            )
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in (block_ids or ())]


def strip_null_prefix(blocks: Any) -> tuple[Any, Any]:
    """``blocks`` (flat or per group) without the leading null-block entries of each list,
    and how many were dropped (an int, or one per group): a lease holds real blocks only,
    each once, and the decode side keeps its blocks aligned by that count."""

    def strip(ids: list[int]) -> tuple[list[int], int]:
        k = 0
        while k < len(ids) - 1 and ids[k] == NULL_BLOCK_ID:
            k += 1
        return ids[k:], k

    if nested(blocks):
        pairs = [strip(list(g)) for g in blocks]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return strip(list(blocks))


def local_blocks(blocks: Any, num_groups: int = 1) -> Any:
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bindable(host: str) -> bool:
    """Whether this machine can listen on ``host`` (one of its own addresses, or a name that
    resolves to one)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(address)
            return True
        except OSError:
            continue
    return False


def rank_addresses(s: "Settings", rank: int) -> tuple[str, str]:
    """Where TP rank ``rank``'s prefill agent listens and the host its hand-offs name.

    ``kvxfer_host`` names one host; in multi-node tensor parallelism the ranks on the
    other nodes cannot listen there. A rank of a TP > 1 instance whose configured host is
    not an address of its node (and whose ``kvxfer_listen_host`` is not set) listens on
    and names its node's ``VLLM_HOST_IP`` instead, when that is set to one of its node's
    own (specific) addresses (logged); the scheduler hands off every rank's own host
    (``kvxfer_rank_hosts``). Otherwise it is a start-up error naming the keys to set."""
    if "kvxfer_listen_host" in s.extra or bindable(s.listen_host):
        return s.listen_host, s.host
    node = os.environ.get("VLLM_HOST_IP", "")
    if s.tp_size > 1 and node and not _unspecified(node) and bindable(node):
        logger.warning(
            "kvxfer: rank %d: kvxfer_host %s is not an address of this node; this rank listens on and names "
            "VLLM_HOST_IP %s, as multi-node tensor parallelism needs",
            rank,
            s.listen_host,
            node,
        )
        return node, node
    multi_node = (
        "in multi-node tensor parallelism set VLLM_HOST_IP on every node to one of that node's addresses (each "
        "rank then listens on and names it); "
        if s.tp_size > 1
        else ""
    )
    raise ValueError(
        f"kvxfer: tensor-parallel rank {rank} cannot listen on kvxfer_host {s.listen_host!r}: it is not an "
        f"address of this node; {multi_node}where kvxfer_host is an address that reaches this instance from "
        "elsewhere (NAT, a virtual address), set kvxfer_listen_host to one it can listen on (e.g. 0.0.0.0)"
    )


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# KV-cache specs whose blocks vLLM never frees or rewrites while their request runs (a sliding
# window frees blocks that slid out; Mamba-style state blocks are rewritten in place).
_STABLE_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def _dp_index(parallel: Any) -> int:
    """This engine's data-parallel index: vLLM's ``data_parallel_index`` where it has one —
    for a dense model vLLM sets ``data_parallel_rank`` to 0 on every engine (each runs as an
    independent rank), so two engines with a fixed ``kvxfer_port`` would take one port —
    else ``data_parallel_rank``."""
    index = getattr(parallel, "data_parallel_index", None)
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    return int(getattr(parallel, "data_parallel_rank", 0) or 0)


def _transport(extra: dict[str, Any]) -> str:
    """``kvxfer_transport``: ``auto`` (default), ``tcp`` or ``ucx``."""
    value = str(extra.get("kvxfer_transport", "auto")).lower()
    if value not in ("auto", "tcp", "ucx"):
        raise ValueError(f"kvxfer_transport must be 'auto', 'tcp' or 'ucx', not {extra.get('kvxfer_transport')!r}")
    return value


@dataclass
class Settings:
    """The connector's configuration, read once from ``VllmConfig`` (see the package docs
    for each ``kv_connector_extra_config`` key)."""

    kv_role: str
    engine_id: str
    host: str
    listen_host: str
    base_port: int
    lease_ttl: float
    arm_wait: float
    heartbeat_interval: float
    io_timeout: float
    worker_threads: int
    notify_with_read: bool
    # The agents' data path: "auto" (UCX where both sides offer it, else TCP), "tcp", "ucx".
    transport: str
    # UCX's transports (UCX_TLS syntax); None: UCX's own choice (or UCX_TLS).
    ucx_tls: Optional[str]
    cluster_key: Optional[str]
    tp_size: int
    dp_rank: int
    decode_tp_size: int
    kv_layout: str
    block_size: int
    kv_buffer_device: str
    # Stage through host memory even for a CPU cache (tests the GPU path on a CPU).
    host_staging: bool
    # Register a CUDA cache as it is with UCX (no host copy) where UCX has CUDA transports.
    device_direct: bool
    # Children of a parallel-sampling parent share one prompt hand-off (see scheduler.py).
    share_prompt: bool
    # Every KV-cache group is full attention (MLA included): vLLM keeps a running request's
    # blocks as they are, so a sibling can copy a decode request's prompt blocks later.
    stable_blocks: bool
    extra: dict[str, Any]
    model_config: Any
    # One list of layer names per KV-cache group (None: one group).
    group_layers: Optional[list[list[str]]]
    num_groups: int
    num_blocks: Optional[int]

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> "Settings":
        config = vllm_config.kv_transfer_config
        extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
        parallel = getattr(vllm_config, "parallel_config", None)
        tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        if pp_size > 1:
            # Each stage's workers hold only their layers' KV cache, and hand-offs name one
            # agent per TP rank: the stages of a decode would all read one prefill stage.
            raise ValueError(
                f"kvxfer's KV connector does not support pipeline parallelism (pipeline_parallel_size={pp_size}): "
                "each stage holds only its own layers' KV cache and hand-offs name one agent per tensor-parallel "
                "rank; run the prefill and decode instances with pipeline_parallel_size 1 (tensor parallelism, "
                "of any size on either side, is supported)"
            )
        host = str(extra.get("kvxfer_host") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        lease_ttl = float(extra.get("kvxfer_lease_ttl", 30.0))
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        group_layers: Optional[list[list[str]]] = None
        if len(groups) > 1:
            names = [list(getattr(g, "layer_names", None) or ()) for g in groups]
            if not all(names):
                raise ValueError(
                    "kvxfer needs the layer names of every KV-cache group (kv_cache_groups[g].layer_names)"
                )
            group_layers = names
        num_blocks = getattr(kv_cache_config, "num_blocks", None)
        return cls(
            kv_role=str(getattr(config, "kv_role", "kv_both") or "kv_both"),
            engine_id=str(extra.get("kvxfer_engine_id") or getattr(config, "engine_id", None) or "kvxfer"),
            host=host,
            listen_host=str(extra.get("kvxfer_listen_host") or host),
            base_port=int(extra.get("kvxfer_port", 0)),
            lease_ttl=lease_ttl,
            arm_wait=float(extra.get("kvxfer_arm_wait", 5.0)),
            heartbeat_interval=float(extra.get("kvxfer_heartbeat_interval", lease_ttl / 6)),
            io_timeout=float(extra.get("kvxfer_io_timeout", 10.0)),
            worker_threads=int(extra.get("kvxfer_worker_threads", 2)),
            notify_with_read=flag(extra, "kvxfer_notify_with_read"),
            transport=_transport(extra),
            ucx_tls=str(extra["kvxfer_ucx_tls"]) if extra.get("kvxfer_ucx_tls") else None,
            cluster_key=extra.get("kvxfer_cluster_key"),
            tp_size=tp_size,
            dp_rank=_dp_index(parallel),
            decode_tp_size=int(extra.get("kvxfer_decode_tp_size", tp_size)),
            kv_layout=str(extra.get("kvxfer_kv_layout", "auto")),
            block_size=int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 0) or 0),
            kv_buffer_device=str(getattr(config, "kv_buffer_device", None) or "").lower(),
            host_staging=flag(extra, "kvxfer_host_staging"),
            device_direct=flag(extra, "kvxfer_device_direct"),
            share_prompt=flag(extra, "kvxfer_share_prompt", True),
            stable_blocks=bool(groups)
            and all(type(getattr(g, "kv_cache_spec", None)).__name__ in _STABLE_SPECS for g in groups),
            extra=extra,
            model_config=getattr(vllm_config, "model_config", None),
            group_layers=group_layers,
            num_groups=max(1, len(groups)),
            num_blocks=int(num_blocks) if isinstance(num_blocks, int) and num_blocks > 0 else None,
        )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def port_of(self, rank: int) -> int:
        """The configured listening port of TP rank ``rank`` (0: the OS picks one, and the
        worker reports it through vLLM's handshake metadata)."""
        if self.base_port == 0:
            return 0
        return self.base_port + self.dp_rank * self.tp_size + rank
