"""moe_ep_overlap_chunks with moe_ep's dispatcher ("deepep") on CPU ranks: a layer's tokens pipelined in
chunks give the output and gradients of the unchunked layer; the option's checks and its Megatron-LM flag."""
import argparse
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from . import megatron_fns  # noqa: E402

# Tokens on each rank: uneven counts, and ranks with fewer tokens than chunks, which send empty chunks
# (megatron's router takes no rank without tokens, so a rank has none only in a chunk).
TOKENS = {2: [13, 2], 4: [11, 1, 7, 2]}


def _run(pools, ranks, chunks, seed, topk=2, capacity_factor=None, elementwise_experts=False, hidden=32,
         **kw):
    return pools(ranks).run(megatron_fns.chunked_moe_layer, 2 * ranks, topk, hidden, chunks, TOKENS[ranks],
                            seed % 10000, capacity_factor, elementwise_experts, **kw)


def _assert_close_to_unchunked(unchunked, chunked, ranks, chunks: int, bitwise_rows: bool):
    """Every rank made chunks times the Buffer calls (each chunk's layout, dispatch and combine, and in
    the backward each chunk's combine and cached dispatch). bitwise_rows: the output and the input's
    gradient are the same bits (each row's operations are unchanged by chunking wherever the experts'
    are). Parameter gradients sum over rows chunk by chunk and then add the chunks' sums, another
    order: always compared to float32 rounding."""
    for rank, ((out, grad_x, grads, calls), (c_out, c_grad_x, c_grads, c_calls)) in enumerate(zip(unchunked, chunked)):
        assert out.shape[0] == TOKENS[ranks][rank]
        assert calls == dict(get_dispatch_layout=1, dispatch=1, combine=2, cached_dispatch=1), calls
        assert c_calls == {kind: chunks * n for kind, n in calls.items()}, f"rank {rank}: {c_calls}"
        if bitwise_rows:
            assert torch.equal(out, c_out), f"rank {rank} output"
            assert torch.equal(grad_x, c_grad_x), f"rank {rank} input gradient"
        torch.testing.assert_close(c_out, out, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} output: {m}")
        torch.testing.assert_close(c_grad_x, grad_x, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} input gradient: {m}")
        assert grads.keys() == c_grads.keys() and any("experts" in name for name in grads)
        for name in grads:
            torch.testing.assert_close(c_grads[name], grads[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_pass_every_row_through_unchanged(pools, seed, ranks, chunks):
    """Elementwise experts: the dispatch, the combine and the router treat a row the same in any chunk,
    so the output and the input's gradient are the unchunked layer's bits."""
    unchunked = _run(pools, ranks, 1, seed, elementwise_experts=True)
    chunked = _run(pools, ranks, chunks, seed, elementwise_experts=True)
    _assert_close_to_unchunked(unchunked, chunked, ranks, chunks, bitwise_rows=True)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_with_megatrons_expert_mlps(pools, seed, ranks, chunks):
    """megatron's expert MLPs: a CPU GEMM's blocking follows the number of rows, so a row's result may
    differ in its last bits with the chunk it came in; compared to float32 rounding."""
    unchunked = _run(pools, ranks, 1, seed)
    chunked = _run(pools, ranks, chunks, seed)
    _assert_close_to_unchunked(unchunked, chunked, ranks, chunks, bitwise_rows=False)


@pytest.mark.parametrize("ranks", [2, 4])
def test_chunks_with_routes_dropped_by_capacity(pools, seed, ranks):
    """Routes past an expert's capacity are -1 slots in the dispatch: chunked, the same as unchunked."""
    unchunked = _run(pools, ranks, 1, seed, topk=3, capacity_factor=0.5, elementwise_experts=True)
    chunked = _run(pools, ranks, 3, seed, topk=3, capacity_factor=0.5, elementwise_experts=True)
    _assert_close_to_unchunked(unchunked, chunked, ranks, 3, bitwise_rows=True)


def test_chunks_with_the_shared_expert_overlap(pools, seed):
    """moe_shared_expert_overlap: the shared expert's stages run around the chunks' pipeline; the
    shared expert's parameters get their gradients as unchunked."""
    shared = dict(moe_shared_expert_intermediate_size=32, add_bias_linear=False, moe_shared_expert_overlap=True)
    unchunked = _run(pools, 2, 1, seed, elementwise_experts=True, **shared)
    chunked = _run(pools, 2, 2, seed, elementwise_experts=True, **shared)
    assert any("shared_experts" in name for name in unchunked[0][2])
    # The input gradient's three shares (shared expert, router, dispatch) are added in the order autograd
    # runs them, which the graph's shape fixes: the same bits chunked, whatever the data.
    _assert_close_to_unchunked(unchunked, chunked, 2, 2, bitwise_rows=True)


def test_chunks_with_fp8_dispatch(pools, seed):
    """FP8 dispatch casts each row on its own (1x128 blocks along the hidden size), in any chunk the
    same bits; each chunk keeps its own received fp8 rows until its permute."""
    fp8 = dict(hidden=128, elementwise_experts=True, moe_ep_options=dict(moe_ep_fp8_dispatch="on"))
    unchunked = _run(pools, 2, 1, seed, **fp8)
    chunked = _run(pools, 2, 3, seed, **fp8)
    _assert_close_to_unchunked(unchunked, chunked, 2, 3, bitwise_rows=True)
    in_bf16 = _run(pools, 2, 3, seed, hidden=128, elementwise_experts=True,
                   moe_ep_options=dict(moe_ep_fp8_dispatch="off"))
    assert not torch.equal(in_bf16[0][0], chunked[0][0]), "the tokens travelled in fp8"


def test_phases_called_one_by_one_are_refused_in_chunks(pools, seed):
    """Only MoELayer's routed_experts_compute runs the chunks' experts; a caller of the phases themselves
    is told so instead of permuting rows that were never dispatched."""
    from moe_ep.launch import RankError
    with pytest.raises(RankError, match="moe_ep_overlap_chunks > 1: each chunk's experts run in experts_in_chunks"):
        pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 32, "deepep", 12,
                     moe_ep_options=dict(moe_ep_overlap_chunks=2))


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2", True, None])
def test_a_bad_chunk_count_is_refused(bad):
    from moe_ep.megatron import options
    with pytest.raises(ValueError, match="moe_ep_overlap_chunks: expected an int >= 1"):
        options.options_for(types.SimpleNamespace(moe_ep_overlap_chunks=bad))


def test_chunks_are_off_by_default():
    from moe_ep.megatron import DispatcherOptions
    assert DispatcherOptions().moe_ep_overlap_chunks == 1


def test_megatron_lm_flag_sets_the_chunk_count():
    from moe_ep.megatron import DispatcherOptions, add_arguments, apply_arguments, options
    saved = options.options_for(types.SimpleNamespace())
    parser = add_arguments(argparse.ArgumentParser())
    try:
        apply_arguments(parser.parse_args([]))
        assert options.options_for(types.SimpleNamespace()).moe_ep_overlap_chunks == 1
        apply_arguments(parser.parse_args(["--moe-ep-overlap-chunks", "4"]))
        assert options.options_for(types.SimpleNamespace()) == DispatcherOptions(moe_ep_overlap_chunks=4)
        # A config's own attribute wins over the flag.
        assert options.options_for(types.SimpleNamespace(moe_ep_overlap_chunks=2)).moe_ep_overlap_chunks == 2
        with pytest.raises(SystemExit):
            parser.parse_args(["--moe-ep-overlap-chunks", "two"])
    finally:
        options.set_defaults(**vars(saved))
