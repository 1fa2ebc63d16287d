// The two-pass intranode dispatch. Dispatch pulls: every rank stages a window of its tokens once in
// its own buffer (whatever the number of destinations), and every receiver copies the rows meant for it
// straight into its output tensors, at the row the sender computed. Windows alternate between two
// halves of the buffer, so staging window w overlaps the reads of window w - 1; a bounded number of
// windows makes any token count fit any buffer size.
#include <stdexcept>

#include "common.cuh"
#include "launch.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// Whether the two-pass dispatch copies its rows two at a time: in the shapes deep enough for it, and
// for rows that a whole warp copies in under two full trips a lane, so that the last trip runs part
// empty (an fp8 row of 7,168 bytes at depth 12: 12 + 2 vectors a lane, two on half-warps 12 + 12 + 4).
// Longer rows gain little from the fuller trips: bf16 rows in pairs were +4% at 2 ranks and -8% at 4
// (16 blocks) on one H200, where fp8 rows gained 11% and 12% (`moe-ep-bench intranode --ranks 2 4 --sms 24
// --modes dispatch_fp8 dispatch_bf16`, A/B).
template <typename S>
__device__ __forceinline__ bool rows_in_pairs(int64_t row_bytes) {
    return S::kPairs && row_bytes < int64_t{2} * 32 * 16 * S::kCopyDepth;
}

// Output row `row`'s top-k entry k on rank `me`: the expert's local id where it lives there, else -1 with
// a weight of 0 (the portable backend's recv_topk_idx / recv_topk_weights).
__device__ __forceinline__ void store_local_topk(const DispatchArgs& a, int me, int64_t row, int k, int64_t expert,
                                                 float weight) {
    const int64_t lo = static_cast<int64_t>(me) * a.experts_per_rank;
    const bool here = expert >= lo && expert < lo + a.experts_per_rank;
    a.recv_topk_idx[row * a.num_topk + k] = here ? expert - lo : -1;
    a.recv_topk_weights[row * a.num_topk + k] = here ? weight : 0.f;
}

