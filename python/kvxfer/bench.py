"""``python -m kvxfer.bench``: kvxfer-bench's one-process workload through the Python API.

The same workload and the same metrics as the Rust ``kvxfer-bench`` (one process, TCP):
per block size, ``--total-bytes`` (512 MiB) moved per iteration as ``--parents`` parents of
``--n`` (8) children, ``--warmup`` unmeasured and ``--iters`` measured iterations; each parent
leased by a ``PrefillAgent`` (``lease_parent``, hand-offs as ``kv_transfer_params`` dicts) and
pulled by a ``DecodeAgent`` (``submit`` of the dicts); reported: GiB/s, blocks/s, per-child
hand-off latency (lease to report; p50, p99, max), CPU seconds per GiB, and every pulled byte
verified. Memory is numpy: one segment of ``blocks * block`` bytes per side. Also reported:
``api_us_per_parent``, the median time of the calls through the binding for one parent
(``lease_parent``, ``to_params``, ``poll_ends``, ``submit``).

numpy's huge-page advice is turned off (``--numpy-hugepages`` keeps it): kvxfer-bench's
memory has none, and a paired run should compare the binding, not page sizes.

``--pair-with PATH`` runs the Rust binary (``cargo build --release -p kvxfer-bench``;
``target/release/kvxfer-bench``) and this benchmark alternately, ``--rounds`` times each, on
the same machine, and prints both medians and their ratio per block size.

``--latency`` measures the one-block hand-off instead, across two processes (the prefill
agent in a child Python process, leasing on request): per iteration, from ``submit`` of
one child of one block to ``Pull.wait()`` returning in this process, beside a raw TCP
round trip of the same block (a 64-byte request answered with the block, read with one
``MSG_WAITALL`` receive) to a responder in another process, and every pulled block checked — ``kvxfer-bench serve``'s
(``--raw-with PATH``; Rust, as in kvxfer-bench's own latency figures) or else one in the
prefill process. The two alternate, so each hand-off is paired with a round trip taken in
the same moment; the report gives both distributions and the paired ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import kvxfer

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is in the `bench` and `test` extras
    raise SystemExit("python -m kvxfer.bench needs numpy: pip install numpy (or kvxfer[bench])") from None


def parse_size(s: str) -> int:
    s = s.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    num = s[:-1] if mult > 1 else s
    value = int(num) * mult
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 64K, 2M)")
    return value


def human(b: int) -> str:
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def percentile(sorted_samples: list[float], p: float) -> float:
    if not sorted_samples:
        return 0.0
    idx = round((len(sorted_samples) - 1) * p)
    return sorted_samples[min(idx, len(sorted_samples) - 1)]


def run_block_size(args: argparse.Namespace, block: int) -> dict[str, Any]:
    """One block size: agents over fresh numpy memory, warm-up and measured iterations."""
    n, parents = max(args.n, 1), max(args.parents, 1)
    bpc = args.total_bytes // block // (n * parents)
    if bpc == 0:
        raise SystemExit(f"--total-bytes {args.total_bytes} is too small for {n * parents} children of {block}-byte blocks")
    blocks = bpc * n * parents
    # numpy asks for transparent huge pages on large arrays (madvise); kvxfer-bench's memory
    # (KvMemory::alloc) does not, so a paired run would compare page sizes, not the binding.
    # Off unless --numpy-hugepages.
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    set_hugepage = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if set_hugepage is not None:
        set_hugepage(args.numpy_hugepages)
    src = np.random.default_rng(block).integers(0, 256, size=blocks * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    common = dict(worker_threads=args.worker_threads, transport=args.transport)
    prefill = kvxfer.PrefillAgent(
        kvxfer.Memory([kvxfer.Segment(src, block_bytes=block)], num_blocks=blocks), agent_name="bench-prefill", **common
    )
    decode = kvxfer.DecodeAgent(
        kvxfer.Memory([kvxfer.Segment(dst, block_bytes=block)], num_blocks=blocks),
        agent_name="bench-decode",
        connections_per_peer=args.connections,
        **common,
    )

    def ids(p: int, c: int) -> list[int]:
        first = (p * n + c) * bpc
        return list(range(first, first + bpc))

    latencies: list[float] = []
    # Per parent: lease_parent + to_params + poll_ends + submit, the calls through the binding.
    api_seconds: list[float] = []
    seconds = cpu = 0.0
    moved = 0
    try:
        for it in range(args.warmup + args.iters):
            measured = it >= args.warmup
            cpu0, t0 = time.process_time(), time.perf_counter()
            pulls = []
            for p in range(parents):
                lease_start = time.perf_counter()
                handoffs = prefill.lease_parent(f"bench-{block}-{it}-{p}", [ids(p, c) for c in range(n)])
                params = [h.to_params() for h in handoffs]
                prefill.poll_ends()
                submitted = time.perf_counter()
                pulls.append((lease_start, submitted, decode.submit(params, [ids(p, c) for c in range(n)])))
                if measured:
                    api_seconds.append(time.perf_counter() - lease_start)
            for lease_start, submitted, pull in pulls:
                reports = pull.wait()
                for r in reports:
                    if r["outcome"] != "done":
                        raise SystemExit(f"child {r['child_index']} of {pull.parent_request_id}: {r['outcome']} {r['error']}")
                    if measured:
                        latencies.append((submitted - lease_start + r["seconds"]) * 1e6)
                if measured:
                    moved += pull.delivered_bytes
            if measured:
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - cpu0
        verified: Optional[bool] = None if args.no_verify else bool(np.array_equal(src, dst))
        stats = prefill.stats()
    finally:
        decode.shutdown()
        prefill.shutdown()
    latencies.sort()
    gib = moved / float(1 << 30)
    leases = stats["leases"]
    return {
        "api": "python",
        "transport": args.transport,
        "processes": "1",
        "block_bytes": block,
        "bytes": moved // max(args.iters, 1),
        "n": n,
        "parents": parents,
        "iters": args.iters,
        "connections": args.connections,
        "gib_per_s": gib / max(seconds, 1e-9),
        "blocks_per_s": (moved // block) / max(seconds, 1e-9),
        "p50_us": percentile(latencies, 0.5),
        "p99_us": percentile(latencies, 0.99),
        "max_us": latencies[-1] if latencies else 0.0,
        "cpu_s_per_gib": cpu / max(gib, 1e-12),
        "api_us_per_parent": statistics.median(api_seconds) * 1e6 if api_seconds else 0.0,
        "verified": verified,
        "prefill": {
            "leased": leases["leased"],
            "pulled": leases["pulled"],
            "released": leases["released"],
            "expired": leases["expired"],
            "unrecognized": leases["unrecognized"],
            "bytes_served": stats["server"]["bytes_served"],
        },
    }


def prefill_server(args: argparse.Namespace) -> int:
    """``--prefill-server``: the prefill half of ``--latency``, one JSON request per stdin
    line (``lease``, ``raw_rtt``, ``stats``), one JSON answer per stdout line."""
    block = args.block_bytes[0]
    blocks = args.blocks
    src = latency_source(block, blocks)
    prefill = kvxfer.PrefillAgent(
        kvxfer.Memory([kvxfer.Segment(src, block_bytes=block)], num_blocks=blocks),
        agent_name="bench-prefill",
        worker_threads=args.worker_threads,
        transport=args.transport,
    )
    raw_listener: Optional[socket.socket] = None
    try:
        for line in sys.stdin:
            req = json.loads(line)
            op = req.get("op")
            if op == "lease":
                handoffs = prefill.lease_parent(req["parent"], req["blocks"])
                prefill.poll_ends()
                reply: dict[str, Any] = {"params": [h.to_params() for h in handoffs]}
            elif op == "raw_rtt" and raw_listener is None:
                # A responder in this process, for runs without --raw-with.
                raw_listener = socket.create_server(("127.0.0.1", 0))
                threading.Thread(target=raw_responder, args=(raw_listener, block), daemon=True).start()
                reply = {"addr": "%s:%d" % raw_listener.getsockname()[:2]}
            elif op == "stats":
                reply = {"leases": prefill.stats()["leases"]}
            else:
                reply = {"error": f"unexpected request {op!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        prefill.shutdown()
        if raw_listener is not None:
            raw_listener.close()
    return 0


def latency_source(block: int, blocks: int) -> Any:
    """The prefill cache of a ``--latency`` run: the same bytes in both processes, so the
    decode side checks every block it pulled."""
    return np.random.default_rng(block).integers(0, 256, size=blocks * block, dtype=np.uint8)


def raw_responder(listener: socket.socket, block: int) -> None:
    """Answers every 64-byte request on one connection with ``block`` bytes."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = bytes(block)
    req = bytearray(64)
    with conn:
        while conn.recv_into(req, 64, socket.MSG_WAITALL) == 64:
            conn.sendall(data)


