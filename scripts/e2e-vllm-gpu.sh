#!/usr/bin/env bash
# shellcheck disable=SC2015,SC2317
# (SC2015: `check && pass || fail` is meant, pass only prints; SC2317: functions run from
# traps and wait_for look unreachable to shellcheck.)
# Real vLLM end to end on ONE NVIDIA GPU: for each connector, `pdctl up` a 1P1D whose prefill
# and decode share the GPU (instances_per_gpu = 2), prove it serves and hands KV over, that a
# killed engine comes back without leaking GPU memory, that a SIGKILLed supervisor leaves
# nothing behind, and that `down` does not either. Opt-in: not part of `cargo test` or CI.
#
#   scripts/e2e-vllm-gpu.sh --model DIR [--python PATH] [--only CASE] [--gpu N] [--pdctl PATH] [--keep]
#   scripts/e2e-vllm-gpu.sh --measure --model DIR [--python PATH] [--eager] [--pdctl PATH]
#
#   --model DIR    a local model directory (or PDCTL_E2E_MODEL); nothing is fetched at run time
#   --python PATH  the python that has vLLM and the connectors' packages (default: python3)
#   --only CASE    example (ExampleConnector, shared directory), nixl (NixlConnector, decode
#                  pulls), nixl-push (NixlConnector in push mode, vLLM 0.24.0 on) or mooncake
#                  (MooncakeConnector V1 over tcp), several comma-separated; default: every
#                  one the vLLM version has (with --cpu every one but mooncake). Only when
#                  named: rebalance (1P2D of three engines sharing the GPU, `[rebalance]` in
#                  act mode with a TTFT objective no engine meets: under load it moves one
#                  decode to prefill, 1P2D -> 2P1D, the removed engine stopped before the new
#                  one starts on its share; 0 failed requests, the move explained in status,
#                  `pdctl check` passes on the new split, down leaves the GPU empty)
#   --measure      instead of the cases: one engine's start alone (the prefill's own command
#                  line and environment from `pdctl plan`, until /health answers), then
#                  `pdctl up -d` of the NIXL 1P1D sharing the GPU; prints both times and their
#                  ratio, PASS when `up` takes at most 1.2 times one engine's start
#   --gpu N        the GPU to share (default 0)
#   --pdctl PATH   the pdctl binary (default: pdctl on PATH, else this checkout's target/release
#                  or target/debug build)
#   --keep         keep each case's state directory (logs) even when it passed
#   --eager        start vLLM with --enforce-eager (no torch.compile, no CUDA graphs): each
#                  start-up is shorter, for a machine lent by the minute
#   --cpu          rehearse the script on vLLM's CPU build (engine.device = "cpu", no GPU
#                  figures): checks the script itself on a machine without a GPU;
#                  scripts/e2e-vllm-cpu.sh runs it as its case `gpu-script`
#
# Needs: nvidia-smi, vLLM in --python (and nixl / mooncake for those cases), etcd is not
# needed. Each case takes 2-4 minutes (two vLLM start-ups, one restart). Prints a PASS or FAIL
# line per check and a summary table; exits 0 only when every check passed. Everything it
# started is stopped on exit, also on failure or Ctrl-C. Requests straight to an engine carry
# the cluster's engine key (`pdctl secret --engine-key`); requests to the proxy carry
# PDCTL_API_KEY when it is set (`pdctl up`, run with it, makes the proxy require it).
# The GPU is declared to pdctl with the memory nvidia-smi says is free when the script starts
# (`--gpus N:FREEMiB`), so every plan of a case (up, apply, up again) is the same plan.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
MODEL="${PDCTL_E2E_MODEL:-}"
PYTHON=python3
ONLY=""
GPU=0
PDCTL=""
KEEP=0
CPU=0
EAGER=0
MEASURE=0
while (($#)); do
  case "$1" in
    --model) MODEL="${2:?--model needs a directory}"; shift 2 ;;
    --python) PYTHON="${2:?--python needs a path}"; shift 2 ;;
    --only) ONLY="${2:?--only needs a case: example, nixl, nixl-push, mooncake or rebalance}"; shift 2 ;;
    --gpu) GPU="${2:?--gpu needs an index}"; shift 2 ;;
    --pdctl) PDCTL="${2:?--pdctl needs a path}"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --cpu) CPU=1; shift ;;
    --eager) EAGER=1; shift ;;
    --measure) MEASURE=1; shift ;;
    -h|--help) sed -n '5,45p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "e2e-vllm-gpu.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "e2e-vllm-gpu.sh: $*" >&2; exit 2; }
