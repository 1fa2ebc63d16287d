#!/usr/bin/env bash
# Everything a GPU machine call needs, in one go: build the extension, run the GPU tests and the GPU
# benchmarks, write logs and a summary. Writes into ${OUT:-out}/.
#   usage: bash scripts/gpu_check.sh [pytest -k expression]
#   MOE_EP_SKIP_BENCH=1: build and tests only; MOE_EP_SKIP_TESTS=1: build and benchmarks only.
#   GPU_TESTS: the test files (default: the seven below; the whole set takes over 8 min on one H200, so a
#   600-s call takes it in two parts, e.g. "tests/test_intranode.py tests/test_gpu_kernels.py" and
#   "tests/test_low_latency_kernels.py tests/test_benchmark_scripts.py tests/test_shared_gpu.py", on a
#   machine kept warm). GPU_TESTS_TIMEOUT_S: a limit on the tests that still lets pytest report.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# Short peer deadlines: a kernel protocol bug shows up as a TimeoutError in seconds, not a stuck run.
export MOE_EP_TIMEOUT_S=${MOE_EP_TIMEOUT_S:-20}
# A pool call stuck past every kernel deadline fails in two minutes instead of ten.
export MOE_EP_TEST_CALL_TIMEOUT_S=${MOE_EP_TEST_CALL_TIMEOUT_S:-120}
: > "$OUT/summary.txt"
summary "gpu_check $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
summary "torch $($PY -c 'import torch; print(torch.__version__)')"

build_extension || exit 1
summary "backends: $($PY -c 'import moe_ep, json; print(json.dumps(moe_ep.backend_info()))')"

status=0
if [[ ${MOE_EP_SKIP_TESTS:-0} != 1 ]]; then  # benchmarks alone: a second call on the still-warm machine
t0=$(date +%s)
GPU_TESTS=${GPU_TESTS:-tests/test_gpu_kernels.py tests/test_fp8_blockwise.py tests/test_intranode.py tests/test_internode.py tests/test_low_latency_kernels.py tests/test_benchmark_scripts.py tests/test_shared_gpu.py}
# shellcheck disable=SC2086  # GPU_TESTS: a list of files
# GPU_TESTS_TIMEOUT_S: stop the tests that long after they start with SIGINT, so that pytest still
# writes its failures and summary (a limit that kills the call loses them; 0: no limit).
timeout -s INT "${GPU_TESTS_TIMEOUT_S:-0}" $PY -m pytest -v --durations=10 --maxfail=${MAXFAIL:-3} -rf $GPU_TESTS \
  ${1:+-k "$1"} > "$OUT/gpu_tests.log" 2>&1
status=$?
summary "gpu tests: $(tail -1 "$OUT/gpu_tests.log") in $(( $(date +%s) - t0 )) s"
[[ $status -ne 0 ]] && tail -60 "$OUT/gpu_tests.log"
fi

# megatron-core: the CPU integration tests on this machine's Python, then the dispatcher comparison at
# EP=1 on the GPU. A carried TE bundle (.te/, with its megatron-core) or wheel (.whl/megatron_core-*.whl,
# see README) is installed first; with TE the tests that need its layers run too.
if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/mcore .whl/megatron_core-*.whl && export PYTHONPATH=/tmp/mcore${PYTHONPATH:+:$PYTHONPATH}
fi
install_te_bundle
if $PY -c "import megatron.core" 2>/dev/null; then
  summary "$(te_versions)"
  if [[ ${MOE_EP_SKIP_TESTS:-0} != 1 ]]; then
    $PY -m pytest -q tests/test_megatron.py tests/test_overlap_chunks.py tests/test_microbatch_overlap.py \
      tests/test_capacity_padding.py tests/test_shared_expert_overlap.py tests/test_fp8_dispatch.py \
      tests/test_te_experts.py > "$OUT/megatron_tests.log" 2>&1
    summary "megatron tests (CPU ranks, CUDA ranks where the kernels are built, TE's layers where it imports): $(tail -1 "$OUT/megatron_tests.log")"
  fi
  if [[ ${MOE_EP_SKIP_BENCH:-0} != 1 ]]; then
    # One MoE layer: the chunked pipeline, fp8 dispatch and the shared expert's overlap, bf16, 4 ranks; then
    # a training step with and without megatron's micro-batch overlap.
    timeout 150 $PY -m moe_ep.bench megatron_layer --ranks 4 --dtype bfloat16 --ffn-hidden 2816 --overlap-chunks 1 2 \
      --fp8-dispatch --shared-expert-ffn 2816 --jsonl "$OUT/bench.jsonl" 2>&1 | grep -v -i warn | tail -16 | tee -a "$OUT/summary.txt"
    timeout 200 $PY -m moe_ep.bench microbatch_overlap --ranks 4 --jsonl "$OUT/bench.jsonl" 2>&1 | grep -v -i warn \
      | tail -4 | tee -a "$OUT/summary.txt"
    # EP=1 on the two-pass calls, then EP=4 with four ranks sharing this GPU (the launcher's MPS and SM
    # share) through the dispatcher's default arena; COMPARE_EPS="1 4 8" adds eight ranks (another ~110 s
    # on one H200).
    for ep in ${COMPARE_EPS:-1 4}; do
      arena=--no-arena; [[ $ep -gt 1 ]] && arena=
      # shellcheck disable=SC2086  # arena: no argument or one
      timeout 240 $PY examples/compare_dispatchers.py --config configs/single_gpu_small.yaml --nproc $ep --steps 30 \
        --warmup 5 $arena --plot "$OUT/compare_ep$ep.png" --json "$OUT/compare_ep$ep.json" 2>&1 \
        | grep -v "step/s" | tail -6 | tee -a "$OUT/summary.txt"
    done
  fi
