// Low-latency dispatch and combine (decode): fixed-size receive regions (room for max tokens per
// expert and source), and a split into a send kernel that waits for nothing and a receive (the hook:
// a one-block wait kernel and a copy kernel) that waits for the peers' flags, so no block is resident
// while data is in flight. Between mapped ranks the rows are pulled: a send stores each row once in
// its own buffer (the dispatch's outbox; a plain combine's staged rows) and pushes only small index
// entries, and the receivers read the rows from there (eight ranks on one GPU pushing rows into each
// other's buffers took several times longer for the same bytes).
//
// Call number c uses half c % 2 of every rank's buffer. Every (source rank, local expert) pair has one
// flag per half; the sender raises it to tag(call, count) after its rows, so a flag of an earlier call
// never passes for a later one and no flag is ever cleaned. The call number lives in the buffer's
// header and the receive kernel's last block advances it, so eager calls and CUDA-graph replays (of
// any number of calls) keep alternating halves on every rank alike.
//
// Peers that loads and stores cannot reach (another host; a null entry in the buffer table) get the
// rows through NVSHMEM puts in the build with NVSHMEM's device library (moe_ep._internode compiles this
// file so: internode/low_latency_puts.cu): the row is staged in this rank's send region (registered
// memory, which an RDMA transport reads from), put into the peer's receive region, and the flag
// follows as a signal once this rank's puts are complete.
#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

#include "api.cuh"
#include "buffer_layout.cuh"
#include "cuda_check.cuh"
#include "early_launch.cuh"
#include "fp8_block.cuh"
#include "peer_sync.cuh"

namespace moe_ep {
namespace low_latency {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A receive is two kernels: one block waits for the peers' flags, then the copy kernel, which waits
// for nothing, runs on as many blocks as its work wants (blocks that spin must leave the SMs to the
// peers' sends when ranks share a GPU; blocks that only copy need not, and a few spinning blocks
// copying alone made the receives latency-bound).
constexpr int kWaitThreads = 256;          // wait kernels: a warp per expert, a lane per source rank
// Dispatch receive: a warp per row. Blocks of 256 threads: a 1024-thread block needed a whole SM free
// of other blocks, which with 8 PEs' sends and receives sharing the GPU is rare (and their 8 x 32
// blocks took two waves of the 132 SMs). Three per SM: each holds its warps' bulk-copy stages (64 KB of
// shared memory), so no more fit, and the bound leaves ptxas 85 registers (64 spilled).
constexpr int kRecvThreads = 256;
constexpr int kRecvBlocksPerSm = 3;
constexpr int kCombineRecvThreads = 512;   // combine receive: a thread per (token, 16 bytes)
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kCountBits = 24;  // peer::tag keeps the step (here: a row count) in the low 24 bits

using peer::arrive_last;
using peer::load_acquire;
using peer::load_volatile;
using peer::raise_flag;
using peer::Src;
using peer::tag;
using peer::warp_copy;

struct Env {
    uint8_t* const* buffers;
    int rank, num_ranks, num_local, max_tokens, hidden, num_experts;
    Regions g;
    int64_t half_offset;
    int* host;
    uint64_t seq, deadline;
    bool one_device;  // every rank on this GPU (arrive_last)

