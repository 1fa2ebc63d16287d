// How the intranode data kernels are launched (host side): the block shapes each is built in, and the
// choice of the first shape whose blocks, for every rank on this GPU, are resident together. Each kernel
// file instantiates the templates below for its own kernels; launch.cu holds the rest.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../api.cuh"
#include "../cuda_check.cuh"
#include "../residency.cuh"

namespace moe_ep {
namespace intranode {

// Every block of every rank must be resident at once (they wait on each other), and with several
// ranks on one GPU two consecutive kernels of different ranks can be alive together (one rank in
// combine while another finishes its dispatch): 2 * ranks * blocks must fit. Each kernel is built in
// four shapes and a launch takes the first whose blocks fit (launch_resident), in the order
// shape_order(ctx.full_first) gives:
//  - Solo: 512 threads, one block per SM, so 128 registers per thread: no spills, and twice the
//    loads in flight per lane. The kernels are bound by memory latency (every warp waits on its own
//    loads; the wait profile shows little waiting on peers), so loads in flight are what moves bytes.
//  - Wide: 512 threads, two blocks per SM (64 registers).
//  - Narrow: 256 threads, four per SM. Measured on an H200: 512-thread blocks moved 15-20% more than
//    256-thread ones at 2 and 4 ranks, and deadlocked until the deadline with 8 ranks of 20 blocks
//    (2 per SM: 264 fit) before the shape was chosen by residency.
//  - Full: 1024 threads, one block per SM (64 registers, the code of Wide): the threads of two Wide
//    blocks in one, so fewer blocks, which is what residency rations when ranks share a GPU (4 ranks at
//    a budget of 24: 16 Full blocks hold 16,384 threads where 24 Wide ones hold 12,288). Tried first,
//    instead of Solo, by the kernels that gained from it where ranks share a GPU (Ctx::full_first).
template <int kThreadsPerBlock, int kBlocksPerSm>
struct Shape {
    static constexpr int kThreads = kThreadsPerBlock;
    static constexpr int kMinBlocks = kBlocksPerSm;
    static constexpr int kWarps = kThreads / 32;
    // What __launch_bounds__ leaves a thread of the SM's 64K registers (at most 255).
    static constexpr int kRegisters = 65536 / (kThreadsPerBlock * kBlocksPerSm);
    // 16-byte loads in flight per lane in a row copy.
    static constexpr int kCopyDepth = kRegisters >= 128 ? 12 : 6;
    // The two-pass dispatch may copy rows two at a time (peer::warp_copy_rows; rows_in_pairs says
    // when): measured faster at depth 12 (fp8 +10% at 2 ranks on one H200), slower at 6 (bf16 -1.5% at 4
    // and 8 ranks).
    static constexpr bool kPairs = kCopyDepth >= 12;
    // Combine loads up to this many ranks' slots of a token at once (kChunks vectors of each per lane)
    // before summing them in rank order.
    static constexpr int kCombineBatch = kRegisters >= 128 ? 4 : 2;
};
using Solo = Shape<512, 1>;
using Wide = Shape<512, 2>;
using Narrow = Shape<256, 4>;
using Full = Shape<1024, 1>;

// A kernel built in the four shapes.
constexpr int kNumShapes = 4;
struct Shapes {
    const void* kernel[kNumShapes];  // Solo, Wide, Narrow, Full
};
constexpr int kShapeThreads[kNumShapes] = {Solo::kThreads, Wide::kThreads, Narrow::kThreads, Full::kThreads};
// The first shape, in the order full_first picks, that holds `blocks` blocks per kernel on every rank
// of this GPU at once; -1 when none does (*most: the blocks per kernel the last shape tried holds).
int first_fitting_shape(const Shapes& shapes, bool full_first, int64_t blocks, int ranks_on_device,
                        int sm_share_percent, bool start_together, int64_t* most);

// The one-block kernel (rendezvous.cu) that a data kernel starts behind where ctx.rendezvous_before asks.
void launch_rendezvous(const Ctx& ctx);

// Launches the first shape whose blocks, for every rank on this GPU, are resident together, behind a
// rendezvous kernel where ctx.rendezvous_before asks for one; none fits: an error that names the limit
// (and nothing is launched, so the ranks stay in step). launch(shape index).
template <typename Launch>
void launch_resident(const Ctx& ctx, const Shapes& shapes, const char* what, Launch launch) {
    int64_t most = 0;
    const int shape =
        first_fitting_shape(shapes, ctx.full_first, ctx.num_blocks, ctx.ranks_on_device, ctx.sm_share_percent,
                            ctx.start_together, &most);
    if (shape >= 0) {
        if (ctx.rendezvous_before != 0) launch_rendezvous(ctx);
        launch(shape);
        MOE_EP_LAUNCH_CHECK(what);
        return;
    }
    const bool shared = under_sm_share(ctx.sm_share_percent);
    const char* alive = ctx.ranks_on_device <= 1 ? "one kernel alive at a time"
                        : one_kernel_each(ctx.ranks_on_device, ctx.sm_share_percent, ctx.start_together)
                            ? "one kernel of each rank, and a waiting block of each other rank, alive together"
                            : "two kernels of each rank can be alive together";
    throw std::invalid_argument(
        "num_sms (Config): " + std::to_string(ctx.num_blocks) + " blocks per kernel with " +
        std::to_string(ctx.ranks_on_device) + " rank(s) on this GPU cannot all be resident at once (" + alive +
        (shared ? ", this process holding " + std::to_string(sm_count()) + " SMs under its MPS share of " +
                      std::to_string(ctx.sm_share_percent) + "%"
                : std::string()) +
        "): use num_sms <= " + std::to_string(most));
}

template <template <typename> class Kernel>
Shapes shapes_of() {
    return {{reinterpret_cast<const void*>(Kernel<Solo>::fn), reinterpret_cast<const void*>(Kernel<Wide>::fn),
             reinterpret_cast<const void*>(Kernel<Narrow>::fn), reinterpret_cast<const void*>(Kernel<Full>::fn)}};
}

// Launches kernel<Solo | Wide | Narrow | Full>(args...) on the first shape that fits.
template <template <typename> class Kernel, typename... Args>
void launch_shaped(const Ctx& ctx, const char* what, Args... args) {
    launch_resident(ctx, shapes_of<Kernel>(), what, [&](int i) {
        const dim3 grid(ctx.num_blocks), block(kShapeThreads[i]);
        if (i == 0) Kernel<Solo>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
        else if (i == 1) Kernel<Wide>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
        else if (i == 2) Kernel<Narrow>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
        else Kernel<Full>::fn<<<grid, block, 0, ctx.stream>>>(ctx, args...);
    });
}

// The dispatch kernel's shapes (dispatch.cu), for check_blocks_fit and fitted_blocks.
Shapes dispatch_shapes();

}  // namespace intranode
}  // namespace moe_ep
