// Intranode normal-mode dispatch and combine over CUDA IPC (peers' buffers mapped in this process).
//
// Dispatch pulls: every rank stages a window of its tokens once in its own buffer (whatever the
// number of destinations), and every receiver copies the rows meant for it straight into its output
// tensors, at the row the sender computed. Combine pushes: every rank writes the rows it holds into
// the owner's window, one slot per (token, sending rank), and the owner sums them in rank order.
// Windows alternate between two halves of the buffer, so staging (or pushing) window w overlaps the
// reads of window w - 1; a bounded number of windows makes any token count fit any buffer size.
//
// Cross-rank flags carry tags (kernel sequence number, window) and only grow (atomicMax), so a flag
// of an earlier call never satisfies a wait of a later one, and every wait has a deadline: a peer
// that never arrives is reported to the host record and all blocks return; nothing traps.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include <algorithm>

#include "api.cuh"
#include "buffer_layout.cuh"
#include "cuda_check.cuh"
#include "peer_sync.cuh"
#include "residency.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// Every block of every rank must be resident at once (they wait on each other), and with several
// ranks on one GPU two consecutive kernels of different ranks can be alive together (one rank in
// combine while another finishes its dispatch): 2 * ranks * blocks must fit. Each kernel is built in
// four shapes and a launch takes the first whose blocks fit (launch_resident), in the order
// shape_order(ctx.full_first) gives:
//  - Solo: 512 threads, one block per SM, so 128 registers per thread: no spills, and twice the
//    loads in flight per lane. The kernels are bound by memory latency (every warp waits on its own
//    loads; the wait profile shows little waiting on peers), so loads in flight are what moves bytes.
//  - Wide: 512 threads, two blocks per SM (64 registers).
//  - Narrow: 256 threads, four per SM. Measured on an H200: 512-thread blocks moved 15-20% more than
//    256-thread ones at 2 and 4 ranks, and deadlocked until the deadline with 8 ranks of 20 blocks
//    (2 per SM: 264 fit) before the shape was chosen by residency.
//  - Full: 1024 threads, one block per SM (64 registers, the code of Wide): the threads of two Wide
//    blocks in one, so fewer blocks, which is what residency rations when ranks share a GPU (4 ranks at
//    a budget of 24: 16 Full blocks hold 16,384 threads where 24 Wide ones hold 12,288). Tried first,
//    instead of Solo, by the kernels that gained from it where ranks share a GPU (Ctx::full_first).
template <int kThreadsPerBlock, int kBlocksPerSm>
struct Shape {
    static constexpr int kThreads = kThreadsPerBlock;
    static constexpr int kMinBlocks = kBlocksPerSm;
    static constexpr int kWarps = kThreads / 32;
    // What __launch_bounds__ leaves a thread of the SM's 64K registers (at most 255).
    static constexpr int kRegisters = 65536 / (kThreadsPerBlock * kBlocksPerSm);
    // 16-byte loads in flight per lane in a row copy.
    static constexpr int kCopyDepth = kRegisters >= 128 ? 12 : 6;
    // The two-pass dispatch may copy rows two at a time (peer::warp_copy_rows; rows_in_pairs says
    // when): measured faster at depth 12 (fp8 +10% at 2 ranks on one H200), slower at 6 (bf16 -1.5% at 4
    // and 8 ranks).
    static constexpr bool kPairs = kCopyDepth >= 12;
    // Combine loads up to this many ranks' slots of a token at once (kChunks vectors of each per lane)
    // before summing them in rank order.
    static constexpr int kCombineBatch = kRegisters >= 128 ? 4 : 2;
};
using Solo = Shape<512, 1>;
using Wide = Shape<512, 2>;
using Narrow = Shape<256, 4>;
using Full = Shape<1024, 1>;
constexpr int kChunks = 2;
constexpr int kNotifyThreads = 512;
constexpr int kScanItems = 4;
constexpr unsigned kFullMask = 0xffffffffu;
// Combine keeps one bit per sending rank; dispatch's pull and combine's push a list start per rank.
constexpr int kMaxRanks = 64;

using peer::arrive_last;
using peer::load_acquire;
using peer::load_volatile;
using peer::now_ns;
using peer::raise_flag;
using peer::Src;
using peer::tag;
using peer::warp_copy;
using peer::warp_copy_rows;

// What every block of a kernel knows about the buffers and the call.
struct Env {
    uint8_t* const* buffers;
    int rank, num_ranks;
    int64_t header, half;
    int* host;
    uint64_t seq, deadline, start;
    uint64_t* wait_ns;  // this block's wait profile row, or null
    int64_t* kernel_log;  // Ctx::kernel_log
    int kernel;         // KernelId

    // kHostKernelStarted / kHostKernelFinished's value for this kernel.
    __device__ int progress_mark() const { return kernel << 24 | static_cast<int>(seq & 0xffffff); }

    __device__ uint64_t* signals(int r) const { return reinterpret_cast<uint64_t*>(buffers[r]); }
    __device__ uint64_t* own(int64_t index) const { return signals(rank) + index; }
    __device__ uint64_t* peer_array(int r, SignalArray array, int slot) const {
        return signals(r) + signal_index(array, num_ranks, slot);
    }
    __device__ uint8_t* window(int r, int parity) const { return buffers[r] + header + parity * half; }
    // Where a wait for `peer` reports a failure, with that peer's progress mark.
    __device__ peer::Failure failure(int peer) const {
        return {own(kAbort), own(kErrorClaim), host, deadline, signals(peer) + kStartedMark};
    }
};

__device__ Env make_env(const Ctx& c, KernelId kernel) {
    Env e;
    e.kernel = kernel;
    e.buffers = c.buffers;
    e.rank = c.rank;
    e.num_ranks = c.num_ranks;
    e.header = header_bytes(c.num_ranks);
    e.half = half_bytes(c.num_nvl_bytes, c.num_ranks);
    e.host = c.host_info;
    e.seq = load_volatile(reinterpret_cast<uint64_t*>(c.buffers[c.rank]) + kSeq);
    e.start = now_ns();
    e.deadline = e.start + c.timeout_ns;
    e.wait_ns = c.wait_ns == nullptr ? nullptr : c.wait_ns + static_cast<int64_t>(blockIdx.x) * kWaitSlots;
    e.kernel_log = c.kernel_log;
    if (threadIdx.x == 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(e.own(kBlocksStarted)), 1ull);
        if (blockIdx.x == 0) {
            reinterpret_cast<volatile int*>(e.host)[kHostKernelStarted] = e.progress_mark();
            volatile uint64_t* started = e.own(kStartedMark);
            started[0] = static_cast<uint64_t>(e.progress_mark());
            started[1] = e.start;
        }
    }
    return e;
}

// One thread waits; false after a timeout (reported) or when another block already failed.
__device__ bool wait_flag(const Env& e, const uint64_t* flag, uint64_t target, int kind, int from_rank, int window) {
    return peer::wait_flag(e.failure(from_rank), flag, target, kind, from_rank, window);
}

// The whole block waits for flags[peer] >= target for every peer in [first, last).
__device__ bool block_wait(const Env& e, SignalArray array, int first, int last, uint64_t target, int kind,
                           int window) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        const uint64_t began = e.wait_ns != nullptr ? now_ns() : 0;
        ok = load_volatile(e.own(kAbort)) == 0;
        for (int r = first; ok && r < last; ++r)
            ok = wait_flag(e, e.peer_array(e.rank, array, r), target, kind, r, window);
        if (e.wait_ns != nullptr) e.wait_ns[kind] += now_ns() - began;
    }
    __syncthreads();
    const bool result = ok;
    __syncthreads();
    return result;
}

