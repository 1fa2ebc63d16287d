// The one-pass intranode dispatch: every rank writes its rows straight into each receiver's zero-copy
// area or dispatch arena region, at their final rows.
#include <cstdint>
#include <stdexcept>

#include "common.cuh"
#include "launch.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// One trip of a row copy: vectors [base, base + 32 x kDepth) of it, lane-strided, predicated at the end.
template <int kDepth>
__device__ __forceinline__ void load_trip(int4 (&v)[kDepth], const int4* from, int64_t base, int64_t vectors, int lane) {
    const int64_t left = vectors - base - lane;
    const int4* in = from + base + lane;  // constant offsets from one address fold into the instructions
#pragma unroll
    for (int j = 0; j < kDepth; ++j)
        if (j * 32 < left) v[j] = __ldg(in + j * 32);
}
template <int kDepth>
__device__ __forceinline__ void store_trip(const int4 (&v)[kDepth], uint8_t* dst, unsigned to, int64_t base,
                                           int64_t vectors, int lane) {
    const int64_t left = vectors - base - lane;
    for (unsigned rest = to; rest != 0; rest &= rest - 1) {
        int4* out = reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(dst), __ffs(rest) - 1)) + base + lane;
#pragma unroll
        for (int j = 0; j < kDepth; ++j)
            if (j * 32 < left) __stcs(out + j * 32, v[j]);  // evict-first: never read back here
    }
}

// A warp stores one row into every destination of `to` (lane j of the mask holds destination j's
// address in `dst`), reading each vector of the source once: a token sent to several ranks costs one
// read. All lanes make the same trips (the destinations come by shuffle), and the last trip loads all
// of a lane's remaining vectors at once (predicated).
// kWide: `bytes`, src and every destination are 16-byte aligned (the kernel's launch checks the row
// sizes; the bases are aligned); otherwise one copy per destination.
template <bool kWide, int kDepth>
__device__ __forceinline__ void warp_copy_to_all(uint8_t* dst, unsigned to, const uint8_t* src, int64_t bytes, int lane) {
    if constexpr (!kWide) {
        for (unsigned rest = to; rest != 0; rest &= rest - 1)
            warp_copy<Src::kReadOnly, 2>(reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(dst), __ffs(rest) - 1)),
                                         src, bytes, lane);
        return;
    }
    // Two register buffers of half the depth: the next trip's loads are in flight while this trip's
    // stores issue, so the memory system never waits for the warp between trips.
    constexpr int kHalf = kDepth / 2;
    constexpr int64_t kStep = kHalf * 32;
    const int4* from = reinterpret_cast<const int4*>(src);
    const int64_t vectors = bytes / 16;
    int4 a[kHalf], b[kHalf];
    load_trip(a, from, 0, vectors, lane);
    for (int64_t base = 0; base < vectors; base += 2 * kStep) {
        if (base + kStep < vectors) load_trip(b, from, base + kStep, vectors, lane);
        store_trip(a, dst, to, base, vectors, lane);
        if (base + 2 * kStep < vectors) load_trip(a, from, base + 2 * kStep, vectors, lane);
        if (base + kStep < vectors) store_trip(b, dst, to, base + kStep, vectors, lane);
    }
}

