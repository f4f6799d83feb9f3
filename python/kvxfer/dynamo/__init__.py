"""kvxfer's connector in NVIDIA Dynamo's vLLM worker, without editing Dynamo.

Dynamo's vLLM worker (``python -m dynamo.vllm``) chooses how a prefill and a decode worker
exchange ``kv_transfer_params`` from the engine's ``kv_connector`` name, in its registry of
PD protocols (``dynamo.vllm.kv_connector_protocols.KV_CONNECTOR_PROTOCOLS``), and refuses a
name it does not list (``Unsupported kv_connector='KvxferConnector' for PD``).
:func:`register` adds ``KvxferConnector`` to that registry with a pull protocol — the
decode worker's params are the prefill response's, as for NIXL — and ``python -m
kvxfer.dynamo`` does that, then runs Dynamo's own worker entry point with the arguments it
was given::

    python -m kvxfer.dynamo --model MODEL --disaggregation-mode prefill \\
      --kv-transfer-config '{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer.vllm","kv_role":"kv_producer"}'

n > 1 needs nothing more: Dynamo keeps one output's params, and with kvxfer every child of
a parallel-sampling parent names the parent's one shared prompt hand-off (the other
children's blocks are freed at once), so whichever output Dynamo keeps hands the decode
worker a lease that every decode child reads once.

The registry is an internal of Dynamo's: the version this was tested with is
:data:`TESTED_DYNAMO`, and another is refused with the reason (set
``KVXFER_DYNAMO_ANY_VERSION=1`` to try it anyway)."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

#: The ai-dynamo release the registration was tested with.
TESTED_DYNAMO = "1.6.1"
#: The connector name registered (``kv_connector`` in ``--kv-transfer-config``).
CONNECTOR_NAME = "KvxferConnector"


class DynamoVersionError(RuntimeError):
    """The installed ai-dynamo is not the release this integration was tested with."""


def dynamo_version() -> Optional[str]:
    """The installed ai-dynamo version, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ai-dynamo")
    except PackageNotFoundError:
        return None


def check_version() -> str:
    """The installed ai-dynamo version; raises :class:`DynamoVersionError` when it is
    missing or not :data:`TESTED_DYNAMO` (unless ``KVXFER_DYNAMO_ANY_VERSION=1``)."""
    found = dynamo_version()
    if found is None:
        raise DynamoVersionError(
            f"kvxfer.dynamo: ai-dynamo is not installed in this environment ({TESTED_DYNAMO} is the tested release)"
        )
    if found != TESTED_DYNAMO and os.environ.get("KVXFER_DYNAMO_ANY_VERSION") != "1":
        raise DynamoVersionError(
            f"kvxfer.dynamo: ai-dynamo {found} is installed, but this integration registers KvxferConnector in "
            f"Dynamo's internal PD-protocol registry as ai-dynamo {TESTED_DYNAMO} has it; install "
            f"ai-dynamo=={TESTED_DYNAMO}, or set KVXFER_DYNAMO_ANY_VERSION=1 to try {found} anyway"
        )
    return found


def _protocol_class() -> Any:
    """kvxfer's PD protocol, a subclass of Dynamo's ``KvConnectorProtocol``."""
    from dynamo.vllm.kv_connector_protocols import KvConnectorProtocol

    class KvxferConnectorProtocol(KvConnectorProtocol):  # type: ignore[misc, valid-type]
        """Pull-based, as NIXL: the prefill request asks for a hand-off
        (``do_remote_decode``) and the decode worker's params are the prefill response's
        ``kv_transfer_params`` as vLLM returned them (any child's: they all name the
        parent's shared prompt hand-off)."""

        def prefill_request_kv_transfer_params(self) -> Dict[str, Any]:
            return {"do_remote_decode": True, "do_remote_prefill": False}

        def decode_request_kv_transfer_params(self, prefill_response: Any) -> Optional[Dict[str, Any]]:
            return getattr(prefill_response, "kv_transfer_params", None)

    return KvxferConnectorProtocol


def register() -> Any:
    """Adds ``KvxferConnector`` to Dynamo's PD-protocol registry (once; a name already
    there is left as it is) and returns the protocol class registered under it."""
    check_version()
    from dynamo.vllm import kv_connector_protocols as protocols

    registry = protocols.KV_CONNECTOR_PROTOCOLS
    if CONNECTOR_NAME not in registry:
        registry[CONNECTOR_NAME] = _protocol_class()
    return registry[CONNECTOR_NAME]


__all__ = ["CONNECTOR_NAME", "TESTED_DYNAMO", "DynamoVersionError", "check_version", "dynamo_version", "register"]
