// The ranks' agreement on the path of a call that can take one pass or two (a Buffer with an arena).
#include "../cuda_check.cuh"
#include "common.cuh"

namespace moe_ep {
namespace intranode {
namespace {

// Both of the call's data kernels are queued behind this one and each returns at once unless it is the
// one chosen (chosen() in common.cuh): the choice is made here, on the device, from every rank's vote,
// so it needs no host round trip. Its one block also serves as the call's rendezvous. A vote rides on
// the arrival flag itself (the step of its tag), which no peer raises again before this rank has read
// it: each peer's next arrival follows the data kernel chosen here, which waits for this rank.
constexpr int kAgreeThreads = 64;
__global__ void __launch_bounds__(kAgreeThreads) agree_kernel(Ctx c, AgreeArgs a) {
    c.wait_ns = nullptr;  // the wait profile is the data kernels' (its slots are theirs)
    const Env e = make_env(c, kKernelAgree);
    int vote = a.vote;
    if (a.recv_info != nullptr &&
        dispatch_region(a.recv_info[1], a.x_bytes, a.scale_bytes, a.num_topk).bytes > a.region_bytes)
        vote &= ~kVoteRoom;
    bool ok = load_volatile(e.own(kAbort)) == 0;
    if (ok) {
        for (int r = threadIdx.x; r < e.num_ranks; r += blockDim.x)
            raise_flag(e.peer_array(r, kArrivedFrom, e.rank), tag(e.seq, vote));
        ok = block_wait(e, kArrivedFrom, 0, e.num_ranks, tag(e.seq, 0), kErrRendezvous, kKernelAgree);
    }
    if (threadIdx.x == 0) {
        int all = kVoteRoom | kVoteInPlace;
        for (int r = 0; r < e.num_ranks; ++r)
            all &= static_cast<int>((load_volatile(e.peer_array(e.rank, kArrivedFrom, r)) & 0xFFFFFF) - 1);
        const int one_pass = ok && (all & kVoteRoom) && ((all & kVoteInPlace) || a.copy_ok);
        *a.choice = one_pass;
        volatile int* host = reinterpret_cast<volatile int*>(e.host);
        host[kHostChoice] = one_pass;
        __threadfence_system();
        host[kHostChoiceDone] = a.nonce;
    }
    finish_kernel(e, e.own(kDoneCount));
}

}  // namespace

void agree(const Ctx& ctx, const AgreeArgs& args) {
    agree_kernel<<<1, kAgreeThreads, 0, ctx.stream>>>(ctx, args);
    MOE_EP_LAUNCH_CHECK("intranode agree_kernel");
}

}  // namespace intranode
}  // namespace moe_ep
