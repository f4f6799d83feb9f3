"""The README's Python example runs as printed."""

from __future__ import annotations

import contextlib
import io
import pathlib

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_example_runs():
    text = README.read_text()
    example = text[text.index("The Python API on its own") :].split("```python")[1].split("```")[0]
    assert len(example.strip().splitlines()) <= 10, "a ten-line example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {})
    assert out.getvalue().strip() == "['pulled', 'pulled']"
