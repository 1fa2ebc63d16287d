// The intranode combines through this rank's buffer: windowed, and streaming through per-channel rings.
// Combine pushes: every rank writes the rows it holds into the owner's window, one slot per (token,
// sending rank), and the owner sums them in rank order. Windows alternate between two halves of the
// buffer, so pushing window w overlaps the reads of window w - 1; a bounded number of windows makes
// any token count fit any buffer size.
#include <algorithm>
#include <stdexcept>

#include "combine_common.cuh"
#include "common.cuh"
#include "launch.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// ------------------------------------------------------------------ windowed combine
// First index in sorted [lo, hi) with value >= key.
__device__ int lower_bound(const int* values, int lo, int hi, int key) {
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (values[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// This rank's received rows from `owner` whose tokens lie in [first, last): rows from an owner are
// sorted by token, so they are contiguous; returns their count and sets `begin` to the first.
__device__ int owner_rows(const CombineArgs& a, const int* base, int owner, int first, int last, int& begin) {
    begin = lower_bound(a.recv_src_idx, base[owner], base[owner + 1], first);
    return lower_bound(a.recv_src_idx, begin, base[owner + 1], last) - begin;
}

// What one combine call's blocks share: the arguments and where the windows are.
struct CombineCall {
    const CombineArgs& a;
    int64_t slot_bytes, x_bytes, weights_offset;
    int window_tokens;
    const int* base;  // first received row of each source rank (R + 1)
};

// Token t's row that this rank itself received (its own token, for a local expert): the combines read
// it in place in x instead of passing it through this rank's window or ring (a copy and a read back
// saved: half the rows at 2 ranks, a quarter at 4). Row base[me] + send_pos[t][me], as at any
// receiver of this rank's rows. Valid where send_pos[t][me] >= 0, which `sent` says.
struct OwnRow {
    const CombineArgs& a;
    const int* base;  // first received row of each source rank
    int64_t x_bytes, t;
    int me, R;
    __device__ int64_t index() const { return base[me] + a.send_pos[t * R + me]; }
    __device__ const uint8_t* row() const { return static_cast<const uint8_t*>(a.x) + index() * x_bytes; }
    __device__ const float* weights() const { return a.topk_weights + index() * a.num_topk; }
};

// Push: every row this rank holds for a token of window w goes to its owner's slot (token, this rank).
// The rows of all owners form one list (owners from the next rank on) spread over all warps of the
// kernel; the last block to finish raises every owner's pushed flag.
template <typename T, typename V, typename S>
__device__ bool push_window(const Env& e, const CombineCall& call, const Warps& warps, int w) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32;
    const int parity = w & 1, first = w * call.window_tokens;
    // Entry i of the list is received row lo[j] + i - starts[j] for owner (me + 1 + j) % R, where
    // starts[j] <= i < starts[j + 1].
    __shared__ int lo[kMaxRanks], starts[kMaxRanks + 1];
    // This rank's own rows stay where they are (the reduce reads them from x): owner me, the last, gets none.
    for (int j = threadIdx.x; j < R; j += blockDim.x)
        starts[j + 1] = j == R - 1 ? (lo[j] = 0) : owner_rows(a, call.base, (me + 1 + j) % R, first, first + call.window_tokens, lo[j]);
    __syncthreads();
    if (threadIdx.x == 0) {
        starts[0] = 0;
        for (int j = 0; j < R; ++j) starts[j + 1] += starts[j];
    }
    // Every owner opens window w for every rank: waiting for all of them never waits in vain. The
    // wait's barrier publishes starts.
    if (!block_wait(e, kOpenFrom, 0, R, tag(e.seq, w), kErrOpen, w)) return false;
    for (int item = warps.warp; item < starts[R]; item += warps.num_warps) {
        const int j = list_part(starts, R, item), s = (me + 1 + j) % R;
        const int64_t i = lo[j] + item - starts[j], t = a.recv_src_idx[i];
        uint8_t* dst = e.window(s, parity) + ((t - first) * R + me) * call.slot_bytes;
        warp_copy<Src::kReadOnly, S::kCopyDepth>(dst, static_cast<const uint8_t*>(a.x) + i * call.x_bytes, call.x_bytes, lane);
        for (int k = lane; k < K; k += 32)
            reinterpret_cast<float*>(dst + call.weights_offset)[k] = a.topk_weights[i * K + k];
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kPushCount + parity), warps.blocks))
        for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kPushedFrom, me), tag(e.seq, w));
    return true;
}

