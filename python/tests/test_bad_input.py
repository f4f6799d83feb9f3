"""Bad input from Python — wrong dicts, freed or resized buffers, wrong layouts, wrong
options — is a Python exception with a clear message, never a crash of the interpreter."""

from __future__ import annotations

import gc
import secrets
import weakref

import numpy as np
import pytest

import kvxfer
from conftest import SHAPE, random_cache, unarmed


def good_params(prefill: kvxfer.PrefillAgent) -> dict:
    return prefill.lease("B", 0, 1, [1, 2]).to_params()


# ---- wrong dicts


@pytest.mark.parametrize(
    "change, field",
    [
        ({"remote_port": "x"}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"kvxfer_lease_token": None}, "kvxfer_lease_token"),
        ({"kvxfer_lease_token": "not hex"}, "kvxfer_lease_token"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": [1, "a"]}, "remote_block_ids"),
        ({"remote_host": None}, "remote_host"),
        ({"kvxfer_lease_ttl_ms": 0}, "kvxfer_lease_ttl_ms"),
    ],
)
def test_a_wrong_params_dict_names_its_field(prefill, decode, change, field):
    params = dict(good_params(prefill), **change)
    with pytest.raises(kvxfer.ParamsError) as e:
        decode.submit([params], [[3, 4]])
    assert e.value.field == field and field in str(e.value), str(e.value)
    assert str(e.value).startswith("children[0]: ")


@pytest.mark.parametrize("bad", [["a", "list"], 42, {"remote_port": object()}, '{"remote_port": 5', None])
def test_not_a_params_dict_is_a_params_error(decode, bad):
    with pytest.raises(kvxfer.ParamsError):
        decode.submit([bad], [[1]])


def test_children_that_do_not_fit_together_are_refused_before_any_io(prefill, decode):
    a = [h.to_params() for h in prefill.lease_parent("A", [[1], [2]])]
    b = prefill.lease("Z", 0, 1, [3]).to_params()
    cases = [
        (lambda: decode.submit([a[0], b], [[1], [2]]), "mixed_parents"),
        (lambda: decode.submit([a[0], a[0]], [[1], [2]]), "bad_child"),
        (lambda: decode.submit([a[0]], [[1], [2]]), "local_block_lists"),
        (lambda: decode.submit([], []), "nothing_selected"),
        (lambda: decode.submit([a[0]], [[1, 2]]), "plan"),
        (lambda: decode.submit([a[0]], [[10_000]]), "plan"),
    ]
    for call, kind in cases:
        with pytest.raises(kvxfer.SubmitError) as e:
            call()
        assert e.value.kind == kind, (kind, str(e.value))
        # The message a log shows ends with its kind, whoever refused (binding or engine).
        assert str(e.value).endswith(f"(kind={kind})"), str(e.value)
    minted = unarmed(prefill, "U", [1])
    pull = decode.submit([minted], [[5]])  # its read waits for the arm
    with pytest.raises(kvxfer.SubmitError) as e:
        decode.submit([a[1]], [[5]])  # block 5 is being written by the first pull
    assert e.value.kind == "local_blocks_busy" and "[5]" in str(e.value)
    prefill.arm(minted)
    assert pull.wait(timeout=30)[0]["outcome"] == "done"


def test_a_child_naming_a_block_twice_is_refused_and_siblings_may_share(prefill):
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.lease_parent("G", [[1, 1]])
    assert e.value.kind == "duplicate_block" and "block 1 " in str(e.value), str(e.value)
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.lease_parent("G2", [[2], [3, 4, 3]])  # nothing of the parent is leased
    assert e.value.kind == "duplicate_block" and "block 3 " in str(e.value), str(e.value)
    assert prefill.stats()["leases"]["live"] == 0
    # Two children sharing a prefix block: legal, each hand-off lists it once.
    shared = prefill.lease_parent("S", [[5, 6], [5, 7]])
    assert [h.to_params()["remote_block_ids"] for h in shared] == [[5, 6], [5, 7]]
    for h in shared:
        prefill.cancel(h)


def test_bad_leases_are_lease_errors(prefill):
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.lease("R", 0, 1, [SHAPE[1]])
    assert e.value.kind == "blocks_out_of_range" and str(SHAPE[1]) in str(e.value)
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.lease("R", 2, 2, [1])
    assert e.value.kind == "bad_child_index"
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.lease("R", 0, 1, [])
    assert e.value.kind == "no_blocks"
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.arm(dict(good_params(prefill), remote_request_id="B2", kvxfer_lease_token="00" * 16))
    assert e.value.kind == "id_mismatch"
    with pytest.raises(OverflowError):
        prefill.lease("R", 0, 1, [-1])


