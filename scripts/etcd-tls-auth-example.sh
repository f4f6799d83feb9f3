#!/usr/bin/env bash
# A complete etcd set-up for kvxfer with TLS, client certificates and authentication, as the
# cluster guide shows it (docs/src/guides/cluster.md includes the ANCHOR regions), run end to
# end on 127.0.0.1 by the README test command: certificates, etcd's flags, the users and the
# role (etcdctl), then a kvxfer engine registered with its settings from the environment
# (`EtcdConfig::security_from_env`), and the refusals a wrong set-up gets.
#
# Usage: scripts/etcd-tls-auth-example.sh [path to kvxfer-register]
# (default: target/debug/kvxfer-register, built by `cargo build -p kvxfer-cluster --bins`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
register=${1:-$root/target/debug/kvxfer-register}
for tool in etcd etcdctl openssl "$register"; do
    command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
dir=$(mktemp -d)
pids=()
# Waits up to 10 s for process $1 to exit (it was signalled, or its stdin closed).
gone() {
    for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
    return 1
}
cleanup() {
    # etcd and a registration still running: TERM, then KILL if one does not go.
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do gone "$p" || kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
cd "$dir"
# Two free ports on 127.0.0.1 (client, peer).
read -r CLIENT_PORT PEER_PORT < <(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])')

# ANCHOR: certificates
# A CA, etcd's server certificate (for the address clients dial) and a client certificate.
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj /CN=etcd-ca -keyout ca.key -out ca.crt
openssl req -newkey rsa:2048 -nodes -subj /CN=etcd -keyout server.key -out server.csr
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out server.crt \
    -extfile <(printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n')
openssl req -newkey rsa:2048 -nodes -subj /CN=kvxfer -keyout client.key -out client.csr
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out client.crt \
    -extfile <(printf 'extendedKeyUsage=clientAuth\n')
# ANCHOR_END: certificates
chmod 600 ./*.key

# ANCHOR: etcd
# etcd serving clients over TLS only, asking each for a certificate the CA signed.
etcd --name kvxfer-etcd --data-dir etcd-data \
    --listen-client-urls "https://127.0.0.1:$CLIENT_PORT" \
    --advertise-client-urls "https://127.0.0.1:$CLIENT_PORT" \
    --listen-peer-urls "http://127.0.0.1:$PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
    --initial-cluster "kvxfer-etcd=http://127.0.0.1:$PEER_PORT" \
    --cert-file server.crt --key-file server.key --trusted-ca-file ca.crt --client-cert-auth \
    >etcd.log 2>&1 &
# ANCHOR_END: etcd
pids+=($!)

# ANCHOR: etcdctl
ctl() { etcdctl --endpoints "https://127.0.0.1:$CLIENT_PORT" --cacert ca.crt --cert client.crt --key client.key "$@"; }
for _ in $(seq 100); do ctl endpoint health >/dev/null 2>&1 && break; sleep 0.1; done   # etcd up
# ANCHOR_END: etcdctl
ctl endpoint health || { echo "etcd did not come up:" >&2; cat etcd.log >&2; exit 1; }
# ANCHOR: roles
# A root user, then a role that may read and write the namespace's prefix only, and the
# user kvxfer's agents log in as; then authentication on.
ctl user add root:root-password
ctl user grant-role root root
ctl role add kvxfer
ctl role grant-permission kvxfer --prefix=true readwrite /prod/
ctl user add kvxfer:kvxfer-password
ctl user grant-role kvxfer kvxfer
ctl auth enable
# ANCHOR_END: roles

# ANCHOR: agent
# The agent's etcd settings, read by EtcdConfig::security_from_env() (the password from a file).
echo kvxfer-password >etcd-password && chmod 600 etcd-password
export KVXFER_ETCD_CA=$PWD/ca.crt KVXFER_ETCD_CERT=$PWD/client.crt KVXFER_ETCD_KEY=$PWD/client.key
export KVXFER_ETCD_USER=kvxfer KVXFER_ETCD_PASSWORD_FILE=$PWD/etcd-password
# ANCHOR_END: agent

# The engine rank registered (kvxfer-register: an agent's registration, on its own), until
# its stdin closes.
mkfifo hold
"$register" --etcd "https://127.0.0.1:$CLIENT_PORT" --namespace prod --engine-id prefill-0 \
    --addr 10.0.0.7:5600 --ttl-secs 5 <hold >register.out 2>register.err &
pids+=($!)
exec 3>hold
for _ in $(seq 100); do grep -q '"registered"' register.out 2>/dev/null && break; sleep 0.1; done
grep -q '"registered"' register.out || { cat register.out register.err >&2; exit 1; }
keys=$(ctl --user root:root-password get --prefix /prod/ --keys-only)
echo "$keys"
grep -qx /prod/v1/engines/prefill-0/0 <<<"$keys" || { echo "no engine key" >&2; exit 1; }
exec 3>&-
gone "${pids[1]}" || { echo "the registration did not end when its stdin closed" >&2; exit 1; }
grep -q '"revoked"' register.out || { echo "the registration did not end by revoking its key" >&2; exit 1; }

# What a wrong set-up gets: refused at the first answer, exit status 1, etcd's reason named.
# Each run's stdin stays open (a FIFO this script holds open for reading and writing), so
# only a refusal ends it: an accepted registration would hold on until the timeout kills it.
mkfifo open-stdin
exec 4<>open-stdin
refused() {
    local want=$1
    shift
    if timeout 30 "$register" --etcd "https://127.0.0.1:$CLIENT_PORT" --engine-id prefill-0 \
        --addr 10.0.0.7:5600 "$@" <open-stdin >refused.out 2>&1; then
        cat refused.out >&2
        echo "expected a refusal naming '$want'" >&2
        exit 1
    fi
    if ! grep -Eq "$want" refused.out; then
        echo "expected '$want' in:" >&2
        cat refused.out >&2
        exit 1
    fi
    echo "refused as expected: $(grep -Eo "$want" refused.out | head -1)"
}
# A namespace outside the role's prefix.
refused "permission denied" --namespace other
# A wrong password.
echo wrong >wrong-password
KVXFER_ETCD_PASSWORD_FILE=$PWD/wrong-password refused "authentication failed" --namespace prod
# No client certificate while etcd asks for one.
(unset KVXFER_ETCD_CERT KVXFER_ETCD_KEY; refused "BadCertificate|CertificateRequired|certificate required" --namespace prod)
exec 4>&-
echo "etcd with TLS, client certificates and authentication: ok"