// Profiled blocks (thread 0): the time since `since` goes to the phase's slot; returns now.
__device__ uint64_t end_phase(const Env& e, int phase, uint64_t since) {
    if (e.wait_ns == nullptr) return 0;
    const uint64_t now = now_ns();
    if (threadIdx.x == 0) e.wait_ns[phase] += now - since;
    return now;
}

// Thread 0 of a kernel's last block: the host record says it finished, and the sequence number the
// next kernel's tags use advances.
__device__ void end_of_kernel(const Env& e) {
    if (e.kernel_log != nullptr) {
        // Every block arrived before this one, block 0 among them, so its start time is in place.
        const auto i = atomicAdd(reinterpret_cast<unsigned long long*>(e.kernel_log), 1ull);
        if (i < static_cast<unsigned long long>(kKernelLogEntries)) {
            int64_t* entry = e.kernel_log + 1 + 3 * static_cast<int64_t>(i);
            entry[0] = e.kernel;
            entry[1] = static_cast<int64_t>(load_volatile(e.own(kStartedAt)));
            entry[2] = static_cast<int64_t>(now_ns());
        }
    }
    reinterpret_cast<volatile int*>(e.host)[kHostKernelFinished] = e.progress_mark();
    atomicExch(reinterpret_cast<unsigned long long*>(e.own(kBlocksStarted)), 0ull);  // every block started
    atomicAdd(reinterpret_cast<unsigned long long*>(e.own(kSeq)), 1ull);
}

