#!/usr/bin/env bash
# The multi-host demo and test (issue 13): three network namespaces with their own addresses
# — etcd (10.77.0.1), a prefill host (10.77.0.2), a decode host (10.77.0.3) — joined by veth
# pairs to a bridge in a fourth, hub namespace (10.77.0.254, where the driver runs). The
# driver (`kvxfer-multihost`) pulls a parent with n = 8 across hosts over TCP (hand-offs
# naming only the engine id, resolved through etcd) and over UCX-tcp, scrapes /metrics,
# kill -9s the prefill process, prints how long each decode node took to see its etcd key
# vanish, checks that the next pull of that engine fails at once with EngineNotRegistered,
# restarts the prefill node (a new incarnation) and pulls again. Then the failure scenarios,
# each with its figures in the summary: a network partition (the prefill host's veth down:
# the engine leaves after the TTL, pulls fail, it registers again once healed), an etcd
# outage shorter than the TTL, killed and restarted, then frozen with SIGSTOP (pulls go on,
# nothing flaps, time to reconnect), SIGTERM of the prefill node (its key goes at once,
# pulls fail at once with EngineNotRegistered), and a three-member etcd — members in the
# etcd namespace and two more (10.77.0.4, 10.77.0.5) — with the member in use killed under
# steady pulls (no pull fails). About 50 s in all.
#
#   sudo scripts/multihost.sh            # progress on stderr, one JSON summary on stdout
#   sudo scripts/multihost.sh --ttl-s 5  # other driver options: kvxfer-multihost --help
#
# Needs root, `ip netns` (iproute2) and etcd (etcd-server); without them it prints why it
# is skipped and exits 0. Everything it creates is removed on exit, also on failure or
# interruption. KVXFER_BIN_DIR=target/debug uses binaries built already (with the cluster and
# ucx features) instead of building them.
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
    echo "multihost: SKIPPED: $*" >&2
    exit 0
}
[ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces (run it as root or with sudo)"
command -v ip >/dev/null || skip "ip (iproute2) is not installed"
command -v etcd >/dev/null || skip "etcd is not installed (apt-get install etcd-server)"
probe="kvxprobe$$"
ip netns add "$probe" 2>/dev/null || skip "'ip netns add' does not work here (no network namespaces in this container?)"
# `ip netns exec` also remounts /sys, which some containers refuse even when `add` works.
if ! ip netns exec "$probe" true 2>/dev/null; then
    ip netns del "$probe" 2>/dev/null || true
    skip "'ip netns exec' does not work here (cannot enter or remount /sys in a network namespace)"
fi
ip netns del "$probe"

if [ -n "${KVXFER_BIN_DIR:-}" ]; then
    # Binaries built already (scripts/test-all.sh: `cargo test --workspace --all-features`).
    bin="$KVXFER_BIN_DIR"
else
    echo "multihost: building kvxfer-node and kvxfer-multihost (features cluster, ucx)" >&2
    cargo build --locked -q -p kvxfer-chaos --features cluster,ucx --bins
    bin="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/debug"
fi
for b in kvxfer-node kvxfer-multihost; do
    [ -x "$bin/$b" ] || { echo "multihost: $bin/$b is missing (build with --features kvxfer-chaos/cluster,kvxfer-chaos/ucx)" >&2; exit 1; }
done

# Namespace names unique per run (parallel runs do not collide; the 10.77.0.0/24 addresses
# live inside the namespaces only).
p="kvx$$"
hub="$p-hub"
hosts=(etcd pre dec etcd2 etcd3)
declare -A ip_of=([etcd]=10.77.0.1 [pre]=10.77.0.2 [dec]=10.77.0.3 [etcd2]=10.77.0.4 [etcd3]=10.77.0.5)

# etcd's data (its WAL alone is 64 MB) lives in a directory this script owns: killing the
# driver (below, on failure or interruption) skips its own clean-up.
etcd_dir=$(mktemp -d "${TMPDIR:-/tmp}/kvxfer-multihost-etcd.XXXXXX")

cleanup() {
    for ns in "${hosts[@]/#/$p-}" "$hub"; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$etcd_dir"
}
trap cleanup EXIT
trap "exit 130" INT TERM

ip netns add "$hub"
ip -n "$hub" link set lo up
ip -n "$hub" link add br0 type bridge
ip -n "$hub" addr add 10.77.0.254/24 dev br0
ip -n "$hub" link set br0 up
for h in "${hosts[@]}"; do
    ns="$p-$h"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # One veth pair per host: eth0 in the host, v<host> on the hub's bridge.
    ip link add name eth0 netns "$ns" type veth peer name "v$h" netns "$hub"
    ip -n "$hub" link set "v$h" master br0
    ip -n "$hub" link set "v$h" up
    ip -n "$ns" addr add "${ip_of[$h]}/24" dev eth0
    ip -n "$ns" link set eth0 up
done
echo "multihost: namespaces $p-{etcd,pre,dec,etcd2,etcd3} at 10.77.0.{1,2,3,4,5}, bridged in $hub" >&2

ip netns exec "$hub" "$bin/kvxfer-multihost" \
    --node-bin "$bin/kvxfer-node" \
    --etcd-ns "$p-etcd" --etcd-ip "${ip_of[etcd]}" --etcd-dir "$etcd_dir" \
    --prefill-ns "$p-pre" --prefill-ip "${ip_of[pre]}" \
    --decode-ns "$p-dec" --decode-ip "${ip_of[dec]}" \
    --prefill-link vpre \
    --etcd-member "$p-etcd=${ip_of[etcd]}" --etcd-member "$p-etcd2=${ip_of[etcd2]}" \
    --etcd-member "$p-etcd3=${ip_of[etcd3]}" \
    "$@"
