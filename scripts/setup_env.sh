#!/usr/bin/env bash
# Creates .venv (once) with torch and moe_ep installed in editable mode; source it from other scripts.
# Where torch already imports with CUDA (a GPU machine), the system Python is used as it is.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${MOE_EP_TORCH_VERSION:-2.13.0}
if [[ ! -x "$ROOT/.venv/bin/python" ]]; then
  "$PYTHON" -m venv "$ROOT/.venv"
fi
# shellcheck disable=SC1091
source "$ROOT/.venv/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==$TORCH_VERSION"
python -m pip install -q pytest numpy rich pyyaml tqdm matplotlib
# megatron-core for the dispatcher integration tests: 0.16.x on Python 3.11, newer on Python >= 3.12.
python -m pip install -q "megatron-core>=0.16,<0.20"
# --no-build-isolation: setup.py decides from the installed torch whether to build the CUDA extension.
python -m pip install -q --no-build-isolation -e "$ROOT"