    __device__ uint64_t* header(int r) const { return reinterpret_cast<uint64_t*>(buffers[r]); }
    // This rank's send region: scratch of the send kernel (no peer touches it).
    __device__ int* send_scratch() const { return reinterpret_cast<int*>(buffers[rank] + half_offset); }
    __device__ uint8_t* recv(int r) const { return buffers[r] + half_offset + g.send; }
    // Rank r's rows of a zero-copy combine in host slot `slot`: [L, R * max, H] bf16 in the send region
    // of half `slot`, behind the send kernel's scratch (the slot alternates per combine on the host, the half
    // per call on the device). A combine that pushes stages row g for its put at row g of its own slot, so
    // zero-copy rows are put from where they lie.
    __device__ const uint8_t* zero_copy_rows(int r, int slot) const {
        return buffers[r] + kHeaderBytes + slot * g.half + g.zero_copy_offset;
    }
    __device__ uint64_t* signals(int r) const { return reinterpret_cast<uint64_t*>(buffers[r] + half_offset + g.send + g.recv); }
    // Peers without a mapping (null) are reached through NVSHMEM puts.
    __device__ bool reachable(int r) const { return buffers[r] != nullptr; }
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
    // Byte `offset` of any rank's buffer as NVSHMEM names it (this rank's own address: the symmetric
    // heap has the same layout on every PE).
    __device__ uint8_t* symmetric(int64_t offset) const { return buffers[rank] + offset; }
#endif
    // Rank r's dispatch message of token t in this call (messages `pitch` apart in its outbox, in the
    // send region of the call's half): the receive reads it there when rank r is mapped here.
    __device__ uint8_t* outbox(int r, int64_t t, int64_t pitch) const {
        return buffers[r] + half_offset + g.outbox_offset + t * pitch;
    }
    __device__ peer::Failure failure() const {
        return {header(rank) + kAbort, header(rank) + kErrorClaim, host, deadline};
    }
    __device__ bool aborted() const { return load_volatile(header(rank) + kAbort) != 0; }
};

__device__ Env make_env(const Ctx& c) {
    Env e;
    e.buffers = c.buffers;
    e.rank = c.rank;
    e.num_ranks = c.num_ranks;
    e.num_local = c.num_experts / c.num_ranks;
    e.max_tokens = c.num_max_tokens;
    e.hidden = c.hidden;
    e.num_experts = c.num_experts;
    e.g = regions(c.num_max_tokens, c.hidden, c.num_ranks, c.num_experts);
    e.host = c.host_info;
    e.seq = load_volatile(reinterpret_cast<uint64_t*>(c.buffers[c.rank]) + kSeq);
    e.half_offset = kHeaderBytes + static_cast<int64_t>(e.seq & 1) * e.g.half;
    e.deadline = peer::now_ns() + c.timeout_ns;
    e.one_device = c.ranks_on_device == c.num_ranks;
    return e;
}

#ifdef MOE_EP_TIMELINE
__device__ unsigned long long g_timeline[kTimelineCalls][kTimelineColumns];
#endif
// Thread 0 of a block stamps the timeline (api.cuh); nothing without MOE_EP_TIMELINE.
__device__ __forceinline__ void stamp_first(uint64_t seq, int column) {
#ifdef MOE_EP_TIMELINE
    if (threadIdx.x == 0) atomicMin(&g_timeline[seq % kTimelineCalls][column], peer::now_ns());
#endif
}
__device__ __forceinline__ void stamp_last(uint64_t seq, int column) {
#ifdef MOE_EP_TIMELINE
    if (threadIdx.x == 0) atomicMax(&g_timeline[seq % kTimelineCalls][column], peer::now_ns());
#endif
}
// Once every thread of the block is done (a barrier only in the timeline build: all threads reach it).
__device__ __forceinline__ void stamp_block_done(uint64_t seq, int column) {
#ifdef MOE_EP_TIMELINE
    __syncthreads();
    stamp_last(seq, column);
#endif
}
__device__ __forceinline__ void stamp_start(uint64_t seq, int kind) {  // a send block's start
    stamp_first(seq, kSendFirstStart);
    stamp_last(seq, kSendLastStart);
#ifdef MOE_EP_TIMELINE
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        g_timeline[seq % kTimelineCalls][kCallNumber] = seq;
        g_timeline[seq % kTimelineCalls][kCallKind] = kind;
    }
#endif
}

// Read once per block: the loops after it hold barriers, which every thread of the block must reach.
__device__ bool block_not_aborted(const Env& e) {
    __shared__ bool ok;
    if (threadIdx.x == 0) ok = !e.aborted();
    __syncthreads();
    return ok;
}

// A wait kernel's end: every flag is in (or the wait gave up), so the receive's copy kernel may be
// scheduled; it waits for this kernel's end before it reads anything.
__device__ void let_receive_start(const Env& e) {
    stamp_block_done(e.seq, kWaitSeen);
    __syncthreads();
    let_dependents_start();
    wait_for_prerequisite();
}

// The receive kernel ends the call: its last block advances the call number.
__device__ void finish_call(const Env& e) {
    __syncthreads();
    stamp_last(e.seq, kRecvLastEnd);
    if (threadIdx.x == 0 && arrive_last(e.header(e.rank) + kRecvDone, gridDim.x, e.one_device))
        atomicAdd(reinterpret_cast<unsigned long long*>(e.header(e.rank) + kSeq), 1ull);
}

// Rank r's flag `index` (of the call's half) set to `value`: a release store, or for a peer reached
// through puts a signal, which the caller issues once its puts are complete.
__device__ void raise_flag_at(const Env& e, int r, int64_t index, uint64_t value) {
    if (e.reachable(r)) {
        raise_flag(e.signals(r) + index, value);
        return;
    }
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
    uint64_t* flags = reinterpret_cast<uint64_t*>(e.symmetric(e.half_offset + e.g.send + e.g.recv));
    nvshmemx_signal_op(flags + index, value, NVSHMEM_SIGNAL_SET, r);
#endif
}

// Before a block's arrival: the puts its threads issued are complete at their targets (so that the
// flags raised after the arrival find the bytes in place).
__device__ void complete_puts(bool issued) {
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
    if (issued) nvshmem_quiet();
#endif
}

__device__ __forceinline__ int scale_bytes(int hidden, bool use_fp8, bool use_ue8m0) {
    const int blocks = hidden / fp8::kBlock;
    if (!use_fp8) return 0;
    return use_ue8m0 ? (blocks + fp8::kUe8m0PerWord - 1) / fp8::kUe8m0PerWord * 4 : blocks * 4;
}

// Bytes of a dispatch message's row and scales.
__device__ __forceinline__ int64_t message_payload(int hidden, bool use_fp8, bool use_ue8m0) {
    return use_fp8 ? hidden + scale_bytes(hidden, true, use_ue8m0) : static_cast<int64_t>(hidden) * 2;
}

// A dispatch's index entry for an expert row: the source token and pick k, and the call number (so that
// a receiver never takes an entry left from an earlier call for one of this call).
constexpr int kPickBits = 5;  // k < kMaxTopk
__device__ __forceinline__ int2 index_entry(int token, int k, uint64_t seq) {
    return make_int2(token, static_cast<int>((static_cast<unsigned>(seq) << kPickBits) | static_cast<unsigned>(k)));
}
__device__ __forceinline__ bool entry_of_call(int2 entry, uint64_t seq) {
    return static_cast<unsigned>(entry.y) >> kPickBits == (static_cast<unsigned>(seq) & (~0u >> kPickBits));
}
__device__ __forceinline__ int entry_pick(int2 entry) { return entry.y & ((1 << kPickBits) - 1); }

#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
// Two int32 as the 64-bit word they make in memory (`low` first), for a put by value; built unsigned,
// as the call number in an index entry reaches the sign bit.
__device__ __forceinline__ long long word_of(int low, int high) {
    return static_cast<long long>(static_cast<unsigned>(low) |
                                  (static_cast<unsigned long long>(static_cast<unsigned>(high)) << 32));
}
#endif

constexpr int kBlocksPerPiece = 32 / fp8::kLanesPerBlock;        // a warp casts 4 blocks at once
constexpr int kPieceColumns = kBlocksPerPiece * fp8::kBlock;      // 512

// A warp casts columns [piece * 512, +512) of a bf16 row to e4m3 once, with the cast kernel's own lane
// code (fp8_block.cuh, so the bits equal fp8.cu's and fp8.py's), and stores them and their scales
// (after the row: out + hidden) into the message `out`.
__device__ void cast_piece_to(const __nv_bfloat16* row, uint8_t* out, int hidden, int piece, bool round_scale,
                              bool use_ue8m0, int lane) {
    const int blocks = hidden / fp8::kBlock, sub = lane % fp8::kLanesPerBlock;
    const int b = piece * kBlocksPerPiece + lane / fp8::kLanesPerBlock;
    const bool active = b < blocks;
    float v[fp8::kElemsPerLane];
    if (active) {
        fp8::load_lane(row + b * fp8::kBlock + sub * fp8::kElemsPerLane, v);
    } else {
#pragma unroll
        for (int i = 0; i < fp8::kElemsPerLane; ++i) v[i] = 0.f;
    }
    alignas(16) uint8_t q[fp8::kElemsPerLane];
    const float scale = fp8::cast_lane(v, round_scale, q);  // every lane takes part in the shuffles
    const uint4 values = *reinterpret_cast<const uint4*>(q);
    uint8_t* scales = out + hidden;
    if (active) {
        *reinterpret_cast<uint4*>(out + b * fp8::kBlock + sub * fp8::kElemsPerLane) = values;
        if (sub == 0) {
            if (use_ue8m0) scales[b] = fp8::ue8m0_byte(scale);
            else reinterpret_cast<float*>(scales)[b] = scale;
        }
    } else if (use_ue8m0 && sub == 0 && b < scale_bytes(hidden, true, true)) {
        scales[b] = 0;  // the pad bytes of the last UE8M0 word are zero, as in the cast kernel
    }
}

constexpr int kMaxListed = 1024;  // tokens per rank and call, so rows per expert and call too
constexpr int kMaxTopk = 32;      // config.NUM_MAX_TOPK: a lane per pick

// Bytes of a bf16 row one work item copies: four 16-byte vectors per lane.
constexpr int kCopyVectors = 4;
constexpr int64_t kCopyPieceBytes = 32 * 16 * kCopyVectors;

// A warp copies bytes [piece * 2 KB, +2 KB) of a bf16 row into the message `out`.
__device__ void copy_piece_to(const uint8_t* row, uint8_t* out, int64_t row_bytes, int piece, int lane) {
    const int64_t first = piece * kCopyPieceBytes;
    uint4 v[kCopyVectors];
#pragma unroll
    for (int j = 0; j < kCopyVectors; ++j) {
        const int64_t at = first + (static_cast<int64_t>(j) * 32 + lane) * 16;
        if (at < row_bytes) v[j] = __ldg(reinterpret_cast<const uint4*>(row + at));
    }
#pragma unroll
    for (int j = 0; j < kCopyVectors; ++j) {
        const int64_t at = first + (static_cast<int64_t>(j) * 32 + lane) * 16;
        if (at < row_bytes) *reinterpret_cast<uint4*>(out + at) = v[j];
    }
}

// A block per token (looping when the grid is smaller): the token's row is read, and in fp8 cast,
// once and stored once, as the token's message in this rank's outbox, where every mapped rank whose
// experts it picked reads it (a rank reached through puts gets it put into its region, at the token's
// place in this rank's stretch of that rank's messages). Each pick writes its entry in its rank's
// index: its slot, its place among its expert's entries in entry order (the portable backend's order;
// the block's warps count it over their own stretches of the earlier entries), names the token and
// pick, and the slot raises its expert's row count. The last block to finish raises the count flags;
// nothing waits here, so a block may return at any point before that.
// Four blocks per SM (64 registers), as ptxas chose before the put path: without the bound it still
// picks 64 and spills. With NVSHMEM's device calls in the kernel it needs more than 64: no bound.
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
constexpr int kSendMinBlocks = 1;
#else
constexpr int kSendMinBlocks = 4;
#endif
__global__ void __launch_bounds__(kThreads, kSendMinBlocks) dispatch_send_kernel(Ctx c, const __nv_bfloat16* __restrict__ x, int num_tokens,
                                                                 const int64_t* __restrict__ topk_idx, int num_topk,
                                                                 bool use_fp8, bool round_scale, bool use_ue8m0,
                                                                 int* __restrict__ recv_count) {
    __shared__ int earlier[kWarps][kMaxTopk];  // per warp: entries of its stretch before pick k with its expert
    // The token's message in this rank's outbox (nullptr: the token picks no expert).
    __shared__ uint8_t* message;
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
    __shared__ int64_t put_at[kMaxTopk];       // pick k's message offset in its rank's buffer
    __shared__ int put_to[kMaxTopk];           // the rank a pick is put to, or -1
#endif
    __shared__ bool stop, last, issued_puts;
    // The wait kernel after this one (one block, polling flags) may start now: what it waits for is
    // in the flags, not in this kernel's end.
    let_dependents_start();
    const Env e = make_env(c);
    stamp_start(e.seq, kTimelineDispatch);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // Nothing has arrived before the hook: the receive kernel writes the real counts later on this stream.
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < e.num_local; i += kThreads) recv_count[i] = 0;
    if (threadIdx.x == 0) {
        stop = e.aborted();
        issued_puts = false;
    }
    __syncthreads();
    // A token picks an expert at most once (distinct top-k), so at most max_tokens rows per expert;
    // the cap only keeps repeated ids from writing past the slots.
    const int capacity = min(kMaxListed, e.max_tokens);
    const int64_t payload = message_payload(e.hidden, use_fp8, use_ue8m0), pitch = dispatch_message_pitch(payload);
    // Every rank's index, and (for puts) this rank's stretch of every rank's messages: offsets in the
    // buffers.
    const int64_t index_at = e.half_offset + e.g.send;
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
    const int64_t stretch_at = index_at + dispatch_messages_offset(e.num_experts, e.max_tokens) +
                               dispatch_message_at(e.rank, 0, e.max_tokens, pitch);
#endif
    const int64_t row_bytes = static_cast<int64_t>(e.hidden) * 2;
    const int pieces = use_fp8 ? (e.hidden + kPieceColumns - 1) / kPieceColumns
                               : static_cast<int>((row_bytes + kCopyPieceBytes - 1) / kCopyPieceBytes);
    for (int t = blockIdx.x; !stop && t < num_tokens; t += gridDim.x) {
        const int64_t first = static_cast<int64_t>(t) * num_topk;
        // Lane k: pick k's expert. Ids out of range (unchecked unless MOE_EP_DEBUG=1) are not sent, as
        // no block of the expert-major send ever matched them.
        int64_t picked = lane < num_topk ? topk_idx[first + lane] : -1;
        if (picked >= e.num_experts) picked = -1;
        const int picked_rank = picked >= 0 ? static_cast<int>(picked / e.num_local) : -1;
        int count = 0;
        for (int64_t base = static_cast<int64_t>(warp) * 32; base < first + num_topk; base += kWarps * 32) {
            const int64_t entry = base + lane;
            const int64_t id = entry < first + num_topk ? topk_idx[entry] : -1;
            for (int k = 0; k < num_topk; ++k) {
                const int64_t expert = __shfl_sync(kFullMask, picked, k);
                const unsigned hits = __ballot_sync(kFullMask, expert >= 0 && id == expert && entry < first + k);
                if (lane == k) count += __popc(hits);
            }
        }
        if (lane < num_topk) earlier[warp][lane] = count;
        __syncthreads();
        int to = -1;
        if (warp == 0) {  // lane k: pick k
            const int k = lane;
            int slot = 0;
            for (int w = 0; w < kWarps && k < num_topk; ++w) slot += earlier[w][k];
            // Only repeated ids (unchecked unless MOE_EP_DEBUG=1) reach the cap; such rows are not sent.
            const int dst = k < num_topk && slot < capacity ? picked_rank : -1;
            const int local = static_cast<int>(picked - static_cast<int64_t>(dst) * e.num_local);
            // Every pick writes its index entry at its rank. The row is stored once, in this rank's
            // outbox, where mapped ranks read it, as the zero-copy combine reads its rows (eight sends
            // pushing rows into each other's buffers at once took ~4x one send's time on one GPU);
            // a rank reached through puts gets it once, by its first pick there.
            const int64_t entry_at = index_at + dispatch_index_entry(local, e.rank, slot, e.num_ranks, e.max_tokens) *
                                                    kIndexEntryBytes;
            // Slots of an expert's entries run 0, 1, ...: the largest + 1 is its row count, gathered
            // here by every block at once rather than counted afterwards by the last one.
            if (dst >= 0) atomicMax(e.send_scratch() + picked, slot + 1);
            if (dst >= 0 && e.reachable(dst)) {
                *reinterpret_cast<int2*>(e.buffers[dst] + entry_at) = index_entry(t, k, e.seq);
            } else if (dst >= 0) {
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
                const int2 entry = index_entry(t, k, e.seq);  // by value; the row below
                nvshmem_longlong_p(reinterpret_cast<long long*>(e.symmetric(entry_at)), word_of(entry.x, entry.y), dst);
#endif
            }
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
            // (Every lane takes part in the match: a lane left out of it would hang the warp.)
            const unsigned same_rank = __match_any_sync(kFullMask, dst);
            if (dst >= 0 && !e.reachable(dst) && __ffs(same_rank) - 1 == lane) {
                put_at[k] = stretch_at + static_cast<int64_t>(t) * pitch;
                to = dst;
                issued_puts = true;
            }
            if (k < num_topk) put_to[k] = to;
#endif
            const bool sent = __any_sync(kFullMask, dst >= 0);
            if (lane == 0) message = sent ? e.outbox(e.rank, t, pitch) : nullptr;
        }
        const bool puts = __syncthreads_or(to >= 0);
        const __nv_bfloat16* row = x + static_cast<int64_t>(t) * e.hidden;
        // A token that picks no expert has no message and stores nothing.
        for (int piece = warp; message != nullptr && piece < pieces; piece += kWarps) {
            if (use_fp8) cast_piece_to(row, message, e.hidden, piece, round_scale, use_ue8m0, lane);
            else copy_piece_to(reinterpret_cast<const uint8_t*>(row), message, row_bytes, piece, lane);
        }
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
        if (puts) {
            __threadfence_system();  // the outbox row, written by every warp, before a transport reads it
            __syncthreads();
            for (int k = warp; k < num_topk; k += kWarps)
                if (put_to[k] >= 0) nvshmemx_putmem_nbi_warp(e.symmetric(put_at[k]), message, payload, put_to[k]);
        }
#else
        (void)puts;
#endif
        __syncthreads();  // `earlier`, `message` and the puts' entries are rewritten for the next token
    }
    complete_puts(issued_puts);
    __syncthreads();  // every warp's stores before the arrival
    stamp_last(e.seq, kSendLastEnd);
    if (threadIdx.x == 0) last = arrive_last(e.header(e.rank) + kSendDone, gridDim.x, e.one_device);
    __syncthreads();
    if (!last) return;
    // Each expert's row count (the blocks' largest slot + 1), raised as its flag and zeroed for the
    // call after next in this half (also after an abort, whose blocks stopped counting part way).
    int* rows_of = e.send_scratch();
    for (int expert = threadIdx.x; expert < e.num_experts; expert += kThreads) {
        const int rows = __ldcg(rows_of + expert), dst = expert / e.num_local, local = expert % e.num_local;
        rows_of[expert] = 0;
        if (!stop) raise_flag_at(e, dst, static_cast<int64_t>(local) * e.num_ranks + e.rank, tag(e.seq, rows));
    }
    stamp_block_done(e.seq, kFlagsRaised);
}

