#!/usr/bin/env python3
"""Renders BENCHMARKING.md's result tables from bench-results/*.json and checks the figures
quoted elsewhere against them (standard library only).

Every figure lives once, in a results file under ``bench-results/`` (one per path: TCP, UCX
shared memory, many parents, ...). This script writes the tables into BENCHMARKING.md
between generated-region markers and leaves the hand-written prose around them alone::

    <!-- BEGIN GENERATED: tcp-two-process -->
    ...the table, its commands and its goals...
    <!-- END GENERATED: tcp-two-process -->

A region's name is a results file's ``path`` (its file name without ``.json``), or
``machines`` (the machines the rows name) or ``goals`` (every file's goals in one table).

Results file (``schema`` 1)::

    {"schema": 1, "path": "tcp-two-process", "title": "...", "about": "optional sentence",
     "columns": [{"text": "config", "title": "configuration"},
                 {"figure": "gib_per_s", "title": "kvxfer", "unit": "GiB/s"},
                 {"figure": "ratio_vs_raw_tcp", "title": "kvxfer / raw TCP", "suffix": "x"}],
     "rows": [{"id": "64K", "config": "64 KiB blocks", "date": "2026-12-01",
               "machine": "ci-vm", "conditions": "3 interleaved rounds, load 1.3-2.0",
               "command": "scripts/bench-two-process.sh ...",
               "figures": {"gib_per_s": [2.07, 2.59], "ratio_vs_raw_tcp": 0.67},
               "runs": [{...one JSON line the bench printed...}, ...],
               "where": {"block_bytes": 65536}, "note": "..."}],
     "goals": [{"id": "...", "statement": "...", "target": ">= 0.9x",
                "measured": [{"ref": "64K/ratio_vs_raw_tcp", "label": "64 KiB"}], "met": "no"}]}

A figure is a number, ``[min, max]`` (a range over runs, as measured), a string (a cell
no number describes), or null (not measured: rendered "—"). A row may instead (or as well)
carry ``runs``: the JSON rows the bench printed (``kvxfer-bench --json``, ``python -m
kvxfer.bench --json``, ``scripts/vllm-pd-bench.py --json``, ``kvxfer-hostile --json``'s
phases), pasted as they are; ``where`` keeps only the runs whose keys equal its values. A
column then takes ``[min, max]`` over the runs of its first key present (``keys``, default
``[figure]``; dotted keys reach into nested objects, ``prefill.ucx_version``), or their
median with ``"agg": "median"`` (``key`` names the bench key then), rounded to ``digits``
(default 2) but never to more decimals than the runs were measured with (runs of 11.4 and
32.6 give ``11.4–32.6``). A figure in ``figures`` wins over the runs. Numbers render as
typed: the files are read with their decimals kept, so type ``9.30`` for a figure measured
to two decimals (``9.30`` stays ``9.30``, ``0.9`` stays ``0.9``). The two ends of a range
always show as many decimals as each other (``[3.8, 5.16]`` renders ``3.80–5.16``).

Quoting a figure elsewhere (README.md, ARCHITECTURE.md, CHANGELOG.md, docs/DESIGN.md,
docs/src/**/*.md)::

    <!-- fig ucx-shared-memory/113-ucx-2M/gib_per_s -->8.32–10.29 GiB/s<!-- /fig -->

``PATH/ROW/FIGURE``; the text between the markers must be the table's cell, optionally
followed by the column's unit (with or without a space). A goal's target is quoted as
``PATH/goal:ID/target`` (its text, with or without the leading ``≥`` / ``≤``). HTML comments render as nothing
in GitHub and in mdBook.

Usage::

    scripts/render-benchmarks.py            # rewrite BENCHMARKING.md's generated regions
    scripts/render-benchmarks.py --check    # exit 1 naming every region or quote that differs,
                                            # and every unmarked figure in the docs
    scripts/render-benchmarks.py --root DIR # another checkout (the tests use copies)
"""

from __future__ import annotations

import argparse
import decimal
import json
import pathlib
import re
import statistics
import sys
from typing import Any

BEGIN = re.compile(r"^<!-- BEGIN GENERATED: ([\w.-]+) -->$")
END = "<!-- END GENERATED: {} -->"
FIG = re.compile(r"<!-- fig ([\w.-]+)/([\w.:-]+)/([\w.:-]+) -->(.*?)<!-- /fig -->", re.S)

