// When the intranode kernels' blocks can all be resident at once (they wait on each other across
// ranks). Plain arithmetic, free of CUDA, so that tests compile it for the host
// (tests/test_residency.py); intranode/launch.cu asks the occupancy API for `own` and `per_sm`.
#pragma once

#include <cstdint>

namespace moe_ep {
namespace intranode {

// An MPS SM share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) below 100%.
constexpr bool under_sm_share(int sm_share_percent) { return sm_share_percent > 0 && sm_share_percent < 100; }

// Whether most_resident_blocks (below) counts one data kernel of each rank (plus the others' waiting
// blocks) rather than two.
constexpr bool one_kernel_each(int ranks_on_device, int sm_share_percent, bool start_together) {
    return ranks_on_device <= 1 || (start_together && !under_sm_share(sm_share_percent));
}

// The most blocks each kernel of a rank may have, in a shape of which this process's SMs hold `own`
// (`per_sm` on each SM), so that every block of every rank on this GPU is resident at once.
//
// What else can be alive on the GPU while a data kernel waits for its peers depends on how the ranks'
// data kernels start, the same on every rank (`start_together`):
//  - Together, where ranks share a GPU and every data kernel waits behind a one-block rendezvous or its
//    call's count exchange, which finishes only once every rank has reached that call: no rank's data
//    kernel of call c starts before every rank's call c - 1 is over, so a data kernel shares the GPU with
//    the same call's data kernels of the other ranks only, and with one waiting block of each rank that
//    already finished it (its next call's rendezvous or count exchange; the count exchange's other blocks
//    do not wait). Such a block is counted as a whole SM, since a data block needs an SM's registers.
//  - Otherwise (MOE_EP_RENDEZVOUS=0), two kernels of each rank (one rank in combine while another
//    finishes its dispatch).
// Under an MPS SM share (sm_share_percent < 100) the two-kernel count stays, together or not: the
// launcher's share, (R + 1) / 2R of the GPU a rank (moe_ep.mps.client_sm_share), is what lets one rank's
// GEMMs, whose blocks may wait on each other, be placed beside the other ranks' communication kernels
// when those hold 1 / 2R of the GPU each; counting one kernel would let them hold up to 1 / R. CUDA then
// reports only this process's part of the SMs, rounded down to whole TPCs (72 of an H200's 132 at 56%,
// the launcher's share for 8 ranks): this rank's two kernels must fit that part, and all ranks' kernels
// the whole GPU, of at least reported x 100 / share SMs. That estimate errs low, the safe side: a budget
// that did not fit would wait until the deadline; one refused is named in the error.
constexpr int64_t most_resident_blocks(int64_t own, int64_t per_sm, int ranks_on_device, int sm_share_percent,
                                       bool start_together) {
    if (ranks_on_device <= 1) return own;
    const int64_t ranks = ranks_on_device;
    if (one_kernel_each(ranks_on_device, sm_share_percent, start_together)) {
        const int64_t most = (own - (ranks - 1) * per_sm) / ranks;
        return most > 0 ? most : 0;
    }
    const int64_t whole = under_sm_share(sm_share_percent) ? own * 100 / sm_share_percent : own;
    const int64_t all_ranks = whole / (2 * ranks), this_rank = own / 2;
    return all_ranks < this_rank ? all_ranks : this_rank;
}

}  // namespace intranode
}  // namespace moe_ep
