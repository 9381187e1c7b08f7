#!/usr/bin/env bash
# A real run of the rebalancer (`[rebalance]`, mode act) to read and plot: a simulated
# 2P2D cluster (NIXL-style handoff, 4 instances of budget) under a steady load of 8
# streams whose shape shifts twice — chat with long answers, then long documents with
# short answers, then long answers again — while the head's supervisor moves instances
# between the roles. At the end it prints `pdctl rebalance history` (each look's figures
# and the moves), writes the plot, and prints the load's requests and failures per phase.
#
#   bench/rebalance-shift.sh                       # plot in target/tmp/rebalance-run.svg
#   PLOT=docs/rebalance-run.svg bench/rebalance-shift.sh
#   PHASE_S=90 WINDOW_S=10 COOLDOWN_S=40 bench/rebalance-shift.sh
#
# The sim: a long prompt (1024 tokens) computes 0.5 s, one at a time per prefill; a decode
# step is 20 ms x (1 + 0.25 per other sequence running on it). Objectives: TTFT p90 200 ms,
# ITL p90 50 ms. Takes 3 x PHASE_S seconds (default 60) plus about 20 s.
set -euo pipefail

PHASE_S=${PHASE_S:-60}
WINDOW_S=${WINDOW_S:-6}
COOLDOWN_S=${COOLDOWN_S:-30}
cd "$(dirname "$0")/.."
PLOT=${PLOT:-target/tmp/rebalance-run.svg}
if [[ -z "${PDCTL:-}" ]]; then
    cargo build --quiet --bin pdctl >&2
    PDCTL=target/debug/pdctl
fi

work=$(mktemp -d /tmp/pdctl-bench-rebalance.XXXXXX)
state="$work/state"
cleanup() {
    "$PDCTL" down -t 5 --state-dir "$state" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

read -r etcd_client etcd_peer rpc metrics proxy bootstrap pbase dbase < <(python3 bench/free_ports.py 1 1 1 1 1 4 4 4)

cat >"$work/rebalance.toml" <<TOML
cluster = "rebalance-run"

[model]
name = "sim-model"

[engine]
kind = "sim"

[engine.sim]
prefill_ms_per_token = 0.5
itl_ms = 20
batch_slowdown = 0.25

[connector]
kind = "nixl"
bootstrap_port = $bootstrap

[etcd]
client_port = $etcd_client
peer_port = $etcd_peer

[mooncake_master]
rpc_port = $rpc
metrics_port = $metrics

# Ports laid out for 4 of each role; 2 of each start.
[prefill]
instances = 2
base_port = $pbase

[decode]
instances = 2
base_port = $dbase

[rebalance]
ttft_p90_ms = 200
itl_p90_ms = 50
window_s = $WINDOW_S
cooldown_s = $COOLDOWN_S
mode = "act"

[proxy]
port = $proxy
TOML

"$PDCTL" up -d -f "$work/rebalance.toml" --state-dir "$state" >&2

# One phase: `pdctl bench` runs of 16 requests back to back (8 at a time) until the
# phase's time is up; their JSON reports are kept for the tally.
phase() {
    local name=$1 input=$2 output=$3 end=$((SECONDS + PHASE_S)) i=0
    echo "$(date +%T) phase $name: prompts of $input tokens, $output out" >&2
    while ((SECONDS < end)); do
        "$PDCTL" bench --url "http://127.0.0.1:$proxy" --num-prompts 16 --max-concurrency 8 \
            --input-len "$input" --output-len "$output" --seed "$i" \
            --json "$work/$name-$i.json" >/dev/null 2>&1 || true
        i=$((i + 1))
    done
}
phase 1-long-outputs 32 64
phase 2-long-prompts 1024 8
phase 3-long-outputs 32 64

"$PDCTL" rebalance history --state-dir "$state" --cluster rebalance-run
mkdir -p "$(dirname "$PLOT")"
"$PDCTL" rebalance history --state-dir "$state" --cluster rebalance-run --plot "$PLOT"
python3 - "$work" <<'PY'
import glob, json, os, sys
phases = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-*.json"))):
    name = os.path.basename(f).rsplit("-", 1)[0]
    r = json.load(open(f))
    c, x = phases.get(name, (0, 0))
    phases[name] = (c + r.get("completed", 0), x + r.get("failed", 0))
for name, (c, x) in sorted(phases.items()):
    print(f"load {name}: {c} requests completed, {x} failed")
PY
