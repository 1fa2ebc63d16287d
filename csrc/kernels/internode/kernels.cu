// The internode kernels (api.cuh). Network legs are NVSHMEM puts with a signal per chunk, from this
// rank's own symmetric buffer (what an RDMA transport can read from); NVLink legs are loads and stores
// through the node's peer pointers, with flags raised after them.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuda_bf16.h>

#include "../cuda_check.cuh"
#include "../peer_sync.cuh"
#include "api.cuh"

namespace moe_ep {
namespace internode {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// The device's view of a call.
struct Dev {
    uint8_t* base;
    const int64_t* node_peers;
    int rank, num_ranks, per_node;
    uint64_t value;  // what this call's signals and flags are raised to
    int* host;
    uint64_t timeout_ns;

    __device__ uint64_t* words(int64_t offset) const { return reinterpret_cast<uint64_t*>(base + offset); }
    __device__ uint8_t* peer(int local) const { return reinterpret_cast<uint8_t*>(node_peers[local]); }
    __device__ int node() const { return rank / per_node; }
    __device__ int local() const { return rank % per_node; }
    __device__ int num_nodes() const { return num_ranks / per_node; }
    __device__ peer::Failure failure() const {
        uint64_t* w = words(Control::kWords);
        return {w + kAbort, w + kClaim, host, peer::now_ns() + timeout_ns};
    }
};

Dev dev(const Ctx& c) {
    return {c.base, c.node_peers, c.rank, c.num_ranks, c.ranks_per_node, c.nonce << 24 | 1ull, c.host_info,
            static_cast<uint64_t>(c.timeout_s * 1e9)};
}

// Chunk c of n items in `chunks` even parts: [begin(c), begin(c + 1)).
__device__ __forceinline__ int chunk_begin(int n, int c, int chunks) {
    return static_cast<int>(static_cast<int64_t>(n) * c / chunks);
}

// Thread 0 of each block waits for `count` flags at stride 1 from `flags` (peer i of the failure record:
// peer_of + i * peer_step, window: window_of + i); the block learns whether all came.
__device__ bool block_waits(const Dev& d, const uint64_t* flags, int count, int kind, int peer_of, int peer_step,
                            int window_of, bool window_per_flag) {
    __shared__ bool all_in;
    if (threadIdx.x == 0) {
        const peer::Failure f = d.failure();
        all_in = true;
        for (int i = 0; i < count && all_in; ++i)
            all_in = peer::wait_flag(f, flags + i, d.value, kind, peer_of + i * peer_step,
                                     window_per_flag ? window_of + i : window_of);
    }
    __syncthreads();
    return all_in;
}

// After this block's stores into peers' buffers: the last block of the grid raises this rank's flag
// (at `flag_offset` + 8 * local rank) in every rank of the node.
__device__ void last_block_raises(const Dev& d, int64_t flag_offset) {
    __syncthreads();
    if (threadIdx.x == 0 && peer::arrive_last(d.words(Control::kWords) + kBlocksDone, gridDim.x)) {
        for (int p = 0; p < d.per_node; ++p)
            peer::raise_flag(reinterpret_cast<uint64_t*>(d.peer(p) + flag_offset) + d.local(), d.value);
    }
}

__global__ void __launch_bounds__(kThreads) arrive_kernel(Dev d, const int* row, int row_ints,
                                                          const int* expert_counts, int local_experts, int* matrix,
                                                          int parity) {
    const int stride = row_ints + local_experts;
    int* outbox = reinterpret_cast<int*>(d.base + Control::kOutbox);
    int* inbox = reinterpret_cast<int*>(d.base + Control::kInbox) + static_cast<int64_t>(parity) * kMaxRanks *
                 Control::kInboxInts;
    // Rank r's part of the outbox: the row, then this rank's counts of r's experts.
    for (int i = threadIdx.x; i < d.num_ranks * stride; i += blockDim.x) {
        const int r = i / stride, j = i % stride;
        outbox[i] = j < row_ints ? row[j] : expert_counts[r * local_experts + j - row_ints];
    }
    __syncthreads();
    uint64_t* arrive = d.words(Control::kArrive);
    for (int r = threadIdx.x; r < d.num_ranks; r += blockDim.x) {
        int* into = inbox + static_cast<int64_t>(d.rank) * Control::kInboxInts;
        if (stride > 0)
            nvshmem_putmem_signal_nbi(into, outbox + r * stride, 4 * stride, arrive + d.rank, d.value,
                                      NVSHMEM_SIGNAL_SET, r);
        else
            nvshmemx_signal_op(arrive + d.rank, d.value, NVSHMEM_SIGNAL_SET, r);
    }
    nvshmem_quiet();  // the outbox is read before the next call writes it
    __shared__ bool all_in;
    if (threadIdx.x == 0) all_in = true;
    __syncthreads();
    const peer::Failure f = d.failure();
    for (int r = threadIdx.x; r < d.num_ranks; r += blockDim.x)
        if (!peer::wait_flag(f, arrive + r, d.value, intranode::kErrInternodeArrive, r, -1)) all_in = false;
    __syncthreads();
    if (matrix == nullptr || !all_in) return;
    for (int i = threadIdx.x; i < d.num_ranks * stride; i += blockDim.x) {
        const int r = i / stride, j = i % stride;
        matrix[i] = reinterpret_cast<volatile int*>(inbox)[static_cast<int64_t>(r) * Control::kInboxInts + j];
    }
}

__global__ void __launch_bounds__(kThreads) send_kernel(Dev d, DispatchArgs a) {
    const int n = blockIdx.x / a.num_chunks, c = blockIdx.x % a.num_chunks;
    const int count = a.send_count[n], begin = chunk_begin(count, c, a.num_chunks);
    const int end = chunk_begin(count, c + 1, a.num_chunks);
    const Message& msg = a.msg;
    const int64_t msg_bytes = msg.bytes();
    uint8_t* out = d.base + a.send_region + static_cast<int64_t>(a.send_offset[n]) * msg_bytes;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, K = msg.num_topk;
    for (int i = begin + warp; i < end; i += kWarps) {
        const int t = a.node_token[a.send_offset[n] + i];
        uint8_t* m = out + static_cast<int64_t>(i) * msg_bytes;
        peer::warp_copy<peer::Src::kReadOnly>(m, a.x + static_cast<int64_t>(t) * msg.row_bytes, msg.row_bytes, lane);
        if (a.scales != nullptr)
            peer::warp_copy<peer::Src::kReadOnly>(m + msg.scales(), a.scales + static_cast<int64_t>(t) * msg.scale_bytes,
                                                  msg.scale_bytes, lane);
        if (lane < K) {
            reinterpret_cast<int*>(m + msg.topk_idx())[lane] = static_cast<int>(a.topk_idx[static_cast<int64_t>(t) * K + lane]);
            reinterpret_cast<float*>(m + msg.topk_weights())[lane] = a.topk_weights[static_cast<int64_t>(t) * K + lane];
        }
        if (lane == 0) *reinterpret_cast<int*>(m + msg.source()) = t;
        if (lane < d.per_node) {
            const int r = n * d.per_node + lane, pos = a.send_pos[static_cast<int64_t>(t) * d.num_ranks + r];
            reinterpret_cast<int*>(m + msg.rows())[lane] = pos >= 0 ? a.row_base[r] + pos : -1;
        }
    }
    __syncthreads();
    // This node's chunk c at the forwarder of node n: the rank there with this rank's local index.
    const int forwarder = n * d.per_node + d.local();
    uint64_t* signal = d.words(Control::kDispatchSignals) + d.node() * kMaxChunks + c;
    if (end > begin)
        nvshmemx_putmem_signal_nbi_block(d.base + a.recv_region + (a.remote_offset[n] + begin) * msg_bytes,
                                         out + static_cast<int64_t>(begin) * msg_bytes, (end - begin) * msg_bytes,
                                         signal, d.value, NVSHMEM_SIGNAL_SET, forwarder);
    else if (threadIdx.x == 0)
        nvshmemx_signal_op(signal, d.value, NVSHMEM_SIGNAL_SET, forwarder);
    nvshmem_quiet();  // the send region is read before the next call writes it
}

__global__ void __launch_bounds__(kThreads) forward_kernel(Dev d, DispatchArgs a) {
    const int n = blockIdx.x / a.num_chunks, c = blockIdx.x % a.num_chunks;
    const int count = a.forward_count[n], begin = chunk_begin(count, c, a.num_chunks);
    const int end = chunk_begin(count, c + 1, a.num_chunks);
    const uint64_t* signal = d.words(Control::kDispatchSignals) + n * kMaxChunks + c;
    if (!block_waits(d, signal, 1, intranode::kErrInternodeChunk, n * d.per_node + d.local(), 0, c, false)) return;
    const Message& msg = a.msg;
    const int64_t msg_bytes = msg.bytes();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, K = msg.num_topk;
    const int experts = a.experts_per_rank;
    for (int i = begin + warp; i < end; i += kWarps) {
        const int slot = a.forward_offset[n] + i;
        const uint8_t* m = d.base + a.recv_region + static_cast<int64_t>(slot) * msg_bytes;
        const int* rows = reinterpret_cast<const int*>(m + msg.rows());
        const int source = __ldcg(reinterpret_cast<const int*>(m + msg.source()));
        int expert = -1;
        float weight = 0.f;
        if (lane < K) {
            expert = __ldcg(reinterpret_cast<const int*>(m + msg.topk_idx()) + lane);
            weight = __ldcg(reinterpret_cast<const float*>(m + msg.topk_weights()) + lane);
        }
        int mask = 0;
        for (int p = 0; p < d.per_node; ++p) {
            const int row = __ldcg(rows + p);
            if (row < 0) continue;
            mask |= 1 << p;
            uint8_t* into = d.peer(p);
            peer::warp_copy<peer::Src::kShared>(into + a.stage_x + row * msg.row_bytes, m, msg.row_bytes, lane);
            if (msg.scale_bytes > 0)
                peer::warp_copy<peer::Src::kShared>(into + a.stage_scales + row * msg.scale_bytes, m + msg.scales(),
                                                    msg.scale_bytes, lane);
            if (lane < K) {
                const int first = (d.node() * d.per_node + p) * experts;
                const bool here = expert >= first && expert < first + experts;
                reinterpret_cast<int64_t*>(into + a.stage_idx)[static_cast<int64_t>(row) * K + lane] = here ? expert - first : -1;
                reinterpret_cast<float*>(into + a.stage_weights)[static_cast<int64_t>(row) * K + lane] = here ? weight : 0.f;
            }
            if (lane == 0) {
                reinterpret_cast<int*>(into + a.stage_source)[row] = source;
                reinterpret_cast<int2*>(into + a.stage_forward)[row] = make_int2(d.local(), slot);
            }
        }
        if (lane == 0 && a.forward_mask != nullptr) a.forward_mask[slot] = mask;
    }
    last_block_raises(d, Control::kForwardedFlags);
}

// Every forwarder of this node has stored its rows here.
__global__ void forwarded_kernel(Dev d) {
    block_waits(d, d.words(Control::kForwardedFlags), d.per_node, intranode::kErrInternodeForwarded,
                d.node() * d.per_node, 1, -1, false);
}

__global__ void __launch_bounds__(kThreads) push_kernel(Dev d, CombineArgs a) {
    const int64_t row_bytes = combine_row_bytes(a.row_bytes, a.num_weights);
    const int lane = threadIdx.x % 32;
    for (int j = blockIdx.x * kWarps + threadIdx.x / 32; j < a.num_rows; j += gridDim.x * kWarps) {
        const int2 f = a.forward[j];
        uint8_t* into = d.peer(f.x) + a.area_region + (static_cast<int64_t>(d.local()) * a.forwarded + f.y) * row_bytes;
        peer::warp_copy<peer::Src::kReadOnly>(into, a.x + static_cast<int64_t>(j) * a.row_bytes, a.row_bytes, lane);
        if (lane < a.num_weights)
            reinterpret_cast<float*>(into + a.row_bytes)[lane] = a.topk_weights[static_cast<int64_t>(j) * a.num_weights + lane];
    }
    last_block_raises(d, Control::kPushedFlags);
}

__device__ __forceinline__ void add_vector(float (&acc)[8], const int4& v, RowType type) {
    if (type == RowType::kBFloat16) {
        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += __bfloat162float(h[i]);
    } else {
        const float* x = reinterpret_cast<const float*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += x[i];
    }
}

__device__ __forceinline__ int4 round_vector(const float (&acc)[8], RowType type) {
    int4 v;
    if (type == RowType::kBFloat16) {
        __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = __float2bfloat16_rn(acc[i]);
    } else {
        float* x = reinterpret_cast<float*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = acc[i];
    }
    return v;
}

__global__ void __launch_bounds__(kThreads) combine_forward_kernel(Dev d, CombineArgs a) {
    const int n = blockIdx.x / a.num_chunks, c = blockIdx.x % a.num_chunks;
    const int count = a.forward_count[n], begin = chunk_begin(count, c, a.num_chunks);
    const int end = chunk_begin(count, c + 1, a.num_chunks);
    if (!block_waits(d, d.words(Control::kPushedFlags), d.per_node, intranode::kErrInternodePushed,
                     d.node() * d.per_node, 1, -1, false))
        return;
    const int64_t row_bytes = combine_row_bytes(a.row_bytes, a.num_weights);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t vectors = a.row_bytes / 16;
    const uint8_t* area = d.base + a.area_region;
    uint8_t* sums = d.base + a.sum_region;
    for (int i = begin + warp; i < end; i += kWarps) {
        const int slot = a.forward_offset[n] + i, mask = a.forward_mask[slot];
        for (int64_t v = lane; v < vectors; v += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int p = 0; p < d.per_node; ++p) {
                if (!(mask >> p & 1)) continue;
                const uint8_t* row = area + (static_cast<int64_t>(p) * a.forwarded + slot) * row_bytes;
                add_vector(acc, __ldcg(reinterpret_cast<const int4*>(row) + v), a.type);
            }
            reinterpret_cast<int4*>(sums + static_cast<int64_t>(slot) * row_bytes)[v] = round_vector(acc, a.type);
        }
        if (lane < a.num_weights) {
            float acc = 0.f;
            for (int p = 0; p < d.per_node; ++p)
                if (mask >> p & 1)
                    acc += __ldcg(reinterpret_cast<const float*>(area + (static_cast<int64_t>(p) * a.forwarded + slot) *
                                                                          row_bytes + a.row_bytes) + lane);
            reinterpret_cast<float*>(sums + static_cast<int64_t>(slot) * row_bytes + a.row_bytes)[lane] = acc;
        }
    }
    __syncthreads();
    // Back to the source rank of these messages: the rank of node n with this rank's local index.
    const int source = n * d.per_node + d.local();
    uint64_t* signal = d.words(Control::kReturnSignals) + d.node() * kMaxChunks + c;
    const int first = a.forward_offset[n] + begin;
    if (end > begin)
        nvshmemx_putmem_signal_nbi_block(d.base + a.return_region + (a.return_offset[n] + begin) * row_bytes,
                                         sums + static_cast<int64_t>(first) * row_bytes, (end - begin) * row_bytes,
                                         signal, d.value, NVSHMEM_SIGNAL_SET, source);
    else if (threadIdx.x == 0)
        nvshmemx_signal_op(signal, d.value, NVSHMEM_SIGNAL_SET, source);
    nvshmem_quiet();  // the sums are read before the next call writes them
}

__global__ void __launch_bounds__(kThreads) reduce_kernel(Dev d, CombineArgs a) {
    const int nodes = d.num_nodes();
    __shared__ bool all_in;
    if (threadIdx.x == 0) {
        const peer::Failure f = d.failure();
        all_in = true;
        for (int n = 0; n < nodes && all_in; ++n)
            for (int c = 0; c < a.num_chunks && all_in; ++c)
                all_in = peer::wait_flag(f, d.words(Control::kReturnSignals) + n * kMaxChunks + c, d.value,
                                         intranode::kErrInternodeSums, n * d.per_node + d.local(), c);
    }
    __syncthreads();
    if (!all_in) return;
    const int64_t row_bytes = combine_row_bytes(a.row_bytes, a.num_weights);
    const uint8_t* sums = d.base + a.return_region;
    const int lane = threadIdx.x % 32;
    const int64_t vectors = a.row_bytes / 16;
    for (int t = blockIdx.x * kWarps + threadIdx.x / 32; t < a.num_tokens; t += gridDim.x * kWarps) {
        const int* pos = a.node_pos + static_cast<int64_t>(t) * nodes;
        for (int64_t v = lane; v < vectors; v += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (a.bias0 != nullptr) add_vector(acc, __ldg(reinterpret_cast<const int4*>(a.bias0 + t * a.row_bytes) + v), a.type);
            if (a.bias1 != nullptr) add_vector(acc, __ldg(reinterpret_cast<const int4*>(a.bias1 + t * a.row_bytes) + v), a.type);
            for (int n = 0; n < nodes; ++n) {
                if (pos[n] < 0) continue;
                const uint8_t* row = sums + static_cast<int64_t>(a.send_offset[n] + pos[n]) * row_bytes;
                add_vector(acc, __ldcg(reinterpret_cast<const int4*>(row) + v), a.type);
            }
            reinterpret_cast<int4*>(a.out + t * a.row_bytes)[v] = round_vector(acc, a.type);
        }
        if (a.out_weights != nullptr && lane < a.num_weights) {
            float acc = 0.f;
            for (int n = 0; n < nodes; ++n)
                if (pos[n] >= 0)
                    acc += __ldcg(reinterpret_cast<const float*>(sums + static_cast<int64_t>(a.send_offset[n] + pos[n]) *
                                                                            row_bytes + a.row_bytes) + lane);
            a.out_weights[static_cast<int64_t>(t) * a.num_weights + lane] = acc;
        }
    }
}

int grid(const Ctx& ctx) { return ctx.num_sms > 0 ? ctx.num_sms : 1; }

}  // namespace

