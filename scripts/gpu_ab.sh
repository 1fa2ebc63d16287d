#!/usr/bin/env bash
# An A/B of two kernel builds in one GPU call: the tree as it is (A) against the tree with a patch
# applied (B), benchmarks alternating A, B, A, B on the same machine. Figures from separate calls
# differ by more than most kernel changes gain, so a change is judged here or not at all.
#   usage: AB_PATCH=ab/b.patch bash scripts/gpu_ab.sh
#   make the patch here: git diff main gpu-pending -- csrc moe_ep benchmarks > ab/b.patch (ab/ is
#   ignored: name it in the device call's carry). Merge A into B first, or B undoes what A has since.
#   AB_ROUNDS (2): rounds of A then B; AB_INTRANODE ("--ranks 2 4 8 --sms 24"): bench_intranode's
#   arguments, empty to skip; AB_LOW_LATENCY ("--ranks 2 8"): bench_low_latency's, empty to skip.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
PATCH_FILE=$(realpath "${AB_PATCH:?AB_PATCH: the patch that turns this tree into variant B}")
B_TREE=${AB_B_TREE:-/tmp/moe_ep_variant_b}

build() {  # build the tree in $1, log to $OUT/build_$2.log
  if ! (cd "$1" && $PY setup.py build_ext --inplace > "$OUT/build_$2.log" 2>&1); then
    echo "BUILD $2 FAILED"; tail -30 "$OUT/build_$2.log"; exit 1
  fi
}
rm -rf "$B_TREE" && mkdir -p "$B_TREE"
# A fresh copy without build outputs: a copied build/ would point at A's sources.
tar --exclude=./.git --exclude=./build --exclude='./moe_ep/*.so' --exclude=./out -cf - . | tar -xf - -C "$B_TREE"
(cd "$B_TREE" && patch -s -p1 < "$PATCH_FILE") || { echo "the patch does not apply to this tree"; exit 1; }
t0=$(date +%s)
build "$ROOT" A & build "$B_TREE" B & wait
echo "built A and B in $(( $(date +%s) - t0 )) s"

for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for variant in A B; do
    dir=$ROOT; [[ $variant == B ]] && dir=$B_TREE
    if [[ -n ${AB_INTRANODE-"--ranks 2 4 8 --sms 24"} ]]; then
      (cd "$dir" && timeout 300 $PY -m benchmarks.bench_intranode ${AB_INTRANODE-"--ranks 2 4 8 --sms 24"} \
        --json "$OUT/ab_$variant.jsonl" > "$OUT/ab_${variant}_intranode_$round.txt" 2>&1) || echo "bench_intranode $variant round $round failed"
    fi
    if [[ -n ${AB_LOW_LATENCY-"--ranks 2 8"} ]]; then
      (cd "$dir" && timeout 240 $PY -m benchmarks.bench_low_latency ${AB_LOW_LATENCY-"--ranks 2 8"} \
        --json "$OUT/ab_$variant.jsonl" > "$OUT/ab_${variant}_low_latency_$round.txt" 2>&1) || echo "bench_low_latency $variant round $round failed"
    fi
  done
done
$PY scripts/ab_summary.py "$OUT/ab_A.jsonl" "$OUT/ab_B.jsonl" | tee "$OUT/ab_summary.txt"
