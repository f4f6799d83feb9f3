"""A serving load generator: ``python -m kvxfer.loadgen --url http://127.0.0.1:8000`` (needs
``aiohttp``, the ``proxy`` extra).

Clients (``--concurrency``) drive an OpenAI-compatible endpoint — kvxfer's router in front
of prefill and decode instances, or anything else — for ``--duration`` seconds with a mix of
requests: n = 1 and n = 4 (``--n4-share``), streamed and not, completions and chat, seeded
sampling with ``ignore_eos`` (every choice has ``--max-tokens`` tokens); a client backs off
after an error (0.1 s, doubling up to 2 s, until an answer comes). Each client holds a
conversation of ``--turns`` turns, each turn's prompt the last one's plus its answer, so the
prefix caches of both instances are hit. ``--abort-share`` of the requests are given up by
their client at a random moment (during the prefill, between the legs, mid-stream): they
count as aborted, not as errors.

Per request it records the status, the kind of error (``http_<status>``, ``timeout``,
``connection``, ``stream_error``, ``stream_cut``, ``answer_cut``, ``incomplete``,
``bad_answer``), the
latency and the time to the first token (streams; the latency otherwise). With
``--reference URL`` (one engine serving the same model by itself) every successful request
is sent there again afterwards and each choice's token ids compared: a difference means a
decode read KV that was not its prompt's. ``--metrics NAME=URL`` (repeat) reads each
engine's ``/metrics`` before and after the run: kvxfer's lease counters
(``vllm:kvxfer_leases_{made,pulled,released,expired}``) and vLLM's KV-cache usage.

The report (``--json`` prints it whole) has requests, errors by kind, p50/p99 latency and
time to first token, the slowest request, the token checks, and the metrics before, after
and their difference. Exits 1 when a request outlived ``--bound`` seconds or an answer
differed from the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one "
    "you were all her she there would their we him been has when who will no more if out so up said what its "
    "about than into them can only other time new some could these two may first then do any like my now over "
    "such our man me even most made after also did many off before must well back through years much where your"
).split()

LEASE_COUNTERS = ("made", "pulled", "released", "expired")


@dataclass
class LoadConfig:
    """What :func:`run_load` sends, to where, for how long."""

    url: str
    duration: float = 60.0
    concurrency: int = 4
    n4_share: float = 0.5
    stream_share: float = 0.5
    chat_share: float = 0.5
    abort_share: float = 0.0
    turns: int = 4
    max_tokens: int = 8
    model: str = "tiny"
    request_timeout: float = 120.0
    reference: Optional[str] = None
    metrics: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    api_key: Optional[str] = None


@dataclass
class Result:
    """One request: what was sent and what came of it."""

    client: int
    kind: str  # "completion" or "chat"
    n: int
    stream: bool
    body: dict[str, Any]
    started: float
    status: Optional[int] = None
    error: Optional[str] = None  # an error kind (see the module docs), None when it succeeded
    detail: str = ""
    aborted: bool = False
    latency: float = 0.0
    ttft: Optional[float] = None
    tokens: dict[int, list[int]] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.aborted


class Conversation:
    """One client's multi-turn conversation: each turn extends the last prompt with its
    answer; a new one starts after ``turns`` turns."""

    def __init__(self, rng: random.Random, turns: int) -> None:
        self.rng = rng
        self.turns = turns
        self._start()

    def _start(self) -> None:
        self.turn = 0
        self.text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(12, 40)))
        self.messages: list[dict[str, str]] = [{"role": "user", "content": self.text}]

    def advance(self, answer: str) -> None:
        self.turn += 1
        if self.turn >= self.turns:
            self._start()
            return
        follow = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(3, 10)))
        self.text = f"{self.text}{answer} {follow}"
        self.messages = [*self.messages, {"role": "assistant", "content": answer}, {"role": "user", "content": follow}]


def request_body(cfg: LoadConfig, conv: Conversation, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """The next request of a conversation: its kind and its JSON body."""
    n = 4 if rng.random() < cfg.n4_share else 1
    chat = rng.random() < cfg.chat_share
    body: dict[str, Any] = {
        "model": cfg.model,
        "n": n,
        "seed": rng.randrange(1 << 31),
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": rng.random() < cfg.stream_share,
    }
    if chat:
        body["messages"] = list(conv.messages)
        body["max_completion_tokens"] = cfg.max_tokens
    else:
        body["prompt"] = conv.text
        body["max_tokens"] = cfg.max_tokens
    return ("chat" if chat else "completion"), body


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def _choice_text(kind: str, choice: dict[str, Any], stream: bool) -> str:
    if kind == "chat":
        part = choice.get("delta" if stream else "message") or {}
        return str(part.get("content") or "")
    return str(choice.get("text") or "")


def _take_choices(r: Result, choices: Any, stream: bool) -> None:
    for c in choices if isinstance(choices, list) else ():
        if not isinstance(c, dict) or not isinstance(c.get("index"), int):
            continue
        i = c["index"]
        ids = c.get("token_ids")
        if ids is None and r.kind == "chat" and isinstance(c.get("delta"), dict):
            ids = c["delta"].get("token_ids")
        if isinstance(ids, list):
            r.tokens.setdefault(i, []).extend(int(t) for t in ids)
        r.texts[i] = r.texts.get(i, "") + _choice_text(r.kind, c, stream)


def _check_complete(r: Result, max_tokens: int) -> None:
    if r.error is not None:
        return
    if sorted(r.tokens) != list(range(r.n)) or any(len(t) != max_tokens for t in r.tokens.values()):
        counts = {i: len(t) for i, t in sorted(r.tokens.items())}
        r.error, r.detail = "incomplete", f"{r.n} choices of {max_tokens} tokens asked, token counts {counts}"


async def send(session: aiohttp.ClientSession, cfg: LoadConfig, r: Result, base: str) -> None:
    """Sends ``r``'s request to ``base`` and fills in what came of it."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    started = time.monotonic()
    try:
        async with session.post(base + _path(r.kind), json=r.body, headers=headers) as resp:
            r.status = resp.status
            if resp.status >= 400:
                r.error, r.detail = f"http_{resp.status}", (await resp.text())[:300]
                return
            if not r.stream:
                body = await resp.read()
                if not body:
                    # The status came and the body never did: the answer was cut (an
                    # instance died after the router passed the status on).
                    r.error, r.detail = "answer_cut", f"status {resp.status} and an empty body"
                    return
                try:
                    answer = json.loads(body)
                except ValueError as e:  # a body cut short, or not JSON
                    r.error, r.detail = "bad_answer", f"not a JSON answer: {e}"[:300]
                    return
                if not isinstance(answer, dict) or "choices" not in answer:
                    r.error, r.detail = "bad_answer", str(answer)[:300]
                    return
                _take_choices(r, answer["choices"], stream=False)
                r.ttft = time.monotonic() - started
            else:
                done = False
                buffer = b""
                async for chunk in resp.content.iter_any():
                    buffer = (buffer + chunk).replace(b"\r\n", b"\n")
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                done = True
                                continue
                            try:
                                payload = json.loads(data)
                            except ValueError:
                                r.error, r.detail = "bad_answer", data[:300].decode("utf-8", "replace")
                                continue
                            if not isinstance(payload, dict):
                                r.error, r.detail = "bad_answer", data[:300].decode("utf-8", "replace")
                                continue
                            if "error" in payload:
                                r.error, r.detail = "stream_error", json.dumps(payload["error"])[:300]
                                continue
                            if r.ttft is None and any(
                                c.get("token_ids") or _choice_text(r.kind, c, True)
                                for c in payload.get("choices") or ()
                                if isinstance(c, dict)
                            ):
                                r.ttft = time.monotonic() - started
                            _take_choices(r, payload.get("choices"), stream=True)
                if not done and r.error is None:
                    r.error, r.detail = "stream_cut", "the stream ended without data: [DONE]"
    except asyncio.TimeoutError:
        r.error, r.detail = "timeout", f"no whole answer within {cfg.request_timeout} s"
    except aiohttp.ClientError as e:
        r.error, r.detail = "connection", str(e)[:300]
    finally:
        r.latency = time.monotonic() - started
    _check_complete(r, cfg.max_tokens)


