#!/usr/bin/env bash
# Issue 4 and 6's common question on one GPU: are stores into another process's buffer slow because of
# how it is mapped? The low-latency benchmark at 8 PEs with the buffers mapped through CUDA IPC
# (default) and through NVSHMEM's heap (MOE_EP_LL_MEMORY=nvshmem), each with the plain combine staged
# (main) and pushed (diag-ll-push-combine). ~4 min with the machine's start.
#   usage (GPU machine, repository root): export OUT; bash scripts/candidates/ll_mappings.sh
set -uo pipefail
source "$(dirname "$0")/../gpu_env.sh"
D=/tmp/moe_ep_push; rm -rf "$D"; mkdir -p "$D"
tar --exclude=./.git --exclude=./build --exclude='./moe_ep/*.so' --exclude=./out -cf - . | tar -xf - -C "$D"
(cd "$D" && patch -s -p1 < "$ROOT/scripts/candidates/diag-ll-push-combine.patch" &&
  $PY setup.py build_ext --inplace > "$OUT/build_push.log" 2>&1; echo "push tree build rc $?") &
$PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1; echo "main build rc $?"
wait
for memory in ipc nvshmem; do
  for tree in "$ROOT" "$D"; do
    label=$([[ $tree == "$ROOT" ]] && echo staged || echo pushed)
    echo "== $memory, plain combine $label"
    (cd "$tree" && MOE_EP_LL_MEMORY=$memory MOE_EP_DIAG_LL_PUSH=1 timeout 90 $PY -m moe_ep.bench.low_latency \
      --ranks 8 --graph --json "$OUT/ll_${memory}_$label.jsonl" 2>&1 | tail -3)
  done
done
