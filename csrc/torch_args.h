// What every binding file needs between torch tensors and the torch-free kernels: the current stream,
// the device's SM count, nullable tensor pointers and the row check. Internal linkage: each extension
// module compiles its own copy.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>

namespace moe_ep {
namespace {

inline int num_sms_of_current_device() {
    int device = 0, count = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

template <typename T>
T* optional_ptr(const std::optional<torch::Tensor>& t) {
    return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

// The kernels load and store rows in 16-byte vectors.
inline void check_rows(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                ": expected a contiguous, 16-byte aligned CUDA tensor");
}

}  // namespace
}  // namespace moe_ep
