// Buffer.stats()'s device-side counters for low-latency calls: one launch per call, where the same counts
// in torch ops took two dozen small kernels.
#include <algorithm>

#include "api.cuh"
#include "cuda_check.cuh"

namespace moe_ep {
namespace traffic {
namespace {

constexpr int kThreads = 512;
// Enough blocks to read [local experts, R x max] source slots quickly; their per-rank sums meet in atomics.
constexpr int kMaxBlocks = 32;

__global__ void __launch_bounds__(kThreads) count_low_latency_kernel(
    const int64_t* __restrict__ topk_idx, int64_t num_picks, int experts_per_rank, const int* __restrict__ recv_src_info,
    const int* __restrict__ recv_count, int num_local, int64_t slots, int num_topk, int max_tokens, int num_ranks,
    bool combine, int64_t row_bytes, unsigned long long* __restrict__ acc, int64_t* __restrict__ expert_last) {
    extern __shared__ int rows[];  // [sent by the dispatch to each rank | received by it from each rank]
    for (int i = threadIdx.x; i < 2 * num_ranks; i += blockDim.x) rows[i] = 0;
    __syncthreads();
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t num_experts = static_cast<int64_t>(experts_per_rank) * num_ranks;
    for (int64_t i = first; i < num_picks; i += stride) {  // a row per (token, expert) pick; -1: none
        // Ids past the experts (unchecked without MOE_EP_DEBUG) travel nowhere, as in the send kernel.
        const int64_t expert = topk_idx[i];
        if (expert >= 0 && expert < num_experts) atomicAdd(&rows[expert / experts_per_rank], 1);
    }
    const int64_t all_slots = static_cast<int64_t>(num_local) * slots;
    for (int64_t i = first; i < all_slots; i += stride) {  // each expert's first recv_count slots hold rows
        if (i % slots < recv_count[i / slots])
            atomicAdd(&rows[num_ranks + recv_src_info[i] / num_topk / max_tokens], 1);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * num_ranks; i += blockDim.x) {
        if (rows[i] == 0) continue;
        // A combine's rows go back the way its dispatch's came: sent where they were received.
        const bool sent = (i < num_ranks) != combine;
        atomicAdd(&acc[(sent ? 0 : num_ranks) + i % num_ranks], static_cast<unsigned long long>(rows[i] * row_bytes));
    }
    if (!combine && blockIdx.x == 0) {
        for (int local = threadIdx.x; local < num_local; local += blockDim.x) {
            expert_last[local] = recv_count[local];
            atomicAdd(&acc[2 * num_ranks + local], static_cast<unsigned long long>(recv_count[local]));
        }
    }
}

}  // namespace

void count_low_latency(const int64_t* topk_idx, int64_t num_picks, int experts_per_rank, const int* recv_src_info,
                       const int* recv_count, int num_local, int64_t slots, int num_topk, int max_tokens,
                       int num_ranks, bool combine, int64_t row_bytes, int64_t* acc, int64_t* expert_last,
                       cudaStream_t stream) {
    const int64_t work = std::max(num_picks, static_cast<int64_t>(num_local) * slots);
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
    count_low_latency_kernel<<<blocks, kThreads, 2 * num_ranks * sizeof(int), stream>>>(
        topk_idx, num_picks, experts_per_rank, recv_src_info, recv_count, num_local, slots, num_topk, max_tokens,
        num_ranks, combine, row_bytes, reinterpret_cast<unsigned long long*>(acc), expert_last);
    MOE_EP_LAUNCH_CHECK("traffic count_low_latency_kernel");
}

}  // namespace traffic
}  // namespace moe_ep
