# Sourced by the GPU machine scripts (gpu_check.sh, gpu_ab.sh, multi_gpu_check.sh): the repository
# root as working directory, $OUT for what comes back, $PY, and the environment every GPU run wants.
# NVLink multicast stays off (the lent machines' KINDS.md says why).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
