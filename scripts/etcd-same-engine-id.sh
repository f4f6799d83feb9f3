#!/usr/bin/env bash
# Times, against a throw-away etcd on 127.0.0.1 free ports, what happens to a second process
# registering a live engine's id (refused: how long until it exits) and to a restart right
# after kill -9 (how long until it is registered), with kvxfer-register and TTL 10 s.
# Usage: scripts/etcd-same-engine-id.sh [runs]   (needs etcd on PATH and a debug build of
# kvxfer-register: cargo build -p kvxfer-cluster --bins)
set -euo pipefail
RUNS=${1:-3}
REG=${KVXFER_REGISTER:-$(dirname "$0")/../target/debug/kvxfer-register}
DIR=$(mktemp -d)
read -r CP PP < <(python3 -c "
import socket
a=socket.socket();a.bind(('127.0.0.1',0));b=socket.socket();b.bind(('127.0.0.1',0))
print(a.getsockname()[1], b.getsockname()[1])")
etcd --name m --data-dir "$DIR/data" --listen-client-urls "http://127.0.0.1:$CP" \
    --advertise-client-urls "http://127.0.0.1:$CP" --listen-peer-urls "http://127.0.0.1:$PP" \
    --initial-advertise-peer-urls "http://127.0.0.1:$PP" --initial-cluster "m=http://127.0.0.1:$PP" \
    --log-level=warn > "$DIR/etcd.log" 2>&1 < /dev/null &
ETCD=$!
trap 'kill $ETCD 2>/dev/null; rm -rf "$DIR"' EXIT
sleep 2
# kvxfer-register leaves when its stdin closes: a FIFO this shell holds open keeps them all.
mkfifo "$DIR/hold"
exec 3<>"$DIR/hold"
E=http://127.0.0.1:$CP
now() { date +%s.%N; }
for i in $(seq "$RUNS"); do
    "$REG" --etcd "$E" --engine-id "e$i" --addr 127.0.0.1:7400 --ttl-secs 10 < "$DIR/hold" > "$DIR/a$i" 2>/dev/null &
    A=$!
    until grep -qs registered "$DIR/a$i"; do sleep 0.01; done
    t0=$(now)
    rc=0
    "$REG" --etcd "$E" --engine-id "e$i" --addr 127.0.0.1:7401 --ttl-secs 10 < "$DIR/hold" > /dev/null 2> "$DIR/d$i" || rc=$?
    echo "run $i: a second live process exited $rc after $(echo "$(now) - $t0" | bc) s: $(tail -1 "$DIR/d$i" | cut -c1-90)"
    kill -9 "$A"
    t0=$(now)
    "$REG" --etcd "$E" --engine-id "e$i" --addr 127.0.0.1:7400 --ttl-secs 10 < "$DIR/hold" > "$DIR/b$i" 2>/dev/null &
    B=$!
    until grep -qs registered "$DIR/b$i"; do sleep 0.01; done
    echo "run $i: a restart registered $(echo "$(now) - $t0" | bc) s after kill -9 of the first (TTL 10 s)"
    kill "$B"
    wait "$B" 2>/dev/null || true
done
