"""n > 1 where the bug was reported: NVIDIA Dynamo's own frontend and vLLM workers,
unmodified, with kvxfer's connector registered by ``python -m kvxfer.dynamo``.

Dynamo's frontend (``python -m dynamo.frontend``) routes each request to a prefill worker
(``--disaggregation-mode prefill``) and then a decode worker (``decode``), both Dynamo's
vLLM worker on vLLM's CPU build and a tiny Llama (``tiny_model.py``; nothing is downloaded);
discovery through files (``DYN_DISCOVERY_BACKEND=file``), no etcd or NATS. Dynamo keeps one
output's ``kv_transfer_params`` per request — the bug: with per-child hand-offs the other
children's leases expire. With kvxfer's shared prompt hand-off every request with n = 4 must:

- return all four choices, each with the text Dynamo's aggregated worker (one engine, no
  connector, served as ``tiny-ref``) gives for the same seed;
- end its prefill leases as one pulled and three released (the siblings', at once), none
  expired (``vllm:kvxfer_leases_*`` on the prefill worker's system port, as an operator
  reads them);
- be read by one pull on the decode worker (``vllm:kvxfer_pulls_done``), its prompt tokens
  counted as external KV by vLLM (``vllm:prompt_tokens_by_source``).

Runs where Dynamo's interpreter exists: ``$KVXFER_DYNAMO_PY`` (made by
``scripts/python-envs.sh``); it needs the kvxfer package importable there. The processes
run in process groups of their own and are stopped when the module's tests end; their logs
are in the module's temporary directory and their tails are printed when something fails.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest

DYNAMO_PY = os.environ.get("KVXFER_DYNAMO_PY", "")
if not DYNAMO_PY or not os.path.exists(DYNAMO_PY):
    pytest.skip(
        "Dynamo is not installed: set KVXFER_DYNAMO_PY to the interpreter scripts/python-envs.sh made",
        allow_module_level=True,
    )
openai = pytest.importorskip("openai", reason="the Dynamo test drives the frontend with the openai client")

sys.path.insert(0, os.path.dirname(__file__))

from test_serve_router import (  # noqa: E402
    Proc,
    engine_env,
    explained,
    free_port,
    http_get,
    make_model,
    metric_sum,
    on_core,
)

N = 4
MAX_TOKENS = 8
LEASE_TTL = 10  # s: an unpulled lease would show up as expired this long after its request
START_TIMEOUT = 900  # s: four engines starting on 2 shared cores


def free_port_i16() -> int:
    """A free port Dynamo 1.6.1 takes for DYN_SYSTEM_PORT: it parses the variable as an i16
    (``invalid value ... expected i16``), so the OS's ephemeral ports (32768 and up) fail."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


