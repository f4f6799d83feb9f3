"""Type stubs of the Rust extension module ``kvxfer._kvxfer`` (crates/kvxfer-py)."""

from typing import Any, Optional, Sequence, Union

__version__: str

Params = Union[dict[str, Any], str]
"""A child's ``kv_transfer_params`` dict (or its JSON text)."""

Blocks = Union[Sequence[int], Sequence[Sequence[int]]]
"""Block ids: one list, or one list per KV-cache group (vLLM's nested form)."""

class KvxferError(Exception):
    """Base class of every kvxfer error."""

class ConfigError(KvxferError):
    """An agent option or the cluster key is invalid, or this build cannot do what was asked."""

class RegistrationError(KvxferError):
    """Memory could not be registered (not a writable, C-contiguous host buffer; too short;
    a null or freed pointer)."""

class LayoutError(KvxferError):
    """A block layout is malformed, or a ``KvShape`` does not describe the memory."""

    field: Optional[str]
    """For a shape refusal: the ``KvShape`` field that differs ('head_dim', 'dtype',
    'block_tokens', 'total_kv_heads', 'tp_rank', ...); otherwise absent."""

class LeaseError(KvxferError):
    """A lease could not be made or armed."""

    kind: str
    """'already_leased', 'blocks_out_of_range', 'no_blocks', 'duplicate_block',
    'group_count', 'no_consumers', 'too_many_children', 'bad_child_index',
    'child_count_mismatch', 'closed', 'id_mismatch', 'zero_token', 'token_reused',
    'id_too_long' (a request id over 4096 bytes),
    'wrong_engine', 'draining' (the agent is draining: ``PrefillAgent.drain()``) or
    'other'."""

class ParamsError(KvxferError):
    """A ``kv_transfer_params`` dict could not be read or turned into a hand-off."""

    field: Optional[str]
    """The dict key that failed (None when the value is not a dict at all)."""

class SubmitError(KvxferError):
    """A pull was refused before any I/O."""

    kind: str
    """'incomplete_result', 'local_block_lists', 'bad_child', 'nothing_selected', 'plan',
    'unfit', 'group_count', 'mixed_engines', 'mixed_parents', 'shutting_down',
    'local_blocks_busy' or 'other'."""

class PullError(KvxferError):
    """A child's pull failed; carried (not raised) in failed reports as ``report['error']``."""

    kind: str
    """'connect', 'incompatible', 'handshake_refused', 'authentication', 'peer_restarted',
    'lease_unknown', 'lease_ended', 'refused', 'integrity', 'timeout', 'connection_lost',
    'protocol', 'remote_blocks_out_of_range', 'transport_unavailable', 'ucx_read',
    'pin_not_held', 'engine_not_registered', 'sibling_failed', 'shutdown' or
    'local_blocks'."""
    advice: str
    """What to do: 'retry_fresh_handoff', 'recompute' or 'fail_request'."""
    retryable: bool
    remote_request_id: str
    child_index: int

class TransportError(KvxferError):
    """Binding a socket, starting a runtime or talking to a peer failed."""

class AgentClosedError(KvxferError):
    """The agent was shut down (or the Memory already belongs to an agent)."""

