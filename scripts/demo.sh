#!/usr/bin/env bash
# Sets up .venv and runs the main demo: one MoE step over 4 ranks (CPU by default, CUDA when present).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python examples/demo.py --device auto "$@"
