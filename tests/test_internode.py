"""Internode kernels (NVSHMEM puts between nodes, NVLink stores within one) against the portable backend,
bit for bit, with the group's ranks cut into nodes (ranks_per_node) on one GPU.

Every test runs the same rank function on GPU ranks (kernels) and CPU ranks (portable backend, whose
combine across nodes sums each node's rows first, as the kernels do) and compares all outputs. Skipped
where there is no GPU or no internode extension.
"""
import pytest
import torch

from moe_ep import _native

from . import rank_fns
from .problems import Problem
from .problems import same_bits as _same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(_native.internode_unavailable_reason() is not None,
                       reason=str(_native.internode_unavailable_reason())),
]

FIELDS = ("recv_x", "recv_idx", "recv_w", "counts", "cached", "cached_rest", "combined", "combined_w",
          "num_recv_rows")
NODES = pytest.mark.parametrize("num_ranks,ranks_per_node", [(4, 2), (8, 4), (8, 2)], ids=["2x2", "2x4", "4x2"])


def _compare(seed, on_gpu, on_cpu):
    for rank, (g, c) in enumerate(zip(on_gpu, on_cpu)):
        assert g["backend"] == "InternodeBackend", f"rank {rank}: the CUDA calls ran on {g['backend']}"
        for field in FIELDS:
            assert _same(g[field], c[field]), f"seed {seed} rank {rank}: {field} differs from the portable backend"


@NODES
@pytest.mark.parametrize("variant", [
    dict(use_fp8=False, num_biases=0),
    dict(use_fp8=True, num_biases=2),
    dict(use_fp8=False, num_biases=1, expert_alignment=16),
    dict(use_fp8=True, num_worst_tokens=768),  # 8 ranks x 96 tokens: any load fits
    dict(use_fp8=False, with_topk=False),
    dict(use_fp8=False, stream_args=True, num_biases=2),
    dict(dtype=torch.float32, num_biases=1),
], ids=["bf16", "fp8_biases", "alignment", "worst_tokens", "no_topk", "stream_args", "float32"])
def test_internode_equals_portable(pools, gpu_pools, seed, num_ranks, ranks_per_node, variant):
    p = Problem(seed, num_ranks, num_ranks * 8, 512, 6, max_tokens=96)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, **variant)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, **variant))


@NODES
def test_internode_rounds_on_one_buffer(pools, gpu_pools, seed, num_ranks, ranks_per_node):
    """Calls reuse every region of the buffer: three rounds on one Buffer end as one round does."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=64, drop=0.5)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, rounds=3, num_biases=1)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, num_biases=1))