// Reduce this rank's window w once every rank pushed into it: bias, then every rank's row in ascending
// rank order, in float32; the last block to finish reopens the window half for window w + 2. A window
// may hold fewer tokens than the kernel has warps: then each token's row is cut into parts, a warp each.
template <typename T, typename V, typename S>
__device__ bool reduce_window(const Env& e, const CombineCall& call, const Warps& warps, int w) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, lane = threadIdx.x % 32;
    const int parity = w & 1, first = w * call.window_tokens;
    const int64_t chunks = call.x_bytes / sizeof(V);
    if (!block_wait(e, kPushedFrom, 0, R, tag(e.seq, w), kErrPushed, w)) return false;
    const uint8_t* window = e.window(me, parity);
    const int count = clamp_count(a.num_tokens, first, call.window_tokens);
    const int steps = static_cast<int>((chunks + 32 * kChunks - 1) / (32 * kChunks));  // a warp's passes over a row
    const int parts = count == 0 ? 1 : max(1, min(steps, warps.num_warps / count));
    for (int item = warps.warp; item < count * parts; item += warps.num_warps) {
        const int i = item / parts, part = item % parts;
        const int64_t t = first + i;
        uint64_t sent = 0;
        for (int r0 = 0; r0 < R; r0 += 32) {
            const int r = r0 + lane;
            const unsigned bits = __ballot_sync(kFullMask, r < R && a.send_pos[t * R + r] >= 0);
            sent |= static_cast<uint64_t>(bits) << r0;
        }
        const uint8_t* slots = window + static_cast<int64_t>(i) * R * call.slot_bytes;
        const int64_t begin = static_cast<int64_t>(steps) * part / parts * 32 * kChunks;
        const int64_t end = min(chunks, static_cast<int64_t>(steps) * (part + 1) / parts * 32 * kChunks);
        const OwnRow own{a, call.base, call.x_bytes, t, me, R};
        sum_token<T, V, S>(
            a, t, chunks, begin, end, sent,
            [&](int r) { return r == me ? own.row() : slots + r * call.slot_bytes; },
            [&](int r) { return r == me ? own.weights() : reinterpret_cast<const float*>(slots + r * call.slot_bytes + call.weights_offset); },
            part == 0, lane);
    }
    __syncthreads();
    if (threadIdx.x == 0 && arrive_last(e.own(kReduceCount + parity), warps.blocks))
        for (int r = 0; r < R; ++r) raise_flag(e.peer_array(r, kOpenFrom, me), tag(e.seq, w + 2));
    return true;
}