fi

if [[ ${MOE_EP_SKIP_BENCH:-0} != 1 ]]; then
  $PY -m moe_ep.bench.profile_layout_call 2>&1 | tee -a "$OUT/summary.txt"
  $PY -m moe_ep.bench.layout --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench_layout.txt" | tee -a "$OUT/summary.txt"
  $PY -m moe_ep.bench.fp8 --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench_fp8.txt" | tee -a "$OUT/summary.txt"
  # BENCH_SMS / BENCH_RECV_TOKENS: space-separated sweeps (SM budgets; chunk = window sizes).
  timeout 300 $PY -m moe_ep.bench.intranode --ranks 2 4 8 --sms ${BENCH_SMS:-24} \
    ${BENCH_RECV_TOKENS:+--recv-tokens $BENCH_RECV_TOKENS} --json "$OUT/bench.jsonl" 2>&1 \
    | tee "$OUT/bench_intranode.txt" | tee -a "$OUT/summary.txt"
  # Both combines forced on the same problems (the default streams from 4 ranks up): BENCH_OTHER_COMBINE=1.
  if [[ ${BENCH_OTHER_COMBINE:-0} == 1 ]]; then
    for forced in 0 1; do
      timeout 300 $PY -m moe_ep.bench.intranode --ranks 2 4 8 --sms ${BENCH_SMS:-24} --stream-combine $forced \
        --modes combine --json "$OUT/bench.jsonl" 2>&1 | sed "s/^/--stream-combine $forced: /" | tee -a "$OUT/summary.txt"
    done
  fi
  # Where the intranode kernels' time goes (their blocks' waits on peers), apart from the figures above.
  [[ ${BENCH_PROFILE_WAITS:-0} == 1 ]] && timeout 200 $PY -m moe_ep.bench.intranode --ranks 4 8 --sms ${BENCH_SMS:-24} \
    --profile-waits 2>&1 | tee -a "$OUT/summary.txt"
  # Stores into a peer's buffer against loads from it (ranks on one GPU; BENCH_PEER_COPY=0 skips it).
  [[ ${BENCH_PEER_COPY:-1} == 1 && $($PY -c 'import torch; print(torch.cuda.device_count())') == 1 ]] && \
    timeout 120 $PY -m moe_ep.bench.peer_copy --ranks 2 8 --json "$OUT/bench.jsonl" 2>&1 | tee -a "$OUT/summary.txt"
  # Host time of a low-latency call, and where it goes ("no sync": calls back to back, so it can include
  # waiting on a full launch queue; "device idle": the host alone).
  timeout 60 $PY -m moe_ep.bench.profile_low_latency_call --python-profile 10 2>&1 | tee -a "$OUT/summary.txt"
  # Device time per kernel inside the calls (BENCH_TRACE=0 skips it); torch.profiler's warning per rank left out.
  if [[ ${BENCH_TRACE:-1} == 1 ]]; then
    for trace in "--mode low_latency" "--mode normal" "--mode normal --arena"; do
      # shellcheck disable=SC2086  # trace: the arguments of one run
      timeout 120 $PY -m moe_ep.bench.trace_kernels $trace --ranks 2 8 2>&1 \
        | grep -v -e "Profiler clears events" -e "_warn_once(" | tee -a "$OUT/summary.txt"
    done
  fi
  # What Buffer.stats() collection and Buffer.profile() cost a round, against neither, in one run.
  timeout 120 $PY -m moe_ep.bench observe --ranks 4 --jsonl "$OUT/bench.jsonl" 2>&1 | tee -a "$OUT/summary.txt"
  timeout 240 $PY -m moe_ep.bench.low_latency --ranks ${BENCH_LL_RANKS:-2 4 8} --graph --json "$OUT/bench.jsonl" 2>&1 \
    | tee "$OUT/bench_low_latency.txt" | tee -a "$OUT/summary.txt"
fi
exit $status
