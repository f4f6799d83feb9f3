#!/usr/bin/env bash
# The device check of the zero-copy path: kvxfer pulling a vLLM-shaped bf16 CUDA KV cache
# between two processes on one GPU over UCX (the caches registered as they are: cuda_ipc),
# then through host staging; every byte verified; GiB/s against torch's device-to-device
# copy of the same blocks, and the path UCX chose (scripts/gpu_check.py does the work).
#
# Two steps, because the GPU machine has no package registry and an older distribution:
#
#   bash scripts/gpu-check.sh prepare     # here: builds what travels into .gpu-carry/ (git-ignored
#                                         # through .git/info/exclude): the kvxfer wheel's files
#                                         # (abi3, stripped) and UCX's libraries from the
#                                         # libucx-cu12 wheel (the CUDA transports included),
#                                         # about 30 MiB; checks the glibc they need
#   bash scripts/gpu-check.sh run         # there (the device tool: carry [".gpu-carry"],
#                                         # timeout_s 540): prints ldd --version, the driver and
#                                         # torch's CUDA version, then the check's JSON lines
#                                         # (also into $OUT/gpu-check.jsonl when $OUT is set)
#
# It must finish in under 8 minutes on the device; the default sizes (32 layers, 256 blocks
# of 16 tokens x 8 heads x 128 dims, n = 4 children of 52 blocks, 3 rounds per mode) move
# about 1.6 GiB per mode.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu-carry

prepare() {
    local py=${KVXFER_VLLM_PY:-$(bash scripts/python-envs.sh | sed -n 's/^VLLM_PY=//p')}
    local venv
    venv=$(dirname "$(dirname "$py")")
    rm -rf "$CARRY" target/gpu-wheel
    mkdir -p "$CARRY/site" target/gpu-wheel
    grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude
    # Built against (and loading) the libucx-cu12 wheel of that venv (ucx-sys: PYO3_PYTHON).
    (
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
        maturin build --release --strip --locked -q -o target/gpu-wheel
    )
    "$py" -m zipfile -e target/gpu-wheel/kvxfer-*.whl "$CARRY/site"
    local site
    site=$("$py" -c 'import libucx, os; print(os.path.dirname(os.path.dirname(libucx.__file__)))')
    mkdir -p "$CARRY/site/libucx/lib/ucx"
    cp "$site"/libucx/*.py "$CARRY/site/libucx/"
    cp "$site"/libucx/GIT_COMMIT "$site"/libucx/UCX_WHEEL_VERSION.txt "$CARRY/site/libucx/" 2>/dev/null || true
    # One file per library, by soname (the unpacked wheel holds each three times: a zip has no
    # links), and the names libucx.load_library() opens as links to it.
    local f
    for f in "$site"/libucx/lib/*.so.0; do
        cp "$f" "$CARRY/site/libucx/lib/"
        ln -sf "$(basename "$f")" "$CARRY/site/libucx/lib/$(basename "$f" .0)"
    done
    # The transport modules UCX loads by soname (cma, cuda: cuda_copy and cuda_ipc; not perftest).
    for f in "$site"/libucx/lib/ucx/libuct_*.so.0 "$site"/libucx/lib/ucx/libucm_*.so.0; do
        cp "$f" "$CARRY/site/libucx/lib/ucx/"
        ln -sf "$(basename "$f")" "$CARRY/site/libucx/lib/ucx/$(basename "$f" .0)"
    done
    cp -r "$site"/libucx_cu12.libs "$CARRY/site/"
    cp -r "$site"/libucx_cu12-*.dist-info "$CARRY/site/"
    # The newest glibc symbol version anything carried needs (the device's must be >= it).
    local need
    need=$(find "$CARRY" -name '*.so*' -type f -exec objdump -T {} + 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
    echo "$need" > "$CARRY/glibc-needed"
    du -sh "$CARRY" >&2
    echo "prepared $CARRY (needs $need); on the device: bash scripts/gpu-check.sh run (carry [\"$CARRY\"])" >&2
}

run() {
    [ -d "$CARRY/site/kvxfer" ] || { echo "no $CARRY: run 'bash scripts/gpu-check.sh prepare' first (here)" >&2; exit 2; }
    echo "== machine"
    ldd --version | head -1
    echo "glibc needed by what was carried: $(cat "$CARRY/glibc-needed" 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    export PYTHONPATH="$PWD/$CARRY/site${PYTHONPATH:+:$PYTHONPATH}"
    # The UCX that was carried, and what it finds on this machine.
    python3 -c 'import kvxfer, json; print(json.dumps(kvxfer.ucx_info()))'
    echo "== check"
    local out=${OUT:-/tmp}/gpu-check.jsonl
    timeout 450 python3 scripts/gpu_check.py "$@" | tee "$out"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash scripts/gpu-check.sh prepare | run [gpu_check.py options]" >&2; exit 2 ;;
esac