// Stage window w of this rank's tokens in its own buffer (the half of window w - 2, once every rank has
// finished reading it), and copy the tokens meant for this rank straight into its outputs from the same
// registers (the source is read once; no rank pulls its own window); the last block raises every
// rank's staged flag. A token that no peer receives is not staged (its destination entries still are).
template <typename S>
__device__ bool stage_window(const Env& e, const DispatchArgs& a, const DispatchSlot& slot, int window_tokens,
                             const Warps& warps, int w) {
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32;
    const int parity = w & 1, first = w * window_tokens;
    if (w >= 2 && !block_wait(e, kReleasedBy, 0, R, tag(e.seq, w - 2), kErrReleased, w - 2)) return false;
    uint8_t* staged = e.window(me, parity);
    const int count = clamp_count(a.num_tokens, first, window_tokens);
    const bool pairs = rows_in_pairs<S>(a.x_bytes);
    const int64_t own_base = a.recv_info[2 + me];
    auto* recv_x = static_cast<uint8_t*>(a.recv_x);
    auto* recv_scales = static_cast<uint8_t*>(a.recv_scales);
    // A warp takes 32 tokens (spaced by the number of warps, so that all warps have work): each lane
    // writes its token's destination rows, then the warp copies the tokens that go anywhere.
    for (int b = 0; b * warps.num_warps * 32 < count; ++b) {
        const int mine = (b * 32 + lane) * warps.num_warps + warps.warp;
        bool to_peer = false;
        int64_t own_row = -1;  // this token's row in this rank's outputs, or -1
        if (mine < count) {
            int* pos = reinterpret_cast<int*>(staged + mine * slot.bytes + slot.pos_offset);
            for (int r = 0; r < R; ++r) {
                const int p = a.send_pos[(static_cast<int64_t>(first) + mine) * R + r];
                pos[r] = p;
                if (r != me) to_peer |= p >= 0;
                else if (p >= 0) own_row = own_base + p;
            }
            if (own_row >= a.num_recv_rows) {  // num_worst_tokens too small: report, write nothing past it
                reinterpret_cast<volatile int*>(e.host)[kHostOverflow] = a.recv_info[1];
                own_row = -1;
            }
        }
        // Two tokens at a time where rows go in pairs: their row copies share trips (peer::warp_copy_rows).
        for (unsigned todo = __ballot_sync(kFullMask, to_peer || own_row >= 0); todo != 0;) {
            const int l0 = __ffs(todo) - 1;
            todo &= todo - 1;
            const bool two = pairs && todo != 0;
            const int l1 = two ? __ffs(todo) - 1 : l0;
            if (two) todo &= todo - 1;
            const int i0 = (b * 32 + l0) * warps.num_warps + warps.warp, i1 = (b * 32 + l1) * warps.num_warps + warps.warp;
            const bool peer0 = __shfl_sync(kFullMask, to_peer, l0), peer1 = __shfl_sync(kFullMask, to_peer, l1);
            const int64_t own0 = __shfl_sync(kFullMask, own_row, l0), own1 = __shfl_sync(kFullMask, own_row, l1);
            const int64_t t0 = first + i0, t1 = first + i1;
            uint8_t* slot0 = staged + i0 * slot.bytes;
            uint8_t* slot1 = staged + i1 * slot.bytes;
            // A lane's top-k entries: of the token its half-warp copies (the first one's where one token).
            const bool second = two && lane >= 16;
            const int lanes = two ? 16 : 32;
            const int64_t t = second ? t1 : t0, own = second ? own1 : own0;
            uint8_t* meta = second ? slot1 : slot0;
            const bool staging = second ? peer1 : peer0;
            for (int k = two ? lane % 16 : lane; k < K; k += lanes) {
                const int64_t expert = a.topk_idx[t * K + k];
                const float weight = a.topk_weights[t * K + k];
                if (staging) {
                    reinterpret_cast<int64_t*>(meta + slot.idx_offset)[k] = expert;
                    reinterpret_cast<float*>(meta + slot.weight_offset)[k] = weight;
                }
                if (own >= 0) store_local_topk(a, me, own, k, expert, weight);
            }
            if (lane == (second ? 16 : 0) && own >= 0) a.recv_src_idx[own] = static_cast<int>(t);
            // Each token's part (row or scales, `bytes` each) into its slot where a peer receives the token
            // and into this rank's outputs `out` where this rank does (into the outputs only where no peer does).
            const auto copy_part = [&](const void* from, int64_t offset, uint8_t* out, int64_t bytes) {
                const auto* src = static_cast<const uint8_t*>(from);
                warp_copy_rows<Src::kReadOnly, S::kCopyDepth, S::kPairs>(
                    peer0 ? slot0 + offset : out + own0 * bytes, peer0 && own0 >= 0 ? out + own0 * bytes : nullptr,
                    src + t0 * bytes, peer1 ? slot1 + offset : out + own1 * bytes,
                    peer1 && own1 >= 0 ? out + own1 * bytes : nullptr, src + t1 * bytes, bytes, two, lane);
            };
            copy_part(a.x, slot.x_offset, recv_x, a.x_bytes);
            if (a.scale_bytes > 0) copy_part(a.scales, slot.scale_offset, recv_scales, a.scale_bytes);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kStageCount + parity), warps.blocks))
        for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kStagedFrom, me), tag(e.seq, w));
    return true;
}

