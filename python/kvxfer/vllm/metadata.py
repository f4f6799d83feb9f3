"""What the two halves tell each other: the scheduler's per-step metadata (pickled to the
workers) and a worker's handshake metadata (sent to the scheduler once, at start-up)."""

from __future__ import annotations

from typing import Any

from .common import HandshakeMetadataBase, MetadataBase


class KvxferConnectorMetadata(MetadataBase):
    """What the scheduler side tells the workers at one step."""

    def __init__(self, step: int) -> None:
        self.step = step
        # Prefill: request id -> minted params (rank 0's address), to arm once this step's
        # forward has written the blocks.
        self.to_arm: dict[str, dict[str, Any]] = {}
        # Prefill: params of minted leases whose request will not hand them off (aborted,
        # preempted, re-minted): cancelled before this step's forward.
        self.to_retract: list[tuple[str, dict[str, Any]]] = []
        # Decode: request id -> (the child's params, local block ids), to pull.
        self.to_recv: dict[str, tuple[dict[str, Any], Any]] = {}
        # Decode: request ids whose pull is to be cancelled (the request was aborted).
        self.to_cancel: list[str] = []
        # Decode: params of leases to release without pulling (aborted before the pull).
        self.to_release: list[dict[str, Any]] = []
        # Decode: params of leases of requests waiting in the queue, to heartbeat.
        self.heartbeats: list[dict[str, Any]] = []
        # Requests finished or preempted since the last step: their blocks may be reused
        # from this step on (a sibling no longer copies a shared hand-off from them).
        self.gone: list[str] = []

    def __repr__(self) -> str:
        return (
            f"KvxferConnectorMetadata(step={self.step}, arm={list(self.to_arm)}, "
            f"retract={len(self.to_retract)}, recv={list(self.to_recv)}, cancel={self.to_cancel}, "
            f"release={len(self.to_release)}, heartbeats={len(self.heartbeats)})"
        )


class KvxferHandshakeMetadata(HandshakeMetadataBase):
    """What a worker rank tells the scheduler side at start-up (vLLM's out-of-band handshake
    metadata): where its prefill agent listens and which process it is, so hand-offs name
    the real port (the OS picks it by default) and state the incarnation."""

    def __init__(self, rank: int, host: str, port: int, incarnation: int, layout: str = "") -> None:
        self.rank = rank
        self.host = host
        self.port = port
        self.incarnation = incarnation
        # How bytes are ordered inside a block (``worker.layout_tag``): a decode engine whose
        # cache orders them otherwise must not pull (same sizes, other meaning).
        self.layout = layout

    def __repr__(self) -> str:
        return f"KvxferHandshakeMetadata(rank={self.rank}, {self.host}:{self.port}, incarnation={self.incarnation})"
