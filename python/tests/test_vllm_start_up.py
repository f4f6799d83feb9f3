"""The connector's start-up checks, with real vLLM types and torch tensors: a device cache
without host staging is refused naming the setting, a loopback advertised host is warned
about, the default port lets several instances share a host."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch", reason="tensors of another device need torch")
from vllm_real import KVConnectorRole  # noqa: E402
from vllm_sim import vllm_config  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer.vllm import KvxferConnector  # noqa: E402


def test_a_device_cache_without_host_staging_is_refused_naming_kv_buffer_device():
    conn = KvxferConnector(vllm_config("kv_producer", "dev"), KVConnectorRole.WORKER, None)
    cache = torch.empty((8, 2, 16, 64), dtype=torch.float16, device="meta")
    with pytest.raises(kvxfer.RegistrationError, match="kv_buffer_device"):
        conn.register_kv_caches({"layer.0": cache})
    assert conn.worker is not None and conn.worker.prefill is None, "nothing started"


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({}, "opt-in"),
        # This machine's UCX: no CUDA driver, so no cuda_* transport.
        ({"kvxfer_device_direct": True}, "no CUDA transport"),
        ({"kvxfer_device_direct": True, "kvxfer_transport": "tcp"}, "kvxfer_transport"),
        ({"kvxfer_host_staging": True}, "asked for"),
    ],
)
def test_a_cuda_cache_is_staged_through_host_memory_unless_ucx_reads_cuda_memory(extra, reason):
    """Where the loaded UCX has CUDA transports (and the transport is not tcp) a CUDA cache is
    registered as it is; otherwise it is staged, and the start-up log says why."""
    conn = KvxferConnector(vllm_config("kv_producer", "dev", extra), KVConnectorRole.WORKER, None)
    why = conn.worker._why_staged({"cuda"})
    assert why is not None and reason in why, why
    if "no CUDA transport" in reason:
        assert "posix/memory" in why, "the message names the transports UCX has"


def test_the_block_copier_of_a_device_cache_copies_with_torch_as_the_host_one_does():
    """A CUDA cache registered as it is is copied by torch on its device (the CPU never
    touches it); here on CPU tensors, against the host copier's numpy copy."""
    from kvxfer.vllm.worker import BlockCopier

    conn = KvxferConnector(vllm_config("kv_consumer", "copy"), KVConnectorRole.WORKER, None)
    g = torch.Generator().manual_seed(3)
    base = {f"layer.{i}": torch.randn((2, 8, 4, 2, 16), generator=g, dtype=torch.float32) for i in range(2)}
    host = {k: v.clone() for k, v in base.items()}
    device = {k: v.clone() for k, v in base.items()}
    pairs = [(1, 5), (2, 6), (3, 3)]
    BlockCopier.over(host, conn.worker.s).copy(0, pairs)
    torch_copier = BlockCopier.over(device, conn.worker.s, on_device=True)
    assert torch_copier.on_device
    torch_copier.copy(0, pairs)
    for k in base:
        assert torch.equal(host[k], device[k]), k
        assert torch.equal(device[k][:, 5], base[k][:, 1]) and torch.equal(device[k][:, 6], base[k][:, 2])


def test_a_loopback_advertised_host_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        KvxferConnector(vllm_config("kv_producer", "lo"), KVConnectorRole.SCHEDULER, None)
    assert any("loopback" in r.getMessage() and "kvxfer_host" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        KvxferConnector(
            vllm_config("kv_producer", "lan", {"kvxfer_host": "10.0.0.7"}), KVConnectorRole.SCHEDULER, None
        )
    assert not any("loopback" in r.getMessage() for r in caplog.records)


def test_two_kv_both_instances_on_one_host_listen_on_ports_of_their_own():
    """The default port is 0: the OS picks one per agent, and the worker reports it to its
    scheduler through vLLM's handshake metadata (two instances used to collide on 5600)."""
    cfg = {"kvxfer_host": "127.0.0.1"}
    cfg.pop("kvxfer_port", None)
    conns = []
    try:
        for name in ("a", "b"):
            config = vllm_config("kv_both", name, cfg)
            config.kv_transfer_config.kv_connector_extra_config.pop("kvxfer_port", None)
            conn = KvxferConnector(config, KVConnectorRole.WORKER, None)
            conn.register_kv_caches({"layer.0": torch.zeros((2, 8, 4, 2, 16), dtype=torch.float16)})
            conns.append(conn)
        ports = [c.get_handshake_metadata().port for c in conns]
        assert len(set(ports)) == 2 and all(p > 0 for p in ports), ports
    finally:
        for c in conns:
            c.shutdown()
