// Where things lie in an internode Buffer's symmetric (NVSHMEM) buffer: a control area of fixed size at
// its start, then the data regions of the call in flight. Free of CUDA: the extension exports these
// numbers (internode_layout) and Python carves the data regions with them, so host and device read one
// definition.
#pragma once

#include <cstdint>

namespace moe_ep {
namespace internode {

constexpr int kMaxRanks = 256;
// A forwarded token's local destinations are one int32 bitmask.
constexpr int kMaxRanksPerNode = 32;
constexpr int kMaxNodes = 64;
// Puts (each with its own signal) per source node and call: a forwarder starts on a chunk once it is in.
constexpr int kMaxChunks = 32;
constexpr int kMaxExperts = 4096;
// What every rank's arrival at a fresh dispatch carries besides its counts, so that all ranks check alike
// that they make the same call (FormField).
enum FormField : int { kFormTokens, kFormRowBytes, kFormScaleBytes, kFormTopk, kFormExperts, kFormChunks, kFormInts };

__host__ __device__ constexpr int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Ints a rank's arrival row holds: the form, tokens to each rank, tokens to each node.
__host__ __device__ constexpr int row_ints(int num_ranks, int num_nodes) { return kFormInts + num_ranks + num_nodes; }

// Byte offsets of the control area.
struct Control {
    static constexpr int64_t kArrive = 0;  // u64 [kMaxRanks]: rank r's arrival at call n sets [r] to n
    static constexpr int64_t kDispatchSignals = kArrive + 8 * kMaxRanks;  // u64 [source node][chunk]
    static constexpr int64_t kReturnSignals = kDispatchSignals + 8 * kMaxNodes * kMaxChunks;  // u64 [node][chunk]
    static constexpr int64_t kForwardedFlags = kReturnSignals + 8 * kMaxNodes * kMaxChunks;  // u64 [local forwarder]
    static constexpr int64_t kPushedFlags = kForwardedFlags + 8 * kMaxRanksPerNode;  // u64 [local rank]
    static constexpr int64_t kWords = kPushedFlags + 8 * kMaxRanksPerNode;  // u64 Word
    // int32: for each rank r, this rank's row and then its counts of r's experts (R rows and E counts in all).
    static constexpr int64_t kOutbox = kWords + 64;
    static constexpr int64_t kOutboxInts = kMaxRanks * (kFormInts + kMaxRanks + kMaxNodes) + kMaxExperts;
    // int32 [2 call parities][kMaxRanks][kInboxInts]: each rank's row and its counts of this rank's experts.
    static constexpr int64_t kInbox = align16(kOutbox + 4 * kOutboxInts);
    static constexpr int64_t kInboxInts = kFormInts + kMaxRanks + kMaxNodes + kMaxExperts;
    static constexpr int64_t kBytes = (kInbox + 2 * 4 * kMaxRanks * kInboxInts + (1 << 20) - 1) / (1 << 20) * (1 << 20);
};
enum Word : int { kAbort, kClaim, kBlocksDone, kWordCount };

// A dispatch message (one token for one node): its row, its scales, top-k ids (int32) and weights, its
// index on the source rank, and its row on each rank of the node (-1: not sent there).
struct Message {
    int64_t row_bytes, scale_bytes;
    int num_topk, ranks_per_node;

    __host__ __device__ constexpr int64_t scales() const { return row_bytes; }
    __host__ __device__ constexpr int64_t topk_idx() const { return align16(row_bytes + scale_bytes); }
    __host__ __device__ constexpr int64_t topk_weights() const { return topk_idx() + 4 * num_topk; }
    __host__ __device__ constexpr int64_t source() const { return topk_weights() + 4 * num_topk; }
    __host__ __device__ constexpr int64_t rows() const { return source() + 4; }
    __host__ __device__ constexpr int64_t bytes() const { return align16(rows() + 4 * ranks_per_node); }
};

// A combine row: the expert output row and, where the combine has them, its top-k weights (float32).
__host__ __device__ constexpr int64_t combine_row_bytes(int64_t row_bytes, int num_weights) {
    return align16(row_bytes + 4 * num_weights);
}

}  // namespace internode
}  // namespace moe_ep
