#!/usr/bin/env bash
# Installs (once) a current UCX, outside the checkout and keyed by its version, for building
# and testing kvxfer against it instead of the system's (Debian's UCX 1.13, libucx-dev):
#
#   $KVXFER_VENV_CACHE/libucx-cu12-<UCX_VERSION>/libucx     lib/ (libucp, libuct, libucs,
#       the transport modules in lib/ucx/), include/, lib/pkgconfig/ucx.pc
#
# It is the `libucx-cu12` wheel from PyPI (RAPIDS' UCX build: the shared-memory, CMA and tcp
# transports are plain host code; its CUDA modules load only where CUDA is), fetched with pip
# download (no virtualenv) at a pinned version and hash, and unpacked. The install is used
# only when its `.complete` stamp exists (a half-made one is made again).
#
# Prints shell assignments for building and running against it:
#
#   eval "$(bash scripts/ucx-current.sh)"; export UCX_HOME
#   # UCX_HOME=...              ucx-sys builds against it (see crates/ucx-sys/build.rs)
#   # UCX_LIBRARY_PATH=...      its lib/: put it in LD_LIBRARY_PATH when running what was
#   #                           built (kvxfer refuses to start UCX on another libucp)
#   LD_LIBRARY_PATH=$UCX_LIBRARY_PATH CARGO_TARGET_DIR=target/ucx-current UCX_HOME=$UCX_HOME cargo test ...
set -euo pipefail

UCX_VERSION=1.22.0
# sha256 of libucx_cu12-1.22.0-py3-none-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
UCX_WHEEL_SHA256=5cbbef0c140a0a158ae3486089af659b38822b2234cd3dc90ba40a5e6553402a
CACHE=${KVXFER_VENV_CACHE:-/var/cache/kvxfer}
PY=${PYTHON:-python3}

DIR="$CACHE/libucx-cu12-$UCX_VERSION"
HOME_DIR="$DIR/libucx"
# One install at a time: a second run waits, then finds it complete.
mkdir -p "$CACHE"
exec 9>"$CACHE/.libucx-cu12-$UCX_VERSION.lock"
flock 9
if [ ! -f "$DIR/.complete" ] || [ "$(cat "$DIR/.complete")" != "$UCX_WHEEL_SHA256" ]; then
    echo "installing UCX $UCX_VERSION (libucx-cu12 wheel) into $DIR" >&2
    rm -rf "$DIR"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "libucx-cu12==$UCX_VERSION --hash=sha256:$UCX_WHEEL_SHA256" > "$tmp/req.txt"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --require-hashes \
        -r "$tmp/req.txt" -d "$tmp/wheel" >&2
    mkdir -p "$DIR"
    "$PY" -m zipfile -e "$tmp"/wheel/libucx_cu12-*.whl "$DIR"
    for f in lib/libucp.so lib/pkgconfig/ucx.pc include/ucp/api/ucp.h; do
        [ -e "$HOME_DIR/$f" ] || { echo "ucx-current.sh: the wheel has no libucx/$f" >&2; exit 1; }
    done
    # The stamp names the wheel it was made from: a re-pinned hash installs again.
    echo "$UCX_WHEEL_SHA256" > "$DIR/.complete"
fi

printf 'UCX_HOME=%q\n' "$HOME_DIR"
printf 'UCX_LIBRARY_PATH=%q\n' "$HOME_DIR/lib"