__device__ void finish_kernel(const Env& e, uint64_t* done_counter) {
    __syncthreads();
    if (threadIdx.x == 0 && e.wait_ns != nullptr) e.wait_ns[kWaitSlots - 1] += now_ns() - e.start;
    if (threadIdx.x == 0 && arrive_last(done_counter, gridDim.x)) end_of_kernel(e);
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int clamp_count(int n, int first, int capacity) { return max(0, min(n - first, capacity)); }
// The part a list entry falls in, for `parts` parts laid back to back, part j from entry starts[j];
// entries past the list's end fall in the last part.
__device__ __forceinline__ int list_part(const int* starts, int parts, int entry) {
    int j = 0;
    while (j + 1 < parts && starts[j + 1] <= entry) ++j;
    return j;
}

// ------------------------------------------------------------------ notify
// Block d scans column d of is_token_in_rank and sends this rank's counts to rank d; the last block to
// finish waits for every rank's counts and sums them up. One block waits, not R: where ranks share a GPU,
// R waiting blocks a rank (64 in all at 8 ranks) hold SMs a late peer's GEMMs may need (as the rendezvous below).
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

// ------------------------------------------------------------------ rendezvous
// Where ranks share a GPU, a data kernel that starts before its peers reach the call holds its blocks'
// SMs while it waits for them, and a peer whose expert GEMMs are still ahead of the call can then find
// too few SMs to finish them: with seven ranks' combines waiting, grids resident, the eighth rank never
// reached its combine before the deadline (thirtieth session; DESIGN.md, "Ranks sharing a GPU"). This
// one-block kernel goes first: it tells every rank that this one reached the call and waits until all
// have, so the data kernel queued behind it starts only once every rank's is about to, and a rank
// waits for late peers on one block instead of a whole grid. `c.rendezvous_before` names that kernel
// in a timeout's report.
constexpr int kRendezvousThreads = 64;
__global__ void __launch_bounds__(kRendezvousThreads) rendezvous_kernel(Ctx c) {
    c.wait_ns = nullptr;  // the wait profile is the data kernels' (its slots are theirs)
    const Env e = make_env(c, kKernelRendezvous);
    if (load_volatile(e.own(kAbort)) == 0) {
        for (int r = threadIdx.x; r < e.num_ranks; r += blockDim.x)
            raise_flag(e.peer_array(r, kArrivedFrom, e.rank), tag(e.seq, 0));
        block_wait(e, kArrivedFrom, 0, e.num_ranks, tag(e.seq, 0), kErrRendezvous, c.rendezvous_before);
    }
    finish_kernel(e, e.own(kDoneCount));
}

// ------------------------------------------------------------------ agree
// Where a call can take the one-pass or the two-pass path, both kernels are queued behind this one and
// each returns at once unless it is the one chosen: the choice is made here, on the device, from every
// rank's vote, so it needs no host round trip. Its one block also serves as the call's rendezvous. A
// vote rides on the arrival flag itself (the step of its tag), which no peer raises again before this
// rank's next call: each peer's next call waits for this rank in the data kernel chosen here.
constexpr int kAgreeThreads = 64;
__global__ void __launch_bounds__(kAgreeThreads) agree_kernel(Ctx c, AgreeArgs a) {
    c.wait_ns = nullptr;  // the wait profile is the data kernels' (its slots are theirs)
    const Env e = make_env(c, kKernelAgree);
    int vote = a.vote;
    if (a.recv_info != nullptr &&
        dispatch_region(a.recv_info[1], a.x_bytes, a.scale_bytes, a.num_topk).bytes > a.region_bytes)
        vote &= ~kVoteRoom;
    bool ok = load_volatile(e.own(kAbort)) == 0;
    if (ok) {
        for (int r = threadIdx.x; r < e.num_ranks; r += blockDim.x)
            raise_flag(e.peer_array(r, kArrivedFrom, e.rank), tag(e.seq, vote));
        ok = block_wait(e, kArrivedFrom, 0, e.num_ranks, tag(e.seq, 0), kErrRendezvous, kKernelAgree);
    }
    if (threadIdx.x == 0) {
        int all = kVoteRoom | kVoteInPlace;
        for (int r = 0; r < e.num_ranks; ++r)
            all &= static_cast<int>((load_volatile(e.peer_array(e.rank, kArrivedFrom, r)) & 0xFFFFFF) - 1);
        const int one_pass = ok && (all & kVoteRoom) && ((all & kVoteInPlace) || a.copy_ok);
        *a.choice = one_pass;
        volatile int* host = reinterpret_cast<volatile int*>(e.host);
        host[kHostChoice] = one_pass;
        __threadfence_system();
        host[kHostChoiceDone] = a.nonce;
    }
    finish_kernel(e, e.own(kDoneCount));
}

// Whether a data kernel queued behind an agreement is the one it chose (always, without one).
__device__ __forceinline__ bool chosen(const int* choice, int run_if) {
    return choice == nullptr || __ldcg(choice) == run_if;
}

// ------------------------------------------------------------------ dispatch
// The kernel's blocks and this warp's place among all their warps. (Blocks split by role, some only
// staging or pushing and the others only pulling or reducing, were measured and lost: DESIGN.md.)
struct Warps {
    int blocks, warp, num_warps;
};
template <int kWarps>
__device__ Warps grid_warps() {
    return {static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32,
            static_cast<int>(gridDim.x) * kWarps};
}

// Whether the two-pass dispatch copies its rows two at a time: in the shapes deep enough for it, and
// for rows that a whole warp copies in under two full trips a lane, so that the last trip runs part
// empty (an fp8 row of 7,168 bytes at depth 12: 12 + 2 vectors a lane, two on half-warps 12 + 12 + 4).
// Longer rows gain little from the fuller trips: bf16 rows in pairs were +4% at 2 ranks and -8% at 4
// (16 blocks) on one H200, where fp8 rows gained 11% and 12% (DESIGN.md).
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
// (DESIGN.md, "Data movement").
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

// Padding rows [first, last) of a num_worst_tokens dispatch: no data, no expert. x_rows and scale_rows
// are where the outputs' rows lie (the output tensors, or a zero-copy slot).
__device__ void pad_rows(const DispatchArgs& a, uint8_t* x_rows, uint8_t* scale_rows, int64_t first, int64_t last,
                         const Warps& warps, int lane) {
    const int K = a.num_topk;
    for (int64_t row = first + warps.warp; row < last; row += warps.num_warps) {
        for (int64_t b = lane; b < a.x_bytes; b += 32) x_rows[row * a.x_bytes + b] = 0;
        for (int64_t b = lane; b < a.scale_bytes; b += 32) scale_rows[row * a.scale_bytes + b] = 0;
        for (int k = lane; k < K; k += 32) {
            a.recv_topk_idx[row * K + k] = -1;
            a.recv_topk_weights[row * K + k] = 0.f;
        }
        if (lane == 0) a.recv_src_idx[row] = -1;
    }
}

// Every block stages its share of window w, then pulls its share of every rank's window w.
template <typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    dispatch_kernel(Ctx c, DispatchArgs a, DispatchSlot slot, int window_tokens) {
    const Env e = make_env(c, kKernelDispatch);
    const int R = e.num_ranks, lane = threadIdx.x % 32;
    const int max_tokens = a.recv_info[0], total = a.recv_info[1];
    const int num_windows = max(1, ceil_div(max_tokens, window_tokens));
    const Warps warps = grid_warps<S::kWarps>();
    bool ok = load_volatile(e.own(kAbort)) == 0 && chosen(a.choice, a.run_if);
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

// ------------------------------------------------------------------ combine
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

// First index in sorted [lo, hi) with value >= key.
__device__ int lower_bound(const int* values, int lo, int hi, int key) {
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (values[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// This rank's received rows from `owner` whose tokens lie in [first, last): rows from an owner are
// sorted by token, so they are contiguous; returns their count and sets `begin` to the first.
__device__ int owner_rows(const CombineArgs& a, const int* base, int owner, int first, int last, int& begin) {
    begin = lower_bound(a.recv_src_idx, base[owner], base[owner + 1], first);
    return lower_bound(a.recv_src_idx, begin, base[owner + 1], last) - begin;
}

// What one combine call's blocks share: the arguments and where the windows are.
struct CombineCall {
    const CombineArgs& a;
    int64_t slot_bytes, x_bytes, weights_offset;
    int window_tokens;
    const int* base;  // first received row of each source rank (R + 1)
};

// Token t's row that this rank itself received (its own token, for a local expert): the combines read
// it in place in x instead of passing it through this rank's window or ring (a copy and a read back
// saved: half the rows at 2 ranks, a quarter at 4). Row base[me] + send_pos[t][me], as at any
// receiver of this rank's rows. Valid where send_pos[t][me] >= 0, which `sent` says.
struct OwnRow {
    const CombineArgs& a;
    const int* base;  // first received row of each source rank
    int64_t x_bytes, t;
    int me, R;
    __device__ int64_t index() const { return base[me] + a.send_pos[t * R + me]; }
    __device__ const uint8_t* row() const { return static_cast<const uint8_t*>(a.x) + index() * x_bytes; }
    __device__ const float* weights() const { return a.topk_weights + index() * a.num_topk; }
};

// Push: every row this rank holds for a token of window w goes to its owner's slot (token, this rank).
// The rows of all owners form one list (owners from the next rank on) spread over all warps of the
// kernel; the last block to finish raises every owner's pushed flag.
template <typename T, typename V, typename S>
__device__ bool push_window(const Env& e, const CombineCall& call, const Warps& warps, int w) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32;
    const int parity = w & 1, first = w * call.window_tokens;
    // Entry i of the list is received row lo[j] + i - starts[j] for owner (me + 1 + j) % R, where
    // starts[j] <= i < starts[j + 1].
    __shared__ int lo[kMaxRanks], starts[kMaxRanks + 1];
    // This rank's own rows stay where they are (the reduce reads them from x): owner me, the last, gets none.
    for (int j = threadIdx.x; j < R; j += blockDim.x)
        starts[j + 1] = j == R - 1 ? (lo[j] = 0) : owner_rows(a, call.base, (me + 1 + j) % R, first, first + call.window_tokens, lo[j]);
    __syncthreads();
    if (threadIdx.x == 0) {
        starts[0] = 0;
        for (int j = 0; j < R; ++j) starts[j + 1] += starts[j];
    }
    // Every owner opens window w for every rank: waiting for all of them never waits in vain. The
    // wait's barrier publishes starts.
    if (!block_wait(e, kOpenFrom, 0, R, tag(e.seq, w), kErrOpen, w)) return false;
    for (int item = warps.warp; item < starts[R]; item += warps.num_warps) {
        const int j = list_part(starts, R, item), s = (me + 1 + j) % R;
        const int64_t i = lo[j] + item - starts[j], t = a.recv_src_idx[i];
        uint8_t* dst = e.window(s, parity) + ((t - first) * R + me) * call.slot_bytes;
        warp_copy<Src::kReadOnly, S::kCopyDepth>(dst, static_cast<const uint8_t*>(a.x) + i * call.x_bytes, call.x_bytes, lane);
        for (int k = lane; k < K; k += 32)
            reinterpret_cast<float*>(dst + call.weights_offset)[k] = a.topk_weights[i * K + k];
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kPushCount + parity), warps.blocks))
        for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kPushedFrom, me), tag(e.seq, w));
    return true;
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

// Reduce this rank's window w once every rank pushed into it: bias, then every rank's row in ascending
// rank order, in float32; the last block to finish reopens the window half for window w + 2. A window
// may hold fewer tokens than the kernel has warps: then each token's row is cut into parts, a warp each.
template <typename T, typename V, typename S>
__device__ bool reduce_window(const Env& e, const CombineCall& call, const Warps& warps, int w) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, lane = threadIdx.x % 32;
    const int parity = w & 1, first = w * call.window_tokens;
    const int64_t chunks = call.x_bytes / sizeof(V);
    if (!block_wait(e, kPushedFrom, 0, R, tag(e.seq, w), kErrPushed, w)) return false;
    const uint8_t* window = e.window(me, parity);
    const int count = clamp_count(a.num_tokens, first, call.window_tokens);
    const int steps = static_cast<int>((chunks + 32 * kChunks - 1) / (32 * kChunks));  // a warp's passes over a row
    const int parts = count == 0 ? 1 : max(1, min(steps, warps.num_warps / count));
    for (int item = warps.warp; item < count * parts; item += warps.num_warps) {
        const int i = item / parts, part = item % parts;
        const int64_t t = first + i;
        uint64_t sent = 0;
        for (int r0 = 0; r0 < R; r0 += 32) {
            const int r = r0 + lane;
            const unsigned bits = __ballot_sync(kFullMask, r < R && a.send_pos[t * R + r] >= 0);
            sent |= static_cast<uint64_t>(bits) << r0;
        }
        const uint8_t* slots = window + static_cast<int64_t>(i) * R * call.slot_bytes;
        const int64_t begin = static_cast<int64_t>(steps) * part / parts * 32 * kChunks;
        const int64_t end = min(chunks, static_cast<int64_t>(steps) * (part + 1) / parts * 32 * kChunks);
        const OwnRow own{a, call.base, call.x_bytes, t, me, R};
        sum_token<T, V, S>(
            a, t, chunks, begin, end, sent,
            [&](int r) { return r == me ? own.row() : slots + r * call.slot_bytes; },
            [&](int r) { return r == me ? own.weights() : reinterpret_cast<const float*>(slots + r * call.slot_bytes + call.weights_offset); },
            part == 0, lane);
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kReduceCount + parity), warps.blocks))
        for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kOpenFrom, me), tag(e.seq, w + 2));
    return true;
}

