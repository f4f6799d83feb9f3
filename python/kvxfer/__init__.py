"""kvxfer: KV-cache transfer for disaggregated LLM serving.

A prefill worker registers its KV cache (:class:`Memory` over :class:`Segment` s of numpy
arrays or CPU torch tensors), starts a :class:`PrefillAgent` and leases each child's blocks;
every child's hand-off becomes its own ``kv_transfer_params`` dict. A decode worker's
:class:`DecodeAgent` pulls any set of children of a parent straight into its own blocks
(:meth:`DecodeAgent.submit`) and reports per child. Every lease ends exactly once: pulled,
released or (loudly) expired.

Shut agents down before the process exits (``shutdown()``, or ``with`` blocks):
:func:`shutdown_on_signals` and :func:`shutdown_at_exit` (:mod:`kvxfer.lifecycle`) do it on
SIGTERM/SIGINT and at interpreter exit for processes of your own (not under vLLM, which
shuts the connector down itself).

The vLLM connector is :class:`kvxfer.vllm.KvxferConnector`; ``python -m kvxfer.bench`` is the
benchmark.
"""

from __future__ import annotations

from ._kvxfer import (
    AgentClosedError,
    ConfigError,
    DecodeAgent,
    Handoff,
    KvShape,
    KvxferError,
    LayoutError,
    LeaseError,
    Memory,
    ParamsError,
    PrefillAgent,
    Pull,
    PullError,
    RegistrationError,
    Segment,
    SubmitError,
    TransportError,
    __version__,
    enable_logging,
    protocol_version,
)
from .kvcache import kv_cache_heads, kv_cache_memory, kv_cache_segments
from .lifecycle import shutdown_at_exit, shutdown_on_signals

__all__ = [
    "AgentClosedError",
    "ConfigError",
    "DecodeAgent",
    "Handoff",
    "KvShape",
    "KvxferError",
    "LayoutError",
    "LeaseError",
    "Memory",
    "ParamsError",
    "PrefillAgent",
    "Pull",
    "PullError",
    "RegistrationError",
    "Segment",
    "SubmitError",
    "TransportError",
    "__version__",
    "enable_logging",
    "kv_cache_heads",
    "kv_cache_memory",
    "kv_cache_segments",
    "protocol_version",
    "shutdown_at_exit",
    "shutdown_on_signals",
]
