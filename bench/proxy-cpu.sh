#!/usr/bin/env bash
# CPU per proxied request and requests per second: the decode engine called directly,
# pdctl's proxy, and vllm-router, side by side in one run, driven by a load generator not
# written here (`hey`, Debian package `hey`). Backends are pdctl's simulated engines with the
# NIXL-style handoff and every latency at zero, so what is measured is the proxies' own work.
#
#   bench/proxy-cpu.sh                      # 3 rounds at 32 and 1 connections
#   PROXY_CPU_ROUNDS=5 PROXY_CPU_REQUESTS=40000 bench/proxy-cpu.sh
#   PROXY_CPU_CONNS="32" bench/proxy-cpu.sh  # only 32 connections
#   PROXY_CPU_BASELINE=/path/to/old/pdctl bench/proxy-cpu.sh
#       adds that build's proxy as "pdctl-baseline", in front of the same engines, taking
#       turns with the others, so a change is judged against its predecessor in one run
#   PROXY_CPU_BUILDS="name=/path/to/pdctl other=/path/to/script" bench/proxy-cpu.sh
#       adds more builds the same way, each under its name (a script must exec pdctl, so
#       that its process is the proxy's)
#
# CPU is the proxy process's user + system time (its whole process tree) over the run,
# divided by the requests answered 200; "direct" has no proxy, so its column is the engine's.
# The proxy runs at its default log level, as `pdctl up` runs it. PROXY_CPU_STREAM=1 asks for
# streamed answers (SSE) instead of one JSON body.
# Output: a markdown table with the median over rounds of each figure, the rate's ratio to
# direct and the CPU's to the floor's.
# vllm-router comes from PyPI into a venv ($PROXY_CPU_VENV); without it, it is left out.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${PROXY_CPU_ROUNDS:-3}
REQS=${PROXY_CPU_REQUESTS:-20000}
CONNS=${PROXY_CPU_CONNS:-"32 1"}
VENV=${PROXY_CPU_VENV:-$HOME/.cache/pdctl/peers-venv}
OUT=$(mktemp -d -t pdctl-proxy-cpu.XXXXXX)
command -v hey >/dev/null || { echo "hey is not installed (apt-get install hey)" >&2; exit 2; }
. bench/common.sh

pp=$(free_port); dp=$(free_port); px=$(free_port)
z=(--prefill-ms-per-token 0 --overhead-ms 0 --batch-slowdown 0 --log-stats-interval-ms 0 --itl-ms 0)
RUST_LOG=warn "$PDCTL" sim --port "$pp" --role prefill --handoff nixl "${z[@]}" 2>"$OUT/prefill.log" & PIDS+=($!)
RUST_LOG=warn "$PDCTL" sim --port "$dp" --role decode --handoff nixl "${z[@]}" 2>"$OUT/decode.log" & PIDS+=($!); DECODE_PID=$!
wait_http "http://127.0.0.1:$pp/health"; wait_http "http://127.0.0.1:$dp/health"
TARGETS=("direct http://127.0.0.1:$dp $DECODE_PID")
"$PDCTL" proxy --host 127.0.0.1 --port "$px" --protocol nixl \
  --prefill "127.0.0.1:$pp" --decode "127.0.0.1:$dp" 2>"$OUT/pdctl-proxy.log" & PIDS+=($!)
TARGETS+=("pdctl-proxy http://127.0.0.1:$px $!")
wait_http "http://127.0.0.1:$px/health"
floor_build
fp=$(free_port)
"$FLOOR" "$fp" "http://127.0.0.1:$pp" "http://127.0.0.1:$dp" 2>"$OUT/floor.log" & PIDS+=($!)
TARGETS+=("floor http://127.0.0.1:$fp $!")
wait_http "http://127.0.0.1:$fp/health"
OTHERS=${PROXY_CPU_BUILDS:-}
[ -n "${PROXY_CPU_BASELINE:-}" ] && OTHERS="pdctl-baseline=$PROXY_CPU_BASELINE $OTHERS"
for other in $OTHERS; do
  bp=$(free_port)
  "${other#*=}" proxy --host 127.0.0.1 --port "$bp" --protocol nixl \
    --prefill "127.0.0.1:$pp" --decode "127.0.0.1:$dp" 2>"$OUT/${other%%=*}.log" & PIDS+=($!)
  TARGETS+=("${other%%=*} http://127.0.0.1:$bp $!")
  wait_http "http://127.0.0.1:$bp/health"
