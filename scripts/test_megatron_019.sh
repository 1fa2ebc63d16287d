#!/usr/bin/env bash
# The megatron integration tests on CPU ranks against megatron-core 0.19.2's Python source, on this
# machine's Python (the venv's 3.11: PyPI's 0.19 wheels say Python >= 3.12, but the code the tests reach
# runs on 3.11). Downloads the cp312 wheel and triton (which 0.19 imports) into .mcore019/ once.
#   usage: bash scripts/test_megatron_019.sh [pytest arguments]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
DIR=.mcore019
if [[ ! -d $DIR/src/megatron ]]; then
  rm -rf "$DIR" && mkdir -p "$DIR/wheel" "$DIR/src"
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$DIR/wheel" "megatron-core==0.19.2"
  python -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$DIR"/wheel/megatron_core-*.whl "$DIR/src"
  python -m pip install -q --target "$DIR/deps" triton einops
fi
PYTHONPATH="$ROOT/$DIR/src:$ROOT/$DIR/deps" python -m pytest -q -p no:cacheprovider -W ignore \
  tests/test_megatron.py tests/test_fp8_dispatch.py tests/test_overlap_chunks.py tests/test_capacity_padding.py \
  tests/test_shared_expert_overlap.py tests/test_microbatch_overlap.py tests/test_megatron_layer_bench.py \
  tests/test_microbatch_overlap_bench.py "$@"
