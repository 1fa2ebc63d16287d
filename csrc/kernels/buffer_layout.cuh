// Byte layout of a rank's intranode (CUDA IPC) buffer. moe_ep/config.py (IntranodeLayout) mirrors
// these formulas one to one; tests/test_layout_formulas.py compiles this header for the host and
// compares (no CUDA in it: keep it so), and tests/test_intranode.py checks the extension on a GPU.
//
//   [ signals: uint64 slots | counts: int32 rows, one per source rank ]  header, 4 KB aligned
//   [ window half 0 | window half 1 ]                                      the rest, split in two
//
// Dispatch stages a window of this rank's tokens in one half while peers pull the previous window
// from the other; combine receives a window of this rank's tokens (one slot per token and rank) there.
#pragma once

#include <cstdint>

namespace moe_ep {
namespace intranode {

constexpr int64_t kHeaderAlign = 4096;
constexpr int64_t kSlotAlign = 16;
// Largest num_experts the count exchange reserves room for.
constexpr int kMaxExperts = 16384;

__host__ __device__ constexpr int64_t align_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Signal slots. Local counters are touched by this rank's blocks only; the *From/*By arrays are written
// by peers (slot = the writing rank) with monotonically increasing tags.
enum Signal : int {
    kSeq = 0,          // kernels run on this buffer so far: numbers each kernel's tags
    kAbort = 1,        // nonzero once a wait timed out: later kernels return at once
    kErrorClaim = 2,   // first failing block claims the host error record
    kNotifyCount = 3,  // blocks of the notify kernel done
    kDoneCount = 4,    // blocks of a data kernel done
    kStageCount = 5,   // [2] by window parity: blocks done staging a dispatch window
    kReduceCount = 7,  // [2] by window parity: blocks done reducing a combine window
    kPullCount = 9,    // [2] by window parity: blocks done pulling every rank's dispatch window
    kPushCount = 11,   // [2] by window parity: blocks done pushing a combine window to every owner
    kStartedMark = 13,  // this rank's last intranode kernel to start: its progress mark (ProgressMark)
    kStartedAt = 14,    // ... and when (%globaltimer ns): a peer's timed-out wait reports both
    kBlocksStarted = 15,  // blocks of the running kernel started so far (0 between kernels): its
                          // residency, when a wait for this rank times out
    kFixedSignals = 16,
};
static_assert(kStartedAt == kStartedMark + 1 && kBlocksStarted == kStartedMark + 2,
              "a failed wait reads a peer's progress as three consecutive slots (peer_sync.cuh, Failure)");
// Per-rank arrays follow the fixed slots, in this order.
enum SignalArray : int {
    kNotifyFrom = 0,   // [R] peer r's counts for this call are in the counts area
    kStagedFrom = 1,   // [R] peer r staged dispatch window w
    kReleasedBy = 2,   // [R] peer r finished pulling this rank's window w
    kOpenFrom = 3,     // [R] peer r accepts combine rows for its windows <= w
    kPushedFrom = 4,   // [R] peer r pushed its combine rows of this rank's window w
    kZeroCopyReadyFrom = 5,  // [R] zero-copy combine: peer r's rows (and weights) are in its area;
                             // zero-copy dispatch: step 0, peer r started the call (its slot is free),
                             // step 1, peer r's rows are in this rank's area
    kArrivedFrom = 6,  // [R] peer r reached the call a rendezvous kernel opens (ranks sharing a GPU)
    kNumArraySlots = 7,
};

__host__ __device__ constexpr int64_t signal_index(SignalArray array, int num_ranks, int rank) {
    return kFixedSignals + static_cast<int64_t>(array) * num_ranks + rank;
}
// The streaming combine's ring counters follow, [channel][rank] each: rows peer r produced into this
// rank's ring of a channel (kProducedFrom), and rows of this rank's ring at peer r that r consumed
// (kConsumedBy).
constexpr int kStreamChannels = 32;
enum StreamArray : int { kProducedFrom = 0, kConsumedBy = 1, kNumStreamArrays = 2 };
__host__ __device__ constexpr int64_t stream_index(StreamArray array, int num_ranks, int channel, int rank) {
    return kFixedSignals + kNumArraySlots * static_cast<int64_t>(num_ranks) +
           (static_cast<int64_t>(array) * kStreamChannels + channel) * num_ranks + rank;
}
// A zero-copy dispatch's receiving layout, which every receiver stores at every sender when the call
// starts ([from rank][field], int64 each): where in the receiver's area this call's rows and their
// parts go, and how many rows fit. With the area's two alternating slots every rank's is the same;
// with a dispatch arena each receiver has a region of its own.
enum ZeroCopyLayoutField : int {
    kLayoutSlot = 0,  // bytes from the area's start to the slot or region
    kLayoutCapacity,  // rows it holds
    kLayoutX,         // the five parts, in bytes from the slot's start
    kLayoutScale,
    kLayoutIdx,
    kLayoutWeight,
    kLayoutSrc,
    kLayoutFields,
};
// A zero-copy combine from the dispatch arena publishes where its rows are in the same slots (the
// dispatch that wrote them last read them before its rows were in place, which the combine waits for).
enum CombineLayoutField : int {
    kCombineRows = 0,      // bytes from the area's start to row 0
    kCombineCapacity = 1,  // rows there; < 0: the rank had no room for them (the call takes two passes)
    kCombinePitch = 2,     // bytes from row to row
    kCombineWeights = 3,   // bytes from the area's start to the rows' top-k weights (K floats a row)
};
static_assert(static_cast<int>(kCombineWeights) < static_cast<int>(kLayoutFields), "a combine's layout fits a dispatch's slots");
__host__ __device__ constexpr int64_t layout_index(int num_ranks, int rank, int field) {
    return kFixedSignals + (kNumArraySlots + kNumStreamArrays * kStreamChannels) * static_cast<int64_t>(num_ranks) +
           static_cast<int64_t>(rank) * kLayoutFields + field;
}
// The layout of exactly `rows` received rows in a region of a dispatch arena: x, scales, top-k local
// ids (int64), top-k weights (float) and source tokens (int32), each part 16-byte aligned, then the
// end. config.py's zero_copy_dispatch_region is the same formula: the kernel lays a region out on the
// device when the host launched it before it knew the rows, and the host lays it out once it knows them.
struct DispatchRegion {
    int64_t x, scale, idx, weight, src, bytes;
};
__host__ __device__ constexpr DispatchRegion dispatch_region(int64_t rows, int64_t x_bytes, int64_t scale_bytes,
                                                             int num_topk) {
    DispatchRegion d{};
    d.scale = align_up(rows * x_bytes, kSlotAlign);
    d.idx = align_up(d.scale + rows * scale_bytes, kSlotAlign);
    d.weight = align_up(d.idx + rows * 8 * num_topk, kSlotAlign);
    d.src = align_up(d.weight + rows * 4 * num_topk, kSlotAlign);
    d.bytes = align_up(d.src + rows * 4, kSlotAlign);
    return d;
}
__host__ __device__ constexpr int64_t signal_bytes(int num_ranks) {
    return (kFixedSignals + (kNumArraySlots + kNumStreamArrays * kStreamChannels + kLayoutFields) * static_cast<int64_t>(num_ranks)) * 8;
}
// Row of source rank s in the counts area: [num_tokens, tokens for this rank, tokens for each rank (R),
// per local expert counts]: every rank learns the whole count matrix from the rows it receives.
constexpr int kCountsPerRankAt = 2;
__host__ __device__ constexpr int counts_row_ints(int num_ranks, int num_experts) {
    return 2 + num_ranks + num_experts / num_ranks;
}
__host__ __device__ constexpr int64_t header_bytes(int num_ranks) {
    return align_up(signal_bytes(num_ranks) + 4LL * (2 * num_ranks + static_cast<int64_t>(num_ranks) * num_ranks + kMaxExperts),
                    kHeaderAlign);
}
__host__ __device__ constexpr int64_t half_bytes(int64_t num_nvl_bytes, int num_ranks) {
    return num_nvl_bytes <= header_bytes(num_ranks) ? 0
                                                    : (num_nvl_bytes - header_bytes(num_ranks)) / 2 / kSlotAlign * kSlotAlign;
}

// A staged dispatch token: [destination row per rank (int32, -1: not sent) | x | scales | top-k ids | weights].
struct DispatchSlot {
    int64_t pos_offset, x_offset, scale_offset, idx_offset, weight_offset, bytes;
};
__host__ __device__ constexpr DispatchSlot dispatch_slot(int num_ranks, int64_t x_bytes, int64_t scale_bytes,
                                                         int num_topk) {
    DispatchSlot s{};
    s.pos_offset = 0;
    s.x_offset = align_up(4LL * num_ranks, kSlotAlign);
    s.scale_offset = s.x_offset + align_up(x_bytes, kSlotAlign);
    s.idx_offset = s.scale_offset + align_up(scale_bytes, kSlotAlign);
    s.weight_offset = s.idx_offset + align_up(8LL * num_topk, kSlotAlign);
    s.bytes = s.weight_offset + align_up(4LL * num_topk, kSlotAlign);
    return s;
}
// A combine slot (one per token of the owner's window and sending rank): [row | top-k weights].
__host__ __device__ constexpr int64_t combine_slot_bytes(int64_t x_bytes, int num_topk) {
    return align_up(x_bytes, kSlotAlign) + align_up(4LL * num_topk, kSlotAlign);
}

}  // namespace intranode
}  // namespace moe_ep

