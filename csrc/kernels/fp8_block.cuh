// The arithmetic of one 1x128 FP8 block, shared by the cast kernels (fp8.cu) and the low-latency
// dispatch (low_latency.cu), so that both are bitwise equal to moe_ep/fp8.py: float32 amax (floored);
// scale = amax / 448 and inverse = 448 / amax, or the scale rounded up to a power of two and
// inverse = 1 / scale; each element times the inverse, round-to-nearest-even e4m3 with saturation.
// Explicit _rn intrinsics keep the compiler from fusing or approximating.
#pragma once

#include <cuda_fp8.h>

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

__device__ __forceinline__ uint8_t to_e4m3(float value, float inverse) {
    return __nv_cvt_float_to_fp8(__fmul_rn(value, inverse), __NV_SATFINITE, __NV_E4M3);
}

// UE8M0 keeps the biased exponent of a power-of-two scale, four blocks to an int32.
constexpr int kUe8m0PerWord = 4;
__device__ __forceinline__ uint8_t ue8m0_byte(float scale) { return static_cast<uint8_t>((__float_as_uint(scale) >> 23) & 0xFFu); }

}  // namespace fp8
}  // namespace moe_ep