// One pass: every rank stores its tokens' rows, scales, local top-k and source index straight into
// the receivers' arena regions at their final rows (the receiver's rows from source s start at s's
// first_row_at, in token order: the portable order). Three steps:
//  1. announce the call to every peer, with this rank's receiving layout (its region: laid out by the
//     host, or here for the rows the count exchange brings; capacity -1 where it has no room), and
//     wait for every peer's announcement. Every rank makes the same choice from them (PathChoice):
//     where any rank has no room, all return and the two-pass kernel queued behind runs. A region is
//     free to write once its receiver announced it (the host hands out only free regions);
//  2. store; the last block announces to every peer that this rank's rows are in place;
//  3. wait for every peer's rows, then copy ids, weights and source tokens out of this rank's region
//     into the outputs (recv_x and the scales are the region itself) and fill num_worst_tokens padding.
template <typename S, bool kWide>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    zero_copy_dispatch_kernel(Ctx c, DispatchArgs a, ZeroCopyDispatchArgs z) {
    const Env e = make_env(c, kKernelZeroCopyDispatch);
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32;
    const Warps warps = grid_warps<S::kWarps>();
    const int* first_row_at = a.recv_info + 3 + 2 * R;
    // Loads in flight per lane: 16 in the 128-register shape, so that an fp8 row of 7168 (14 vectors
    // per lane) is one trip.
    constexpr int kDepth = S::kRegisters >= 128 ? 16 : 6;
    // Scales of up to 32 vectors travel in registers, one vector per lane, loaded before the row so
    // that their latency hides behind it (a separate copy after the row cost a latency per token).
    const int scale_vectors = static_cast<int>(a.scale_bytes / 16);
    const bool scales_with_row = kWide && a.scale_bytes > 0 && scale_vectors <= 32;
    // This rank's receiving layout: the host's, or a region laid out here for the rows the count
    // exchange announced (the same formula as the host's once it knows them).
    ZeroCopyDispatchArgs receiving = z;
    if (z.region_bytes >= 0) {
        const int64_t rows = a.recv_info[1];
        const DispatchRegion d = dispatch_region(rows, a.x_bytes, a.scale_bytes, K);
        receiving.capacity_rows = d.bytes <= z.region_bytes ? rows : -1;
        receiving.x_offset = d.x, receiving.scale_offset = d.scale, receiving.idx_offset = d.idx;
        receiving.weight_offset = d.weight, receiving.src_offset = d.src;
    }
    bool ok = load_volatile(e.own(kAbort)) == 0;
    if (ok && blockIdx.x == 0) {
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            int64_t* layout = reinterpret_cast<int64_t*>(e.signals(r) + layout_index(R, me, 0));
            const int64_t mine[kLayoutFields] = {receiving.slot_offset, receiving.capacity_rows, receiving.x_offset,
                                                 receiving.scale_offset, receiving.idx_offset, receiving.weight_offset,
                                                 receiving.src_offset};
            for (int f = 0; f < kLayoutFields; ++f) layout[f] = mine[f];
            raise_flag(e.peer_array(r, kZeroCopyReadyFrom, me), tag(e.seq, 0));  // fences the layout first
        }
    }
    ok = ok && block_wait(e, kZeroCopyReadyFrom, 0, R, tag(e.seq, 0), kErrNotify, 0);
    // Every receiver's layout, as it stored it here before its announcement.
    __shared__ int64_t to_slot[kMaxRanks], to_capacity[kMaxRanks], to_x[kMaxRanks], to_scale[kMaxRanks];
    __shared__ int64_t to_idx[kMaxRanks], to_weight[kMaxRanks], to_src[kMaxRanks];
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int64_t* layout = reinterpret_cast<const int64_t*>(e.own(layout_index(R, r, 0)));
        to_slot[r] = __ldcg(layout + kLayoutSlot), to_capacity[r] = __ldcg(layout + kLayoutCapacity);
        to_x[r] = __ldcg(layout + kLayoutX), to_scale[r] = __ldcg(layout + kLayoutScale);
        to_idx[r] = __ldcg(layout + kLayoutIdx), to_weight[r] = __ldcg(layout + kLayoutWeight);
        to_src[r] = __ldcg(layout + kLayoutSrc);
    }
    __syncthreads();
    bool room = true;
    for (int r = 0; r < R; ++r) room = room && to_capacity[r] >= 0;
    record_choice(e, z.path, ok && room);
    ok = ok && room;
    // Wait profile phases: "stage" = the announcement, "pull" = the stores, "reduce" = the copy out.
    uint64_t since = end_phase(e, kPhaseStage, e.start);
    if (ok) {
        for (int64_t t = warps.warp; t < a.num_tokens; t += warps.num_warps) {
            int64_t expert = -1;
            float weight = 0.f;
            if (a.topk_idx != nullptr && lane < K) {
                expert = __ldg(a.topk_idx + t * K + lane);
                weight = __ldg(a.topk_weights + t * K + lane);
            }
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                // A row past the receiver's capacity is dropped; the receiver reports the overflow.
                int64_t row = -1;
                if (r < R) {
                    const int p = __ldg(a.send_pos + t * R + r);
                    if (p >= 0 && first_row_at[r] + p < to_capacity[r]) row = first_row_at[r] + p;
                }
                const unsigned to = __ballot_sync(kFullMask, row >= 0);
                if (to == 0) continue;
                uint8_t* slot = row >= 0 ? z.areas[r] + to_slot[r] : nullptr;
                uint8_t* scale_dst = row >= 0 ? slot + to_scale[r] + row * a.scale_bytes : nullptr;
                const uint8_t* scale_src = static_cast<const uint8_t*>(a.scales) + t * a.scale_bytes;
                int4 scale{};
                if (scales_with_row && lane < scale_vectors) scale = __ldg(reinterpret_cast<const int4*>(scale_src) + lane);
                warp_copy_to_all<kWide, kDepth>(row >= 0 ? slot + to_x[r] + row * a.x_bytes : nullptr, to,
                                                static_cast<const uint8_t*>(a.x) + t * a.x_bytes, a.x_bytes, lane);
                if (scales_with_row) {
                    for (unsigned rest = to; rest != 0; rest &= rest - 1) {
                        int4* dst = reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(scale_dst), __ffs(rest) - 1));
                        if (lane < scale_vectors) dst[lane] = scale;
                    }
                } else if (a.scale_bytes > 0) {
                    warp_copy_to_all<kWide, kDepth>(scale_dst, to, scale_src, a.scale_bytes, lane);
                }
                for (unsigned rest = to; rest != 0; rest &= rest - 1) {
                    const int j = __ffs(rest) - 1, dest = r0 + j;
                    const int64_t at = __shfl_sync(kFullMask, row, j);
                    uint8_t* dest_slot = z.areas[dest] + to_slot[dest];
                    if (a.topk_idx != nullptr && lane < K) {
                        const int64_t local = expert - static_cast<int64_t>(dest) * a.experts_per_rank;
                        const bool here = expert >= 0 && local >= 0 && local < a.experts_per_rank;
                        reinterpret_cast<int64_t*>(dest_slot + to_idx[dest])[at * K + lane] = here ? local : -1;
                        reinterpret_cast<float*>(dest_slot + to_weight[dest])[at * K + lane] = here ? weight : 0.f;
                    }
                    if (lane == 0) reinterpret_cast<int*>(dest_slot + to_src[dest])[at] = static_cast<int>(t);
                }
            }
        }
    }
    __syncthreads();
    if (ok && threadIdx.x == 0 && arrive_last(e.own(kStageCount), warps.blocks))
        for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kZeroCopyReadyFrom, me), tag(e.seq, 1));
    since = end_phase(e, kPhasePull, since);
    ok = ok && block_wait(e, kZeroCopyReadyFrom, 0, R, tag(e.seq, 1), kErrStaged, 0);
    if (ok) {
        const int total = a.recv_info[1];
        // num_recv_rows < 0: the outputs are exactly the received rows (the host did not know the count
        // when it launched this kernel).
        const int64_t rows_out =
            a.num_recv_rows < 0 ? min(static_cast<int64_t>(total), receiving.capacity_rows) : a.num_recv_rows;
        const int64_t kept = min(static_cast<int64_t>(total), min(rows_out, receiving.capacity_rows));
        if (blockIdx.x == 0 && threadIdx.x == 0 && total > kept) reinterpret_cast<volatile int*>(e.host)[kHostOverflow] = total;
        const uint8_t* own = z.areas[me] + receiving.slot_offset;
        const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
        if (a.recv_topk_idx != nullptr) {
            for (int64_t i = thread; i < kept * K; i += threads) {
                a.recv_topk_idx[i] = __ldcg(reinterpret_cast<const long long*>(own + receiving.idx_offset) + i);
                a.recv_topk_weights[i] = __ldcg(reinterpret_cast<const float*>(own + receiving.weight_offset) + i);
            }
        }
        for (int64_t i = thread; i < kept; i += threads)
            a.recv_src_idx[i] = __ldcg(reinterpret_cast<const int*>(own + receiving.src_offset) + i);
        uint8_t* own_slot = z.areas[me] + receiving.slot_offset;
        pad_rows(a, own_slot + receiving.x_offset, own_slot + receiving.scale_offset, kept, rows_out, warps, lane);
    }
    end_phase(e, kPhaseReduce, since);
    finish_kernel(e, e.own(kDoneCount));
}