async def _client(
    index: int,
    cfg: LoadConfig,
    session: aiohttp.ClientSession,
    deadline: float,
    results: list[Result],
    stop: Optional[threading.Event],
    hold: Optional[threading.Event] = None,
) -> None:
    rng = random.Random(cfg.seed * 1_000_003 + index)
    conv = Conversation(rng, cfg.turns)
    failures = 0
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if hold is not None and hold.is_set():
            await asyncio.sleep(0.05)  # held: no new request starts
            continue
        kind, body = request_body(cfg, conv, rng)
        r = Result(index, kind, body["n"], bool(body["stream"]), body, time.monotonic())
        results.append(r)
        if rng.random() < cfg.abort_share:
            # The client gives up at a random moment: during the prefill, between the legs
            # or mid-stream (the answer of a tiny model comes within a second or two).
            r.aborted = True
            try:
                await asyncio.wait_for(send(session, cfg, r, cfg.url), timeout=rng.uniform(0.0, 1.5))
                r.aborted = False  # it finished first
            except asyncio.TimeoutError:
                r.latency = time.monotonic() - r.started
            continue
        await send(session, cfg, r, cfg.url)
        if r.ok:
            conv.advance(r.texts.get(0, ""))
            failures = 0
        else:
            # An instance may be down: back off as a client would (0.1 s doubling to 2 s).
            await asyncio.sleep(min(2.0, 0.1 * 2 ** min(failures, 5)))
            failures += 1


