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

// Blocks of `kernel` the whole current device holds at once.
inline int resident_blocks(const void* kernel, int threads, size_t dynamic_smem = 0) {
    int device = 0, sms = 0, per_sm = 0;
    MOE_EP_CUDA_CHECK(cudaGetDevice(&device));
    MOE_EP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    MOE_EP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
    return per_sm * sms;
}

}  // namespace moe_ep