// T: element type; V: the vector a lane moves at once (16 bytes, or 8 for rows of 8-byte multiples).
// Every block pushes its share of window w to every owner, then reduces its share of its own window w.
template <typename T, typename V, typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    combine_kernel(Ctx c, CombineArgs a, int64_t slot_bytes, int window_tokens) {
    const Env e = make_env(c, kKernelCombine);
    const int64_t x_bytes = static_cast<int64_t>(a.hidden) * sizeof(T);
    const CombineCall call{a, slot_bytes, x_bytes, align_up(x_bytes, kSlotAlign), window_tokens, a.recv_info + 2};
    const int max_tokens = a.recv_info[0];
    const int num_windows = max(1, ceil_div(max_tokens, window_tokens));
    const Warps warps = grid_warps<S::kWarps>();
    bool ok = load_volatile(e.own(kAbort)) == 0 && chosen(a.choice, a.run_if);
    // Windows 0 and 1 of this rank accept rows from now on (the previous kernel left them unused).
    if (ok && blockIdx.x == 0 && threadIdx.x == 0)
        for (int r = 0; r < e.num_ranks; ++r) raise_flag(e.peer_array(r, kOpenFrom, e.rank), tag(e.seq, 1));
    uint64_t since = e.start;
    for (int w = 0; ok && w < num_windows; ++w) {
        ok = push_window<T, V, S>(e, call, warps, w);
        since = end_phase(e, kPhasePush, since);
        if (ok) ok = reduce_window<T, V, S>(e, call, warps, w);
        since = end_phase(e, kPhaseReduce, since);
    }
    finish_kernel(e, e.own(kDoneCount));
}

// ------------------------------------------------------------------ streaming combine
// The combine from 4 ranks up (ctx.stream_combine, chosen in Python; measured in DESIGN.md, "Where the
// speed stands", step 3). The windowed combine above pushes a whole window before any of it is
// reduced, so the slots come back from DRAM and every window costs an all-rank handshake. Here the
// first `channels` blocks receive and the others send, at the same time. Every owner's tokens are cut into `channels`
// contiguous ranges; per (channel, sending rank) the owner's buffer holds a ring of `ring_rows` slots.
// A sending block serves one channel: in rounds, its warps write every owner's next rows of the
// channel, in token order, into the owner's ring, as far as each owner's consumed count allows (never
// waiting on one owner while another has room) and at most a send chunk per owner, since a round's
// rows are released only when the round ends: a ring that takes a whole channel would otherwise be
// written in full before its owner sums any of it. A receiving block takes its channel's tokens in
// batches of one token per warp, in order: a token's row from rank r is the next unread slot of ring
// r, because r sends in token order, and is summed in rank order as in the windowed combine (the same
// bits). Senders wait only on receivers and receivers only on senders; a batch never needs more rows
// of a ring than it holds, and every block is resident: no cycle of waits.
constexpr int kMaxStreamRanks = 32;  // a warp's lanes hold one rank each

struct StreamCall {
    const CombineArgs& a;
    int64_t slot_bytes, x_bytes, weights_offset;
    int ring_rows, channels;
    const int* base;        // first received row of each rank (R + 1)
    const int* src_tokens;  // every rank's num_tokens
};

// Tokens [first, last) of a rank with n tokens that channel c covers.
__device__ __forceinline__ void channel_tokens(int n, int c, int channels, int& first, int& last) {
    first = static_cast<int>(static_cast<int64_t>(n) * c / channels);
    last = static_cast<int>(static_cast<int64_t>(n) * (c + 1) / channels);
}

// Rank `owner`'s ring of channel c for rows from rank `from` (in the window area, unused meanwhile).
__device__ __forceinline__ uint8_t* stream_ring(const Env& e, const StreamCall& call, int owner, int c, int from) {
    return e.window(owner, 0) + (static_cast<int64_t>(c) * e.num_ranks + from) * call.ring_rows * call.slot_bytes;
}

// Rows counted in a ring counter of this call (tag(seq, rows)); a counter of a later call counts as
// everything (its rank is past this call), one of an earlier call as nothing.
__device__ __forceinline__ int counted_rows(uint64_t flag, uint64_t seq, int everything) {
    if (flag < tag(seq, 0)) return -1;
    return (flag >> 24) == seq ? static_cast<int>(flag & 0xffffff) - 1 : everything;
}

template <typename T, typename V, typename S>
__device__ bool stream_send(const Env& e, const StreamCall& call, int c) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // Per owner j (rank (me + 1 + j) % R, so the senders start on different owners): its rows of the
    // channel (lo, count, sorted by token), rows written so far, and rows its ring has room up to.
    __shared__ int lo[kMaxStreamRanks], count[kMaxStreamRanks], sent[kMaxStreamRanks], room[kMaxStreamRanks];
    __shared__ int starts[kMaxStreamRanks + 1];
    __shared__ int state;
    enum { kGo, kDone, kFailed };
    if (threadIdx.x < R) {
        const int j = threadIdx.x, s = (me + 1 + j) % R;
        int first, last;
        channel_tokens(call.src_tokens[s], c, call.channels, first, last);
        // This rank's own rows stay in x (the receiver reads them there): its own ring gets none.
        count[j] = s == me ? (lo[j] = 0) : owner_rows(a, call.base, s, first, last, lo[j]);
        sent[j] = 0;
    }
    const uint8_t* x = static_cast<const uint8_t*>(a.x);
    while (true) {
        // Each round writes whatever room every owner's ring has, all warps over one list (a warp per
        // owner would leave most warps idle at few ranks), so no owner waits on another's ring.
        if (threadIdx.x < R) {
            const int j = threadIdx.x, s = (me + 1 + j) % R;
            room[j] = sent[j];
            if (sent[j] < count[j]) {
                const int consumed = counted_rows(load_acquire(e.own(stream_index(kConsumedBy, R, c, s))), e.seq, count[j]);
                if (consumed >= 0) room[j] = min(count[j], consumed + call.ring_rows);
                if (a.send_chunk > 0) room[j] = min(room[j], sent[j] + a.send_chunk);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int waiting_on = -1;
            starts[0] = 0;
            for (int j = 0; j < R; ++j) {
                starts[j + 1] = starts[j] + room[j] - sent[j];
                if (waiting_on < 0 && sent[j] < count[j]) waiting_on = j;
            }
            state = waiting_on < 0 ? kDone : kGo;
            // Every unfinished owner's ring is full: give up only at the deadline.
            if (waiting_on >= 0 && starts[R] == 0) {
                if (load_volatile(e.own(kAbort)) != 0) {
                    state = kFailed;
                } else if (now_ns() > e.deadline) {
                    const int s = (me + 1 + waiting_on) % R;
                    peer::report_timeout(e.failure(s), kErrRingRoom, s, c,
                                         tag(e.seq, 0), load_volatile(e.own(stream_index(kConsumedBy, R, c, s))));
                    state = kFailed;
                }
            }
        }
        __syncthreads();
        if (state != kGo) return state == kDone;
        for (int item = warp; item < starts[R]; item += S::kWarps) {
            const int j = list_part(starts, R, item), s = (me + 1 + j) % R;
            const int k = sent[j] + item - starts[j];
            const int64_t i = lo[j] + k;
            uint8_t* dst = stream_ring(e, call, s, c, me) + static_cast<int64_t>(k % call.ring_rows) * call.slot_bytes;
            warp_copy<Src::kReadOnly, S::kCopyDepth>(dst, x + i * call.x_bytes, call.x_bytes, lane);
            for (int k2 = lane; k2 < K; k2 += 32) reinterpret_cast<float*>(dst + call.weights_offset)[k2] = a.topk_weights[i * K + k2];
        }
        __syncthreads();  // the block's stores before the releases
        if (threadIdx.x < R && room[threadIdx.x] > sent[threadIdx.x]) {
            const int j = threadIdx.x, s = (me + 1 + j) % R;
            raise_flag(e.signals(s) + stream_index(kProducedFrom, R, c, me), tag(e.seq, room[j]));
            sent[j] = room[j];
        }
    }
}

