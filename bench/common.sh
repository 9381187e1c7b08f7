# Shared by the side-by-side bench scripts (sourced, not run): background processes
# stopped on exit, small helpers, a release build of pdctl in $PDCTL, vllm-router from
# PyPI in $ROUTER (empty when pip cannot install it, or when NO_ROUTER=1), and
# `floor_build`, the floor proxy (bench/floor). Set VENV before sourcing; set PDCTL to
# measure a build that is already there.
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

# user+system clock ticks of a process and all its descendants (with a second argument,
# that awk expression of /proc/PID/stat's fields instead: '$14' is user time alone)
tree_ticks() {
  local pids=("$1") all=() p fields=${2:-'$14+$15'}
  while [ ${#pids[@]} -gt 0 ]; do
    p=${pids[0]}; pids=("${pids[@]:1}"); all+=("$p")
    for c in $(cat /proc/"$p"/task/*/children 2>/dev/null); do pids+=("$c"); done
  done
  local t=0
  for p in "${all[@]}"; do
    t=$((t + $(awk "{print $fields}" /proc/"$p"/stat 2>/dev/null || echo 0)))
  done
  echo "$t"
}

# Builds the floor (bench/floor: its own crate, outside pdctl's workspace, so pdctl's
# `cargo test` never builds it) into target/floor and sets $FLOOR to its binary.
floor_build() {
  say "building the floor (bench/floor, release)"
  CARGO_TARGET_DIR=$PWD/target/floor cargo build --release --quiet --locked --manifest-path bench/floor/Cargo.toml
  FLOOR=$PWD/target/floor/release/pdctl-floor
}

ROUTER=""
if [ "${NO_ROUTER:-0}" = 1 ]; then
  :
elif [ -x "$VENV/bin/vllm-router" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q vllm-router; } 2>/dev/null; then
  ROUTER="$VENV/bin/vllm-router"
  say "vllm-router $("$VENV/bin/pip" show vllm-router 2>/dev/null | awk '/^Version/{print $2}') from $VENV"
else
  say "vllm-router could not be installed with pip: measuring without it"
fi
