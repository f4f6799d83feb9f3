"""What a guide shows a command printing, checked against what the real stack printed.

A guide marks an expected-output block with an HTML comment right before its fence::

    <!-- output: vllm-prefill-metrics -->
    ```text
    vllm:kvxfer_leases_pulled_total{engine="0",model_name="MODEL"} 1.0
    ```

Three kinds of check:

- :func:`check_metrics`: each quoted Prometheus sample line names a metric, with the same
  label names, that the real ``/metrics`` text has (label values are the reader's own: they
  depend on the model and the host);
- :func:`check_metric_deltas`: as above, and each quoted value (what a fresh server shows
  after the guide's one request) is what the real counter rose by over that request;
- :func:`check_lines`: each quoted line matches some real line, ``…`` standing for any text
  and ``MODEL`` for the model's name.
"""

from __future__ import annotations

import json
import pathlib
import re
import time
import urllib.request

GUIDES = pathlib.Path(__file__).resolve().parents[3] / "docs" / "src" / "guides"
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+\S+$")


def quoted(guide: str, name: str) -> list[str]:
    """The lines of the fenced block right after ``<!-- output: name -->`` in a guide."""
    text = (GUIDES / guide).read_text()
    marker = f"<!-- output: {name} -->"
    at = text.find(marker)
    assert at >= 0, f"{guide} has no {marker}"
    rest = text[at + len(marker):].lstrip("\n")
    assert rest.startswith("```"), f"{guide}: {marker} is not followed by a fenced block"
    body = rest.split("\n", 1)[1]
    block = body[: body.index("```")]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert lines, f"{guide}: the block after {marker} is empty"
    return lines


def shape(line: str) -> tuple[str, tuple[str, ...]] | None:
    """(metric name, sorted label names) of a Prometheus sample line, None for others."""
    m = SAMPLE.match(line.strip())
    if not m:
        return None
    labels = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or "")))
    return m.group(1), labels


def check_metrics(guide: str, name: str, real: str) -> None:
    real_shapes = {s for s in map(shape, real.splitlines()) if s}
    for line in quoted(guide, name):
        s = shape(line)
        assert s is not None, f"{guide} [{name}]: not a sample line: {line!r}"
        assert s in real_shapes, (
            f"{guide} [{name}] shows {line!r}, but the real /metrics has no {s[0]} with labels {s[1]}; "
            f"it has: {sorted(x for x in real_shapes if x[0] == s[0]) or 'none of that name'}"
        )


def values(text: str) -> dict[tuple[str, tuple[str, ...]], float]:
    """Each series shape's value in Prometheus text (summed over label values)."""
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for line in text.splitlines():
        s = shape(line)
        if s:
            out[s] = out.get(s, 0.0) + float(line.split()[-1])
    return out


def check_metric_deltas(guide: str, name: str, url: str, grep: str, before: str, wait: float = 30.0) -> None:
    """The quoted lines' shapes are in ``url``'s /metrics, and each quoted value is how much
    its series rose since ``before`` (the grepped text taken before the guide's request),
    waiting up to ``wait`` seconds for the counters to get there."""
    want = {shape(line): float(line.split()[-1]) for line in quoted(guide, name)}
    assert None not in want, f"{guide} [{name}]: a quoted line is not a sample line"
    start = values(before)
    deadline = time.monotonic() + wait
    while True:
        now = grepped_metrics(url, grep, wait=0)
        check_metrics(guide, name, now)
        got = {s: values(now).get(s, 0.0) - start.get(s, 0.0) for s in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == want, f"{guide} [{name}]: over the guide's request the counters rose by {got}, the guide shows {want}"


def pattern(line: str, model: str) -> re.Pattern[str]:
    """A quoted line as a regex: ``…`` any text, ``MODEL`` the model's name."""
    parts = re.split(r"(…|MODEL)", line.strip())
    rx = "".join(".*?" if p == "…" else re.escape(model) if p == "MODEL" else re.escape(p) for p in parts)
    return re.compile(rx)


def check_lines(guide: str, name: str, real: str, model: str) -> None:
    real_lines = real.splitlines()
    for line in quoted(guide, name):
        rx = pattern(line, model)
        assert any(rx.search(r) for r in real_lines), (
            f"{guide} [{name}] shows {line!r}; no line printed matches it. Printed (last 40 lines):\n"
            + "\n".join(real_lines[-40:])
        )


# The guides' request (`curl ... -d '{"model":"MODEL","prompt":"Hello","n":4,...}'`) and
# their greps of each engine's /metrics.
PREFILL_GREP = r"^vllm:kvxfer_leases_(pulled|released|expired)_total"
DECODE_GREP = r"^vllm:kvxfer_pulls_done_total"


def guide_completion(base_url: str, model: str) -> str:
    """The body a server at ``base_url`` answers the guides' n = 4 completion request with."""
    body = json.dumps({"model": model, "prompt": "Hello", "n": 4, "max_tokens": 16, "seed": 1}).encode()
    req = urllib.request.Request(
        base_url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return resp.read().decode()


def grepped_metrics(url: str, grep: str, wait: float = 30.0) -> str:
    """The lines of ``url``'s /metrics that match ``grep``, waiting up to ``wait`` seconds for
    any (vLLM exports the connector's counters with its stats, every step or so)."""
    deadline = time.monotonic() + wait
    while True:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        found = "\n".join(ln for ln in text.splitlines() if re.match(grep, ln))
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