class LatencyPeers:
    """The other processes of a ``--latency`` run: the prefill process (leases on request)
    and, with ``--raw-with``, ``kvxfer-bench serve`` (the raw round trip's responder). Every
    one is stopped on exit, whatever failed."""

    TIMEOUT = 30.0

    def __init__(self, args: argparse.Namespace, block: int) -> None:
        self.serve: Optional[subprocess.Popen[str]] = None
        self.control: Optional[socket.socket] = None
        self.child = subprocess.Popen(
            [sys.executable, "-m", "kvxfer.bench", "--prefill-server", "--block-bytes", str(block),
             "--blocks", str(args.blocks), "--worker-threads", str(args.worker_threads),
             "--transport", args.transport],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        """One request to the prefill process and its answer."""
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps(req) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        if not line:
            raise SystemExit(f"the prefill process ended (exit {self.child.poll()}) before answering {req['op']}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"prefill process: {reply['error']}")
        return reply

    def raw_responder(self, raw_with: Optional[str], block: int) -> tuple[str, int]:
        """The address of a raw round-trip responder in another process."""
        if not raw_with:
            addr = self.ask({"op": "raw_rtt"})["addr"]
        else:
            self.serve = subprocess.Popen([raw_with, "serve", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
            assert self.serve.stdout is not None
            control = self.serve.stdout.readline().rsplit(" ", 1)[-1].strip()
            host, port = control.rsplit(":", 1)
            self.control = socket.create_connection((host, int(port)), timeout=self.TIMEOUT)
            self.control.sendall((json.dumps({"op": "raw_rtt_responder", "block_bytes": block}) + "\n").encode())
            answer = json.loads(self.control.makefile().readline() or "{}")
            if "addr" not in answer:
                raise SystemExit(f"{raw_with} serve: no raw responder: {answer}")
            addr = answer["addr"]
        host, port = addr.rsplit(":", 1)
        return host, int(port)

    def close(self) -> None:
        for step in (self._close_child, self._close_serve):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - cleanup goes on; the run's own error wins
                print(f"kvxfer.bench --latency: cleanup: {e}", file=sys.stderr)

    def _close_child(self) -> None:
        try:
            if self.child.stdin is not None:
                self.child.stdin.close()
            self.child.wait(timeout=self.TIMEOUT)
        finally:
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait()

    def _close_serve(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.serve is not None:
            self.serve.kill()
            self.serve.wait()


def run_latency(args: argparse.Namespace, block: int) -> dict[str, Any]:
    """``--latency``: one-block hand-offs from a prefill process, each paired with a raw
    round trip of the same block taken right after it; every pulled block checked."""
    blocks = args.blocks
    expected = latency_source(block, blocks)
    dst = np.zeros(blocks * block, dtype=np.uint8)
    handoffs: list[float] = []
    rtts: list[float] = []
    # Counted CPU of this (decode) process over the hand-offs alone, submit to report, every
    # thread (the agent's runtime included): CLOCK_PROCESS_CPUTIME_ID (time.process_time,
    # exact, not tick-sampled); and its context switches (getrusage).
    cpu_s = 0.0
    # The calling thread's own share (CLOCK_THREAD_CPUTIME_ID): in submit, and in wait; the
    # rest of cpu_s is every other thread of the process over the same windows (the agent's
    # runtime thread or threads, mostly).
    submit_s = wait_s = 0.0
    switches = 0
    with contextlib.ExitStack() as stack:
        peers = LatencyPeers(args, block)
        stack.callback(peers.close)
        decode = kvxfer.DecodeAgent(
            kvxfer.Memory([kvxfer.Segment(dst, block_bytes=block)], num_blocks=blocks),
            agent_name="bench-decode",
            connections_per_peer=args.connections,
            worker_threads=args.worker_threads,
            transport=args.transport,
            notify_with_read=args.notify_with_read,
        )
        stack.callback(decode.shutdown)
        raw = socket.create_connection(peers.raw_responder(args.raw_with, block), timeout=LatencyPeers.TIMEOUT)
        stack.callback(raw.close)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking, so one MSG_WAITALL receive takes the whole block (a timeout would make
        # Python poll first and receive what is there).
        raw.settimeout(None)
        request, answer = b"\1" * 64, bytearray(block)
        for it in range(args.warmup + args.iters):
            b = it % blocks
            params = peers.ask({"op": "lease", "parent": f"lat-{it}", "blocks": [[b]]})["params"]
            dst[b * block : (b + 1) * block] = 0
            r0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
            t0, th0 = time.perf_counter(), time.thread_time()
            pull = decode.submit(params, [[b]])
            th1 = time.thread_time()
            reports = pull.wait(timeout=LatencyPeers.TIMEOUT)
            t1, th2 = time.perf_counter(), time.thread_time()
            c1, r1 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            if it >= args.warmup:
                cpu_s += c1 - c0
                submit_s += th1 - th0
                wait_s += th2 - th1
                switches += (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw)
            raw.sendall(request)
            got = raw.recv_into(answer, block, socket.MSG_WAITALL)
            t2 = time.perf_counter()
            if reports[0]["outcome"] != "done":
                raise SystemExit(f"hand-off {it}: {reports[0]['outcome']} {reports[0]['error']}")
            if got != block:
                raise SystemExit(f"raw round trip {it}: {got} of {block} bytes")
            if not np.array_equal(dst[b * block : (b + 1) * block], expected[b * block : (b + 1) * block]):
                raise SystemExit(f"hand-off {it}: block {b} does not hold the prefill's bytes")
            if it >= args.warmup:
                handoffs.append((t1 - t0) * 1e6)
                rtts.append((t2 - t1) * 1e6)
        leases = peers.ask({"op": "stats"})["leases"]
        with_read = decode.stats()["notifies_with_read"]
    ratios = sorted(h / r for h, r in zip(handoffs, rtts))
    handoffs.sort()
    rtts.sort()
    return {
        "api": "python",
        "mode": "latency",
        "transport": args.transport,
        "processes": "2",
        "block_bytes": block,
        "iters": args.iters,
        "worker_threads": args.worker_threads,
        "notify_with_read": args.notify_with_read,
        "notifies_with_read": with_read,
        "raw_responder": "kvxfer-bench serve" if args.raw_with else "python",
        "handoff_p10_us": percentile(handoffs, 0.1),
        "handoff_p50_us": percentile(handoffs, 0.5),
        "handoff_p99_us": percentile(handoffs, 0.99),
        "raw_rtt_p10_us": percentile(rtts, 0.1),
        "raw_rtt_p50_us": percentile(rtts, 0.5),
        "raw_rtt_p99_us": percentile(rtts, 0.99),
        "handoff_vs_raw_rtt_paired_p50": percentile(ratios, 0.5),
        "handoff_vs_raw_rtt_paired_p10": percentile(ratios, 0.1),
        "decode_cpu_us_per_handoff": round(cpu_s * 1e6 / max(args.iters, 1), 1),
        "decode_context_switches_per_handoff": round(switches / max(args.iters, 1), 2),
        "decode_caller_submit_cpu_us": round(submit_s * 1e6 / max(args.iters, 1), 1),
        "decode_caller_wait_cpu_us": round(wait_s * 1e6 / max(args.iters, 1), 1),
        "decode_runtime_cpu_us": round((cpu_s - submit_s - wait_s) * 1e6 / max(args.iters, 1), 1),
        "verified": True,
        "prefill": {k: leases[k] for k in ("leased", "pulled", "released", "expired")},
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'block':>9} {'bytes':>10} {'GiB/s':>9} {'blocks/s':>12} {'p50 us':>10} {'p99 us':>10} {'max us':>10} "
        f"{'CPU s/GiB':>9} {'verified':>8}"
    )
    for m in rows:
        verified = "skipped" if m["verified"] is None else str(m["verified"]).lower()
        print(
            f"{human(m['block_bytes']):>9} {human(m['bytes']):>10} {m['gib_per_s']:>9.3f} {m['blocks_per_s']:>12.0f} "
            f"{m['p50_us']:>10.0f} {m['p99_us']:>10.0f} {m['max_us']:>10.0f} {m['cpu_s_per_gib']:>9.3f} {verified:>8}"
        )


def workload_flags(args: argparse.Namespace) -> list[str]:
    """The flags both benchmarks share, so a paired run moves the same workload."""
    return [
        "--block-bytes",
        ",".join(str(b) for b in args.block_bytes),
        "--total-bytes",
        str(args.total_bytes),
        "--n",
        str(args.n),
        "--parents",
        str(args.parents),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--connections",
        str(args.connections),
        "--worker-threads",
        str(args.worker_threads),
        "--json",
    ] + (["--no-verify"] if args.no_verify else [])


def json_lines(cmd: list[str]) -> list[dict[str, Any]]:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def paired(args: argparse.Namespace) -> int:
    """Rust and Python runs alternated, ``--rounds`` each; medians and the ratio."""
    flags = workload_flags(args)
    rust_cmd = [args.pair_with, "--transport", args.transport] + flags
    py_cmd = [sys.executable, "-m", "kvxfer.bench", "--transport", args.transport] + flags + (["--numpy-hugepages"] if args.numpy_hugepages else [])
    samples: dict[str, dict[int, list[dict[str, Any]]]] = {"rust": {}, "python": {}}
    for r in range(args.rounds):
        order = [("rust", rust_cmd), ("python", py_cmd)] if r % 2 == 0 else [("python", py_cmd), ("rust", rust_cmd)]
        for name, cmd in order:
            for row in json_lines(cmd):
                if row.get("verified") is False:
                    raise SystemExit(f"{name}: verification failed: {row}")
                samples[name].setdefault(row["block_bytes"], []).append(row)
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
    results = []
    for block in args.block_bytes:
        row: dict[str, Any] = {"block_bytes": block, "rounds": args.rounds}
        for name in ("rust", "python"):
            rows = samples[name].get(block, [])
            for key in ("gib_per_s", "p50_us", "p99_us", "cpu_s_per_gib"):
                row[f"{name}_{key}"] = statistics.median(x[key] for x in rows) if rows else None
            row[f"{name}_gib_per_s_all"] = [round(x["gib_per_s"], 3) for x in rows]
        row["python_api_us_per_parent"] = statistics.median(
            x["api_us_per_parent"] for x in samples["python"].get(block, [])
        )
        row["python_over_rust"] = row["python_gib_per_s"] / row["rust_gib_per_s"]
        # Each round ran both back to back: the median of the per-round ratios is less
        # sensitive to load that changes between rounds than the ratio of the medians.
        pairs = zip(samples["rust"].get(block, []), samples["python"].get(block, []))
        row["python_over_rust_paired_median"] = statistics.median(p["gib_per_s"] / r["gib_per_s"] for r, p in pairs)
        results.append(row)
    if args.json:
        for row in results:
            print(json.dumps(row))
    else:
        print(
            f"{'block':>9} {'Rust GiB/s':>11} {'Python GiB/s':>13} {'Py/Rust':>8} {'paired':>7} "
            f"{'Rust p50 us':>12} {'Py p50 us':>10} {'Rust CPU s/GiB':>15} {'Py CPU s/GiB':>13} {'Py API us':>10}"
        )
        for row in results:
            print(
                f"{human(row['block_bytes']):>9} {row['rust_gib_per_s']:>11.3f} {row['python_gib_per_s']:>13.3f} "
                f"{row['python_over_rust']:>8.3f} {row['python_over_rust_paired_median']:>7.3f} "
                f"{row['rust_p50_us']:>12.0f} {row['python_p50_us']:>10.0f} "
                f"{row['rust_cpu_s_per_gib']:>15.3f} {row['python_cpu_s_per_gib']:>13.3f} "
                f"{row['python_api_us_per_parent']:>10.0f}"
            )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-bytes", type=lambda s: [parse_size(x) for x in s.split(",")], default=[64 << 10, 2 << 20])
    ap.add_argument("--total-bytes", type=parse_size, default=512 << 20)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--parents", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--connections", type=int, default=2)
    ap.add_argument("--worker-threads", type=int, default=2)
    ap.add_argument(
        "--transport",
        choices=("tcp", "auto", "ucx"),
        default="tcp",
        help="the agents' data path (default tcp: the one the raw TCP and --pair-with baselines measure)",
    )
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument(
        "--numpy-hugepages",
        action="store_true",
        help="let numpy madvise huge pages for its arrays (kvxfer-bench's memory does not: off for paired runs)",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per block size")
    ap.add_argument("--pair-with", metavar="KVXFER_BENCH", help="alternate runs with this kvxfer-bench binary")
    ap.add_argument("--rounds", type=int, default=5, help="paired runs of each (with --pair-with)")
    ap.add_argument("--latency", action="store_true", help="one-block hand-offs across two processes, paired with raw round trips")
    ap.add_argument("--notify-with-read", action="store_true", help="--latency: the decode agent's notify_with_read")
    ap.add_argument("--raw-with", metavar="KVXFER_BENCH", help="--latency: the raw round trip's responder in `KVXFER_BENCH serve`")
    ap.add_argument("--blocks", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prefill_server:
        return prefill_server(args)
    if args.latency:
        for block in args.block_bytes:
            row = run_latency(args, block)
            print(json.dumps(row) if args.json else "\n".join(f"{k}: {v}" for k, v in row.items()), flush=True)
        return 0
    if args.pair_with:
        return paired(args)
    rows = []
    for block in args.block_bytes:
        row = run_block_size(args, block)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print_table(rows)
    return 0 if all(r["verified"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
