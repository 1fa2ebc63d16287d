// The internode kernels' interface: plain pointers, counts and a stream (csrc/internode_bindings.cpp is
// the torch side). A group of R ranks spans R / P nodes of P ranks; rank r sits on node r / P as local
// rank r % P. A token crosses the network at most once per destination node, to the rank there with its
// source's local index (its forwarder), which stores it over NVLink into the receive rows of every rank
// of its node that holds one of its experts. The combine mirrors it: each rank pushes its rows to their
// forwarders, which sum them per token and put one row per node back.
//
// Every call starts with an arrival (arrive): every rank tells every other that its previous calls are
// done, so each call may reuse every region of the buffer.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "../reports.cuh"
#include "layout.cuh"

namespace moe_ep {
namespace internode {

enum class RowType : int { kBFloat16 = 0, kFloat32 = 2 };  // combine rows (values as the bindings map dtypes)

// What every kernel of a call knows about the group and this rank's buffer.
struct Ctx {
    uint8_t* base;                 // this rank's symmetric buffer (its address as NVSHMEM names it on every PE)
    const int64_t* node_peers;     // [P] the buffer of each rank of this node, as loads and stores reach it
    int rank, num_ranks, ranks_per_node;
    uint64_t nonce;                // this call's number, the same on every rank
    int* host_info;                // pinned host record (HostInfo) a failed wait reports into
    double timeout_s;
    int num_sms;

    int node() const { return rank / ranks_per_node; }
    int local() const { return rank % ranks_per_node; }
    int num_nodes() const { return num_ranks / ranks_per_node; }
};

// Puts `row` (row_ints ints) and, to each rank r, this rank's counts of r's experts (local_experts ints
// of expert_counts from r * local_experts) into every rank's inbox, raises its arrival there, and waits
// for every rank's arrival at this call. With row_ints and local_experts 0 only the arrival travels.
// matrix (null: not wanted) gets what every rank sent this one: [R][row_ints + local_experts] int32.
void arrive(const Ctx& ctx, const int* row, int row_ints, const int* expert_counts, int local_experts, int* matrix,
            cudaStream_t stream);

struct DispatchArgs {
    Message msg;
    const uint8_t* x;                 // [N, row_bytes]
    const uint8_t* scales;            // [N, scale_bytes] or null
    const int64_t* topk_idx;          // [N, K] or null (K = msg.num_topk)
    const float* topk_weights;        // [N, K] or null
    const int* send_pos;              // [N, R]: row of each token among those sent to rank r, -1: not sent
    const int* row_base;              // [R]: where this rank's rows start among rank r's received rows
    const int* node_token;            // [sum of send_count]: the token of each message, by node then position
    const int* send_offset;           // [nodes]: first message to each node (in node_token and in the outbox)
    const int* send_count;            // [nodes]
    const int* remote_offset;         // [nodes]: first slot of this rank's messages in that node's forwarder
    const int* forward_offset;        // [nodes]: first slot of the messages each source node sends this rank
    const int* forward_count;         // [nodes]
    int64_t send_region, recv_region;  // byte offsets in the buffer: messages out, messages in
    int64_t stage_x, stage_scales, stage_idx, stage_weights, stage_source, stage_forward;  // receive rows
    int num_chunks, experts_per_rank;
    int* forward_mask;                // [forwarded messages] local ranks each was stored to, or null
};

// The source side: packs each token once per destination node into the send region and puts every
// chunk to its forwarder with a signal.
void dispatch_send(const Ctx& ctx, const DispatchArgs& args, cudaStream_t stream);
// The forwarder side: as each chunk lands, stores its tokens into the receive rows of their ranks on
// this node (top-k ids made local to each, weights of other ranks' experts 0), then raises this rank's
// flag on each of them; waits until every forwarder of this node has raised its flag here.
void dispatch_forward(const Ctx& ctx, const DispatchArgs& args, cudaStream_t stream);

struct CombineArgs {
    RowType type;
    int64_t row_bytes;                 // hidden * element size
    int num_weights;                   // K, or 0 without top-k weights
    const uint8_t* x;                  // [rows, row_bytes] expert outputs, in receive order
    const float* topk_weights;         // [rows, K] or null
    int num_rows;
    const int2* forward;               // [rows]: (local forwarder, its slot) of each received row
    const int* forward_mask;           // [forwarded] local ranks each forwarded message went to
    const int* forward_offset;         // [nodes] as DispatchArgs
    const int* forward_count;          // [nodes]
    const int* return_offset;          // [nodes]: where the sums of each source node's messages go there
    const int* node_pos;               // [N, nodes]: each token's message to a node, -1 where not sent
    const int* send_offset;            // [nodes]
    const uint8_t* bias0;              // [N, row_bytes] or null
    const uint8_t* bias1;
    int num_tokens;
    int64_t area_region, sum_region, return_region;  // byte offsets: pushed rows, node sums out, sums in
    int forwarded;                     // messages this rank forwards (rows of its area per local rank)
    int num_chunks;
    uint8_t* out;                      // [N, row_bytes]
    float* out_weights;                // [N, K] or null
};

// Each rank stores its rows (and weights) into their forwarders' areas and raises its flag there.
void combine_push(const Ctx& ctx, const CombineArgs& args, cudaStream_t stream);
// Each forwarder sums the rows of each message's ranks in local-rank order, rounds to the row type and
// puts each chunk's sums back to the source rank with a signal.
void combine_forward(const Ctx& ctx, const CombineArgs& args, cudaStream_t stream);
// Each source: out = biases, then each node's sum in node order, one rounding.
void combine_reduce(const Ctx& ctx, const CombineArgs& args, cudaStream_t stream);

}  // namespace internode
}  // namespace moe_ep
