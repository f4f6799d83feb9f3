#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 60), one after another.
# Needs a nightly toolchain and cargo-fuzz (installed here if missing). Crashes land in
# fuzz/artifacts/<target>/; the corpus grows in fuzz/corpus/<target>/.
#   scripts/fuzz.sh 300            # every target, 5 minutes each
#   scripts/fuzz.sh 60 lease_table # one target
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cd fuzz && cargo +nightly fuzz list)
fi
status=0
for t in "${targets[@]}"; do
  echo "== $t: ${seconds}s"
  before=$({ ls "fuzz/artifacts/$t" 2>/dev/null || true; } | wc -l)
  (cd fuzz && cargo +nightly fuzz run "$t" -- -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1) 2>&1 \
    | grep -E '^(==|#[0-9]+ *DONE|stat::number_of_executed_units|stat::peak_rss_mb|SUMMARY|.*panicked|.*Test unit written)' || true
  after=$({ ls "fuzz/artifacts/$t" 2>/dev/null || true; } | wc -l)
  if [ "$after" -gt "$before" ]; then
    echo "!! $t: new crash artifacts in fuzz/artifacts/$t (reproduce: cd fuzz && cargo +nightly fuzz run $t <file>)" >&2
    status=1
  fi
done
exit $status
