"""scripts/render-benchmarks.py: BENCHMARKING.md and the figures quoted in the docs agree
with bench-results/, and the check notices when they do not (on copies, never the real files).
Standard library and pytest only: the kvxfer extension is not needed."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "render-benchmarks.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def copy_repo(tmp: pathlib.Path) -> pathlib.Path:
    root = tmp / "repo"
    root.mkdir()
    for name in ("BENCHMARKING.md", "README.md", "ARCHITECTURE.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "bench-results", root / "bench-results")
    shutil.copytree(ROOT / "docs" / "src", root / "docs" / "src")
    shutil.copy(ROOT / "docs" / "DESIGN.md", root / "docs" / "DESIGN.md")
    return root


def check_with(root: pathlib.Path, rel: str, text: str) -> subprocess.CompletedProcess[str]:
    """--check on the copy with `text` appended to the file `rel` (its original restored after)."""
    page = root / rel
    original = page.read_text(encoding="utf-8")
    page.write_text(original + "\n" + text + "\n", encoding="utf-8")
    try:
        return run("--check", "--root", str(root))
    finally:
        page.write_text(original, encoding="utf-8")


def test_the_repository_passes_the_check() -> None:
    r = run("--check", "--root", str(ROOT))
    assert r.returncode == 0, r.stderr


def test_a_copy_passes_and_rendering_is_idempotent(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    assert run("--check", "--root", str(root)).returncode == 0
    before = (root / "BENCHMARKING.md").read_bytes()
    assert run("--root", str(root)).returncode == 0
    assert run("--root", str(root)).returncode == 0
    assert (root / "BENCHMARKING.md").read_bytes() == before


def test_a_changed_result_fails_until_rendered(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    f = root / "bench-results" / "tcp-two-process.json"
    data = json.loads(f.read_text(encoding="utf-8"))
    row = next(r for r in data["rows"] if r["id"] == "64K")
    row["figures"]["gib_per_s"] = [2.07, 2.69]
    f.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    r = run("--check", "--root", str(root))
    assert r.returncode != 0
    assert "region tcp-two-process" in r.stderr
    assert run("--root", str(root)).returncode == 0
    assert "2.07–2.69" in (root / "BENCHMARKING.md").read_text(encoding="utf-8")
    assert run("--check", "--root", str(root)).returncode == 0


def test_a_changed_result_fails_the_quotes_of_it(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    f = root / "bench-results" / "ucx-shared-memory.json"
    data = json.loads(f.read_text(encoding="utf-8"))
    row = next(r for r in data["rows"] if r["id"] == "113-ucx-2M")
    row["figures"]["gib_per_s"] = [14.5, 16.7]
    f.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    assert run("--root", str(root)).returncode == 0  # the table follows; README's quote does not
    r = run("--check", "--root", str(root))
    assert r.returncode != 0
    assert "README.md" in r.stderr and "113-ucx-2M" in r.stderr


def test_a_typed_unmarked_figure_fails(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    assert run("--check", "--root", str(root)).returncode == 0
    # Each case alone, on the original README: the failure must name that case's figure.
    cases = {
        "kvxfer moves 14.5–16.7 GiB/s over shared memory.": "14.5–16.7 GiB/s",
        # A ratio against raw TCP, a latency and a CPU share are figures too.
        "TCP reaches 0.66–0.90x of raw TCP.": "0.66–0.90x",
        "A hand-off's p50 is 97 µs.": "97 µs",
        "The CRC is 12% of the CPU samples.": "12%",
    }
    for line, figure in cases.items():
        r = check_with(root, "README.md", line)
        assert r.returncode != 0, line
        assert "README.md:" in r.stderr and f"unmarked figure {figure!r}" in r.stderr, (line, r.stderr)


def test_bound_words_count_only_as_whole_words(tmp_path: pathlib.Path) -> None:
    # "bottleneck" holds "ttl", "settled" "ttl", "unlimited" "limit", "thankfully" "than",
    # "everything" "every": none of them makes the figure after it a bound.
    root = copy_repo(tmp_path)
    for line, figure in {
        "The bottleneck: kvxfer moved 3.4 GiB/s.": "3.4 GiB/s",
        "Once settled, kvxfer moved 3.5 GiB/s.": "3.5 GiB/s",
        "An unlimited pull moved 3.6 GiB/s.": "3.6 GiB/s",
        "Thankfully kvxfer moved 3.7 GiB/s.": "3.7 GiB/s",
        "Everything verified, kvxfer moved 3.8 GiB/s.": "3.8 GiB/s",
    }.items():
        r = check_with(root, "docs/src/guides/tuning.md", line)
        assert r.returncode != 0 and f"unmarked figure {figure!r}" in r.stderr, (line, r.stderr)
    # As whole words (or ending an identifier) they still mark a bound.
    line = "A pull slower than 1 MiB/s fails; `lease_ttl` 100 µs; the limit is 2 GiB/s."
    r = check_with(root, "docs/src/guides/tuning.md", line)
    assert r.returncode == 0, r.stderr


def test_the_words_before_a_figure_are_read_at_its_own_place(tmp_path: pathlib.Path) -> None:
    # The same text twice on a line: the first is a bound, the second a measurement. Reading
    # the words before the first occurrence would pass both.
    root = copy_repo(tmp_path)
    line = "Pulls slower than 2.5 GiB/s fail; over `posix,sysv,cma,self` kvxfer moved 2.5 GiB/s."
    r = check_with(root, "README.md", line)
    assert r.returncode != 0 and "unmarked figure '2.5 GiB/s'" in r.stderr, r.stderr
    assert r.stderr.count("unmarked figure") == 1, r.stderr
    # Code before a figure keeps its length: a bound word right before the figure is still read.
    r = check_with(root, "README.md", "With `--connections 8 --block-bytes 64K --total-bytes 512M` at most 3 GiB/s.")
    assert r.returncode == 0, r.stderr


def test_other_ways_to_write_units_are_figures(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    for line, figure in {
        "A hand-off's p50 is 97 μs (Greek mu).": "97 μs",
        "A hand-off's p50 is 98 µs (micro sign).": "98 µs",
        "kvxfer is 1.5× faster than raw TCP.": "1.5×",
        "kvxfer moved 450 MB/s.": "450 MB/s",
        "kvxfer moved .5 GiB/s.": ".5 GiB/s",
        "The keyed p99 was x1.10 of its baseline.": "x1.10",
        "kvxfer-bench measured 42 Gbit/s against raw TCP.": "42 Gbit/s",
    }.items():
        r = check_with(root, "docs/src/guides/tuning.md", line)
        assert r.returncode != 0 and f"unmarked figure {figure!r}" in r.stderr, (line, r.stderr)


def test_configuration_values_are_not_figures(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    r = check_with(
        root,
        "docs/src/guides/tuning.md",
        "A heartbeat every 100 ms, an io timeout of 10 s, 64 KiB blocks, a rate limit of 1 MiB/s,"
        " the ≥ 0.9x goal against raw TCP.\n\n```sh\nkvxfer-bench  # 3.4 GiB/s in a code block\n```\n"
        "\nBuilt for x86 and x86_64, measured against the raw baseline on a PCIe x16 card."
        "\nBehind a 100 Gbit/s NIC (a specification, not a measurement) and a 25 Gb/s link."
        "\nThe poller sleeps 100 µs between polls and waits for 50 µs after a miss; an interval of 250 µs.",
    )
    assert r.returncode == 0, r.stderr


def test_changelog_and_design_are_checked(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    for rel in ("CHANGELOG.md", "docs/DESIGN.md"):
        r = check_with(root, rel, "kvxfer moved 9.9 GiB/s over shared memory.")
        assert r.returncode != 0 and f"{rel}:" in r.stderr and "'9.9 GiB/s'" in r.stderr, (rel, r.stderr)


def test_a_marked_figure_that_disagrees_fails(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8")
    good = "<!-- fig ucx-shared-memory/113-ucx-2M/gib_per_s -->8.32–10.29 GiB/s<!-- /fig -->"
    assert good in text
    readme.write_text(text.replace(good, good.replace("8.32–10.29", "7.1–10.3")), encoding="utf-8")
    r = run("--check", "--root", str(root))
    assert r.returncode != 0
    assert "113-ucx-2M/gib_per_s quotes '7.1–10.3 GiB/s'" in r.stderr
    # A quote of a row that does not exist fails as well.
    readme.write_text(text.replace(good, good.replace("113-ucx-2M", "113-ucx-4M")), encoding="utf-8")
    assert "not in bench-results" in run("--check", "--root", str(root)).stderr


def test_a_goal_target_is_quoted_as_the_results_state_it(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    page = root / "docs" / "src" / "reference" / "ucx.md"
    text = page.read_text(encoding="utf-8")
    good = "<!-- fig ucx-shared-memory/goal:ucx-vs-nixl/target -->1.5x<!-- /fig -->"
    assert good in text
    page.write_text(text.replace(good, good.replace(">1.5x<", ">1.6x<")), encoding="utf-8")
    r = run("--check", "--root", str(root))
    assert r.returncode != 0 and "goal:ucx-vs-nixl/target" in r.stderr


def test_runs_pasted_from_the_bench_render_as_ranges(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    f = root / "bench-results" / "tcp-two-process.json"
    data = json.loads(f.read_text(encoding="utf-8"))
    row = next(r for r in data["rows"] if r["id"] == "2M")
    del row["figures"]["gib_per_s"]
    row["runs"] = [
        {"block_bytes": 2097152, "gib_per_s": 2.514, "verified": True},
        {"block_bytes": 65536, "gib_per_s": 9.9, "verified": True},
        {"block_bytes": 2097152, "gib_per_s": 2.872, "verified": True},
    ]
    row["where"] = {"block_bytes": 2097152}
    f.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    assert run("--root", str(root)).returncode == 0
    assert "| 2 MiB blocks | 2.51–2.87 |" in (root / "BENCHMARKING.md").read_text(encoding="utf-8")


def test_numbers_render_as_typed_and_as_measured(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    f = root / "bench-results" / "tcp-two-process.json"
    text = f.read_text(encoding="utf-8")
    data = json.loads(text)
    row = next(r for r in data["rows"] if r["id"] == "2M")
    del row["figures"]["ratio_vs_raw_tcp"]
    row["figures"].pop("gib_per_s", None)
    row["runs"] = [{"gib_per_s": 11.4}, {"gib_per_s": 32.6}, {"gib_per_s": 20.0}]
    row["figures"]["raw_tcp_gib_per_s"] = "TYPED"
    out = json.dumps(data, indent=1, ensure_ascii=False)
    # Typed with their decimals kept: 2.80 stays 2.80; a range's ends get the same decimals.
    out = out.replace('"TYPED"', "[2.80, 9.0]")
    f.write_text(out + "\n", encoding="utf-8")
    assert run("--root", str(root)).returncode == 0
    table = (root / "BENCHMARKING.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| 2 MiB blocks |")]
    assert "| 2 MiB blocks | 11.4–32.6 | 2.80–9.00 |" in table, rows
