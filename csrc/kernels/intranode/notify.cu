// The count exchange ahead of a fresh dispatch: every rank's tokens per rank and expert reach every
// peer, and each rank learns where its received rows go.
#include <cub/block/block_scan.cuh>

#include <stdexcept>
#include <string>

#include "../cuda_check.cuh"
#include "common.cuh"

namespace moe_ep {
namespace intranode {
namespace {

constexpr int kNotifyThreads = 512;
constexpr int kScanItems = 4;

// Block d scans column d of is_token_in_rank and sends this rank's counts to rank d; the last block to
// finish waits for every rank's counts and sums them up. One block waits, not R: where ranks share a GPU,
// R waiting blocks a rank (64 in all at 8 ranks) hold SMs a late peer's GEMMs may need (as rendezvous.cu says).
__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(Ctx c, const bool* __restrict__ in_rank, int num_tokens,
                                                                const int* __restrict__ tokens_per_rank,
                                                                const int* __restrict__ tokens_per_expert,
                                                                int num_experts, int* __restrict__ send_pos,
                                                                int* __restrict__ recv_info, int nonce) {
    using Scan = cub::BlockScan<int, kNotifyThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int carry;
    const Env e = make_env(c, kKernelNotify);
    const int R = e.num_ranks, d = blockIdx.x, local = num_experts / R, row_ints = counts_row_ints(R, num_experts);
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int base = 0; base < num_tokens; base += kNotifyThreads * kScanItems) {
        int flags[kScanItems], count = 0;
#pragma unroll
        for (int i = 0; i < kScanItems; ++i) {
            const int t = base + threadIdx.x * kScanItems + i;
            flags[i] = t < num_tokens && in_rank[static_cast<int64_t>(t) * R + d];
            count += flags[i];
        }
        int before, block_total;
        Scan(scan_storage).ExclusiveSum(count, before, block_total);
        before += carry;
#pragma unroll
        for (int i = 0; i < kScanItems; ++i) {
            const int t = base + threadIdx.x * kScanItems + i;
            if (t < num_tokens) send_pos[static_cast<int64_t>(t) * R + d] = flags[i] ? before : -1;
            before += flags[i];
        }
        __syncthreads();
        if (threadIdx.x == 0) carry += block_total;
        __syncthreads();
    }
    // Our row in rank d's counts area: [tokens, tokens for d, tokens for each rank, counts of d's experts].
    int* row = reinterpret_cast<int*>(e.buffers[d] + signal_bytes(R)) + e.rank * row_ints;
    for (int i = threadIdx.x; i < R; i += blockDim.x) row[kCountsPerRankAt + i] = tokens_per_rank[i];
    for (int i = threadIdx.x; i < local; i += blockDim.x) row[kCountsPerRankAt + R + i] = tokens_per_expert[d * local + i];
    if (threadIdx.x == 0) {
        row[0] = num_tokens;
        row[1] = carry;
        e.host[kHostCounts + R + d] = carry;
    }
    __syncthreads();
    if (threadIdx.x == 0) raise_flag(e.peer_array(d, kNotifyFrom, e.rank), tag(e.seq, 0));
    __shared__ bool last;
    if (threadIdx.x == 0) last = arrive_last(e.own(kNotifyCount), gridDim.x);
    __syncthreads();
    if (!last) return;
    if (!block_wait(e, kNotifyFrom, 0, R, tag(e.seq, 0), kErrNotify, 0)) {
        if (threadIdx.x == 0) end_of_kernel(e);
        return;
    }
    const int* counts = reinterpret_cast<const int*>(e.buffers[e.rank] + signal_bytes(R));
    if (threadIdx.x == 0) {
        int total = 0, max_tokens = 0;
        for (int s = 0; s < R; ++s) {
            const int tokens = __ldcg(counts + s * row_ints), rows = __ldcg(counts + s * row_ints + 1);
            recv_info[2 + s] = total;
            recv_info[3 + R + s] = tokens;
            e.host[kHostCounts + s] = rows;
            total += rows;
            max_tokens = max(max_tokens, tokens);
        }
        recv_info[2 + R] = total;
        recv_info[0] = max_tokens;
        recv_info[1] = total;
        e.host[kHostTotal] = total;
        e.host[kHostMaxTokens] = max_tokens;
    }
    for (int i = threadIdx.x; i < local; i += blockDim.x) {
        int sum = 0;
        for (int s = 0; s < R; ++s) sum += __ldcg(counts + s * row_ints + kCountsPerRankAt + R + i);
        e.host[kHostCounts + 2 * R + i] = sum;
    }
    // The rank prefix matrix (every source's tokens for every rank, summed over the sources up to it),
    // and where this rank's rows start at each peer r (the one-pass kernels write and read them there):
    // the tokens r's sources before this rank send it.
    int* prefix = recv_info + recv_info_prefix_matrix(R);
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int sum = 0;
        for (int s = 0; s < R; ++s) {
            if (s == e.rank) recv_info[3 + 2 * R + r] = sum;
            sum += __ldcg(counts + s * row_ints + kCountsPerRankAt + r);
            prefix[s * R + r] = sum;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        reinterpret_cast<volatile int*>(e.host)[kHostDone] = nonce;
        end_of_kernel(e);
    }
}

}  // namespace

void notify(const Ctx& ctx, const bool* is_token_in_rank, int num_tokens, const int* num_tokens_per_rank,
            const int* num_tokens_per_expert, int num_experts, int* send_pos, int* recv_info, int nonce) {
    if (num_experts > kMaxExperts)
        throw std::runtime_error("moe_ep: intranode dispatch supports at most " + std::to_string(kMaxExperts) +
                                 " experts, got " + std::to_string(num_experts));
    notify_kernel<<<ctx.num_ranks, kNotifyThreads, 0, ctx.stream>>>(ctx, is_token_in_rank, num_tokens,
                                                                     num_tokens_per_rank, num_tokens_per_expert,
                                                                     num_experts, send_pos, recv_info, nonce);
    MOE_EP_LAUNCH_CHECK("intranode notify_kernel");
}

}  // namespace intranode
}  // namespace moe_ep
