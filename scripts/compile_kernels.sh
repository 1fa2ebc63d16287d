#!/usr/bin/env bash
# Compile-only check of every CUDA/C++ source (no GPU needed): the kernels with nvcc for sm_80 and sm_90, the
# torch bindings and the NVSHMEM runtime with nvcc's host compiler against the installed headers.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
NVCC=${NVCC:-${CUDA_HOME:-/usr/local/cuda}/bin/nvcc}
CUDA_INC=$(dirname "$(dirname "$NVCC")")/include
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
python -c "import nvidia.nvshmem" 2>/dev/null || python -m pip install -q nvidia-nvshmem-cu13
NVSHMEM_INC=$(python -c "import nvidia.nvshmem as m, os; print(os.path.join(list(m.__path__)[0], 'include'))")
TORCH_INCS=$(python -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))")
PY_INC=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
PYBIND_INC=$(python -c "import pybind11; print(pybind11.get_include())" 2>/dev/null || true)
COMMON=(-std=c++17 -O2 -I csrc -I "$CUDA_INC" -I "$CUDA_INC/cccl")
# The kernels as torch's extension build compiles them: without the half/bf16 operators...
read -r -a TORCH_NVCC <<< "$(python -c "from torch.utils.cpp_extension import COMMON_NVCC_FLAGS as f; print(' '.join(f))")"
# ...which the NVSHMEM device build defines back (setup.py does the same), for NVSHMEM's headers.
read -r -a NVSHMEM_DEVICE_NVCC <<< "$(python -c "from torch.utils.cpp_extension import COMMON_NVCC_FLAGS as f
print(' '.join('-U' + x[2:] for x in f if x.startswith('-D__CUDA_NO_')))")"
JOBS=${MAX_JOBS:-$(nproc)}
status=0
compile() { echo "  $*" | sed 's/ -I[^ ]*//g' | cut -c1-160; "$@" || { echo "FAILED: $*" | cut -c1-200; return 1; }; }
pids=()
for src in csrc/kernels/*.cu csrc/kernels/intranode/*.cu; do
  compile "$NVCC" "${COMMON[@]}" -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
    "${TORCH_NVCC[@]}" \
    -c "$src" -o "$OUT/$(echo "${src#csrc/kernels/}" | tr / _).o" &
  pids+=($!)
  if (( ${#pids[@]} >= JOBS )); then wait "${pids[0]}" || status=1; pids=("${pids[@]:1}"); fi
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
# The measuring build (setup.py with MOE_EP_TIMELINE=1): the low-latency kernels with their stamps.
compile "$NVCC" "${COMMON[@]}" -gencode=arch=compute_90,code=sm_90 "${TORCH_NVCC[@]}" -DMOE_EP_TIMELINE=1 \
  -c csrc/kernels/low_latency.cu -o "$OUT/low_latency_timeline.o" || status=1
# Host sources: torch's headers and NVSHMEM's, syntax only. A CPU wheel of torch ships the c10/cuda
# headers but not the one header its CUDA build generates; a stand-in with the same single define lets
# the bindings be checked here (on a CUDA build of torch the real one is found first).
mkdir -p "$OUT/shim/c10/cuda/impl"
echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$OUT/shim/c10/cuda/impl/cuda_cmake_macros.h"
compile g++ "${COMMON[@]}" -std=c++20 $TORCH_INCS -idirafter "$OUT/shim" -I "$PY_INC" ${PYBIND_INC:+-I "$PYBIND_INC"} -DTORCH_EXTENSION_NAME=_C \
  -DMOE_EP_WITH_NVSHMEM=1 -fsyntax-only csrc/bindings.cpp || status=1
compile g++ "${COMMON[@]}" -Wall -Wextra -Werror -fsyntax-only csrc/peer_memory.cpp || status=1
compile g++ "${COMMON[@]}" -I "$NVSHMEM_INC" -fsyntax-only csrc/runtime_nvshmem.cpp || status=1
# The internode module (setup.py's moe_ep._internode): its kernels (the internode ones, the low-latency ones
# that put, the put-with-signal test kernel) relocatable and device-linked together against NVSHMEM's static
# device library, so that a missing, duplicate or mismatched device symbol fails here; its host sources
# against torch's and NVSHMEM's headers.
NVSHMEM_LIB=$(dirname "$NVSHMEM_INC")/lib
INTERNODE_OBJS=()
pids=()
for src in csrc/kernels/internode/*.cu; do
  obj="$OUT/internode_$(basename "$src" .cu).o"
  INTERNODE_OBJS+=("$obj")
  compile "$NVCC" "${COMMON[@]}" -I "$NVSHMEM_INC" -rdc=true -gencode=arch=compute_80,code=sm_80 \
    -gencode=arch=compute_90,code=sm_90 --expt-relaxed-constexpr "${TORCH_NVCC[@]}" "${NVSHMEM_DEVICE_NVCC[@]}" \
    -c "$src" -o "$obj" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
compile "$NVCC" -dlink -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
  "${INTERNODE_OBJS[@]}" -L "$NVSHMEM_LIB" -lnvshmem_device -o "$OUT/internode_dlink.o" || status=1
# The measuring build's low-latency kernels that put (setup.py hands MOE_EP_TIMELINE to both modules).
compile "$NVCC" "${COMMON[@]}" -I "$NVSHMEM_INC" -rdc=true -gencode=arch=compute_90,code=sm_90 --expt-relaxed-constexpr \
  "${TORCH_NVCC[@]}" "${NVSHMEM_DEVICE_NVCC[@]}" -DMOE_EP_TIMELINE=1 -c csrc/kernels/internode/low_latency_puts.cu \
  -o "$OUT/low_latency_puts_timeline.o" || status=1
compile g++ "${COMMON[@]}" -std=c++20 $TORCH_INCS -idirafter "$OUT/shim" -I "$PY_INC" ${PYBIND_INC:+-I "$PYBIND_INC"} \
  -DTORCH_EXTENSION_NAME=_internode -fsyntax-only csrc/internode_bindings.cpp || status=1
compile g++ "${COMMON[@]}" -I "$NVSHMEM_INC" -fsyntax-only csrc/internode_runtime.cpp || status=1
exit $status
