"""Normal-mode layout, dispatch and combine against the dense reference, on 2, 3, 4 and 8 ranks."""
import pytest
import torch

from moe_ep import fp8

from . import rank_fns
from .problems import (Problem, bias_for, expert_output, make_inputs, problem_where, ref_combine, ref_dispatch,
                       ref_recv_x, same_bits)

RANKS = [2, 3, 4, 8]


def _problem(seed, num_ranks, local_experts=3, hidden=256, num_topk=4, **kw):
    num_experts = num_ranks * local_experts
    return Problem(seed, num_ranks, num_experts, hidden, min(num_topk, num_experts), **kw)


def _check_layout(p, inputs, results):
    for rank, res in enumerate(results):
        per_rank, per_rdma, per_expert, in_rank = res["layout"]
        idx = inputs[rank]["topk_idx"]
        n = idx.shape[0]
        want_in_rank = torch.zeros(n, p.num_ranks, dtype=torch.bool)
        want_per_expert = torch.zeros(p.num_experts, dtype=torch.int32)
        for t in range(n):
            for e in idx[t].tolist():
                if e >= 0:
                    want_in_rank[t, e // p.local_experts] = True
                    want_per_expert[e] += 1
        assert torch.equal(in_rank, want_in_rank), f"rank {rank}: is_token_in_rank"
        assert torch.equal(per_expert, want_per_expert), f"rank {rank}: num_tokens_per_expert"
        assert torch.equal(per_rank, want_in_rank.sum(0, dtype=torch.int32)), f"rank {rank}: num_tokens_per_rank"
        assert per_rdma is None, "all ranks share one host here: no rdma ranks"


@pytest.mark.parametrize("num_ranks", RANKS)
def test_dispatch_sends_each_token_once_per_rank_in_source_order(pools, seed, num_ranks):
    p = _problem(seed, num_ranks)
    results = pools(num_ranks).run(rank_fns.normal_round, p)
    inputs = make_inputs(p)
    _check_layout(p, inputs, results)
    for dst, res in enumerate(results):
        sources, idx_rows, weight_rows, per_expert = ref_dispatch(p, inputs, dst)
        assert torch.equal(res["recv_x"], ref_recv_x(inputs, sources)), f"seed {seed} rank {dst}: recv_x"
        assert res["recv_idx"].tolist() == idx_rows, f"seed {seed} rank {dst}: recv_topk_idx"
        assert torch.equal(res["recv_w"], torch.tensor(weight_rows, dtype=torch.float32).view(-1, p.num_topk))
        assert res["counts"] == per_expert
        assert torch.equal(res["cached"], res["recv_x"]), "a cached dispatch must reproduce the first"
        assert res["cached_rest"] == (None, None, None, None)


@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("num_biases", [0, 1, 2])
def test_combine_sums_rows_from_every_rank_in_rank_order(pools, seed, num_ranks, num_biases):
    p = _problem(seed, num_ranks, hidden=128)
    results = pools(num_ranks).run(rank_fns.normal_round, p, num_biases=num_biases)
    inputs = make_inputs(p)
    received = [ref_dispatch(p, inputs, dst)[0] for dst in range(num_ranks)]
    returned = [expert_output(ref_recv_x(inputs, received[dst]), dst) for dst in range(num_ranks)]
    for src, res in enumerate(results):
        n = inputs[src]["x"].shape[0]
        biases = [bias_for(p, src, n, i) for i in range(num_biases)]
        want = ref_combine(p, inputs, received, returned, src, biases)
        assert torch.equal(res["combined"], want), f"seed {seed} rank {src}: combined_x"
        # Summing the forwarded weights gives back each token's weights of experts that exist.
        weights = torch.where(inputs[src]["topk_idx"] >= 0, inputs[src]["topk_weights"], 0.0)
        sent = (inputs[src]["topk_idx"] >= 0).any(1)
        assert torch.equal(res["combined_w"][sent], weights[sent])


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_fp8_dispatch_moves_values_and_scales_exactly(pools, seed, num_ranks):
    p = _problem(seed, num_ranks, hidden=384)
    results = pools(num_ranks).run(rank_fns.normal_round, p, use_fp8=True)
    inputs = make_inputs(p)
    casts = [fp8.per_token_cast_to_fp8(inp["x"]) for inp in inputs]
    fp8_inputs = [{"q": c[0].view(torch.uint8), "s": c[1]} for c in casts]
    for dst, res in enumerate(results):
        sources = ref_dispatch(p, inputs, dst)[0]
        recv_q, recv_s = res["recv_x"]
        assert recv_q.dtype == torch.float8_e4m3fn and recv_s.dtype == torch.float32
        assert torch.equal(recv_q.view(torch.uint8), ref_recv_x(fp8_inputs, sources, "q"))
        assert torch.equal(recv_s, ref_recv_x(fp8_inputs, sources, "s"))
        assert torch.equal(res["cached"][0].view(torch.uint8), recv_q.view(torch.uint8))


@pytest.mark.parametrize("num_ranks", [3, 4])
def test_expert_alignment_rounds_counts_up(pools, seed, num_ranks):
    p = _problem(seed, num_ranks)
    results = pools(num_ranks).run(rank_fns.normal_round, p, expert_alignment=8)
    inputs = make_inputs(p)
    for dst, res in enumerate(results):
        per_expert = ref_dispatch(p, inputs, dst)[3]
        assert res["counts"] == [-(-c // 8) * 8 for c in per_expert]


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_num_worst_tokens_pads_outputs_and_combine_ignores_padding(pools, seed, num_ranks):
    p = _problem(seed, num_ranks, hidden=128)
    worst = p.max_tokens * num_ranks
    results = pools(num_ranks).run(rank_fns.normal_round, p, num_worst_tokens=worst, num_biases=1)
    inputs = make_inputs(p)
    received = [ref_dispatch(p, inputs, dst)[0] for dst in range(num_ranks)]
    returned = [expert_output(ref_recv_x(inputs, received[dst]), dst) for dst in range(num_ranks)]
    for dst, res in enumerate(results):
        n = len(received[dst])
        assert res["num_recv_rows"] == worst and res["recv_x"].shape[0] == worst
        assert torch.equal(res["recv_x"][:n], ref_recv_x(inputs, received[dst]))
        assert (res["recv_idx"][n:] == -1).all() and (res["recv_w"][n:] == 0).all()
        assert res["counts"] == [], "no host synchronisation: per-expert counts are not returned"
        assert res["cached"].shape[0] == worst
        biases = [bias_for(p, dst, inputs[dst]["x"].shape[0], 0)]
        assert torch.equal(res["combined"], ref_combine(p, inputs, received, returned, dst, biases))


def test_dispatch_without_topk_forwards_rows_only(pools, seed):
    p = _problem(seed, 4)
    results = pools(4).run(rank_fns.normal_round, p, with_topk=False)
    inputs = make_inputs(p)
    for dst, res in enumerate(results):
        sources, _, _, per_expert = ref_dispatch(p, inputs, dst)
        assert torch.equal(res["recv_x"], ref_recv_x(inputs, sources))
        assert res["recv_idx"] is None and res["recv_w"] is None
        assert res["counts"] == per_expert


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_uniform_routing_without_drops(pools, seed, num_ranks):
    p = _problem(seed, num_ranks, local_experts=2, num_topk=2, drop=0.0, skew=False, zero_token_rank=False)
    results = pools(num_ranks).run(rank_fns.normal_round, p)
    inputs = make_inputs(p)
    for dst, res in enumerate(results):
        assert torch.equal(res["recv_x"], ref_recv_x(inputs, ref_dispatch(p, inputs, dst)[0]))


def test_num_worst_tokens_too_small_raises_on_every_rank(pools, seed):
    def some_rank_receives_two_rows(q):
        inputs = make_inputs(q)
        return max(len(ref_dispatch(q, inputs, dst)[0]) for dst in range(q.num_ranks)) >= 2

    p = problem_where(lambda s: _problem(s, 3, drop=0.0, zero_token_rank=False), seed, some_rank_receives_two_rows)
    inputs = make_inputs(p)
    for dst, (outcome, received) in enumerate(pools(3).run(rank_fns.worst_tokens_too_small, p)):
        assert "num_worst_tokens=1 is too small" in outcome, outcome
        assert received == len(ref_dispatch(p, inputs, dst)[0]), "the next dispatch works"


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("variant", [
    dict(combine_x="empty_combine_input", num_biases=1),
    dict(combine_x="tensor", use_fp8=True, num_worst_tokens=100),
    dict(combine_x="recv_x", with_topk=False, stream_args=True),
])
def test_an_arena_changes_nothing_on_the_portable_backend(pools, seed, num_ranks, variant):
    """CPU tensors run on the portable backend, which has no arena: a Buffer given num_arena_bytes, or the
    default, gives the outputs of one with num_arena_bytes=0, whatever combine's x is
    (empty_combine_input is then a plain tensor)."""
    p = Problem(seed, num_ranks, num_ranks * 4, 128, 3, max_tokens=24)
    without = pools(num_ranks).run(rank_fns.normal_round, p, arena=False, **variant)
    for arena in (True, None):
        for rank, (a, b) in enumerate(zip(pools(num_ranks).run(rank_fns.normal_round, p, arena=arena, **variant),
                                          without)):
            for field in a:
                assert same_bits(a[field], b[field]), f"seed {seed} arena {arena} rank {rank}: {field}"


@pytest.mark.parametrize("num_ranks,num_biases", [(2, 0), (3, 2)])
def test_repeated_combines_with_an_arena_equal_the_ordinary_one(pools, seed, num_ranks, num_biases):
    """Three combines after a cached dispatch on a Buffer with an arena, of rows written into
    empty_combine_input and of a tensor of their own: the bits of the same combines on a Buffer
    without one."""
    p = Problem(seed, num_ranks, num_ranks * 4, 128, 3, max_tokens=24)
    for rank, results in enumerate(pools(num_ranks).run(rank_fns.arena_combine_rounds, p, num_biases, 3, True)):
        for i, (in_place, in_place_w, copied, copied_w, plain, plain_w) in enumerate(results):
            assert torch.equal(in_place, plain) and torch.equal(copied, plain), f"rank {rank}, combine {i}"
            assert torch.equal(in_place_w, plain_w) and torch.equal(copied_w, plain_w), f"rank {rank}, combine {i}"


def test_empty_combine_input_misuse_is_refused(pools):
    for outcomes in pools(2).run(rank_fns.combine_input_misuse):
        for (kind, message), (want_kind, names) in zip(outcomes, [("ValueError", "hidden"), ("ValueError", "dtype"),
                                                                   ("TypeError", "handle")]):
            assert kind == want_kind and names in message, message


def test_empty_combine_input_is_a_tensor_for_combine(pools):
    """Without the kernels' arena, empty_combine_input is a plain [received rows, hidden] tensor, and a
    combine of it is the combine of the same rows from any tensor."""
    for same in pools(2).run(rank_fns.combine_of_empty_combine_input):
        assert same


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(4, 2), (8, 4), (8, 2)])
@pytest.mark.parametrize("num_biases", [0, 2])
def test_combine_across_nodes_sums_each_node_first(pools, seed, num_ranks, ranks_per_node, num_biases):
    """With the group spread over nodes the dispatch is the same, and the combine sums each node's rows
    (rounded to bf16, as they cross the network back) before the biases and the other nodes' sums."""
    def wants(q):
        """Each rank's combined tokens, summed per node first and (to tell them apart) flat."""
        inputs = make_inputs(q)
        received = [ref_dispatch(q, inputs, dst)[0] for dst in range(num_ranks)]
        returned = [expert_output(ref_recv_x(inputs, received[dst]), dst) for dst in range(num_ranks)]
        per_node, flat = [], []
        for src in range(num_ranks):
            biases = [bias_for(q, src, inputs[src]["x"].shape[0], i) for i in range(num_biases)]
            per_node.append(ref_combine(q, inputs, received, returned, src, biases, ranks_per_node))
            flat.append(ref_combine(q, inputs, received, returned, src, biases))
        return per_node, flat

    def orders_differ(q):
        return num_biases == 0 or any(not torch.equal(a, b) for a, b in zip(*wants(q)))

    # With biases, a problem whose two orders round differently on some token, so that the test can tell
    # them apart (a few tokens may round alike).
    p = problem_where(lambda s: _problem(s, num_ranks, hidden=128), seed, orders_differ)
    results = pools(num_ranks).run(rank_fns.normal_round, p, num_biases=num_biases, ranks_per_node=ranks_per_node)
    inputs = make_inputs(p)
    for src, (res, want) in enumerate(zip(results, wants(p)[0])):
        assert res["layout"][1] is not None, "several nodes: num_tokens_per_rdma_rank is counted"
        assert torch.equal(res["combined"], want), f"seed {seed} rank {src}: combined_x"
        weights = torch.where(inputs[src]["topk_idx"] >= 0, inputs[src]["topk_weights"], 0.0)
        sent = (inputs[src]["topk_idx"] >= 0).any(1)
        assert torch.equal(res["combined_w"][sent], weights[sent])


def test_a_layout_tensor_reused_after_the_dispatch_changes_nothing(pools, seed):
    """The handle keeps what it needs of is_token_in_rank: a caller that overwrites its tensor after the
    dispatch (deep_ep's combine never reads it) gets the same cached dispatch and combine."""
    p = _problem(seed, 3)
    for rank, (left_alone, reused) in enumerate(pools(3).run(rank_fns.layout_tensor_reused_after_dispatch, p)):
        for name, a, b in zip(("recv_x", "cached recv_x", "combined"), left_alone, reused):
            assert same_bits(a, b), f"seed {seed} rank {rank}: {name}"
