"""moe_ep_overlap_chunks with moe_ep's dispatcher ("deepep"): a layer's tokens pipelined in chunks, forward
and backward, give the output and every gradient of the unchunked layer; each chunk's exchanges are in
flight while its neighbours' experts compute; the option's checks and its Megatron-LM flag.

On CPU ranks the chunked runs go through late_delivery.LateDelivery: an asynchronous call's rows are NaN
until its event is waited for, so a phase that read rows (or gradients) before they arrived would show."""
import argparse
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from . import megatron_fns  # noqa: E402

# Tokens on each rank: uneven counts, and ranks with fewer tokens than chunks, which send empty chunks.
TOKENS = {2: [13, 2], 4: [11, 1, 7, 2]}
# A rank without tokens sends only empty chunks (megatron's router refuses no tokens; the rank function
# gives that rank the same gating with its shape spelled out).
NO_TOKENS = {2: [9, 0], 4: [11, 0, 7, 2]}


def _run(pools, ranks, chunks, seed, topk=2, capacity_factor=None, elementwise_experts=False, hidden=32,
         tokens=TOKENS, late_delivery=True, **kw):
    return pools(ranks).run(megatron_fns.chunked_moe_layer, 2 * ranks, topk, hidden, chunks, tokens[ranks],
                            seed % 10000, capacity_factor, elementwise_experts, late_delivery=late_delivery, **kw)


def _in_flight(log, position):
    """The (kind, exchange) calls started before log[position] and not yet waited for."""
    started = set()
    for action, kind, exchange in log[:position]:
        if action == "start":
            started.add((kind, exchange))
        elif action == "wait":
            started.discard((kind, exchange))
    return started


def _assert_pipelined(result, chunks: int):
    """Between the wait for chunk i's rows and the start of chunk i's combine its experts compute (in the
    backward, their backward): meanwhile the neighbouring chunks' exchanges are in flight, the next
    chunk's dispatch and the previous chunk's combine (the backward runs the chunks last first)."""
    forward, backward = result["forward_log"], result["backward_log"]
    if chunks == 1:
        assert forward == [("start", "dispatch", 0), ("wait", "dispatch", 0), ("start", "combine", 0),
                           ("wait", "combine", 0)], forward
        assert backward == [("call", "cached_dispatch", 0), ("call", "combine", 0)], backward
        return
    for log, arriving, leaving, step in ((forward, "dispatch", "combine", 1),
                                         (backward, "cached_dispatch", "combine", -1)):
        assert all(action != "call" for action, _, _ in log), log
        for i in range(chunks):
            computing = log.index(("wait", arriving, i)) + 1
            assert log[computing] == ("start", leaving, i), (i, log)
            neighbours = {(arriving, i + step), (leaving, i - step)}
            neighbours = {(kind, j) for kind, j in neighbours if 0 <= j < chunks}
            assert neighbours <= _in_flight(log, computing), (i, log)
        for i in range(chunks):  # every exchange waited for once
            assert log.count(("wait", arriving, i)) == log.count(("wait", leaving, i)) == 1, log


