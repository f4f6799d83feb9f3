"""The UCX data path of the binding: ``transport="auto"`` (the default) pulls over UCX where
both agents offer it, and every report names the path its bytes took. UCX comes from the
libucx-cu12 wheel (the ``kvxfer`` wheel's dependency), not from the system."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvxfer
from conftest import SHAPE, blocks_equal, random_cache

SHARED_MEMORY = ("posix/", "sysv/", "cma/", "xpmem/", "knem/")


def test_the_binding_loads_the_ucx_it_was_built_against_from_the_libucx_wheel():
    info = kvxfer.ucx_info()
    assert info["built"] is True, info
    assert info["usable"] is True and info["error"] is None, info
    assert info["loaded_version"].split(".")[:2] == info["built_version"].split(".")[:2], info
    # The libucp mapped in this process is the wheel's (a system libucp is never loaded).
    assert info["loaded_from"] == "libucx wheel", info
    assert info["library"] and f"{os.sep}libucx{os.sep}lib{os.sep}" in info["library"], info
    assert any(t.startswith(SHARED_MEMORY) for t in info["transports"]), info
    # Asking for a transport set narrows what UCX may use.
    assert set(kvxfer.ucx_info("posix,self")["transports"]) <= {"posix/memory", "self/memory"}


@pytest.mark.parametrize("transport", ["auto", "ucx"])
def test_two_agents_pull_four_children_over_ucx_shared_memory(transport):
    src, dst = random_cache(11), np.zeros(SHAPE, dtype=np.float16)
    with kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), engine_id="p", transport=transport) as prefill:
        with kvxfer.DecodeAgent(kvxfer.kv_cache_memory([dst]), engine_id="d", transport=transport) as decode:
            assert prefill.offers_ucx and decode.has_ucx
            blocks = [[1, 2, 10 + i] for i in range(4)]
            local = [[20, 21, 22], [23, 24, 25], [26, 27, 28], [29, 30, 31]]
            params = [h.to_params() for h in prefill.lease_parent("U", blocks)]
            reports = decode.submit(params, local).wait(timeout=30)
            assert [r["outcome"] for r in reports] == ["done"] * 4, reports
            for i in range(4):
                assert blocks_equal(src, blocks[i], dst, local[i])
            for r in reports:
                assert r["path"].startswith("ucx(") and r["ucx_transports"], r
                # One host: UCX reads over a shared-memory transport.
                assert any(t.startswith(SHARED_MEMORY) for t in r["ucx_transports"]), r
            assert sorted(e["kind"] for e in prefill.wait_ends(4, timeout=10)) == ["pulled"] * 4
            stats = decode.stats()
            assert stats["bytes_pulled_tcp"] == 0 and stats["bytes_pulled_ucx"] == stats["bytes_pulled"] > 0, stats


def test_a_tcp_peer_is_pulled_over_tcp_under_auto_and_refused_under_ucx():
    src = random_cache(12)
    with kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), engine_id="p", transport="tcp") as prefill:
        assert not prefill.offers_ucx
        for transport, outcome in (("auto", "done"), ("ucx", "failed")):
            dst = np.zeros(SHAPE, dtype=np.float16)
            with kvxfer.DecodeAgent(kvxfer.kv_cache_memory([dst]), engine_id="d", transport=transport) as decode:
                params = [prefill.lease_parent(f"T-{transport}", [[3]])[0].to_params()]
                (report,) = decode.submit(params, [[4]]).wait(timeout=30)
                assert report["outcome"] == outcome, report
                if outcome == "done":
                    assert report["path"] == "tcp" and report["ucx_transports"] is None
                    assert blocks_equal(src, [3], dst, [4])
                else:
                    assert report["error"].kind == "transport_unavailable", report
                    assert "does not offer it" in str(report["error"])


def test_ucx_required_but_unable_to_start_is_an_error_naming_the_transports():
    with pytest.raises(kvxfer.KvxferError, match="no_such_transport.*UCX finds here: .*posix/memory"):
        kvxfer.PrefillAgent(
            kvxfer.kv_cache_memory([random_cache(13)]), transport="ucx", ucx_tls="no_such_transport"
        )
    # Under auto the agent starts without UCX and serves over TCP.
    with kvxfer.PrefillAgent(
        kvxfer.kv_cache_memory([random_cache(13)]), transport="auto", ucx_tls="no_such_transport"
    ) as prefill:
        assert not prefill.offers_ucx


# The interpreter of a venv with the wheel `pip install .` made (scripts/test-all.sh), else
# this one (this checkout's build, with the libucx wheel of this venv).
WHEEL_PY = os.environ.get("KVXFER_WHEEL_PY") or sys.executable


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"), reason="needs root and unshare(1)")
def test_a_pull_over_ucx_needs_no_system_ucx():
    """In a mount namespace where the system's UCX libraries are empty files, a fresh
    interpreter (of the venv `pip install .` made, in the README test command) imports
    kvxfer and pulls over UCX: everything UCX comes from the libucx-cu12 wheel."""
    hidden = [
        os.path.join(d, f)
        for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib")
        if os.path.isdir(d)
        for f in os.listdir(d)
        if f.startswith(("libucp.so", "libuct.so", "libucs.so", "libucm.so")) and not os.path.islink(os.path.join(d, f))
    ]
    script = textwrap.dedent(
        """
        import numpy as np, kvxfer, sys
        src = np.arange(2 * 32 * 4 * 2 * 16, dtype=np.float16).reshape(2, 32, 4, 2, 16)
        dst = np.zeros_like(src)
        with kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]), engine_id="p", transport="ucx") as p:
            with kvxfer.DecodeAgent(kvxfer.kv_cache_memory([dst]), engine_id="d", transport="ucx") as d:
                params = [h.to_params() for h in p.lease_parent("W", [[1], [2]])]
                reports = d.submit(params, [[5], [6]]).wait(timeout=30)
                assert [r["outcome"] for r in reports] == ["done", "done"], reports
                assert np.array_equal(dst[:, 5], src[:, 1]) and np.array_equal(dst[:, 6], src[:, 2])
                print(reports[0]["path"], kvxfer.ucx_info()["library"], kvxfer.__file__)
        """
    )
    binds = "".join(f"mount --bind /dev/null {h} && " for h in hidden)
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{binds}exec "$0" -c "$1"', WHEEL_PY, script],
        capture_output=True,
        text=True,
        timeout=120,
        # Run from elsewhere than the checkout, so the wheel's package is what is imported.
        cwd="/",
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path, library, package = out.stdout.split()[-3:]
    assert path.startswith("ucx(") and "/libucx/lib/" in library, out.stdout
    if os.environ.get("KVXFER_WHEEL_PY"):
        venv = os.path.dirname(os.path.dirname(WHEEL_PY))
        assert library.startswith(venv) and package.startswith(venv), (venv, out.stdout)


class FakeCudaTensor:
    """Host memory presented the way a CUDA torch tensor is (``device.type == "cuda"``,
    ``data_ptr()``, ``nbytes``): the binding registers it as device memory, which kvxfer
    never touches on the CPU — so this checks the CPU-side logic of the device path (UCX
    moves every byte; TCP reads, CRCs and local copies are refused) without a GPU."""

    class device:  # noqa: N801 - torch's attribute name
        type = "cuda"

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


def cuda_memory(array: np.ndarray, blocks: int) -> kvxfer.Memory:
    flat = array.reshape(-1).view(np.uint8)
    return kvxfer.Memory([kvxfer.Segment(FakeCudaTensor(flat), block_bytes=flat.nbytes // blocks)], num_blocks=blocks)


def test_cuda_memory_is_served_and_pulled_only_over_ucx_with_no_cpu_copy():
    src = np.random.default_rng(5).integers(0, 255, size=(16, 512), dtype=np.uint8)
    dst = np.zeros_like(src)
    memory = cuda_memory(src, 16)
    assert memory.device is True
    with pytest.raises(kvxfer.KvxferError, match="device memory"):
        kvxfer.PrefillAgent(cuda_memory(src, 16), transport="tcp")
    with kvxfer.PrefillAgent(memory, engine_id="p", ucx_tls="posix,cma,self") as prefill:
        with kvxfer.DecodeAgent(cuda_memory(dst, 16), engine_id="d", ucx_tls="posix,cma,self") as decode:
            # Two children share remote block 1 but land it in different local blocks: no
            # CPU copy on device memory, so it is read twice.
            params = [h.to_params() for h in prefill.lease_parent("C", [[1, 2], [1, 3]])]
            reports = decode.submit(params, [[10, 11], [12, 13]]).wait(timeout=30)
            assert [r["outcome"] for r in reports] == ["done", "done"], reports
            assert all(r["path"].startswith("ucx(") for r in reports), reports
            for remote, local in (([1, 2], [10, 11]), ([1, 3], [12, 13])):
                assert np.array_equal(dst[local], src[remote])
            stats = decode.stats()
            assert (stats["bytes_pulled_ucx"], stats["bytes_pulled_tcp"]) == (4 * 512, 0), stats
        # A host-memory decode on TCP: its read of the device cache is refused, by name.
        host = kvxfer.Memory([kvxfer.Segment(np.zeros(16 * 512, dtype=np.uint8), block_bytes=512)], num_blocks=16)
        with kvxfer.DecodeAgent(host, transport="tcp") as tcp:
            (report,) = tcp.submit([prefill.lease_parent("X", [[4]])[0].to_params()], [[5]]).wait(timeout=30)
            assert report["outcome"] == "failed" and "device memory" in str(report["error"]), report


def run_with_env(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, **env),
    )


@pytest.mark.skipif(
    not any(os.path.exists(p) for p in ("/usr/lib/x86_64-linux-gnu/libucp.so.0", "/usr/lib/libucp.so.0")),
    reason="needs a system UCX of another version (Debian's libucx0)",
)
def test_a_libucp_of_another_version_is_refused_naming_both_versions():
    """KVXFER_UCX_HOME=/usr loads the system's UCX (Debian's 1.13) under a binding built
    against the wheel's 1.22: UCX is refused with both versions named, TCP still works."""
    out = run_with_env(
        """
        import json, numpy as np, kvxfer
        info = kvxfer.ucx_info()
        print(json.dumps({k: info.get(k) for k in ("usable", "error", "loaded_version", "built_version", "loaded_from")}))
        mem = lambda: kvxfer.Memory([kvxfer.Segment(np.zeros(4096, dtype=np.uint8), block_bytes=1024)], num_blocks=4)
        try:
            kvxfer.PrefillAgent(mem(), transport="ucx")
            print("STARTED")
        except kvxfer.KvxferError as e:
            print("REFUSED", e)
        with kvxfer.PrefillAgent(mem()) as p:
            print("AUTO", p.offers_ucx)
        """,
        KVXFER_UCX_HOME="/usr",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    info = json.loads(lines[0])
    assert info["loaded_from"] == "KVXFER_UCX_HOME" and info["usable"] is False, info
    assert info["loaded_version"].split(".")[:2] != info["built_version"].split(".")[:2], info
    refused = next(line for line in lines if line.startswith(("REFUSED", "STARTED")))
    assert refused.startswith("REFUSED") and info["loaded_version"] in refused and info["built_version"] in refused, refused
    assert "AUTO False" in lines, lines


def test_a_wrong_kvxfer_ucx_home_is_reported_and_the_wheels_ucx_used():
    out = run_with_env(
        """
        import json, kvxfer
        info = kvxfer.ucx_info()
        print(json.dumps({k: info.get(k) for k in ("usable", "loaded_from", "load_problem")}))
        """,
        KVXFER_UCX_HOME="/nonexistent/ucx",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.splitlines()[-1])
    assert info["loaded_from"] == "libucx wheel" and info["usable"] is True, info
    assert "KVXFER_UCX_HOME" in info["load_problem"] and "/nonexistent/ucx" in info["load_problem"], info
