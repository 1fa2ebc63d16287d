// 1x128 per-token FP8 (e4m3) cast and cast-back, bitwise equal to moe_ep/fp8.py, and the cast under
// transformer-engine's rule, bitwise equal to moe_ep/fp8_blockwise.py (the block arithmetic is in
// fp8_block.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "api.cuh"
#include "cuda_check.cuh"
#include "fp8_block.cuh"

namespace moe_ep {
namespace fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kGroupsPerCta = kThreads / kLanesPerBlock;

// Rule: bool (moe_ep's rule: round_scale) or TeScaling (transformer-engine's; scales are float32 scale_inv).
template <typename T, typename Rule>
__global__ void __launch_bounds__(kThreads) cast_kernel(const T* __restrict__ x, int64_t num_groups, int hidden,
                                                        Rule rule, bool use_ue8m0, uint8_t* __restrict__ q,
                                                        void* __restrict__ scales) {
    const int blocks_per_row = hidden / kBlock;
    const int lane = threadIdx.x % kLanesPerBlock;
    // The loop runs per warp (a warp holds 32 / kLanesPerBlock groups) so that every lane reaches the
    // full-mask shuffles in cast_lane; groups past the end compute on zeros and store nothing.
    constexpr int kGroupsPerWarp = 32 / kLanesPerBlock;
    const int group_in_warp = (threadIdx.x % 32) / kLanesPerBlock;
    for (int64_t warp_first = static_cast<int64_t>(blockIdx.x) * kGroupsPerCta + (threadIdx.x / 32) * kGroupsPerWarp;
         warp_first < num_groups; warp_first += static_cast<int64_t>(gridDim.x) * kGroupsPerCta) {
        const int64_t g = warp_first + group_in_warp;
        const bool in_range = g < num_groups;
        const int64_t row = g / blocks_per_row;
        const int block = static_cast<int>(g % blocks_per_row);
        const int64_t offset = row * hidden + static_cast<int64_t>(block) * kBlock + lane * kElemsPerLane;
        float v[kElemsPerLane] = {};
        if (in_range) load_lane(x + offset, v);
        alignas(16) uint8_t out[kElemsPerLane];
        const float scale = cast_lane(v, rule, out);
        if (!in_range) continue;
        *reinterpret_cast<uint4*>(q + offset) = *reinterpret_cast<const uint4*>(out);
        if (lane == 0) {
            if (use_ue8m0) {
                const int words = (blocks_per_row + kUe8m0PerWord - 1) / kUe8m0PerWord;
                static_cast<uint8_t*>(scales)[row * words * kUe8m0PerWord + block] = ue8m0_byte(scale);
            } else {
                static_cast<float*>(scales)[row * blocks_per_row + block] = scale;
            }
        }
    }
}

constexpr int kBackElems = 8;  // cast-back: 8 fp8 bytes in, 16 or 32 bytes out per thread

template <typename T>
__device__ __forceinline__ void store_back(T* dst, const float (&v)[kBackElems]);

template <>
__device__ __forceinline__ void store_back<__nv_bfloat16>(__nv_bfloat16* dst, const float (&v)[kBackElems]) {
    uint4 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(dst) = raw;
}

template <>
__device__ __forceinline__ void store_back<float>(float* dst, const float (&v)[kBackElems]) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) cast_back_kernel(const uint8_t* __restrict__ q,
                                                             const void* __restrict__ scales, bool scales_ue8m0,
                                                             int64_t num_chunks, int hidden, T* __restrict__ out) {
    const int blocks_per_row = hidden / kBlock;
    const int chunks_per_row = hidden / kBackElems;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < num_chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = c / chunks_per_row;
        const int col = static_cast<int>(c % chunks_per_row) * kBackElems;
        const int block = col / kBlock;
        float scale;
        if (scales_ue8m0) {
            const int words = (blocks_per_row + kUe8m0PerWord - 1) / kUe8m0PerWord;
            const unsigned exponent = static_cast<const uint8_t*>(scales)[row * words * kUe8m0PerWord + block];
            scale = __uint_as_float(exponent << 23);
        } else {
            scale = static_cast<const float*>(scales)[row * blocks_per_row + block];
        }
        const uint2 raw = *reinterpret_cast<const uint2*>(q + row * hidden + col);
        const __nv_fp8_storage_t* bytes = reinterpret_cast<const __nv_fp8_storage_t*>(&raw);
        float v[kBackElems];
#pragma unroll
        for (int i = 0; i < kBackElems; ++i)
            v[i] = __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(bytes[i], __NV_E4M3))), scale);
        store_back(out + row * hidden + col, v);
    }
}

