// Row copies through the Tensor Memory Accelerator (sm_90 `cp.async.bulk`): one lane of a warp moves
// a row global -> shared -> global in chunks of a few kilobytes, several chunks in flight, without
// holding a register per byte in flight. A register copy (peer_sync.cuh, warp_copy) keeps at most
// 6-12 vectors per lane in flight, so the kernels' bytes in flight per SM are bounded by registers;
// here they are bounded by shared memory (up to ~200 KB per SM). An experiment against warp_copy,
// switched on with MOE_EP_BULK_COPY=1 (DESIGN.md, "Where the speed stands").
//
// Ordering: rows other ranks wrote (and published with a flag this block acquired) are read by the
// async proxy, so each copy starts with a proxy fence; bulk stores complete asynchronously, so a warp
// drains its stores (and fences them back to the generic proxy) before its block raises a flag.
#pragma once

#include <cstdint>

#include "peer_sync.cuh"

namespace moe_ep {
namespace bulk {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MOE_EP_BULK_COPY_AVAILABLE 1
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One warp's staging area: kStages chunks of kChunkBytes and an mbarrier each, in dynamic shared
// memory. Only lane 0 issues and waits; `phases` holds, per stage, the parity its next completion has.
template <int kStages, int kChunkBytes>
struct WarpStaging {
    static_assert(kStages >= 2 && kChunkBytes % 16 == 0, "bulk copies move 16-byte multiples");
    static constexpr int kChunkArea = kStages * kChunkBytes;  // a warp's chunks (16-byte multiple)
    static constexpr int kBarrierArea = kStages * 8;          // a warp's mbarriers

    uint8_t* chunks = nullptr;  // null: bulk copies off (warp_copy instead)
    uint64_t* barriers = nullptr;
    uint32_t phases = 0;
    int next = 0;  // stage of the next chunk

    // A block of `warps` warps lays out its shared memory as [every warp's chunks | every warp's
    // barriers]: warps * (kChunkArea + kBarrierArea) bytes from `area` (16-byte aligned), or null.
    __device__ void init(uint8_t* area, int warp, int warps, int lane) {
        if (area == nullptr) return;
        chunks = area + warp * kChunkArea;
        barriers = reinterpret_cast<uint64_t*>(area + warps * kChunkArea + warp * kBarrierArea);
#ifdef MOE_EP_BULK_COPY_AVAILABLE
        if (lane == 0) {
            for (int s = 0; s < kStages; ++s)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barriers + s)) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
#else
        (void)lane;
#endif
    }
    __device__ bool on() const { return chunks != nullptr; }

#ifdef MOE_EP_BULK_COPY_AVAILABLE
    __device__ void load(int stage, const uint8_t* src, uint32_t bytes) {
        const uint32_t bar = shared_address(barriers + stage);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(shared_address(chunks + stage * kChunkBytes)), "l"(src), "r"(bytes), "r"(bar)
                     : "memory");
    }
    __device__ void wait_loaded(int stage) {
        const uint32_t bar = shared_address(barriers + stage), parity = (phases >> stage) & 1u;
        uint32_t done = 0;
        while (!done) {
            asm volatile(
                "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        }
        phases ^= 1u << stage;
    }
    __device__ void store(int stage, uint8_t* dst, uint32_t bytes) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     ::"l"(dst), "r"(shared_address(chunks + stage * kChunkBytes)), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    template <int kPending>
    __device__ static void wait_stores_read() {  // all but the kPending newest stores have read their chunk
        asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
    }
#endif

    // The warp copies `bytes` from src to dst (both 16-byte aligned, bytes a multiple of 16; anything
    // else goes through warp_copy). Chunk k + kStages - 1 is loaded while chunk k is stored.
    template <peer::Src kSrc, int kDepth>
    __device__ void copy(void* dst, const void* src, int64_t bytes, int lane) {
#ifdef MOE_EP_BULK_COPY_AVAILABLE
        const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                               static_cast<uint64_t>(bytes)) % 16) == 0;
        if (on() && aligned && bytes > 0) {
            if (lane == 0) {
                const auto* from = static_cast<const uint8_t*>(src);
                auto* to = static_cast<uint8_t*>(dst);
                const int n = static_cast<int>((bytes + kChunkBytes - 1) / kChunkBytes);
                const auto size = [&](int k) {
                    const int64_t rest = bytes - static_cast<int64_t>(k) * kChunkBytes;
                    return static_cast<uint32_t>(rest < kChunkBytes ? rest : kChunkBytes);
                };
                const int first = next;
                // Rows peers wrote were acquired through the generic proxy; the loads below use the async one.
                asm volatile("fence.proxy.async.global;" ::: "memory");
                // Stages rotate over all chunks a warp ever copies, so chunk c reuses the stage of store
                // c - kStages: with one store (the newest) allowed pending, every stage loaded below is free.
                wait_stores_read<1>();
                for (int k = 0; k < kStages - 1 && k < n; ++k) load((first + k) % kStages, from + int64_t(k) * kChunkBytes, size(k));
                for (int k = 0; k < n; ++k) {
                    const int stage = (first + k) % kStages;
                    wait_loaded(stage);
                    store(stage, to + int64_t(k) * kChunkBytes, size(k));
                    const int ahead = k + kStages - 1;  // goes into the stage chunk k - 1 was stored from
                    if (ahead < n) {
                        wait_stores_read<1>();
                        load((first + ahead) % kStages, from + int64_t(ahead) * kChunkBytes, size(ahead));
                    }
                }
                next = (first + n) % kStages;
            }
            __syncwarp();
            return;
        }
#endif
        peer::warp_copy<kSrc, kDepth>(dst, src, bytes, lane);
    }

    // Before the block publishes what this warp wrote: every store complete and visible to the
    // generic proxy (the flag's release and the peers' loads).
    __device__ void drain(int lane) {
#ifdef MOE_EP_BULK_COPY_AVAILABLE
        if (on() && lane == 0) {
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            asm volatile("fence.proxy.async.global;" ::: "memory");
        }
        __syncwarp();
#else
        (void)lane;
#endif
    }
};

}  // namespace bulk
}  // namespace moe_ep
