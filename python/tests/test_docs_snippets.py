"""The book's code blocks that are code: every ```python block of docs/src compiles, the ones
that need nothing beyond kvxfer, numpy and the standard library run, and every ```json block
(e.g. a kv_transfer_config) parses.

A Python block containing ``# not-run`` is only compiled (for fragments that need a server,
vLLM or a GPU). Rust blocks are not handled here: full Rust examples live in examples/,
which CI runs, and the book's Rust fragments are marked ``rust,ignore``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import pathlib
import re
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "src"
RUNNABLE_IMPORTS = {"kvxfer", "numpy"} | set(sys.stdlib_module_names)
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(id, code) of every fenced block of `lang` in the book's Markdown sources."""
    out = []
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            info = m.group(1).strip().split(",")[0].strip()
            if info == lang:
                line = text.count("\n", 0, m.start()) + 1
                out.append((f"{path.relative_to(DOCS)}:{line}", m.group(2)))
    return out


PYTHON = _blocks("python")
JSON = _blocks("json")


def _top_level_imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_book_has_code_blocks():
    assert PYTHON, f"no ```python block under {DOCS}"
    assert JSON, f"no ```json block under {DOCS}"


@pytest.mark.parametrize("where,code", PYTHON, ids=[w for w, _ in PYTHON])
def test_python_block(where, code):
    tree = ast.parse(code, where)
    compiled = compile(tree, where, "exec")
    if "# not-run" in code:
        return
    imports = _top_level_imports(tree)
    if not imports <= RUNNABLE_IMPORTS:
        return  # needs more than kvxfer: compiling it is the check
    if "kvxfer" in imports:
        pytest.importorskip("kvxfer._kvxfer", reason="the kvxfer extension is not built")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compiled, {"__name__": "__docs__"})


@pytest.mark.parametrize("where,text", JSON, ids=[w for w, _ in JSON])
def test_json_block(where, text):
    value = json.loads(text)
    if isinstance(value, dict) and "kv_connector" in value:
        # A kv_transfer_config: the connector as vLLM's factory loads it.
        assert value["kv_connector"] == "KvxferConnector", where
        assert value["kv_connector_module_path"] == "kvxfer.vllm", where
        assert value["kv_role"] in ("kv_producer", "kv_consumer", "kv_both"), where
        extra = value.get("kv_connector_extra_config", {})
        assert all(k.startswith("kvxfer_") for k in extra), where


def test_every_expected_output_block_is_checked_by_a_test():
    """A guide's ``<!-- output: NAME -->`` block (what a command prints) is compared with the
    real output by a test that names its guide and it (python/tests/real_vllm/guide_output.py's
    checks: ``check_lines("vllm.md", "NAME", ...)``), so it cannot go stale unnoticed; and each
    name marks one block only."""
    blocks = [(p.name, n) for p in DOCS.rglob("*.md") for n in re.findall(r"<!-- output: ([\w-]+) -->", p.read_text())]
    assert blocks, "no expected-output block in the book"
    names = [n for _, n in blocks]
    assert len(names) == len(set(names)), f"an output name marks several blocks: {sorted(names)}"
    tests = pathlib.Path(__file__).resolve().parent
    text = "\n".join(p.read_text() for p in tests.rglob("*.py") if p.name != "test_docs_snippets.py")
    call = r'check_(?:lines|metrics|metric_deltas)\(\s*"{guide}",\s*"{name}"'
    unchecked = [(g, n) for g, n in blocks if not re.search(call.format(guide=re.escape(g), name=re.escape(n)), text)]
    assert not unchecked, f"expected-output blocks no test compares with real output: {unchecked}"
