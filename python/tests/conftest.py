"""Shared fixtures: small numpy KV caches and agents on 127.0.0.1 (free ports), shut down
after each test."""

from __future__ import annotations

import os
import secrets
import time
from typing import Callable

import numpy as np
import pytest

import kvxfer

# The package under test must be this checkout's: the cached virtualenvs import kvxfer
# through a .pth file that scripts/test-all.sh points at the checkout it runs in, so after a
# run from another clone they would silently test that clone's code.
_HERE = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "kvxfer"))
_IMPORTED = os.path.realpath(os.path.dirname(kvxfer.__file__))
if _IMPORTED != _HERE:
    raise pytest.UsageError(
        f"kvxfer is imported from {_IMPORTED}, not this checkout's {_HERE}: run scripts/test-all.sh here, or "
        "point the venv's kvxfer-checkout.pth (and maturin develop's kvxfer.pth) at this checkout's python/"
    )

# Agents default to transport="auto": UCX where both peers offer it. UCX's tcp transport
# listens on every network device it may use; tests (and the engines they start, which
# inherit this) keep it on the loopback device. Its shared-memory transports are not network
# devices and stay on.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# Per layer (2, num_blocks, block_size, heads, head_dim), float16: 256-byte K and V blocks.
SHAPE = (2, 32, 4, 2, 16)


def random_cache(seed: int, shape=SHAPE) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.float16)


def blocks_equal(src: np.ndarray, remote: list[int], dst: np.ndarray, local: list[int]) -> bool:
    return all(np.array_equal(dst[kv, local].view(np.uint16), src[kv, remote].view(np.uint16)) for kv in range(2))


def eventually(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Waits until ``cond()`` holds (a guard against a hang, not a timed assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def unarmed(prefill: kvxfer.PrefillAgent, rid: str, blocks: list[int]) -> dict:
    """A scheduler-minted hand-off that no worker armed yet (reads of it wait for the arm)."""
    host, port = prefill.address
    return {
        "remote_block_ids": blocks,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": rid,
        "remote_host": host,
        "remote_port": port,
        "kvxfer_lease_token": secrets.token_hex(16),
    }


def arm_waits(prefill: kvxfer.PrefillAgent) -> int:
    """Requests that waited for a lease to be armed (reads, cancels, notifies, heartbeats)."""
    return prefill.stats()["server"]["arm_waits"]


@pytest.fixture
def src():
    return random_cache(1)


@pytest.fixture
def dst():
    return np.zeros(SHAPE, dtype=np.float16)


# The `prefill` / `decode` fixtures use the TCP data path (what most tests here check: its
# batches, CRCs, connections); test_ucx.py covers the default, UCX.
@pytest.fixture
def prefill(src):
    agent = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), engine_id="prefill-engine", transport="tcp")
    yield agent
    agent.shutdown()


@pytest.fixture
def decode(dst):
    agent = kvxfer.DecodeAgent(
        kvxfer.kv_cache_memory([dst]), engine_id="decode-engine", queue_reports=True, transport="tcp"
    )
    yield agent
    agent.shutdown()
