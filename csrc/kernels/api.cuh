// The kernels' whole interface: plain pointers, counts and a stream. No torch here, so the kernels
// compile (and can be unit-tested) without it; csrc/bindings.cpp is the only torch-aware file.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "reports.cuh"

namespace moe_ep {

// Element types the kernels accept for hidden states (values match the bindings' dtype mapping).
enum class DType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

namespace layout {

// One pass over topk_idx [num_tokens, num_topk] (-1 = no expert). Experts are spread evenly:
// expert e lives on rank e / (num_experts / num_ranks); rank r on node r / ranks_per_node.
// Outputs: counts[num_ranks + num_nodes + num_experts] int32 laid out as
//   [tokens per rank | tokens per node | (token, k) entries per expert], and
//   is_token_in_rank [num_tokens, num_ranks] bool. A token counts once per rank and once per node.
// num_nodes = num_ranks / ranks_per_node; the per-node counts are written only when num_nodes > 1.
void get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                         int ranks_per_node, int* counts, bool* is_token_in_rank, int num_sms, cudaStream_t stream);

}  // namespace layout

namespace fp8 {

constexpr int kBlock = 128;       // columns per scale
constexpr float kE4M3Max = 448.f;  // largest finite e4m3 value
constexpr float kAmaxFloor = 1e-4f;

// x [num_tokens, hidden] -> x_fp8 [num_tokens, hidden] e4m3 and, per 128 columns, a float32 scale
// (scales [num_tokens, hidden / 128]) or, with use_ue8m0, its biased exponent packed four to an int32
// (scales [num_tokens, ceil(hidden / 512)] int32, pad bytes zero). hidden % 128 == 0.
void per_token_cast(const void* x, DType x_dtype, int num_tokens, int hidden, bool round_scale, bool use_ue8m0,
                    uint8_t* x_fp8, void* scales, int num_sms, cudaStream_t stream);

// The same cast under transformer-engine's 1D-block rule (Float8BlockQuantizer): per 128 columns the
// factor 448 / amax (amax floored at amax_epsilon when it is positive), rounded down to a power of two
// with pow2_scales, inf_factor where it is infinite, 1 for a zero block; x_fp8 = e4m3(x * factor) and
// scale_inv [num_tokens, hidden / 128] = 1 / factor. hidden % 128 == 0.
void blockwise_cast(const void* x, DType x_dtype, int num_tokens, int hidden, bool pow2_scales, float amax_epsilon,
                    float inf_factor, uint8_t* x_fp8, float* scale_inv, int num_sms, cudaStream_t stream);

// out [num_tokens, hidden] (bf16 or float32) = e4m3 value * its block's scale.
void per_token_cast_back(const uint8_t* x_fp8, const void* scales, bool scales_ue8m0, int num_tokens, int hidden,
                         void* out, DType out_dtype, int num_sms, cudaStream_t stream);

}  // namespace fp8

namespace traffic {

// Adds a low-latency call's bytes per rank and, for a dispatch, its tokens per local expert to
// acc int64 [2 R + num_local] ([sent to each rank | received from each rank | tokens per local expert]):
// the dispatch sends a row of row_bytes per pick in topk_idx [num_picks] (-1: none; expert e on rank
// e / experts_per_rank) and receives the first recv_count[l] of each local expert's `slots` rows of
// recv_src_info [num_local, slots] ((source rank * max_tokens + token) * num_topk + k); a combine
// (combine=true) moves the same rows the other way. A dispatch also writes expert_last [num_local].
void count_low_latency(const int64_t* topk_idx, int64_t num_picks, int experts_per_rank, const int* recv_src_info,
                       const int* recv_count, int num_local, int64_t slots, int num_topk, int max_tokens,
                       int num_ranks, bool combine, int64_t row_bytes, int64_t* acc, int64_t* expert_last,
                       cudaStream_t stream);

}  // namespace traffic