// Waits for every (local expert, source rank) count flag of this call (a warp per expert, a lane per
// source) and writes each local expert's row count. A count flag is tag(call, rows) >= tag(call, 0)
// for any row count, and below it for every earlier call.
__global__ void __launch_bounds__(kWaitThreads) dispatch_wait_kernel(Ctx c, int* __restrict__ recv_count,
                                                                     int* __restrict__ stats) {
    const Env e = make_env(c);
    stamp_last(e.seq, kWaitStart);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    bool ok = !e.aborted();
    for (int local = warp; local < e.num_local; local += kWaitThreads / 32) {
        int total = 0;
        for (int s0 = 0; s0 < e.num_ranks; s0 += 32) {
            const int s = s0 + lane;
            int rows = 0;
            if (ok && s < e.num_ranks) {
                const uint64_t* flag = e.signals(e.rank) + static_cast<int64_t>(local) * e.num_ranks + s;
                ok = peer::wait_flag(e.failure(), flag, tag(e.seq, 0), intranode::kErrLowLatencyDispatch, s,
                                     e.rank * e.num_local + local);
                if (ok) rows = static_cast<int>(load_acquire(flag) & ((1u << kCountBits) - 1)) - 1;
            }
            total += __reduce_add_sync(kFullMask, rows);
        }
        ok = __all_sync(kFullMask, ok);
        if (!ok) break;
        if (lane == 0) {  // after this rank's own flag, so after the send kernel zeroed the counts
            recv_count[local] = total;
            if (stats != nullptr) stats[local] += total;
        }
    }
    let_receive_start(e);
}