def test_a_zero_token_cannot_be_armed(prefill):
    host, port = prefill.address
    params = {
        "remote_block_ids": [1],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "Z",
        "remote_host": host,
        "remote_port": port,
        "kvxfer_lease_token": "00" * 16,
    }
    with pytest.raises(kvxfer.LeaseError) as e:
        prefill.arm(params)
    assert e.value.kind == "zero_token"


# ---- freed, resized and unsuitable buffers


def test_a_registered_array_cannot_be_resized_or_freed_under_the_agent():
    arr = np.zeros(4096, dtype=np.uint8)
    seg = kvxfer.Segment(arr, block_bytes=1024)
    with pytest.raises(ValueError, match="resize"):
        arr.resize(8192)  # numpy sees the reference kvxfer holds
    buf = bytearray(4096)
    held = kvxfer.Segment(buf, block_bytes=1024)
    with pytest.raises(BufferError):
        buf.extend(b"more")  # the buffer export kvxfer holds forbids it
    alive = weakref.ref(arr)
    del arr
    gc.collect()
    assert alive() is not None, "the segment keeps the array alive"
    del seg, held
    gc.collect()
    assert alive() is None
    buf.extend(b"more")  # no longer registered


class FakeTensor:
    """Duck-typed like a torch tensor (data_ptr(), nbytes, device, is_contiguous())."""

    def __init__(self, ptr: int, nbytes: int, device: str = "cpu", contiguous: bool = True) -> None:
        self._ptr, self.nbytes, self._contiguous = ptr, nbytes, contiguous
        self.device = type("device", (), {"type": device, "__str__": lambda s: f"{device}:0"})()

    def data_ptr(self) -> int:
        return self._ptr

    def is_contiguous(self) -> bool:
        return self._contiguous