// A receiving block's view of its channel: where each sender's rows of the channel start in its ring,
// and how many of them it has read.
struct StreamChannel {
    int c, first, last;       // channel, its tokens [first, last)
    const int* ring_first;    // per sender: send_pos of the channel's first token it got
    int* consumed;            // per sender: its ring rows read so far
    const uint8_t* rings;     // this rank's rings of the channel, one per sender
    int64_t ring_bytes;
};

// One token of the channel, by one warp: waits for its rows in the rings and sums them (a rank's own
// row read in place in x). -> false where a wait gave up (reported).
template <typename T, typename V, typename S>
__device__ bool receive_token(const Env& e, const StreamCall& call, const StreamChannel& ch, int64_t t, int lane) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank;
    int k = -1;  // lane r: ring index of this token's row from rank r
    if (lane < R) {
        const int p = a.send_pos[t * R + lane];
        if (p >= 0) k = p - ch.ring_first[lane];
    }
    bool ready = true;
    if (k >= 0 && lane != me)  // this rank's own row is read in place, never sent
        ready = wait_flag(e, e.own(stream_index(kProducedFrom, R, ch.c, lane)), tag(e.seq, k + 1), kErrRingRows, lane, ch.c);
    if (!__all_sync(kFullMask, ready)) return false;
    const unsigned sent = __ballot_sync(kFullMask, k >= 0);
    const int64_t offset = k >= 0 ? lane * ch.ring_bytes + static_cast<int64_t>(k % call.ring_rows) * call.slot_bytes : 0;
    const OwnRow own{a, call.base, call.x_bytes, t, me, R};
    sum_token<T, V, S>(
        a, t, call.x_bytes / sizeof(V), 0, call.x_bytes / sizeof(V), sent,
        [&](int r) { return r == me ? own.row() : ch.rings + __shfl_sync(kFullMask, offset, r); },
        [&](int r) {
            return r == me ? own.weights()
                           : reinterpret_cast<const float*>(ch.rings + __shfl_sync(kFullMask, offset, r) + call.weights_offset);
        },
        true, lane);
    if (k >= 0) atomicMax(&ch.consumed[lane], k + 1);
    return true;
}

// Ranks from which a channel is received per warp rather than in batches. Measured (twenty-third
// session, one H200, 24 SMs): per warp -2% at 4 ranks, +6% at 8; the batch barrier costs more the more
// senders a token's rows wait on.
constexpr int kPerWarpReceiveMinRanks = 8;
constexpr int kLookahead = 4;  // tokens a receiving warp looks at for a ring's next row (per warp)

// The channel's tokens, a token a warp at a time, in one of two ways (one loop: sum_token is inlined
// once, which keeps the 64-register shapes' spills where they were).
// In batches (below kPerWarpReceiveMinRanks ranks): a block barrier after each batch of min(warps, ring
// rows) tokens, then one release per sender.
// Per warp: each warp goes on without waiting for the others. next_token[w] says that warp w summed
// all its tokens below it, so every token below the smallest entry ("below") is summed, and a ring's
// rows of those tokens are read. After each token a warp tells the senders what below allows: for
// ring r, the index of r's first row at or past below, when one lies within kLookahead tokens (else
// nothing now), or all of r's rows once none is left in the channel; only steps of `publish_step` rows
// or the end are told (a system-scope fence each). No wait closes a cycle: the slowest warp's token is
// below itself, so its rows are what was found at distance 0, at most publish_step <= ring_rows past
// what the senders were told, and they always fit the rings.
template <typename T, typename V, typename S>
__device__ bool receive_channel(const Env& e, const StreamCall& call, const StreamChannel& ch) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    constexpr int W = S::kWarps;
    const int first = ch.first, last = ch.last;
    const bool per_warp = R >= kPerWarpReceiveMinRanks;
    __shared__ int next_token[W];
    __shared__ int published[kMaxStreamRanks];  // per sender: rows last told
    if (threadIdx.x < W) next_token[threadIdx.x] = min(first + static_cast<int>(threadIdx.x), last);
    if (threadIdx.x < R) published[threadIdx.x] = 0;
    __syncthreads();
    const int publish_step = max(1, min(W, call.ring_rows / 2));
    const int step = per_warp ? W : min(W, call.ring_rows);  // a batch needs at most that many rows of a ring
    for (int b0 = first; b0 < last; b0 += step) {
        const int64_t t = b0 + warp;
        const bool mine = warp < step && t < last;
        const bool failed = mine && !receive_token<T, V, S>(e, call, ch, t, lane);
        if (!per_warp) {
            // The batch's rows are read (their slots may be refilled), and every thread learns of a failed wait.
            if (__syncthreads_or(failed)) return false;
            if (threadIdx.x < R)
                raise_flag(e.signals(threadIdx.x) + stream_index(kConsumedBy, R, ch.c, me), tag(e.seq, ch.consumed[threadIdx.x]));
            continue;
        }
        if (failed) return false;  // reported; the other warps' waits give up too
        if (!mine) continue;
        // This warp's rows are read; then the fence orders its progress against every other warp's (of
        // two warps moving at once, at least one sees both).
        __syncwarp();
        if (lane == 0) {
            __threadfence_block();
            *reinterpret_cast<volatile int*>(&next_token[warp]) = static_cast<int>(min(t + W, static_cast<int64_t>(last)));
            __threadfence_block();
        }
        __syncwarp();
        int below = lane < W ? *reinterpret_cast<volatile int*>(&next_token[lane]) : last;
        for (int w = lane + 32; w < W; w += 32) below = min(below, *reinterpret_cast<volatile int*>(&next_token[w]));
        below = __reduce_min_sync(kFullMask, below);
        if (lane < R) {
            int rows = -1;  // ring `lane`'s rows of the tokens below `below` (-1: not known now)
            int p[kLookahead];
#pragma unroll
            for (int i = 0; i < kLookahead; ++i)
                p[i] = below + i < last ? a.send_pos[static_cast<int64_t>(below + i) * R + lane] : -1;
#pragma unroll
            for (int i = 0; i < kLookahead; ++i)
                if (rows < 0 && p[i] >= 0) rows = p[i] - ch.ring_first[lane];
            // None left in the channel: every row it sent, all read by now.
            if (rows < 0 && below + kLookahead >= last) rows = *reinterpret_cast<volatile int*>(&ch.consumed[lane]);
            const int told = *reinterpret_cast<volatile int*>(&published[lane]);
            if (rows >= 0 && (rows >= told + publish_step || (below >= last && rows > told)) &&
                atomicMax(&published[lane], rows) < rows)
                raise_flag(e.signals(lane) + stream_index(kConsumedBy, R, ch.c, me), tag(e.seq, rows));
        }
    }
    return true;
}

template <typename T, typename V, typename S>
__device__ bool stream_receive(const Env& e, const StreamCall& call, int c) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __shared__ int ring_first[kMaxStreamRanks];
    __shared__ int consumed[kMaxStreamRanks];
    // This call's rings are open: the previous call read them all before its kernel ended.
    if (threadIdx.x < R) {
        raise_flag(e.signals(threadIdx.x) + stream_index(kConsumedBy, R, c, me), tag(e.seq, 0));
        consumed[threadIdx.x] = 0;
    }
    int first, last;
    channel_tokens(a.num_tokens, c, call.channels, first, last);
    for (int r = warp; r < R; r += S::kWarps) {
        int found = 0;
        for (int t0 = first; t0 < last; t0 += 32) {
            const int p = t0 + lane < last ? a.send_pos[static_cast<int64_t>(t0 + lane) * R + r] : -1;
            const unsigned hits = __ballot_sync(kFullMask, p >= 0);
            if (hits != 0) {
                found = __shfl_sync(kFullMask, p, __ffs(hits) - 1);
                break;
            }
        }
        if (lane == 0) ring_first[r] = found;
    }
    __syncthreads();
    const StreamChannel ch{c, first, last, ring_first, consumed, stream_ring(e, call, me, c, 0),
                           static_cast<int64_t>(call.ring_rows) * call.slot_bytes};
    return receive_channel<T, V, S>(e, call, ch);
}