// The last of `n` ranges whose start (`starts`, ascending) is at or before i: with the starts of
// the experts' rows, the expert of row i (experts without rows share their start with the next one).
__device__ __forceinline__ int range_of(const int* starts, int n, int i) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Warp-wide, the starts of n consecutive ranges from their sizes: first[0] = 0 and first[i + 1] =
// size(0) + ... + size(i), 32 sizes at a time (size(i) is asked by the lane that takes i).
template <typename Size>
__device__ __forceinline__ void warp_range_starts(int* first, int n, Size size, int lane) {
    int carry = 0;
    for (int base = 0; base < n; base += 32) {
        int sum = base + lane < n ? size(base + lane) : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int below = __shfl_up_sync(kFullMask, sum, d);
            if (lane >= d) sum += below;
        }
        if (base + lane < n) first[base + lane + 1] = carry + sum;
        carry += __shfl_sync(kFullMask, sum, 31);
    }
    if (lane == 0) first[0] = 0;
}

// The receive's count tables in bytes, rounded up to 128 (the bulk-copy stages follow them).
__host__ __device__ __forceinline__ int64_t recv_table_bytes(int num_local, int num_ranks) {
    return (4LL * (static_cast<int64_t>(num_local) * (num_ranks + 1) + num_local + 1) + 127) / 128 * 128;
}