namespace intranode {

// The most ranks the kernels take. Combine keeps one bit per sending rank; dispatch's pull and combine's
// push a list start per rank.
constexpr int kMaxRanks = 64;

// The host record's ints (HostInfo, reports.cuh: its slots, then a count exchange's counts).
inline int host_info_ints(int num_ranks) { return kHostCounts + 2 * num_ranks + 16384; }
// Kernel log (with the wait profile, Ctx::kernel_log): [count, then per kernel (KernelId, start, end)], the
// %globaltimer ns of its block 0's start and of its last block's end, appended by that last block for
// every intranode kernel of this rank (rendezvous and count exchange included) until it is full. It
// tells the time between a call's kernels and a kernel's span from its blocks' mean time.
constexpr int kKernelLogEntries = 4096;
inline int kernel_log_ints(int entries = kKernelLogEntries) { return 1 + 3 * entries; }

// Device int32 summary of a count exchange: [max tokens, total rows, base row of each source (R + 1),
// tokens of each source (R), this rank's first row at each peer (R), the rank prefix matrix (R x R:
// entry [i][j] = tokens ranks 0..i send to rank j)].
__host__ __device__ inline int recv_info_prefix_matrix(int num_ranks) { return 3 + 3 * num_ranks; }
inline int recv_info_ints(int num_ranks) { return recv_info_prefix_matrix(num_ranks) + num_ranks * num_ranks; }

struct Ctx {
    uint8_t* const* buffers;  // device array [R]: every rank's buffer as mapped in this process
    int rank, num_ranks;
    int64_t num_nvl_bytes;    // size of each rank's buffer
    int* host_info;           // pinned host memory, HostInfo layout
    uint64_t timeout_ns;      // a wait for a peer longer than this fails (kHostError, no trap)
    int num_blocks;           // the SM budget of data kernels
    int ranks_on_device;      // ranks of the group on this GPU: their blocks must all fit it at once
    int sm_share_percent;     // this process's MPS SM share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), 100: none
    uint64_t* wait_ns;        // null, or [blocks][kWaitSlots]: where the time goes, added up per call
    int64_t* kernel_log;      // null, or the kernel log (kKernelLogEntries above)
    bool stream_combine;      // combine through per-channel rings instead of windows (up to 32 ranks)
    bool full_first;          // launches try 1024-thread blocks first, not 512 at one an SM (intranode/launch.cuh)
    int rendezvous_before;    // KernelId of a data kernel that waits for every rank to reach the call
                              // before it starts (a one-block rendezvous kernel ahead of it), 0: none
    bool start_together;      // every data kernel starts behind a rendezvous or its call's count exchange
                              // on every rank (residency.cuh: what else can be alive beside it)
    cudaStream_t stream;
};

// Count exchange. is_token_in_rank [N, R] -> send_pos [N, R] (row of each token among those this
// rank sends to r, -1 where not sent); every rank's counts (num_tokens_per_rank [R] among them) reach
// every peer; recv_info gets the summary and host_info its copy, then host_info[kHostDone] = nonce.
void notify(const Ctx& ctx, const bool* is_token_in_rank, int num_tokens, const int* num_tokens_per_rank,
            const int* num_tokens_per_expert, int num_experts, int* send_pos, int* recv_info, int nonce);

// A call that can take one pass or two (a Buffer with an arena) queues both kernels: the one-pass
// kernel first, which chooses the path from every rank's announcement of its room (the same choice on
// every rank), and the two-pass kernel behind it, which returns at once unless chosen (choice below).
// The one-pass kernel's block 0 writes the choice to *choice, adds a call it runs to *one_pass_calls,
// and tells the host: kHostChoice, then kHostChoiceDone = nonce (a fresh dispatch's host waits for it).
struct PathChoice {
    int* choice;           // device int32: 1, the one-pass kernel ran; 0, the two-pass kernel runs
    int* one_pass_calls;   // device int32 count of calls run in one pass, or null
    int nonce;
};

struct DispatchArgs {
    const void* x;                // [N, x_bytes] raw rows (bf16, float32 or e4m3)
    int64_t x_bytes;
    const void* scales;           // [N, scale_bytes] or null
    int64_t scale_bytes;
    const int64_t* topk_idx;      // [N, K] global expert ids or null (cached dispatch)
    const float* topk_weights;    // [N, K]
    int num_topk;
    int experts_per_rank;
    const int* send_pos;          // from notify
    int num_tokens;
    const int* recv_info;         // from notify
    void* recv_x;                 // [num_recv_rows, x_bytes]
    void* recv_scales;
    int64_t* recv_topk_idx;       // local ids, -1 elsewhere
    float* recv_topk_weights;
    int* recv_src_idx;            // [num_recv_rows] source token index of each row (for combine)
    int num_recv_rows;            // rows allocated; rows past the received ones are padding; -1
                                  // (zero-copy dispatch only): exactly the received rows, read on the device
    const int* choice;            // null, or a one-pass kernel's choice (PathChoice): the kernel
                                  // returns at once unless *choice == 0
};
// Throws std::invalid_argument when the blocks of all ranks on this GPU cannot be resident together;
// check_blocks_fit(ctx) says so before a call starts (the count exchange would run otherwise).
void check_blocks_fit(const Ctx& ctx);
// The blocks a data kernel runs on for an SM budget of `budget` (which check_blocks_fit accepted) when
// up to `ranks_on_device` ranks of the group share a GPU: the count, at most the budget, whose blocks
// keep the most loads in flight (threads x copy depth) in the shape that fits them, trying the shapes in
// the order that Ctx::full_first picks, under an MPS SM share of sm_share_percent and with the data
// kernels starting together or not (Ctx). Every rank of the group must pass the same values: the
// streaming combine's channels follow the count. `budget` when one rank has a GPU.
int fitted_blocks(int budget, int ranks_on_device, bool full_first, int sm_share_percent, bool start_together);
void dispatch(const Ctx& ctx, const DispatchArgs& args);

struct CombineArgs {
    const void* x;                // [rows, hidden] rows to send back, in dispatch's receive order
    DType dtype;                  // bf16 or float32
    int hidden;
    const float* topk_weights;    // [rows, K] or null
    int num_topk;
    const int* recv_src_idx;      // from dispatch
    const int* recv_info;
    const int* send_pos;
    int num_tokens;
    const void* bias0;            // [N, hidden] or null
    const void* bias1;
    void* out;                    // [N, hidden]
    float* out_weights;           // [N, K] or null
    // The streaming combine: rows per owner a sending round writes before it releases them (Config's
    // num_max_nvl_chunked_send_tokens), so the owner sums a round's rows while the next is written;
    // 0: as many as the owner's ring has room for.
    int send_chunk;
    const int* choice;            // null, or a one-pass kernel's choice (PathChoice): the kernel
                                  // returns at once unless *choice == 0
};
void combine(const Ctx& ctx, const CombineArgs& args);
// One-pass combine from the arena: every rank's rows (args.x) lie in its arena where it says (its own
// slot_offset, pitch, capacity_rows), their top-k weights at weights_offset (K floats a row); each rank
// sums its tokens' rows where they lie, at the first rows its dispatch's notify found (recv_info).
// capacity_rows < 0: this rank has no room for them, and every rank leaves the call to the two-pass
// combine queued behind (path).
struct ZeroCopyArgs {
    uint8_t* const* areas;   // device array [R]: every rank's arena as mapped here
    int64_t slot_offset;     // bytes from this rank's arena's start to its row 0
    int64_t pitch;           // bytes from one row to the next (16-byte aligned)
    int64_t capacity_rows;   // rows there, or -1
    int64_t weights_offset;  // bytes from the arena's start to the weights
    PathChoice path;
};
void zero_copy_combine(const Ctx& ctx, const CombineArgs& args, const ZeroCopyArgs& z);
// One-pass dispatch into the arena: every rank writes its rows straight into the receivers' arena
// regions, at their final rows, and args.recv_x / args.recv_scales are ignored: the receiver's outputs
// are its own region. A region holds [capacity rows of x | of scales | of K int64 local ids | of K float
// weights | of int32 source tokens], each part at its offset (16-byte aligned); the receiver copies
// the ids, weights and source tokens into args' tensors, at the first rows notify found (recv_info).
struct ZeroCopyDispatchArgs {
    uint8_t* const* areas;   // device array [R]: every rank's arena as mapped here
    // This rank's receiving layout, which the kernel hands to every sender (ZeroCopyLayoutField).
    int64_t slot_offset;     // bytes from this rank's arena's start to its region
    int64_t capacity_rows;   // rows it holds; -1: no region (no room here: the call takes two passes)
    int64_t x_offset, scale_offset, idx_offset, weight_offset, src_offset;  // from its start
    // >= 0: a region this many bytes long at slot_offset, which the kernel lays out itself for the rows
    // the count exchange brings (dispatch_region; capacity_rows and the offsets are not read): the host
    // launched it before it knew them. If they do not fit, this rank has no room. -1: the layout above.
    int64_t region_bytes;
    PathChoice path;
};
void zero_copy_dispatch(const Ctx& ctx, const DispatchArgs& args, const ZeroCopyDispatchArgs& z);
// Rows per ring of the streaming combine for rows of x_bytes (ctx.stream_combine); 0: it is off, or
// there are more than 32 ranks, fewer than 2 blocks or no room for a ring row, and combine uses windows.
int stream_ring_rows(const Ctx& ctx, int64_t x_bytes, int num_topk);

// Tokens per window for the given row sizes; 0 when the buffer cannot hold one.
int dispatch_window_tokens(int num_ranks, int64_t num_nvl_bytes, int64_t x_bytes, int64_t scale_bytes, int num_topk);
int combine_window_tokens(int num_ranks, int64_t num_nvl_bytes, int64_t x_bytes, int num_topk);

}  // namespace intranode

