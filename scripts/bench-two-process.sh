#!/usr/bin/env bash
# Runs kvxfer-bench with the prefill and decode agents in two processes on 127.0.0.1:
# `serve` in the background, `pull` in the foreground, both with the same transport flags.
#
#   scripts/bench-two-process.sh [pull flags...]
#   scripts/bench-two-process.sh --transport ucx --ucx-tls posix,sysv,cma,self --block-bytes 64K,2M --json
#
# Builds kvxfer-bench in release mode with the UCX feature (needs libucx-dev), unless
# KVXFER_BENCH names a binary to use instead (for A/B runs of two builds).
set -euo pipefail
cd "$(dirname "$0")/.."
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

# The serve side takes the transport flags and --worker-threads (pull takes them too).
serve_args=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --transport|--ucx-tls|--worker-threads) serve_args+=("${args[$i]}" "${args[$((i + 1))]}") ;;
        --ucx-peer-failure|--precompute-crcs) serve_args+=("${args[$i]}") ;;
    esac
done

fifo=$(mktemp -u)
mkfifo "$fifo"
"$bin" serve --listen 127.0.0.1:0 --runs 1 "${serve_args[@]}" > "$fifo" &
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null || true; rm -f "$fifo"' EXIT
read -r line < "$fifo"
addr=${line##* }
"$bin" pull --peer "$addr" "$@"
wait $serve_pid