def _session(cfg: LoadConfig) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def check_against_reference(cfg: LoadConfig, results: list[Result]) -> dict[str, Any]:
    """Sends every successful request again to ``cfg.reference`` (not streamed, up to
    ``cfg.concurrency`` at once) and compares each choice's token ids."""
    assert cfg.reference is not None
    reference = cfg.reference
    counts = {"checked": 0, "differ": 0, "reference_failed": 0}
    examples: list[str] = []
    limit = asyncio.Semaphore(max(1, cfg.concurrency))

    async def check(session: aiohttp.ClientSession, r: Result) -> None:
        again = Result(r.client, r.kind, r.n, False, dict(r.body, stream=False), time.monotonic())
        async with limit:
            await send(session, cfg, again, reference)
        if not again.ok:
            counts["reference_failed"] += 1
            return
        counts["checked"] += 1
        if again.tokens != r.tokens:
            counts["differ"] += 1
            if len(examples) < 3:
                examples.append(f"{r.kind} n={r.n} seed={r.body['seed']}: {r.tokens} vs reference {again.tokens}")

    async with _session(cfg) as session:
        await asyncio.gather(*(check(session, r) for r in results if r.ok))
    return {**counts, "examples": examples}


def parse_metrics(text: str) -> dict[str, float]:
    """kvxfer's lease and pull counters (summed over label sets), the prompt tokens vLLM
    counts as taken from KV transfer, and vLLM's KV-cache usage (the largest over engines)
    from a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source") and 'source="external_kv_transfer"' in line:
            # Prompt tokens a decode took from KV transfer (vLLM's own count, any connector).
            out["external_prompt_tokens"] = out.get("external_prompt_tokens", 0.0) + float(line.split()[-1])
            continue
        m = re.match(r"^(vllm:[a-z_]+?)(?:_total)?(?:\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        name, value = m.group(1), float(m.group(2))
        for k in LEASE_COUNTERS:
            if name == f"vllm:kvxfer_leases_{k}":
                out[f"leases_{k}"] = out.get(f"leases_{k}", 0.0) + value
        if name in ("vllm:kvxfer_pulls_done", "vllm:kvxfer_pulls_failed"):
            key = name.split(":kvxfer_", 1)[1]
            out[key] = out.get(key, 0.0) + value
        if name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            out["kv_cache_usage_perc"] = max(out.get("kv_cache_usage_perc", 0.0), value)
    return out


async def read_metrics(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each engine's metrics (``parse_metrics``); an engine that does not answer has none."""
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for name, url in urls.items():
            try:
                async with session.get(url.rstrip("/") + "/metrics") as resp:
                    out[name] = parse_metrics(await resp.text()) if resp.status == 200 else {}
            except (aiohttp.ClientError, asyncio.TimeoutError):
                out[name] = {}
    return out