[ -n "$MODEL" ] || die "--model DIR is required (a local model directory; nothing is downloaded)"
[ -f "$MODEL/config.json" ] || die "$MODEL has no config.json: --model must be a local model directory"
MODEL="$(cd "$MODEL" && pwd)"
[ "$CPU" = 1 ] || command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this check needs an NVIDIA GPU and its driver (or --cpu to rehearse)"
PYTHON_PATH="$(command -v "$PYTHON")" || die "--python $PYTHON not found"
"$PYTHON_PATH" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("vllm") else 1)' \
  || die "$PYTHON_PATH cannot import vllm: install vLLM there or pass --python"
if [ -z "$PDCTL" ]; then
  PDCTL="$(command -v pdctl || true)"
  for b in "$REPO/target/release/pdctl" "$REPO/target/debug/pdctl"; do
    [ -n "$PDCTL" ] || { [ -x "$b" ] && PDCTL="$b"; }
  done
fi
[ -x "$PDCTL" ] || die "no pdctl binary: build it (cargo build --release) or pass --pdctl"
# vLLM's version as pdctl reads it: vllm/_version.py, without importing torch.
VLLM_VERSION="$("$PYTHON_PATH" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("vllm")
for d in spec.submodule_search_locations or []:
    f = os.path.join(d, "_version.py")
    if os.path.isfile(f):
        s = importlib.util.spec_from_file_location("_e2e_vllm_version", f)
        m = importlib.util.module_from_spec(s)
        s.loader.exec_module(m)
        print(m.__version__)
        break
else:
    import vllm
    print(vllm.__version__)
PY
)" || die "$PYTHON_PATH could not say its vLLM version"
# NixlConnector's push mode: vLLM 0.24.0 on (pdctl plans it from there).
has_push() {
  local major minor
  IFS=. read -r major minor _ <<<"$VLLM_VERSION"
  (( major > 0 || minor >= 24 ))
}
if [ -z "$ONLY" ]; then
  CASES=(example nixl)
  if has_push; then CASES+=(nixl-push); fi
  # MooncakeConnector's transfer engine has no CPU build.
  if [ "$CPU" = 0 ]; then CASES+=(mooncake); fi