template <typename T, typename V, typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    stream_combine_kernel(Ctx c, CombineArgs a, int64_t slot_bytes, int ring_rows, int channels) {
    const Env e = make_env(c, kKernelStreamCombine);
    const int64_t x_bytes = static_cast<int64_t>(a.hidden) * sizeof(T);
    const StreamCall call{a, slot_bytes, x_bytes, align_up(x_bytes, kSlotAlign), ring_rows, channels,
                          a.recv_info + 2, a.recv_info + 3 + e.num_ranks};
    if (load_volatile(e.own(kAbort)) == 0 && chosen(a.choice, a.run_if)) {
        if (blockIdx.x < channels) {
            stream_receive<T, V, S>(e, call, blockIdx.x);
            end_phase(e, kPhaseReduce, e.start);
        } else if (blockIdx.x < 2 * channels) {
            stream_send<T, V, S>(e, call, blockIdx.x - channels);
            end_phase(e, kPhasePush, e.start);
        }
    }
    finish_kernel(e, e.own(kDoneCount));
}

// A kernel built in the four shapes.
constexpr int kNumShapes = 4;
struct Shapes {
    const void* kernel[kNumShapes];  // Solo, Wide, Narrow, Full
};
constexpr int kShapeThreads[kNumShapes] = {Solo::kThreads, Wide::kThreads, Narrow::kThreads, Full::kThreads};
// 16-byte loads a block of each shape keeps in flight in its row copies.
constexpr int kShapeLoads[kNumShapes] = {Solo::kThreads * Solo::kCopyDepth, Wide::kThreads * Wide::kCopyDepth,
                                         Narrow::kThreads * Narrow::kCopyDepth, Full::kThreads * Full::kCopyDepth};
// The shapes a launch tries, first to last (indices into Shapes): Solo, Wide, Narrow, or Full, Wide,
// Narrow (Full fits wherever Solo does, so one of the two is enough).
struct ShapeOrder {
    int shape[3];
};
const ShapeOrder& shape_order(bool full_first) {
    static constexpr ShapeOrder solo_first{{0, 1, 2}}, full_first_order{{3, 1, 2}};
    return full_first ? full_first_order : solo_first;
}
// How many blocks of `kernel` this process's SMs hold at once. Occupancy does not change during a run:
// asked once per kernel (a handful of kernels per process; 15 families in four shapes at most).
int cached_resident_blocks(const void* kernel, int threads) {
    static thread_local const void* kernels[64] = {};
    static thread_local int blocks[64] = {};
    for (int i = 0; i < 64; ++i) {
        if (kernels[i] == kernel) return blocks[i];
        if (kernels[i] == nullptr) {
            kernels[i] = kernel;
            return blocks[i] = resident_blocks(kernel, threads);
        }
    }
    return resident_blocks(kernel, threads);
}

// The first shape, in the order full_first picks, that holds `blocks` blocks per kernel on every rank
// of this GPU at once; -1 when none does (*most: the blocks per kernel the last shape tried holds).
int first_fitting_shape(const Shapes& shapes, bool full_first, int64_t blocks, int ranks_on_device,
                        int sm_share_percent, bool start_together, int64_t* most) {
    // Asked once, like the occupancy: this runs before every data kernel's launch.
    static thread_local const int sms = sm_count();
    for (const int i : shape_order(full_first).shape) {
        const int own = cached_resident_blocks(shapes.kernel[i], kShapeThreads[i]);
        *most = most_resident_blocks(own, own / sms, ranks_on_device, sm_share_percent, start_together);
        if (blocks <= *most) return i;
    }
    return -1;
}

// Launches the first shape whose blocks, for every rank on this GPU, are resident together, behind a
// rendezvous kernel where ctx.rendezvous_before asks for one; none fits: an error that names the limit
// (and nothing is launched, so the ranks stay in step). launch(shape index).
template <typename Launch>
void launch_resident(const Ctx& ctx, const Shapes& shapes, const char* what, Launch launch) {
    int64_t most = 0;
    const int shape =
        first_fitting_shape(shapes, ctx.full_first, ctx.num_blocks, ctx.ranks_on_device, ctx.sm_share_percent,
                            ctx.start_together, &most);
    if (shape >= 0) {
        if (ctx.rendezvous_before != 0) {
            rendezvous_kernel<<<1, kRendezvousThreads, 0, ctx.stream>>>(ctx);
            MOE_EP_LAUNCH_CHECK("intranode rendezvous_kernel");
        }
        launch(shape);
        MOE_EP_LAUNCH_CHECK(what);
        return;
    }
    const bool shared = under_sm_share(ctx.sm_share_percent);
    const char* alive = ctx.ranks_on_device <= 1 ? "one kernel alive at a time"
                        : one_kernel_each(ctx.ranks_on_device, ctx.sm_share_percent, ctx.start_together)
                            ? "one kernel of each rank, and a waiting block of each other rank, alive together"
                            : "two kernels of each rank can be alive together";
    throw std::invalid_argument(
        "num_sms (Config): " + std::to_string(ctx.num_blocks) + " blocks per kernel with " +
        std::to_string(ctx.ranks_on_device) + " rank(s) on this GPU cannot all be resident at once (" + alive +
        (shared ? ", this process holding " + std::to_string(sm_count()) + " SMs under its MPS share of " +
                      std::to_string(ctx.sm_share_percent) + "%"
                : std::string()) +
        "): use num_sms <= " + std::to_string(most));
}

template <template <typename> class Kernel>
Shapes shapes_of() {
    return {{reinterpret_cast<const void*>(Kernel<Solo>::fn), reinterpret_cast<const void*>(Kernel<Wide>::fn),
             reinterpret_cast<const void*>(Kernel<Narrow>::fn), reinterpret_cast<const void*>(Kernel<Full>::fn)}};
}

// Launches kernel<Solo | Wide | Narrow | Full>(args...) on the first shape that fits.
template <template <typename> class Kernel, typename... Args>
void launch_shaped(const Ctx& ctx, const char* what, Args... args) {
    launch_resident(ctx, shapes_of<Kernel>(), what, [&](int i) {
        const dim3 grid(ctx.num_blocks), block(kShapeThreads[i]);
        if (i == 0) Kernel<Solo>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
        else if (i == 1) Kernel<Wide>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
        else if (i == 2) Kernel<Narrow>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
        else Kernel<Full>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
    });
}