// T: element type; V: the vector a lane moves at once (16 bytes, or 8 for rows of 8-byte multiples).
// Every block pushes its share of window w to every owner, then reduces its share of its own window w.
template <typename T, typename V, typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    combine_kernel(Ctx c, CombineArgs a, int64_t slot_bytes, int window_tokens) {
    if (!chosen(a.choice)) return;  // the one-pass kernel ran
    const Env e = make_env(c, kKernelCombine);
    const int64_t x_bytes = static_cast<int64_t>(a.hidden) * sizeof(T);
    const CombineCall call{a, slot_bytes, x_bytes, align_up(x_bytes, kSlotAlign), window_tokens, a.recv_info + 2};
    const int max_tokens = a.recv_info[0];
    const int num_windows = max(1, ceil_div(max_tokens, window_tokens));
    const Warps warps = grid_warps<S::kWarps>();
    bool ok = load_volatile(e.own(kAbort)) == 0;
    // Windows 0 and 1 of this rank accept rows from now on (the previous kernel left them unused).
    if (ok && blockIdx.x == 0 && threadIdx.x == 0)
        for (int r = 0; r < e.num_ranks; ++r) raise_flag(e.peer_array(r, kOpenFrom, e.rank), tag(e.seq, 1));
    uint64_t since = e.start;
    for (int w = 0; ok && w < num_windows; ++w) {
        ok = push_window<T, V, S>(e, call, warps, w);
        since = end_phase(e, kPhasePush, since);
        if (ok) ok = reduce_window<T, V, S>(e, call, warps, w);
        since = end_phase(e, kPhaseReduce, since);
    }
    finish_kernel(e, e.own(kDoneCount));
}

// ------------------------------------------------------------------ streaming combine
// The combine from 4 ranks up (ctx.stream_combine, chosen in Python; measured in DESIGN.md, "Two-pass
// calls (no arena)": `moe-ep-bench intranode --modes combine --stream-combine 0` / `1`). The windowed
// combine above pushes a whole window before any of it is reduced, so the slots come back from DRAM and
// every window costs an all-rank handshake. Here the first `channels` blocks receive and the others
// send, at the same time. Every owner's tokens are cut into `channels` contiguous ranges; per (channel,
// sending rank) the owner's buffer holds a ring of `ring_rows` slots.
// A sending block serves one channel: in rounds, its warps write every owner's next rows of the
// channel, in token order, into the owner's ring, as far as each owner's consumed count allows (never
// waiting on one owner while another has room) and at most a send chunk per owner, since a round's
// rows are released only when the round ends: a ring that takes a whole channel would otherwise be
// written in full before its owner sums any of it. A receiving block takes its channel's tokens in
// batches of one token per warp, in order: a token's row from rank r is the next unread slot of ring
// r, because r sends in token order, and is summed in rank order as in the windowed combine (the same
// bits). Senders wait only on receivers and receivers only on senders; a batch never needs more rows
// of a ring than it holds, and every block is resident: no cycle of waits.
constexpr int kMaxStreamRanks = 32;  // a warp's lanes hold one rank each

struct StreamCall {
    const CombineArgs& a;
    int64_t slot_bytes, x_bytes, weights_offset;
    int ring_rows, channels;
    const int* base;        // first received row of each rank (R + 1)
    const int* src_tokens;  // every rank's num_tokens
};

// Tokens [first, last) of a rank with n tokens that channel c covers.
__device__ __forceinline__ void channel_tokens(int n, int c, int channels, int& first, int& last) {
    first = static_cast<int>(static_cast<int64_t>(n) * c / channels);
    last = static_cast<int>(static_cast<int64_t>(n) * (c + 1) / channels);
}

// Rank `owner`'s ring of channel c for rows from rank `from` (in the window area, unused meanwhile).
__device__ __forceinline__ uint8_t* stream_ring(const Env& e, const StreamCall& call, int owner, int c, int from) {
    return e.window(owner, 0) + (static_cast<int64_t>(c) * e.num_ranks + from) * call.ring_rows * call.slot_bytes;
}

// Rows counted in a ring counter of this call (tag(seq, rows)); a counter of a later call counts as
// everything (its rank is past this call), one of an earlier call as nothing.
__device__ __forceinline__ int counted_rows(uint64_t flag, uint64_t seq, int everything) {
    if (flag < tag(seq, 0)) return -1;
    return (flag >> 24) == seq ? static_cast<int>(flag & 0xffffff) - 1 : everything;
}

