#!/usr/bin/env bash
# Sets up .venv and runs the test suite (CPU: portable backend; GPU tests run where CUDA is present).
#   bash scripts/test.sh            the whole suite (what CI runs)
#   bash scripts/test.sh --quick    a first check in a few minutes on two cores: QUICK below
# Other arguments go to pytest (after --quick too: e.g. --quick -x).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# deep_ep's surface and moe_ep's API, every call against the portable reference on CPU ranks, bad input
# and missing peers, stats, megatron's dispatcher, the set-up script.
QUICK=(tests/test_v1_surface.py tests/test_api.py tests/test_layouts.py tests/test_normal.py tests/test_low_latency.py
       tests/test_handles.py tests/test_errors.py tests/test_diagnostics.py tests/test_megatron.py
       tests/test_setup_env.py)
if [[ ${1:-} == --quick ]]; then
  shift
  set -- "${QUICK[@]}" "$@"
fi
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python -m pytest -q "$@"
