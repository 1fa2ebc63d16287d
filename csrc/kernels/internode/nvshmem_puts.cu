// A device-initiated NVSHMEM put followed by its signal: the building block of the low-latency kernels'
// path to peers that loads and stores cannot reach (another host: RDMA), on its own for a test. Built
// into moe_ep._internode, with NVSHMEM's device library. A put works for every PE, reachable or not, so
// the path can be tested on one GPU; only the transport between hosts needs two of them.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../api.cuh"
#include "../cuda_check.cuh"

namespace moe_ep {
namespace nvshmem_puts {
namespace {

// One warp: `bytes` from this PE's `src` to `dst` (a symmetric address, as this PE sees it) at PE
// `pe`, then, ordered after the data, the 64-bit `signal` (symmetric) at `pe` set to `value`: the
// receiver that sees the signal sees the bytes.
__global__ void put_with_signal_kernel(void* dst, const void* src, size_t bytes, int pe, uint64_t* signal,
                                       uint64_t value) {
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
    nvshmem_fence();  // the data before the signal, to the same PE
    if (threadIdx.x == 0) nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, pe);
}

}  // namespace

void put_with_signal(void* dst, const void* src, size_t bytes, int pe, uint64_t* signal, uint64_t value,
                     cudaStream_t stream) {
    put_with_signal_kernel<<<1, 32, 0, stream>>>(dst, src, bytes, pe, signal, value);
    MOE_EP_LAUNCH_CHECK("nvshmem put_with_signal_kernel");
}

}  // namespace nvshmem_puts
}  // namespace moe_ep
