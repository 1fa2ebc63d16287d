#!/usr/bin/env bash
# The multi-GPU check in one call on a multi-GPU host (nvidia-h200-x8, -x4 or -x2): topology, build, the
# intranode benchmark with one rank per GPU next to NCCL's all-to-all, its SM sweep, and megatron-core at
# EP=N with both dispatchers. Writes into ${OUT:-out}/; the standing figures belong in docs/BENCHMARKS.md.
#   usage: bash scripts/multi_gpu_check.sh            (all GPUs of the host)
#          RANKS=4 bash scripts/multi_gpu_check.sh    (dry run on fewer GPUs: ranks then share them)
#          PARTS="tests bench" bash scripts/multi_gpu_check.sh   (some of: tests bench sweep low_latency
#          megatron; all by default), so that the whole check fits two 600-s calls on a still-warm machine
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
GPUS=$(nvidia-smi -L | wc -l)
RANKS=${RANKS:-$GPUS}
PARTS=" ${PARTS:-tests bench sweep low_latency megatron} "
part() { [[ $PARTS == *" $1 "* ]]; }
: > "$OUT/summary.txt"
summary "multi_gpu_check $(date -u +%FT%TZ): $GPUS x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $RANKS ranks"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
cat "$OUT/topology.txt" >> "$OUT/summary.txt"

build_extension || exit 1

# The GPU tests first: here ranks spread over the GPUs (rank % GPUs), so the kernels' peers are on other
# GPUs (NVLink). MOE_EP_SKIP_TESTS=1 skips them; TESTS_S (420): their time limit.
if part tests && [[ ${MOE_EP_SKIP_TESTS:-0} != 1 ]]; then
  t0=$(date +%s)
  MOE_EP_TIMEOUT_S=${MOE_EP_TIMEOUT_S:-20} timeout "${TESTS_S:-420}" $PY -m pytest -q --maxfail=${MAXFAIL:-5} -rf \
    tests/test_intranode.py tests/test_low_latency_kernels.py > "$OUT/gpu_tests.log" 2>&1
  summary "gpu tests over $GPUS GPUs: $(tail -1 "$OUT/gpu_tests.log") in $(( $(date +%s) - t0 )) s"
fi

# The intranode kernels at the benchmark's default shape; NCCL's all-to-all only where each rank has a GPU.
NCCL_FLAG=""
[[ $RANKS -le $GPUS ]] && NCCL_FLAG=--nccl
part bench && timeout 240 $PY -m moe_ep.bench.intranode --ranks "$RANKS" --sms 24 $NCCL_FLAG --json "$OUT/bench.jsonl" 2>&1 \
  | tee -a "$OUT/summary.txt"
part sweep && timeout 240 $PY -m moe_ep.bench.intranode --ranks "$RANKS" --sms 8 16 32 48 --json "$OUT/sweep.jsonl" 2>&1 \
  | tee -a "$OUT/summary.txt"
part low_latency && timeout 200 $PY -m moe_ep.bench.low_latency --ranks "$RANKS" --json "$OUT/bench.jsonl" 2>&1 \
  | tee -a "$OUT/summary.txt"

# megatron-core at EP=$RANKS, both dispatchers, same seeds (a carried .whl/megatron_core-*.whl is used).
if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/mcore .whl/megatron_core-*.whl \
    && export PYTHONPATH=/tmp/mcore${PYTHONPATH:+:$PYTHONPATH}
fi
if part megatron; then
  if $PY -c "import megatron.core" 2>/dev/null; then
    for config in ${CONFIGS:-configs/mixtral_8x7b_like.yaml}; do
      name=$(basename "$config" .yaml)
      timeout 400 $PY examples/compare_dispatchers.py --config "$config" --nproc "$RANKS" --steps "${STEPS:-20}" \
        --warmup 5 --plot "$OUT/compare_$name.png" --json "$OUT/compare_$name.json" 2>&1 \
        | grep -v "step/s" | tail -8 | tee -a "$OUT/summary.txt"
    done
  else
    summary "megatron-core not importable: carry .whl/megatron_core-*.whl (see README)"
  fi
fi
