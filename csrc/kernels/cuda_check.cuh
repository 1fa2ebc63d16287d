// Launch-error checking and occupancy queries shared by the kernel files; the bindings turn the
// exceptions into Python errors.
#pragma once

#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

namespace moe_ep {

inline void check_cuda(cudaError_t status, const char* what) {
    if (status != cudaSuccess)
        throw std::runtime_error(std::string("moe_ep: ") + what + ": " + cudaGetErrorString(status));
}

}  // namespace moe_ep

#define MOE_EP_CUDA_CHECK(call) ::moe_ep::check_cuda((call), #call)
#define MOE_EP_LAUNCH_CHECK(what) ::moe_ep::check_cuda(cudaGetLastError(), what)

namespace moe_ep {

// The SMs of the current device this process may use: under an MPS SM share, only the share's part.
inline int sm_count() {
    int device = 0, sms = 0;
    MOE_EP_CUDA_CHECK(cudaGetDevice(&device));
    MOE_EP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
}

// Blocks of `kernel` the SMs this process may use hold at once (sm_count of them).
inline int resident_blocks(const void* kernel, int threads, size_t dynamic_smem = 0) {
    int per_sm = 0;
    MOE_EP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
    return per_sm * sm_count();
}

// For kernels whose blocks spin while other kernels must still start on the same GPU: an SM keeps its
// shared-memory carveout while any block runs on it, so a spinning block on an SM configured for
// little shared memory keeps out every block that needs more (a peer's send kernel, a GEMM) for as
// long as it spins. Configured for the most shared memory, the SM still takes anyone's blocks.
inline void prefer_max_shared_carveout(const void* kernel) {
    MOE_EP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
}

}  // namespace moe_ep
