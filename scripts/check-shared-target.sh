#!/usr/bin/env bash
# Two clones of this repository building into one target directory (a CI cache, sccache, a
# CARGO_TARGET_DIR exported for both): the second clone's build must compile its own proto
# file, even after the first clone is gone.
set -euo pipefail
src=${1:-$(cd "$(dirname "$0")/.." && pwd)}
rev=${2:-HEAD}  # a commit: what CI cloned (uncommitted edits are not seen)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git -C "$src" worktree list >/dev/null
git clone -q --no-checkout "$src" "$work/a" && git -C "$work/a" checkout -q "$rev"
git clone -q --no-checkout "$src" "$work/b" && git -C "$work/b" checkout -q "$rev"
export CARGO_TARGET_DIR="$work/target"
(cd "$work/a" && cargo build -q --locked -p kvxfer-proto)
rm -rf "$work/a"
# A change to the second clone's proto file makes cargo run the build script again.
sleep 1
echo "// touched" >> "$work/b/proto/kvxfer/v1/kvxfer.proto"
(cd "$work/b" && cargo build -q --locked -p kvxfer-proto)
echo "two clones sharing one target directory: ok"