template <typename T, typename V, typename S>
__device__ bool stream_send(const Env& e, const StreamCall& call, int c) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, K = a.num_topk, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // Per owner j (rank (me + 1 + j) % R, so the senders start on different owners): its rows of the
    // channel (lo, count, sorted by token), rows written so far, and rows its ring has room up to.
    __shared__ int lo[kMaxStreamRanks], count[kMaxStreamRanks], sent[kMaxStreamRanks], room[kMaxStreamRanks];
    __shared__ int starts[kMaxStreamRanks + 1];
    __shared__ int state;
    enum { kGo, kDone, kFailed };
    if (threadIdx.x < R) {
        const int j = threadIdx.x, s = (me + 1 + j) % R;
        int first, last;
        channel_tokens(call.src_tokens[s], c, call.channels, first, last);
        // This rank's own rows stay in x (the receiver reads them there): its own ring gets none.
        count[j] = s == me ? (lo[j] = 0) : owner_rows(a, call.base, s, first, last, lo[j]);
        sent[j] = 0;
    }
    const uint8_t* x = static_cast<const uint8_t*>(a.x);
    while (true) {
        // Each round writes whatever room every owner's ring has, all warps over one list (a warp per
        // owner would leave most warps idle at few ranks), so no owner waits on another's ring.
        if (threadIdx.x < R) {
            const int j = threadIdx.x, s = (me + 1 + j) % R;
            room[j] = sent[j];
            if (sent[j] < count[j]) {
                const int consumed = counted_rows(load_acquire(e.own(stream_index(kConsumedBy, R, c, s))), e.seq, count[j]);
                if (consumed >= 0) room[j] = min(count[j], consumed + call.ring_rows);
                if (a.send_chunk > 0) room[j] = min(room[j], sent[j] + a.send_chunk);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int waiting_on = -1;
            starts[0] = 0;
            for (int j = 0; j < R; ++j) {
                starts[j + 1] = starts[j] + room[j] - sent[j];
                if (waiting_on < 0 && sent[j] < count[j]) waiting_on = j;
            }
            state = waiting_on < 0 ? kDone : kGo;
            // Every unfinished owner's ring is full: give up only at the deadline.
            if (waiting_on >= 0 && starts[R] == 0) {
                if (load_volatile(e.own(kAbort)) != 0) {
                    state = kFailed;
                } else if (now_ns() > e.deadline) {
                    const int s = (me + 1 + waiting_on) % R;
                    peer::report_timeout(e.failure(s), kErrRingRoom, s, c,
                                         tag(e.seq, 0), load_volatile(e.own(stream_index(kConsumedBy, R, c, s))));
                    state = kFailed;
                }
            }
        }
        __syncthreads();
        if (state != kGo) return state == kDone;
        for (int item = warp; item < starts[R]; item += S::kWarps) {
            const int j = list_part(starts, R, item), s = (me + 1 + j) % R;
            const int k = sent[j] + item - starts[j];
            const int64_t i = lo[j] + k;
            uint8_t* dst = stream_ring(e, call, s, c, me) + static_cast<int64_t>(k % call.ring_rows) * call.slot_bytes;
            warp_copy<Src::kReadOnly, S::kCopyDepth>(dst, x + i * call.x_bytes, call.x_bytes, lane);
            for (int k2 = lane; k2 < K; k2 += 32) reinterpret_cast<float*>(dst + call.weights_offset)[k2] = a.topk_weights[i * K + k2];
        }
        __syncthreads();  // the block's stores before the releases
        if (threadIdx.x < R && room[threadIdx.x] > sent[threadIdx.x]) {
            const int j = threadIdx.x, s = (me + 1 + j) % R;
            raise_flag(e.signals(s) + stream_index(kProducedFrom, R, c, me), tag(e.seq, room[j]));
            sent[j] = room[j];
        }
    }
}

// A receiving block's view of its channel: where each sender's rows of the channel start in its ring,
// and how many of them it has read.
struct StreamChannel {
    int c, first, last;       // channel, its tokens [first, last)
    const int* ring_first;    // per sender: send_pos of the channel's first token it got
    int* consumed;            // per sender: its ring rows read so far
    const uint8_t* rings;     // this rank's rings of the channel, one per sender
    int64_t ring_bytes;
};

