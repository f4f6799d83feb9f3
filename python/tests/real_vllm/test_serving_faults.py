"""Disaggregated serving under load and faults: real engines of vLLM's CPU build (two prefill
instances sharing one core and a decode instance on the other, each a ``vllm serve`` process
with kvxfer's connector; ``KVXFER_FAULTS_PREFILLS=1`` for one prefill) behind
``python -m kvxfer.proxy``, driven by ``kvxfer.loadgen`` (n = 1 and 4,
streamed and not, completions and chat, multi-turn prompts, a share of clients that give up
at random moments) while the runner:

1. kills the decode instance (``kill -9``, its whole process group) and starts it again;
2. kills the router and starts it again on its port;
3. kills the first prefill instance and, after a third of a phase of load on the second
   alone, starts it again with the load held (an engine starting beside a loaded one on its
   core takes minutes on two cores): the router routes around the dead one, so no request
   that starts while it is down may fail;
4. sends a prefill request whose decode leg never comes (a client that left between them);

then stops the load, lets the engines quiesce and checks what must hold whatever happened:

- every request ended — with an answer or an OpenAI-style error — within the bound
  (lease TTL + io timeout + slack; a request in flight when its instance died included);
- the errors are of the kinds a fault explains (502s, cut streams, connection errors while
  the router was down), never a short or malformed answer;
- every answer that came back equals the prefill engine's own for the same seed (no decode
  read KV that was not its prompt's);
- the restarted first prefill balances its leases (made = pulled + released + expired, none
  live) with exactly one expired — the hand-off whose decode never came —; the second
  prefill, alive through every kill, balances with at most the requests in flight at the
  decode's and the router's kills expired; and every engine's KV-cache usage goes back to
  idle within a lease TTL.

The short form (the default: 4 clients, faults a few seconds apart, about 5 minutes on two
cores with the engines' restarts) runs in the README's test command. The long form:
``KVXFER_FAULTS_CONCURRENCY=32 KVXFER_FAULTS_SECONDS=600`` (load before, between and after
the faults) and ``KVXFER_FAULTS_REPORT=<file>`` to keep the JSON report
(BENCHMARKING.md, "Serving under faults").
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_serve_router import (  # noqa: E402
    CPU_PY,
    Proc,
    engine_argv,
    engine_env,
    free_port,
    http_get,
    make_model,
    on_core,
    wait_ready,
)

loadgen = pytest.importorskip("kvxfer.loadgen", reason="the load generator needs aiohttp (the `proxy` extra)")

# s: the connector's default. Two cores carry three engines, the router and the clients here:
# an engine restarting on one starves the others for seconds, and a pull of a prefill that
# just came back can time out (then its lease is released once the prefill answers again);
# with a 10 s TTL such leases expired first (KVXFER_FAULTS_LEASE_TTL sets another).
LEASE_TTL = int(os.environ.get("KVXFER_FAULTS_LEASE_TTL", "30"))
IO_TIMEOUT = 10  # s: the connector's default kvxfer_io_timeout
SLACK = 60  # s: an engine starting on the other core starves the one serving
BOUND = LEASE_TTL + IO_TIMEOUT + SLACK
CONCURRENCY = int(os.environ.get("KVXFER_FAULTS_CONCURRENCY", "4"))
# Seconds of load before the first fault, between faults and after the last.
PHASE = float(os.environ.get("KVXFER_FAULTS_SECONDS", "60")) / 4
REPORT = os.environ.get("KVXFER_FAULTS_REPORT")
# Prefill instances behind the router (the first is the one killed; a second shares its core).
PREFILLS = int(os.environ.get("KVXFER_FAULTS_PREFILLS", "2"))
PREFILL_NAMES = ["prefill"] + [f"prefill{i}" for i in range(2, PREFILLS + 1)]


class Stack:
    """The engines and the router, each restartable on its port."""

    def __init__(self, work: str, model: str) -> None:
        self.work = work
        self.model = model
        self.env = engine_env()
        names = [*PREFILL_NAMES, "decode", "router"]
        self.ports = {name: free_port() for name in names}
        self.procs: dict[str, Proc] = {}
        self.starts = {name: 0 for name in names}
        self.all_procs: list[Proc] = []

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self, name: str) -> None:
        self.starts[name] += 1
        label = f"{name}-{self.starts[name]}"
        if name == "router":
            argv = [
                sys.executable, "-m", "kvxfer.proxy", "--port", str(self.ports["router"]),
                *(a for name in PREFILL_NAMES for a in ("--prefill", self.url(name))),
                "--decode", self.url("decode"), "--timeout", "300",
                "--log-level", "debug",
            ]
            env = self.env
        else:
            role, core = ("kv_producer", 0) if name.startswith("prefill") else ("kv_consumer", 1)
            argv = engine_argv(self.model, self.ports[name], role, LEASE_TTL)
            if name == "decode":
                # As a deployment that rides out faults would: a hand-off the decode cannot
                # read (its prefill died) is computed locally instead of failing the request.
                at = argv.index("--kv-transfer-config") + 1
                argv[at] = json.dumps(dict(json.loads(argv[at]), kv_load_failure_policy="recompute"))
            env = on_core(self.env, core)
        proc = Proc(label, argv, env, self.work)
        self.procs[name] = proc
        self.all_procs.append(proc)

    def ready(self, name: str) -> None:
        wait_ready(self.procs[name], self.url(name), timeout=900 if name != "router" else 60)

    def kill9(self, name: str) -> None:
        """``kill -9`` of the instance's whole process group (its API server and engine)."""
        proc = self.procs[name]
        try:
            os.killpg(proc.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.p.wait(timeout=60)

    def metrics(self, name: str) -> dict[str, float]:
        status, text = http_get(self.url(name) + "/metrics")
        assert status == 200, text[:300]
        return loadgen.parse_metrics(text)

    def tails(self) -> str:
        return "\n".join(p.tail(40) for p in self.all_procs)

    def stop(self) -> None:
        for p in reversed(self.all_procs):
            p.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("serving_faults"))
    s = Stack(work, make_model(CPU_PY, work))
    try:
        for name in [*PREFILL_NAMES, "decode"]:
            s.start(name)
        for name in [*PREFILL_NAMES, "decode"]:
            s.ready(name)
        s.start("router")
        s.ready("router")
        yield s
    finally:
        s.stop()