void arrive(const Ctx& ctx, const int* row, int row_ints, const int* expert_counts, int local_experts, int* matrix,
            cudaStream_t stream) {
    arrive_kernel<<<1, kThreads, 0, stream>>>(dev(ctx), row, row_ints, expert_counts, local_experts, matrix,
                                               static_cast<int>(ctx.nonce & 1));
    MOE_EP_LAUNCH_CHECK("internode arrive_kernel");
}

void dispatch_send(const Ctx& ctx, const DispatchArgs& args, cudaStream_t stream) {
    send_kernel<<<ctx.num_nodes() * args.num_chunks, kThreads, 0, stream>>>(dev(ctx), args);
    MOE_EP_LAUNCH_CHECK("internode send_kernel");
}

void dispatch_forward(const Ctx& ctx, const DispatchArgs& args, cudaStream_t stream) {
    forward_kernel<<<ctx.num_nodes() * args.num_chunks, kThreads, 0, stream>>>(dev(ctx), args);
    MOE_EP_LAUNCH_CHECK("internode forward_kernel");
    forwarded_kernel<<<1, 32, 0, stream>>>(dev(ctx));
    MOE_EP_LAUNCH_CHECK("internode forwarded_kernel");
}

void combine_push(const Ctx& ctx, const CombineArgs& args, cudaStream_t stream) {
    push_kernel<<<grid(ctx), kThreads, 0, stream>>>(dev(ctx), args);
    MOE_EP_LAUNCH_CHECK("internode push_kernel");
}

void combine_forward(const Ctx& ctx, const CombineArgs& args, cudaStream_t stream) {
    combine_forward_kernel<<<ctx.num_nodes() * args.num_chunks, kThreads, 0, stream>>>(dev(ctx), args);
    MOE_EP_LAUNCH_CHECK("internode combine_forward_kernel");
}

void combine_reduce(const Ctx& ctx, const CombineArgs& args, cudaStream_t stream) {
    reduce_kernel<<<grid(ctx), kThreads, 0, stream>>>(dev(ctx), args);
    MOE_EP_LAUNCH_CHECK("internode reduce_kernel");
}

}  // namespace internode
}  // namespace moe_ep
