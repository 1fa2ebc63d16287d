// Device-side pieces every kernel family that talks to peers' buffers shares: tagged flags that only
// grow, waits with a deadline that report to the host instead of trapping, last-arrival counters,
// and warp-wide row copies.
#pragma once

#include <cstdint>

#include "api.cuh"

namespace moe_ep {
namespace peer {

// A flag value: which kernel (sequence number) and which step of it (window, count...) it announces.
__device__ __forceinline__ uint64_t tag(uint64_t seq, int step) { return seq << 24 | static_cast<uint64_t>(step + 1); }

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t load_volatile(const uint64_t* p) { return *reinterpret_cast<const volatile uint64_t*>(p); }
__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Raise a flag to at least `value`, after this thread's (and, through the caller's fences, its
// block's) earlier writes.
__device__ __forceinline__ void raise_flag(uint64_t* flag, uint64_t value) {
    __threadfence_system();
    atomicMax_system(reinterpret_cast<unsigned long long*>(flag), static_cast<unsigned long long>(value));
}

// Thread 0, after the block's writes: true for the last of `num_blocks` arrivals, which also resets
// the counter (a counter's next use must wait on a flag raised after the reset). `one_device`: every
// rank's kernels run on this GPU, so every reader of the block's writes is within GPU scope and the
// arriving block's fence can be a GPU-scope one; the last block still fences at system scope before
// what it raises, which the host may read. The low-latency kernels (a block per token, so a fence per
// token) pass it: 1-3% off their dispatch and 5-7% off the zero-copy combine at 8 PEs; the intranode
// kernels (few long blocks) gained nothing measurable and keep the system-scope fence.
__device__ __forceinline__ bool arrive_last(uint64_t* counter, int num_blocks, bool one_device = false) {
    if (one_device) __threadfence();
    else __threadfence_system();
    const unsigned long long previous = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
    if (previous + 1 != static_cast<unsigned long long>(num_blocks)) return false;
    atomicExch(reinterpret_cast<unsigned long long*>(counter), 0ull);
    __threadfence_system();
    return true;
}

// Where a failed wait goes: the first failure claims the host record (HostInfo in api.cuh), and the
// abort flag makes every other wait of this rank give up at once.
struct Failure {
    uint64_t* abort;
    uint64_t* claim;
    int* host;
    uint64_t deadline;
    // The waited-for peer's progress mark, its start time and its blocks started (intranode:
    // kStartedMark, kStartedAt, kBlocksStarted in its signals), recorded with the failure; null where
    // the kernels keep none (low-latency).
    const uint64_t* peer_started = nullptr;
};

__device__ __forceinline__ void report_timeout(const Failure& f, int kind, int peer, int window, uint64_t target,
                                               uint64_t seen) {
    if (atomicCAS(reinterpret_cast<unsigned long long*>(f.claim), 0ull, 1ull) == 0ull) {
        volatile int* host = f.host;
        host[intranode::kHostErrorKind] = kind;
        host[intranode::kHostErrorPeer] = peer;
        host[intranode::kHostErrorWindow] = window;
        // Call numbers tell a peer that is late (seen < wanted) from one that is out of step.
        host[intranode::kHostErrorCall] = static_cast<int>((target >> 24) & 0x7fffffff);
        host[intranode::kHostErrorSeen] = seen == 0 ? -1 : static_cast<int>((seen >> 24) & 0x7fffffff);
        host[intranode::kHostErrorPeerStarted] = -1;  // no progress marks (low-latency kernels)
        if (f.peer_started != nullptr) {
            const uint64_t mark = load_volatile(f.peer_started), at = load_volatile(f.peer_started + 1), now = now_ns();
            host[intranode::kHostErrorPeerStarted] = static_cast<int>(mark);
            const uint64_t ms = at == 0 || at > now ? 0 : (now - at) / 1000000;
            host[intranode::kHostErrorPeerStartedMs] = static_cast<int>(ms < 0x7fffffff ? ms : 0x7fffffff);
            host[intranode::kHostErrorPeerBlocks] = static_cast<int>(load_volatile(f.peer_started + 2));
            host[intranode::kHostErrorBlocks] = static_cast<int>(gridDim.x);
        }
        __threadfence_system();
        host[intranode::kHostError] = 1;
    }
    atomicExch(reinterpret_cast<unsigned long long*>(f.abort), 1ull);
    __threadfence_system();
}

// One thread waits for *flag >= target; false after a timeout (reported) or another wait's failure.
__device__ __forceinline__ bool wait_flag(const Failure& f, const uint64_t* flag, uint64_t target, int kind, int peer,
                                          int window) {
    uint64_t seen;
    while ((seen = load_acquire(flag)) < target) {
        if (load_volatile(f.abort) != 0) return false;
        if (now_ns() > f.deadline) {
            report_timeout(f, kind, peer, window, target, seen);
            return false;
        }
    }
    return true;
}

// ------------------------------------------------------------------ warp-wide row copies
enum class Src { kReadOnly, kShared };  // user input (cacheable) / memory other ranks write during the kernel

template <Src kSrc, typename V>
__device__ __forceinline__ V load(const V* p) {
    if constexpr (kSrc == Src::kReadOnly) return __ldg(p);
    else return __ldcg(p);
}

// One trip of kDepth loads in flight per lane, then their stores (into `also` as well unless it is
// null), if the lane has that many vectors left (a lane takes every `lanes`-th vector from its first, i).
template <Src kSrc, int kDepth, int lanes, typename V>
__device__ __forceinline__ bool copy_trip(V* dst, V* also, const V* src, int64_t n, int64_t& i) {
    if (i + (kDepth - 1) * lanes >= n) return false;
    V v[kDepth];
#pragma unroll
    for (int j = 0; j < kDepth; ++j) v[j] = load<kSrc>(src + i + j * lanes);
#pragma unroll
    for (int j = 0; j < kDepth; ++j) dst[i + j * lanes] = v[j];
    if (also != nullptr) {
#pragma unroll
        for (int j = 0; j < kDepth; ++j) also[i + j * lanes] = v[j];
    }
    i += kDepth * lanes;
    return true;
}

// `lanes` lanes copy n vectors, this one from vector `lane` on; kDepth: loads in flight per lane
// (registers: kDepth vectors). The vectors a lane has left after its full trips go in trips of 8, 4, 2
// and 1 (at most one each): a row's tail costs a memory latency per set bit of its size, not one per
// vector (an fp8 row of 7,168 bytes left 2 vectors a lane after two trips of 6, a bf16 one 4 after
// four). A single trip masked per vector spilled (DESIGN.md, "Two-pass calls (no arena)").
template <Src kSrc, int kDepth, int lanes, typename V>
__device__ __forceinline__ void copy_vectors(V* dst, V* also, const V* src, int64_t n, int lane) {
    static_assert(kDepth >= 1 && kDepth <= 16, "the tail trips cover at most 15 vectors a lane");
    int64_t i = lane;
    while (copy_trip<kSrc, kDepth, lanes>(dst, also, src, n, i)) {
    }
    if constexpr (kDepth > 8) copy_trip<kSrc, 8, lanes>(dst, also, src, n, i);
    if constexpr (kDepth > 4) copy_trip<kSrc, 4, lanes>(dst, also, src, n, i);
    if constexpr (kDepth > 2) copy_trip<kSrc, 2, lanes>(dst, also, src, n, i);
    if constexpr (kDepth > 1) copy_trip<kSrc, 1, lanes>(dst, also, src, n, i);
}

// `lanes` lanes (this one the lane-th) copy `bytes` bytes into dst and, unless it is null, into `also`,
// in the widest vectors the sizes and addresses allow, kDepth loads in flight per lane.
template <Src kSrc, int kDepth, int lanes>
__device__ __forceinline__ void lanes_copy(void* dst, void* also, const void* src, int64_t bytes, int lane) {
    const auto bits = static_cast<uint64_t>(bytes) | reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(also) |
                      reinterpret_cast<uintptr_t>(src);
    if (bits % 16 == 0)
        copy_vectors<kSrc, kDepth, lanes>(static_cast<int4*>(dst), static_cast<int4*>(also), static_cast<const int4*>(src), bytes / 16, lane);
    else if (bits % 8 == 0)
        copy_vectors<kSrc, kDepth, lanes>(static_cast<int2*>(dst), static_cast<int2*>(also), static_cast<const int2*>(src), bytes / 8, lane);
    else if (bits % 4 == 0)
        copy_vectors<kSrc, kDepth, lanes>(static_cast<int*>(dst), static_cast<int*>(also), static_cast<const int*>(src), bytes / 4, lane);
    else
        for (int64_t i = lane; i < bytes; i += lanes) {
            static_cast<uint8_t*>(dst)[i] = static_cast<const uint8_t*>(src)[i];
            if (also != nullptr) static_cast<uint8_t*>(also)[i] = static_cast<const uint8_t*>(src)[i];
        }
}

// A warp copies `bytes` bytes, kDepth loads in flight per lane (6 fits kernels of 64 registers per thread).
template <Src kSrc, int kDepth = 6>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
    lanes_copy<kSrc, kDepth, 32>(dst, nullptr, src, bytes, lane);
}

// A warp copies two rows of `bytes` bytes each, a half-warp each, so that a lane's trips carry twice
// the vectors: an fp8 row of 7,168 bytes costs a lane 2 trips of 16-byte loads at depth 12 (12 + 2
// vectors), two rows on half-warps 3 (12 + 12 + 4), and their scales (224 bytes each) one trip for both
// instead of one each. Where `two` is false the whole warp copies the first row. kPairs false: `two`
// must be false (one instantiation, no more registers than one row's copy: at depth 6, in kernels of
// 64 registers, the pairs lost 1.5% on bf16 rows at 4 ranks: `moe-ep-bench intranode --ranks 4 8 --sms 24
// --modes dispatch_bf16`, A/B). A row goes to `also` as well where that
// is not null (the same registers stored twice: the source is read once).
template <Src kSrc, int kDepth, bool kPairs>
__device__ __forceinline__ void warp_copy_rows(void* dst0, void* also0, const void* src0, void* dst1, void* also1,
                                               const void* src1, int64_t bytes, bool two, int lane) {
    if constexpr (kPairs) {
        if (two) {
            const bool second = lane >= 16;
            lanes_copy<kSrc, kDepth, 16>(second ? dst1 : dst0, second ? also1 : also0, second ? src1 : src0, bytes, lane % 16);
            return;
        }
    }
    lanes_copy<kSrc, kDepth, 32>(dst0, also0, src0, bytes, lane);
}

}  // namespace peer
}  // namespace moe_ep
