#!/usr/bin/env python3
"""NIXL's UCX backend reading the same bytes as `kvxfer-bench` between two processes.

The NIXL side of the issue-15 comparison: a target process registers `--total-bytes` of
filled host memory with a NIXL agent (UCX backend); an initiator process registers its own
buffer and READs all of it, one descriptor per `--block-bytes` block, in one transfer
request per iteration (like nixlbench's initiator/target pair). Prints one JSON object per
block size with the GiB/s of every measured iteration; the bytes are compared after the last
one. UCX_TLS (e.g. posix,sysv,cma,self) picks NIXL's transports as for kvxfer.

With `--layers L [--kv-split]` it reads a vLLM-shaped cache instead: one registered region per
layer (and per K/V), `--num-blocks` blocks of `--block-bytes` in each; every request reads
`--blocks-per-request` blocks from every region (L x 2 x B pieces), as vLLM's NixlConnector
does: descriptor lists prepared once (`prep_xfer_dlist`), one `make_prepped_xfer` per request
(`--n` of them at once for a parent of n children), `--requests` requests one after another.
It prints µs per request and counted CPU (user + system, `getrusage`) per request of each
process; every pulled block is compared with its source at the end.

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
import resource
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


def accept_initiator(port_file):
    """Listens on 127.0.0.1, writes the port to `port_file` and returns the initiator's
    connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    with open(port_file, "w") as f:
        f.write(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    return conn


def target(port_file, total):
    agent = make_agent("target")
    src = pattern(total)
    agent.register_memory([(src.ctypes.data, total, 0, "")], "DRAM")
    conn = accept_initiator(port_file)
    send_obj(conn, {"meta": agent.get_agent_metadata(), "addr": src.ctypes.data})
    recv_obj(conn)  # the initiator is done
    conn.close()


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def region_pattern(region_bytes, region):
    """Region `region`'s bytes: the pattern shifted per region, so a piece read from the
    wrong region differs."""
    return np.roll(pattern(region_bytes), 7 * region)


def shaped_target(port_file, regions, region_bytes):
    """The target of a vLLM-shaped run: `regions` filled regions; answers "cpu" with its CPU
    seconds so far until "done"."""
    agent = make_agent("target")
    srcs = [region_pattern(region_bytes, r) for r in range(regions)]
    agent.register_memory([(a.ctypes.data, region_bytes, 0, "") for a in srcs], "DRAM")
    conn = accept_initiator(port_file)
    send_obj(conn, {"meta": agent.get_agent_metadata(), "addrs": [a.ctypes.data for a in srcs]})
    while recv_obj(conn) == "cpu":
        send_obj(conn, cpu_seconds())
    conn.close()


def shaped_initiator(port, a, regions, block, num_blocks):
    agent = make_agent("initiator")
    sock = socket.create_connection(("127.0.0.1", port))
    info = recv_obj(sock)
    remote = agent.add_remote_agent(info["meta"])
    region_bytes = block * num_blocks
    dsts = [np.zeros(region_bytes, dtype=np.uint8) for _ in range(regions)]
    for d in dsts:
        d[::4096] = 1
    agent.register_memory([(d.ctypes.data, region_bytes, 0, "") for d in dsts], "DRAM")
    # One descriptor per (region, block), prepared once, as vLLM's NixlConnector does.
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT",
        [(d.ctypes.data + b * block, block, 0) for d in dsts for b in range(num_blocks)], "DRAM")
    far = agent.prep_xfer_dlist(
        remote, [(addr + b * block, block, 0) for addr in info["addrs"] for b in range(num_blocks)], "DRAM")
    per_child = a.blocks_per_request
    slots = num_blocks // per_child
    if slots < a.n:
        raise SystemExit(f"--num-blocks {num_blocks} holds fewer than --n {a.n} children of {per_child} blocks")

    def ids(slot):
        first = slot * per_child
        return [r * num_blocks + b for r in range(regions) for b in range(first, first + per_child)]

    latencies, cpu, target_cpu, used = [], 0.0, 0.0, set()
    for req in range(a.warmup + a.requests):
        measured = req >= a.warmup
        if measured:
            send_obj(sock, "cpu")
            t_cpu0 = recv_obj(sock)
            c0 = cpu_seconds()
        t0 = time.perf_counter()
        slot0 = (req * a.n) % (slots - a.n + 1)
        handles = []
        for k in range(a.n):
            used.add(slot0 + k)
            i = ids(slot0 + k)
            h = agent.make_prepped_xfer("READ", local, i, far, i)
            if agent.transfer(h) not in ("PROC", "DONE"):
                raise RuntimeError("NIXL transfer failed to start")
            handles.append(h)
        for h in handles:
            state = agent.check_xfer_state(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in {state}")
            agent.release_xfer_handle(h)
        if measured:
            latencies.append((time.perf_counter() - t0) * 1e6)
            cpu += cpu_seconds() - c0
            send_obj(sock, "cpu")
            target_cpu += recv_obj(sock) - t_cpu0
    # Every block read, each region against its source (a piece from the wrong region or
    # block differs); the target's CPU window includes its "cpu" message exchanges.
    span = per_child * block
    verified = True
    for r, d in enumerate(dsts):
        want = region_pattern(region_bytes, r)  # once per region
        verified &= all(np.array_equal(d[k * span:(k + 1) * span], want[k * span:(k + 1) * span]) for k in used)
    latencies.sort()
    pieces = a.n * per_child * regions
    print(json.dumps({
        "mode": "vllm_shaped", "layers": a.layers, "kv_split": a.kv_split, "regions": regions, "block_bytes": block,
        "n": a.n, "blocks_per_request": per_child, "pieces_per_request": pieces, "requests": a.requests,
        "bytes_per_request": pieces * block, "p50_us": latencies[len(latencies) // 2],
        "p99_us": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "initiator_cpu_us_per_request": cpu * 1e6 / a.requests, "target_cpu_us_per_request": target_cpu * 1e6 / a.requests,
        "cpu_us_per_request_both": (cpu + target_cpu) * 1e6 / a.requests,
        "cpu_us_per_piece_both": (cpu + target_cpu) * 1e6 / a.requests / pieces,
        "verified": verified, "ucx_version": loaded_ucx_version()}), flush=True)
    send_obj(sock, "done")
    sock.close()


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
    p.add_argument("--layers", type=int, default=0, help="a vLLM-shaped cache of this many layers")
    p.add_argument("--kv-split", action="store_true", help="with --layers: K and V regions per layer")
    p.add_argument("--num-blocks", type=int, default=1024, help="with --layers: blocks per region")
    p.add_argument("--blocks-per-request", type=int, default=64)
    p.add_argument("--n", type=int, default=1, help="with --layers: children per request, read at once")
    p.add_argument("--requests", type=int, default=200)
    a = p.parse_args()
    total = size(a.total_bytes)
    regions = a.layers * (2 if a.kv_split else 1)
    shaped_block = size(a.block_bytes.split(",")[0])
    if a.role == "target":
        if regions:
            shaped_target(a.port_file, regions, shaped_block * a.num_blocks)
        else:
            target(a.port_file, total)
        sys.stdout.flush()
        os._exit(0)

    port_file = tempfile.mktemp()
    child = subprocess.Popen([sys.executable, __file__, "--role", "target", "--port-file", port_file,
                              "--total-bytes", a.total_bytes, "--layers", str(a.layers), "--block-bytes", a.block_bytes,
                              "--num-blocks", str(a.num_blocks), *(["--kv-split"] if a.kv_split else [])])
    try:
        deadline = time.time() + 60
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if time.time() > deadline or child.poll() is not None:
                raise RuntimeError("NIXL target did not start")
            time.sleep(0.05)
        port = int(open(port_file).read())
        if regions:
            shaped_initiator(port, a, regions, shaped_block, a.num_blocks)
        else:
            initiator(port, total, [size(b) for b in a.block_bytes.split(",")], a.iters, a.warmup)
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
