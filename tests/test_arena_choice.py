"""The path each call takes with an arena: one pass where every rank has room (and, for a combine, its
rows lie in the arena or copying them there pays), else two passes, chosen on the device by every rank
alike; either way the results equal the portable backend's bit for bit. GPU only: the portable backend
has no arena."""
import pytest
import torch
import torch.distributed as dist

from moe_ep import Buffer, Config, fp8
from moe_ep.config import arena_bytes

from .problems import Problem, expert_output, make_inputs, ref_dispatch
from .rank_fns import cpu, my_inputs, normal_buffer

# A count of rows that no dispatch of these problems reaches: an arena this small never has room.
TINY_ARENA_ROWS = 1


def _one_pass(buffer: Buffer, kind: str, call):
    """(call(), whether the device ran it in one pass): the Buffer's count of one-pass calls of `kind`
    ("dispatch" or "combine") before and after it."""
    before = buffer.stats()["one_pass_calls"][kind]
    result = call()
    return result, buffer.stats()["one_pass_calls"][kind] == before + 1


def arena_rounds(p: Problem, arena: str, use_fp8: bool, num_worst_tokens: int = 0, short_rank: int = -1,
                 small_buffer: bool = False):
    """A dispatch, a cached dispatch and two combines (x from empty_combine_input, and an ordinary x) on
    a Buffer whose arena is `arena`: "none" (0 bytes), "tiny" (room for no call), "roomy" (the round's
    calls' rows), "auto" (the Buffer's own, growing), or "roomy" except on short_rank, whose arena is
    full ("short"). small_buffer: the Buffer and its calls sized by a small Config (so an arena of the
    Buffer's own starts small). -> per call its outputs and which path ran."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    rows = dist.get_world_size() * max(p.max_tokens, num_worst_tokens)
    sizes = {"none": 0, "auto": None,
             "tiny": arena_bytes(TINY_ARENA_ROWS, p.hidden * 2, p.hidden // 128 * 4, p.num_topk, num_live=1),
             "roomy": arena_bytes(rows, p.hidden * 2, p.hidden // 128 * 4, p.num_topk, num_live=6)}
    size = sizes["roomy" if arena == "short" else arena]
    config = Config(24, 4, 8, 4, 8) if small_buffer else None
    buffer = normal_buffer(p.hidden, config, num_arena_bytes=size)
    call = dict(config=config) if small_buffer else {}
    x = fp8.per_token_cast_to_fp8(inp["x"]) if use_fp8 else inp["x"]
    layout = _layout(buffer, inp, p)
    paths = {}
    # Maps the arena (and grows one of the Buffer's own that lacks room); only its handle is kept.
    first, paths["first"] = _one_pass(buffer, "dispatch", lambda: buffer.dispatch(x, **layout, **call)[4])
    holds = _fill_arena(buffer, first) if arena == "short" and rank == short_rank else []
    (recv_x, recv_idx, recv_w, counts, handle, _), paths["dispatch"] = _one_pass(
        buffer, "dispatch", lambda: buffer.dispatch(x, num_worst_tokens=num_worst_tokens, **layout, **call))
    cached, paths["cached"] = _one_pass(buffer, "dispatch", lambda: buffer.dispatch(x, handle=handle, **call)[0])
    recv_bf16 = fp8.per_token_cast_back(*recv_x) if use_fp8 else recv_x
    y = expert_output(recv_bf16, rank)
    into = buffer.empty_combine_input(handle, y.shape[1], y.dtype).copy_(y)
    (combined_in_place, w_in_place, _), paths["combine_in_place"] = _one_pass(
        buffer, "combine", lambda: buffer.combine(into, handle, topk_weights=recv_w, **call))
    (combined, w, _), paths["combine"] = _one_pass(
        buffer, "combine", lambda: buffer.combine(y.clone(), handle, topk_weights=recv_w, **call))
    again, paths["dispatch_again"] = _one_pass(  # after any growth
        buffer, "dispatch", lambda: buffer.dispatch(x, num_worst_tokens=num_worst_tokens, **layout, **call)[0])
    del holds
    return cpu(dict(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, counts=counts, cached=cached,
                    combined_in_place=combined_in_place, w_in_place=w_in_place, combined=combined, w=w,
                    again=again, paths=paths))


def _layout(buffer: Buffer, inp: dict, p: Problem) -> dict:
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"])


def _fill_arena(buffer: Buffer, handle) -> list:
    """Combine inputs of `handle` (which received rows) that hold this rank's arena until less is free
    than the smallest of them (one float32 column), halving their width where the free bytes lie in
    pieces."""
    holds, rows = [], handle.num_recv_rows
    assert rows > 0, "a handle of no rows cannot hold arena bytes"
    while True:
        arena = buffer.stats()["arena"]
        hidden = max(1, (arena["capacity"] - arena["in_use"]) // (rows * 4))
        while True:
            held = buffer.empty_combine_input(handle, hidden, torch.float32)
            if buffer.stats()["arena"]["in_use"] > arena["in_use"]:  # it lies in the arena
                holds.append(held)
                break
            if hidden == 1:
                return holds
            hidden //= 2


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a == b


def _check_equal(results, reference, seed):
    for rank, (res, ref) in enumerate(zip(results, reference)):
        for key in ("recv_x", "recv_idx", "recv_w", "counts", "cached", "combined_in_place", "w_in_place",
                    "combined", "w", "again"):
            assert _same(res[key], ref[key]), f"seed {seed} rank {rank}: {key} differs from the two-pass round"


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_each_arena_gives_the_two_pass_results(gpu_pools, seed, num_ranks, use_fp8):
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=48)
    pool = gpu_pools(num_ranks)
    reference = pool.run(arena_rounds, p, "none", use_fp8)
    for arena in ("tiny", "roomy", "auto"):
        _check_equal(pool.run(arena_rounds, p, arena, use_fp8), reference, seed)
    inputs = make_inputs(p)
    assert any(inp["x"].shape[0] for inp in inputs)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_every_rank_takes_the_path_the_one_pass_kernel_chose(gpu_pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=48)
    pool = gpu_pools(num_ranks)
    copy_pays = num_ranks >= 4
    cases = {
        "none": None,  # no arena: no one-pass kernel
        "tiny": dict(first=False, dispatch=False, cached=False, combine_in_place=False, combine=False,
                     dispatch_again=False),
        "roomy": dict(first=True, dispatch=True, cached=True, combine_in_place=True, combine=copy_pays,
                      dispatch_again=True),
        # The short rank's arena is filled after the first dispatch.
        "short": dict(first=True, dispatch=False, cached=False, combine_in_place=False, combine=False,
                      dispatch_again=False),
    }
    reference = pool.run(arena_rounds, p, "none", False)
    inputs = make_inputs(p)
    # The rank whose arena is filled: the one receiving the most rows (the filler is its combine inputs).
    short_rank = max(range(num_ranks), key=lambda r: len(ref_dispatch(p, inputs, r)[0]))
    for arena, want in cases.items():
        if want is None:
            continue
        results = pool.run(arena_rounds, p, arena, False, short_rank=short_rank)
        _check_equal(results, reference, seed)
        for rank, res in enumerate(results):
            assert res["paths"] == want, f"seed {seed} arena {arena} rank {rank}: {res['paths']}"


@pytest.mark.parametrize("num_worst_tokens", [0, 2048])  # 2048: every token of both ranks fits
def test_an_arena_of_the_buffers_own_grows_to_one_pass(gpu_pools, seed, num_worst_tokens):
    """The default arena (num_nvl_bytes, small here) with more rows than it holds: the first fresh
    dispatch takes two passes and the arena grows, so the next ones take one; results equal the
    two-pass round."""
    p = Problem(seed, 2, 8, 256, 4, max_tokens=1024, drop=0.0, zero_token_rank=False)
    pool = gpu_pools(2)
    reference = pool.run(arena_rounds, p, "none", False, num_worst_tokens, small_buffer=True)
    results = pool.run(arena_rounds, p, "auto", False, num_worst_tokens, small_buffer=True)
    _check_equal(results, reference, seed)
    for res in results:
        if num_worst_tokens == 0:
            assert not res["paths"]["first"] and res["paths"]["dispatch_again"], res["paths"]