# Where quoted figures are checked: these files (the user-facing Markdown outside the book;
# docs/DESIGN.md is included into it) and every Markdown file under docs/src, except the page
# that includes BENCHMARKING.md. BENCHMARKING.md itself is checked outside its generated
# regions.
QUOTING = ("README.md", "ARCHITECTURE.md", "CHANGELOG.md", "docs/DESIGN.md")
BOOK = "docs/src"
SKIP = {"docs/src/reference/benchmarks.md"}

# Figures typed without a marker that --check tolerates: (file, the matched text). Empty:
# every unmarked figure fails.
KNOWN_UNMARKED: set[tuple[str, str]] = set()

_N = r"(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
NUM = r"(?<!±)[~≈]?" + _N + r"(?:\s*(?:–|-|to)\s*[~≈]?" + _N + r")?"
# Throughput and CPU cost: always a measurement (µs: U+00B5 or the Greek U+03BC).
ALWAYS = re.compile(
    r"(?<![\w.])" + NUM + r"\s*(?:GiB/s|MiB/s|GB/s|MB/s|[µμ]s|s/GiB|requests/s|pulls/s|req/s)(?!\w)"
)
# A link speed is a specification ("a 100 Gbit/s NIC") unless the line speaks of a measurement.
LINK = re.compile(r"(?<![\w.])" + NUM + r"\s*(?:Gbit/s|Gb/s|Mbit/s|Mb/s)(?!\w)")
LINK_CONTEXT = re.compile(r"measur|moved|reach|achiev|delivered|throughput|ran at|kvxfer-bench|raw|against", re.I)
LINK_AFTER = re.compile(
    r"^\s*(?:\w+\s+)?(?:NIC|link|port|network|Ethernet|InfiniBand|RoCE|card|adapter)s?\b", re.I
)
# Latency in ms, ratios and percentages: only in a line that speaks of performance
# (timeouts, intervals and sizes elsewhere are configuration, not figures).
MS = re.compile(r"(?<![\w.])" + NUM + r"\s*ms\b")
MS_CONTEXT = re.compile(r"p50|p99|latency|round trip|hand-off|per request|per pull|wall", re.I)
# 1.5x, 1.5×, x1.10 (a prefix x needs decimals or thousands, so "x86" and "PCIe x16" are not ratios).
RATIO = re.compile(
    r"(?<![\w.])(?:" + NUM + r"(?:x\b|×)|[x×](?:\d+\.\d+|\d{1,3}(?:,\d{3})+)(?![\w.]))"
)
RATIO_CONTEXT = re.compile(r"raw|memcpy|NIXL|baseline|p99|p50|faster|slower|round trip|big transfer", re.I)
PCT = re.compile(r"(?<![\w.])" + NUM + r"\s*%")
PCT_CONTEXT = re.compile(r"CPU|throughput|samples|p50|p99|faster|slower|latency|hand-off", re.I)
# A number after these (within 40 characters, whole words; identifiers such as `lease_ttl`
# count) is a bound or a goal, not a measurement ("slower than 1 MiB/s", "`min_transfer_rate`
# | 1 MiB/s", "≥ 0.9x", "the 2x goal").
_W = r"(?<![A-Za-z])(?:{})(?![A-Za-z])"
BOUND_BEFORE = re.compile(
    _W.format(r"than|at least|at most|goals?|targets?|limits?|ttl|timeouts?") + r"|≥|≤|_rate(?![A-Za-z])", re.I
)
# A number right after these is configuration ("sleeps 100 µs", "a heartbeat every 100 ms",
# "an interval of 250 ms").
CONFIG_BEFORE = re.compile(
    _W.format(
        r"sleeps?|slept|sleeping|waits?|waited|waiting|intervals?|every|polls?|polling|period|set to|defaults? to"
    )
    + r"(?:\s+(?:for|of|to|up to|at most|about|is|=))?\s*[:=]?\s*$",
    re.I,
)
BOUND_AFTER = re.compile(r"^\S*\s*(?:goal|target)", re.I)

