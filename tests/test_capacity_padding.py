"""megatron's capacity padding (moe_expert_capacity_factor with moe_pad_expert_input_to_capacity) with
moe_ep's dispatcher: every size is known on the host beforehand, so the dispatch runs with
num_worst_tokens and the experts get fixed blocks of rows; outputs and gradients equal megatron's alltoall
dispatcher with the same capacity, and the step never waits for the device on the host."""
import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from . import capacity_fns  # noqa: E402


def _capacity(num_tokens, topk, num_experts, capacity_factor):
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)  # megatron's get_capacity


def _blocks(num_tokens, topk, num_experts, capacity_factor, ranks, chunks):
    """What each experts' call should be handed: (device, tokens_per_expert, rows), a call a chunk; a chunk's
    block holds at most its tokens from each rank."""
    capacity, local = _capacity(num_tokens, topk, num_experts, capacity_factor), num_experts // ranks
    sizes = [len(part) for part in torch.arange(num_tokens).tensor_split(chunks)]
    return [("cpu", [min(capacity, size) * ranks] * local, local * min(capacity, size) * ranks) for size in sizes]


def _assert_like_alltoall(ours, theirs, num_tokens, topk, num_experts, capacity_factor, ranks, chunks):
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for key in ("out", "grad_x"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key}: {m}")
        assert a["grads"].keys() == b["grads"].keys()
        for name, grad in b["grads"].items():
            torch.testing.assert_close(a["grads"][name], grad, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        assert b["handed"] == _blocks(num_tokens, topk, num_experts, capacity_factor, ranks, 1)
        assert a["handed"] == _blocks(num_tokens, topk, num_experts, capacity_factor, ranks, chunks)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2])
def test_capacity_padding_matches_alltoall(pools, seed, ranks, chunks):
    """Dropped routes (capacity factor 0.5 of an even load) and padded blocks: moe_ep's dispatcher hands the
    experts as many rows per expert as alltoall (per chunk, a chunk's share), on the host."""
    num_experts, topk, tokens, factor = 2 * ranks, 2, 12, 0.5
    args = (num_experts, topk, 32, tokens, seed % 10000, factor)
    ours = pools(ranks).run(capacity_fns.capacity_layer, "deepep", *args, chunks=chunks)
    theirs = pools(ranks).run(capacity_fns.capacity_layer, "alltoall", *args)
    _assert_like_alltoall(ours, theirs, tokens, topk, num_experts, factor, ranks, chunks)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_rank_whose_experts_no_token_picks(pools, seed, chunks):
    """Rank 1's experts are picked by no token: they get blocks of padding only (zero rows of probability
    0) and contribute nothing, as alltoall's padding does."""
    args = (8, 2, 32, 10, seed % 10000, 1.0)
    ours = pools(4).run(capacity_fns.capacity_layer, "deepep", *args, chunks=chunks, starved_rank=1)
    theirs = pools(4).run(capacity_fns.capacity_layer, "alltoall", *args, starved_rank=1)
    _assert_like_alltoall(ours, theirs, 10, 2, 8, 1.0, 4, chunks)


@pytest.mark.parametrize("chunks", [1, 2])
def test_no_host_wait_in_the_step_under_capacity(pools, seed, chunks):
    """The forward and backward under a watcher that refuses every operation that makes the host wait for a
    GPU (outside the Buffer, the router and the experts): every fresh dispatch runs with num_worst_tokens
    and hands back counts that fail when read; the results still equal alltoall's."""
    args = (4, 2, 32, 12, seed % 10000, 0.75)
    ours = pools(2).run(capacity_fns.capacity_layer, "deepep", *args, chunks=chunks, watch_host_waits=True)
    theirs = pools(2).run(capacity_fns.capacity_layer, "alltoall", *args)
    _assert_like_alltoall(ours, theirs, 12, 2, 4, 0.75, 2, chunks)
    for result in ours:
        assert len(result["dispatches"]) == chunks and all(worst > 0 for worst in result["dispatches"])


def test_the_watcher_sees_the_host_wait_without_padding(pools, seed):
    """The same step with the capacity dropping routes but padding nothing: the dispatcher needs the counts
    on the host, and the watcher refuses it (it would fail the test above if a wait crept back)."""
    with pytest.raises(Exception, match="host wait in the dispatcher's step|read a dispatch's host counts"):
        pools(2).run(capacity_fns.capacity_layer, "deepep", 4, 2, 32, 12, seed % 10000, 0.75, watch_host_waits=True,
                     pad=False)


def test_padding_rows_the_dispatch_left_unwritten_change_nothing(pools, seed):
    """On the kernels a num_worst_tokens dispatch leaves its padding rows unwritten: with them NaN here
    (fresh and cached dispatches), the experts' padding rows are still zeros and the results alltoall's.
    Rank 1 receives no row, so its experts' blocks are taken from those padding rows alone."""
    args = (8, 2, 32, 10, seed % 10000, 0.5)
    ours = pools(4).run(capacity_fns.capacity_layer, "deepep", *args, unwritten_padding=True, starved_rank=1)
    theirs = pools(4).run(capacity_fns.capacity_layer, "alltoall", *args, starved_rank=1)
    _assert_like_alltoall(ours, theirs, 10, 2, 8, 0.5, 4, 1)


@pytest.mark.parametrize("chunks", [1, 2])
def test_capacity_step_on_cuda_ranks_never_waits_and_replays_in_a_cuda_graph(gpu_pools, seed, chunks):
    """CUDA ranks sharing the GPU (the kernels move the tokens): a forward and backward step runs under
    torch.cuda.set_sync_debug_mode("error"), and the step captured in a CUDA graph, replayed on new tokens,
    gives the output and every gradient of the same step run eagerly."""
    from moe_ep import _native
    if not _native.has_kernels():
        pytest.skip(str(_native.unavailable_reason()))
    for rank, pairs in enumerate(gpu_pools(4).run(capacity_fns.capacity_step_on_cuda, 8, 2, 64, 24, seed % 10000,
                                                  1.0, chunks)):
        for replay, (eager, replayed) in enumerate(pairs):
            assert len(eager) == len(replayed)
            for index, (want, got) in enumerate(zip(eager, replayed)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {rank} replay {replay} tensor {index}: {m}")