namespace low_latency {

// One low-latency call (dispatch or combine): every rank's buffer as mapped here. Calls alternate
// between two halves of the buffers by a call number kept on the device, so the send and receive
// kernels of consecutive calls must run in order (one stream). Failed waits report into host_info
// (intranode::HostInfo).
struct Ctx {
    uint8_t* const* buffers;
    int rank, num_ranks;
    int ranks_on_device;  // ranks whose kernels share this GPU (the receive kernels' grids leave room)
    int num_max_tokens, hidden, num_experts;
    int* host_info;
    uint64_t timeout_ns;
    cudaStream_t stream;
};

// Writes every (token, top-k slot) with an expert into that expert's rank: bf16 rows, or e4m3 rows
// cast here with their 1x128 scales (float32, or UE8M0 packed four to an int32), and zeroes recv_count
// [L] (the receive writes it). Waits for nothing.
void dispatch_send(const Ctx& ctx, const void* x, int num_tokens, const int64_t* topk_idx, int num_topk,
                   bool use_fp8, bool round_scale, bool use_ue8m0, int* recv_count);
// Waits for every rank's rows and packs them per local expert, ordered by source rank, token, slot:
// recv_x [L, R * max, H] (+ recv_scales), recv_count [L], stats [L] += counts (nullable), and
// recv_src_info [L, R * max]: (source rank * max + token) * num_topk + slot of each row.
void dispatch_recv(const Ctx& ctx, int num_topk, bool use_fp8, bool use_ue8m0, void* recv_x, void* recv_scales,
                   int* recv_count, int* stats, int* recv_src_info, int num_sms);
// How a combine's send hands its rows (x) to the tokens' ranks. `slot` is the zero-copy rows (0 or 1)
// the combine owns in this rank's buffer (regions().zero_copy_offset of half `slot`).
enum class CombineSend : int {
    kInSlot = 0,  // x is the slot's rows: only each row's index goes to the token's rank, which reads it there
    kStage = 1,   // x's received rows are copied into the slot first, then as kInSlot
    kPush = 2,    // each row is written into its token's rank: stored where mapped, else put from the slot
};
// Sends row r of local expert e (x [L, R * max, H] bf16) back to the (token, slot) it came from, as
// `how` says.
void combine_send(const Ctx& ctx, const void* x, const int* recv_count, const int* recv_src_info, int num_topk,
                  int num_sms, int slot, CombineSend how);
// out[t] = sum over slots k ascending with an expert of (weight * row), in float32 without FMA; the rows
// come from this rank's receive region, or with zero_copy_slot >= 0 from the experts' ranks' buffers.
void combine_recv(const Ctx& ctx, const int64_t* topk_idx, const float* topk_weights, int num_tokens, int num_topk,
                  void* out, int num_sms, int zero_copy_slot);

// A timeline of the last kTimelineCalls calls on this GPU, in a build with MOE_EP_TIMELINE (a
// measuring tool; elsewhere the kernels stamp nothing): per call (its number modulo kTimelineCalls) the
// GPU's global timer (ns, one clock for every process on the GPU) at the edges of its phases
// (TimelineColumn in reports.cuh), so that a run shows where the time of ranks sharing a GPU goes, which
// a profiler (it serializes kernels) cannot. "First" columns keep the earliest stamp of any block, the
// others the latest.
constexpr int kTimelineCalls = 64;
bool timeline_built();
void timeline_reset();                // every stamp cleared (synchronous)
void timeline_read(int64_t* out);     // [kTimelineCalls][kTimelineColumns] (synchronous)

}  // namespace low_latency

namespace nvshmem_puts {

// One warp puts `bytes` from this PE's `src` to the symmetric `dst` at PE `pe`, then sets the
// symmetric 64-bit `signal` there to `value`, ordered after the data (internode/nvshmem_puts.cu, in
// moe_ep._internode only).
void put_with_signal(void* dst, const void* src, size_t bytes, int pe, uint64_t* signal, uint64_t value,
                     cudaStream_t stream);

}  // namespace nvshmem_puts

}  // namespace moe_ep