else
  IFS=, read -r -a CASES <<<"$ONLY"
  for c in "${CASES[@]}"; do
    case "$c" in
      example|nixl|mooncake|rebalance) ;;
      nixl-push) has_push || die "nixl-push needs vLLM 0.24.0 or later; $PYTHON_PATH has vLLM $VLLM_VERSION" ;;
      *) die "--only takes example, nixl, nixl-push, mooncake or rebalance (comma-separated), not '$c'" ;;
    esac
  done
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/pdctl-e2e-gpu.XXXXXX")"
MDIR="$WORK/measure"
CURRENT_STATE=""
cleanup() {
  if [ -n "$CURRENT_STATE" ]; then "$PDCTL" down --state-dir "$CURRENT_STATE" -t 10 >/dev/null 2>&1 || true; fi
  # An engine --measure starts by itself leads its own process group (its .pid file).
  for f in "$MDIR"/*.log.pid; do
    if [ -f "$f" ]; then kill -9 -- "-$(cat "$f")" 2>/dev/null || true; fi
  done
  if [ "$KEEP" = 0 ] && [ "${FAILED_ANY:-0}" = 0 ]; then rm -rf "$WORK"; else echo "state and logs kept in $WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

FAILED_ANY=0
declare -A SUMMARY
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; FAILED_ANY=1; CASE_FAILED=1; }

if [ "$CPU" = 1 ]; then
  gpu_mem_mib() { echo 0; }
  gpu_pids() { true; }
  GPUS_ARG="$GPU"
else
  gpu_mem_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$GPU" | tr -d ' '; }
  gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader -i "$GPU" | tr -d ' ' | grep -v '^$' || true; }
  # The GPU with its free memory: pdctl gives each engine sharing it its KV cache size from
  # it (vLLM versions with --kv-cache-memory-bytes), and every plan of a run is the same.
  GPUS_ARG="$GPU:$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i "$GPU" | tr -d ' ')MiB"
fi
# `status --json` of the cluster under $1. Its exit status is kept (1 while a service is not
# healthy, the document still printed). When it prints no document (a loaded machine can
# freeze longer than its 5 s wait for the supervisor), what it said is told here and the
# readers below take the empty document as "no status".
status_json() {
  local rc=0
  "$PDCTL" status --json --state-dir "$1" 2>"$WORK/status.err" || rc=$?
  if [ "$rc" -gt 1 ] || [ -s "$WORK/status.err" ]; then
    echo "  (status --json exited $rc: $(tr '\n' ' ' < "$WORK/status.err" | cut -c1-200))" >&2
  fi
  return "$rc"
}
# Python reading a status --json document on stdin into r; {} when there is none.
READ_STATUS='import json,sys; t=sys.stdin.read(); r=json.loads(t) if t.strip() else {}'
# `field SERVICE KEY` from a status --json document on stdin ("" without one).
field() { "$PYTHON_PATH" -c "$READ_STATUS"'
s=[x for x in r.get("services", []) if x["name"]==sys.argv[1]]; print(s[0].get(sys.argv[2]) if s else "")' "$1" "$2"; }
# Processes of the session the detached supervisor $1 led: everything it started and all
# they forked (the run-id marker in the environment is not enough: vLLM's engine core
# writes its process title over its environment).
# Zombies (state Z) are left out: dead, holding nothing, only not yet reaped by their parent.
cluster_pids() { ps -e -o pid=,sid=,stat= | awk -v s="$1" '$2 == s && $1 != s && $3 !~ /^Z/ { print $1 }'; }
# True once no process of the session $1 is left and none is on the GPU.
cluster_gone() { [ -z "$(cluster_pids "$1")" ] && gpu_idle; }
# True once the proxy at $1 is serving a client request (the load has begun).
proxy_busy() { curl -s "$1/metrics" | awk '$1 == "pdctl_proxy_requests_in_flight" && $2 > 0 { ok = 1 } END { exit !ok }'; }
# True once the GPU's used memory is within 1 GiB of $1 MiB.
gpu_mem_near() { local d=$(( $(gpu_mem_mib) - $1 )); (( ${d#-} < 1024 )); }
# The engine core child of a vLLM API server (vLLM names its process VLLM::EngineCore).
engine_core() {
  local p
  for p in $(pgrep -P "$1"); do
    grep -q 'EngineCor' "/proc/$p/comm" 2>/dev/null && { echo "$p"; return; }
  done
}
# `record STATE_ROOT KEY`: a value of the running supervisor's record (run.json).
record() { "$PYTHON_PATH" -c 'import glob,json,sys; print(json.load(open(glob.glob(sys.argv[1]+"/*/run.json")[0]))[sys.argv[2]])' "$1" "$2"; }
wait_for() { # wait_for SECONDS COMMAND...: true once COMMAND succeeds
  local end=$((SECONDS + $1)); shift
  while ((SECONDS < end)); do "$@" && return 0; sleep 1; done
  return 1
}
decode_healthy_after() { # decode-0 healthy with more than $2 restarts
  local js; js="$(status_json "$1")" || return 1
  [ "$(field decode-0 state <<<"$js")" = healthy ] && [ "$(field decode-0 restarts <<<"$js")" -gt "$2" ]
}
gpu_idle() { [ -z "$(gpu_pids)" ]; }

topology() { # topology CASE PORT_BASE [PREFILL DECODE]: the engines share the GPU
  local case="$1" b="$2" np="${3:-1}" nd="${4:-1}" conn env="$ENV_LINES"
  case "$case" in
    example) conn='kind = "example"' ;;
    nixl|nixl-push)
      conn='kind = "nixl"'
      if [ "$case" = nixl-push ]; then conn+=$'\nnixl_mode = "push"'; fi
      # NIXL between two processes on one GPU: UCX picks the transport (cuda_ipc, shared
      # memory) instead of a network device it may not have.
      env+=$'UCX_TLS = "all"\nUCX_NET_DEVICES = "all"\n' ;;
    mooncake) conn=$'kind = "mooncake"\ntransport = "tcp"\nbootstrap_port = '"$((b + 98))" ;;
    rebalance)
      conn='kind = "nixl"'
      env+=$'UCX_TLS = "all"\nUCX_NET_DEVICES = "all"\n' ;;
  esac
  cat <<EOF
cluster = "e2e-gpu-$case"

[model]
name = "$MODEL"
served_name = "e2e-model"
max_model_len = 2048

[engine]
kind = "vllm"
vllm_version = "auto"
python = "$PYTHON_PATH"
instances_per_gpu = $((np + nd))
startup_timeout_s = 900
$DEVICE_LINES
$(if [ -n "$env" ]; then printf '\n[engine.env]\n%s' "$env"; fi)
[connector]
$conn

[prefill]
instances = $np
base_port = $((b + 100))

[decode]
instances = $nd
base_port = $((b + 200))

[proxy]
port = $b
EOF
}

