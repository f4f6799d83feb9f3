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
    for name in ("BENCHMARKING.md", "README.md", "ARCHITECTURE.md"):
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "bench-results", root / "bench-results")
    shutil.copytree(ROOT / "docs" / "src", root / "docs" / "src")
    return root


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
    readme = root / "README.md"
    readme.write_text(
        readme.read_text(encoding="utf-8") + "\nkvxfer moves 14.5–16.7 GiB/s over shared memory.\n", encoding="utf-8"
    )
    r = run("--check", "--root", str(root))
    assert r.returncode != 0
    assert "unmarked figure '14.5–16.7 GiB/s'" in r.stderr
    # A ratio against raw TCP, a latency and a CPU share are figures too.
    for line in ("TCP reaches 0.66–0.90x of raw TCP.", "A hand-off's p50 is 97 µs.", "The CRC is 12% of the CPU samples."):
        readme.write_text(readme.read_text(encoding="utf-8").replace("kvxfer moves", "x") + "\n" + line + "\n")
        assert run("--check", "--root", str(root)).returncode != 0, line


def test_configuration_values_are_not_figures(tmp_path: pathlib.Path) -> None:
    root = copy_repo(tmp_path)
    page = root / "docs" / "src" / "guides" / "tuning.md"
    page.write_text(
        page.read_text(encoding="utf-8")
        + "\nA heartbeat every 100 ms, an io timeout of 10 s, 64 KiB blocks, a rate limit of 1 MiB/s,"
        " the ≥ 0.9x goal against raw TCP.\n\n```sh\nkvxfer-bench  # 3.4 GiB/s in a code block\n```\n",
        encoding="utf-8",
    )
    r = run("--check", "--root", str(root))
    assert r.returncode == 0, r.stderr


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
