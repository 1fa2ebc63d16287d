"""Low-latency kernels against the portable backend, bit for bit, with ranks sharing one GPU.

The kernels serve CUDA tensors by default; the rank functions run under MOE_EP_BACKEND=kernels anyway,
so that a caller's environment cannot turn these tests into portable-against-portable ones (a Buffer
the kernels cannot serve raises instead). Rows past recv_count are not data and are not compared.
"""
import pytest
import torch

from moe_ep import _native

from . import rank_fns
from .problems import Problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason())),
]
KERNELS = {"MOE_EP_BACKEND": "kernels"}


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _compare(seed, on_gpu, on_cpu, use_fp8):
    for rank, (g, c) in enumerate(zip(on_gpu, on_cpu)):
        where = f"seed {seed} rank {rank}"
        wrong = rank_fns.low_latency_differences(g, c, use_fp8)
        assert not wrong, f"{where}: {', '.join(wrong)}"
        assert torch.equal(g["stats"], c["stats"]), f"{where}: cumulative stats"
        assert g["count_before_hook"].sum() == c["count_before_hook"].sum(), f"{where}: counts before the hook"
        assert g["out_is_result"] == c["out_is_result"]


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("variant", [
    dict(use_fp8=False),
    dict(use_fp8=True),
    dict(use_fp8=True, round_scale=True, use_ue8m0=True, return_recv_hook=True),
    dict(use_fp8=True, round_scale=True, zero_copy=True, use_out=True),
    dict(use_fp8=False, return_recv_hook=True, use_out=True),
    dict(use_fp8=False, zero_copy=True, return_recv_hook=True, calls_before=3),
])
def test_low_latency_kernels_equal_portable(pools, gpu_pools, seed, num_ranks, variant):
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=32)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.with_env, KERNELS, rank_fns.low_latency_round, p, **variant)
    on_cpu = pools(num_ranks).run(rank_fns.low_latency_round, p, **variant)
    _compare(seed, on_gpu, on_cpu, variant["use_fp8"])
    if variant.get("zero_copy"):  # the ranks read each other's rows where they were written
        assert all(r["zero_copy_in_place"] for r in on_gpu) and not any(r["zero_copy_in_place"] for r in on_cpu)


@pytest.mark.parametrize("use_fp8,zero_copy", [(True, False), (False, True)])
def test_shape_changes_on_one_buffer(pools, gpu_pools, seed, use_fp8, zero_copy):
    """Calls of three shapes in turn on one Buffer: each change moves the flags over bytes the previous
    shape used for rows, which the backend clears first (tests/test_low_latency_shapes.py)."""
    problems = [Problem(seed, 4, 16, 256, 4, max_tokens=32), Problem(seed + 1, 4, 32, 512, 4, max_tokens=16),
                Problem(seed + 2, 4, 16, 256, 4, max_tokens=32)]
    on_gpu = gpu_pools(4).run(rank_fns.with_env, KERNELS, rank_fns.low_latency_shape_changes, problems, use_fp8,
                              zero_copy)
    on_cpu = pools(4).run(rank_fns.low_latency_shape_changes, problems, use_fp8, zero_copy)
    for call in range(len(problems)):
        _compare(seed, [r[call] for r in on_gpu], [r[call] for r in on_cpu], use_fp8)


def test_issue_shape_hidden_7168_top8(pools, gpu_pools, seed):
    p = Problem(seed, 4, 32, 7168, 8, max_tokens=128, drop=0.05)
    on_gpu = gpu_pools(4).run(rank_fns.with_env, KERNELS, rank_fns.low_latency_round, p, use_fp8=True)
    on_cpu = pools(4).run(rank_fns.low_latency_round, p, use_fp8=True)
    _compare(seed, on_gpu, on_cpu, True)


def test_top16_and_up_to_1024_tokens(pools, gpu_pools, seed):
    """The issue's limits: top-k 16 and 1024 tokens per rank (hidden 384: any multiple of 128)."""
    p = Problem(seed, 2, 32, 384, 16, max_tokens=1024)
    variant = dict(use_fp8=True, return_recv_hook=True)
    on_gpu = gpu_pools(2).run(rank_fns.with_env, KERNELS, rank_fns.low_latency_round, p, **variant)
    _compare(seed, on_gpu, pools(2).run(rank_fns.low_latency_round, p, **variant), True)


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_back_to_back_calls_at_benchmark_shape(pools, gpu_pools, seed, num_ranks):
    """The benchmark's shape (256 experts, hidden 7168, 128 tokens): 12 dispatch + combine pairs issued
    without host synchronisation, then a compared round. Every rank's receive kernels spin while the
    others' send kernels must still find room on the shared GPU."""
    p = Problem(seed, num_ranks, 256, 7168, 8, max_tokens=128)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.with_env, KERNELS, rank_fns.low_latency_round, p, use_fp8=True,
                                      calls_before=12)
    on_cpu = pools(num_ranks).run(rank_fns.low_latency_round, p, use_fp8=True)
    _compare(seed, on_gpu, on_cpu, True)


