#!/usr/bin/env bash
# Times `pdctl up -d` of a simulated 4P4D cluster (real etcd + real mooncake_master, four
# prefill and four decode `pdctl sim` engines, and the embedded proxy unless PROXY=0) until
# every service is healthy, and `pdctl down` until nothing is left, over several runs;
# prints every run and the medians. The target is under 1 s for each.
#
# `pdctl up -d -f bench.toml` runs the plan exactly as the planner makes it (single-member
# etcd with a short election timeout: without it etcd alone took 1-2 s to serve).
#
#   bench/supervisor_up_down.sh            # 10 runs each with target/release/pdctl (built if missing)
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

# Free ports chosen by the OS: etcd, the master, the proxy, and 4 consecutive per role.
read -r etcd_client etcd_peer rpc metrics proxy pbase dbase < <(python3 bench/free_ports.py 1 1 1 1 1 4 4)

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
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

# One up/down cycle; prints "up_ms down_ms".
cycle() {
    local t0 t1 t2
    t0=$(now_ms)
    if ! "$PDCTL" up -d "$@" --state-dir "$state" >"$work/up.log" 2>&1; then
        echo "up failed:" >&2
        cat "$work/up.log" >&2
        exit 1
    fi
    t1=$(now_ms)
    "$PDCTL" down --state-dir "$state" >"$work/down.log" 2>&1
    t2=$(now_ms)
    # down must leave nothing: no engine of this bench may still listen.
    if pgrep -f "pdctl sim .*--port $pbase" >/dev/null; then
        echo "an engine survived down" >&2
        exit 1
    fi
    echo "$((t1 - t0)) $((t2 - t1))"
}

ups=() downs=()
echo "$PDCTL, $RUNS runs, proxy=$proxy_enabled, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "run     up   down   (ms)"
for i in $(seq 1 "$RUNS"); do
    read -r u d < <(cycle -f "$work/bench.toml")
    ups+=("$u") downs+=("$d")
    printf '%3d  %5d  %5d\n' "$i" "$u" "$d"
done
echo "median: up $(median "${ups[@]}") ms, down $(median "${downs[@]}") ms"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
