// The one-block kernel that a data kernel starts behind where ranks share a GPU.
#include "../cuda_check.cuh"
#include "common.cuh"
#include "launch.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// Where ranks share a GPU, a data kernel that starts before its peers reach the call holds its blocks'
// SMs while it waits for them, and a peer whose expert GEMMs are still ahead of the call can then find
// too few SMs to finish them: with seven ranks' combines waiting, grids resident, the eighth rank never
// reached its combine before the deadline (`tests/test_shared_gpu.py`; DESIGN.md, "Synchronisation"). This
// one-block kernel goes first: it tells every rank that this one reached the call and waits until all
// have, so the data kernel queued behind it starts only once every rank's is about to, and a rank
// waits for late peers on one block instead of a whole grid. `c.rendezvous_before` names that kernel
// in a timeout's report.
constexpr int kRendezvousThreads = 64;
__global__ void __launch_bounds__(kRendezvousThreads) rendezvous_kernel(Ctx c) {
    c.wait_ns = nullptr;  // the wait profile is the data kernels' (its slots are theirs)
    const Env e = make_env(c, kKernelRendezvous);
    if (load_volatile(e.own(kAbort)) == 0) {
        for (int r = threadIdx.x; r < e.num_ranks; r += blockDim.x)
            raise_flag(e.peer_array(r, kArrivedFrom, e.rank), tag(e.seq, 0));
        block_wait(e, kArrivedFrom, 0, e.num_ranks, tag(e.seq, 0), kErrRendezvous, c.rendezvous_before);
    }
    finish_kernel(e, e.own(kDoneCount));
}

}  // namespace

void launch_rendezvous(const Ctx& ctx) {
    rendezvous_kernel<<<1, kRendezvousThreads, 0, ctx.stream>>>(ctx);
    MOE_EP_LAUNCH_CHECK("intranode rendezvous_kernel");
}

}  // namespace intranode
}  // namespace moe_ep
