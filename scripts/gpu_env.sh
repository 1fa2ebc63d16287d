# Sourced by the GPU machine scripts (gpu_check.sh, gpu_ab.sh, multi_gpu_check.sh): the repository
# root as working directory, $OUT for what comes back, $PY, and the environment every GPU run wants.
# NVLink multicast stays off (the lent machines' KINDS.md says why).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}

# transformer-engine and megatron-core for the megatron tests and benchmarks: a bundle carried as .te/ (an
# offline TE build with its megatron-core, see README), installed once per machine into /tmp/te_site.
TE_SITE=${TE_SITE:-/tmp/te_site}
install_te_bundle() {
  [[ -x .te/install_on_device.sh ]] || return 0
  if ! PYTHONPATH=$TE_SITE $PY -c "import torch, transformer_engine.pytorch" 2>/dev/null; then
    TE_USE_PREBUILT=1 TE_SKIP_SMOKE=1 TE_SITE=$TE_SITE bash .te/install_on_device.sh > "$OUT/te_install.log" 2>&1 \
      || { echo "transformer-engine bundle: install failed (tail of te_install.log follows)"; tail -20 "$OUT/te_install.log"; return 1; }
  fi
  export PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH}
}
# "transformer-engine 2.20.2, megatron-core 0.19.2", or what is missing.
te_versions() {
  $PY -c "
import torch
try:
    import transformer_engine as te; t = 'transformer-engine ' + te.__version__
except Exception as e: t = 'no transformer-engine (' + type(e).__name__ + ')'
try:
    import megatron.core as m; t += ', megatron-core ' + m.__version__
except Exception: t += ', no megatron-core'
print(t)" 2>/dev/null
}

# One line of a run's summary, printed and kept in $OUT/summary.txt.
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
# The extension built in place (a carried build is reused: setup.py rebuilds only what changed); the
# summary says how long it took, or the build log's tail where it failed (then a non-zero status).
build_extension() {
  local t0
  t0=$(date +%s)
  if ! $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    summary "BUILD FAILED (tail of build.log follows)"; tail -40 "$OUT/build.log"; return 1
  fi
  summary "build: ok in $(( $(date +%s) - t0 )) s"
}
