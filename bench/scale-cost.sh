#!/usr/bin/env bash
# The proxy's CPU per request as the cluster grows: 1P1D, 4P4D, 16P16D and 64P64D proxies
# side by side in one run, in front of the same simulated engines (every latency at zero,
# the NIXL handoff, so what is measured is the proxy's own work), each loaded in turn by an
# outside load generator (`hey`, Debian package `hey`) at one offered rate that every size
# keeps up with. Each proxy routes over its first N prefills and N decodes of one set of
# 64 + 64 sims; its pairs are warmed (N x N) before the load.
#
#   bench/scale-cost.sh                                  # 3 rounds, 640 req/s, 32 connections
#   SCALE_COST_ROUNDS=5 SCALE_COST_RATE=1280 bench/scale-cost.sh
#   SCALE_COST_SIZES="1 16" bench/scale-cost.sh          # only 1P1D and 16P16D
#   SCALE_COST_PROXY_ARGS="--health-interval-ms 5000" bench/scale-cost.sh
#   PDCTL=/path/to/pdctl bench/scale-cost.sh             # a build that is already there
#   SCALE_COST_BASELINE=/path/to/old/pdctl bench/scale-cost.sh
#       adds that build's proxies (sizes SCALE_COST_BASELINE_SIZES, "1 16" unless said)
#       in front of the same sims, taking turns with the others, so a change is judged
#       against its predecessor in one run
#   SCALE_COST_SIMS=per-engine bench/scale-cost.sh      # a sim process per engine (128 at
#       64P64D) instead of all prefills in one process and all decodes in another
#       (`pdctl sim --instances`): on a small machine 128 processes spend it waking each
#       other, a cost that grows with the size whatever the proxy does
#   SCALE_COST_FLOOR=0 bench/scale-cost.sh              # without the floor's rows
#       (by default the floor, bench/floor, runs at the smallest and the largest size,
#       taking its engines in turn: what spreading the legs over more engines costs on
#       this machine, apart from what pdctl's routing costs)
#
# CPU is the proxy process's user + system time over its load window (/proc), divided by
# the requests answered 200: the health probes it sends meanwhile (one per instance per
# --health-interval-ms, 1 s by default) are in it. Before the load, all proxies idle
# together for SCALE_COST_IDLE_S seconds and each one's CPU over that time is the idle
# column (per 20 s). Output: a markdown table, medians over rounds, the order of the
# proxies rotated each round, and each size's CPU per request against 1P1D's, in all and
# in user space alone: the kernel's part grows with the size on its own, since a leg sent
# to one of 64 engines that each get a 64th of the load wakes a process that was asleep,
# and the sender pays the wake-up (docs/proxy.md, "CPU as the cluster grows").
set -euo pipefail
cd "$(dirname "$0")/.."

SIZES=${SCALE_COST_SIZES:-"1 4 16 64"}
ROUNDS=${SCALE_COST_ROUNDS:-3}
RATE=${SCALE_COST_RATE:-640}
CONNS=${SCALE_COST_CONNS:-32}
SECS=${SCALE_COST_SECONDS:-15}
IDLE_S=${SCALE_COST_IDLE_S:-20}
SIMS=${SCALE_COST_SIMS:-two-processes}
EXTRA=${SCALE_COST_PROXY_ARGS:-}
OUT=$(mktemp -d -t pdctl-scale-cost.XXXXXX)
command -v hey >/dev/null || { echo "hey is not installed (apt-get install hey)" >&2; exit 2; }
NO_ROUTER=1 VENV=/nonexistent
. bench/common.sh

