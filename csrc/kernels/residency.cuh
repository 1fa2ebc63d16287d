// When the intranode kernels' blocks can all be resident at once (they wait on each other across
// ranks). Plain arithmetic, free of CUDA, so that tests compile it for the host
// (tests/test_residency.py); intranode.cu asks the occupancy API for `own`.
#pragma once

#include <cstdint>

namespace moe_ep {
namespace intranode {

// Kernels resident at once per block of one rank's kernel, with `ranks_on_device` ranks on its GPU:
// two kernels of each when ranks share it (one rank in combine while another finishes its dispatch).
constexpr int64_t resident_share(int ranks_on_device) { return ranks_on_device > 1 ? 2LL * ranks_on_device : 1; }

// The most blocks each kernel of a rank may have, in a shape of which this process's SMs hold `own`, so
// that every block of every rank on this GPU is resident at once. Under an MPS SM share
// (sm_share_percent < 100) CUDA reports only this process's part of the SMs, rounded down to whole TPCs
// (72 of an H200's 132 at 56%, the launcher's share for 8 ranks): this rank's two kernels must fit that
// part, and all ranks' kernels the whole GPU, of at least reported x 100 / share SMs. That estimate errs
// low, the safe side: a budget that did not fit would wait until the deadline; one refused is named in
// the error.
constexpr int64_t most_resident_blocks(int64_t own, int ranks_on_device, int sm_share_percent) {
    const int64_t whole = sm_share_percent > 0 && sm_share_percent < 100 ? own * 100 / sm_share_percent : own;
    const int64_t all_ranks = whole / resident_share(ranks_on_device);
    const int64_t this_rank = own / (ranks_on_device > 1 ? 2 : 1);
    return all_ranks < this_rank ? all_ranks : this_rank;
}

}  // namespace intranode
}  // namespace moe_ep