// One token of the channel, by one warp: waits for its rows in the rings and sums them (a rank's own
// row read in place in x). -> false where a wait gave up (reported).
template <typename T, typename V, typename S>
__device__ bool receive_token(const Env& e, const StreamCall& call, const StreamChannel& ch, int64_t t, int lane) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank;
    int k = -1;  // lane r: ring index of this token's row from rank r
    if (lane < R) {
        const int p = a.send_pos[t * R + lane];
        if (p >= 0) k = p - ch.ring_first[lane];
    }
    bool ready = true;
    if (k >= 0 && lane != me)  // this rank's own row is read in place, never sent
        ready = wait_flag(e, e.own(stream_index(kProducedFrom, R, ch.c, lane)), tag(e.seq, k + 1), kErrRingRows, lane, ch.c);
    if (!__all_sync(kFullMask, ready)) return false;
    const unsigned sent = __ballot_sync(kFullMask, k >= 0);
    const int64_t offset = k >= 0 ? lane * ch.ring_bytes + static_cast<int64_t>(k % call.ring_rows) * call.slot_bytes : 0;
    const OwnRow own{a, call.base, call.x_bytes, t, me, R};
    sum_token<T, V, S>(
        a, t, call.x_bytes / sizeof(V), 0, call.x_bytes / sizeof(V), sent,
        [&](int r) { return r == me ? own.row() : ch.rings + __shfl_sync(kFullMask, offset, r); },
        [&](int r) {
            return r == me ? own.weights()
                           : reinterpret_cast<const float*>(ch.rings + __shfl_sync(kFullMask, offset, r) + call.weights_offset);
        },
        true, lane);
    if (k >= 0) atomicMax(&ch.consumed[lane], k + 1);
    return true;
}

// Ranks from which a channel is received per warp rather than in batches. Measured on one H200 at 24
// SMs (`moe-ep-bench intranode --ranks 4 8 --sms 24 --modes combine`, A/B): per warp -2% at 4 ranks, +6%
// at 8; the batch barrier costs more the more senders a token's rows wait on.
constexpr int kPerWarpReceiveMinRanks = 8;
constexpr int kLookahead = 4;  // tokens a receiving warp looks at for a ring's next row (per warp)

