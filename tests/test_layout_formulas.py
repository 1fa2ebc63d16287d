"""The byte layouts moe_ep/config.py mirrors from csrc/kernels/buffer_layout.cuh (intranode and
low-latency), compared with the header itself compiled for the host (its functions are constexpr and
free of CUDA): a formula changed on one side only fails here on any machine with a C++ compiler, not
only end to end on a GPU."""
import pytest

from moe_ep.config import arena_dispatch_region, intranode_header_bytes, IntranodeLayout, LowLatencyLayout

from .host_headers import run_against_headers

REGION_CASES = [(0, 14336, 0, 8), (1, 7168, 224, 8), (4096, 7168, 224, 8), (37, 264, 0, 3), (513, 4104, 128, 0),
                (32768, 14336, 0, 16)]
HEADER_CASES = [(2, 1 << 26), (5, 3 << 20), (8, 1 << 30), (64, 1 << 20)]
# (max tokens a rank, hidden, ranks, experts)
LOW_LATENCY_CASES = [(128, 7168, 8, 256), (128, 7168, 8, 288), (1, 128, 2, 2), (1024, 4096, 16, 64), (37, 2560, 3, 9)]

PROGRAM = r"""
#define __host__
#define __device__
#include <cstdio>
#include "buffer_layout.cuh"
using namespace moe_ep::intranode;
int main() {
    const long long low_latency[][4] = {%(low_latency)s};
    for (const auto& c : low_latency) {
        const moe_ep::low_latency::Regions r = moe_ep::low_latency::regions(c[0], c[1], c[2], c[3]);
        std::printf("{\"low_latency\": [%%lld, %%lld, %%lld, %%lld, %%lld, %%lld, %%lld, %%lld]}\n",
                    (long long)r.dispatch_message, (long long)r.combine_message, (long long)r.zero_copy_offset,
                    (long long)r.outbox_offset, (long long)r.send, (long long)r.recv, (long long)r.signal,
                    (long long)r.total);
    }
    const long long regions[][4] = {%(regions)s};
    for (const auto& c : regions) {
        const DispatchRegion d = dispatch_region(c[0], c[1], c[2], static_cast<int>(c[3]));
        std::printf("{\"region\": [%%lld, %%lld, %%lld, %%lld, %%lld, %%lld]}\n", (long long)d.x, (long long)d.scale,
                    (long long)d.idx, (long long)d.weight, (long long)d.src, (long long)d.bytes);
    }
    const long long headers[][2] = {%(headers)s};
    for (const auto& c : headers)
        std::printf("{\"header\": [%%lld, %%lld]}\n", (long long)header_bytes(static_cast<int>(c[0])),
                    (long long)half_bytes(c[1], static_cast<int>(c[0])));
    return 0;
}
"""


@pytest.fixture(scope="module")
def from_the_header(tmp_path_factory):
    lines = run_against_headers(
        tmp_path_factory.mktemp("layout"), "layout",
        PROGRAM % dict(regions=", ".join("{%d, %d, %d, %d}" % c for c in REGION_CASES),
                       headers=", ".join("{%d, %d}" % c for c in HEADER_CASES),
                       low_latency=", ".join("{%d, %d, %d, %d}" % c for c in LOW_LATENCY_CASES)))
    return tuple([line[key] for line in lines if key in line] for key in ("region", "header", "low_latency"))


@pytest.mark.parametrize("case", range(len(REGION_CASES)))
def test_an_arena_region_is_laid_out_alike(from_the_header, case):
    """The early arena dispatch lays its region out on the device, the host once it knows the rows."""
    rows, x_bytes, scale_bytes, num_topk = REGION_CASES[case]
    host = arena_dispatch_region(rows, x_bytes, scale_bytes, num_topk)
    assert from_the_header[0][case] == [*host.offsets, host.slot_bytes], REGION_CASES[case]


@pytest.mark.parametrize("case", range(len(HEADER_CASES)))
def test_the_intranode_header_and_halves_agree(from_the_header, case):
    num_ranks, num_nvl_bytes = HEADER_CASES[case]
    layout = IntranodeLayout(num_ranks, num_nvl_bytes, 14336, 0, 8)
    assert from_the_header[1][case] == [intranode_header_bytes(num_ranks), layout.half_bytes], HEADER_CASES[case]


@pytest.mark.parametrize("case", range(len(LOW_LATENCY_CASES)))
def test_the_low_latency_buffer_is_laid_out_alike(from_the_header, case):
    l = LowLatencyLayout(*LOW_LATENCY_CASES[case])
    assert from_the_header[2][case] == [l.dispatch_message_bytes, l.combine_message_bytes, l.zero_copy_offset,
                                        l.outbox_offset, l.send_bytes, l.recv_bytes, l.signal_bytes,
                                        l.total_bytes], LOW_LATENCY_CASES[case]
