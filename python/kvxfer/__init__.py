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

from typing import Any, Dict, Optional

from . import _ucxlib

_ucxlib.load()
try:
    from . import _kvxfer as _binding
except ImportError as e:  # pragma: no cover - depends on the installation
    if "libuc" in str(e):
        raise ImportError(
            f"{e}: kvxfer's binding is built with UCX and needs its libraries: install the "
            f"libucx-cu12 wheel it depends on (pip install kvxfer installs it), or set "
            f"KVXFER_UCX_HOME to a UCX install of the version it was built against "
            f"(UCX loading: {_ucxlib.LOADED})"
        ) from e
    raise
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


def ucx_info(ucx_tls: Optional[str] = None) -> Dict[str, Any]:
    """Which UCX this process uses: ``built`` (whether the binding has the UCX data path);
    where it has, ``built_version`` / ``built_from`` (compiled against), ``loaded_version``
    and ``library`` (the libucp mapped in this process), ``loaded_from`` (how it was found:
    ``KVXFER_UCX_HOME``, the ``libucx`` wheel, or the loader's search path), ``usable``
    (major.minor match: kvxfer refuses UCX otherwise), ``transports`` (the
    ``"<transport>/<device>"`` resources a UCX context with ``ucx_tls`` — default UCX's own
    choice or ``UCX_TLS`` — finds on this host) and ``error``."""
    info: Dict[str, Any] = dict(_binding.ucx_info(ucx_tls))
    info["loaded_from"] = _ucxlib.LOADED["source"]
    info["library"] = _ucxlib.mapped_libucp()
    if _ucxlib.LOADED["problem"]:
        info["load_problem"] = _ucxlib.LOADED["problem"]
    if info.get("built") and not info.get("usable") and not info.get("error"):
        info["error"] = (
            f"the loaded libucp is UCX {info.get('loaded_version')} but kvxfer was built against "
            f"UCX {info.get('built_version')} ({info.get('built_from')})"
        )
    return info

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
    "ucx_info",
]