// A warp's bulk copy of a row (sm_90's bulk-copy unit: global -> shared -> global, issued by one lane,
// so the warp's other lanes and the SM's issue slots stay free while the bytes move; with 8 PEs on one
// H200 the dispatch took ~5 us less than with the lanes' 16-byte loads and stores). Each warp owns
// kBulkChunk bytes of staging and an mbarrier that counts the bytes landing there.
constexpr int kBulkChunk = 8192;
struct BulkStage {
    uint8_t* bytes;
    uint64_t* bar;
    unsigned phase;
};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bulk_init(BulkStage& st) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(st.bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    st.phase = 0;
}
// Lane 0 only: `bytes` (a multiple of 16, 16-byte aligned ends) from src to dst through the stage.
__device__ __forceinline__ void bulk_copy(BulkStage& st, uint8_t* dst, const uint8_t* src, int64_t bytes) {
    const unsigned bar = shared_address(st.bar), stage = shared_address(st.bytes);
    for (int64_t at = 0; at < bytes; at += kBulkChunk) {
        const unsigned n = static_cast<unsigned>(bytes - at < kBulkChunk ? bytes - at : kBulkChunk);
        // The stage is free once the previous chunk's store has read it.
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(stage),
                     "l"(src + at), "r"(n), "r"(bar)
                     : "memory");
        unsigned done = 0;
        while (!done)
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                         : "=r"(done)
                         : "r"(bar), "r"(st.phase)
                         : "memory");
        st.phase ^= 1;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + at), "r"(stage), "r"(n) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}
// Lane 0: every store issued is complete (before the kernel's end is announced).
__device__ __forceinline__ void bulk_drain() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// After the flags' acquire: the bulk unit's reads (another proxy) see what the acquire made visible.
__device__ __forceinline__ void bulk_acquire_fence() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
constexpr bool kHaveBulk = true;
#else
__device__ __forceinline__ void bulk_init(BulkStage&) {}
__device__ __forceinline__ void bulk_copy(BulkStage&, uint8_t*, const uint8_t*, int64_t) {}
__device__ __forceinline__ void bulk_drain() {}
__device__ __forceinline__ void bulk_acquire_fence() {}
constexpr bool kHaveBulk = false;
#endif

// After dispatch_wait_kernel: every block reads the counts in the flags (final by now) into shared
// memory, then its warps take the received rows in the packed order (by expert, then source rank, then
// slot: the portable order), a warp per row, and copy each from the message its index entry names (in
// the source's outbox, or for a source that puts in this rank's region); on sm_90 the row itself goes
// through the bulk-copy unit, the scales (a few hundred bytes, not always a multiple of 16) by the lanes.
__global__ void __launch_bounds__(kRecvThreads, kRecvBlocksPerSm) dispatch_recv_kernel(Ctx c, int num_topk, bool use_fp8, bool use_ue8m0,
                                                                 uint8_t* __restrict__ recv_x, uint8_t* __restrict__ recv_scales,
                                                                 int* __restrict__ recv_src_info, bool with_stages) {
    wait_for_prerequisite();  // the wait kernel's end: every flag final, or the call aborted
    // [L][R + 1]: the first packed row of each (local expert, source) within the expert's rows, then the
    // expert's total; then [L + 1]: each expert's first row among all received rows, then the total.
    // Then each warp's bulk-copy stage and its mbarrier.
    extern __shared__ __align__(128) int tables[];
    const Env e = make_env(c);
    const int R = e.num_ranks, L = e.num_local, lane = threadIdx.x % 32;
    int* first_of = tables;
    int* first_row = tables + static_cast<int64_t>(L) * (R + 1);
    const int64_t table_bytes = recv_table_bytes(L, R);
    stamp_first(e.seq, kRecvFirstStart);
    if (block_not_aborted(e)) {  // else the wait kernel gave up: nothing to copy
        for (int i = threadIdx.x; i < L * R; i += blockDim.x) {
            const uint64_t* flag = e.signals(e.rank) + i;  // flag of (local i / R, source i % R)
            first_of[(i / R) * (R + 1) + i % R + 1] = static_cast<int>(load_acquire(flag) & ((1u << kCountBits) - 1)) - 1;
        }
        __syncthreads();
        for (int local = threadIdx.x; local < L; local += blockDim.x) {  // counts -> exclusive prefix
            int* row = first_of + static_cast<int64_t>(local) * (R + 1);
            row[0] = 0;
            for (int s = 1; s <= R; ++s) row[s] += row[s - 1];
        }
        __syncthreads();
        if (threadIdx.x < 32)  // warp 0: each expert's first row, from the experts' totals
            warp_range_starts(first_row, L, [&](int local) { return first_of[local * (R + 1) + R]; }, lane);
        __syncthreads();
        const int64_t x_bytes = use_fp8 ? e.hidden : static_cast<int64_t>(e.hidden) * 2;
        const int64_t s_bytes = scale_bytes(e.hidden, use_fp8, use_ue8m0);
        const int64_t pitch = dispatch_message_pitch(message_payload(e.hidden, use_fp8, use_ue8m0));
        const int2* index = reinterpret_cast<const int2*>(e.recv(e.rank));
        const uint8_t* messages = e.recv(e.rank) + dispatch_messages_offset(e.num_experts, e.max_tokens);
        const int64_t rows_per_expert = static_cast<int64_t>(R) * e.max_tokens;
        const int warps = gridDim.x * (blockDim.x / 32);
        // This warp's stage, behind the tables (table_bytes, 128-byte aligned).
        BulkStage stage{};
        const bool bulk = kHaveBulk && with_stages && x_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(recv_x) % 16 == 0;
        if (bulk && lane == 0) {
            uint8_t* base = reinterpret_cast<uint8_t*>(tables) + table_bytes;
            stage.bytes = base + (threadIdx.x / 32) * kBulkChunk;
            stage.bar = reinterpret_cast<uint64_t*>(base + kWarps * kBulkChunk) + threadIdx.x / 32;
            bulk_init(stage);
            bulk_acquire_fence();
        }
        for (int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < first_row[L]; i += warps) {
            const int local = range_of(first_row, L, i), within = i - first_row[local];
            const int* first = first_of + static_cast<int64_t>(local) * (R + 1);
            const int s = range_of(first, R, within);
            const int2 entry = __ldcg(index + dispatch_index_entry(local, s, within - first[s], R, e.max_tokens));
            // Only with repeated ids can an entry of the counted rows be one this call did not write.
            if (!entry_of_call(entry, e.seq) || entry_pick(entry) >= num_topk || entry.x < 0 || entry.x >= e.max_tokens)
                continue;
            const int64_t row = local * rows_per_expert + within;
            // A mapped source's row waits in its outbox; a source that puts sent it into this region.
            const uint8_t* message = e.reachable(s) ? e.outbox(s, entry.x, pitch)
                                                    : messages + dispatch_message_at(s, entry.x, e.max_tokens, pitch);
            if (lane == 0) recv_src_info[row] = (s * e.max_tokens + entry.x) * num_topk + entry_pick(entry);
            if (bulk) {
                if (lane == 0) bulk_copy(stage, recv_x + row * x_bytes, message, x_bytes);
            } else {
                warp_copy<Src::kShared>(recv_x + row * x_bytes, message, x_bytes, lane);
            }
            if (s_bytes > 0) warp_copy<Src::kShared>(recv_scales + row * s_bytes, message + e.hidden, s_bytes, lane);
        }
        if (bulk && lane == 0) bulk_drain();
    }
    finish_call(e);
}

