// The kernels' whole interface: plain pointers, counts and a stream. No torch here, so the kernels
// compile (and can be unit-tested) without it; csrc/bindings.cpp is the only torch-aware file.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace moe_ep {

// Element types the kernels accept for hidden states (values match the bindings' dtype mapping).
enum class DType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

namespace layout {

// One pass over topk_idx [num_tokens, num_topk] (-1 = no expert). Experts are spread evenly:
// expert e lives on rank e / (num_experts / num_ranks); rank r on node r / ranks_per_node.
// Outputs: counts[num_ranks + num_nodes + num_experts] int32 laid out as
//   [tokens per rank | tokens per node | (token, k) entries per expert], and
//   is_token_in_rank [num_tokens, num_ranks] bool. A token counts once per rank and once per node.
// num_nodes = num_ranks / ranks_per_node; the per-node counts are written only when num_nodes > 1.
void get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                         int ranks_per_node, int* counts, bool* is_token_in_rank, int num_sms, cudaStream_t stream);

}  // namespace layout

namespace fp8 {

constexpr int kBlock = 128;       // columns per scale
constexpr float kE4M3Max = 448.f;  // largest finite e4m3 value
constexpr float kAmaxFloor = 1e-4f;

// x [num_tokens, hidden] -> x_fp8 [num_tokens, hidden] e4m3 and, per 128 columns, a float32 scale
// (scales [num_tokens, hidden / 128]) or, with use_ue8m0, its biased exponent packed four to an int32
// (scales [num_tokens, ceil(hidden / 512)] int32, pad bytes zero). hidden % 128 == 0.
void per_token_cast(const void* x, DType x_dtype, int num_tokens, int hidden, bool round_scale, bool use_ue8m0,
                    uint8_t* x_fp8, void* scales, int num_sms, cudaStream_t stream);

// out [num_tokens, hidden] (bf16 or float32) = e4m3 value * its block's scale.
void per_token_cast_back(const uint8_t* x_fp8, const void* scales, bool scales_ue8m0, int num_tokens, int hidden,
                         void* out, DType out_dtype, int num_sms, cudaStream_t stream);

}  // namespace fp8

}  // namespace moe_ep
