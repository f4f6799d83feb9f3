#!/usr/bin/env bash
# Runs kvxfer-bench with the prefill and decode agents in two processes on 127.0.0.1:
# `serve` in the background, `pull` in the foreground, both with the same transport flags.
#
#   scripts/bench-two-process.sh [pull flags...]
#   scripts/bench-two-process.sh --transport ucx --ucx-tls posix,sysv,cma,self --block-bytes 64K,2M --json
#
# Builds kvxfer-bench in release mode with the UCX feature (needs libucx-dev), unless
# KVXFER_BENCH names a binary to use instead (for A/B runs of two builds).
#
# UCX_HOME=<prefix>, exported (e.g. `eval "$(bash scripts/ucx-current.sh)"; export UCX_HOME`), builds and runs against
# that UCX instead of the system's: the build goes to target/ucx-current (unless
# CARGO_TARGET_DIR says otherwise, so the system build is not invalidated) and both
# processes run with $UCX_HOME/lib first in LD_LIBRARY_PATH (a KVXFER_BENCH binary too).
# The JSON's `ucx_version` (and `prefill.ucx_version`) is the libucp each process loaded.
#
# --serve-cpus LIST / --pull-cpus LIST (taskset's CPU lists, taken by this script) pin each
# process to its own cores, as two hosts would have them. Unpinned on loopback with two
# connections, the raw TCP baseline's sending threads count about half the CPU they count
# pinned (where the loopback's receive work lands when both ends can share a core), and
# kvxfer's prefill does not get that discount: the CPU goals are judged pinned.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${UCX_HOME:-}" ]; then
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target/ucx-current}
    export LD_LIBRARY_PATH="$UCX_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
bin=${KVXFER_BENCH:-}
if [ -z "$bin" ]; then
    cargo build -q --release -p kvxfer-bench --features ucx
    # Where cargo put it: honours CARGO_TARGET_DIR and a configured build.target-dir.
    target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    if [ -z "$target_dir" ]; then
        echo "bench-two-process.sh: cargo metadata named no target directory" >&2
        exit 1
    fi
    bin=$target_dir/release/kvxfer-bench
fi

# UCX reads every UCX_* variable and warns about UCX_HOME, which is not one of its own: the
# build above was its only reader.
unset UCX_HOME

# The serve side takes the transport flags, --worker-threads and --memory (pull takes them
# too; it checks that `serve` used the --memory it names).
serve_args=()
serve_pin=()
pull_pin=()
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --serve-cpus|--pull-cpus)
            if [ $# -lt 2 ]; then
                echo "bench-two-process.sh: $1 needs a CPU list (e.g. 0 or 0-1)" >&2
                exit 2
            fi
            if [ "$1" = --serve-cpus ]; then serve_pin=(taskset -c "$2"); else pull_pin=(taskset -c "$2"); fi
            shift 2
            ;;
        --serve-cpus=*) serve_pin=(taskset -c "${1#*=}"); shift ;;
        --pull-cpus=*) pull_pin=(taskset -c "${1#*=}"); shift ;;
        *) args+=("$1"); shift ;;
    esac
done
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --transport|--ucx-tls|--worker-threads|--memory) serve_args+=("${args[$i]}" "${args[$((i + 1))]}") ;;
        --memory=*|--transport=*|--ucx-tls=*|--worker-threads=*) serve_args+=("${args[$i]}") ;;
        --ucx-peer-failure|--precompute-crcs) serve_args+=("${args[$i]}") ;;
    esac
done

fifo=$(mktemp -u)
mkfifo "$fifo"
"${serve_pin[@]}" "$bin" serve --listen 127.0.0.1:0 --runs 1 "${serve_args[@]}" > "$fifo" &
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null || true; rm -f "$fifo"' EXIT
read -r line < "$fifo"
addr=${line##* }
"${pull_pin[@]}" "$bin" pull --peer "$addr" "${args[@]}"
wait $serve_pid
