#!/usr/bin/env bash
# Sets up .venv and runs the main demo: a tiny GPT-MoE trained with megatron-core over 4 ranks, once with
# megatron's alltoall dispatcher and once with moe_ep's; prints step time, tokens/s and losses side by
# side and writes out/compare_dispatchers.png. CPU by default; CUDA when a GPU is present.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python examples/compare_dispatchers.py --config configs/tiny_cpu.yaml --nproc 4 "$@"
