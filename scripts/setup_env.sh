#!/usr/bin/env bash
# Makes .venv (once) with torch, megatron-core, the test and demo packages and moe_ep in editable mode, and
# leaves it active: demo.sh, test.sh and compile_kernels.sh source this. Where the system's python3 imports
# a CUDA build of torch (a GPU machine), the venv sees the system's packages and uses that torch as it is;
# elsewhere it gets torch==$MOE_EP_TORCH_VERSION (default 2.13.0). Once everything is installed, a stamp
# keyed on what the installs depend on lets later runs skip pip altogether.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${MOE_EP_TORCH_VERSION:-2.13.0}
VENV=$ROOT/.venv
STAMP=$VENV/moe_ep_setup.stamp

# This script, setup.py, the torch asked for and, where the CUDA extension was built, its sources: a change
# to any of them installs again (pip then rebuilds what changed).
setup_key() {
  {
    cat "$ROOT/scripts/setup_env.sh" "$ROOT/setup.py"
    echo "torch==$TORCH_VERSION"
    if compgen -G "$ROOT/moe_ep/_C*.so" >/dev/null; then
      find "$ROOT/csrc" -type f -print0 | LC_ALL=C sort -z | xargs -0 cat
    fi
  } | sha256sum | cut -d' ' -f1
}

if [[ ! -x "$VENV/bin/python" ]]; then
  if "$PYTHON" -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$(setup_key)" ]]; then
  rm -f "$STAMP"
  # A machine without the package index (a GPU machine) keeps the venv's own pip.
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==$TORCH_VERSION"
  python -m pip install -q pytest numpy rich pyyaml tqdm matplotlib setuptools
  # megatron-core for the dispatcher integration tests: 0.16.x on Python 3.11, newer on Python >= 3.12; a
  # wheel carried in .whl/ (the GPU machine's) is found there.
  wheels=()
  [[ -d "$ROOT/.whl" ]] && wheels=(--find-links "$ROOT/.whl")
  python -m pip install -q ${wheels[@]+"${wheels[@]}"} "megatron-core>=0.16,<0.20"
  # --no-build-isolation: setup.py decides from the installed torch whether to build the CUDA extension.
  python -m pip install -q --no-build-isolation -e "$ROOT"
  setup_key > "$STAMP"
fi
