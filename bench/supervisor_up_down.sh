#!/usr/bin/env bash
# Times `pdctl up -d` of a simulated 4P4D cluster (real etcd + real mooncake_master, four
# prefill and four decode `pdctl sim` engines, the embedded proxy) until every service is
# healthy, and `pdctl down` until nothing is left, over several runs; prints every run and
# the medians. The target is under 1 s for each.
#
#   bench/supervisor_up_down.sh            # 10 runs with target/release/pdctl (built if missing)
#   RUNS=20 PDCTL=target/debug/pdctl bench/supervisor_up_down.sh
#   PROXY=0 bench/supervisor_up_down.sh    # without the proxy service
set -euo pipefail

RUNS=${RUNS:-10}
PROXY=${PROXY:-1}
cd "$(dirname "$0")/.."
if [[ -z "${PDCTL:-}" ]]; then
    PDCTL=target/release/pdctl
    [[ -x $PDCTL ]] || cargo build --release --bin pdctl >&2
fi

work=$(mktemp -d /tmp/pdctl-bench-updown.XXXXXX)
state="$work/state"
cleanup() {
    "$PDCTL" down -t 5 --state-dir "$state" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

# Free ports, chosen by the OS, for etcd, the master, the proxy and 8 engines.
read -r etcd_client etcd_peer rpc metrics proxy pbase dbase < <(python3 - <<'PY'
import socket
def free(n=1):
    # n consecutive free ports starting at a free one
    while True:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); base = s.getsockname()[1]; s.close()
        if base + n > 65000:
            continue
        ok = True
        for p in range(base, base + n):
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", p))
            except OSError:
                ok = False
            t.close()
        if ok:
            return base
print(free(), free(), free(), free(), free(), free(4), free(4))
PY
)

proxy_enabled=$([[ $PROXY == 1 ]] && echo true || echo false)
cat >"$work/bench.toml" <<TOML
cluster = "bench-4p4d"

[model]
name = "sim-model"

[engine]
kind = "sim"

[connector]
kind = "mooncake-store"

[etcd]
client_port = $etcd_client
peer_port = $etcd_peer

[mooncake_master]
rpc_port = $rpc
metrics_port = $metrics

[prefill]
instances = 4
base_port = $pbase

[decode]
instances = 4
base_port = $dbase

[proxy]
enabled = $proxy_enabled
port = $proxy
TOML

now_ms() { date +%s%3N; }
ups=()
downs=()
echo "run  up_ms  down_ms   ($PDCTL, $RUNS runs, proxy=$proxy_enabled)"
for i in $(seq 1 "$RUNS"); do
    t0=$(now_ms)
    if ! "$PDCTL" up -d -f "$work/bench.toml" --state-dir "$state" >"$work/up.log" 2>&1; then
        echo "up failed in run $i:" >&2
        cat "$work/up.log" >&2
        exit 1
    fi
    t1=$(now_ms)
    "$PDCTL" down --state-dir "$state" >"$work/down.log" 2>&1
    t2=$(now_ms)
    # down must leave nothing: the run's processes carry its run id in their environment.
    if pgrep -f "pdctl sim .*--port $pbase" >/dev/null; then
        echo "run $i: an engine survived down" >&2
        exit 1
    fi
    ups+=($((t1 - t0)))
    downs+=($((t2 - t1)))
    printf '%3d  %5d  %7d\n' "$i" "$((t1 - t0))" "$((t2 - t1))"
done

median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "median up (to all healthy): $(median "${ups[@]}") ms"
echo "median down (nothing left): $(median "${downs[@]}") ms"