done
if [ -n "$ROUTER" ]; then
  rp=$(free_port); mp=$(free_port)
  "$ROUTER" --host 127.0.0.1 --port "$rp" --prometheus-port "$mp" --vllm-pd-disaggregation --kv-connector nixl \
    --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" --log-level warning \
    --max-concurrent-requests 1024 --queue-size 1024 >"$OUT/vllm-router.log" 2>&1 & PIDS+=($!)
  TARGETS+=("vllm-router http://127.0.0.1:$rp $!")
  wait_http "http://127.0.0.1:$rp/health"
fi

STREAM=false; [ "${PROXY_CPU_STREAM:-0}" = 1 ] && STREAM=true
printf '{"model":"sim-model","prompt":"the quick brown fox jumps over the lazy dog again","max_tokens":16,"stream":%s}' "$STREAM" >"$OUT/body.json"
say "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc)"
: >"$OUT/results.tsv"
for c in $CONNS; do
  for r in $(seq 1 "$ROUNDS"); do
    n=${#TARGETS[@]}
    for i in $(seq 0 $((n - 1))); do            # rotate the order each round
      read -r name url pid <<<"${TARGETS[$(((i + r) % n))]}"
      hey -n 500 -c "$c" -m POST -T application/json -D "$OUT/body.json" "$url/v1/completions" >/dev/null
      t0=$(tree_ticks "$pid")
      hey -n "$REQS" -c "$c" -m POST -T application/json -D "$OUT/body.json" "$url/v1/completions" >"$OUT/$name-c$c-r$r.txt"
      t1=$(tree_ticks "$pid")
      rps=$(awk '/Requests\/sec:/{print $2}' "$OUT/$name-c$c-r$r.txt")
      ok=$(awk '$1 == "[200]" && $3 == "responses" {print $2}' "$OUT/$name-c$c-r$r.txt"); ok=${ok:-0}
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$c" "$name" "$r" "$rps" "$((t1 - t0))" "$ok" "$((REQS / c * c))" >>"$OUT/results.tsv"
      say "c=$c round $r $name: $rps req/s, $ok ok, $((t1 - t0)) ticks"
    done
  done
done
say "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT/results.tsv" "$(getconf CLK_TCK)" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
tck = int(sys.argv[2])
med = statistics.median
print("| connections | path | requests/s | vs direct | CPU per request | CPU vs floor | failed |")
print("|---:|---|---:|---:|---:|---:|---:|")
for c in dict.fromkeys(r[0] for r in rows):
    by = {}
    for cc, name, _, rps, ticks, ok, sent in rows:
        if cc == c:
            by.setdefault(name, []).append((float(rps), int(ticks) * 1e6 / tck / max(int(ok), 1), int(sent) - int(ok)))
    d = med(x[0] for x in by["direct"])
    floor = med(x[1] for x in by["floor"])
    for name, runs in sorted(by.items(), key=lambda kv: kv[0] != "direct"):
        rps = med(x[0] for x in runs)
        cpu = med(x[1] for x in runs)
        label = "engine" if name == "direct" else "proxy"
        vs = "-" if name == "direct" else f"{cpu / floor:.2f}x"
        print(f"| {c} | {name} | {rps:.0f} | {rps / d:.2f} | {cpu:.0f} us ({label}) | {vs} | {sum(x[2] for x in runs)} |")
EOF
say "raw results: $OUT"