class Results:
    """Every results file of a checkout, by path."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        folder = root / "bench-results"
        self.files: dict[str, dict[str, Any]] = {}
        self.machines: dict[str, dict[str, str]] = {}
        for f in sorted(folder.glob("*.json")):
            data = json.loads(f.read_text(encoding="utf-8"), parse_float=decimal.Decimal)
            if f.stem == "machines":
                self.machines = data["machines"]
                continue
            if data.get("path") != f.stem:
                raise SystemExit(f"{f}: \"path\" must be {f.stem!r}")
            ids = [r["id"] for r in data["rows"]]
            if len(ids) != len(set(ids)):
                raise SystemExit(f"{f}: row ids repeat")
            self.files[f.stem] = data

    def row(self, path: str, row_id: str) -> dict[str, Any] | None:
        for r in self.files.get(path, {}).get("rows", []):
            if r["id"] == row_id:
                return r
        return None

    def column(self, path: str, figure: str) -> dict[str, Any] | None:
        for c in self.files.get(path, {}).get("columns", []):
            if c.get("figure") == figure:
                return c
        return None


# ---------------------------------------------------------------------------- values


def _dig(obj: Any, dotted: str) -> Any:
    if isinstance(obj, dict) and dotted in obj:
        return obj[dotted]
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, decimal.Decimal)) and not isinstance(v, bool)


def _decimals(v: Any) -> int:
    """How many decimals a number was typed or measured with."""
    if isinstance(v, decimal.Decimal):
        exp = v.as_tuple().exponent
        return -exp if isinstance(exp, int) and exp < 0 else 0
    if isinstance(v, float):
        text = repr(v)
        return len(text.split(".")[1]) if "." in text and "e" not in text else 0
    return 0


def _round(v: Any, places: int) -> decimal.Decimal:
    q = decimal.Decimal(1).scaleb(-places)
    return decimal.Decimal(str(v)).quantize(q, rounding=decimal.ROUND_HALF_EVEN)


def _from_runs(row: dict[str, Any], col: dict[str, Any]) -> tuple[Any, bool]:
    runs = [r for r in row.get("runs", []) if all(_dig(r, k) == v for k, v in row.get("where", {}).items())]
    keys = [col["key"]] if "key" in col else col.get("keys", [col["figure"]])
    for key in keys:
        values = [_dig(r, key) for r in runs]
        values = [v for v in values if v is not None]
        if not values:
            continue
        if all(_is_number(v) for v in values):
            # At most `digits` decimals, never more than the runs were measured with.
            places = min(col.get("digits", 2), max(_decimals(v) for v in values))
            if col.get("agg") == "median":
                return _round(statistics.median(decimal.Decimal(str(v)) for v in values), places), True
            lo, hi = _round(min(values), places), _round(max(values), places)
            return (lo if lo == hi else [lo, hi]), True
        texts = []
        for v in values:
            t = ", ".join(map(str, v)) if isinstance(v, list) else str(v)
            if t not in texts:
                texts.append(t)
        return "; ".join(texts), True
    return None, False


def value(row: dict[str, Any], col: dict[str, Any]) -> tuple[Any, bool]:
    """(the figure, whether it came from runs)."""
    if "text" in col:
        return row.get(col["text"]), False
    figures = row.get("figures", {})
    if col["figure"] in figures:
        return figures[col["figure"]], False
    return _from_runs(row, col)


def fmt_number(v: Any, places: int | None = None) -> str:
    """A number as typed (or with `places` decimals), thousands separated."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if _is_number(v):
        d = _round(v, _decimals(v) if places is None else places)
        return f"{d:,f}"
    return str(v)


def cell(row: dict[str, Any], col: dict[str, Any]) -> str:
    """A table cell as the table shows it ("" when the row has no such figure)."""
    v, _ = value(row, col)
    if v is None:
        return ""
    if isinstance(v, str):
        text = v
    else:
        if isinstance(v, list):
            # Both ends with as many decimals as each other (2.82–9.00, not 2.82–9.0).
            places = max(_decimals(x) for x in v)
            lo, hi = (fmt_number(x if isinstance(x, bool) else decimal.Decimal(str(x)), places) for x in v)
            text = lo if lo == hi else f"{lo}–{hi}"
        else:
            text = fmt_number(v)
        text = col.get("prefix", "") + text + col.get("suffix", "")
    if col.get("row_unit") and row.get("unit"):
        text += ("" if row["unit"] == "%" else " ") + row["unit"]
    return text


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------- rendering


def _labels() -> list[str]:
    letters = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    return letters + [a + b for a in letters for b in letters]


def _code(command: str) -> str:
    if "`" in command:
        return command
    return f"`{command}`"


def goal_measured(results: Results, path: str, goal: dict[str, Any]) -> str:
    parts = []
    for m in goal["measured"]:
        row_id, figure = m["ref"].split("/", 1)
        row = results.row(path, row_id)
        col = results.column(path, figure)
        if row is None or col is None:
            raise SystemExit(f"bench-results/{path}.json: goal {goal['id']} names {m['ref']}, which is not there")
        text = cell(row, col) or "—"
        if col.get("unit") and not col.get("suffix") and text != "—":
            text += " " + col["unit"]
        parts.append(f"{m['label']} {text}".strip() if m.get("label") else text)
    return "; ".join(parts)