// Every received row back to the (token, slot) slot of its source rank, or in a zero-copy combine only
// the row's index (the source rank reads the row from this rank's buffer); the last block raises every
// rank's flag, which publishes the rows (or the indices, and the caller's rows) alike.
// The work is the received rows only (a warp per row, a thread per index in a zero-copy combine): the
// slots hold L x R x max rows, ~30x more than arrive at top-8 with 8 ranks, and walking them all cost
// a load and a branch per empty row.
__global__ void __launch_bounds__(kThreads) combine_send_kernel(Ctx c, const uint8_t* __restrict__ x,
                                                                const int* __restrict__ recv_count,
                                                                const int* __restrict__ recv_src_info, int num_topk,
                                                                int slot, CombineSend how) {
    extern __shared__ int first_row[];  // [num_local + 1]
    let_dependents_start();  // as in the dispatch send: the wait kernel after this one polls flags
    const Env e = make_env(c);
    stamp_start(e.seq, kTimelineCombine);
    const int lane = threadIdx.x % 32, warp_id = blockIdx.x * kWarps + threadIdx.x / 32, num_warps = gridDim.x * kWarps;
    const int64_t rows_per_expert = static_cast<int64_t>(e.num_ranks) * e.max_tokens, row_bytes = e.hidden * 2LL;
    bool issued_puts = false;  // this thread's
    if (threadIdx.x < 32)  // warp 0: each expert's first row, from the experts' counts
        warp_range_starts(first_row, e.num_local, [&](int local) { return recv_count[local]; }, lane);
    __syncthreads();
    const int total = first_row[e.num_local];
    // A row's place in the slots (g) and in its source's combine buffer (entry, of source s).
    const auto locate = [&](int i, int64_t& g, int& s, int64_t& entry) {
        const int local = range_of(first_row, e.num_local, i);
        g = local * rows_per_expert + (i - first_row[local]);
        const int info = recv_src_info[g], k = info % num_topk, t = info / num_topk % e.max_tokens;
        s = info / num_topk / e.max_tokens;
        entry = static_cast<int64_t>(t) * num_topk + k;
    };
    // This rank's rows of the combine's slot: where rows are staged, for the tokens' ranks to read or to put.
    uint8_t* const own_slot = const_cast<uint8_t*>(e.zero_copy_rows(e.rank, slot));
    if (!e.aborted()) {
        int64_t g, entry;
        int s;
        if (how == CombineSend::kStage) {
            // A plain combine with every rank mapped: each row is copied into this rank's zero-copy rows
            // of the combine's slot (a local store), and the token's rank reads it there as in a zero-copy
            // combine (a load from a peer's buffer): pushing the rows into the token ranks' buffers
            // made eight combines on one GPU three times slower than eight zero-copy ones.
            for (int i = warp_id; i < total; i += num_warps) {
                locate(i, g, s, entry);
                warp_copy<Src::kReadOnly>(own_slot + g * row_bytes, x + g * row_bytes, row_bytes, lane);
                if (lane == 0) reinterpret_cast<int*>(e.recv(s))[entry] = static_cast<int>(g);
            }
        } else if (how == CombineSend::kInSlot) {
            for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
                locate(i, g, s, entry);
                reinterpret_cast<int*>(e.recv(s))[entry] = static_cast<int>(g);
            }
        } else {
            for (int i = warp_id; i < total; i += num_warps) {
                locate(i, g, s, entry);
                // The row's place in its source's buffer.
                const int64_t at = e.half_offset + e.g.send + entry * e.g.combine_message;
                if (e.reachable(s)) {
                    warp_copy<Src::kReadOnly>(e.buffers[s] + at, x + g * row_bytes, row_bytes, lane);
                    continue;
                }
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
                // Staged in the combine's own slot (registered memory a transport can read), then put; the
                // rows of a zero-copy combine are there already. Never the other slot: a caller may have
                // filled it for another combine.
                uint8_t* const staged = own_slot + g * row_bytes;
                if (staged != x + g * row_bytes) warp_copy<Src::kReadOnly>(staged, x + g * row_bytes, row_bytes, lane);
                __threadfence_system();
                __syncwarp();
                nvshmemx_putmem_nbi_warp(e.symmetric(at), staged, row_bytes, s);
                issued_puts = true;
#endif
            }
        }
    }
    complete_puts(__syncthreads_or(issued_puts));
    __syncthreads();
    stamp_last(e.seq, kSendLastEnd);
    if (threadIdx.x == 0 && arrive_last(e.header(e.rank) + kSendDone, gridDim.x, e.one_device)) {
        for (int r = 0; r < e.num_ranks; ++r) raise_flag_at(e, r, e.num_experts + e.rank, tag(e.seq, 0));
        stamp_last(e.seq, kFlagsRaised);
    }
}

// Tokens a combine receive block takes per step: their picks' setup (a chain of dependent loads) is
// paid once per step, so a step should hold many 16-byte items per thread.
constexpr int kCombineStepTokens = 8;

