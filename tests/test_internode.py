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

FIELDS = rank_fns.ROUND_FIELDS
# The kernel paths' variants, and float32 rows (the internode combine sums them in float32 vectors too).
VARIANTS = {**rank_fns.ROUND_VARIANTS, "float32": dict(dtype=torch.float32, num_biases=1)}
NODES = pytest.mark.parametrize("num_ranks,ranks_per_node", [(4, 2), (8, 4), (8, 2)], ids=["2x2", "2x4", "4x2"])


def _compare(seed, on_gpu, on_cpu, ranks_per_node):
    for rank, (g, c) in enumerate(zip(on_gpu, on_cpu)):
        assert g["backend"] == "InternodeBackend", f"rank {rank}: the CUDA calls ran on {g['backend']}"
        backend, peers = g["topology"]
        node = rank // ranks_per_node
        assert backend == "internode"
        assert peers == ["self" if r == rank else "same_gpu" if r // ranks_per_node == node else "nvshmem_put"
                         for r in range(len(on_gpu))], f"rank {rank}: topology peers {peers}"
        for field in FIELDS:
            assert _same(g[field], c[field]), f"seed {seed} rank {rank}: {field} differs from the portable backend"


@NODES
@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=list(VARIANTS))
def test_internode_equals_portable(pools, gpu_pools, seed, num_ranks, ranks_per_node, variant):
    p = Problem(seed, num_ranks, num_ranks * 8, 512, 6, max_tokens=96)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, **variant)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, **variant),
             ranks_per_node)


@NODES
def test_internode_rounds_on_one_buffer(pools, gpu_pools, seed, num_ranks, ranks_per_node):
    """Calls reuse every region of the buffer: three rounds on one Buffer end as one round does."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=64, drop=0.5)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, rounds=3, num_biases=1)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, num_biases=1),
             ranks_per_node)


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(8, 2)], ids=["4x2"])
def test_group_limited_routing_puts_each_token_once_per_node(gpu_pools, seed, num_ranks, ranks_per_node):
    """With megatron's group-limited router (groups = nodes, 2 of 4), the bytes put across nodes are one
    message per token and distinct other node its experts sit on: fewer than one row per destination rank,
    and fewer still than one per top-k pick."""
    pytest.importorskip("megatron.core")
    from . import megatron_fns
    from moe_ep import _native as native
    hidden, topk = 256, 8
    message = native.internode_ops().message(hidden * 2, 0, topk, ranks_per_node)["bytes"]
    results = gpu_pools(num_ranks).run(megatron_fns.group_limited_network_bytes, seed, 64, topk, hidden,
                                       ranks_per_node, 2)
    for rank, (network, messages, rank_rows, picks) in enumerate(results):
        assert network == messages * message, f"seed {seed} rank {rank}: {network} bytes for {messages} messages"
        assert messages <= rank_rows <= picks
    assert sum(r[1] for r in results) < sum(r[2] for r in results) < sum(r[3] for r in results)


def test_a_buffer_too_small_grows(pools, gpu_pools, seed):
    """A Buffer whose num_rdma_bytes leaves a megabyte past the control area: the first calls that need
    more replace its buffer (collectively) with a larger one, and every round still equals the portable
    backend's."""
    num_ranks, ranks_per_node = 4, 2
    p = Problem(seed, num_ranks, num_ranks * 8, 1024, 6, max_tokens=256, zero_token_rank=False)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, rounds=2, small=True,
                                      num_biases=1, dtype=torch.float32)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node, num_biases=1,
                                                dtype=torch.float32), ranks_per_node)
    control = _native.internode_ops().layout()["control_bytes"]
    assert all(r["buffer_bytes"] > control + (1 << 20) for r in on_gpu), [r["buffer_bytes"] for r in on_gpu]


def test_calls_across_nodes_are_refused_in_a_capture(pools, gpu_pools, seed):
    """A fresh dispatch (num_worst_tokens or not), a cached dispatch and a combine across nodes, each begun
    inside a CUDA-graph capture, raise RuntimeError before any rank communicates (a replay would reuse
    the host's count of calls that their flags take); the same Buffer then makes an exact round."""
    num_ranks, ranks_per_node = 4, 2
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=32)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.internode_capture_refused, p, ranks_per_node)
    for rank, result in enumerate(on_gpu):
        assert set(result["errors"]) == {"fresh", "cached", "combine"}, f"seed {seed} rank {rank}: {result['errors']}"
        for name, (kind, message) in result["errors"].items():
            call = "combine" if name == "combine" else "dispatch"
            assert kind == "RuntimeError" and message.startswith(f"{call}: calls across nodes cannot be captured"), \
                f"rank {rank} {name}: {message}"
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.internode_round, p, ranks_per_node), ranks_per_node)