class Segment:
    """One segment of every block, over memory Python owns: block ``b`` is ``block_bytes``
    bytes at ``offset + b * stride`` of the buffer. The buffer is kept while registered: for
    buffer-protocol objects with a buffer export (no resize or free possible), for torch
    tensors with their storage (``untyped_storage()``; but resizing that storage itself
    frees the memory: do not while registered)."""

    def __init__(self, buffer: Any, *, block_bytes: int, stride: Optional[int] = None, offset: int = 0) -> None:
        """``buffer``: a writable, C-contiguous buffer-protocol object (numpy array,
        bytearray) or an object with ``data_ptr()`` and ``nbytes`` (a contiguous CPU torch
        tensor; with ``untyped_storage()`` its bytes must lie inside that storage, without it
        its ``data_ptr()`` is trusted as given)."""
    @staticmethod
    def from_address(
        address: int, length: int, owner: Any, *, block_bytes: int, stride: Optional[int] = None, offset: int = 0
    ) -> Segment:
        """``length`` bytes at ``address``, kept valid by ``owner`` (the caller vouches)."""
    @property
    def address(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def offset(self) -> int: ...

class Memory:
    """A registered KV cache: a block layout over segments; one agent takes it over."""

    def __init__(
        self, segments: Sequence[Segment], *, num_blocks: int, dtype: str = "u8", block_tokens: int = 16
    ) -> None:
        """Segments over the same memory (same start, block size and stride) count once."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def num_segments(self) -> int: ...
    @property
    def deduplicated(self) -> int: ...
    @property
    def compat_hash(self) -> int: ...
    @property
    def taken(self) -> bool: ...
    @staticmethod
    def grouped(groups: Sequence[Memory]) -> Memory:
        """A KV cache of several KV-cache groups (hybrid models), ``groups[g]`` being group
        g's memory (each its own segments, block count and ids); takes them over."""
    @property
    def device(self) -> Optional[bool]:
        """Whether this is CUDA device memory (segments over CUDA tensors): agents over it
        pull and serve only over UCX. None once an agent took it."""
    @property
    def num_groups(self) -> int: ...
    @property
    def group_num_blocks(self) -> list[int]: ...

class KvShape:
    """One tensor-parallel rank's KV-cache shape, for pairing engines of different TP or
    block sizes. Blocks hold whole heads in order (HND). ``dtype`` and ``block_tokens``
    default to the memory's, ``head_dim`` is derived from each segment's block size,
    ``dtype_bytes`` from the dtype name. Refusals are ``LayoutError`` with ``field``."""

    def __init__(
        self,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        total_kv_heads: Optional[int] = None,
        attention: str = "mha",
        head_dim: Optional[int] = None,
        dtype: Optional[str] = None,
        dtype_bytes: Optional[int] = None,
        block_tokens: Optional[int] = None,
    ) -> None:
        """``attention``: 'mha' / 'gqa' / 'mqa' (needs ``total_kv_heads``, the model's KV
        heads over all ranks) or 'mla' (one latent, replicated on every rank)."""
    @property
    def tp_size(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def total_kv_heads(self) -> Optional[int]: ...
    @property
    def attention(self) -> str: ...
    @property
    def head_dim(self) -> Optional[int]: ...

class Handoff:
    """One child's hand-off (what a decode worker needs to pull it and notify)."""

    @staticmethod
    def from_params(params: Params) -> Handoff: ...
    def to_params(self) -> dict[str, Any]:
        """vLLM's ``kv_transfer_params`` dict for this child (plus the ``kvxfer_*`` keys)."""
    @property
    def remote_request_id(self) -> str: ...
    @property
    def parent_request_id(self) -> str: ...
    @property
    def child_index(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def token(self) -> str: ...
    @property
    def remote_block_ids(self) -> list[int]:
        """Group 0's blocks."""
    @property
    def group_block_ids(self) -> list[list[int]]:
        """Every KV-cache group's blocks, group 0 first."""
    @property
    def num_groups(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def expected_consumers(self) -> int: ...
    @property
    def ttl(self) -> float: ...

class PrefillAgent:
    """A prefill worker's agent: serves the registered KV cache over TCP and, with
    ``transport="auto"`` (default) or ``"ucx"`` in a build with UCX, over UCX too; leases (or
    arms) children's blocks, and reports how each lease ended. ``worker_threads`` runtime
    workers (0: one thread driving a current-thread runtime). ``ucx_tls``: UCX's transports
    (``UCX_TLS`` syntax, e.g. ``"posix,cma,self"``); default UCX's own choice."""

    def __init__(
        self,
        memory: Memory,
        listen: str = "127.0.0.1:0",
        *,
        agent_name: str = "prefill",
        engine_id: Optional[str] = None,
        rank: int = 0,
        tp_size: int = 1,
        kv_shape: Optional[KvShape] = None,
        advertise_host: Optional[str] = None,
        cluster_key: Optional[str] = None,
        lease_ttl: float = 30.0,
        arm_wait: float = 5.0,
        max_lease_lifetime: float = 600.0,
        io_timeout: float = 10.0,
        worker_threads: int = 2,
        transport: str = "auto",
        ucx_tls: Optional[str] = None,
        ucx_peer_failure_handling: Optional[bool] = None,
        shutdown_grace: float = 5.0,
    ) -> None: ...
    @property
    def address(self) -> tuple[str, int]: ...
    @property
    def offers_ucx(self) -> bool:
        """Whether the agent started UCX and offers it to decode agents."""
    @property
    def port(self) -> int: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def drain(self) -> None:
        """Starts draining: new leases (``lease``, ``lease_parent``) raise ``LeaseError``
        with kind ``'draining'``; an ``arm`` is not refused (its hand-off already left the
        process), and leases made before are still pulled and end as usual."""
    def undrain(self) -> None:
        """Ends a drain started by ``drain()``."""
    @property
    def draining(self) -> bool:
        """Whether new leases are refused."""
    def lease(
        self,
        parent: str,
        child_index: int,
        n: int,
        blocks: Blocks,
        *,
        expected_consumers: int = 1,
        ttl: Optional[float] = None,
    ) -> Handoff:
        """``blocks``: a list, or one list per KV-cache group of the memory."""
    def lease_parent(
        self, parent: str, blocks: Sequence[Blocks], *, expected_consumers: int = 1, ttl: Optional[float] = None
    ) -> list[Handoff]:
        """``blocks[i]``: child i's blocks (a list, or one list per KV-cache group)."""
    def arm(self, params: Params) -> Handoff:
        """Arms the lease a scheduler process minted into ``params`` (two-phase lease)."""
    def cancel(self, handoff: Union[Handoff, Params]) -> str:
        """'released', 'already_pulled', 'already_released', 'already_expired',
        'unrecognized' or 'bad_token'."""
    def poll_ends(self, max: Optional[int] = None) -> list[dict[str, Any]]: ...
    def wait_ends(self, count: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]: ...
    def stats(self) -> dict[str, dict[str, int]]: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> PrefillAgent: ...
    def __exit__(self, *args: Any) -> None: ...

class Pull:
    """A pull under way: its children's reports, and cancelling children."""

    @property
    def id(self) -> int: ...
    @property
    def parent_request_id(self) -> str: ...
    @property
    def children(self) -> list[str]: ...
    @property
    def done(self) -> bool: ...
    @property
    def wire_bytes(self) -> Optional[int]: ...
    @property
    def delivered_bytes(self) -> Optional[int]: ...
    @property
    def elapsed(self) -> Optional[float]: ...
    def cancel_child(self, child_index: int) -> None: ...
    def poll(self) -> list[dict[str, Any]]: ...
    def wait(self, timeout: Optional[float] = None) -> list[dict[str, Any]]: ...

class DecodeAgent:
    """A decode worker's agent: pulls children straight into its registered memory."""

    def __init__(
        self,
        memory: Memory,
        *,
        agent_name: str = "decode",
        engine_id: Optional[str] = None,
        rank: int = 0,
        kv_shape: Optional[KvShape] = None,
        consumer_id: Optional[str] = None,
        cluster_key: Optional[str] = None,
        io_timeout: float = 10.0,
        worker_threads: int = 2,
        connections_per_peer: int = 2,
        heartbeat_interval: Optional[float] = None,
        transport: str = "auto",
        ucx_tls: Optional[str] = None,
        ucx_peer_failure_handling: Optional[bool] = None,
        shutdown_grace: float = 5.0,
        queue_reports: bool = False,
        notify_with_read: bool = False,
    ) -> None:
        """``worker_threads=0``: one thread driving a current-thread runtime (the lowest
        one-block latency, one core's throughput). ``notify_with_read=True``: over TCP, a
        child whose own read settles it (a single-group cache, no block shared with a
        sibling, a plain ``submit``) sends its notify behind the read, one round trip for its
        hand-off instead of two; its lease then ends as pulled once the prefill side sent
        the payload (see the engine's ``AgentConfig::notify_with_read``). ``stats()``
        counts such reads as ``notifies_with_read``. ``transport``: ``"auto"`` pulls over
        UCX from a peer that offers it, else TCP; ``"tcp"`` / ``"ucx"`` force one. Every
        report says which path the child's bytes took: ``path`` (``"tcp"``, or ``"ucx(...)"``
        with the transports UCX's endpoint uses) and ``ucx_transports``."""
    @property
    def consumer_id(self) -> str: ...
    @property
    def has_ucx(self) -> bool:
        """Whether the agent started UCX."""
    @property
    def closed(self) -> bool: ...
    def submit(self, children: Sequence[Params], local_blocks: Sequence[Blocks]) -> Pull:
        """Pulls children of one parent (all, or any subset); returns at once.
        ``local_blocks[i]``: a list, or one list per KV-cache group."""
    def submit_ranks(self, ranks: Sequence[Sequence[Params]], local_blocks: Sequence[Blocks]) -> Pull:
        """Pulls children of one parent from a prefill engine of another TP size (or block
        size): ``ranks[r]`` the children's params from prefill rank r (every rank, in rank
        order); ``local_blocks[i]`` for the i-th child of ``ranks[0]``. Needs ``kv_shape``."""
    def poll_reports(self) -> list[dict[str, Any]]: ...
    def wait_reports(self, timeout: float = 10.0) -> list[dict[str, Any]]: ...
    def cancel(self, remote_request_id: str) -> bool: ...
    @property
    def _tracked_pulls(self) -> int:
        """How many pulls the agent tracks for ``cancel`` (for tests)."""
    def heartbeat(self, children: Sequence[Params], *, wait: bool = False, timeout: float = 10.0) -> Optional[list[str]]:
        """Keeps leases of pulls not started yet alive (requests waiting in the queue); with
        ``wait``, one outcome per child (an empty list when no answer came within ``timeout``
        or the agent was shut down meanwhile)."""
    def release(self, children: Sequence[Params], *, wait: bool = False, timeout: float = 10.0) -> Optional[list[bool]]:
        """Releases leases this agent will not pull (aborted in the queue, full prefix hits);
        with ``wait``, whether the prefill side released each (``TimeoutError`` after
        ``timeout``, ``AgentClosedError`` if the agent was shut down meanwhile)."""
    def poll_reclaimed(self) -> list[dict[str, Any]]: ...
    def stats(self) -> dict[str, int]: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> DecodeAgent: ...
    def __exit__(self, *args: Any) -> None: ...

def enable_logging(filter: str = "info") -> bool:
    """Logs kvxfer's events to stderr (``RUST_LOG`` syntax; ``RUST_LOG`` wins)."""

def protocol_version() -> int: ...
def ucx_info(ucx_tls: Optional[str] = None) -> dict[str, Any]: ...
