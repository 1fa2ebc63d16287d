// Python bindings: tensor checks, allocation and streams on top of the torch-free kernels/api.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include "kernels/api.cuh"

#ifndef MOE_EP_NVSHMEM_REASON
#define MOE_EP_NVSHMEM_REASON ""
#endif

namespace moe_ep {
namespace {

// Vector loads in the kernels need 16-byte aligned rows; a view into the middle of a tensor is copied.
torch::Tensor aligned_contiguous(const torch::Tensor& t) {
    auto c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

DType dtype_of(const torch::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case torch::kBFloat16: return DType::kBFloat16;
        case torch::kFloat16: return DType::kFloat16;
        case torch::kFloat32: return DType::kFloat32;
        default: TORCH_CHECK(false, name, ": expected bfloat16, float16 or float32, got ", t.scalar_type());
    }
}

int num_sms_of_current_device() {
    int device = 0, count = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

py::tuple get_dispatch_layout(const torch::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks,
                              int64_t ranks_per_node) {
    TORCH_CHECK(topk_idx.is_cuda() && topk_idx.scalar_type() == torch::kInt64 && topk_idx.dim() == 2,
                "topk_idx: expected a 2-D int64 CUDA tensor");
    TORCH_CHECK(num_ranks > 0 && num_experts % num_ranks == 0 && ranks_per_node > 0 && num_ranks % ranks_per_node == 0,
                "get_dispatch_layout: inconsistent num_experts/num_ranks/ranks_per_node");
    const c10::cuda::CUDAGuard guard(topk_idx.device());
    auto idx = topk_idx.contiguous();
    const int64_t num_tokens = idx.size(0), num_nodes = num_ranks / ranks_per_node;
    auto opts = idx.options();
    auto counts = torch::empty({num_ranks + num_nodes + num_experts}, opts.dtype(torch::kInt32));
    auto in_rank = torch::empty({num_tokens, num_ranks}, opts.dtype(torch::kBool));
    layout::get_dispatch_layout(idx.data_ptr<int64_t>(), static_cast<int>(num_tokens), static_cast<int>(idx.size(1)),
                                static_cast<int>(num_experts), static_cast<int>(num_ranks),
                                static_cast<int>(ranks_per_node), counts.data_ptr<int>(), in_rank.data_ptr<bool>(),
                                num_sms_of_current_device(), current_stream());
    auto per_rank = counts.narrow(0, 0, num_ranks);
    py::object per_node = py::none();
    if (num_nodes > 1) per_node = py::cast(counts.narrow(0, num_ranks, num_nodes));
    auto per_expert = counts.narrow(0, num_ranks + num_nodes, num_experts);
    return py::make_tuple(per_rank, per_node, per_expert, in_rank);
}

py::tuple fp8_cast(const torch::Tensor& x, bool round_scale, bool use_ue8m0) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "x: expected a 2-D CUDA tensor");
    TORCH_CHECK(x.size(1) % fp8::kBlock == 0, "x: hidden must be a multiple of ", fp8::kBlock, ", got ", x.size(1));
    TORCH_CHECK(!use_ue8m0 || round_scale, "use_ue8m0=True needs round_scale=True");
    const c10::cuda::CUDAGuard guard(x.device());
    auto src = aligned_contiguous(x);
    const int64_t n = src.size(0), hidden = src.size(1), blocks = hidden / fp8::kBlock;
    auto q = torch::empty({n, hidden}, src.options().dtype(torch::kFloat8_e4m3fn));
    torch::Tensor scales = use_ue8m0 ? torch::zeros({n, (blocks + 3) / 4}, src.options().dtype(torch::kInt32))
                                     : torch::empty({n, blocks}, src.options().dtype(torch::kFloat32));
    fp8::per_token_cast(src.data_ptr(), dtype_of(src, "x"), static_cast<int>(n), static_cast<int>(hidden), round_scale,
                        use_ue8m0, static_cast<uint8_t*>(q.data_ptr()), scales.data_ptr(),
                        num_sms_of_current_device(), current_stream());
    return py::make_tuple(q, scales);
}

torch::Tensor fp8_cast_back(const torch::Tensor& q, const torch::Tensor& scales, torch::ScalarType out_dtype) {
    TORCH_CHECK(q.is_cuda() && q.dim() == 2 && q.scalar_type() == torch::kFloat8_e4m3fn,
                "x_fp8: expected a 2-D float8_e4m3fn CUDA tensor");
    TORCH_CHECK(q.size(1) % fp8::kBlock == 0, "x_fp8: hidden must be a multiple of ", fp8::kBlock);
    const bool ue8m0 = scales.scalar_type() == torch::kInt32;
    TORCH_CHECK(ue8m0 || scales.scalar_type() == torch::kFloat32, "scales: expected float32 or int32 (UE8M0)");
    TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat32, "out_dtype: bfloat16 or float32");
    const c10::cuda::CUDAGuard guard(q.device());
    auto src = aligned_contiguous(q);
    auto s = scales.contiguous();
    auto out = torch::empty(src.sizes(), src.options().dtype(out_dtype));
    fp8::per_token_cast_back(static_cast<const uint8_t*>(src.data_ptr()), s.data_ptr(), ue8m0,
                             static_cast<int>(src.size(0)), static_cast<int>(src.size(1)), out.data_ptr(),
                             out_dtype == torch::kFloat32 ? DType::kFloat32 : DType::kBFloat16,
                             num_sms_of_current_device(), current_stream());
    return out;
}

}  // namespace

#ifdef MOE_EP_WITH_NVSHMEM
std::string nvshmem_version();  // runtime_nvshmem.cpp
#endif

}  // namespace moe_ep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "moe_ep CUDA kernels";
    m.def("get_dispatch_layout", &moe_ep::get_dispatch_layout, "dispatch layout from topk_idx");
    m.def("fp8_cast", &moe_ep::fp8_cast, "1x128 per-token e4m3 cast");
    m.def("fp8_cast_back", &moe_ep::fp8_cast_back, "1x128 per-token e4m3 cast back");
#ifdef MOE_EP_WITH_NVSHMEM
    m.attr("WITH_NVSHMEM") = true;
    m.attr("NVSHMEM_REASON") = "";
    m.def("nvshmem_version", &moe_ep::nvshmem_version, "version of the linked NVSHMEM host library");
#else
    m.attr("WITH_NVSHMEM") = false;
    m.attr("NVSHMEM_REASON") = MOE_EP_NVSHMEM_REASON;
#endif
#ifdef MOE_EP_SM90_COMPILED
    m.attr("SM90_COMPILED") = true;
#else
    m.attr("SM90_COMPILED") = false;
#endif
}
