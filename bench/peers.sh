#!/usr/bin/env bash
# The PD proxies side by side on one machine, in one run, against the same backends:
# pdctl's proxy, vllm-router (PyPI, when pip can install it) and, when you supply one,
# the Python proxy script from your own setup; calling the decode engine directly is the
# floor. Backends are pdctl's simulated engines with the NIXL-style handoff (the protocol
# both pdctl and vllm-router speak); `pdctl bench` is the load generator.
#
#   bench/peers.sh                       # 3 rounds, targets in rotating order
#   PEERS_ROUNDS=5 bench/peers.sh
#   PEERS_PY_PROXY=/path/proxy.py PEERS_PY_PROXY_PORT=8000 bench/peers.sh
#       runs `python3 /path/proxy.py`, which must listen on PEERS_PY_PROXY_PORT and send
#       prefill to 127.0.0.1:8100 and decode to 127.0.0.1:8200 (the usual hand-run ports; the
#       simulated engines then take those ports)
#
# Output: a markdown table of TTFT p50/p99 (streams paced 10 ms per token) at 1 and 64
# concurrent streams, the time each proxy adds over direct, and throughput with a
# zero-latency backend, with ratios to direct. Medians over rounds.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${PEERS_ROUNDS:-3}
REQS=${PEERS_REQUESTS:-400}
TPUT_REQS=${PEERS_TPUT_REQUESTS:-3000}
VENV=${PEERS_VENV:-$HOME/.cache/pdctl/peers-venv}
OUT=$(mktemp -d -t pdctl-peers.XXXXXX)
. bench/common.sh
if [ -n "${PEERS_PY_PROXY:-}" ]; then
  python3 -c 'import quart, aiohttp' 2>/dev/null || { say "PEERS_PY_PROXY needs quart and aiohttp (pip install quart aiohttp)"; exit 2; }
fi

# Starts a prefill and a decode sim (decode tokens ITL ms apart) and the proxies in front.
# Sets DIRECT and the TARGETS list ("name url" pairs).
start_backends() {
  local itl=$1
  cleanup; PIDS=()
  local pp dp
  if [ -n "${PEERS_PY_PROXY:-}" ]; then pp=8100; dp=8200; else pp=$(free_port); dp=$(free_port); fi
  local z=(--prefill-ms-per-token 0 --overhead-ms 0 --batch-slowdown 0 --log-stats-interval-ms 0)
  RUST_LOG=warn "$PDCTL" sim --port "$pp" --role prefill --handoff nixl "${z[@]}" --itl-ms 0 2>"$OUT/prefill.log" & PIDS+=($!)
  RUST_LOG=warn "$PDCTL" sim --port "$dp" --role decode --handoff nixl "${z[@]}" --itl-ms "$itl" 2>"$OUT/decode.log" & PIDS+=($!)
  wait_http "http://127.0.0.1:$pp/health"; wait_http "http://127.0.0.1:$dp/health"
  DIRECT="http://127.0.0.1:$dp"
  TARGETS=("direct $DIRECT")
  local px; px=$(free_port)
  RUST_LOG=warn "$PDCTL" proxy --host 127.0.0.1 --port "$px" --protocol nixl \
    --prefill "127.0.0.1:$pp" --decode "127.0.0.1:$dp" 2>"$OUT/pdctl-proxy.log" & PIDS+=($!)
  wait_http "http://127.0.0.1:$px/health"
  TARGETS+=("pdctl-proxy http://127.0.0.1:$px")
  if [ -n "$ROUTER" ]; then
    local rp mp; rp=$(free_port); mp=$(free_port)
    "$ROUTER" --host 127.0.0.1 --port "$rp" --prometheus-port "$mp" --vllm-pd-disaggregation --kv-connector nixl \
      --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" --log-level warning \
      --max-concurrent-requests 1024 --queue-size 1024 >"$OUT/vllm-router.log" 2>&1 & PIDS+=($!)
    wait_http "http://127.0.0.1:$rp/health"
    TARGETS+=("vllm-router http://127.0.0.1:$rp")
  fi
  if [ -n "${PEERS_PY_PROXY:-}" ]; then
    local yp=${PEERS_PY_PROXY_PORT:-8000}
    python3 "$PEERS_PY_PROXY" >"$OUT/py-proxy.log" 2>&1 & PIDS+=($!)
    sleep 2
    TARGETS+=("python-proxy http://127.0.0.1:$yp")
  fi
}

# run NAME URL CONCURRENCY REQUESTS TAG
run() {
  "$PDCTL" bench --url "$2" --model sim-model --input-len 32 --output-len 16 --num-prompts "$4" \
    --max-concurrency "$3" --seed 1 --label "$1" --json "$OUT/$5.json" >/dev/null 2>"$OUT/$5.err" \
    || { say "bench against $1 failed: $(tail -2 "$OUT/$5.err")"; return 1; }
}

say "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
start_backends 10
for r in $(seq 1 "$ROUNDS"); do
  n=${#TARGETS[@]}
  for c in 1 64; do
    for i in $(seq 0 $((n - 1))); do          # rotate the order each round
      t=${TARGETS[$(((i + r) % n))]}
      run ${t% *} "${t#* }" "$c" "$REQS" "lat-c$c-${t% *}-r$r"
    done
  done
done
start_backends 0
for r in $(seq 1 "$ROUNDS"); do
  n=${#TARGETS[@]}
  for i in $(seq 0 $((n - 1))); do
    t=${TARGETS[$(((i + r) % n))]}
    run ${t% *} "${t#* }" 64 "$TPUT_REQS" "tput-${t% *}-r$r"
  done
done
say "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT" <<'EOF'
import json, glob, os, statistics, sys
out = sys.argv[1]
def load(pattern):
    runs = {}
    for f in sorted(glob.glob(os.path.join(out, pattern))):
        r = json.load(open(f)); runs.setdefault(r["label"], []).append(r)
    return runs
med = statistics.median
names = lambda runs: sorted(runs, key=lambda n: (n != "direct", n))
print("| streams | path | TTFT p50 | TTFT p99 | added p50 | added p99 | failed |")
print("|---:|---|---:|---:|---:|---:|---:|")
for c in (1, 64):
    runs = load(f"lat-c{c}-*.json")
    d50 = med(r["ttft_ms"]["median"] for r in runs["direct"])
    d99 = med(r["ttft_ms"]["p99"] for r in runs["direct"])
    for n in names(runs):
        p50 = med(r["ttft_ms"]["median"] for r in runs[n]); p99 = med(r["ttft_ms"]["p99"] for r in runs[n])
        fails = sum(r["failed"] for r in runs[n])
        add = "-" if n == "direct" else f"{p50 - d50:+.3f} ms"
        add99 = "-" if n == "direct" else f"{p99 - d99:+.3f} ms"
        print(f"| {c} | {n} | {p50:.3f} ms | {p99:.3f} ms | {add} | {add99} | {fails} |")
print()
print("| path (zero-latency backend, 64 streams) | requests/s | vs direct | E2E p50 | E2E p99 | failed |")
print("|---|---:|---:|---:|---:|---:|")
runs = load("tput-*.json")
dt = med(r["request_throughput"] for r in runs["direct"])
for n in names(runs):
    t = med(r["request_throughput"] for r in runs[n])
    print(f"| {n} | {t:.0f} | {t / dt:.2f} | {med(r['e2el_ms']['median'] for r in runs[n]):.2f} ms | "
          f"{med(r['e2el_ms']['p99'] for r in runs[n]):.2f} ms | {sum(r['failed'] for r in runs[n])} |")
EOF
say "raw results: $OUT"