def test_compute_between_send_and_hook(pools, gpu_pools, seed):
    """Matmuls run between each send and its hook (no kernel of ours is resident meanwhile: the send
    kernels wait for nothing); the results are unchanged."""
    p = Problem(seed, 4, 16, 512, 4, max_tokens=64)
    variant = dict(use_fp8=True, return_recv_hook=True, busy_gpu=True)
    on_gpu = gpu_pools(4).run(rank_fns.with_env, KERNELS, rank_fns.low_latency_round, p, **variant)
    on_cpu = pools(4).run(rank_fns.low_latency_round, p, **variant)
    _compare(seed, on_gpu, on_cpu, True)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_cuda_graph(gpu_pools, seed, use_fp8):
    p = Problem(seed, 4, 16, 256, 4, max_tokens=32, drop=0.2)
    q = Problem(seed, 4, 16, 256, 4, max_tokens=32, drop=0.5)   # same seed: same shapes, other routing
    results = gpu_pools(4).run(rank_fns.with_env, KERNELS, rank_fns.low_latency_graph_round, p, q, use_fp8)
    for rank, (replays, eager_q, eager_p) in enumerate(results):
        for i, want in enumerate((eager_q, eager_p)):
            assert torch.equal(replays[i][0], want[0]), f"seed {seed} rank {rank}: replay {i} recv_count"
            assert torch.equal(_bits(replays[i][1]), _bits(want[1])), f"seed {seed} rank {rank}: replay {i} combined"


def test_low_latency_missing_peer_names_rank_and_expert(gpu_pools):
    results = gpu_pools(3).run(rank_fns.with_env, dict(KERNELS, MOE_EP_TIMEOUT_S="2.0"), rank_fns.low_latency_peer_missing, 2)
    assert results[2] == "skipped"
    for kind, message in results[:2]:
        assert kind == "TimeoutError" and "rank 2 did not arrive" in message and "for expert" in message, message


def test_low_latency_layouts_agree(gpu_pools):
    cases = [(128, 7168, 8, 256), (1, 128, 2, 2), (1024, 4096, 4, 64), (128, 7168, 8, 288)]
    for cuda_numbers, python_numbers in gpu_pools(2).run(rank_fns.low_latency_layout_numbers, cases)[0]:
        for key, value in python_numbers.items():
            assert cuda_numbers[key] == value, key


def _round_on_memory(pools, gpu_pools, seed, num_ranks, memory):
    """A hooked fp8 round with the buffers mapped as low_latency_memory=memory, against the CPU ranks."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=32)
    variant = dict(use_fp8=True, return_recv_hook=True)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.with_env, KERNELS, rank_fns.with_choices,
                                      dict(low_latency_memory=memory), rank_fns.low_latency_round, p, **variant)
    on_cpu = pools(num_ranks).run(rank_fns.low_latency_round, p, **variant)
    _compare(seed, on_gpu, on_cpu, True)


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_low_latency_kernels_on_cuda_ipc_memory(pools, gpu_pools, seed, num_ranks):
    """low_latency_memory="ipc": the buffers opened from CUDA IPC handles instead of file descriptors."""
    _round_on_memory(pools, gpu_pools, seed, num_ranks, "ipc")


# Last in the file: NVSHMEM starts once per rank process (the pools live for the whole session).
@pytest.mark.skipif(not _native.has_nvshmem(), reason="built without NVSHMEM")
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_low_latency_kernels_on_nvshmem_memory(pools, gpu_pools, seed, num_ranks):
    """NVSHMEM bootstrapped through the process group (unique id over the store), several PEs on one
    GPU, the buffers on its symmetric heap and the peers reached through nvshmem_ptr."""
    _round_on_memory(pools, gpu_pools, seed, num_ranks, "nvshmem")


@pytest.mark.skipif(not _native.has_nvshmem_device(), reason=str(_native.internode_unavailable_reason()))
@pytest.mark.parametrize("num_bytes", [16, 7168 + 224, 1 << 20])
def test_device_initiated_put_lands_before_its_signal(gpu_pools, num_bytes):
    """The building block of the puts to peers on other hosts: a put, then a signal ordered after it,
    from a kernel; on one GPU NVSHMEM carries it between the PEs without a network."""
    results = gpu_pools(2).run(rank_fns.with_env, KERNELS, rank_fns.with_choices, dict(low_latency_memory="nvshmem"),
                               rank_fns.nvshmem_put_round, num_bytes)
    assert results == [None, True], results


# Every peer reached through NVSHMEM puts, even where loads and stores could reach it.
PUTS = dict(low_latency_memory="nvshmem", low_latency_puts=True)


@pytest.mark.skipif(not _native.has_nvshmem_device(), reason=str(_native.internode_unavailable_reason()))
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("variant", [
    dict(use_fp8=True, return_recv_hook=True),
    dict(use_fp8=False, use_out=True, calls_before=3),
    dict(use_fp8=True, round_scale=True, use_ue8m0=True),
])
def test_low_latency_through_puts_equals_portable(pools, gpu_pools, seed, num_ranks, variant):
    """Every peer reached through NVSHMEM puts (low_latency_puts=True), as peers on another host would be:
    rows staged and put, flags as signals after the puts complete, by the kernels of moe_ep._internode
    (NVSHMEM's device library, in the default build). On one GPU NVSHMEM carries them without a network;
    the results are the stores' bit for bit."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=32)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.with_env, KERNELS, rank_fns.with_choices, PUTS,
                                      rank_fns.low_latency_round_and_path, p, **variant)
    on_cpu = pools(num_ranks).run(rank_fns.low_latency_round, p, **variant)
    _compare(seed, on_gpu, on_cpu, variant["use_fp8"])
    for rank, result in enumerate(on_gpu):
        others = [r for r in range(num_ranks) if r != rank]
        assert result["path"] == dict(module="moe_ep._internode", memory="nvshmem", unreachable=others,
                                      ranks_per_node=num_ranks), result["path"]


