// What the intranode combines (windowed and streaming: combine.cu; zero-copy: zero_copy_combine.cu)
// share: a token's rows summed in rank order in float32 (the portable backend's bits), the limits on
// their rows, and their launch for the rows' element type.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>

#include "../api.cuh"
#include "common.cuh"
#include "launch.cuh"

namespace moe_ep {
namespace intranode {

constexpr int kChunks = 2;  // vectors of each rank's row a lane loads in one pass of sum_token

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
template <typename T>
__device__ __forceinline__ T from_float(float v) {
    if constexpr (sizeof(T) == 2) return __float2bfloat16_rn(v);
    else return v;
}

// acc[i] += element i of the vector v of T.
template <typename T, typename V>
__device__ __forceinline__ void add_to(float* acc, const V& v) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(T)); ++i) acc[i] += to_float(e[i]);
}
template <typename T, typename V>
__device__ __forceinline__ V pack(const float* acc) {
    V v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(T)); ++i) e[i] = from_float<T>(acc[i]);
    return v;
}

// Token t's combined row, vectors [begin, end) of it: bias0, bias1, then the row of every rank in
// `sent`, ascending, in float32 (the portable backend's order, so the same bits); row_of(r) is where
// rank r's row is (warp-uniform calls). kChunks vectors per lane and up to S::kCombineBatch ranks
// each: their loads are all in flight together, then summed per vector in rank order. With
// `with_weights` (and out_weights given) also out_weights[t] = the sum of the ranks' top-k weights,
// rank r's at weights_of(r) (warp-uniform calls too).
template <typename T, typename V, typename S, typename RowOf, typename WeightsOf>
__device__ void sum_token(const CombineArgs& a, int64_t t, int64_t chunks, int64_t begin, int64_t end, uint64_t sent,
                          RowOf row_of, WeightsOf weights_of, bool with_weights, int lane) {
    constexpr int kElems = sizeof(V) / sizeof(T);
    // Every lane makes the same trips, also past the row's end: row_of may shuffle (the streaming
    // combine's does), and a shuffle that a finished lane never joins waits forever, deadline or not.
    for (int64_t trip = begin; trip < end; trip += 32 * kChunks) {
        const int64_t chunk0 = trip + lane;
        float acc[kChunks][kElems];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            const int64_t chunk = chunk0 + c * 32;
#pragma unroll
            for (int v = 0; v < kElems; ++v) acc[c][v] = 0.f;
            if (chunk < end) {
                if (a.bias0 != nullptr) add_to<T>(acc[c], __ldg(static_cast<const V*>(a.bias0) + t * chunks + chunk));
                if (a.bias1 != nullptr) add_to<T>(acc[c], __ldg(static_cast<const V*>(a.bias1) + t * chunks + chunk));
            }
        }
        for (uint64_t rest = sent; rest != 0;) {
            V vals[S::kCombineBatch][kChunks];
            int loaded = 0;
#pragma unroll
            for (int j = 0; j < S::kCombineBatch; ++j) {
                if (rest != 0) {
                    const int r = __ffsll(static_cast<long long>(rest)) - 1;
                    rest &= rest - 1;
                    const V* slot = reinterpret_cast<const V*>(row_of(r));
#pragma unroll
                    for (int c = 0; c < kChunks; ++c)
                        if (chunk0 + c * 32 < end) vals[j][c] = __ldcg(slot + chunk0 + c * 32);
                    loaded = j + 1;
                }
            }
#pragma unroll
            for (int j = 0; j < S::kCombineBatch; ++j)
#pragma unroll
                for (int c = 0; c < kChunks; ++c)
                    if (j < loaded && chunk0 + c * 32 < end) add_to<T>(acc[c], vals[j][c]);
        }
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            if (chunk0 + c * 32 < end) static_cast<V*>(a.out)[t * chunks + chunk0 + c * 32] = pack<T, V>(acc[c]);
    }
    if (a.out_weights != nullptr && with_weights) {
        const int K = a.num_topk;
        for (int k0 = 0; k0 < K; k0 += 32) {  // every lane walks the ranks: weights_of may shuffle
            const int k = k0 + lane;
            float acc = 0.f;
            for (uint64_t rest = sent; rest != 0; rest &= rest - 1) {
                const float* weights = weights_of(__ffsll(static_cast<long long>(rest)) - 1);
                if (k < K) acc += __ldcg(weights + k);
            }
            if (k < K) a.out_weights[t * K + k] = acc;
        }
    }
}

// Bytes per row of a combine's x, once the limits both combines share hold: a 64-bit mask of senders
// per token, and rows of whole 8-byte vectors.
inline int64_t combine_row_bytes(const Ctx& ctx, const CombineArgs& args) {
    if (ctx.num_ranks > kMaxRanks) throw std::runtime_error("moe_ep: intranode combine supports at most 64 ranks");
    const int64_t x_bytes = static_cast<int64_t>(args.hidden) * (args.dtype == DType::kFloat32 ? 4 : 2);
    if (x_bytes % 8 != 0) throw std::runtime_error("moe_ep: intranode combine needs rows of a multiple of 8 bytes");
    return x_bytes;
}

// Launches Kernels<T, V>::Of for the rows' element type T (bfloat16 or float32) and vector V (16 bytes
// when every row starts 16-byte aligned, else 8).
template <template <typename, typename> class Kernels, typename... Args>
void launch_for_rows(const Ctx& ctx, const char* what, DType dtype, bool wide, Args... args) {
    if (dtype == DType::kBFloat16 && wide)
        launch_shaped<Kernels<__nv_bfloat16, int4>::template Of>(ctx, what, args...);
    else if (dtype == DType::kBFloat16)
        launch_shaped<Kernels<__nv_bfloat16, int2>::template Of>(ctx, what, args...);
    else if (dtype == DType::kFloat32 && wide)
        launch_shaped<Kernels<float, int4>::template Of>(ctx, what, args...);
    else if (dtype == DType::kFloat32)
        launch_shaped<Kernels<float, int2>::template Of>(ctx, what, args...);
    else
        throw std::runtime_error("moe_ep: intranode combine takes bfloat16 or float32 rows");
}

}  // namespace intranode
}  // namespace moe_ep
