#!/usr/bin/env python3
"""Where a benchmark's CPU goes: runs a command, samples the processes named by ``--proc``
with ``perf record`` (from ``--after`` seconds after the start, for ``--seconds``), and
prints one JSON line per process with the share of its samples in each category:

- ``crc32c``: the integrity check's CRC-32C;
- ``scheduling``: the kernel switching threads, waking others, putting one to sleep (futex,
  epoll, eventfd), whoever's code asked (an engine's thread waiting for a pull included;
  interrupt work that runs as a switch re-enables interrupts lands here too);
- ``harness``: the benchmark's own work (``kvxfer_bench::``, its byte patterns and their
  check, or the Python benchmark's interpreter frames, where the stack shows them) outside
  kvxfer's calls, the kernel's work on its behalf included (its lease requests' sockets),
  but not its sleeps and wake-ups (``scheduling``);
- ``payload_copy``: the kernel copying payload bytes to or from user memory;
- ``allocator``: malloc and free;
- ``kernel_other``: the rest of the kernel (the TCP/IP stack and syscall entry, mostly);
- ``python``: the Python interpreter (``libpython``) outside kvxfer's calls;
- ``user_other``: the rest of user space (kvxfer, tokio, libc).

Each sample falls in the first category that matches, in that order (a CRC sample inside a
syscall is ``crc32c``). Shares are of the process's own samples; ``us_per_unit`` turns them
into µs of the process's counted CPU per unit, read from the run's own JSON output with
``--unit-key NAME=KEY`` (the last line that has KEY: ``cpu_us_per_request`` for a decode
process of the many-parents workload, ``decode_cpu_us_per_handoff`` for the Python
binding's latency run, ...).

Example (the many-parents row, blocking facade, each process on its own core)::

    scripts/cpu-profile.py --proc prefill="kvxfer-bench serve" --proc decode="kvxfer-bench pull" \\
        --unit-key decode=cpu_us_per_request --unit-key prefill=prefill_cpu_us_per_request \\
        --after 1.5 --seconds 2.5 -- scripts/bench-two-process.sh --serve-cpus 0 --pull-cpus 1 --transport tcp \\
        --block-bytes 64K --n 4 --blocks-per-child 2 --concurrency 256 --duration 4 \\
        --warmup-secs 1 --json --notify-with-read

Needs ``perf`` (linux-perf) and permission to trace the processes (root, or
``kernel.perf_event_paranoid`` ≤ 1). Not part of the test suite: a measurement tool.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

# (category, regex over one stack frame, where): "leaf" matches the sampled frame only,
# "any" any frame of the stack.
CATEGORIES: list[tuple[str, str, str]] = [
    ("crc32c", r"crc32|crc_fast|crc32c", "any"),
    ("scheduling", r"(finish_task_switch|__schedule|schedule\b|try_to_wake_up|futex|do_epoll_wait|ep_poll|eventfd|pick_next_task|dequeue_task|enqueue_task|ttwu|__wake_up).*\[kernel\.kallsyms\]", "any"),
    ("harness", r"kvxfer_bench::|kvxfer_mem::pattern::|kvxfer/bench\.py|_PyEval_EvalFrame", "harness"),
    ("payload_copy", r"_copy_to_iter|_copy_from_iter|copy_user|rep_movs_alternative|copy_page_to_iter|copy_page_from_iter", "leaf"),
    ("allocator", r"^(_int_malloc|_int_free|malloc|cfree|free|__libc_free|__libc_malloc|unlink_chunk|malloc_consolidate|tcache_get|tcache_put|_int_realloc|realloc|__rustc::__rdl_alloc|__rustc::__rdl_dealloc)\b|__GI___libc_free|__GI___libc_malloc", "leaf"),
    ("kernel_other", r"\[kernel\.kallsyms\]", "leaf"),
    ("python", r"libpython", "leaf"),
]
# The agent's own work: kvxfer's code (not the bench's byte patterns, kvxfer_mem::pattern,
# which are harness) and the runtime that drives it (a bench thread that drives a
# current-thread runtime runs the agent's I/O and tasks under its own frames).
KVXFER_CALL = re.compile(r"\bkvxfer(_core|_tcp|_ucx)?::|\bkvxfer_mem::(?!pattern::)|_kvxfer::|\btokio::|\bmio::")


def parse_samples(text: str) -> list[list[str]]:
    """Stacks (leaf first) from ``perf script -F comm,tid,ip,sym,dso`` output."""
    stacks, cur = [], None
    for line in text.splitlines():
        if not line.strip():
            if cur:
                stacks.append(cur)
            cur = None
            continue
        if not line[0].isspace():
            cur = []
            continue
        if cur is not None:
            parts = line.strip().split(" ", 1)
            cur.append(parts[1] if len(parts) > 1 else parts[0])
    if cur:
        stacks.append(cur)
    return stacks


def category(stack: list[str]) -> str:
    for name, pattern, where in CATEGORIES:
        rx = re.compile(pattern)
        if where == "leaf" and rx.search(stack[0]):
            return name
        if where == "any" and any(rx.search(f) for f in stack):
            return name
        if where == "harness":
            # The harness frame nearest the leaf, with no kvxfer or runtime frame between it
            # and the leaf.
            for f in stack:
                if KVXFER_CALL.search(f):
                    break
                if rx.search(f):
                    return name
    return "user_other"


def descendants(root: int) -> set[int]:
    """Every process below ``root`` now (from each process's parent in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces and parentheses.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def find_pid(pattern: str, command: subprocess.Popen[str], deadline: float) -> int:
    """The one process ``command`` started (or itself) whose command line matches
    ``pattern`` (``pgrep -f``) and has no other match below it (a wrapper such as
    ``timeout`` or ``bash -c`` names the pattern too, above what it runs). Several such
    processes are an error: a pattern that names one process is needed."""
    root = command.pid
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        below = descendants(root) | {root}
        theirs = {int(p) for p in out if int(p) in below}
        leaves = [p for p in theirs if not (descendants(p) & theirs)]
        if len(leaves) > 1:
            raise SystemExit(f"cpu-profile: {pattern!r} matches several processes ({sorted(leaves)}): name one")
        if leaves:
            return leaves[0]
        if command.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"cpu-profile: no process matching {pattern!r} appeared under the command")