// Pull window w of every other rank into the outputs (this rank's own rows were copied as it staged
// them). The slots of all sources form one list spread over all warps of the kernel, so no barrier
// separates the sources; the last block to finish raises every source's released flag. The list goes in
// rounds: round q holds slots [q, q + 1) x kPullRoundSlots of every source (from the next rank on, so
// that ranks spread their reads), and the warps sweep it in order, so every rank reads a token's staged
// row about when the other ranks that receive it do. Where ranks share a GPU the row then comes from L2
// after the first read: +10% fp8 at 4 ranks on one H200 against sources taken one after another
// (DESIGN.md, "Two-pass calls (no arena)").
constexpr int kPullRoundSlots = 32;
template <typename S>
__device__ bool pull_window(const Env& e, const DispatchArgs& a, const DispatchSlot& slot, int window_tokens,
                            const Warps& warps, int w) {
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32;
    const int parity = w & 1, first = w * window_tokens;
    const int total = a.recv_info[1];
    const int* base = a.recv_info + 2;
    const int* src_tokens = a.recv_info + 3 + R;
    __shared__ int slots[kMaxRanks];  // slots[j]: staged slots of source (me + 1 + j) % R in window w
    __shared__ int rounds;
    if (threadIdx.x == 0) {
        int most = 0;
        for (int j = 0; j < R - 1; ++j) {
            slots[j] = clamp_count(src_tokens[(me + 1 + j) % R], first, window_tokens);
            most = max(most, slots[j]);
        }
        rounds = ceil_div(most, kPullRoundSlots);
    }
    if (!block_wait(e, kStagedFrom, 0, R, tag(e.seq, w), kErrStaged, w)) return false;  // its barrier publishes slots
    const int per_round = kPullRoundSlots * (R - 1), n = rounds * per_round;
    const bool pairs = rows_in_pairs<S>(a.x_bytes);
    // A warp reads the destination rows of 32 slots at once, then copies the ones meant here.
    for (int b = 0; b * warps.num_warps * 32 < n; ++b) {
        const int mine = (b * 32 + lane) * warps.num_warps + warps.warp;
        const int q = mine / per_round, j = mine % per_round / kPullRoundSlots, s = (me + 1 + j) % R;
        const int i = q * kPullRoundSlots + mine % kPullRoundSlots;
        const int p = mine < n && i < slots[j]
                          ? __ldcg(reinterpret_cast<const int*>(e.window(s, parity) + i * slot.bytes + slot.pos_offset) + me)
                          : -1;
        // Two rows at a time where rows go in pairs: their copies share trips (peer::warp_copy_rows).
        for (unsigned todo = __ballot_sync(kFullMask, p >= 0); todo != 0;) {
            const int jj0 = __ffs(todo) - 1;
            todo &= todo - 1;
            bool two = pairs && todo != 0;
            const int jj1 = two ? __ffs(todo) - 1 : jj0;
            if (two) todo &= todo - 1;
            int src0 = __shfl_sync(kFullMask, s, jj0), token0 = __shfl_sync(kFullMask, i, jj0);
            int64_t row0 = base[src0] + __shfl_sync(kFullMask, p, jj0);
            // (`two` is the same on every lane; where rows never go in pairs no code is left of these)
            const int src1 = two ? __shfl_sync(kFullMask, s, jj1) : src0, token1 = two ? __shfl_sync(kFullMask, i, jj1) : token0;
            const int64_t row1 = two ? base[src1] + __shfl_sync(kFullMask, p, jj1) : row0;
            const bool fits0 = row0 < a.num_recv_rows, fits1 = two && row1 < a.num_recv_rows;
            if (!fits0 || (two && !fits1)) {  // num_worst_tokens too small: report, write nothing past it
                if (lane == 0) reinterpret_cast<volatile int*>(e.host)[kHostOverflow] = total;
                if (!fits0) {
                    src0 = src1, token0 = token1, row0 = row1;
                    if (!fits1) continue;
                }
                two = false;
            }
            const uint8_t* from0 = e.window(src0, parity) + token0 * slot.bytes;
            const uint8_t* from1 = two ? e.window(src1, parity) + token1 * slot.bytes : from0;
            // A lane's top-k entries: of the row its half-warp copies (the first one's where one row),
            // entries k, k + 16, ...; the first issued before the row copy so that its latency overlaps it.
            const bool second = two && lane >= 16;
            const int lanes = two ? 16 : 32, k0 = two ? lane % 16 : lane;
            const uint8_t* meta = second ? from1 : from0;
            const int64_t meta_row = second ? row1 : row0;
            int64_t expert = -1;
            float weight = 0.f;
            if (k0 < K) {
                expert = __ldcg(reinterpret_cast<const long long*>(meta + slot.idx_offset) + k0);
                weight = __ldcg(reinterpret_cast<const float*>(meta + slot.weight_offset) + k0);
            }
            auto* recv_x = static_cast<uint8_t*>(a.recv_x);
            warp_copy_rows<Src::kShared, S::kCopyDepth, S::kPairs>(recv_x + row0 * a.x_bytes, nullptr, from0 + slot.x_offset,
                                                                   recv_x + row1 * a.x_bytes, nullptr, from1 + slot.x_offset,
                                                                   a.x_bytes, two, lane);
            if (a.scale_bytes > 0) {
                auto* recv_scales = static_cast<uint8_t*>(a.recv_scales);
                warp_copy_rows<Src::kShared, S::kCopyDepth, S::kPairs>(recv_scales + row0 * a.scale_bytes, nullptr,
                                                                       from0 + slot.scale_offset, recv_scales + row1 * a.scale_bytes,
                                                                       nullptr, from1 + slot.scale_offset, a.scale_bytes, two, lane);
            }
            if (k0 < K) store_local_topk(a, me, meta_row, k0, expert, weight);
            if (S::kPairs)  // top-k past 16 where a half-warp takes a row
                for (int k = k0 + lanes; k < K; k += lanes)
                    store_local_topk(a, me, meta_row, k, __ldcg(reinterpret_cast<const long long*>(meta + slot.idx_offset) + k),
                                     __ldcg(reinterpret_cast<const float*>(meta + slot.weight_offset) + k));
            if (lane == 0) {
                a.recv_src_idx[row0] = first + token0;
                if (two) a.recv_src_idx[row1] = first + token1;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kPullCount + parity), warps.blocks))
        for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kReleasedBy, me), tag(e.seq, w));
    return true;
}

