#!/usr/bin/env bash
# megatron training with moe_ep's dispatcher on a GPU machine, several ranks per GPU: one short run per
# variant, each line of TRAIN_VARIANTS being "name [train_moe.py argument ...]" (what that run adds to the
# command line), e.g.
#   TRAIN_VARIANTS=$'arena\ntwo_pass --no-arena' bash scripts/train_check.sh
# Prints each run's errors (one line per distinct message) and its last steps; logs in $OUT/<name>.log.
# A carried .whl/megatron_core-*.whl or TE bundle (.te/) is installed first (README). TRAIN_NPROC (4), TRAIN_STEPS (12),
# TRAIN_CONFIG (configs/single_gpu_small.yaml), TRAIN_TIMEOUT_S (150), MOE_EP_TIMEOUT_S (10). A step
# longer than TRAIN_STALL_S (6) leaves every rank's Python stacks and Buffer progress in
# $OUT/stalls_<name>/stall_rank<N>.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
build_extension || exit 1
if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/mcore .whl/megatron_core-*.whl 2>/dev/null
  export PYTHONPATH=/tmp/mcore${PYTHONPATH:+:$PYTHONPATH}
fi
install_te_bundle  # a carried .te/: TE's layers for --transformer-impl transformer_engine
export PYTHONWARNINGS=ignore MOE_EP_TIMEOUT_S=${MOE_EP_TIMEOUT_S:-10}
steps=${TRAIN_STEPS:-12}
while read -r name extra; do
  [[ -z $name ]] && continue
  echo "== $name: ${extra:-(the defaults)}"
  # shellcheck disable=SC2086  # extra: a list of arguments
  timeout "${TRAIN_TIMEOUT_S:-150}" $PY -m moe_ep.launch --nproc "${TRAIN_NPROC:-4}" examples/train_moe.py \
    --config "${TRAIN_CONFIG:-configs/single_gpu_small.yaml}" --dispatcher deepep --steps "$steps" \
    --stall-dump "${TRAIN_STALL_S:-6}" --stall-dir "$OUT/stalls_$name" $extra > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -h "Error:" "$OUT/$name.log" | sort | uniq -c | cut -c1-1200
  tr '\r' '\n' < "$OUT/$name.log" | grep -o "[0-9]*/$steps \[[^]]*\]" | tail -1
  for dump in "$OUT/stalls_$name"/stall_rank*.txt; do  # each stalled rank's main thread, innermost frames
    [[ -s $dump ]] && { echo "  $(basename "$dump"):"; awk 'BEGIN { RS = "" } /train_moe.py/ { print; exit }' "$dump" \
      | sed -n '2,5p' | sed 's/^/    /'; grep -h "^step " "$dump" | tail -1 | cut -c1-900 | sed 's/^/    /'; }
  done
done <<< "${TRAIN_VARIANTS:-arena}"
