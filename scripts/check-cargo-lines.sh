#!/usr/bin/env bash
# The dependency lines of the embedding guide ("Getting it") work as written: a crate outside
# the workspace, with exactly that guide's `[dependencies]` block, builds the guide's code
# fragments (examples/guide_snippets.rs) against this checkout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The guide's path is `../kvxfer/crates/kvxfer`, from a project next to a checkout.
ln -s "$root" "$work/kvxfer"
mkdir -p "$work/app/src"
deps=$(awk '/^## Getting it/{g=1} g&&/^```toml/{t=1;next} t&&/^```/{exit} t{print}' "$root/docs/src/guides/embedding.md")
if ! grep -q '^kvxfer = { path = "../kvxfer/crates/kvxfer" }' <<<"$deps"; then
    echo "docs/src/guides/embedding.md: no path dependency line under 'Getting it'" >&2
    exit 1
fi
# (The fragments' etcd part is behind the app's own `cluster` feature, as in an application,
# built in a second pass below.)
printf '[package]\nname = "app"\nversion = "0.1.0"\nedition = "2021"\n\n%s\n\n[features]\ncluster = ["kvxfer/cluster"]\n' \
    "$deps" >"$work/app/Cargo.toml"
cp "$root/examples/guide_snippets.rs" "$work/app/src/main.rs"
# The workspace's lock file pins the same versions (cargo drops what the app does not use).
cp "$root/Cargo.lock" "$work/app/Cargo.lock"
# The default features, then with kvxfer's `cluster` feature: the fragments' etcd part.
(cd "$work/app" && CARGO_TARGET_DIR="$root/target/cargo-lines" RUSTFLAGS="-D warnings" cargo check -q --offline)
(cd "$work/app" && CARGO_TARGET_DIR="$root/target/cargo-lines" RUSTFLAGS="-D warnings" cargo check -q --offline --features cluster)
echo "the embedding guide's dependency lines build its fragments: ok"