template <typename S>
struct DispatchKernel {
    static constexpr auto fn = dispatch_kernel<S>;
};
// ------------------------------------------------------------------ zero-copy dispatch
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
// the receivers' slots at their final rows (the receiver's rows from source s start at s's
// first_row_at, in token order: the portable order). Three steps:
//  1. announce the call to every peer, with this rank's receiving layout (where its rows go in its
//     area: the host's slot, or an arena region the kernel lays out for the rows the count exchange
//     brings), and wait for every peer's announcement: a peer's slot is free once it started this
//     call (it last used the slot two zero-copy dispatches ago, and its caller finished with those
//     outputs before making this call; an arena region is free when the host hands it out);
//  2. store; the last block announces to every peer that this rank's rows are in place;
//  3. wait for every peer's rows, then copy ids, weights and source tokens out of this rank's slot
//     into the outputs (recv_x and the scales are the slot itself) and fill num_worst_tokens padding.
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
    // This rank's receiving layout: the host's, or an arena region's laid out here for the rows the
    // count exchange announced (the same formula as the host's once it knows them).
    ZeroCopyDispatchArgs receiving = z;
    if (z.region_bytes >= 0) {
        const int64_t rows = a.recv_info[1];
        const DispatchRegion d = dispatch_region(rows, a.x_bytes, a.scale_bytes, K);
        receiving.capacity_rows = d.bytes <= z.region_bytes ? rows : 0;
        receiving.x_offset = d.x, receiving.scale_offset = d.scale, receiving.idx_offset = d.idx;
        receiving.weight_offset = d.weight, receiving.src_offset = d.src;
    }
    bool ok = load_volatile(e.own(kAbort)) == 0 && chosen(a.choice, a.run_if);
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

// ------------------------------------------------------------------ zero-copy combine
// Every rank's rows already lie in mapped memory: one pass. Each rank puts its rows' weights where
// its peers read them, tells every peer its rows are in place, waits for every peer's, then sums each
// of its tokens' rows where they lie, in rank order (the windowed combine's bits).
//  - From the zero-copy combine area (Buffer.get_next_combine_buffer): every rank's rows in the same
//    slot, weights behind each row. The all-rank wait also keeps a slot safe to rewrite two combines
//    later: a rank finishes combine c + 1 only after every rank has started it, so after every rank
//    finished reading combine c.
//  - From the dispatch arena (an ordinary combine whose x lies there): each rank's rows are wherever
//    its caller put them, so each publishes where, with its announcement (the layout slots a zero-copy
//    dispatch uses: that dispatch read them before its rows were in place). x is the caller's tensor,
//    free to reuse once the call is over, so the call ends only when every peer has read this rank's
//    rows: the last block to finish its sums tells every peer, then waits for all of them.
template <typename T, typename V, typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    zero_copy_combine_kernel(Ctx c, CombineArgs a, ZeroCopyArgs z) {
    const Env e = make_env(c, kKernelZeroCopyCombine);
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32;
    const Warps warps = grid_warps<S::kWarps>();
    const int64_t x_bytes = static_cast<int64_t>(a.hidden) * sizeof(T), behind_row = align_up(x_bytes, kSlotAlign);
    const int64_t chunks = x_bytes / sizeof(V);
    const bool published = z.weights_offset >= 0;
    const int total = min(static_cast<int64_t>(a.recv_info[1]), max(z.capacity_rows, int64_t{0}));
    const int* first_row_at = a.recv_info + 3 + 2 * R;  // this rank's first row at each peer
    bool ok = load_volatile(e.own(kAbort)) == 0 && chosen(a.choice, a.run_if);
    if (ok && a.topk_weights != nullptr) {
        uint8_t* rows = z.areas[me] + z.slot_offset;
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < static_cast<int64_t>(total) * K;
             i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
            float* to = published ? reinterpret_cast<float*>(z.areas[me] + z.weights_offset) + i
                                  : reinterpret_cast<float*>(rows + (i / K) * z.pitch + behind_row) + i % K;
            *to = a.topk_weights[i];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kPushCount), gridDim.x) && chosen(a.choice, a.run_if))
        for (int r = 0; r < R; ++r) {
            if (published) {
                int64_t* layout = reinterpret_cast<int64_t*>(e.signals(r) + layout_index(R, me, 0));
                layout[kCombineRows] = z.slot_offset, layout[kCombineCapacity] = z.capacity_rows;
                layout[kCombinePitch] = z.pitch, layout[kCombineWeights] = z.weights_offset;
            }
            raise_flag(e.peer_array(r, kZeroCopyReadyFrom, me), tag(e.seq, 0));  // fences the layout first
        }
    ok = ok && block_wait(e, kZeroCopyReadyFrom, 0, R, tag(e.seq, 0), kErrPushed, 0);
    // Where every rank's rows are: the same slot everywhere, or as each rank published it.
    __shared__ int64_t from_rows[kMaxRanks], from_capacity[kMaxRanks], from_pitch[kMaxRanks], from_weights[kMaxRanks];
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        if (published) {
            const int64_t* layout = reinterpret_cast<const int64_t*>(e.own(layout_index(R, r, 0)));
            from_rows[r] = __ldcg(layout + kCombineRows), from_capacity[r] = __ldcg(layout + kCombineCapacity);
            from_pitch[r] = __ldcg(layout + kCombinePitch), from_weights[r] = __ldcg(layout + kCombineWeights);
            // A rank that had no room for its rows published a negative capacity: its rows count as not
            // sent here, and this rank's host reports it once this call is launched, or at the next
            // combine if the kernel ran later (that rank raised at once).
            if (ok && blockIdx.x == 0 && from_capacity[r] < 0 && r != me)
                reinterpret_cast<volatile int*>(e.host)[kHostCombineMissing] = r + 1;
        } else {
            from_rows[r] = z.slot_offset, from_capacity[r] = z.capacity_rows, from_pitch[r] = z.pitch;
            from_weights[r] = -1;
        }
    }
    __syncthreads();
    if (ok) {
        for (int64_t t = warps.warp; t < a.num_tokens; t += warps.num_warps) {
            uint64_t sent = 0;
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                // A row past a slot's capacity was never received (num_worst_tokens too small: that
                // dispatch reported it); it counts as not sent rather than read out of bounds.
                const bool here = r < R && a.send_pos[t * R + r] >= 0 &&
                                  first_row_at[r] + a.send_pos[t * R + r] < from_capacity[r];
                sent |= static_cast<uint64_t>(__ballot_sync(kFullMask, here)) << r0;
            }
            const auto row_index = [&](int r) { return static_cast<int64_t>(first_row_at[r] + a.send_pos[t * R + r]); };
            const auto row_of = [&](int r) { return z.areas[r] + from_rows[r] + row_index(r) * from_pitch[r]; };
            const auto weights_of = [&](int r) {
                return reinterpret_cast<const float*>(from_weights[r] < 0 ? row_of(r) + behind_row
                                                                           : z.areas[r] + from_weights[r] + row_index(r) * K * 4);
            };
            sum_token<T, V, S>(a, t, chunks, 0, chunks, sent, row_of, weights_of, true, lane);
        }
    }
    if (published) {
        __shared__ bool last;
        __syncthreads();
        if (threadIdx.x == 0) {
            last = ok && arrive_last(e.own(kReduceCount), gridDim.x);
            if (last)
                for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kPushedFrom, me), tag(e.seq, 1));
        }
        __syncthreads();
        if (last) block_wait(e, kPushedFrom, 0, R, tag(e.seq, 1), kErrReleased, 0);
    }
    finish_kernel(e, e.own(kDoneCount));
}

template <typename T, typename V>
struct ZeroCopyCombineKernels {
    template <typename S>
    struct Of {
        static constexpr auto fn = zero_copy_combine_kernel<T, V, S>;
    };
};
template <typename T, typename V>
struct CombineKernels {
    template <typename S>
    struct Of {
        static constexpr auto fn = combine_kernel<T, V, S>;
    };
};
template <typename T, typename V>
struct StreamCombineKernels {
    template <typename S>
    struct Of {
        static constexpr auto fn = stream_combine_kernel<T, V, S>;
    };
};

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

}  // namespace

void check_blocks_fit(const Ctx& ctx) {
    // The combine kernels have the same shapes (launch bounds, no dynamic shared memory).
    launch_resident(ctx, shapes_of<DispatchKernel>(), "check_blocks_fit", [](int) {});
}

