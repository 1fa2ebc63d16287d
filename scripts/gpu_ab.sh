#!/usr/bin/env bash
# An A/B of kernel builds in one GPU call: the tree as it is (A) against the tree with each patch
# applied (one variant per patch), every variant built, the benchmarks in alternating rounds on the same
# machine. Figures from separate calls differ by more than most kernel changes gain, so a change is
# judged here or not at all.
#   usage: AB_PATCHES="ab/tail.patch ab/receive.patch" bash scripts/gpu_ab.sh
#   make a patch here, after merging main into the branch (else the patch undoes what main has since):
#   git diff main some-branch -- . ':(exclude)docs' > ab/some.patch (its tests and scripts come along).
#   ab/ is ignored: name it in the device call's carry.
#   AB_TESTS: pytest arguments run in every patched tree before the benchmarks (a variant must be right
#   before its speed counts), e.g. "tests/test_low_latency_kernels.py -x"; AB_TEST_VARIANTS (all
#   patched ones): which variants, by patch name; a variant whose tests fail is not benchmarked (a wrong
#   kernel's speed says nothing, and a hung one would eat the call). AB_ROUNDS (2): rounds over all
#   variants. AB_BENCH_TIMEOUT: seconds a benchmark run may take (default 300 intranode, 240 low-latency).
#   AB_INTRANODE ("--ranks 2 4 8 --sms 24"): bench_intranode's arguments, empty to skip;
#   AB_LOW_LATENCY ("--ranks 2 8 --graph"): bench_low_latency's, empty to skip.
#   AB_INTRANODE_<variant> / AB_LOW_LATENCY_<variant> (variant = patch name, each character outside
#   [A-Za-z0-9_] as _): that variant's own arguments, e.g. a mode only it has.
#   AB_TIMELINE (empty: none), e.g. "--ranks 8 --combine": every variant is also built with
#   MOE_EP_TIMELINE=1 (in a copy of its tree, alongside the other builds) and, after the benchmarks,
#   moe_ep.bench.ll_timeline runs there with these arguments: where each variant's time goes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
INTRANODE=${AB_INTRANODE-"--ranks 2 4 8 --sms 24"}
LOW_LATENCY=${AB_LOW_LATENCY-"--ranks 2 8 --graph"}
read -r -a PATCHES <<< "${AB_PATCHES:?AB_PATCHES: the patches that make the variants, space-separated}"

# A fresh copy of the sources in $1 at $2 (a copied build/ would point at the first tree's sources).
copy_sources() {
  rm -rf "$2" && mkdir -p "$2"
  (cd "$1" && tar --exclude=./.git --exclude=./.venv --exclude=./build --exclude='./moe_ep/*.so' --exclude=./out \
    -cf - .) | tar -xf - -C "$2"
}
# Variant A is this tree; each other variant a patched copy.
declare -A TREE=([A]=$ROOT)
VARIANTS=(A)
for patch in "${PATCHES[@]}"; do
  name=$(basename "$patch" .patch)
  dir=/tmp/moe_ep_variant_$name
  copy_sources "$ROOT" "$dir"
  (cd "$dir" && patch -s -p1 < "$ROOT/$patch") || { echo "$patch does not apply to this tree"; exit 1; }
  TREE[$name]=$dir
  VARIANTS+=("$name")
done
declare -A TIMELINE_TREE
if [[ -n ${AB_TIMELINE:-} ]]; then
  for v in "${VARIANTS[@]}"; do
    TIMELINE_TREE[$v]=/tmp/moe_ep_timeline_$v
    copy_sources "${TREE[$v]}" "${TIMELINE_TREE[$v]}"
  done
fi
t0=$(date +%s)
declare -A BUILD
for v in "${VARIANTS[@]}"; do
  (cd "${TREE[$v]}" && $PY setup.py build_ext --inplace > "$OUT/build_$v.log" 2>&1) &
  BUILD[$v]=$!
  if [[ -n ${TIMELINE_TREE[$v]:-} ]]; then
    (cd "${TIMELINE_TREE[$v]}" && MOE_EP_TIMELINE=1 $PY setup.py build_ext --inplace > "$OUT/build_timeline_$v.log" 2>&1) &
    BUILD[timeline_$v]=$!
  fi