// The channel's tokens, a token a warp at a time, in one of two ways (one loop: sum_token is inlined
// once, which keeps the 64-register shapes' spills where they were).
// In batches (below kPerWarpReceiveMinRanks ranks): a block barrier after each batch of min(warps, ring
// rows) tokens, then one release per sender.
// Per warp: each warp goes on without waiting for the others. next_token[w] says that warp w summed
// all its tokens below it, so every token below the smallest entry ("below") is summed, and a ring's
// rows of those tokens are read. After each token a warp tells the senders what below allows: for
// ring r, the index of r's first row at or past below, when one lies within kLookahead tokens (else
// nothing now), or all of r's rows once none is left in the channel; only steps of `publish_step` rows
// or the end are told (a system-scope fence each). No wait closes a cycle: the slowest warp's token is
// below itself, so its rows are what was found at distance 0, at most publish_step <= ring_rows past
// what the senders were told, and they always fit the rings.
template <typename T, typename V, typename S>
__device__ bool receive_channel(const Env& e, const StreamCall& call, const StreamChannel& ch) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    constexpr int W = S::kWarps;
    const int first = ch.first, last = ch.last;
    const bool per_warp = R >= kPerWarpReceiveMinRanks;
    __shared__ int next_token[W];
    __shared__ int published[kMaxStreamRanks];  // per sender: rows last told
    if (threadIdx.x < W) next_token[threadIdx.x] = min(first + static_cast<int>(threadIdx.x), last);
    if (threadIdx.x < R) published[threadIdx.x] = 0;
    __syncthreads();
    const int publish_step = max(1, min(W, call.ring_rows / 2));
    const int step = per_warp ? W : min(W, call.ring_rows);  // a batch needs at most that many rows of a ring
    for (int b0 = first; b0 < last; b0 += step) {
        const int64_t t = b0 + warp;
        const bool mine = warp < step && t < last;
        const bool failed = mine && !receive_token<T, V, S>(e, call, ch, t, lane);
        if (!per_warp) {
            // The batch's rows are read (their slots may be refilled), and every thread learns of a failed wait.
            if (__syncthreads_or(failed)) return false;
            if (threadIdx.x < R)
                raise_flag(e.signals(threadIdx.x) + stream_index(kConsumedBy, R, ch.c, me), tag(e.seq, ch.consumed[threadIdx.x]));
            continue;
        }
        if (failed) return false;  // reported; the other warps' waits give up too
        if (!mine) continue;
        // This warp's rows are read; then the fence orders its progress against every other warp's (of
        // two warps moving at once, at least one sees both).
        __syncwarp();
        if (lane == 0) {
            __threadfence_block();
            *reinterpret_cast<volatile int*>(&next_token[warp]) = static_cast<int>(min(t + W, static_cast<int64_t>(last)));
            __threadfence_block();
        }
        __syncwarp();
        int below = lane < W ? *reinterpret_cast<volatile int*>(&next_token[lane]) : last;
        for (int w = lane + 32; w < W; w += 32) below = min(below, *reinterpret_cast<volatile int*>(&next_token[w]));
        below = __reduce_min_sync(kFullMask, below);
        if (lane < R) {
            int rows = -1;  // ring `lane`'s rows of the tokens below `below` (-1: not known now)
            int p[kLookahead];
#pragma unroll
            for (int i = 0; i < kLookahead; ++i)
                p[i] = below + i < last ? a.send_pos[static_cast<int64_t>(below + i) * R + lane] : -1;
#pragma unroll
            for (int i = 0; i < kLookahead; ++i)
                if (rows < 0 && p[i] >= 0) rows = p[i] - ch.ring_first[lane];
            // None left in the channel: every row it sent, all read by now.
            if (rows < 0 && below + kLookahead >= last) rows = *reinterpret_cast<volatile int*>(&ch.consumed[lane]);
            const int told = *reinterpret_cast<volatile int*>(&published[lane]);
            if (rows >= 0 && (rows >= told + publish_step || (below >= last && rows > told)) &&
                atomicMax(&published[lane], rows) < rows)
                raise_flag(e.signals(lane) + stream_index(kConsumedBy, R, ch.c, me), tag(e.seq, rows));
        }
    }
    return true;
}

template <typename T, typename V, typename S>
__device__ bool stream_receive(const Env& e, const StreamCall& call, int c) {
    const CombineArgs& a = call.a;
    const int R = e.num_ranks, me = e.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __shared__ int ring_first[kMaxStreamRanks];
    __shared__ int consumed[kMaxStreamRanks];
    // This call's rings are open: the previous call read them all before its kernel ended.
    if (threadIdx.x < R) {
        raise_flag(e.signals(threadIdx.x) + stream_index(kConsumedBy, R, c, me), tag(e.seq, 0));
        consumed[threadIdx.x] = 0;
    }
    int first, last;
    channel_tokens(a.num_tokens, c, call.channels, first, last);
    for (int r = warp; r < R; r += S::kWarps) {
        int found = 0;
        for (int t0 = first; t0 < last; t0 += 32) {
            const int p = t0 + lane < last ? a.send_pos[static_cast<int64_t>(t0 + lane) * R + r] : -1;
            const unsigned hits = __ballot_sync(kFullMask, p >= 0);
            if (hits != 0) {
                found = __shfl_sync(kFullMask, p, __ffs(hits) - 1);
                break;
            }
        }
        if (lane == 0) ring_first[r] = found;
    }
    __syncthreads();
    const StreamChannel ch{c, first, last, ring_first, consumed, stream_ring(e, call, me, c, 0),
                           static_cast<int64_t>(call.ring_rows) * call.slot_bytes};
    return receive_channel<T, V, S>(e, call, ch);
}

