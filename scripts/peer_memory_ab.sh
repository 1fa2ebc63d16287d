#!/usr/bin/env bash
# Peers' buffers mapped through file descriptors (the virtual-memory API, the benchmarks' --peer-memory
# vmm, which auto takes where the GPU can) against CUDA IPC handles (--peer-memory ipc), in one build,
# alternating: the 8-rank intranode benchmark (five modes) and the 2- and 8-PE low-latency one; then the
# tests that cover both mappings (~7 min).
#   usage (GPU machine, repository root): export OUT; bash scripts/peer_memory_ab.sh
#   RANKS (8): the intranode benchmark's ranks, spread over the host's GPUs (rank % GPUs).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t0=$(date +%s)
$PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for memory in vmm ipc; do
    echo "== intranode, $memory, round $round"
    timeout 120 $PY -m moe_ep.bench.intranode --ranks "${RANKS:-8}" --sms 24 --peer-memory "$memory" \
      --modes dispatch_fp8_arena dispatch_bf16_arena dispatch_bf16 combine combine_arena_input \
      --json "$OUT/intranode_$memory.jsonl" 2>&1 | grep -v "^ranks" | cut -c1-110
  done
done
for memory in vmm ipc; do
  echo "== low latency, $memory"
  timeout 60 $PY -m moe_ep.bench.low_latency --ranks 2 8 --graph --peer-memory "$memory" \
    --json "$OUT/ll_$memory.jsonl" 2>&1 | tail -3
done
echo "benchmarks done at $(( $(date +%s) - t0 )) s"
export MOE_EP_TIMEOUT_S=20 MOE_EP_TEST_CALL_TIMEOUT_S=120
timeout 60 $PY -m pytest -q tests/test_descriptors.py tests/test_gpu_kernels.py -k "descriptor or peer or backend_info" 2>&1 | tail -3
timeout 200 $PY -m pytest -q -x tests/test_low_latency_kernels.py 2>&1 | tail -3
timeout "${TEST_INTRANODE_S:-150}" $PY -m pytest -q -x tests/test_intranode.py -k "equals_portable or cuda_ipc or into_the_arena" 2>&1 | tail -3
echo "all done at $(( $(date +%s) - t0 )) s"