class DynamoStack:
    """Frontend, prefill and decode workers, and the aggregated reference worker."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, Proc] = {}
        self.frontend = ""
        self.system: dict[str, str] = {}

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs.values())

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def metric(self, worker: str, name: str) -> float:
        status, text = http_get(self.system[worker] + "/metrics")
        assert status == 200, text
        return metric_sum(text, name) or 0.0

    def leases(self) -> dict[str, float]:
        return {k: self.metric("prefill", f"vllm:kvxfer_leases_{k}") for k in ("pulled", "released", "expired")}


def kv_config(role: str) -> str:
    return json.dumps(
        {
            "kv_connector": "KvxferConnector",
            "kv_connector_module_path": "kvxfer.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"kvxfer_host": "127.0.0.1", "kvxfer_lease_ttl": LEASE_TTL},
        }
    )


def wait_until(what: str, cond: Any, stack: DynamoStack, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in stack.procs.values():
            if p.p.poll() is not None:
                pytest.fail(f"{p.name} exited with {p.p.returncode} while waiting for {what}\n{stack.tails()}")
        try:
            if cond():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{stack.tails()}")
        time.sleep(1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("dynamo"))
    model = make_model(DYNAMO_PY, work)
    store = os.path.join(work, "discovery")
    os.makedirs(store)
    base = engine_env(
        OMP_WAIT_POLICY="PASSIVE", DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=store,
        DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1",
        DYN_SYSTEM_HOST="127.0.0.1",
    )
    engine = [
        "--model", model, "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
        "--seed", "0",
    ]
    s = DynamoStack(work)
    try:
        for name, extra, core, namespace in (
            ("prefill", ["--served-model-name", "tiny", "--disaggregation-mode", "prefill",
                         "--kv-transfer-config", kv_config("kv_producer")], 0, "dynamo"),
            ("decode", ["--served-model-name", "tiny", "--disaggregation-mode", "decode",
                        "--kv-transfer-config", kv_config("kv_consumer")], 1, "dynamo"),
            # Dynamo's aggregated worker, no connector: the reference for the same seeds.
            ("reference", ["--served-model-name", "tiny-ref"], 0, "reference"),
        ):
            port = free_port_i16()
            s.system[name] = f"http://127.0.0.1:{port}"
            env = on_core(dict(base, DYN_SYSTEM_PORT=str(port), DYN_NAMESPACE=namespace), core)
            entry = "kvxfer.dynamo" if name != "reference" else "dynamo.vllm"
            s.procs[name] = Proc(name, [DYNAMO_PY, "-m", entry, *engine, *extra], env, work)
        port = free_port()
        s.frontend = f"http://127.0.0.1:{port}"
        s.procs["frontend"] = Proc("frontend", [DYNAMO_PY, "-m", "dynamo.frontend", "--http-port", str(port)], base, work)

        def models() -> set[str]:
            status, body = http_get(s.frontend + "/v1/models", timeout=2)
            return {m["id"] for m in json.loads(body)["data"]} if status == 200 else set()

        wait_until("the frontend to list tiny and tiny-ref", lambda: models() >= {"tiny", "tiny-ref"}, s)
        wait_until(
            "the prefill worker's kvxfer metrics",
            lambda: http_get(s.system["prefill"] + "/metrics", timeout=2)[1].find("vllm:kvxfer_leases_pulled") >= 0,
            s,
        )
        wait_until(
            "the frontend's prefill router",
            lambda: "Prefill router target activated" in s.procs["frontend"].log(),
            s,
        )
        yield s
    finally:
        s.stop()


def texts(stack: DynamoStack, model: str, chat: bool, stream: bool, seed: int) -> dict[int, str]:
    """Each choice's text by index."""
    c = openai.OpenAI(base_url=stack.frontend + "/v1", api_key="none", max_retries=0, timeout=600)
    common = dict(model=model, n=N, seed=seed, temperature=1.0, stream=stream)
    if chat:
        content = f"Tell me about kv caches, seed {seed}."
        r = c.chat.completions.create(messages=[{"role": "user", "content": content}], max_completion_tokens=MAX_TOKENS, **common)
    else:
        r = c.completions.create(prompt=f"The quick brown fox jumps over the lazy dog {seed}. " * 4, max_tokens=MAX_TOKENS, **common)
    out: dict[int, str] = {}
    if stream:
        for chunk in r:
            for choice in chunk.choices:
                piece = (choice.delta.content or "") if chat else (choice.text or "")
                out[choice.index] = out.get(choice.index, "") + piece
    else:
        for choice in r.choices:
            out[choice.index] = choice.message.content if chat else choice.text
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n4_behind_dynamo_every_child_served_no_lease_expires(stack, chat, stream):
    with explained(stack):
        before = stack.leases()
        pulls = stack.metric("decode", "vllm:kvxfer_pulls_done")
        seed = 100 + 2 * int(chat) + int(stream)
        got = texts(stack, "tiny", chat, stream, seed)
        assert sorted(got) == list(range(N)), f"choices {sorted(got)} came back, not all {N}"
        assert got == texts(stack, "tiny-ref", chat, stream, seed), "the P/D tokens differ from one engine's"
        want = {"pulled": 1.0, "released": float(N - 1), "expired": 0.0}
        deadline = time.monotonic() + 30
        while True:
            now = stack.leases()
            delta = {k: now[k] - before[k] for k in now}
            if delta == want or delta["expired"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert delta == want, f"the request's prefill leases ended as {delta}"
        assert stack.metric("decode", "vllm:kvxfer_pulls_done") - pulls == 1, "not one pull for the request"


def test_nothing_expires_after_the_lease_ttl(stack):
    """After every request above, a lease time-to-live later: no lease expired, no
    notification named a request the prefill worker does not know."""
    with explained(stack):
        time.sleep(LEASE_TTL + 2)
        assert stack.leases()["expired"] == 0
        status, text = http_get(stack.system["decode"] + "/metrics")
        external = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source") and 'source="external_kv_transfer"' in line:
                external += float(line.split()[-1])
        assert external > 0, "the decode worker counted no prompt tokens from KV transfer"
        for name in ("prefill", "decode"):
            log = stack.procs[name].log()
            assert "unrecognized request" not in log.lower(), f"{name}: a notification named an unknown request"


def test_the_guide_shows_what_dynamo_prints(stack):
    """docs/src/guides/dynamo.md's expected output, against this stack's: the completion of
    the guide's n = 4 request through Dynamo's frontend, and the kvxfer `/metrics` lines its
    greps find on each worker's system port (Dynamo's labels)."""
    from guide_output import DECODE_GREP, PREFILL_GREP, check_lines, check_metric_deltas, grepped_metrics, guide_completion

    with explained(stack):
        prefill, decode = stack.system["prefill"], stack.system["decode"]
        before = {prefill: grepped_metrics(prefill, PREFILL_GREP, wait=0), decode: grepped_metrics(decode, DECODE_GREP, wait=0)}
        check_lines("dynamo.md", "dynamo-completion", guide_completion(stack.frontend, "tiny"), "tiny")
        check_metric_deltas("dynamo.md", "dynamo-prefill-metrics", prefill, PREFILL_GREP, before[prefill])
        check_metric_deltas("dynamo.md", "dynamo-decode-metrics", decode, DECODE_GREP, before[decode])