def stop(command: subprocess.Popen[str]) -> None:
    """Stops the command and every process of its process group (its own: see main), those
    whose parent already exited included: TERM, then KILL to whatever is left."""
    import signal

    group = command.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            command.poll()  # reap the leader
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proc", action="append", required=True, metavar="NAME=PATTERN",
                    help="a process to sample, found by `pgrep -f PATTERN` (repeatable)")
    ap.add_argument("--after", type=float, default=1.0,
                    help="seconds after the start before the processes are looked for and sampled (skips start-up)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds to sample")
    ap.add_argument("--freq", type=int, default=499,
                    help="samples per second (perf's sampling is charged to the process: lower is lighter)")
    ap.add_argument("--unit-key", action="append", default=[], metavar="NAME=KEY",
                    help="the key of the run's JSON output that holds the process's counted CPU per unit (µs)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("cpu-profile: perf is not installed (apt install linux-perf)")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("cpu-profile: no command given")
    procs = dict(p.split("=", 1) for p in args.proc)
    unit_keys = dict(c.split("=", 1) for c in args.unit_key)
    tmp = tempfile.mkdtemp(prefix="kvxfer-cpu-profile-")
    # In a process group of its own, so a failure stops everything it started.
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    recorders = {}
    try:
        # Found after the warm-up wait: by then a wrapper has started what it wraps.
        time.sleep(args.after)
        deadline = time.monotonic() + 60
        pids = {name: find_pid(pattern, bench, deadline) for name, pattern in procs.items()}
        for name, pid in pids.items():
            data = os.path.join(tmp, f"{name}.data")
            recorders[name] = (data, subprocess.Popen(
                ["perf", "record", "-q", "-F", str(args.freq), "--call-graph", "dwarf,16384", "-o", data,
                 "-p", str(pid), "--", "sleep", str(args.seconds)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for _, r in recorders.values():
            r.wait()
        bench_out, _ = bench.communicate(timeout=600)
        if bench.returncode != 0:
            raise SystemExit(f"cpu-profile: the command failed ({bench.returncode})")
        out_rows = []
        for line in (bench_out or "").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out_rows.append(row)
        cpu_us = {}
        for name, key in unit_keys.items():
            found = [r[key] for r in out_rows if isinstance(r.get(key), (int, float))]
            if not found:
                raise SystemExit(f"cpu-profile: the run printed no {key!r} for {name}")
            cpu_us[name] = float(found[-1])
        for name, (data, _) in recorders.items():
            script = subprocess.run(["perf", "script", "-i", data, "-F", "comm,tid,ip,sym,dso"],
                                    capture_output=True, text=True).stdout
            stacks = [s for s in parse_samples(script) if s]
            counts = Counter(category(s) for s in stacks)
            total = max(len(stacks), 1)
            shares = {c: round(counts.get(c, 0) / total, 4) for c in [c for c, _, _ in CATEGORIES] + ["user_other"]}
            row = {"process": name, "pattern": procs[name], "samples": len(stacks), "shares": shares,
                   "percent": {c: round(100 * v, 1) for c, v in shares.items()}, "command": " ".join(command)}
            if name in cpu_us:
                row["cpu_us_per_unit"] = round(cpu_us[name], 1)
                row["us_per_unit"] = {c: round(s * cpu_us[name], 1) for c, s in shares.items()}
            print(json.dumps(row))
        sys.stdout.flush()
        # The run's own output (its counted CPU among it), for the µs per category.
        sys.stderr.write(bench_out or "")
    finally:
        for _, r in recorders.values():
            if r.poll() is None:
                r.kill()
        stop(bench)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