def _assert_like_unchunked(unchunked, chunked, ranks, chunks: int, bitwise_rows: bool, tokens=TOKENS):
    """Every rank made chunks times the Buffer calls (each chunk's layout, dispatch and combine, and in
    the backward each chunk's cached dispatch and combine), pipelined (_assert_pipelined).
    bitwise_rows: the output, the input's gradient and the gradients of the parameters outside the
    routed experts (router, shared experts) are the same bits, since each row's operations are
    unchanged by chunking wherever the experts' are. The routed experts' parameter gradients sum over
    rows chunk by chunk and then add the chunks' sums, another order: compared to float32 rounding."""
    for rank, (ref, res) in enumerate(zip(unchunked, chunked)):
        assert ref["out"].shape[0] == tokens[ranks][rank]
        assert ref["calls"] == dict(get_dispatch_layout=1, dispatch=1, combine=2, cached_dispatch=1), ref["calls"]
        assert res["calls"] == {kind: chunks * n for kind, n in ref["calls"].items()}, f"rank {rank}: {res['calls']}"
        if res["forward_log"] is not None:
            _assert_pipelined(res, chunks)
        for key in ("out", "grad_x"):
            if bitwise_rows:
                assert torch.equal(ref[key], res[key]), f"rank {rank} {key}"
            torch.testing.assert_close(res[key], ref[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {key}: {m}")
        assert ref["grads"].keys() == res["grads"].keys() and any(name.startswith("experts.") for name in ref["grads"])
        for name, grad in ref["grads"].items():
            if bitwise_rows and not name.startswith("experts."):  # the routed experts' sum by chunk
                assert torch.equal(grad, res["grads"][name]), f"rank {rank} {name}"
            torch.testing.assert_close(res["grads"][name], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("ranks", [2, 4])
def test_chunks_pass_every_row_through_unchanged(pools, seed, ranks):
    """Elementwise experts: the dispatch, the combine and the router treat a row the same in any chunk,
    so the output and the gradients of the input and the router are the unchunked layer's bits."""
    unchunked = _run(pools, ranks, 1, seed, elementwise_experts=True, late_delivery=False)
    for chunks in (1, 2, 3):
        chunked = _run(pools, ranks, chunks, seed, elementwise_experts=True)
        _assert_like_unchunked(unchunked, chunked, ranks, chunks, bitwise_rows=True)


@pytest.mark.parametrize("ranks", [2, 4])
def test_chunks_with_megatrons_expert_mlps(pools, seed, ranks):
    """megatron's expert MLPs: each chunk's GEMMs see only that chunk's rows, and a CPU GEMM's blocking
    follows the number of rows, so a row's result may differ in its last bits with the chunk it came
    in; compared to float32 rounding."""
    unchunked = _run(pools, ranks, 1, seed, late_delivery=False)
    for chunks in (2, 3):
        _assert_like_unchunked(unchunked, _run(pools, ranks, chunks, seed), ranks, chunks, bitwise_rows=False)


@pytest.mark.parametrize("ranks", [2, 4])
def test_chunks_with_a_rank_without_tokens(pools, seed, ranks):
    """A rank without tokens makes every chunk's calls with empty rows, forward and backward, and its
    peers get the unchunked layer's bits."""
    unchunked = _run(pools, ranks, 1, seed, elementwise_experts=True, tokens=NO_TOKENS, late_delivery=False)
    for chunks in (2, 3):
        chunked = _run(pools, ranks, chunks, seed, elementwise_experts=True, tokens=NO_TOKENS)
        _assert_like_unchunked(unchunked, chunked, ranks, chunks, bitwise_rows=True, tokens=NO_TOKENS)


@pytest.mark.parametrize("ranks", [2, 4])
def test_chunks_with_routes_dropped_by_capacity(pools, seed, ranks):
    """Routes past an expert's capacity are -1 slots in the dispatch: chunked, the same as unchunked."""
    dropping = dict(topk=3, capacity_factor=0.5, elementwise_experts=True)
    unchunked = _run(pools, ranks, 1, seed, late_delivery=False, **dropping)
    chunked = _run(pools, ranks, 3, seed, **dropping)
    _assert_like_unchunked(unchunked, chunked, ranks, 3, bitwise_rows=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_chunks_with_shared_experts(pools, seed, overlap):
    """Shared experts, with moe_shared_expert_overlap (their stages run around the chunks' pipeline) and
    without (MoELayer runs them itself): the shared experts' parameters get the unchunked gradients'
    bits. The input gradient's three shares (shared experts, router, dispatch) are added in the order
    autograd runs them, which the graph's shape fixes: the same bits chunked, whatever the data."""
    shared = dict(moe_shared_expert_intermediate_size=32, add_bias_linear=False, moe_shared_expert_overlap=overlap)
    unchunked = _run(pools, 2, 1, seed, elementwise_experts=True, late_delivery=False, **shared)
    assert any("shared_experts" in name for name in unchunked[0]["grads"])
    for chunks in (2, 3):
        chunked = _run(pools, 2, chunks, seed, elementwise_experts=True, **shared)
        _assert_like_unchunked(unchunked, chunked, 2, chunks, bitwise_rows=True)


def test_chunks_with_fp8_dispatch(pools, seed):
    """FP8 dispatch casts each row on its own (1x128 blocks along the hidden size), in any chunk the
    same bits; each chunk keeps its own received fp8 rows until its permute."""
    fp8 = dict(hidden=128, elementwise_experts=True, moe_ep_options=dict(moe_ep_fp8_dispatch="on"))
    unchunked = _run(pools, 2, 1, seed, late_delivery=False, **fp8)
    chunked = _run(pools, 2, 3, seed, **fp8)
    _assert_like_unchunked(unchunked, chunked, 2, 3, bitwise_rows=True)
    in_bf16 = _run(pools, 2, 3, seed, hidden=128, elementwise_experts=True,
                   moe_ep_options=dict(moe_ep_fp8_dispatch="off"))
    assert not torch.equal(in_bf16[0]["out"], chunked[0]["out"]), "the tokens travelled in fp8"


def test_backward_mirrors_the_forward_pipeline(pools, seed):
    """Three chunks: the forward runs D0 D1 C0 D2 C1 C2 (dispatch i+1 and combine i-1 in flight while
    chunk i's experts compute); the backward meets the chunks last first and runs the same pipeline
    backwards, each chunk's gradient dispatch started one chunk ahead, and waits for the gradient
    combines where the chunks' input gradients meet."""
    result = _run(pools, 2, 3, seed, elementwise_experts=True)[0]
    assert result["forward_log"] == [
        ("start", "dispatch", 0), ("start", "dispatch", 1), ("wait", "dispatch", 0), ("start", "combine", 0),
        ("start", "dispatch", 2), ("wait", "dispatch", 1), ("start", "combine", 1),
        ("wait", "dispatch", 2), ("start", "combine", 2),
        ("wait", "combine", 0), ("wait", "combine", 1), ("wait", "combine", 2)]
    assert result["backward_log"] == [
        ("start", "cached_dispatch", 2), ("start", "cached_dispatch", 1), ("wait", "cached_dispatch", 2),
        ("start", "combine", 2),
        ("start", "cached_dispatch", 0), ("wait", "cached_dispatch", 1), ("start", "combine", 1),
        ("wait", "cached_dispatch", 0), ("start", "combine", 0),
        ("wait", "combine", 2), ("wait", "combine", 1), ("wait", "combine", 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("elementwise_experts", [True, False])
def test_chunks_on_cuda_ranks(gpu_pools, seed, elementwise_experts):
    """CUDA ranks sharing the GPU (the intranode kernels move the tokens and gradients on the Buffer's
    communication stream while the experts compute on the default one): chunked layers, forward and
    backward, against the unchunked layer on the same ranks, with the shared experts overlapped and
    routes dropped by capacity. Compared to float32 rounding (the GPU's GEMMs and reductions may round
    a row differently in a smaller batch)."""
    from moe_ep import _native
    if not _native.has_kernels():
        pytest.skip(str(_native.unavailable_reason()))
    kw = dict(elementwise_experts=elementwise_experts, late_delivery=False, cuda=True, topk=3, capacity_factor=1.0,
              moe_shared_expert_intermediate_size=32, add_bias_linear=False, moe_shared_expert_overlap=True)
    for tokens in (TOKENS, NO_TOKENS):
        unchunked = _run(gpu_pools, 4, 1, seed, tokens=tokens, **kw)
        for chunks in (2, 3):
            chunked = _run(gpu_pools, 4, chunks, seed, tokens=tokens, **kw)
            _assert_like_unchunked(unchunked, chunked, 4, chunks, bitwise_rows=False, tokens=tokens)


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
