"""The intranode kernels' residency rule (csrc/kernels/residency.cuh) compiled for the host: how many
blocks each rank's kernels may have so that every block of every rank on a GPU is resident at once, with
and without an MPS SM share, and with the ranks' data kernels starting together (behind a rendezvous or
their count exchange: one kernel of each rank alive, and a waiting block of each other rank) or not (two
kernels of each rank). Under the launcher's share for eight ranks a rule that took the share's SMs for
the whole GPU refused the default budget."""
import pytest

from moe_ep.mps import client_sm_share

from .host_headers import run_against_headers

H200_SMS = 132
# Blocks an SM holds in each shape (intranode/launch.cuh): Solo and Full 1, Wide 2, Narrow 4.
SHAPES_PER_SM = (1, 2, 4)


def reported_sms(whole_sms: int, share: int) -> int:
    """The SMs CUDA reports to a process under an MPS share: the share's part rounded down to whole TPCs
    of two SMs (measured: 72 of the H200's 132 at 56%)."""
    return (whole_sms * share // 100) // 2 * 2


# (blocks an SM holds, the GPU's SMs, ranks on it, share percent, data kernels start together); CUDA
# reports reported_sms of the SMs.
CASES = [(per_sm, whole, ranks, share, together) for per_sm in SHAPES_PER_SM for ranks in (1, 2, 3, 4, 8, 16)
         for whole in (16, 78, H200_SMS, 144) for share in (100, client_sm_share(ranks), 10, 37, 99)
         for together in (False, True) if reported_sms(whole, share) >= 2]

PROGRAM = r"""
#include <cstdio>
#include "residency.cuh"
int main() {
    const long long cases[][5] = {%s};
    for (const auto& c : cases)
        std::printf("{\"most\": %%lld}\n", (long long)moe_ep::intranode::most_resident_blocks(
                                                 c[0], c[1], static_cast<int>(c[2]), static_cast<int>(c[3]), c[4] != 0));
    return 0;
}
"""


@pytest.fixture(scope="module")
def most(tmp_path_factory):
    """{case: the most blocks per kernel}, the header's answer for each of CASES."""
    rows = ", ".join("{%d, %d, %d, %d, %d}" % (per_sm * reported_sms(whole, share), per_sm, ranks, share, together)
                     for per_sm, whole, ranks, share, together in CASES)
    lines = run_against_headers(tmp_path_factory.mktemp("residency"), "residency", PROGRAM % rows)
    return {case: line["most"] for case, line in zip(CASES, lines)}


def test_without_a_share_the_blocks_fill_the_gpu_and_no_more(most):
    for (per_sm, whole, ranks, share, together), blocks in most.items():
        if share != 100:
            continue
        case = (per_sm, whole, ranks, together)
        if ranks == 1:
            assert blocks == per_sm * whole, case
        elif together:  # every rank's kernel, and one SM for each other rank's waiting block
            assert blocks == max(0, (per_sm * whole - (ranks - 1) * per_sm) // ranks), case
        else:  # two kernels of every rank
            assert blocks == per_sm * whole // (2 * ranks), case


def test_under_a_share_the_blocks_fit_both_the_share_and_the_whole_gpu(most):
    for (per_sm, whole, ranks, share, together), blocks in most.items():
        case = (per_sm, whole, ranks, share, together)
        one_kernel = ranks == 1 or (together and share == 100)
        kernels_alive = 1 if one_kernel else 2
        waiting_sms = ranks - 1 if ranks > 1 and one_kernel else 0  # an SM each, whatever the shape
        assert blocks * kernels_alive * ranks + waiting_sms * per_sm <= per_sm * whole, case  # all ranks
        assert blocks * kernels_alive <= per_sm * reported_sms(whole, share), case  # its part


def test_a_share_keeps_the_two_kernel_count_that_the_launchers_share_is_made_for(most):
    # The launcher's share, (R + 1) / 2R, leaves a rank's GEMMs room beside the other ranks' communication
    # kernels only while those hold 1 / 2R of the GPU each: starting together changes nothing under it.
    for (per_sm, whole, ranks, share, together), blocks in most.items():
        if share < 100 and ranks > 1:
            assert blocks == most[(per_sm, whole, ranks, share, not together)], (per_sm, whole, ranks, share)
    for ranks in (2, 4, 8):
        share = client_sm_share(ranks)
        blocks = most[(1, H200_SMS, ranks, share, True)]  # one block an SM: a kernel's SMs
        assert (ranks - 1) * blocks + H200_SMS * share / 100 <= H200_SMS, ranks


def test_eight_ranks_under_the_launchers_share_take_the_default_budget(most):
    share = client_sm_share(8)  # 56: CUDA reports 72 of the H200's 132 SMs
    assert reported_sms(H200_SMS, share) == 72
    # 256-thread blocks (4 an SM): 288 on the 72 SMs, which the rule once took for the whole GPU (288 / 16 = 18
    # blocks a kernel, under the default budget of 20); now 128 of the 132 SMs count: 512 / 16 = 32.
    assert most[(4, H200_SMS, 8, share, False)] == 32
    assert most[(4, H200_SMS, 8, share, True)] == 32  # the share keeps the two-kernel count


def test_four_ranks_starting_together_fit_a_budget_of_24_in_one_block_an_sm(most):
    # The benchmark's budget at 4 ranks on one H200 (no share): 24 blocks of the one-an-SM shapes fit only
    # when the data kernels start together (16 otherwise, which is what the kernels ran on before).
    assert most[(1, H200_SMS, 4, 100, True)] == 32
    assert most[(1, H200_SMS, 4, 100, False)] == 16
