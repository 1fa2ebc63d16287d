#!/usr/bin/env bash
# megatron-core with transformer-engine on a GPU machine, ranks sharing its GPU: the tests that need TE's
# layers, one overlapped training under compute-sanitizer, and the dispatcher comparisons with TE's layers
# (bf16 and fp8 blockwise), each against megatron's alltoall in the same run. Needs the TE bundle as .te/
# (README, "Build the CUDA extension"). Writes into ${OUT:-out}/.
#   MOE_EP_SKIP_TESTS=1: build and benchmarks only; MOE_EP_SKIP_BENCH=1: build and tests only;
#   MOE_EP_SKIP_SANITIZER=1: no compute-sanitizer run. TE_TESTS: the test files (default below).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export MOE_EP_TIMEOUT_S=${MOE_EP_TIMEOUT_S:-30} MOE_EP_TEST_CALL_TIMEOUT_S=${MOE_EP_TEST_CALL_TIMEOUT_S:-240}
export PYTHONWARNINGS=ignore
: > "$OUT/summary.txt"
summary "gpu_megatron_te $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
t0=$(date +%s)
[[ -x .te/install_on_device.sh ]] || { summary "no .te/ bundle: nothing to run"; exit 1; }
install_te_bundle || exit 1
summary "$(te_versions), torch $($PY -c 'import torch; print(torch.__version__)'); installed in $(( $(date +%s) - t0 )) s"
build_extension || exit 1

status=0
if [[ ${MOE_EP_SKIP_TESTS:-0} != 1 ]]; then
  t0=$(date +%s)
  TE_TESTS=${TE_TESTS:-tests/test_te_experts.py tests/test_microbatch_overlap.py tests/test_fp8_blockwise.py tests/test_fp8_dispatch.py tests/test_megatron_layer_bench.py tests/test_microbatch_overlap_bench.py}
  # shellcheck disable=SC2086  # TE_TESTS: a list of files
  timeout -s INT "${TE_TESTS_TIMEOUT_S:-0}" $PY -m pytest -v -rfs --durations=8 $TE_TESTS ${1:+-k "$1"} \
    > "$OUT/te_tests.log" 2>&1
  status=$?
  summary "tests with TE: $(tail -1 "$OUT/te_tests.log") in $(( $(date +%s) - t0 )) s"
  [[ $status -ne 0 ]] && grep -E "^(FAILED|ERROR)|Error" "$OUT/te_tests.log" | sort | uniq -c | head -20
fi

if [[ ${MOE_EP_SKIP_SANITIZER:-0} != 1 ]] && command -v compute-sanitizer >/dev/null; then
  # Two CUDA ranks trained through megatron's combined 1F1B schedule with the arena off (megatron frees
  # the rows it may, right after their node's forward): memcheck reports any access to memory freed or
  # reused while a stream still reads or writes it.
  t0=$(date +%s)
  timeout "${SANITIZER_TIMEOUT_S:-300}" compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
    --print-limit 20 $PY -m pytest -q -x -p no:cacheprovider tests/test_microbatch_overlap.py \
    -k "test_microbatch_overlap_on_cuda_ranks and False" > "$OUT/sanitizer.log" 2>&1
  summary "compute-sanitizer memcheck, micro-batch overlap on 2 CUDA ranks, arena off: rc=$? in $(( $(date +%s) - t0 )) s; $(grep -m1 -E "passed|failed|error" "$OUT/sanitizer.log"); $(grep -c "ERROR SUMMARY: 0 errors" "$OUT/sanitizer.log") processes with 0 errors, $(grep -cE "ERROR SUMMARY: [1-9]" "$OUT/sanitizer.log") with errors"
fi

if [[ ${MOE_EP_SKIP_BENCH:-0} != 1 ]]; then
  for impl in local transformer_engine; do
    timeout 200 $PY -m moe_ep.bench microbatch_overlap --ranks 4 --transformer-impl $impl \
      $([[ $impl == transformer_engine ]] && echo --delay-wgrad) --jsonl "$OUT/bench.jsonl" 2>&1 | tail -5 | tee -a "$OUT/summary.txt"
  done
  for recipe in "" "--fp8-recipe blockwise"; do
    # shellcheck disable=SC2086  # recipe: no argument or two
    timeout 200 $PY -m moe_ep.bench megatron_layer --ranks 4 --dtype bfloat16 --transformer-impl transformer_engine \
      $recipe --fp8-dispatch --jsonl "$OUT/bench.jsonl" 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
  done
  # EP=1, like for like (no peer: both dispatchers' exchanges are local): TE's layers in bf16, then under
  # the fp8 blockwise recipe (the config selects both).
  for run in "te_bf16 configs/single_gpu_small.yaml" "te_fp8 configs/single_gpu_te_fp8.yaml"; do
    read -r name config <<< "$run"
    timeout 240 $PY examples/compare_dispatchers.py --config "$config" --nproc 1 --steps 30 --warmup 5 --no-arena \
      --transformer-impl transformer_engine --json "$OUT/compare_ep1_$name.json" --plot "$OUT/compare_ep1_$name.png" \
      2>&1 | grep -v "step/s" | tail -6 | tee -a "$OUT/summary.txt"
  done
fi
exit $status
