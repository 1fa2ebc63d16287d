// What every intranode kernel (notify, rendezvous, dispatch, combine, and their zero-copy forms; one
// file each beside this one) shares on the device: the view of the buffers and the call each block
// starts from, the waits for peers, the end of a kernel, and the warps' places in the grid.
//
// Cross-rank flags carry tags (kernel sequence number, window) and only grow (atomicMax), so a flag
// of an earlier call never satisfies a wait of a later one, and every wait has a deadline: a peer
// that never arrives is reported to the host record and all blocks return; nothing traps.
//
// Every helper here is inlined into the kernels that call it (each kernel file is its own translation
// unit, without relocatable device code).
#pragma once

#include <cstdint>

#include "../api.cuh"
#include "../buffer_layout.cuh"
#include "../peer_sync.cuh"

namespace moe_ep {
namespace intranode {

constexpr unsigned kFullMask = 0xffffffffu;

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

    // kHostKernelStarted / kHostKernelFinished's value for this kernel (ProgressMark).
    __device__ int progress_mark() const {
        return kernel << kMarkCallBits | static_cast<int>(seq & ((1u << kMarkCallBits) - 1));
    }

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

__device__ __forceinline__ Env make_env(const Ctx& c, KernelId kernel) {
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
__device__ __forceinline__ bool wait_flag(const Env& e, const uint64_t* flag, uint64_t target, int kind, int from_rank,
                                          int window) {
    return peer::wait_flag(e.failure(from_rank), flag, target, kind, from_rank, window);
}

// The whole block waits for flags[peer] >= target for every peer in [first, last).
__device__ __forceinline__ bool block_wait(const Env& e, SignalArray array, int first, int last, uint64_t target, int kind,
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
__device__ __forceinline__ uint64_t end_phase(const Env& e, int phase, uint64_t since) {
    if (e.wait_ns == nullptr) return 0;
    const uint64_t now = now_ns();
    if (threadIdx.x == 0) e.wait_ns[phase] += now - since;
    return now;
}

// Thread 0 of a kernel's last block: the host record says it finished, and the sequence number the
// next kernel's tags use advances.
__device__ __forceinline__ void end_of_kernel(const Env& e) {
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

__device__ __forceinline__ void finish_kernel(const Env& e, uint64_t* done_counter) {
    __syncthreads();
    if (threadIdx.x == 0 && e.wait_ns != nullptr) e.wait_ns[kWaitSlots - 1] += now_ns() - e.start;
    if (threadIdx.x == 0 && arrive_last(done_counter, gridDim.x)) end_of_kernel(e);
}

// Whether a two-pass kernel queued behind a one-pass kernel (PathChoice) runs: always without one. A
// kernel not chosen returns before it touches a flag or a counter, alike on every rank.
__device__ __forceinline__ bool chosen(const int* choice) { return choice == nullptr || __ldcg(choice) == 0; }

// A one-pass kernel's choice of its call's path, from every rank's announcement of its room (each block
// makes the same one from the same announcements); block 0 records it (PathChoice).
__device__ __forceinline__ void record_choice(const Env& e, const PathChoice& path, bool one_pass) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    *path.choice = one_pass;
    if (one_pass && path.one_pass_calls != nullptr) atomicAdd(path.one_pass_calls, 1);
    volatile int* host = reinterpret_cast<volatile int*>(e.host);
    host[kHostChoice] = one_pass;
    __threadfence_system();
    host[kHostChoiceDone] = path.nonce;
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

// The kernel's blocks and this warp's place among all their warps. (Blocks split by role, some only
// staging or pushing and the others only pulling or reducing, were measured and lost: DESIGN.md,
// "Two-pass calls (no arena)".)
struct Warps {
    int blocks, warp, num_warps;
};
template <int kWarps>
__device__ Warps grid_warps() {
    return {static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32,
            static_cast<int>(gridDim.x) * kWarps};
}

// Padding rows [first, last) of a num_worst_tokens dispatch: no data, no expert. x_rows and scale_rows
// are where the outputs' rows lie (the output tensors, or a zero-copy slot).
__device__ __forceinline__ void pad_rows(const DispatchArgs& a, uint8_t* x_rows, uint8_t* scale_rows, int64_t first,
                                         int64_t last, const Warps& warps, int lane) {
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

}  // namespace intranode
}  // namespace moe_ep