int fitted_blocks(int budget, int ranks_on_device, bool full_first, int sm_share_percent, bool start_together) {
    if (ranks_on_device <= 1) return budget;  // one block an SM up to the SM count: nothing to gain
    // The answer depends only on the arguments (occupancy does not change during a run): kept per thread,
    // one entry per shape order, since dispatches and combines alternate.
    struct Answer {
        int budget = -1, ranks = -1, share = -1;
        bool together = false;
        int blocks = 0;
    };
    static thread_local Answer last[2];
    Answer& answer = last[full_first ? 1 : 0];
    if (budget == answer.budget && ranks_on_device == answer.ranks && sm_share_percent == answer.share &&
        start_together == answer.together)
        return answer.blocks;
    // Every shape's rate follows the loads its threads keep in flight, so those are counted (4 ranks on
    // one H200 at a budget of 24: 16 Solo blocks keep 98K in flight where 24 Wide ones keep 74K); a tie
    // keeps the budget (the largest count is tried first and only a strict gain moves off it).
    const Shapes shapes = shapes_of<DispatchKernel>();
    int blocks = budget;
    int64_t most = 0;
    // Even counts only, as budgets are (Config): the streaming combine pairs a receiving and a sending
    // block per channel.
    for (int b = budget; b >= 2; b -= 2) {
        int64_t fitting = 0;
        const int shape =
            first_fitting_shape(shapes, full_first, b, ranks_on_device, sm_share_percent, start_together, &fitting);
        if (shape >= 0 && static_cast<int64_t>(b) * kShapeLoads[shape] > most) {
            most = static_cast<int64_t>(b) * kShapeLoads[shape];
            blocks = b;
        }
    }
    answer = {budget, ranks_on_device, sm_share_percent, start_together, blocks};
    return blocks;
}

int dispatch_window_tokens(int num_ranks, int64_t num_nvl_bytes, int64_t x_bytes, int64_t scale_bytes, int num_topk) {
    const int64_t half = half_bytes(num_nvl_bytes, num_ranks);
    const int64_t tokens = half / dispatch_slot(num_ranks, x_bytes, scale_bytes, num_topk).bytes;  // slot >= 16 bytes
    return static_cast<int>(tokens < (1 << 22) ? tokens : (1 << 22));
}

int combine_window_tokens(int num_ranks, int64_t num_nvl_bytes, int64_t x_bytes, int num_topk) {
    const int64_t half = half_bytes(num_nvl_bytes, num_ranks), slot = combine_slot_bytes(x_bytes, num_topk);
    if (slot == 0) return 0;  // an empty row: nothing to hold
    const int64_t tokens = half / (slot * num_ranks);
    return static_cast<int>(tokens < (1 << 22) ? tokens : (1 << 22));
}

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

void agree(const Ctx& ctx, const AgreeArgs& args) {
    agree_kernel<<<1, kAgreeThreads, 0, ctx.stream>>>(ctx, args);
    MOE_EP_LAUNCH_CHECK("intranode agree_kernel");
}

void dispatch(const Ctx& ctx, const DispatchArgs& args) {
    if (ctx.num_ranks > kMaxRanks) throw std::runtime_error("moe_ep: intranode dispatch supports at most 64 ranks");
    const DispatchSlot slot = dispatch_slot(ctx.num_ranks, args.x_bytes, args.scale_bytes, args.num_topk);
    const int window = dispatch_window_tokens(ctx.num_ranks, ctx.num_nvl_bytes, args.x_bytes, args.scale_bytes, args.num_topk);
    if (window < 1) throw std::runtime_error("moe_ep: the intranode buffer cannot hold one dispatch slot");
    launch_shaped<DispatchKernel>(ctx, "intranode dispatch_kernel", args, slot, window);
}

// The streaming combine needs a receiving and a sending block per channel.
static int stream_channels(const Ctx& ctx) { return std::min(ctx.num_blocks / 2, kStreamChannels); }

int stream_ring_rows(const Ctx& ctx, int64_t x_bytes, int num_topk) {
    const int channels = stream_channels(ctx);
    if (!ctx.stream_combine || ctx.num_ranks > kMaxStreamRanks || channels < 1) return 0;
    const int64_t rows = 2 * half_bytes(ctx.num_nvl_bytes, ctx.num_ranks) /
                         (channels * ctx.num_ranks * combine_slot_bytes(x_bytes, num_topk));
    return static_cast<int>(std::min<int64_t>(rows, 1 << 20));
}

// Bytes per row of a combine's x, once the limits both combines share hold: a 64-bit mask of senders
// per token, and rows of whole 8-byte vectors.
static int64_t combine_row_bytes(const Ctx& ctx, const CombineArgs& args) {
    if (ctx.num_ranks > kMaxRanks) throw std::runtime_error("moe_ep: intranode combine supports at most 64 ranks");
    const int64_t x_bytes = static_cast<int64_t>(args.hidden) * (args.dtype == DType::kFloat32 ? 4 : 2);
    if (x_bytes % 8 != 0) throw std::runtime_error("moe_ep: intranode combine needs rows of a multiple of 8 bytes");
    return x_bytes;
}

void combine(const Ctx& ctx, const CombineArgs& args) {
    const int64_t x_bytes = combine_row_bytes(ctx, args);
    const int window = combine_window_tokens(ctx.num_ranks, ctx.num_nvl_bytes, x_bytes, args.num_topk);
    if (window < 1) throw std::runtime_error("moe_ep: the intranode buffer cannot hold one combine window");
    const int64_t slot = combine_slot_bytes(x_bytes, args.num_topk);
    // Outputs and biases are whole rows of x_bytes: 16-byte vectors when every row starts aligned.
    const bool wide = x_bytes % 16 == 0;
    const int rows = stream_ring_rows(ctx, x_bytes, args.num_topk);
    if (rows > 0)
        launch_for_rows<StreamCombineKernels>(ctx, "intranode stream_combine_kernel", args.dtype, wide, args, slot, rows,
                                              stream_channels(ctx));
    else
        launch_for_rows<CombineKernels>(ctx, "intranode combine_kernel", args.dtype, wide, args, slot, window);
}

void zero_copy_dispatch(const Ctx& ctx, const DispatchArgs& args, const ZeroCopyDispatchArgs& z) {
    if (ctx.num_ranks > kMaxRanks) throw std::runtime_error("moe_ep: intranode dispatch supports at most 64 ranks");
    if (!ctx.zero_copy_bases) throw std::runtime_error("moe_ep: zero-copy dispatch needs a notify that found the peers' rows");
    // Rows and scales of whole 16-byte vectors (x and the areas start aligned): each vector is read
    // once for all destinations.
    const bool wide = args.x_bytes % 16 == 0 && args.scale_bytes % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(args.x) % 16 == 0 && reinterpret_cast<uintptr_t>(args.scales) % 16 == 0 &&
                      z.slot_offset % 16 == 0 && z.x_offset % 16 == 0 && z.scale_offset % 16 == 0;
    if (wide) launch_shaped<ZeroCopyDispatchKernels<true>::Of>(ctx, "intranode zero_copy_dispatch_kernel", args, z);
    else launch_shaped<ZeroCopyDispatchKernels<false>::Of>(ctx, "intranode zero_copy_dispatch_kernel", args, z);
}

void zero_copy_combine(const Ctx& ctx, const CombineArgs& args, const ZeroCopyArgs& z) {
    if (!ctx.zero_copy_bases) throw std::runtime_error("moe_ep: zero-copy combine needs a dispatch that found the peers' rows");
    const int64_t x_bytes = combine_row_bytes(ctx, args);
    launch_for_rows<ZeroCopyCombineKernels>(ctx, "intranode zero_copy_combine_kernel", args.dtype, x_bytes % 16 == 0, args, z);
}

}  // namespace intranode
}  // namespace moe_ep
