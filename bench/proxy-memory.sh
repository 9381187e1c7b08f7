#!/usr/bin/env bash
# Memory of a running cluster under many concurrent streams: `pdctl up` of a simulated 1P1D
# cluster (as profiles/sim-1p1d.toml: shared-directory handoff, 10 ms per token), then
# STREAMS concurrent streamed completions through its proxy from the official `openai`
# Python async client (not written here, bench/streams.py). Reports, per process (the
# supervisor, the proxy, the prefill and decode sims), resident memory idle before the load,
# at its peak (the kernel's high-water mark, VmHWM) and some seconds after every stream ended,
# and the most requests the proxy had in flight at once (its own gauge, read every 0.2 s).
#
#   bench/proxy-memory.sh                           # 3 rounds of 1000 streams of 100 tokens
#   PROXY_MEM_STREAMS=500 PROXY_MEM_TOKENS=50 PROXY_MEM_ROUNDS=5 bench/proxy-memory.sh
#   PROXY_MEM_BASELINE=/path/to/old/pdctl bench/proxy-memory.sh
#       runs that build's cluster too, taking turns with this one in each round, so a change
#       is judged against its predecessor in one run
#   PROXY_MEM_BUILDS="name=/path/to/pdctl other=/path/to/script"
#       more builds the same way, each under its name
#   PROXY_MEM_PYTHON=/path/to/python                # a python with `openai` installed
#   PROXY_MEM_PDCTL=/path/to/pdctl                  # measure that build instead of building
#
# Output: a markdown table with the median over rounds of each figure (MiB), and the
# streams that completed. The targets (issue 25): the proxy at most 40 MiB at 1000 streams,
# at most 10 MiB idle, back within twice idle after.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${PROXY_MEM_ROUNDS:-3}
STREAMS=${PROXY_MEM_STREAMS:-1000}
TOKENS=${PROXY_MEM_TOKENS:-100}
SETTLE=${PROXY_MEM_SETTLE_S:-10}
PY=${PROXY_MEM_PYTHON:-python3}
OUT=$(mktemp -d -t pdctl-proxy-mem.XXXXXX)
"$PY" -c 'import openai' 2>/dev/null || { echo "$PY has no openai module (pip install openai, or set PROXY_MEM_PYTHON)" >&2; exit 2; }
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