template <bool kWide>
struct ZeroCopyDispatchKernels {
    template <typename S>
    struct Of {
        static constexpr auto fn = zero_copy_dispatch_kernel<S, kWide>;
    };
};

}  // namespace

void zero_copy_dispatch(const Ctx& ctx, const DispatchArgs& args, const ZeroCopyDispatchArgs& z) {
    if (ctx.num_ranks > kMaxRanks) throw std::runtime_error("moe_ep: intranode dispatch supports at most 64 ranks");
    // Rows and scales of whole 16-byte vectors (x and the areas start aligned): each vector is read
    // once for all destinations.
    const bool wide = args.x_bytes % 16 == 0 && args.scale_bytes % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(args.x) % 16 == 0 && reinterpret_cast<uintptr_t>(args.scales) % 16 == 0 &&
                      z.slot_offset % 16 == 0 && z.x_offset % 16 == 0 && z.scale_offset % 16 == 0;
    if (wide) launch_shaped<ZeroCopyDispatchKernels<true>::Of>(ctx, "intranode zero_copy_dispatch_kernel", args, z);
    else launch_shaped<ZeroCopyDispatchKernels<false>::Of>(ctx, "intranode zero_copy_dispatch_kernel", args, z);
}

}  // namespace intranode
}  // namespace moe_ep