def render_goals(results: Results, path: str, goals: list[dict[str, Any]], with_path: bool) -> list[str]:
    head = "| goal | target | measured | met |"
    if with_path:
        head = "| section | goal | target | measured | met |"
    out = [head, "|" + " --- |" * (5 if with_path else 4)]
    for g in goals:
        p = g.get("_path", path)
        measured = goal_measured(results, p, g)
        if g.get("note"):
            measured += f" ({g['note']})"
        cells = [g["statement"], g["target"], measured, g["met"]]
        if with_path:
            cells.insert(0, results.files[p]["title"])
        out.append("| " + " | ".join(_esc(c) for c in cells) + " |")
    return out


def render_file(results: Results, data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    cols = [c for c in data["columns"] if any(cell(r, c) for r in rows)]
    out: list[str] = []
    if data.get("about"):
        out += [data["about"], ""]
    titles = []
    for c in cols:
        t = c["title"]
        if c.get("unit"):
            t += f" ({c['unit']})"
        titles.append(t)
    has = {k: any(r.get(k) for r in rows) for k in ("conditions", "note")}
    titles += ["date"] + (["conditions"] if has["conditions"] else []) + ["machine", "command"]
    titles += ["note"] if has["note"] else []
    out.append("| " + " | ".join(_esc(t) for t in titles) + " |")
    out.append("|" + " --- |" * len(titles))
    commands: list[str] = []
    labels = _labels()
    for r in rows:
        cells = [cell(r, c) or "—" for c in cols]
        cells.append(r["date"])
        if has["conditions"]:
            cells.append(r.get("conditions", ""))
        machine = r["machine"]
        cells.append(results.machines.get(machine, {}).get("name", machine))
        if r.get("command"):
            if r["command"] not in commands:
                commands.append(r["command"])
            cells.append(labels[commands.index(r["command"])])
        else:
            cells.append("—")
        if has["note"]:
            cells.append(r.get("note", ""))
        out.append("| " + " | ".join(_esc(c) for c in cells) + " |")
    out += ["", "Commands:", ""]
    out += [f"- {labels[i]}: {_code(c)}" for i, c in enumerate(commands)]
    if data.get("goals"):
        out += ["", "Goals:", ""] + render_goals(results, data["path"], data["goals"], False)
    return out


def render_region(results: Results, name: str) -> list[str]:
    if name == "machines":
        return [f"- **{m['name']}**: {m['description']}." for _, m in sorted(results.machines.items())]
    if name == "goals":
        goals = []
        for path, data in results.files.items():
            goals += [dict(g, _path=path) for g in data.get("goals", [])]
        return render_goals(results, "", goals, True)
    if name not in results.files:
        raise KeyError(name)
    return render_file(results, results.files[name])


def render(results: Results, text: str) -> tuple[str, list[str], list[str]]:
    """(the new text, regions whose content changed, problems)."""
    lines = text.split("\n")
    out: list[str] = []
    changed: list[str] = []
    problems: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        out.append(lines[i])
        i += 1
        if not m:
            continue
        name = m.group(1)
        end = END.format(name)
        try:
            j = lines.index(end, i)
        except ValueError:
            problems.append(f"BENCHMARKING.md: region {name} has no `{end}`")
            continue
        try:
            body = [""] + render_region(results, name) + [""]
        except KeyError:
            problems.append(f"BENCHMARKING.md: region {name}: no bench-results/{name}.json")
            body = lines[i:j]
        if body != lines[i:j]:
            changed.append(name)
        out += body + [end]
        seen.add(name)
        i = j + 1
    for name in sorted(set(results.files) - seen):
        problems.append(f"BENCHMARKING.md: no region for bench-results/{name}.json (`<!-- BEGIN GENERATED: {name} -->`)")
    return "\n".join(out), changed, problems


# ---------------------------------------------------------------------------- quotes


def _blank_code(text: str) -> str:
    """Fenced code blocks and inline code spans blanked, line structure and lengths kept."""
    out = []
    fence = None
    for line in text.split("\n"):
        s = line.lstrip()
        if fence is None and (s.startswith("```") or s.startswith("~~~")):
            fence = s[:3]
            out.append("")
            continue
        if fence is not None:
            if s.startswith(fence):
                fence = None
            out.append("")
            continue
        out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: " " * len(m.group(0)), line))
    return "\n".join(out)