def never_decoded(stack: Stack) -> None:
    """A prefill request as the router sends it, whose decode request never comes."""
    body = {
        "model": "tiny", "prompt": "a hand-off nobody comes for " * 4, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": 1},
    }
    req = urllib.request.Request(
        stack.url("prefill") + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    assert answer.get("kv_transfer_params"), f"the prefill answer has no hand-off: {answer}"


# What a fault may cause, and for how long after its instance is back (a decode request whose
# hand-off the dead prefill made fails while the restarted one takes over; a lease TTL).
FAULT_ERRORS = {"http_502", "http_500", "stream_error", "stream_cut", "answer_cut", "connection"}
AFTERMATH = {"decode": 10.0, "router": 5.0, "prefill": LEASE_TTL + 10.0}


def unexplained_errors(results: list[Any], t0: float, at: dict[str, float]) -> list[str]:
    """Failed requests (not given up by their client) that no fault explains: of another
    kind than a dead instance causes, or not overlapping the time an instance was down
    (from its kill to its return, and its aftermath)."""
    windows = [(at[f"{n} killed"], at[f"{n} back"] + AFTERMATH[n]) for n in AFTERMATH]
    out = []
    for r in results:
        if r.error is None or r.aborted:
            continue
        start, end = r.started - t0, r.started - t0 + r.latency
        if r.error not in FAULT_ERRORS or not any(start <= b and end >= a for a, b in windows):
            out.append(f"{r.error} at {start:.1f}-{end:.1f} s: {r.detail}")
    return out


def phases(results: list[Any], t0: float, at: dict[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Latency and errors of the requests that ended before the first fault, of those that
    overlapped the faults (from the decode's kill to the prefill's return) and of those that
    started after; and for each instance killed, the seconds from its kill to the first
    request (started after it) that succeeded."""
    keys = ("requests", "ok", "aborted", "errors", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s")
    kill, back = at["decode killed"], at["prefill back"]
    spans = {
        "before faults": (0.0, kill, lambda s, e: e < kill),
        "faults": (kill, back, lambda s, e: e >= kill and s < back),
        "after faults": (back, at["load stopped"], lambda s, e: s >= back),
    }
    out = {}
    for name, (a, b, within) in spans.items():
        chosen = [r for r in results if within(r.started - t0, r.started - t0 + r.latency)]
        summary = loadgen.summarize(chosen, b - a)
        out[name] = {k: summary[k] for k in keys}
    recovery = {}
    for name in ("decode", "router", "prefill"):
        killed = at[f"{name} killed"]
        done = [r.started - t0 + r.latency for r in results if r.ok and r.started - t0 >= killed]
        recovery[name] = round(min(done) - killed, 1) if done else None
    return out, recovery


def ended_leases(m: dict[str, float]) -> float:
    return sum(m.get(f"leases_{k}", 0.0) for k in ("pulled", "released", "expired"))


def errors_within(results: list[Any], t0: float, at: dict[str, float], name: str) -> list[str]:
    """Failed requests (not given up by their client) that started while ``name`` was down."""
    a, b = at[f"{name} killed"], at.get("load held", at[f"{name} back"])
    return [
        f"{r.error} at {r.started - t0:.1f} s: {r.detail}"
        for r in results
        if r.error is not None and not r.aborted and a <= r.started - t0 <= b
    ]


def test_no_request_hangs_and_no_block_is_stranded_through_kills_and_restarts(stack):
    cfg = loadgen.LoadConfig(
        url=stack.url("router"), duration=24 * 3600, concurrency=CONCURRENCY, abort_share=0.1,
        request_timeout=BOUND + 60, max_tokens=8,
    )
    results: list[Any] = []
    stop, hold = threading.Event(), threading.Event()
    report: dict[str, Any] = {}
    crashed: list[BaseException] = []

    def drive() -> None:
        try:
            report.update(asyncio.run(loadgen.run_load(cfg, results, stop, hold)))
        except BaseException as e:  # reported below: a crashed load must not pass quietly
            crashed.append(e)

    load = threading.Thread(target=drive)
    timeline: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - t0, 1), what))

    load.start()
    try:
        time.sleep(PHASE)
        mark("decode killed")
        stack.kill9("decode")
        stack.start("decode")
        stack.ready("decode")
        mark("decode back")
        time.sleep(PHASE / 3)
        mark("router killed")
        stack.kill9("router")
        stack.start("router")
        stack.ready("router")
        mark("router back")
        time.sleep(PHASE / 3)
        mark("prefill killed")
        stack.kill9("prefill")
        if len(PREFILL_NAMES) > 1:
            # The other prefill serves the load alone; then the load is held while the
            # killed one starts again: on two cores an engine starting beside a loaded one
            # on its core takes minutes.
            time.sleep(PHASE / 3)
            mark("load held")
            hold.set()
        stack.start("prefill")
        stack.ready("prefill")
        mark("prefill back")
        prefill_back = len(results)
        # Its first answer (a fresh engine's slowest: 40 s once in CI beside the loaded
        # second prefill, while clients gave up on the requests routed to it) comes before
        # the load resumes.
        never_decoded(stack)
        mark("a prefill answer never decoded")
        hold.clear()
        time.sleep(PHASE)
    finally:
        stop.set()
        load.join(timeout=BOUND + 120)
        mark("load stopped")
    assert not load.is_alive(), "a client is still waiting for an answer"
    assert not crashed, f"the load generator crashed: {crashed[0]!r}"
    assert report.get("requests"), f"no load report: {report}"
    try:
        # Quiesce: the leases of the prefill's last incarnation all end (the never-decoded one
        # by expiry, one TTL after it) and both caches go back to idle.
        deadline = time.monotonic() + LEASE_TTL + 30
        while True:
            p, d = stack.metrics("prefill"), stack.metrics("decode")
            others = {name: stack.metrics(name) for name in PREFILL_NAMES[1:]}
            ended = ended_leases(p)
            idle = all(m.get("kv_cache_usage_perc", 0.0) == 0.0 for m in (p, d, *others.values()))
            balanced = all(ended_leases(m) == m.get("leases_made", 0.0) for m in others.values())
            if (ended == p.get("leases_made", 0.0) and p.get("leases_expired", 0.0) >= 1 and idle and balanced) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(1)
        mark("quiesced")
        reference = asyncio.run(loadgen.check_against_reference(
            loadgen.LoadConfig(url=cfg.url, reference=stack.url("prefill"), request_timeout=120, concurrency=4), results
        ))
        status, health = http_get(stack.url("router") + "/health")
        router = json.loads(health) if status in (200, 503) else {}
        summary = loadgen.summarize(results, report.get("wall_s") or 0.0)
        summary["router_released"] = {k: router.get(k) for k in ("leases_released", "releases_refused")}
        summary["phases"], summary["kill_to_first_answer_s"] = phases(results, t0, dict((w, t) for t, w in timeline))
        if others:
            summary["other_prefills"] = others
            summary["errors_while_the_prefill_was_down"] = errors_within(
                results, t0, dict((w, t) for t, w in timeline), "prefill"
            )
        summary.update(reference=reference, prefill=p, decode=d, timeline=timeline, bound_s=BOUND,
                       after_prefill_restart_ok=sum(1 for r in results[prefill_back:] if r.ok))
        print(json.dumps(summary, indent=2))
        if REPORT:
            with open(REPORT, "w") as f:
                json.dump(summary, f, indent=2)

        late = [r for r in results if not r.aborted and r.latency > BOUND]
        assert not late, f"{len(late)} requests outlived {BOUND} s: {[(r.error, r.latency) for r in late[:5]]}"
        unexplained = unexplained_errors(results, t0, dict((w, t) for t, w in timeline))
        assert not unexplained, f"{len(unexplained)} errors no fault explains: {unexplained[:5]}"
        assert summary["after_prefill_restart_ok"] > 0, "no request succeeded after the prefill came back"
        assert reference["differ"] == 0, f"answers differ from the prefill engine's: {reference['examples']}"
        assert reference["checked"] == summary["ok"] and reference["checked"] > 0, reference
        assert p.get("leases_made", 0.0) > 0, p
        assert ended == p["leases_made"], f"the prefill's leases do not balance: {p}"
        assert p.get("leases_expired", 0.0) == 1, f"only the never-decoded hand-off may expire: {p}"
        assert idle, f"a KV cache did not go back to idle: prefill {p}, decode {d}, other prefills {others}"
        for name, m in others.items():
            # Alive through every fault: a hand-off whose decode had the request when it was
            # killed (not read yet, and not given back by the router), or whose answer the
            # killed router never read, expires; nothing else.
            assert ended_leases(m) == m.get("leases_made", 0.0) > 0, f"{name}'s leases do not balance: {m}"
            assert m.get("leases_expired", 0.0) <= 2 * CONCURRENCY, f"{name}: more expired than were in flight: {m}"
        if others:
            # The router routes around the dead prefill: a request that started while it was
            # down went to another one (a refused connection is retried there).
            down = summary["errors_while_the_prefill_was_down"]
            assert not down, f"{len(down)} requests failed while another prefill was up: {down[:5]}"
    except AssertionError as e:
        raise AssertionError(f"{e}\ntimeline {timeline}\n{stack.tails()}") from e