MAX=$(printf '%s\n' $SIZES | sort -n | tail -1)
read -r PBASE DBASE <<<"$(python3 bench/free_ports.py "$MAX" "$MAX")"
z=(--prefill-ms-per-token 0 --overhead-ms 0 --batch-slowdown 0 --log-stats-interval-ms 0 --itl-ms 0)
if [ "$SIMS" = per-engine ]; then
  say "starting $MAX prefill and $MAX decode sims, a process each"
  for i in $(seq 0 $((MAX - 1))); do
    RUST_LOG=warn "$PDCTL" sim --port $((PBASE + i)) --role prefill --handoff nixl "${z[@]}" 2>>"$OUT/sims.log" & PIDS+=($!)
    RUST_LOG=warn "$PDCTL" sim --port $((DBASE + i)) --role decode --handoff nixl "${z[@]}" 2>>"$OUT/sims.log" & PIDS+=($!)
  done
else
  say "starting $MAX prefill and $MAX decode sims in two processes (sim --instances)"
  RUST_LOG=warn "$PDCTL" sim --port "$PBASE" --instances "$MAX" --role prefill --handoff nixl "${z[@]}" 2>>"$OUT/sims.log" & PIDS+=($!)
  RUST_LOG=warn "$PDCTL" sim --port "$DBASE" --instances "$MAX" --role decode --handoff nixl "${z[@]}" 2>>"$OUT/sims.log" & PIDS+=($!)
fi
for i in $(seq 0 $((MAX - 1))); do
  wait_http "http://127.0.0.1:$((PBASE + i))/health"; wait_http "http://127.0.0.1:$((DBASE + i))/health"
done

TARGETS=()   # "label url pid", label as NPND (or baseline-NPND)
start_proxy() { # BINARY LABEL N
  local args=() i port
  for i in $(seq 0 $(($3 - 1))); do args+=(--prefill "127.0.0.1:$((PBASE + i))" --decode "127.0.0.1:$((DBASE + i))"); done
  port=$(free_port)
  # shellcheck disable=SC2086 # EXTRA is flags, split on purpose
  "$1" proxy --host 127.0.0.1 --port "$port" --protocol nixl "${args[@]}" $EXTRA 2>"$OUT/proxy-$2.log" & PIDS+=($!)
  TARGETS+=("$2 http://127.0.0.1:$port $!")
}
for n in $SIZES; do start_proxy "$PDCTL" "${n}P${n}D" "$n"; done
if [ "${SCALE_COST_FLOOR:-1}" = 1 ]; then
  floor_build
  for n in $(printf '%s\n' $SIZES | sort -n | sed -n '1p;$p' | uniq); do
    port=$(free_port); ps=() ds=()
    for i in $(seq 0 $((n - 1))); do ps+=("http://127.0.0.1:$((PBASE + i))"); ds+=("http://127.0.0.1:$((DBASE + i))"); done
    "$FLOOR" "$port" "$(IFS=,; echo "${ps[*]}")" "$(IFS=,; echo "${ds[*]}")" 2>"$OUT/floor-${n}.log" & PIDS+=($!)
    TARGETS+=("floor-${n}P${n}D http://127.0.0.1:$port $!")
  done
fi
if [ -n "${SCALE_COST_BASELINE:-}" ]; then
  for n in ${SCALE_COST_BASELINE_SIZES:-1 16}; do start_proxy "$SCALE_COST_BASELINE" "baseline-${n}P${n}D" "$n"; done
fi
for t in "${TARGETS[@]}"; do
  read -r label url _ <<<"$t"
  started=$(date +%s.%N)
  wait_http "$url/health"
  # (the floor answers any GET: it warms nothing)
  for _ in $(seq 1 1200); do curl -fsS "$url/health?warmed" >/dev/null 2>&1 && break; sleep 0.1; done
  curl -fsS "$url/health?warmed" >/dev/null || { say "$label: pairs not warmed; see $OUT/proxy-$label.log"; exit 1; }
  say "$label: pairs warmed ($(python3 -c "import time; print(f'{time.time() - $started:.1f}')") s after its health)"
done

