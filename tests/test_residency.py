"""The intranode kernels' residency rule (csrc/kernels/residency.cuh) compiled for the host: how many
blocks each rank's kernels may have so that every block of every rank on a GPU is resident at once, with
and without an MPS SM share. Under the launcher's share for eight ranks the rule once took the share's
SMs for the whole GPU and refused the default budget (twenty-ninth session)."""
import pytest

from moe_ep.mps import client_sm_share

from .host_headers import run_against_headers

H200_SMS = 132
# Blocks an SM holds in each shape (intranode.cu): Solo and Full 1, Wide 2, Narrow 4.
SHAPES_PER_SM = (1, 2, 4)


def reported_sms(whole_sms: int, share: int) -> int:
    """The SMs CUDA reports to a process under an MPS share: the share's part rounded down to whole TPCs
    of two SMs (measured: 72 of the H200's 132 at 56%)."""
    return (whole_sms * share // 100) // 2 * 2


# (blocks an SM holds, the GPU's SMs, ranks on it, share percent); CUDA reports reported_sms of them.
CASES = [(per_sm, whole, ranks, share) for per_sm in SHAPES_PER_SM for ranks in (1, 2, 3, 4, 8, 16)
         for whole in (16, 78, H200_SMS, 144) for share in (100, client_sm_share(ranks), 10, 37, 99)
         if reported_sms(whole, share) >= 2]

PROGRAM = r"""
#include <cstdio>
#include "residency.cuh"
int main() {
    const long long cases[][3] = {%s};
    for (const auto& c : cases)
        std::printf("{\"most\": %%lld}\n", (long long)moe_ep::intranode::most_resident_blocks(
                                                 c[0], static_cast<int>(c[1]), static_cast<int>(c[2])));
    return 0;
}
"""


@pytest.fixture(scope="module")
def most(tmp_path_factory):
    """{case: the most blocks per kernel}, the header's answer for each of CASES."""
    rows = ", ".join("{%d, %d, %d}" % (per_sm * reported_sms(whole, share), ranks, share)
                     for per_sm, whole, ranks, share in CASES)
    lines = run_against_headers(tmp_path_factory.mktemp("residency"), "residency", PROGRAM % rows)
    return {case: line["most"] for case, line in zip(CASES, lines)}


def test_without_a_share_every_ranks_two_kernels_share_the_gpu(most):
    for (per_sm, whole, ranks, share), blocks in most.items():
        if share == 100:
            assert blocks == (per_sm * whole if ranks == 1 else per_sm * whole // (2 * ranks)), (per_sm, whole, ranks)


def test_under_a_share_the_blocks_fit_both_the_share_and_the_whole_gpu(most):
    for (per_sm, whole, ranks, share), blocks in most.items():
        kernels_alive = 2 if ranks > 1 else 1
        assert blocks * kernels_alive * ranks <= per_sm * whole, (per_sm, whole, ranks, share)  # all ranks
        assert blocks * kernels_alive <= per_sm * reported_sms(whole, share), (per_sm, whole, ranks, share)  # its part


def test_eight_ranks_under_the_launchers_share_take_the_default_budget(most):
    share = client_sm_share(8)  # 56: CUDA reports 72 of the H200's 132 SMs
    assert reported_sms(H200_SMS, share) == 72
    # 256-thread blocks (4 an SM): 288 on the 72 SMs, which the rule once took for the whole GPU (288 / 16 = 18
    # blocks a kernel, under the default budget of 20); now 128 of the 132 SMs count: 512 / 16 = 32.
    assert most[(4, H200_SMS, 8, share)] == 32
