"""The vLLM types the step-by-step connector tests use, taken from the real ``vllm`` package
(never a copy of its interface): a ``Request`` made as vLLM's engine core makes one (its
``kv_transfer_params`` in the sampling params' ``extra_args``), vLLM's own block lists,
scheduler output and connector output. Importing this module needs vLLM; the test modules
that use it are skipped with the reason where it is not installed."""

from __future__ import annotations

from typing import Any, Optional

import pytest

vllm = pytest.importorskip("vllm", reason="the connector tests drive real vLLM types (scripts/python-envs.sh)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput as _SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request as _Request  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

__all__ = [
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVConnectorOutput",
    "KVConnectorRole",
    "Request",
    "RequestStatus",
    "SchedulerOutput",
]


def Request(request_id: str, prompt_token_ids: list[int], kv_transfer_params: Optional[Any] = None) -> _Request:
    """A real ``vllm.v1.request.Request`` of one output token carrying ``kv_transfer_params``."""
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    params = SamplingParams(max_tokens=1, extra_args=extra)
    return _Request(request_id, list(prompt_token_ids), params, None)


def SchedulerOutput(finished_req_ids: set[str]) -> _SchedulerOutput:
    """vLLM's scheduler output of a step that scheduled nothing but reports finished ids."""
    out = _SchedulerOutput.make_empty()
    out.finished_req_ids = set(finished_req_ids)
    return out