// Every block stages its share of window w, then pulls its share of every rank's window w.
template <typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    dispatch_kernel(Ctx c, DispatchArgs a, DispatchSlot slot, int window_tokens) {
    if (!chosen(a.choice)) return;  // the one-pass kernel ran
    const Env e = make_env(c, kKernelDispatch);
    const int R = e.num_ranks, lane = threadIdx.x % 32;
    const int max_tokens = a.recv_info[0], total = a.recv_info[1];
    const int num_windows = max(1, ceil_div(max_tokens, window_tokens));
    const Warps warps = grid_warps<S::kWarps>();
    bool ok = load_volatile(e.own(kAbort)) == 0;
    uint64_t since = e.start;
    for (int w = 0; ok && w < num_windows; ++w) {
        ok = stage_window<S>(e, a, slot, window_tokens, warps, w);
        since = end_phase(e, kPhaseStage, since);
        if (ok) ok = pull_window<S>(e, a, slot, window_tokens, warps, w);
        since = end_phase(e, kPhasePull, since);
    }
    if (ok)
        pad_rows(a, static_cast<uint8_t*>(a.recv_x), static_cast<uint8_t*>(a.recv_scales),
                 min(total, a.num_recv_rows), a.num_recv_rows, warps, lane);
    // The next kernel may overwrite this rank's windows: wait until every rank has read them.
    if (ok && blockIdx.x == 0) block_wait(e, kReleasedBy, 0, R, tag(e.seq, num_windows - 1), kErrReleased, num_windows - 1);
    finish_kernel(e, e.own(kDoneCount));
}

template <typename S>
struct DispatchKernel {
    static constexpr auto fn = dispatch_kernel<S>;
};

}  // namespace

Shapes dispatch_shapes() { return shapes_of<DispatchKernel>(); }

int dispatch_window_tokens(int num_ranks, int64_t num_nvl_bytes, int64_t x_bytes, int64_t scale_bytes, int num_topk) {
    const int64_t half = half_bytes(num_nvl_bytes, num_ranks);
    const int64_t tokens = half / dispatch_slot(num_ranks, x_bytes, scale_bytes, num_topk).bytes;  // slot >= 16 bytes
    return static_cast<int>(tokens < (1 << 22) ? tokens : (1 << 22));
}

void dispatch(const Ctx& ctx, const DispatchArgs& args) {
    if (ctx.num_ranks > kMaxRanks) throw std::runtime_error("moe_ep: intranode dispatch supports at most 64 ranks");
    const DispatchSlot slot = dispatch_slot(ctx.num_ranks, args.x_bytes, args.scale_bytes, args.num_topk);
    const int window = dispatch_window_tokens(ctx.num_ranks, ctx.num_nvl_bytes, args.x_bytes, args.scale_bytes, args.num_topk);
    if (window < 1) throw std::runtime_error("moe_ep: the intranode buffer cannot hold one dispatch slot");
    launch_shaped<DispatchKernel>(ctx, "intranode dispatch_kernel", args, slot, window);
}

}  // namespace intranode
}  // namespace moe_ep
