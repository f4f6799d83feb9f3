#!/usr/bin/env python3
"""NIXL's UCX backend reading the same bytes as `kvxfer-bench` between two processes.

The NIXL side of the issue-15 comparison: a target process registers `--total-bytes` of
filled host memory with a NIXL agent (UCX backend); an initiator process registers its own
buffer and READs all of it, one descriptor per `--block-bytes` block, in one transfer
request per iteration (like nixlbench's initiator/target pair). Prints one JSON object per
block size with the GiB/s of every measured iteration; the bytes are compared after the last
one. UCX_TLS (e.g. posix,sysv,cma,self) picks NIXL's transports as for kvxfer.

Needs the `nixl` Python package (`pip install nixl-cu12`, which bundles its own UCX; its
`torch` dependency is not needed here) and numpy:

    python3 scripts/nixl-read-bench.py --block-bytes 64K,2M --total-bytes 512M --iters 3
"""

import argparse
import ctypes
import json
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from nixl import nixl_agent, nixl_agent_config
except ImportError:
    from nixl_cu12 import nixl_agent, nixl_agent_config


def size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def send_obj(sock, obj):
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def recv_obj(sock):
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("peer closed")
            buf += chunk
        return buf

    (n,) = struct.unpack("!Q", exact(8))
    return pickle.loads(exact(n))


def pattern(total):
    """`total` bytes of a pattern whose period (a prime) is no multiple of any block size,
    so a block read from the wrong place differs."""
    period = (np.arange(1_000_003, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)
    return np.resize(period, total)


def make_agent(name):
    """An agent with a UCX backend without peer-failure handling: UCX's shared-memory
    transports cannot do it (kvxfer-bench's `--ucx-peer-failure` off, likewise)."""
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none", "num_workers": "1"})
    return agent


def target(port_file, total):
    agent = make_agent("target")
    src = pattern(total)
    agent.register_memory([(src.ctypes.data, total, 0, "")], "DRAM")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    with open(port_file, "w") as f:
        f.write(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    send_obj(conn, {"meta": agent.get_agent_metadata(), "addr": src.ctypes.data})
    recv_obj(conn)  # the initiator is done
    conn.close()


def loaded_ucx_version():
    """The version of the libucp this process loaded (NIXL bundles its own), from
    `ucp_get_version_string`; None when no libucp is mapped."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if re.search(r"/libucp[-.][^/]*so", line)}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        return lib.ucp_get_version_string().decode()
    return None


def initiator(port, total, blocks, iters, warmup):
    agent = make_agent("initiator")
    ucx_version = loaded_ucx_version()
    sock = socket.create_connection(("127.0.0.1", port))
    info = recv_obj(sock)
    remote = agent.add_remote_agent(info["meta"])
    dst = np.zeros(total, dtype=np.uint8)
    dst[::4096] = 1  # touch every page before timing
    agent.register_memory([(dst.ctypes.data, total, 0, "")], "DRAM")
    expect = pattern(total)
    for block in blocks:
        n = total // block
        local = agent.get_xfer_descs([(dst.ctypes.data + i * block, block, 0) for i in range(n)], "DRAM")
        far = agent.get_xfer_descs([(info["addr"] + i * block, block, 0) for i in range(n)], "DRAM")
        rates = []
        for it in range(warmup + iters):
            dst[::4096] = 0
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, far, remote)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            secs = time.perf_counter() - t0
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in {state}")
            agent.release_xfer_handle(handle)
            if it >= warmup:
                rates.append(total / (1 << 30) / secs)
        verified = bool(np.array_equal(dst, expect))
        print(json.dumps({"block_bytes": block, "bytes": total, "nixl_gib_per_s": sorted(rates)[len(rates) // 2],
                          "iter_gib_per_s": rates, "verified": verified, "ucx_version": ucx_version}), flush=True)
    send_obj(sock, "done")
    sock.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-bytes", default="64K,2M")
    p.add_argument("--total-bytes", default="512M")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--role", choices=["both", "target"], default="both")
    p.add_argument("--port-file")
    a = p.parse_args()
    total = size(a.total_bytes)
    if a.role == "target":
        target(a.port_file, total)
        sys.stdout.flush()
        os._exit(0)

    port_file = tempfile.mktemp()
    child = subprocess.Popen([sys.executable, __file__, "--role", "target", "--port-file", port_file,
                              "--total-bytes", a.total_bytes])
    try:
        deadline = time.time() + 60
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if time.time() > deadline or child.poll() is not None:
                raise RuntimeError("NIXL target did not start")
            time.sleep(0.05)
        initiator(int(open(port_file).read()), total, [size(b) for b in a.block_bytes.split(",")], a.iters, a.warmup)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        if os.path.exists(port_file):
            os.remove(port_file)
    sys.stdout.flush()
    # Skip the agents' teardown: NIXL 1.5.1 with UCX_TLS set to shared memory was seen to
    # crash in it (SIGSEGV at exit) after the results were printed.
    os._exit(0)


if __name__ == "__main__":
    main()
