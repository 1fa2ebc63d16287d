"""Training-like steps on ranks sharing a GPU, with each rank's SMs capped as `moe_ep.launch` caps them:
the later ranks run more expert GEMMs between their calls, so the earlier ranks' kernels wait for them
while the GEMMs want the SMs. Without the cap this stalled megatron training with four ranks on one
H200 (`scripts/train_check.sh`); with it the results must be the portable backend's, bit for bit, every
step. MOE_EP_TEST_SM_SHARE overrides the share (100: no cap). Before the rendezvous these steps
reproduced a stall with eight ranks under the cap, in 2 of 3 runs: seven ranks' combines held the SMs
while the eighth was still in its GEMMs; a combine now starts behind a rendezvous kernel where ranks
share a GPU, and they passed 3 of 3 runs of 24 steps under the cap (1 of 1 without).
MOE_EP_TEST_SHARED_STEPS sets the steps (each is two calls).
Where every rank has a GPU of its own there is no cap, and the test checks the GEMMs beside the calls."""
import os

import pytest
import torch

from moe_ep import _native
from moe_ep.launch import RankPool, ranks_share_a_gpu, sm_share_env

from . import rank_fns
from .problems import Problem, same_bits
from .test_low_latency_kernels import _compare as _compare_low_latency

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason())),
]

# MOE_EP_TEST_SHARED_STEPS: more steps, for a longer look for stalls (the training's came after 125 to
# 245 calls; 12 steps are 24).
STEPS = int(os.environ.get("MOE_EP_TEST_SHARED_STEPS", "12"))


@pytest.fixture(scope="module")
def capped_pools():
    """capped_pools(n): n CUDA ranks as gpu_pools makes them, each with the launcher's SM share where they
    share a GPU."""
    started = {}

    def get(num_ranks: int) -> RankPool:
        if num_ranks not in started or not started[num_ranks].alive:
            env = {"MOE_EP_TEST_CUDA": "1", "MOE_EP_BACKEND": "kernels"}
            if ranks_share_a_gpu(num_ranks):
                env.update(sm_share_env(os.environ.get("MOE_EP_TEST_SM_SHARE", "auto"), num_ranks))
            started[num_ranks] = RankPool(num_ranks, use_cuda=True, backend="gloo", env=env)
        return started[num_ranks]

    yield get
    for pool in started.values():
        pool.close()


@pytest.mark.parametrize("num_ranks", [4, 8])
@pytest.mark.parametrize("arena", [None, False, True], ids=["default_arena", "two_pass", "arena"])
def test_steps_beside_expert_gemms_equal_portable(pools, capped_pools, seed, num_ranks, arena):
    p = Problem(seed, num_ranks, num_ranks * 4, 1024, 6, max_tokens=512)
    on_gpu = capped_pools(num_ranks).run(rank_fns.normal_steps_beside_gemms, p, STEPS, arena=arena)
    on_cpu = pools(num_ranks).run(rank_fns.normal_steps_beside_gemms, p, 1)
    names = ("recv_x", "recv_idx", "recv_w", "counts", "combined", "combined_w")
    for rank, (steps, (expected,)) in enumerate(zip(on_gpu, on_cpu)):
        assert len(steps) == STEPS
        for step, got in enumerate(steps):
            for name, g, c in zip(names, got, expected):
                assert same_bits(g, c), f"seed {seed} rank {rank} step {step}: {name} differs from the portable backend"


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_low_latency_steps_beside_expert_gemms_equal_portable(pools, capped_pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 1024, 6, max_tokens=128)
    on_gpu = capped_pools(num_ranks).run(rank_fns.low_latency_steps_beside_gemms, p, STEPS)
    (on_cpu,) = zip(*pools(num_ranks).run(rank_fns.low_latency_steps_beside_gemms, p, 1))
    for step in range(STEPS):
        _compare_low_latency(f"{seed} step {step}", [steps[step] for steps in on_gpu], on_cpu, use_fp8=True)


def test_sm_budgets_under_the_share_are_checked_against_the_whole_gpu(capped_pools):
    """Under an SM share CUDA reports only the share's SMs (72 of the H200's 132 at 8 ranks' 56%): the
    residency check that counted them as the whole GPU refused the default budget at 8 ranks. The default
    must be taken, and a budget that cannot be resident still refused."""
    p = Problem(4, 8, 32, 128, 2, max_tokens=8)
    share = sm_share_env(os.environ.get("MOE_EP_TEST_SM_SHARE", "auto"), 8).get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    for rank, (outcome, rows) in enumerate(capped_pools(8).run(rank_fns.oversized_sm_budget, p, 400)):
        assert outcome.startswith("num_sms (Config)") and "use num_sms <=" in outcome, outcome
        if ranks_share_a_gpu(8) and share is not None:
            assert f"under its MPS share of {share}%" in outcome, outcome
        assert rows >= 0, f"rank {rank}: the default budget must be taken after the refusal"
