#!/usr/bin/env bash
# Sets up .venv and runs the test suite (CPU: portable backend; GPU tests run where CUDA is present).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python -m pytest -q "$@"