namespace moe_ep {
namespace low_latency {

// Byte layout of a rank's low-latency buffer; moe_ep/config.py (LowLatencyLayout) mirrors it.
//   [ header: uint64 slots, 4 KB ] [ half 0 ] [ half 1 ]
//   half = [ send region | receive region | signals: uint64 per (local expert, source rank), then per rank ]
// Calls alternate halves, so one call's receive region stays valid while the next call is issued.
// The send region holds the send kernel's scratch and a zero-copy combine's rows (and rows staged for
// puts); peer-to-peer stores write straight into the receiver's region.
// A dispatch's receive region: an index entry per (local expert, source rank, slot), naming the source
// token and pick of the expert's slot-th row from that source, then a stretch of max messages per
// source rank, message t carrying source token t's row (and scales) once for all its picks of this
// rank's experts; a combine's: a row per (source token, pick).
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kIndexEntryBytes = 8;  // source token; pick | call << 5 (int32 each)
// A dispatch message's pitch is a multiple of 128 bytes: every row starts on a cache line, so a warp's
// 512-byte store covers whole lines and sectors.
constexpr int64_t kMessageAlign = 128;

// Distance between a dispatch's messages carrying `payload` bytes (row and scales): an fp8 row's
// messages lie at about half a bf16 row's pitch.
__host__ __device__ constexpr int64_t dispatch_message_pitch(int64_t payload) {
    return intranode::align_up(payload, kMessageAlign);
}
// Where, within the receive region, a dispatch's messages start: behind the index of E x max entries.
__host__ __device__ constexpr int64_t dispatch_messages_offset(int64_t num_experts, int64_t num_max_tokens) {
    return intranode::align_up(num_experts * num_max_tokens * kIndexEntryBytes, kMessageAlign);
}
// Byte offset, within the dispatch's messages, of source rank `source`'s message for token `token`.
__host__ __device__ constexpr int64_t dispatch_message_at(int source, int64_t token, int64_t num_max_tokens, int64_t pitch) {
    return (source * num_max_tokens + token) * pitch;
}
// Index entry of the `slot`-th row of local expert `local` from source rank `source`.
__host__ __device__ constexpr int64_t dispatch_index_entry(int local, int source, int slot, int num_ranks,
                                                           int64_t num_max_tokens) {
    return (static_cast<int64_t>(local) * num_ranks + source) * num_max_tokens + slot;
}
enum HeaderSlot : int { kSeq = 0, kAbort = 1, kErrorClaim = 2, kSendDone = 3, kRecvDone = 4 };

struct Regions {
    int64_t dispatch_message, combine_message, zero_copy_offset, outbox_offset, send, recv, signal, half, total;
};

__host__ __device__ constexpr Regions regions(int64_t num_max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
    Regions r{};
    // A bf16 row is the largest message: fp8 rows with their scales are smaller (H + H/32 < 2H).
    r.dispatch_message = dispatch_message_pitch(hidden * 2);
    r.combine_message = intranode::align_up(hidden * 2, 16);
    const int64_t slots = num_experts * num_max_tokens;
    const int64_t send_combine = slots * r.combine_message;
    const int64_t recv_dispatch = dispatch_messages_offset(num_experts, num_max_tokens) +
                                  num_ranks * num_max_tokens * r.dispatch_message;
    const int64_t recv_combine = slots * r.combine_message;
    // The send region: the send kernel's scratch (E x max int32, of which it uses the first E for its
    // rows per expert), then the rows of a zero-copy combine ([L, R x max, H] bf16, written by the
    // caller; peers read them in place; a combine through puts stages its rows there), then a
    // dispatch's outbox: a message per token of this rank, which peers with a mapping read in place and
    // puts send to the others. The outbox has its own bytes: the caller may write the zero-copy rows
    // while peers still read this call's messages.
    r.zero_copy_offset = intranode::align_up(slots * 4, 128);
    r.outbox_offset = r.zero_copy_offset + intranode::align_up(send_combine, 128);
    r.send = r.outbox_offset + num_max_tokens * r.dispatch_message;
    r.recv = intranode::align_up(recv_dispatch > recv_combine ? recv_dispatch : recv_combine, 128);
    r.signal = intranode::align_up((num_experts + num_ranks) * 8, 128);
    r.half = r.send + r.recv + r.signal;
    r.total = kHeaderBytes + 2 * r.half;
    return r;
}

}  // namespace low_latency
}  // namespace moe_ep