done
for job in "${!BUILD[@]}"; do
  wait "${BUILD[$job]}" || { echo "BUILD $job FAILED (tail of build_$job.log follows)"; tail -30 "$OUT/build_$job.log"; exit 1; }
done
echo "built ${VARIANTS[*]}${AB_TIMELINE:+ (and their timeline builds)} in $(( $(date +%s) - t0 )) s"

FAILED_TESTS=()
if [[ -n ${AB_TESTS:-} ]]; then
  export MOE_EP_TIMEOUT_S=${MOE_EP_TIMEOUT_S:-20} MOE_EP_TEST_CALL_TIMEOUT_S=${MOE_EP_TEST_CALL_TIMEOUT_S:-120}
  for v in ${AB_TEST_VARIANTS:-${VARIANTS[@]:1}}; do
    if ! (cd "${TREE[$v]}" && eval "timeout 400 $PY -m pytest -q -rf $AB_TESTS" > "$OUT/tests_$v.log" 2>&1); then  # eval: quoted -k
      FAILED_TESTS+=("$v")
    fi
    echo "tests of $v: $(tail -1 "$OUT/tests_$v.log")"
  done
fi
BENCHED=()
for v in "${VARIANTS[@]}"; do
  if [[ " ${FAILED_TESTS[*]} " == *" $v "* ]]; then echo "$v: tests failed, not benchmarked"; else BENCHED+=("$v"); fi
done

for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for v in "${BENCHED[@]}"; do
    key=${v//[^A-Za-z0-9_]/_}  # a patch name may hold characters a variable name may not
    own=AB_INTRANODE_$key; INTRANODE_V=${!own-$INTRANODE}
    own=AB_LOW_LATENCY_$key; LOW_LATENCY_V=${!own-$LOW_LATENCY}
    if [[ -n $INTRANODE_V ]]; then
      (cd "${TREE[$v]}" && timeout "${AB_BENCH_TIMEOUT:-300}" $PY -m moe_ep.bench.intranode $INTRANODE_V --json "$OUT/ab_$v.jsonl" \
        > "$OUT/ab_${v}_intranode_$round.txt" 2>&1) || echo "bench_intranode $v round $round failed"
    fi
    if [[ -n $LOW_LATENCY_V ]]; then
      (cd "${TREE[$v]}" && timeout "${AB_BENCH_TIMEOUT:-240}" $PY -m moe_ep.bench.low_latency $LOW_LATENCY_V --json "$OUT/ab_$v.jsonl" \
        > "$OUT/ab_${v}_low_latency_$round.txt" 2>&1) || echo "bench_low_latency $v round $round failed"
    fi
  done
done
if [[ -n ${AB_TIMELINE:-} ]]; then
  for v in "${BENCHED[@]}"; do
    (cd "${TIMELINE_TREE[$v]}" && timeout "${AB_BENCH_TIMEOUT:-240}" $PY -m moe_ep.bench.ll_timeline $AB_TIMELINE \
      > "$OUT/timeline_$v.txt" 2>&1) || echo "ll_timeline $v failed"
  done
fi
for v in "${VARIANTS[@]:1}"; do
  echo "== $v against A"
  if [[ -f $OUT/ab_A.jsonl && -f $OUT/ab_$v.jsonl ]]; then
    $PY scripts/ab_summary.py "$OUT/ab_A.jsonl" "$OUT/ab_$v.jsonl"
  else
    echo "no benchmark figures for both (benchmarks skipped or failed)"
  fi
done | tee "$OUT/ab_summary.txt"
for v in "${BENCHED[@]}"; do
  [[ -f $OUT/timeline_$v.txt ]] && { echo "== timeline of $v"; cat "$OUT/timeline_$v.txt"; }
done | tee -a "$OUT/ab_summary.txt"
# At most 8 files come back from the lent machines: the summary, and everything else in one archive.
(cd "$OUT" && tar czf ab_logs.tar.gz --exclude ab_summary.txt --exclude ab_logs.tar.gz -- * && \
  find . -maxdepth 1 -type f ! -name ab_summary.txt ! -name ab_logs.tar.gz -delete)
