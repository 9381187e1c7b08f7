#!/usr/bin/env bash
# Zero-latency throughput of one `pdctl sim` process: non-streaming /v1/completions
# answered as fast as the HTTP stack allows, measured by wrk in a separate process.
#
#   bench/sim-throughput.sh [RUNS] [DURATION_S] [CONNECTIONS]
#
# Builds the release binary, starts one sim (every latency at 0), runs wrk RUNS times
# and prints each figure and the median. wrk shares the machine's cores with the sim:
# on a 2-core box the sim gets roughly one core, so the figure is a lower bound.
# Needs wrk (Debian: apt-get install -y wrk).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
DURATION=${2:-10}
CONNS=${3:-64}
THREADS=${WRK_THREADS:-1}
PORT=${SIM_BENCH_PORT:-18931}

command -v wrk >/dev/null || { echo "wrk is not installed (Debian: apt-get install -y wrk)" >&2; exit 2; }
cargo build --release --bin pdctl >&2
BIN=target/release/pdctl

"$BIN" sim --port "$PORT" --prefill-ms-per-token 0 --overhead-ms 0 --itl-ms 0 --batch-slowdown 0 \
  --log-stats-interval-ms 0 2>/tmp/pdctl-sim-bench.log &
SIM=$!
trap 'kill $SIM 2>/dev/null; wait $SIM 2>/dev/null || true' EXIT
up=0
for _ in $(seq 100); do curl -fs "http://127.0.0.1:$PORT/health" >/dev/null && { up=1; break; }; sleep 0.05; done
[ "$up" -eq 1 ] || { echo "the sim did not answer on port $PORT within 5 s; see /tmp/pdctl-sim-bench.log (SIM_BENCH_PORT picks another port)" >&2; exit 1; }

# Sanity: the answer is a real completion.
curl -fs "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"San Francisco is a","max_tokens":16}' | grep -q '"completion_tokens":16' \
  || { echo "the sim's answer is not a 16-token completion; see /tmp/pdctl-sim-bench.log" >&2; exit 1; }

echo "cores: $(nproc); sim pid $SIM; wrk -t$THREADS -c$CONNS -d${DURATION}s, $RUNS runs"
wrk -t"$THREADS" -c"$CONNS" -d2s -s bench/sim-completion.lua "http://127.0.0.1:$PORT/v1/completions" >/dev/null # warm-up
# Besides wrk's rate, each run reports the CPU time the sim process itself spent per
# request (from /proc): unlike the rate, it hardly depends on what else the machine runs.
tick=$(getconf CLK_TCK)
sim_cpu() { awk '{print $14+$15}' "/proc/$SIM/stat"; }
served() { curl -fs "http://127.0.0.1:$PORT/metrics" | awk '/^vllm:request_success_total/ {s+=$2} END {print s}'; }
rates=()
for i in $(seq "$RUNS"); do
  load=$(cut -d' ' -f1 /proc/loadavg)
  c0=$(sim_cpu); n0=$(served)
  out=$(wrk -t"$THREADS" -c"$CONNS" -d"${DURATION}s" --latency -s bench/sim-completion.lua "http://127.0.0.1:$PORT/v1/completions")
  c1=$(sim_cpu); n1=$(served)
  rate=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  p50=$(awk '$1=="50%" {print $2}' <<<"$out")
  errs=$(awk -F': ' '/non-2xx or socket errors/ {print $2}' <<<"$out")
  us=$(awk -v c=$((c1-c0)) -v n=$((n1-n0)) -v t="$tick" 'BEGIN {if (n > 0) printf "%.1f", c/t*1e6/n; else printf "n/a (nothing served)"}')
  echo "run $i: $rate req/s, p50 latency $p50, errors $errs, sim cpu $us us/request, load average before $load"
  rates+=("$rate")
done
median=$(printf '%s\n' "${rates[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo "median: $median req/s"
echo "sim counted $(served) successful requests"
