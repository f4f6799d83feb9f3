#!/usr/bin/env bash
# What the Prometheus metrics cost on the TCP path: paired one-process kvxfer-bench runs,
# without and with `--metrics` (both agents feed one registry, scraped every second during
# the run), interleaved and alternating which goes first, so drift of a shared machine hits
# both sides alike. Prints one line per run and the per-pair differences.
#
#   scripts/bench-metrics-cost.sh [PAIRS] [kvxfer-bench options...]
#   scripts/bench-metrics-cost.sh 6 --block-bytes 64K,2M
#   scripts/bench-metrics-cost.sh 6 --block-bytes 4K --total-bytes 16M --parents 64   # many small children
#
# Needs python3 for the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-6}
shift || true
[ $# -gt 0 ] || set -- --block-bytes 64K,2M
cargo build --release --locked -q -p kvxfer-bench --features cluster
bench="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release/kvxfer-bench"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
port=$((20000 + $$ % 20000))

run() { # $1 = off|on, $2 = pair
    if [ "$1" = on ]; then
        (while sleep 1; do curl -s -o /dev/null "http://127.0.0.1:$port/metrics" || true; done) &
        scraper=$!
        "$bench" --transport tcp --json --metrics "127.0.0.1:$port" "${@:3}" 2>/dev/null | sed "s/^/$1 $2 /" >>"$out"
        kill "$scraper" 2>/dev/null || true
        wait "$scraper" 2>/dev/null || true
    else
        "$bench" --transport tcp --json "${@:3}" 2>/dev/null | sed "s/^/$1 $2 /" >>"$out"
    fi
}

for ((p = 0; p < pairs; p++)); do
    if ((p % 2 == 0)); then run off "$p" "$@"; run on "$p" "$@"; else run on "$p" "$@"; run off "$p" "$@"; fi
    echo "pair $((p + 1))/$pairs done" >&2
done

python3 - "$out" <<'EOF'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    mode, pair, js = line.split(" ", 2)
    r = json.loads(js)
    runs.setdefault((r["block_bytes"], int(pair)), {})[mode] = r
by_block = {}
for (block, pair), m in sorted(runs.items()):
    if "on" in m and "off" in m:
        by_block.setdefault(block, []).append((pair, m["off"], m["on"]))
for block, rows in by_block.items():
    print(f"block {block} B: {len(rows)} pairs")
    print("  pair  GiB/s off   on    diff%   p50 ms off   on    CPU s/GiB off  on")
    diffs, lat, cpu = [], [], []
    for pair, off, on in rows:
        d = (on["gib_per_s"] / off["gib_per_s"] - 1) * 100
        diffs.append(d)
        lat.append((on["p50_us"] / off["p50_us"] - 1) * 100)
        cpu.append((on["cpu_s_per_gib"] / off["cpu_s_per_gib"] - 1) * 100)
        print(f"  {pair:>4}  {off['gib_per_s']:8.2f} {on['gib_per_s']:6.2f} {d:+7.1f}%  "
              f"{off['p50_us']/1000:9.1f} {on['p50_us']/1000:6.1f}   {off['cpu_s_per_gib']:9.3f} {on['cpu_s_per_gib']:5.3f}")
    off_all = [o["gib_per_s"] for _, o, _ in rows]
    on_all = [n["gib_per_s"] for _, _, n in rows]
    print(f"  GiB/s mean off {statistics.mean(off_all):.2f} (sd {statistics.pstdev(off_all):.2f}), "
          f"on {statistics.mean(on_all):.2f} (sd {statistics.pstdev(on_all):.2f})")
    print(f"  paired GiB/s difference (on/off - 1): median {statistics.median(diffs):+.1f}%, "
          f"mean {statistics.mean(diffs):+.1f}%, range {min(diffs):+.1f}% .. {max(diffs):+.1f}%")
    print(f"  paired p50 hand-off latency difference: median {statistics.median(lat):+.1f}%; "
          f"CPU s/GiB: median {statistics.median(cpu):+.1f}%")
EOF