// Waits for every rank's combine rows (a lane per source rank).
__global__ void __launch_bounds__(kWaitThreads) combine_wait_kernel(Ctx c) {
    const Env e = make_env(c);
    stamp_last(e.seq, kWaitStart);
    for (int s = threadIdx.x; s < e.num_ranks && !e.aborted(); s += blockDim.x)
        peer::wait_flag(e.failure(), e.signals(e.rank) + e.num_experts + s, tag(e.seq, 0),
                        intranode::kErrLowLatencyCombine, s, -1);
    let_receive_start(e);
}

// After combine_wait_kernel: per token acc = acc + (weight * row) over the slots in order.
__global__ void __launch_bounds__(kCombineRecvThreads) combine_recv_kernel(Ctx c, const int64_t* __restrict__ topk_idx,
                                                                const float* __restrict__ topk_weights, int num_tokens,
                                                                int num_topk, __nv_bfloat16* __restrict__ out,
                                                                int zero_copy_slot) {
    __shared__ const uint8_t* pick_row[kCombineStepTokens * kMaxTopk];  // nullptr: the pick was not sent
    __shared__ float pick_weight[kCombineStepTokens * kMaxTopk];
    wait_for_prerequisite();  // the wait kernel's end
    const Env e = make_env(c);
    stamp_first(e.seq, kRecvFirstStart);
    // The wait kernel saw every rank's flag; this block acquires them again (they are final) so that its
    // reads of the rows are ordered after the senders' writes, as in the dispatch receive.
    if (threadIdx.x == 0)
        for (int s = 0; s < e.num_ranks; ++s) (void)load_acquire(e.signals(e.rank) + e.num_experts + s);
    if (block_not_aborted(e)) {  // the wait kernel gave up: nothing to sum
        // Per step, a block takes a few tokens: first the rows and weights of their picks go to shared
        // memory (in a zero-copy combine a row's index is a load before the row's own: done once per
        // pick, not once per 16 bytes of it), then a thread per (token, 16-byte vector of eight bf16)
        // loads up to kSlotBatch rows at once and adds them in pick order.
        constexpr int kSlotBatch = 8;
        const int chunks = e.hidden / 8;
        // Few blocks take many tokens per step; many blocks one each.
        const int per_step = min(kCombineStepTokens, max(1, (num_tokens + gridDim.x - 1) / gridDim.x));
        const uint8_t* slots = e.recv(e.rank);
        for (int t0 = blockIdx.x * per_step; t0 < num_tokens; t0 += gridDim.x * per_step) {
            const int n = min(per_step, num_tokens - t0);
            for (int i = threadIdx.x; i < n * num_topk; i += blockDim.x) {
                const int64_t entry = static_cast<int64_t>(t0) * num_topk + i;
                const int64_t expert = topk_idx[entry];
                const uint8_t* row = nullptr;
                // Zero copy: the expert's rank left the row's index here; the row is in its buffer.
                if (expert >= 0)
                    row = zero_copy_slot < 0
                        ? slots + entry * e.g.combine_message
                        : e.zero_copy_rows(static_cast<int>(expert / e.num_local), zero_copy_slot) +
                              static_cast<int64_t>(__ldcg(reinterpret_cast<const int*>(slots) + entry)) * e.hidden * 2;
                pick_row[i] = row;
                pick_weight[i] = expert >= 0 ? topk_weights[entry] : 0.f;
            }
            __syncthreads();
            for (int item = threadIdx.x; item < n * chunks; item += blockDim.x) {
                const int j = item / chunks, chunk = item % chunks;
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (int k0 = 0; k0 < num_topk; k0 += kSlotBatch) {
                    int4 v[kSlotBatch];
#pragma unroll
                    for (int i = 0; i < kSlotBatch; ++i) {
                        const uint8_t* row = k0 + i < num_topk ? pick_row[j * num_topk + k0 + i] : nullptr;
                        if (row != nullptr) v[i] = __ldcg(reinterpret_cast<const int4*>(row) + chunk);
                    }
#pragma unroll
                    for (int i = 0; i < kSlotBatch; ++i) {
                        if (k0 + i >= num_topk || pick_row[j * num_topk + k0 + i] == nullptr) continue;
                        const float weight = pick_weight[j * num_topk + k0 + i];
                        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[i]);
#pragma unroll
                        for (int b = 0; b < 8; ++b) acc[b] = __fadd_rn(acc[b], __fmul_rn(weight, __bfloat162float(h[b])));
                    }
                }
                int4 packed;
                __nv_bfloat16* p = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
                for (int b = 0; b < 8; ++b) p[b] = __float2bfloat16_rn(acc[b]);
                reinterpret_cast<int4*>(out + static_cast<int64_t>(t0 + j) * e.hidden)[chunk] = packed;
            }
            __syncthreads();  // the picks are rewritten for the next step
        }
    }
    finish_call(e);
}

int blocks_for(int64_t warps_of_work, int num_sms) {
    const int64_t needed = (warps_of_work + kWarps - 1) / kWarps;
    return static_cast<int>(needed < 1 ? 1 : (needed < num_sms ? needed : num_sms));
}

// Once per kernel and thread, before its first launch (a static's initialiser calls it): the largest
// shared-memory carveout (see prefer_max_shared_carveout; every kernel here asks for it).
bool set_up(const void* kernel) {
    prefer_max_shared_carveout(kernel);
    return true;
}

// The dispatch receive's count tables grow with the experts: past the default 48 KB of dynamic shared
// memory they need the opt-in, with the bulk-copy stages behind them (sm_90 and later only: older
// GPUs copy with the warp's lanes and need no stage).
constexpr size_t kMaxRecvTableBytes = 48 * 1024 * 2;
constexpr size_t kRecvStageBytes = kWarps * (kBulkChunk + sizeof(uint64_t));
size_t recv_table_bytes(const Ctx& ctx) {
    return static_cast<size_t>(recv_table_bytes(ctx.num_experts / ctx.num_ranks, ctx.num_ranks));
}
size_t recv_stage_bytes() { return current_device_major() >= 9 ? kRecvStageBytes : 0; }
bool allow_recv_tables(const void* kernel) {
    MOE_EP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kMaxRecvTableBytes + recv_stage_bytes())));
    return true;
}

}  // namespace

