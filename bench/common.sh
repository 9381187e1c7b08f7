# Shared by the side-by-side bench scripts (sourced, not run): background processes
# stopped on exit, small helpers, a release build of pdctl in $PDCTL, and vllm-router from
# PyPI in $ROUTER (empty when pip cannot install it). Set VENV before sourcing; set PDCTL
# to measure a build that is already there.
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

say() { printf '%s\n' "$*" >&2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 300); do curl -fsS "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; say "not answering: $1"; return 1; }

if [ -z "${PDCTL:-}" ]; then   # PDCTL=/path/to/pdctl measures that build instead
  say "building pdctl (release)"
  cargo build --release --quiet
  PDCTL=$PWD/target/release/pdctl
fi

ROUTER=""
if [ -x "$VENV/bin/vllm-router" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q vllm-router; } 2>/dev/null; then
  ROUTER="$VENV/bin/vllm-router"
  say "vllm-router $("$VENV/bin/pip" show vllm-router 2>/dev/null | awk '/^Version/{print $2}') from $VENV"
else
  say "vllm-router could not be installed with pip: measuring without it"
fi