def _blank(match: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def check_quotes(results: Results, rel: str, text: str, generated: bool = False) -> list[str]:
    problems = []
    for m in FIG.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        path, row_id, figure, quoted = m.groups()
        if row_id.startswith("goal:") and figure == "target":
            goals = {g["id"]: g for g in results.files.get(path, {}).get("goals", [])}
            g = goals.get(row_id[5:])
            if g is None:
                problems.append(f"{rel}:{line}: goal {path}/{row_id} is not in bench-results")
            elif quoted not in {g["target"], re.sub(r"^[≥≤<>]\s*", "", g["target"])}:
                problems.append(f"{rel}:{line}: {path}/{row_id}/target quotes {quoted!r}, the results say {g['target']!r}")
            continue
        row, col = results.row(path, row_id), results.column(path, figure)
        if row is None or col is None:
            problems.append(f"{rel}:{line}: figure {path}/{row_id}/{figure} is not in bench-results")
            continue
        want = cell(row, col)
        allowed = {want}
        if col.get("unit"):
            allowed |= {want + " " + col["unit"], want + col["unit"]}
        if quoted not in allowed:
            problems.append(f"{rel}:{line}: {path}/{row_id}/{figure} quotes {quoted!r}, the results say {want!r}")
    # Unmarked figures: outside code, comments, marked quotes (and generated regions).
    kept = FIG.sub(_blank, text)
    if generated:
        kept = re.sub(r"<!-- BEGIN GENERATED: [\w.-]+ -->.*?<!-- END GENERATED: [\w.-]+ -->", _blank, kept, flags=re.S)
    kept = re.sub(r"<!--.*?-->", _blank, kept, flags=re.S)
    # Figures are looked for outside code; the words before one are read with the code kept
    # (`min_transfer_rate` | 1 MiB/s). Blanking keeps every position.
    with_code = kept.split("\n")
    lines = _blank_code(kept).split("\n")
    for n, line in enumerate(lines, 1):
        # A line's context: it and its neighbours (a sentence wraps).
        near = " ".join(lines[max(n - 2, 0) : n + 1])
        found = list(ALWAYS.finditer(line))
        if LINK_CONTEXT.search(near):
            found += [m for m in LINK.finditer(line) if not LINK_AFTER.search(line[m.end() :])]
        if MS_CONTEXT.search(near):
            found += MS.finditer(line)
        if RATIO_CONTEXT.search(near):
            found += RATIO.finditer(line)
        if PCT_CONTEXT.search(near):
            found += PCT.finditer(line)
        for m in sorted(found, key=lambda m: m.start()):
            before = with_code[n - 1][: m.start()]
            if BOUND_BEFORE.search(before[-40:]) or CONFIG_BEFORE.search(before):
                continue
            if BOUND_AFTER.search(line[m.end() :]):
                continue
            f = m.group(0).strip()
            if (rel, f) not in KNOWN_UNMARKED:
                problems.append(
                    f"{rel}:{n}: unmarked figure {f!r}: quote it from bench-results "
                    "(<!-- fig PATH/ROW/FIGURE -->...<!-- /fig -->) or link to BENCHMARKING.md"
                )
    return problems


def quoting_files(root: pathlib.Path) -> list[pathlib.Path]:
    files = [root / f for f in QUOTING if (root / f).exists()]
    book = root / BOOK
    if book.is_dir():
        files += sorted(p for p in book.rglob("*.md") if p.relative_to(root).as_posix() not in SKIP)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 on any difference")
    ap.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    root = args.root.resolve()
    results = Results(root)
    target = root / "BENCHMARKING.md"
    text = target.read_text(encoding="utf-8")
    new, changed, problems = render(results, text)
    if not args.check:
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 1
        if new != text:
            target.write_text(new, encoding="utf-8")
        print(f"BENCHMARKING.md: {len(changed)} region(s) rewritten" + (f" ({', '.join(changed)})" if changed else ""))
        return 0
    problems += [
        f"BENCHMARKING.md: region {name} differs from "
        + (f"bench-results/{name}.json" if name in results.files else "bench-results/")
        + " (run scripts/render-benchmarks.py)"
        for name in changed
    ]
    problems += check_quotes(results, "BENCHMARKING.md", text, generated=True)
    checked = 1
    for f in quoting_files(root):
        problems += check_quotes(results, f.relative_to(root).as_posix(), f.read_text(encoding="utf-8"))
        checked += 1
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    n = sum(len(d["rows"]) for d in results.files.values())
    print(f"benchmarks: {len(results.files)} results files, {n} rows; BENCHMARKING.md up to date; {checked} files' figures checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
