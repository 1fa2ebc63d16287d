// Programmatic dependent launch (sm_90 and later): a kernel launched with launch_early may be scheduled
// while the kernel before it on the stream still runs, once every block of that kernel has called
// let_dependents_start() (or exited). What that saves is the gap between two kernels of one call
// (the first one's drain, the second one's launch), a few microseconds per boundary on a path of tens.
// An early kernel calls wait_for_prerequisite() before it touches anything the kernels before it
// wrote, and before it exits (so that the kernel after it can count on the whole chain). On older
// GPUs, and for a kernel launched the ordinary way, both calls do nothing.
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.cuh"

namespace moe_ep {

__device__ __forceinline__ void let_dependents_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The current device's compute capability (major), asked once per device and thread.
inline int current_device_major() {
    static thread_local int device_asked = -1;
    static thread_local int major = 0;
    int device = 0;
    MOE_EP_CUDA_CHECK(cudaGetDevice(&device));
    if (device != device_asked) {
        MOE_EP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        device_asked = device;
    }
    return major;
}

// Whether the current device schedules kernels early (compute capability 9 or more).
inline bool current_device_launches_early() { return current_device_major() >= 9; }

template <typename... Params, typename... Args>
void launch_early(void (*kernel)(Params...), int blocks, int threads, size_t smem, cudaStream_t stream,
                  const char* what, Args... args) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = current_device_launches_early() ? 1 : 0;
    check_cuda(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...), what);
}

}  // namespace moe_ep
