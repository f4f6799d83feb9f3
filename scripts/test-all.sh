#!/usr/bin/env bash
# Runs every kvxfer test on a fresh Debian machine that has a Rust toolchain (run as root,
# or with sudo available, when system packages are missing).
#
# What it needs beyond the toolchain is installed first: today nothing, since the wire
# protocol is compiled by protox (pure Rust, no protoc) and the TCP path has no C
# dependencies. System packages for later data paths are listed in SYSTEM_PACKAGES.
set -euo pipefail
cd "$(dirname "$0")/.."

SYSTEM_PACKAGES=()
missing=()
for p in "${SYSTEM_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

echo "== format and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== tests"
cargo test --workspace --locked

echo "== loopback smoke run (pulled, released and expired children; exits non-zero on any mismatch)"
cargo run --locked --example loopback -- --n 3 --cancel-child 1 --skip-child 2 --lease-ms 500 --json
