"""The parts of vLLM's KV-connector interface the kvxfer connector implements, mirrored for
tests that run without vLLM (which needs a multi-GB CUDA torch and cannot serve a model here).

Mirrors vLLM main at commit 003df2961dd8830c317a61f9745ccd557da9fa06:
``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (``KVConnectorRole``,
``KVConnectorMetadata``, ``KVConnectorHandshakeMetadata``, and the method signatures and
default return values of ``KVConnectorBase_V1`` that a connector overrides: names,
parameters, which are abstract). Bodies and documentation are not copied; each method says
in one line what vLLM expects of it.

The scheduler-side objects a connector receives are stand-ins with the attributes it reads,
after the same commit: ``vllm/v1/request.py`` (``RequestStatus``, the ``Request`` fields),
``vllm/v1/core/kv_cache_manager.py`` (``KVCacheBlocks``), ``vllm/v1/outputs.py``
(``KVConnectorOutput``), ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional


class KVConnectorRole(enum.Enum):
    """Which process a connector instance runs in."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024 - abstract marker, as in vLLM
    """Scheduler -> worker metadata of one step (serialized to the workers)."""


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024 - abstract marker, as in vLLM
    """A worker's out-of-band handshake data, collected for the scheduler side."""


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    """The v1 connector interface (signatures as at the mirrored commit)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        """Stores the config and role; raises if ``kv_transfer_config`` is unset."""
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        """This instance's role."""
        return self._role

    # ---- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called before every model execution with the step's metadata."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Called after every model execution."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """The bound metadata (only while bound)."""
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        """Whether metadata is bound."""
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The KV cache, one tensor per layer name (before the first step)."""
        return

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts loading KV into the paged buffer before the forward pass."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Blocks until one layer's KV is loaded."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Starts saving one layer's KV."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Blocks until every save of the step is done."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """(finished sending ids, finished receiving ids); sending ids must have been in a
        ``finished_req_ids`` of this or an earlier call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed, no later than the step reporting the request."""
        return set()

    def shutdown(self) -> None:
        """The worker process shuts down."""
        return None

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        """This worker's handshake metadata for the scheduler side, if any."""
        return None

    # ---- scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """(tokens loadable beyond ``num_computed_tokens``, whether loaded asynchronously)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Blocks were allocated for the request (``num_external_tokens`` to load)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's metadata for the workers; resets the connector's step state."""

    def on_new_request(self, request: Any) -> None:
        """A new request was added to the scheduler."""
        return

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' aggregated output of a step."""
        return

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Once per request, before its blocks are freed: (free later?, kv_transfer_params)."""
        return False, None

    def get_finished_count(self) -> Optional[int]:
        """How many workers report each finished request (None: the world size)."""
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every worker's handshake metadata, by TP rank."""
        return None


class RequestStatus(enum.IntEnum):
    """``vllm.v1.request.RequestStatus``: anything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()


@dataclass
class Request:
    """The ``vllm.v1.request.Request`` fields a connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: Optional[dict[str, Any]] = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)


@dataclass
class KVCacheBlock:
    """One block of ``vllm.v1.core.kv_cache_utils.KVCacheBlock``: id, hash (None: not cached)."""

    block_id: int
    block_hash: Optional[bytes] = None
    is_null: bool = False


@dataclass
class KVCacheBlocks:
    """``vllm.v1.core.kv_cache_manager.KVCacheBlocks``: blocks per KV-cache group."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self, allow_none: bool = False) -> Optional[tuple[list[int], ...]]:
        """Block ids per group."""
        if allow_none and all(len(g) == 0 for g in self.blocks):
            return None
        return tuple([b.block_id for b in g] for g in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a hash (newly allocated), single group."""
        assert len(self.blocks) == 1
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Ids of the blocks without a hash, per group, padding blocks skipped."""
        return [[b.block_id for b in g if b.block_hash is None and not b.is_null] for g in self.blocks]


@dataclass
class KVConnectorOutput:
    """``vllm.v1.outputs.KVConnectorOutput`` (the fields a connector reads)."""

    finished_sending: Optional[set[str]] = None
    finished_recving: Optional[set[str]] = None
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass
class SchedulerOutput:
    """``vllm.v1.core.sched.output.SchedulerOutput`` (the field the step loop passes on)."""

    finished_req_ids: set[str] = field(default_factory=set)
