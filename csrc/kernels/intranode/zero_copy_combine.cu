// The one-pass intranode combine: every rank sums its tokens' rows where its peers' rows already lie
// (their zero-copy areas, or the dispatch arena).
#include <stdexcept>

#include "combine_common.cuh"
#include "common.cuh"
#include "launch.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// Every rank's rows already lie in its arena, where its caller put them: one pass. Each rank puts its
// rows' weights beside them, announces to every peer where both are (the layout slots a one-pass
// dispatch uses: that dispatch read them before its rows were in place) or that it has no room, and
// waits for every peer's announcement. Where any rank has no room, all return and the two-pass combine
// queued behind runs (PathChoice); else each rank sums its tokens' rows where they lie, in rank order
// (the windowed combine's bits). x is the caller's tensor, free to reuse once the call is over, so the
// call ends only when every peer has read this rank's rows: the last block to finish its sums tells
// every peer, then waits for all of them.
template <typename T, typename V, typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    zero_copy_combine_kernel(Ctx c, CombineArgs a, ZeroCopyArgs z) {
    const Env e = make_env(c, kKernelZeroCopyCombine);
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32;
    const Warps warps = grid_warps<S::kWarps>();
    const int64_t x_bytes = static_cast<int64_t>(a.hidden) * sizeof(T);
    const int64_t chunks = x_bytes / sizeof(V);
    const int total = min(static_cast<int64_t>(a.recv_info[1]), max(z.capacity_rows, int64_t{0}));
    const int* first_row_at = a.recv_info + 3 + 2 * R;  // this rank's first row at each peer
    bool ok = load_volatile(e.own(kAbort)) == 0;
    if (ok && a.topk_weights != nullptr && z.capacity_rows >= 0) {
        float* weights = reinterpret_cast<float*>(z.areas[me] + z.weights_offset);
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < static_cast<int64_t>(total) * K;
             i += static_cast<int64_t>(gridDim.x) * blockDim.x)
            weights[i] = a.topk_weights[i];
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kPushCount), gridDim.x))
        for (int r = 0; r < R; ++r) {
            int64_t* layout = reinterpret_cast<int64_t*>(e.signals(r) + layout_index(R, me, 0));
            layout[kCombineRows] = z.slot_offset, layout[kCombineCapacity] = z.capacity_rows;
            layout[kCombinePitch] = z.pitch, layout[kCombineWeights] = z.weights_offset;
            raise_flag(e.peer_array(r, kZeroCopyReadyFrom, me), tag(e.seq, 0));  // fences the layout first
        }
    ok = ok && block_wait(e, kZeroCopyReadyFrom, 0, R, tag(e.seq, 0), kErrPushed, 0);
    // Where every rank's rows are, as it announced them.
    __shared__ int64_t from_rows[kMaxRanks], from_capacity[kMaxRanks], from_pitch[kMaxRanks], from_weights[kMaxRanks];
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int64_t* layout = reinterpret_cast<const int64_t*>(e.own(layout_index(R, r, 0)));
        from_rows[r] = __ldcg(layout + kCombineRows), from_capacity[r] = __ldcg(layout + kCombineCapacity);
        from_pitch[r] = __ldcg(layout + kCombinePitch), from_weights[r] = __ldcg(layout + kCombineWeights);
    }
    __syncthreads();
    bool room = true;
    for (int r = 0; r < R; ++r) room = room && from_capacity[r] >= 0;
    record_choice(e, z.path, ok && room);
    ok = ok && room;
    if (ok) {
        for (int64_t t = warps.warp; t < a.num_tokens; t += warps.num_warps) {
            uint64_t sent = 0;
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                // A row past a region's capacity was never received (num_worst_tokens too small: that
                // dispatch reported it); it counts as not sent rather than read out of bounds.
                const bool here = r < R && a.send_pos[t * R + r] >= 0 &&
                                  first_row_at[r] + a.send_pos[t * R + r] < from_capacity[r];
                sent |= static_cast<uint64_t>(__ballot_sync(kFullMask, here)) << r0;
            }
            const auto row_index = [&](int r) { return static_cast<int64_t>(first_row_at[r] + a.send_pos[t * R + r]); };
            const auto row_of = [&](int r) { return z.areas[r] + from_rows[r] + row_index(r) * from_pitch[r]; };
            const auto weights_of = [&](int r) {
                return reinterpret_cast<const float*>(z.areas[r] + from_weights[r] + row_index(r) * K * 4);
            };
            sum_token<T, V, S>(a, t, chunks, 0, chunks, sent, row_of, weights_of, true, lane);
        }
    }
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        last = ok && arrive_last(e.own(kReduceCount), gridDim.x);
        if (last)
            for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kPushedFrom, me), tag(e.seq, 1));
    }
    __syncthreads();
    if (last) block_wait(e, kPushedFrom, 0, R, tag(e.seq, 1), kErrReleased, 0);
    finish_kernel(e, e.own(kDoneCount));
}

template <typename T, typename V>
struct ZeroCopyCombineKernels {
    template <typename S>
    struct Of {
        static constexpr auto fn = zero_copy_combine_kernel<T, V, S>;
    };
};

}  // namespace

void zero_copy_combine(const Ctx& ctx, const CombineArgs& args, const ZeroCopyArgs& z) {
    const int64_t x_bytes = combine_row_bytes(ctx, args);
    launch_for_rows<ZeroCopyCombineKernels>(ctx, "intranode zero_copy_combine_kernel", args.dtype, x_bytes % 16 == 0, args, z);
}

}  // namespace intranode
}  // namespace moe_ep
