// Launch-error checking shared by the kernel files; the bindings turn the exception into a Python error.
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
