// The arithmetic of one 1x128 FP8 block, shared by the cast kernels (fp8.cu) and the low-latency
// dispatch (low_latency.cu), so that both are bitwise equal to moe_ep/fp8.py: float32 amax (floored);
// scale = amax / 448 and inverse = 448 / amax, or the scale rounded up to a power of two and
// inverse = 1 / scale; each element times the inverse, round-to-nearest-even e4m3 with saturation.
// transformer-engine's rule (te_block_factor) is the other one the cast kernel offers, bitwise equal
// to moe_ep/fp8_blockwise.py. Explicit _rn intrinsics keep the compiler from fusing or approximating.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "api.cuh"

namespace moe_ep {
namespace fp8 {

// Smallest power of two >= scale (scale is a positive normal float here).
__device__ __forceinline__ float round_up_to_power_of_two(float scale) {
    const unsigned bits = __float_as_uint(scale);
    return (bits & 0x7FFFFFu) ? __uint_as_float((bits & 0x7F800000u) + 0x800000u) : scale;
}

// amax: the block's largest |element| -> its scale and the factor every element is multiplied by.
__device__ __forceinline__ void block_scale(float amax, bool round_scale, float& scale, float& inverse) {
    amax = fmaxf(amax, kAmaxFloor);
    scale = __fdiv_rn(amax, kE4M3Max);
    inverse = __fdiv_rn(kE4M3Max, amax);
    if (round_scale) {
        scale = round_up_to_power_of_two(scale);
        inverse = __fdiv_rn(1.f, scale);
    }
}

// transformer-engine's 1D-block quantizer: factor = 448 / max(amax, amax_epsilon), its mantissa cleared
// when scales are powers of two, an infinite factor replaced by inf_factor (which depends on the input
// dtype, so the host passes it), a zero block scaled by 1.
struct TeScaling {
    bool pow2;
    float amax_epsilon;
    float inf_factor;
};

__device__ __forceinline__ float te_block_factor(float amax, const TeScaling& rule) {
    if (rule.amax_epsilon > 0.f) amax = fmaxf(amax, rule.amax_epsilon);
    float factor = __fdiv_rn(kE4M3Max, amax);
    if (rule.pow2 && isfinite(factor) && factor != 0.f) factor = __uint_as_float(__float_as_uint(factor) & 0xFF800000u);
    if (isinf(factor)) factor = rule.inf_factor;
    return amax == 0.f ? 1.f : factor;
}

__device__ __forceinline__ uint8_t to_e4m3(float value, float inverse) {
    return __nv_cvt_float_to_fp8(__fmul_rn(value, inverse), __NV_SATFINITE, __NV_E4M3);
}

// UE8M0 keeps the biased exponent of a power-of-two scale, four blocks to an int32.
constexpr int kUe8m0PerWord = 4;
__device__ __forceinline__ uint8_t ue8m0_byte(float scale) { return static_cast<uint8_t>((__float_as_uint(scale) >> 23) & 0xFFu); }

// Each lane takes 16 elements of a block (two 16-byte loads of bf16 in flight, one 16-byte fp8
// store), so eight lanes share one 128-column block and reduce its amax with three shuffles.
constexpr int kElemsPerLane = 16;
constexpr int kLanesPerBlock = kBlock / kElemsPerLane;

// One lane's 16 consecutive elements of bf16, fp16 or float32, as floats.
template <typename T>
__device__ __forceinline__ void load_lane(const T* src, float (&v)[kElemsPerLane]) {
    if constexpr (std::is_same_v<T, float>) {
        float4 raw[kElemsPerLane / 4];
#pragma unroll
        for (int c = 0; c < kElemsPerLane / 4; ++c) raw[c] = reinterpret_cast<const float4*>(src)[c];
#pragma unroll
        for (int c = 0; c < kElemsPerLane / 4; ++c)
            v[4 * c] = raw[c].x, v[4 * c + 1] = raw[c].y, v[4 * c + 2] = raw[c].z, v[4 * c + 3] = raw[c].w;
    } else {
        using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
        uint4 raw[kElemsPerLane / 8];
#pragma unroll
        for (int c = 0; c < kElemsPerLane / 8; ++c) raw[c] = reinterpret_cast<const uint4*>(src)[c];
        const Pair* pairs = reinterpret_cast<const Pair*>(raw);
#pragma unroll
        for (int i = 0; i < kElemsPerLane / 2; ++i) {
            float2 f;
            if constexpr (std::is_same_v<T, __half>) f = __half22float2(pairs[i]);
            else f = __bfloat1622float2(pairs[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
    }
}

// The block's amax over its eight lanes (all 32 lanes of the warp call this).
__device__ __forceinline__ float block_amax(const float (&v)[kElemsPerLane]) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kElemsPerLane; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int mask = kLanesPerBlock / 2; mask > 0; mask >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, mask));
    return amax;
}

// One lane's part of a block: the block's scale, and the lane's 16 e4m3 values.
__device__ __forceinline__ float cast_lane(const float (&v)[kElemsPerLane], bool round_scale,
                                           uint8_t (&out)[kElemsPerLane]) {
    float scale, inverse;
    block_scale(block_amax(v), round_scale, scale, inverse);
#pragma unroll
    for (int i = 0; i < kElemsPerLane; ++i) out[i] = to_e4m3(v[i], inverse);
    return scale;
}

// The same under transformer-engine's rule: returns the block's scale_inv = 1 / factor.
__device__ __forceinline__ float cast_lane(const float (&v)[kElemsPerLane], const TeScaling& rule,
                                           uint8_t (&out)[kElemsPerLane]) {
    const float factor = te_block_factor(block_amax(v), rule);
#pragma unroll
    for (int i = 0; i < kElemsPerLane; ++i) out[i] = to_e4m3(v[i], factor);
    return __fdiv_rn(1.f, factor);
}

}  // namespace fp8
}  // namespace moe_ep