int grid_for(int64_t work_items, int per_cta, int num_sms) {
    // Enough CTAs to fill every SM a few times over; the kernels stride over the rest.
    const int64_t needed = (work_items + per_cta - 1) / per_cta;
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, static_cast<int64_t>(num_sms) * 8)));
}

template <typename Rule>
void launch_cast(const void* x, DType x_dtype, int num_tokens, int hidden, Rule rule, bool use_ue8m0, uint8_t* x_fp8,
                 void* scales, int num_sms, cudaStream_t stream) {
    const int64_t groups = static_cast<int64_t>(num_tokens) * (hidden / kBlock);
    if (groups == 0) return;
    const int grid = grid_for(groups, kGroupsPerCta, num_sms);
    switch (x_dtype) {
        case DType::kBFloat16:
            cast_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), groups, hidden, rule,
                                                       use_ue8m0, x_fp8, scales);
            break;
        case DType::kFloat16:
            cast_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(x), groups, hidden, rule, use_ue8m0,
                                                       x_fp8, scales);
            break;
        case DType::kFloat32:
            cast_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), groups, hidden, rule, use_ue8m0,
                                                       x_fp8, scales);
            break;
    }
    MOE_EP_LAUNCH_CHECK("fp8 cast_kernel");
}

}  // namespace

void per_token_cast(const void* x, DType x_dtype, int num_tokens, int hidden, bool round_scale, bool use_ue8m0,
                    uint8_t* x_fp8, void* scales, int num_sms, cudaStream_t stream) {
    launch_cast(x, x_dtype, num_tokens, hidden, round_scale, use_ue8m0, x_fp8, scales, num_sms, stream);
}

void blockwise_cast(const void* x, DType x_dtype, int num_tokens, int hidden, bool pow2_scales, float amax_epsilon,
                    float inf_factor, uint8_t* x_fp8, float* scale_inv, int num_sms, cudaStream_t stream) {
    launch_cast(x, x_dtype, num_tokens, hidden, TeScaling{pow2_scales, amax_epsilon, inf_factor}, false, x_fp8,
                scale_inv, num_sms, stream);
}

void per_token_cast_back(const uint8_t* x_fp8, const void* scales, bool scales_ue8m0, int num_tokens, int hidden,
                         void* out, DType out_dtype, int num_sms, cudaStream_t stream) {
    const int64_t chunks = static_cast<int64_t>(num_tokens) * (hidden / kBackElems);
    if (chunks == 0) return;
    const int grid = grid_for(chunks, kThreads, num_sms);
    if (out_dtype == DType::kFloat32)
        cast_back_kernel<<<grid, kThreads, 0, stream>>>(x_fp8, scales, scales_ue8m0, chunks, hidden,
                                                        static_cast<float*>(out));
    else
        cast_back_kernel<<<grid, kThreads, 0, stream>>>(x_fp8, scales, scales_ue8m0, chunks, hidden,
                                                        static_cast<__nv_bfloat16*>(out));
    MOE_EP_LAUNCH_CHECK("fp8 cast_back_kernel");
}

}  // namespace fp8
}  // namespace moe_ep