def percentile(values: list[float], p: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    """Requests, errors by kind, latency and time-to-first-token percentiles."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None and not r.aborted:
            errors[r.error] = errors.get(r.error, 0) + 1
    slowest = max(results, key=lambda r: r.latency, default=None)
    return {
        "requests": len(results),
        "ok": len(ok),
        "aborted": sum(1 for r in results if r.aborted),
        "errors": errors,
        "error_examples": [f"{r.error}: {r.detail}" for r in results if r.error and not r.aborted][:5],
        "by_n": {str(n): sum(1 for r in ok if r.n == n) for n in sorted({r.n for r in results})},
        "latency_p50_s": percentile([r.latency for r in ok], 50),
        "latency_p99_s": percentile([r.latency for r in ok], 99),
        "ttft_p50_s": percentile([r.ttft for r in ok if r.ttft is not None], 50),
        "ttft_p99_s": percentile([r.ttft for r in ok if r.ttft is not None], 99),
        "max_latency_s": slowest.latency if slowest is not None else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "wall_s": wall,
    }


async def run_load(
    cfg: LoadConfig,
    results: Optional[list[Result]] = None,
    stop: Optional[threading.Event] = None,
    hold: Optional[threading.Event] = None,
) -> dict[str, Any]:
    """Runs the load for ``cfg.duration`` seconds, or until ``stop`` is set (clients then
    finish the request they are in), and returns the report (without the reference check
    and metrics: see :func:`run`). ``results`` (a list) receives each request as it starts,
    for a caller that watches the run (a fault runner in another thread); while ``hold`` is
    set, no client starts a request (those under way finish)."""
    results = [] if results is None else results
    started = time.monotonic()
    deadline = started + cfg.duration
    async with _session(cfg) as session:
        clients = (_client(i, cfg, session, deadline, results, stop, hold) for i in range(cfg.concurrency))
        await asyncio.gather(*clients)
    return summarize(results, time.monotonic() - started)


async def run(cfg: LoadConfig) -> tuple[dict[str, Any], list[Result]]:
    """The whole run: metrics before, the load, the reference check, metrics after."""
    before = await read_metrics(cfg.metrics) if cfg.metrics else {}
    results: list[Result] = []
    report = await run_load(cfg, results)
    if cfg.reference:
        report["reference"] = await check_against_reference(cfg, results)
    if cfg.metrics:
        after = await read_metrics(cfg.metrics)
        report["metrics"] = {"before": before, "after": after, "delta": metrics_delta(before, after)}
    return report, results


def metrics_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Counter differences per engine (gauges as they are after)."""
    out: dict[str, Any] = {}
    for name, now in after.items():
        then = before.get(name, {})
        out[name] = {k: (v if k == "kv_cache_usage_perc" else v - then.get(k, 0.0)) for k, v in now.items()}
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvxfer.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the OpenAI-compatible endpoint (the router), without /v1")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--concurrency", type=int, default=4, help="clients, each one request at a time (default 4)")
    p.add_argument("--n4-share", type=float, default=0.5, help="share of requests with n = 4 (default 0.5)")
    p.add_argument("--stream-share", type=float, default=0.5, help="share of streamed requests (default 0.5)")
    p.add_argument("--chat-share", type=float, default=0.5, help="share of chat requests (default 0.5)")
    p.add_argument("--abort-share", type=float, default=0.0, help="share of requests given up by their client")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per choice (default 8)")
    p.add_argument("--model", default="tiny", help="the served model name (default tiny)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds for a whole answer (default 120)")
    p.add_argument("--bound", type=float, default=None, help="exit 1 if a request took longer (seconds)")
    p.add_argument("--reference", default=None, help="an engine serving the model alone, to compare tokens with")
    p.add_argument("--metrics", action="append", default=[], metavar="NAME=URL", help="an engine's base URL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    metrics = {}
    for item in args.metrics:
        name, sep, url = item.partition("=")
        if not sep:
            raise SystemExit(f"--metrics takes NAME=URL, not {item!r}")
        metrics[name] = url
    cfg = LoadConfig(
        url=args.url.rstrip("/"),
        duration=args.duration,
        concurrency=args.concurrency,
        n4_share=args.n4_share,
        stream_share=args.stream_share,
        chat_share=args.chat_share,
        abort_share=args.abort_share,
        turns=args.turns,
        max_tokens=args.max_tokens,
        model=args.model,
        request_timeout=args.request_timeout,
        reference=args.reference.rstrip("/") if args.reference else None,
        metrics=metrics,
        seed=args.seed,
        api_key=args.api_key,
    )
    report, _ = asyncio.run(run(cfg))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['requests']} requests: {report['ok']} ok, {report['aborted']} aborted, errors {report['errors']}; "
            f"latency p50 {report['latency_p50_s']} s p99 {report['latency_p99_s']} s; "
            f"ttft p50 {report['ttft_p50_s']} s p99 {report['ttft_p99_s']} s"
        )
    bad = bool(report.get("reference", {}).get("differ"))
    if args.bound is not None and (report["max_latency_s"] or 0) > args.bound:
        bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