template <typename T, typename V, typename S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    stream_combine_kernel(Ctx c, CombineArgs a, int64_t slot_bytes, int ring_rows, int channels) {
    if (!chosen(a.choice)) return;  // the one-pass kernel ran
    const Env e = make_env(c, kKernelStreamCombine);
    const int64_t x_bytes = static_cast<int64_t>(a.hidden) * sizeof(T);
    const StreamCall call{a, slot_bytes, x_bytes, align_up(x_bytes, kSlotAlign), ring_rows, channels,
                          a.recv_info + 2, a.recv_info + 3 + e.num_ranks};
    if (load_volatile(e.own(kAbort)) == 0) {
        if (blockIdx.x < channels) {
            stream_receive<T, V, S>(e, call, blockIdx.x);
            end_phase(e, kPhaseReduce, e.start);
        } else if (blockIdx.x < 2 * channels) {
            stream_send<T, V, S>(e, call, blockIdx.x - channels);
            end_phase(e, kPhasePush, e.start);
        }
    }
    finish_kernel(e, e.own(kDoneCount));
}

template <typename T, typename V>
struct CombineKernels {
    template <typename S>
    struct Of {
        static constexpr auto fn = combine_kernel<T, V, S>;
    };
};
template <typename T, typename V>
struct StreamCombineKernels {
    template <typename S>
    struct Of {
        static constexpr auto fn = stream_combine_kernel<T, V, S>;
    };
};

}  // namespace

int combine_window_tokens(int num_ranks, int64_t num_nvl_bytes, int64_t x_bytes, int num_topk) {
    const int64_t half = half_bytes(num_nvl_bytes, num_ranks), slot = combine_slot_bytes(x_bytes, num_topk);
    if (slot == 0) return 0;  // an empty row: nothing to hold
    const int64_t tokens = half / (slot * num_ranks);
    return static_cast<int>(tokens < (1 << 22) ? tokens : (1 << 22));
}

// The streaming combine needs a receiving and a sending block per channel.
static int stream_channels(const Ctx& ctx) { return std::min(ctx.num_blocks / 2, kStreamChannels); }

int stream_ring_rows(const Ctx& ctx, int64_t x_bytes, int num_topk) {
    const int channels = stream_channels(ctx);
    if (!ctx.stream_combine || ctx.num_ranks > kMaxStreamRanks || channels < 1) return 0;
    const int64_t rows = 2 * half_bytes(ctx.num_nvl_bytes, ctx.num_ranks) /
                         (channels * ctx.num_ranks * combine_slot_bytes(x_bytes, num_topk));
    return static_cast<int>(std::min<int64_t>(rows, 1 << 20));
}

void combine(const Ctx& ctx, const CombineArgs& args) {
    const int64_t x_bytes = combine_row_bytes(ctx, args);
    const int window = combine_window_tokens(ctx.num_ranks, ctx.num_nvl_bytes, x_bytes, args.num_topk);
    if (window < 1) throw std::runtime_error("moe_ep: the intranode buffer cannot hold one combine window");
    const int64_t slot = combine_slot_bytes(x_bytes, args.num_topk);
    // Outputs and biases are whole rows of x_bytes: 16-byte vectors when every row starts aligned.
    const bool wide = x_bytes % 16 == 0;
    const int rows = stream_ring_rows(ctx, x_bytes, args.num_topk);
    if (rows > 0)
        launch_for_rows<StreamCombineKernels>(ctx, "intranode stream_combine_kernel", args.dtype, wide, args, slot, rows,
                                              stream_channels(ctx));
    else
        launch_for_rows<CombineKernels>(ctx, "intranode combine_kernel", args.dtype, wide, args, slot, window);
}

}  // namespace intranode
}  // namespace moe_ep