say "all idle for $IDLE_S s"
declare -A IDLE0
for t in "${TARGETS[@]}"; do read -r label _ pid <<<"$t"; IDLE0[$label]=$(tree_ticks "$pid"); done
sleep "$IDLE_S"
: >"$OUT/idle.tsv"
for t in "${TARGETS[@]}"; do
  read -r label _ pid <<<"$t"
  printf '%s\t%s\n' "$label" "$(($(tree_ticks "$pid") - IDLE0[$label]))" >>"$OUT/idle.tsv"
done

Q=$(python3 -c "print($RATE / $CONNS)")
printf '{"model":"sim-model","prompt":"the quick brown fox jumps over the lazy dog again","max_tokens":16}' >"$OUT/body.json"
say "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc); $RATE req/s offered over $CONNS connections, $SECS s per proxy and round"
: >"$OUT/results.tsv"
for r in $(seq 1 "$ROUNDS"); do
  k=${#TARGETS[@]}
  for i in $(seq 0 $((k - 1))); do
    read -r n url pid <<<"${TARGETS[$(((i + r) % k))]}"   # n: the label
    hey -n 500 -c "$CONNS" -m POST -T application/json -D "$OUT/body.json" "$url/v1/completions" >/dev/null
    t0=$(tree_ticks "$pid"); u0=$(tree_ticks "$pid" '$14')
    hey -z "${SECS}s" -c "$CONNS" -q "$Q" -m POST -T application/json -D "$OUT/body.json" "$url/v1/completions" >"$OUT/$n-r$r.txt"
    t1=$(tree_ticks "$pid"); u1=$(tree_ticks "$pid" '$14')
    rps=$(awk '/Requests\/sec:/{print $2}' "$OUT/$n-r$r.txt")
    ok=$(awk '$1 == "[200]" && $3 == "responses" {print $2}' "$OUT/$n-r$r.txt"); ok=${ok:-0}
    all=$(awk '/responses$/ && $1 ~ /^\[/ {s += $2} END {print s + 0}' "$OUT/$n-r$r.txt")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$n" "$r" "$rps" "$((t1 - t0))" "$ok" "$all" "$((u1 - u0))" >>"$OUT/results.tsv"
    say "round $r $n: $rps req/s, $ok ok of $all, $((t1 - t0)) ticks"
  done
done
say "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT/results.tsv" "$OUT/idle.tsv" "$(getconf CLK_TCK)" "$RATE" "$IDLE_S" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
idle = dict(l.rstrip("\n").split("\t") for l in open(sys.argv[2]))
tck, rate, idle_s = int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
med = statistics.median
by = {}
for n, _, rps, ticks, ok, sent, user in rows:
    per = lambda t: int(t) * 1e6 / tck / max(int(ok), 1)
    by.setdefault(n, []).append((float(rps), per(ticks), int(sent) - int(ok), per(user)))
def size(label):
    return int(label.split("-")[-1].split("P")[0])
def build(label):
    return label.rsplit("-", 1)[0] if "-" in label else ""
def first(b, column):
    labels = sorted((l for l in by if build(l) == b), key=size)
    return med(x[column] for x in by[labels[0]])
builds = {build(l) for l in by}
base = {b: first(b, 1) for b in builds}
ubase = {b: first(b, 3) for b in builds}
print("| proxy | offered | answered req/s | CPU per request | vs the smallest of its build | of it user space | user vs the smallest | failed | idle CPU-s per 20 s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for label, runs in sorted(by.items(), key=lambda kv: (build(kv[0]), size(kv[0]))):
    cpu = med(x[1] for x in runs)
    user = med(x[3] for x in runs)
    b = build(label)
    idle_cpu = int(idle[label]) / tck * 20 / idle_s
    print(f"| {label} | {rate} req/s | {med(x[0] for x in runs):.0f} | {cpu:.1f} us | {cpu / base[b]:.2f}x | {user:.1f} us | {user / ubase[b]:.2f}x | {sum(x[2] for x in runs)} | {idle_cpu:.2f} |")
PY
say "raw results: $OUT"