void dispatch_send(const Ctx& ctx, const void* x, int num_tokens, const int64_t* topk_idx, int num_topk, bool use_fp8,
                   bool round_scale, bool use_ue8m0, int* recv_count) {
    if (num_tokens > kMaxListed)
        throw std::invalid_argument("moe_ep: low-latency dispatch takes at most 1024 tokens per rank");
    // Checked before anything is sent: the receive (maybe a hook, later) must not be the one to refuse.
    if (recv_table_bytes(ctx) > kMaxRecvTableBytes)
        throw std::invalid_argument("moe_ep: low-latency dispatch: num_experts too large for this num_ranks (the "
                                    "receive keeps (num_experts / num_ranks) x (num_ranks + 2) + 1 counts in 96 KB)");
    static thread_local const bool ready = set_up(reinterpret_cast<const void*>(dispatch_send_kernel));
    (void)ready;
    const int blocks = std::max(1, num_tokens);  // a block per token; one raises the flags when there are none
    dispatch_send_kernel<<<blocks, kThreads, 0, ctx.stream>>>(ctx, static_cast<const __nv_bfloat16*>(x), num_tokens,
                                                              topk_idx, num_topk, use_fp8, round_scale, use_ue8m0, recv_count);
    MOE_EP_LAUNCH_CHECK("low_latency dispatch_send_kernel");
}

void dispatch_recv(const Ctx& ctx, int num_topk, bool use_fp8, bool use_ue8m0, void* recv_x, void* recv_scales,
                   int* recv_count, int* stats, int* recv_src_info, int num_sms) {
    // The tables are within kMaxRecvTableBytes (dispatch_send checked); `with_stages` tells the kernel
    // that the bulk-copy stages follow them.
    const size_t smem = recv_table_bytes(ctx) + recv_stage_bytes();
    static thread_local const bool ready = set_up(reinterpret_cast<const void*>(dispatch_wait_kernel)) &&
                                           set_up(reinterpret_cast<const void*>(dispatch_recv_kernel)) &&
                                           allow_recv_tables(reinterpret_cast<const void*>(dispatch_recv_kernel));
    (void)ready;
    launch_early(dispatch_wait_kernel, 1, kWaitThreads, 0, ctx.stream, "low_latency dispatch_wait_kernel", ctx,
                 recv_count, stats);
    // A warp per two rows a rank receives when the load is even (max tokens x top-k: 1,024 at the
    // benchmark's shape, whatever the expert count), up to two blocks per SM; a heavier load loops.
    // Fewer receive blocks leave room on the SMs for the other ranks' sends (a receive block with its
    // bulk-copy stages fills a third of an SM).
    const int64_t even_rows = static_cast<int64_t>(ctx.num_max_tokens) * num_topk;
    const int64_t warps = (even_rows + 1) / 2;
    const int64_t warps_per_block = kRecvThreads / 32;
    const int blocks = static_cast<int>(std::clamp<int64_t>((warps + warps_per_block - 1) / warps_per_block, 1, 2 * num_sms));
    launch_early(dispatch_recv_kernel, blocks, kRecvThreads, smem, ctx.stream, "low_latency dispatch_recv_kernel", ctx,
                 num_topk, use_fp8, use_ue8m0, static_cast<uint8_t*>(recv_x), static_cast<uint8_t*>(recv_scales),
                 recv_src_info, recv_stage_bytes() > 0);
}

void combine_send(const Ctx& ctx, const void* x, const int* recv_count, const int* recv_src_info, int num_topk, int num_sms,
                  int slot, CombineSend how) {
    // Rows that can have arrived: every source's tokens, each in at most min(top-k, L) of this rank's
    // experts (and at most the L x R x max slots).
    const int64_t num_local = ctx.num_experts / ctx.num_ranks;
    const int64_t rows = std::min(num_local, static_cast<int64_t>(num_topk)) * ctx.num_ranks * ctx.num_max_tokens;
    static thread_local const bool ready = set_up(reinterpret_cast<const void*>(combine_send_kernel));
    (void)ready;
    const size_t smem = sizeof(int) * (num_local + 1);
    // A thread per row's index in a zero-copy combine, else a warp per row.
    const int64_t warps = how == CombineSend::kInSlot ? (rows + 31) / 32 : rows;
    combine_send_kernel<<<blocks_for(warps, num_sms), kThreads, smem, ctx.stream>>>(ctx, static_cast<const uint8_t*>(x),
                                                                                      recv_count, recv_src_info, num_topk,
                                                                                      slot, how);
    MOE_EP_LAUNCH_CHECK("low_latency combine_send_kernel");
}

void combine_recv(const Ctx& ctx, const int64_t* topk_idx, const float* topk_weights, int num_tokens, int num_topk,
                  void* out, int num_sms, int zero_copy_slot) {
    static thread_local const bool ready = set_up(reinterpret_cast<const void*>(combine_wait_kernel)) &&
                                           set_up(reinterpret_cast<const void*>(combine_recv_kernel));
    (void)ready;
    launch_early(combine_wait_kernel, 1, kWaitThreads, 0, ctx.stream, "low_latency combine_wait_kernel", ctx);
    const int blocks = std::max(1, std::min(num_tokens, 2 * num_sms));  // a token per block at most (per_step)
    launch_early(combine_recv_kernel, blocks, kCombineRecvThreads, 0, ctx.stream, "low_latency combine_recv_kernel",
                 ctx, topk_idx, topk_weights, num_tokens, num_topk, static_cast<__nv_bfloat16*>(out), zero_copy_slot);
}

bool timeline_built() {
#ifdef MOE_EP_TIMELINE
    return true;
#else
    return false;
#endif
}

void timeline_reset() {
#ifdef MOE_EP_TIMELINE
    std::vector<unsigned long long> cleared(kTimelineCalls * kTimelineColumns, 0);
    for (int call = 0; call < kTimelineCalls; ++call)
        for (int column : {kSendFirstStart, kRecvFirstStart}) cleared[call * kTimelineColumns + column] = ~0ull;
    MOE_EP_CUDA_CHECK(cudaMemcpyToSymbol(g_timeline, cleared.data(), cleared.size() * sizeof(cleared[0])));
#else
    throw std::runtime_error("moe_ep: the timeline needs a build with MOE_EP_TIMELINE=1");
#endif
}

void timeline_read(int64_t* out) {
#ifdef MOE_EP_TIMELINE
    MOE_EP_CUDA_CHECK(cudaMemcpyFromSymbol(out, g_timeline, kTimelineCalls * kTimelineColumns * sizeof(int64_t)));
#else
    (void)out;
    throw std::runtime_error("moe_ep: the timeline needs a build with MOE_EP_TIMELINE=1");
#endif
}

}  // namespace low_latency
}  // namespace moe_ep