@pytest.mark.parametrize(
    "buffer, message",
    [
        (FakeTensor(0, 4096), "data_ptr() is 0"),
        (FakeTensor(0x1000, 4096, device="xpu"), "device xpu"),  # CUDA is registered as device memory
        (FakeTensor(0x1000, 4096, contiguous=False), "not contiguous"),
        (FakeTensor(0x1000, 0), "empty"),
        (FakeTensor(-5, 4096), "not a valid buffer"),
        (np.zeros(16).view(np.float64)[::2], "not C-contiguous"),
        (np.frombuffer(b"\0" * 64, dtype=np.uint8), "read-only"),
        (np.zeros(0), "empty"),
        (b"bytes are immutable", "read-only"),
        ("not a buffer", "cannot register a str"),
        (12345, "cannot register a int"),
    ],
)
def test_unsuitable_buffers_are_refused_with_a_clear_message(buffer, message):
    with pytest.raises(kvxfer.RegistrationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvxfer.Segment(buffer, block_bytes=8)


class NumpyStorage:
    """What the binding reads of torch's ``UntypedStorage`` (data_ptr(), nbytes()), over a
    numpy array's memory."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, dtype=np.uint8)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def nbytes(self) -> int:
        return int(self.array.nbytes)


class StorageTensor(FakeTensor):
    """A tensor view into a storage it can swap (``set_``), like a CPU torch tensor."""

    def __init__(self, storage: NumpyStorage, offset: int, nbytes: int) -> None:
        super().__init__(storage.data_ptr() + offset, nbytes)
        self.storage = storage

    def untyped_storage(self) -> NumpyStorage:
        return self.storage

    def set_(self, storage: NumpyStorage) -> None:
        self.storage = storage
        self._ptr = storage.data_ptr()


@pytest.mark.parametrize("offset, nbytes", [(-64, 1024), (64, 4096), (4096, 64)])
def test_a_tensor_outside_its_storage_is_refused(offset, nbytes):
    tensor = StorageTensor(NumpyStorage(4096), offset, nbytes)
    with pytest.raises(kvxfer.RegistrationError, match="outside its storage"):
        kvxfer.Segment(tensor, block_bytes=64)


def test_a_registered_tensor_keeps_its_storage_when_the_tensor_swaps_it():
    """``t.set_(other)`` (or dropping ``t``) must not free the memory a registration names:
    the registration holds the storage, not only the tensor."""
    tensor = StorageTensor(NumpyStorage(4096), 0, 4096)
    seg = kvxfer.Segment(tensor, block_bytes=1024)
    registered = weakref.ref(tensor.storage)
    tensor.set_(NumpyStorage(4096))
    del tensor
    gc.collect()
    assert registered() is not None, "the storage under the registration was freed"
    assert seg.address == registered().data_ptr()
    del seg
    gc.collect()
    assert registered() is None


def test_a_null_address_is_refused():
    with pytest.raises(kvxfer.RegistrationError):
        kvxfer.Segment.from_address(0, 4096, None, block_bytes=1024)


# ---- wrong layouts


def test_wrong_layouts_are_refused():
    arr = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(kvxfer.LayoutError, match="stride"):
        kvxfer.Memory([kvxfer.Segment(arr, block_bytes=1024, stride=512)], num_blocks=4)
    with pytest.raises(kvxfer.LayoutError):
        kvxfer.Memory([], num_blocks=4)
    with pytest.raises(kvxfer.RegistrationError, match="need 8192 bytes from offset 0, but its buffer has 4096"):
        kvxfer.Memory([kvxfer.Segment(arr, block_bytes=1024)], num_blocks=8)
    with pytest.raises(kvxfer.RegistrationError, match="from offset 1024"):
        kvxfer.Memory([kvxfer.Segment(arr, block_bytes=1024, offset=1024)], num_blocks=4)
    with pytest.raises(kvxfer.RegistrationError, match="kv_first expects"):
        kvxfer.kv_cache_memory([np.zeros((3, 4, 4, 2, 8), dtype=np.float16)], kv_layout="kv_first")
    with pytest.raises(kvxfer.RegistrationError, match="same shape"):
        kvxfer.kv_cache_memory([np.zeros(SHAPE, dtype=np.float16), np.zeros(SHAPE, dtype=np.float32)])


def test_segments_over_the_same_memory_are_registered_once():
    arr = np.zeros(4096, dtype=np.uint8)
    memory = kvxfer.Memory(
        [kvxfer.Segment(arr, block_bytes=1024), kvxfer.Segment(arr, block_bytes=1024)], num_blocks=4
    )
    assert (memory.num_segments, memory.deduplicated) == (1, 1)


def test_a_memory_serves_one_agent(src):
    memory = kvxfer.kv_cache_memory([src])
    with kvxfer.PrefillAgent(memory):
        with pytest.raises(kvxfer.AgentClosedError, match="already registered"):
            kvxfer.DecodeAgent(memory)
    assert memory.taken


def test_a_pull_between_mismatched_layouts_fails_with_advice_to_recompute(prefill):
    other = np.zeros((2, 32, 8, 2, 16), dtype=np.float16)  # 8 tokens per block, not 4
    with kvxfer.DecodeAgent(kvxfer.kv_cache_memory([other])) as decode:
        report = decode.submit([good_params(prefill)], [[3, 4]]).wait(timeout=30)[0]
    assert report["outcome"] == "failed"
    assert report["error"].kind == "incompatible" and report["error"].advice == "recompute"
    # The handshake failed, so the decode side could not cancel: the lease stays until it
    # expires (loudly) or its owner cancels it.
    assert prefill.stats()["leases"]["live"] == 1


# ---- wrong options


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cluster_key": "zz"}, "cluster_key"),
        ({"cluster_key": "00"}, "cluster_key"),
        ({"transport": "udp"}, "unknown transport"),
        ({"lease_ttl": -1.0}, "lease_ttl"),
        ({"arm_wait": float("nan")}, "arm_wait"),
        # Too large for a Duration, and large enough for a Duration but not for an Instant.
        ({"io_timeout": 1e30}, "io_timeout"),
        ({"io_timeout": 1e19}, "io_timeout"),
        ({"arm_wait": 1e19}, "arm_wait"),
        ({"lease_ttl": 1e19}, "lease_ttl"),
        ({"max_lease_lifetime": 1e19}, "max_lease_lifetime"),
        ({"shutdown_grace": 1e19}, "shutdown_grace"),
    ],
)
def test_bad_agent_options_are_config_errors(kwargs, message):
    with pytest.raises(kvxfer.ConfigError, match=message):
        kvxfer.PrefillAgent(kvxfer.kv_cache_memory([random_cache(3)]), **kwargs)


def test_a_listen_address_in_use_is_a_transport_error(prefill):
    host, port = prefill.address
    with pytest.raises(kvxfer.TransportError, match="binding"):
        kvxfer.PrefillAgent(kvxfer.kv_cache_memory([random_cache(4)]), f"{host}:{port}")


def test_queued_reports_need_the_option(prefill):
    with kvxfer.DecodeAgent(kvxfer.kv_cache_memory([np.zeros(SHAPE, dtype=np.float16)])) as decode:
        with pytest.raises(kvxfer.ConfigError, match="queue_reports"):
            decode.poll_reports()
        unknown = dict(good_params(prefill), kvxfer_lease_token=secrets.token_hex(16), remote_port=1)
        assert decode.heartbeat([unknown], wait=True) == ["error"], "an unreachable prefill agent"