say() { printf '%s\n' "$*" >&2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
if [ -z "${PROXY_MEM_PDCTL:-}" ]; then
  say "building pdctl (release)"
  cargo build --release --quiet
fi
BUILDS=("pdctl ${PROXY_MEM_PDCTL:-$PWD/target/release/pdctl}")
[ -n "${PROXY_MEM_BASELINE:-}" ] && BUILDS+=("pdctl-baseline $PROXY_MEM_BASELINE")
for other in ${PROXY_MEM_BUILDS:-}; do BUILDS+=("${other%%=*} ${other#*=}"); done

STATE=""; BIN=""
cleanup() { [ -n "$STATE" ] && "$BIN" down -t 10 --state-dir "$STATE" >/dev/null 2>&1 || true; }
trap cleanup EXIT INT TERM

# kib PID FIELD: a /proc/PID/status field (VmRSS, VmHWM) in KiB
kib() { awk -v f="$2:" '$1 == f {print $2}' /proc/"$1"/status; }
# pids of the supervisor and of a service, from the state dir's run.json
pid_of() {
  python3 - "$STATE/mem-bench/run.json" "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["supervisor_pid"] if sys.argv[2] == "supervisor" else r["children"][sys.argv[2]]["pid"])
PY
}

say "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc)"
: >"$OUT/results.tsv"
for r in $(seq 1 "$ROUNDS"); do
  n=${#BUILDS[@]}
  for i in $(seq 0 $((n - 1))); do            # rotate the order each round
    read -r name BIN <<<"${BUILDS[$(((i + r) % n))]}"
    STATE="$OUT/state-$name-$r"
    px=$(free_port); pp=$(free_port); dp=$(free_port)
    cat >"$OUT/topology.toml" <<TOML
cluster = "mem-bench"
[model]
name = "sim-model"
[engine]
kind = "sim"
[engine.sim]
prefill_ms_per_token = 0.05
itl_ms = 10.0
[connector]
kind = "example"
[prefill]
instances = 1
base_port = $pp
[decode]
instances = 1
base_port = $dp
[proxy]
port = $px
TOML
    "$BIN" up -d -f "$OUT/topology.toml" --state-dir "$STATE" >"$OUT/up-$name-$r.log" 2>&1 \
      || { say "up failed:"; cat "$OUT/up-$name-$r.log" >&2; exit 1; }
    sleep "$SETTLE"
    declare -A PID=()
    for p in supervisor proxy prefill-0 decode-0; do PID[$p]=$(pid_of "$p"); done
    declare -A IDLE=()
    for p in "${!PID[@]}"; do IDLE[$p]=$(kib "${PID[$p]}" VmRSS); done
    # the most requests in flight at the proxy, from its own gauge, while the load runs
    ( most=0; while :; do
        n=$(curl -fsS "http://127.0.0.1:$px/metrics" 2>/dev/null | awk '$1 == "pdctl_proxy_requests_in_flight" {print $2}')
        [ "${n:-0}" -gt "$most" ] && most=$n && echo "$most" >"$OUT/inflight-$name-$r"
        sleep 0.2
      done ) & SAMPLER=$!
    "$PY" bench/streams.py "http://127.0.0.1:$px" "$STREAMS" "$TOKENS" >"$OUT/load-$name-$r.json"
    kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null || true
    inflight=$(cat "$OUT/inflight-$name-$r" 2>/dev/null || echo 0)
    python3 - "$OUT/load-$name-$r.json" "$inflight" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); r["proxy_in_flight_max"] = int(sys.argv[2])
json.dump(r, open(sys.argv[1], "w"))
PY
    sleep "$SETTLE"
    for p in "${!PID[@]}"; do
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$r" "$p" "${IDLE[$p]}" "$(kib "${PID[$p]}" VmHWM)" \
        "$(kib "${PID[$p]}" VmRSS)" "$(cat "$OUT/load-$name-$r.json")" >>"$OUT/results.tsv"
    done
    say "round $r $name: $(cat "$OUT/load-$name-$r.json"); proxy idle ${IDLE[proxy]} KiB, peak $(kib "${PID[proxy]}" VmHWM) KiB, after $(kib "${PID[proxy]}" VmRSS) KiB"
    "$BIN" down -t 10 --state-dir "$STATE" >/dev/null 2>&1; STATE=""
  done
done
say "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT/results.tsv" "$STREAMS" "$TOKENS" <<'PY'
import json, statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
med = statistics.median
mib = lambda xs: f"{med(int(x) for x in xs) / 1024:.1f}"
print(f"{sys.argv[2]} concurrent streams of {sys.argv[3]} tokens (10 ms per token), official openai async client, medians over rounds (MiB)")
print()
print("| build | process | idle | peak | after the streams | streams complete (per round) | most in flight at the proxy | wall s |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
order = ["proxy", "supervisor", "prefill-0", "decode-0"]
for build in dict.fromkeys(r[0] for r in rows):
    for proc in order:
        sel = [r for r in rows if r[0] == build and r[2] == proc]
        loads = [json.loads(r[6]) for r in sel]
        done = "/".join(str(l["complete"]) for l in loads)
        most = "/".join(str(l["proxy_in_flight_max"]) for l in loads)
        wall = med(l["wall_s"] for l in loads)
        print(f"| {build} | {proc} | {mib(r[3] for r in sel)} | {mib(r[4] for r in sel)} | {mib(r[5] for r in sel)} | {done} | {most} | {wall:.1f} |")
PY
say "raw results: $OUT"