@pytest.mark.skipif(not _native.has_nvshmem_device(), reason=str(_native.internode_unavailable_reason()))
@pytest.mark.parametrize("num_ranks, ranks_per_node", [(4, 2), (8, 4), (8, 2)])
@pytest.mark.parametrize("puts", [False, True])
def test_low_latency_across_nodes_equals_portable(pools, gpu_pools, seed, num_ranks, ranks_per_node, puts):
    """A group of several nodes (MOE_EP_RANKS_PER_NODE; on one GPU, nodes in name) runs its low-latency
    calls on the kernels by default, its buffers on NVSHMEM's symmetric heap: peers that NVSHMEM maps (the
    same GPU here, NVLink on a real node) by loads and stores on moe_ep._C's kernels; with puts (as every
    peer on another host is), moe_ep._internode's. Bit for bit the portable backend's, 0-token ranks and
    -1 ids included."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=32)
    env = {**KERNELS, "MOE_EP_RANKS_PER_NODE": str(ranks_per_node)}
    variant = dict(use_fp8=True, return_recv_hook=True, calls_before=2)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.with_env, env, rank_fns.with_choices, dict(low_latency_puts=puts),
                                      rank_fns.low_latency_round_and_path, p, **variant)
    on_cpu = pools(num_ranks).run(rank_fns.low_latency_round, p, **variant)
    _compare(seed, on_gpu, on_cpu, True)
    for rank, result in enumerate(on_gpu):
        others = [r for r in range(num_ranks) if r != rank] if puts else []
        module = "moe_ep._internode" if puts else "moe_ep._C"
        assert result["path"] == dict(module=module, memory="nvshmem", unreachable=others,
                                      ranks_per_node=ranks_per_node), result["path"]


@pytest.mark.skipif(not _native.has_nvshmem_device(), reason=str(_native.internode_unavailable_reason()))
@pytest.mark.parametrize("calls_before", [0, 3])
def test_zero_copy_combine_through_puts_equals_portable(pools, gpu_pools, seed, calls_before):
    """Rows written into get_next_low_latency_combine_buffer's tensor reach peers that puts reach: they are
    put from where they lie (the push stages its rows in the combine's own slot), both slots in turn."""
    p = Problem(seed, 4, 16, 256, 4, max_tokens=16)
    variant = dict(use_fp8=True, zero_copy=True, calls_before=calls_before)
    on_gpu = gpu_pools(4).run(rank_fns.with_env, KERNELS, rank_fns.with_choices, PUTS,
                              rank_fns.low_latency_round, p, **variant)
    on_cpu = pools(4).run(rank_fns.low_latency_round, p, **variant)
    _compare(seed, on_gpu, on_cpu, True)


@pytest.mark.parametrize("puts", [False, True])
@pytest.mark.parametrize("calls_before", [0, 1])
def test_a_combine_writes_no_slot_but_its_own(gpu_pools, seed, puts, calls_before):
    """A plain combine stages its rows in the zero-copy slot it owns and nowhere else: the other slot,
    filled before the combine, reads the same after it, whether the rows are pulled or put (the device's
    call parity and the host's slot agree for one of calls_before 0 and 1 and differ for the other)."""
    if puts and not _native.has_nvshmem_device():
        pytest.skip(str(_native.internode_unavailable_reason()))
    p = Problem(seed, 4, 16, 256, 4, max_tokens=16)
    choices = PUTS if puts else {}
    results = gpu_pools(4).run(rank_fns.with_env, KERNELS, rank_fns.with_choices, choices,
                               rank_fns.low_latency_combine_keeps_the_other_slot, p, calls_before)
    for rank, kept in enumerate(results):
        assert kept, f"seed {seed} rank {rank}: the combine wrote into the other slot"