run_case() {
  local case="$1" base="$2"
  local dir="$WORK/$case" state="$WORK/$case/state"
  mkdir -p "$dir"
  CASE_FAILED=0
  CURRENT_STATE="$state"
  topology "$case" "$base" > "$dir/topology.toml"
  echo; echo "== $case: 1P1D sharing GPU $GPU ($dir/topology.toml)"
  local mem0 t0 up_s
  mem0="$(gpu_mem_mib)"
  t0=$SECONDS
  if "$PDCTL" up -d -f "$dir/topology.toml" --gpus "$GPUS_ARG" --state-dir "$state" > "$dir/up.log" 2>&1; then
    up_s=$((SECONDS - t0)); pass "$case: pdctl up -d healthy in ${up_s} s"
  else
    fail "$case: pdctl up -d failed (last lines below; logs in $state/logs)"; tail -20 "$dir/up.log"
    SUMMARY[$case]="up failed"; return
  fi
  local js proxy prefill decode engine_key
  js="$(status_json "$state")"
  # Engines require the cluster's engine key (vLLM's --api-key): the checks send it on
  # every request straight to an engine, and see one without it refused.
  engine_key="$("$PDCTL" secret --engine-key --state-dir "$state" 2>"$dir/secret.log")"
  [ -n "$engine_key" ] && pass "$case: pdctl secret --engine-key gives the engines' key" \
    || fail "$case: pdctl secret --engine-key gave no key: $(tail -2 "$dir/secret.log")"
  proxy="http://127.0.0.1:$base"
  prefill="$(field prefill-0 url <<<"$js")"; decode="$(field decode-0 url <<<"$js")"
  if [ "$CPU" = 0 ]; then
    [ "$(field prefill-0 gpus <<<"$js")" = "[$GPU]" ] && [ "$(field decode-0 gpus <<<"$js")" = "[$GPU]" ] \
      && pass "$case: status shows both instances on GPU $GPU" || fail "$case: status does not show both on GPU $GPU"
  fi

  local figures
  PDCTL_E2E_ENGINE_KEY="$engine_key" \
    "$PYTHON_PATH" "$HERE/e2e_gpu_checks.py" answers "$proxy" "$prefill" "$decode" e2e-model > "$dir/answers.log" 2>&1
  grep -E '^(PASS|FAIL)' "$dir/answers.log" | sed "s/^\(PASS\|FAIL\) /\1 $case: /"
  grep -q '^FAIL' "$dir/answers.log" && { FAILED_ANY=1; CASE_FAILED=1; }
  figures="$(sed -n 's/^FIGURES //p' "$dir/answers.log")"

  local bench="-"
  if "$PDCTL" bench --url "$proxy" --model e2e-model --num-prompts 64 --max-concurrency 8 \
      --input-len 256 --output-len 32 --json "$dir/bench.json" > "$dir/bench.log" 2>&1; then
    read -r completed failed rps ttft < <("$PYTHON_PATH" "$HERE/e2e_gpu_checks.py" bench-result "$dir/bench.json")
    bench="$rps req/s, TTFT p50 $ttft ms, $failed failed"
    [ "$failed" = 0 ] && [ "$completed" = 64 ] && pass "$case: pdctl bench 64 at concurrency 8: $bench" \
      || fail "$case: pdctl bench: $completed completed, $failed failed"
  else
    fail "$case: pdctl bench failed: $(tail -3 "$dir/bench.log")"
  fi

  # Changes while serving, under streamed and whole-answer load: the proxy's limits changed
  # in place (`apply`: the same proxy process), then the only decode instance drained and
  # restarted (`restart --drain`: new requests wait in the proxy meanwhile). None may fail.
  local live="-" proxy_pid drain_s="-"
  "$PDCTL" bench --url "$proxy" --model e2e-model --num-prompts 40 --max-concurrency 4 \
    --input-len 64 --output-len 64 --json "$dir/live-stream.json" > "$dir/live-stream.log" 2>&1 &
  local stream_pid=$!
  "$PDCTL" bench --url "$proxy" --model e2e-model --num-prompts 40 --max-concurrency 4 --no-stream \
    --input-len 64 --output-len 64 --json "$dir/live-whole.json" > "$dir/live-whole.log" 2>&1 &
  local whole_pid=$!
  wait_for 120 proxy_busy "$proxy" || fail "$case: the load of pdctl bench never reached the proxy within 120 s"
  proxy_pid="$(field proxy pid <<<"$(status_json "$state")")"
  printf 'max_concurrent = 6\nqueue_size = 64\nrestart_wait_s = 600\n' >> "$dir/topology.toml"
  "$PDCTL" apply -f "$dir/topology.toml" --gpus "$GPUS_ARG" --state-dir "$state" > "$dir/apply.log" 2>&1
  grep -q 'in effect, without a restart' "$dir/apply.log" \
    && [ "$(field proxy pid <<<"$(status_json "$state")")" = "$proxy_pid" ] \
    && pass "$case: apply changed the proxy's limits in place (same pid $proxy_pid)" \
    || fail "$case: apply of the proxy's limits: $(tail -3 "$dir/apply.log")"
  t0=$SECONDS
  if "$PDCTL" restart --drain decode-0 --state-dir "$state" > "$dir/drain.log" 2>&1; then
    drain_s=$((SECONDS - t0)); pass "$case: restart --drain decode-0 while serving: healthy again in ${drain_s} s"
  else
    fail "$case: restart --drain decode-0: $(tail -3 "$dir/drain.log")"
  fi
  wait "$stream_pid" "$whole_pid"
  local s_done s_failed w_done w_failed
  read -r s_done s_failed _ _ < <("$PYTHON_PATH" "$HERE/e2e_gpu_checks.py" bench-result "$dir/live-stream.json" 2>/dev/null || echo "0 ? - -")
  read -r w_done w_failed _ _ < <("$PYTHON_PATH" "$HERE/e2e_gpu_checks.py" bench-result "$dir/live-whole.json" 2>/dev/null || echo "0 ? - -")
  live="drain ${drain_s}s, ${s_done}+${w_done}/80 ok"
  [ "$s_done" = 40 ] && [ "$s_failed" = 0 ] && [ "$w_done" = 40 ] && [ "$w_failed" = 0 ] \
    && pass "$case: under those changes 40 streamed and 40 whole answers, 0 failed" \
    || fail "$case: under those changes: streamed $s_done ok / $s_failed failed, whole $w_done ok / $w_failed failed"

  # kill -9 of decode's engine core (the API server's child): restarted, memory as before.
  local mem_before api core restarts restart_s="-" leak="-"
  mem_before="$(gpu_mem_mib)"
  api="$(field decode-0 pid <<<"$(status_json "$state")")"
  restarts="$(field decode-0 restarts <<<"$(status_json "$state")")"
  core="$(engine_core "$api")"
  if [ -n "$core" ]; then
    t0=$SECONDS
    kill -9 "$core"
    if wait_for 600 decode_healthy_after "$state" "$restarts"; then
      restart_s=$((SECONDS - t0))
      # The new engine's memory settles: wait (bounded) for it to come back near before.
      wait_for 60 gpu_mem_near "$mem_before" || true
      leak=$(( $(gpu_mem_mib) - mem_before ))
      pass "$case: decode's engine core killed (pid $core): healthy again in ${restart_s} s"
      (( ${leak#-} < 1024 )) && pass "$case: GPU memory after the restart within 1 GiB of before (${leak} MiB)" \
        || fail "$case: GPU memory after the restart differs by ${leak} MiB"
    else
      fail "$case: decode not healthy again within 600 s after its engine core was killed"
    fi
  else
    fail "$case: decode's API server (pid $api) has no VLLM::EngineCore child to kill"
  fi

  # SIGKILL of the supervisor: nothing of the cluster may outlive it.
  local sup left gpu_left
  local gone_s="-"
  sup="$(record "$state" supervisor_pid)"
  t0=$SECONDS
  kill -9 "$sup"
  # Waited for, bounded: the watchdog stops everything within ~2 s; a busy machine is slower.
  wait_for 30 cluster_gone "$sup" && gone_s=$((SECONDS - t0))
  left="$(cluster_pids "$sup" | wc -l)"
  gpu_left="$(gpu_pids | wc -l)"
  [ "$left" = 0 ] && [ "$gpu_left" = 0 ] \
    && pass "$case: supervisor SIGKILLed: no process of the cluster and none on the GPU ${gone_s} s later" \
    || fail "$case: supervisor SIGKILLed: $left process(es) of the cluster and $gpu_left on the GPU left 30 s later"
  "$PDCTL" down --state-dir "$state" >/dev/null 2>&1 || true

  # Up again, then down: nothing left, GPU memory back to where it started.
  if "$PDCTL" up -d -f "$dir/topology.toml" --gpus "$GPUS_ARG" --state-dir "$state" > "$dir/up2.log" 2>&1; then
    sup="$(record "$state" supervisor_pid)"
    t0=$SECONDS
    "$PDCTL" down --state-dir "$state" > "$dir/down.log" 2>&1
    local down_s=$((SECONDS - t0))
    wait_for 30 cluster_gone "$sup" || true
    left="$(cluster_pids "$sup" | wc -l)"; gpu_left="$(gpu_pids | wc -l)"
    local mem_end; mem_end="$(gpu_mem_mib)"
    [ "$left" = 0 ] && [ "$gpu_left" = 0 ] && (( mem_end - mem0 < 512 )) \
      && pass "$case: down in ${down_s} s: no process, nothing on the GPU (${mem_end} MiB used, ${mem0} before)" \
      || fail "$case: after down: $left process(es), $gpu_left on the GPU, ${mem_end} MiB used (${mem0} before)"
  else
    fail "$case: the second pdctl up failed: $(tail -3 "$dir/up2.log")"
  fi
  CURRENT_STATE=""
  SUMMARY[$case]="up ${up_s}s | ${figures:-no figures} | bench $bench | live $live | restart ${restart_s}s, leak ${leak} MiB | $([ "$CASE_FAILED" = 0 ] && echo ok || echo FAILED)"
}

# `rebalance_field STATE KEY`: the rebalancer's KEY in status --json (moves_total, verdict,
# or last_move: the last move as "FROM TO OUTCOME").
rebalance_field() {
  status_json "$1" | "$PYTHON_PATH" -c "$READ_STATUS"'
r = (r.get("rebalance") or {})
k = sys.argv[1]
if k == "last_move":
    m = (r.get("moves") or [{}])[-1]
    s = lambda x: "%dP%dD" % (x["prefill"], x["decode"]) if x else "-"
    took = (m.get("ended_ms") or 0) - (m.get("at_ms") or 0)
    print(round(took / 1000, 1), s(m.get("from")), s(m.get("to")), (m.get("outcome") or "-").split(":")[0])
else:
    print(r.get(k, ""))' "$2"
}
moved_once() { [ "$(rebalance_field "$1" moves_total)" -ge 1 ] 2>/dev/null; }

# The rebalancer on real engines: a 1P2D of three engines sharing the GPU under steady
# load; its TTFT objective (1 ms) is missed whatever runs and the budget is the three
# instances, so it moves one decode to prefill (the highest-numbered decode drained and
# stopped, then the new prefill started on its share of the GPU) and then holds at
# min_decode = 1.
run_rebalance() {
  local base="$1" case=rebalance
  local dir="$WORK/$case" state="$WORK/$case/state"
  mkdir -p "$dir"
  CASE_FAILED=0
  CURRENT_STATE="$state"
  { topology rebalance "$base" 1 2
    printf '\n[rebalance]\nttft_p90_ms = 1\nitl_p90_ms = 600000\nbudget = 3\nwindow_s = 10\ncooldown_s = 600\nmode = "act"\n'
  } > "$dir/topology.toml"
  echo; echo "== $case: 1P2D sharing GPU $GPU, [rebalance] act ($dir/topology.toml)"
  local t0 up_s move_s="-"
  t0=$SECONDS
  if "$PDCTL" up -d -f "$dir/topology.toml" --gpus "$GPUS_ARG" --state-dir "$state" > "$dir/up.log" 2>&1; then
    up_s=$((SECONDS - t0)); pass "$case: pdctl up -d of 1P2D healthy in ${up_s} s"
  else
    fail "$case: pdctl up -d failed (last lines below; logs in $state/logs)"; tail -20 "$dir/up.log"
    SUMMARY[$case]="up failed"; return
  fi
  # Steady load: runs of 16 requests back to back until the move is over (at most 15 min).
  rm -f "$dir/load.stop"
  ( i=0; while [ ! -e "$dir/load.stop" ] && ((i < 400)); do
      "$PDCTL" bench --url "http://127.0.0.1:$base" --model e2e-model --num-prompts 16 --max-concurrency 4 \
        --input-len 256 --output-len 32 --seed "$i" --json "$dir/load-$i.json" > "$dir/load-$i.log" 2>&1
      i=$((i + 1)); done ) &
  local load_pid=$!
  t0=$SECONDS
  if wait_for 900 moved_once "$state"; then
    move_s=$((SECONDS - t0))
    local took from to outcome
    read -r took from to outcome < <(rebalance_field "$state" last_move)
    [ "$from $to $outcome" = "1P2D 2P1D done (0)" ] \
      && pass "$case: under load the rebalancer moved $from -> $to (done ${move_s} s after the load began; the change took ${took} s)" \
      || fail "$case: the move was $from -> $to, $outcome"
  else
    fail "$case: no move within 900 s; verdict: $(rebalance_field "$state" verdict)"
  fi
  # The move done, TTFT still missed: min_decode = 1 holds it (said in status).
  wait_for 60 bash -c '"$0" status --json --state-dir "$1" | grep -q "decode has no instance to give"' "$PDCTL" "$state" \
    && pass "$case: then held at min_decode = 1: $(rebalance_field "$state" verdict | cut -c1-100)..." \
    || fail "$case: after the move: $(rebalance_field "$state" verdict)"
  touch "$dir/load.stop"; wait "$load_pid"
  local done_n=0 failed_n=0 c f
  for j in "$dir"/load-*.json; do
    [ -f "$j" ] || continue
    read -r c f _ _ < <("$PYTHON_PATH" "$HERE/e2e_gpu_checks.py" bench-result "$j")
    done_n=$((done_n + c)); failed_n=$((failed_n + f))
  done
  [ "$failed_n" = 0 ] && [ "$done_n" -gt 0 ] \
    && pass "$case: the load through the move: $done_n requests, 0 failed" \
    || fail "$case: the load through the move: $done_n completed, $failed_n failed"
  local js; js="$(status_json "$state")"
  local roles; roles="$("$PYTHON_PATH" -c "$READ_STATUS"'
print(" ".join(sorted(s["name"]+":"+s["state"] for s in r.get("services", []) if s["role"] in ("prefill","decode"))) or "no status")' <<<"$js")"
  [ "$roles" = "decode-0:healthy prefill-0:healthy prefill-1:healthy" ] \
    && pass "$case: status: $roles" || fail "$case: status after the move: $roles"
  "$PDCTL" check --state-dir "$state" > "$dir/check.log" 2>&1 \
    && pass "$case: pdctl check on the new split: $(grep -c ' -> decode-[0-9].*moved' "$dir/check.log") pair(s) hand KV over" \
    || fail "$case: pdctl check after the move: $(tail -3 "$dir/check.log")"
  curl -s "http://127.0.0.1:$base/metrics" | grep -q '^pdctl_proxy_rebalance_moves_total{toward="prefill"} 1$' \
    && pass "$case: the proxy's /metrics counts the move" || fail "$case: the proxy's /metrics does not count the move"
  local sup left gpu_left
  sup="$(record "$state" supervisor_pid)"
  "$PDCTL" down --state-dir "$state" > "$dir/down.log" 2>&1
  wait_for 30 cluster_gone "$sup" || true
  left="$(cluster_pids "$sup" | wc -l)"; gpu_left="$(gpu_pids | wc -l)"
  [ "$left" = 0 ] && [ "$gpu_left" = 0 ] && pass "$case: down: no process, nothing on the GPU" \
    || fail "$case: after down: $left process(es), $gpu_left on the GPU"
  CURRENT_STATE=""
  SUMMARY[$case]="up ${up_s}s | moved 1P2D -> 2P1D ${move_s}s after the load began (change ${took:-?}s) | load $done_n ok, $failed_n failed | $([ "$CASE_FAILED" = 0 ] && echo ok || echo FAILED)"
}

# One engine's start alone against `pdctl up -d` of the 1P1D sharing the GPU, on the same
# machine one after the other: the prefill's own command line and environment from the
# plan, timed until its /health answers, then stopped; then the whole cluster; then, when
# MEASURE_BUDGET_S (default 290) leaves time, the engine alone once more, now as warm as
# `up` found the machine: the baseline of the ratio (else the first start is).
start_alone() { # start_alone NAME: seconds until healthy, or "none"
  "$PYTHON_PATH" "$HERE/e2e_gpu_checks.py" start-alone "$MDIR/plan.json" prefill-0 "$ALONE_TIMEOUT_S" "$MDIR/$1.log"
}
measure() {
  local base=18000 state="$MDIR/state"
  mkdir -p "$MDIR"
  CASE_FAILED=0
  topology nixl "$base" > "$MDIR/topology.toml"
  echo; echo "== measure: one engine's start alone, then pdctl up -d of the NIXL 1P1D sharing GPU $GPU"
  if ! "$PDCTL" plan -f "$MDIR/topology.toml" --gpus "$GPUS_ARG" --state-dir "$state" > "$MDIR/plan.txt" 2>&1 \
      || ! "$PDCTL" plan --json -f "$MDIR/topology.toml" --gpus "$GPUS_ARG" --state-dir "$state" > "$MDIR/plan.json" 2>"$MDIR/plan.err"; then
    fail "measure: pdctl plan failed: $(tail -5 "$MDIR/plan.txt" "$MDIR/plan.err")"; return
  fi
  # How the plan sizes and starts the engines (the memory lines of `pdctl plan`).
  grep -E '^[0-9]+\. (prefill|decode)-|^   memory ' "$MDIR/plan.txt" | sed 's/^/  /'
  "$PYTHON_PATH" "$HERE/e2e_gpu_checks.py" plan-starts "$MDIR/plan.json" | sed 's/^/  /'

  local alone
  alone="$(start_alone alone)"
  if [ -z "$alone" ] || [ "$alone" = none ]; then
    fail "measure: the prefill engine alone did not become healthy (its log: $MDIR/alone.log)"; tail -20 "$MDIR/alone.log"; return
  fi
  pass "measure: one engine alone (prefill-0's command line): healthy in ${alone} s"
  wait_for 60 gpu_idle || fail "measure: the engine started alone left a process on the GPU: $(gpu_pids | tr '\n' ' ')"

  CURRENT_STATE="$state"
  local t0 up
  t0="$(date +%s.%N)"
  if "$PDCTL" up -d -f "$MDIR/topology.toml" --gpus "$GPUS_ARG" --state-dir "$state" > "$MDIR/up.log" 2>&1; then
    up="$("$PYTHON_PATH" -c 'import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))' "$t0" "$(date +%s.%N)")"
    pass "measure: pdctl up -d of the 1P1D sharing GPU $GPU: healthy in ${up} s"
  else
    fail "measure: pdctl up -d failed (logs in $state)"; tail -20 "$MDIR/up.log"; return
  fi
  "$PDCTL" down --state-dir "$state" > "$MDIR/down.log" 2>&1
  CURRENT_STATE=""
  echo "MEASURE one engine alone ${alone} s | pdctl up -d 1P1D ${up} s"

  local warm="" baseline="$alone"
  if (( SECONDS + ${alone%.*} * 13 / 10 + 20 < ${MEASURE_BUDGET_S:-290} )) && wait_for 60 gpu_idle; then
    warm="$(start_alone alone-warm)"
    if [ -n "$warm" ] && [ "$warm" != none ]; then
      pass "measure: one engine alone again, after up: healthy in ${warm} s"
      baseline="$warm"
    else
      fail "measure: the second start alone did not become healthy ($MDIR/alone-warm.log)"
    fi
  else
    echo "  (no time left within MEASURE_BUDGET_S=${MEASURE_BUDGET_S:-290} for a second start alone: the first is the baseline)"
  fi
  local ratio
  ratio="$("$PYTHON_PATH" -c 'import sys; print(round(float(sys.argv[1]) / float(sys.argv[2]), 2))' "$up" "$baseline")"
  echo "MEASURE one engine alone ${alone} s${warm:+, again ${warm} s} | pdctl up -d 1P1D ${up} s | ratio ${ratio} (target <= 1.2) | vLLM $VLLM_VERSION$([ "$EAGER" = 1 ] && echo ', --enforce-eager')"
  "$PYTHON_PATH" -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= 1.2 else 1)' "$ratio" \
    && pass "measure: up within 1.2x of one engine's start (${ratio}x)" \
    || fail "measure: up took ${ratio}x one engine's start (target 1.2x)"
  SUMMARY[measure]="alone ${alone}s${warm:+/${warm}s} | up ${up}s | ratio ${ratio} | $([ "$CASE_FAILED" = 0 ] && echo ok || echo FAILED)"
}

DEVICE_LINES=""
ENV_LINES=""
if [ "$CPU" = 1 ]; then
  # The CPU build: float32, eager, a small KV cache, threads not pinned to the same cores.
  DEVICE_LINES=$'device = "cpu"\nargs = ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8"]'
  ENV_LINES=$'VLLM_CPU_KVCACHE_SPACE = "1"\nVLLM_CPU_OMP_THREADS_BIND = "nobind"\nHF_HUB_OFFLINE = "1"\nVLLM_HOST_IP = "127.0.0.1"\n'
  echo "pdctl $("$PDCTL" --version | awk '{print $2}'), vLLM $VLLM_VERSION via $PYTHON_PATH, model $MODEL, rehearsal on the CPU build; $([ "$MEASURE" = 1 ] && echo "--measure" || echo "cases: ${CASES[*]}")"
else
  # bf16 whatever the model's files hold (the tiny test model is float32), as most served
  # models are: FlashAttention takes nothing else.
  DEVICE_LINES='args = ["--dtype", "bfloat16"'"$([ "$EAGER" = 1 ] && echo ', "--enforce-eager"')"']'
  echo "pdctl $("$PDCTL" --version | awk '{print $2}'), vLLM $VLLM_VERSION via $PYTHON_PATH, model $MODEL, GPU $GPU: $(nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader -i "$GPU") (planned as --gpus $GPUS_ARG)"
fi
if [ "$MEASURE" = 1 ]; then
  # One engine on a GPU is healthy in 1-2 minutes; the measurement fits a 5-minute call.
  ALONE_TIMEOUT_S=240
  if [ "$CPU" = 1 ]; then
    echo "(--cpu: the engines start on the CPU build; the ratio says nothing of a GPU)"
    ALONE_TIMEOUT_S=900
  fi
  CASES=(measure)
  measure
else
  port=18000
  for c in "${CASES[@]}"; do
    if [ "$c" = rebalance ]; then run_rebalance "$port"; else run_case "$c" "$port"; fi
    port=$((port + 1000))
  done
fi

echo; echo "== summary"
for c in "${CASES[@]}"; do printf '%-9s %s\n' "$c" "${SUMMARY[$c]:-not run}"; done
exit "$FAILED_ANY"
