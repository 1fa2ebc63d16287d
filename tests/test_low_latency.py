"""Low-latency dispatch and combine against the dense reference."""
import pytest
import torch

from . import rank_fns
from .problems import (Problem, make_inputs, problem_where, ref_low_latency_combine, ref_low_latency_recv,
                       ref_low_latency_slots)

RANKS = [2, 3, 4, 8]


def _problem(seed, num_ranks, local_experts=2, hidden=256, num_topk=3, **kw):
    num_experts = num_ranks * local_experts
    return Problem(seed, num_ranks, num_experts, hidden, min(num_topk, num_experts), max_tokens=16, **kw)


def _check_recv(p, inputs, results, use_fp8, round_scale=False, use_ue8m0=False):
    for dst, res in enumerate(results):
        slots, expected, rows = ref_low_latency_recv(p, inputs, dst, use_fp8, round_scale, use_ue8m0)
        assert res["recv_count"].tolist() == [len(s) for s in slots], f"rank {dst}: recv_count"
        assert torch.equal(res["stats"], res["recv_count"]), "cumulative stats add the counts"
        recv_x = res["recv_x"][0] if use_fp8 else res["recv_x"]
        assert recv_x.shape == (p.local_experts, rows, p.hidden)
        for j, (vals, scales) in enumerate(expected):
            n = len(vals)
            if n == 0:
                continue
            got = recv_x[j, :n]
            want = torch.stack(vals)
            if use_fp8:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"rank {dst} expert {j}: values"
                assert torch.equal(res["recv_x"][1][j, :n], torch.stack(scales)), f"rank {dst} expert {j}: scales"
            else:
                assert torch.equal(got, want), f"rank {dst} expert {j}: rows"


def _check_combine(p, inputs, results, use_fp8):
    slots = [ref_low_latency_slots(p, inputs, dst) for dst in range(p.num_ranks)]
    outputs = [res["y"] for res in results]
    for src, res in enumerate(results):
        want = ref_low_latency_combine(p, inputs, src, slots, outputs, inputs[src]["topk_weights"])
        assert torch.equal(res["combined"], want), f"rank {src}: combined"


@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_packs_rows_per_expert_by_source_rank_then_token(pools, seed, num_ranks, use_fp8):
    p = _problem(seed, num_ranks)
    results = pools(num_ranks).run(rank_fns.low_latency_round, p, use_fp8)
    inputs = make_inputs(p)
    _check_recv(p, inputs, results, use_fp8)
    _check_combine(p, inputs, results, use_fp8)


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_low_latency_fp8_round_scale_and_ue8m0(pools, seed, use_ue8m0):
    p = _problem(seed, 4, hidden=640)
    results = pools(4).run(rank_fns.low_latency_round, p, True, round_scale=True, use_ue8m0=use_ue8m0)
    inputs = make_inputs(p)
    _check_recv(p, inputs, results, True, round_scale=True, use_ue8m0=use_ue8m0)
    if use_ue8m0:
        assert results[0]["recv_x"][1].dtype == torch.int32


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_receive_happens_in_the_hook(pools, seed, num_ranks):
    p = problem_where(lambda s: _problem(s, num_ranks, zero_token_rank=False, drop=0.0), seed,
                      lambda q: any(inp["x"].shape[0] for inp in make_inputs(q)))  # something to receive
    results = pools(num_ranks).run(rank_fns.low_latency_round, p, True, return_recv_hook=True)
    inputs = make_inputs(p)
    assert any(res["recv_count"].sum() > 0 for res in results)
    for res in results:
        assert res["count_before_hook"].sum() == 0, "nothing may be received before hook() runs"
    _check_recv(p, inputs, results, True)
    _check_combine(p, inputs, results, True)


def test_zero_copy_combine_reads_the_registered_buffer(pools, seed):
    p = _problem(seed, 4)
    results = pools(4).run(rank_fns.low_latency_round, p, False, zero_copy=True)
    _check_combine(p, make_inputs(p), results, False)


def test_combine_writes_into_out(pools, seed):
    p = _problem(seed, 3)
    results = pools(3).run(rank_fns.low_latency_round, p, False, use_out=True)
    assert all(res["out_is_result"] for res in results)
    _check_combine(p, make_inputs(p), results, False)


def test_top_k_of_sixteen_with_many_experts(pools, seed):
    p = Problem(seed, 4, 64, 128, 16, max_tokens=8)
    results = pools(4).run(rank_fns.low_latency_round, p, True)
    inputs = make_inputs(p)
    _check_recv(p, inputs, results, True)
    _check_combine(p, inputs, results, True)
