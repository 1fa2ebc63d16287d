// The launch decisions every intranode data kernel shares, made on the host: which shape fits, how many
// blocks a kernel runs on, and whether the blocks fit at all.
#include <cstdint>

#include "../cuda_check.cuh"
#include "../residency.cuh"
#include "launch.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// 16-byte loads a block of each shape keeps in flight in its row copies.
constexpr int kShapeLoads[kNumShapes] = {Solo::kThreads * Solo::kCopyDepth, Wide::kThreads * Wide::kCopyDepth,
                                         Narrow::kThreads * Narrow::kCopyDepth, Full::kThreads * Full::kCopyDepth};
// The shapes a launch tries, first to last (indices into Shapes): Solo, Wide, Narrow, or Full, Wide,
// Narrow (Full fits wherever Solo does, so one of the two is enough).
struct ShapeOrder {
    int shape[3];
};
const ShapeOrder& shape_order(bool full_first) {
    static constexpr ShapeOrder solo_first{{0, 1, 2}}, full_first_order{{3, 1, 2}};
    return full_first ? full_first_order : solo_first;
}
// How many blocks of `kernel` this process's SMs hold at once. Occupancy does not change during a run:
// asked once per kernel (a handful of kernels per process; 15 families in four shapes at most).
int cached_resident_blocks(const void* kernel, int threads) {
    static thread_local const void* kernels[64] = {};
    static thread_local int blocks[64] = {};
    for (int i = 0; i < 64; ++i) {
        if (kernels[i] == kernel) return blocks[i];
        if (kernels[i] == nullptr) {
            kernels[i] = kernel;
            return blocks[i] = resident_blocks(kernel, threads);
        }
    }
    return resident_blocks(kernel, threads);
}

}  // namespace

int first_fitting_shape(const Shapes& shapes, bool full_first, int64_t blocks, int ranks_on_device,
                        int sm_share_percent, bool start_together, int64_t* most) {
    // Asked once, like the occupancy: this runs before every data kernel's launch.
    static thread_local const int sms = sm_count();
    for (const int i : shape_order(full_first).shape) {
        const int own = cached_resident_blocks(shapes.kernel[i], kShapeThreads[i]);
        *most = most_resident_blocks(own, own / sms, ranks_on_device, sm_share_percent, start_together);
        if (blocks <= *most) return i;
    }
    return -1;
}

void check_blocks_fit(const Ctx& ctx) {
    // The combine kernels have the same shapes (launch bounds, no dynamic shared memory).
    launch_resident(ctx, dispatch_shapes(), "check_blocks_fit", [](int) {});
}

int fitted_blocks(int budget, int ranks_on_device, bool full_first, int sm_share_percent, bool start_together) {
    if (ranks_on_device <= 1) return budget;  // one block an SM up to the SM count: nothing to gain
    // The answer depends only on the arguments (occupancy does not change during a run): kept per thread,
    // one entry per shape order, since dispatches and combines alternate.
    struct Answer {
        int budget = -1, ranks = -1, share = -1;
        bool together = false;
        int blocks = 0;
    };
    static thread_local Answer last[2];
    Answer& answer = last[full_first ? 1 : 0];
    if (budget == answer.budget && ranks_on_device == answer.ranks && sm_share_percent == answer.share &&
        start_together == answer.together)
        return answer.blocks;
    // Every shape's rate follows the loads its threads keep in flight, so those are counted (4 ranks on
    // one H200 at a budget of 24: 16 Solo blocks keep 98K in flight where 24 Wide ones keep 74K); a tie
    // keeps the budget (the largest count is tried first and only a strict gain moves off it).
    const Shapes shapes = dispatch_shapes();
    int blocks = budget;
    int64_t most = 0;
    // Even counts only, as budgets are (Config): the streaming combine pairs a receiving and a sending
    // block per channel.
    for (int b = budget; b >= 2; b -= 2) {
        int64_t fitting = 0;
        const int shape =
            first_fitting_shape(shapes, full_first, b, ranks_on_device, sm_share_percent, start_together, &fitting);
        if (shape >= 0 && static_cast<int64_t>(b) * kShapeLoads[shape] > most) {
            most = static_cast<int64_t>(b) * kShapeLoads[shape];
            blocks = b;
        }
    }
    answer = {budget, ranks_on_device, sm_share_percent, start_together, blocks};
    return blocks;
}

}  // namespace intranode
}  // namespace moe_ep
