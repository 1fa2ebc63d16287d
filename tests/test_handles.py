"""Handles read as deep_ep's tuples; every field against the dense reference."""
import pytest
import torch

from . import rank_fns
from .problems import Problem, make_inputs, ref_dispatch, ref_low_latency_slots


def _problem(seed, num_ranks, **kw):
    return Problem(seed, num_ranks, num_ranks * 3, 128, min(4, num_ranks * 3), **kw)


def check_dispatch_handle(p, inputs, rank, res, num_worst_tokens=0):
    rank_prefix, send_pos, channel_state, recv_src_idx, in_rank, send_head = res["normal"]
    assert res["normal_len"] == 6 and [type(v) for v in res["normal_index"]] == [type(v) for v in res["normal"]]
    assert channel_state is None and send_head is None
    sent = torch.zeros(p.num_ranks, p.num_ranks, dtype=torch.int32)  # [src, dst]
    for src, inp in enumerate(inputs):
        for dst in range(p.num_ranks):
            lo, hi = dst * p.local_experts, (dst + 1) * p.local_experts
            sent[src, dst] = sum(any(lo <= e < hi for e in row) for row in inp["topk_idx"].tolist())
    assert rank_prefix.dtype == torch.int32 and torch.equal(rank_prefix, sent.cumsum(0, dtype=torch.int32)), \
        f"rank {rank}: rank_prefix_matrix"
    sources = ref_dispatch(p, inputs, rank)[0]
    want_src = [t for _, t in sources] + [-1] * (num_worst_tokens - len(sources) if num_worst_tokens else 0)
    assert recv_src_idx.dtype == torch.int32 and recv_src_idx.tolist() == want_src, f"rank {rank}: recv_src_idx"
    idx = inputs[rank]["topk_idx"]
    want_in_rank = torch.zeros(idx.shape[0], p.num_ranks, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                want_in_rank[t, e // p.local_experts] = True
    assert torch.equal(in_rank, want_in_rank)
    want_pos = torch.full((idx.shape[0], p.num_ranks), -1, dtype=torch.int32)
    for dst in range(p.num_ranks):
        want_pos[want_in_rank[:, dst], dst] = torch.arange(int(want_in_rank[:, dst].sum()), dtype=torch.int32)
    assert send_pos.dtype == torch.int32 and torch.equal(send_pos, want_pos), f"rank {rank}: send_pos"


def check_low_latency_handle(p, inputs, rank, res):
    src_info, layout_range, max_tokens, hidden, num_experts = res["low_latency"]
    assert res["low_latency_len"] == 5 and (max_tokens, hidden, num_experts) == (p.max_tokens, p.hidden, p.num_experts)
    assert "hook" in res["before_hook"]
    assert src_info.dtype == torch.int32 and src_info.shape == (p.local_experts, p.num_ranks * p.max_tokens)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (p.local_experts, p.num_ranks)
    for j, entries in enumerate(ref_low_latency_slots(p, inputs, rank)):
        want = [t for _, t, _ in entries]
        assert src_info[j, :len(want)].tolist() == want, f"rank {rank} expert {j}: packed_recv_src_info"
        assert (src_info[j, len(want):] == -1).all()
        begin = 0
        for src in range(p.num_ranks):
            count = sum(1 for s, _, _ in entries if s == src)
            assert int(layout_range[j, src]) == (begin << 32 | count), \
                f"rank {rank} expert {j} source {src}: packed_recv_layout_range"
            begin += count


def check_handles_of_a_round(pool, seed, num_ranks, num_worst_tokens):
    p = _problem(seed, num_ranks)
    results = pool.run(rank_fns.handle_tuples, p, num_worst_tokens=num_worst_tokens)
    inputs = make_inputs(p)
    for rank, res in enumerate(results):
        check_dispatch_handle(p, inputs, rank, res, num_worst_tokens)
        check_low_latency_handle(p, inputs, rank, res)


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("num_worst_tokens", [0, 96])
def test_handles_read_as_deep_ep_tuples(pools, seed, num_ranks, num_worst_tokens):
    check_handles_of_a_round(pools(num_ranks), seed, num_ranks, num_worst_tokens)


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("num_worst_tokens", [0, 96])
def test_kernel_handles_read_as_deep_ep_tuples(gpu_pools, seed, num_ranks, num_worst_tokens):
    check_handles_of_a_round(gpu_pools(num_ranks), seed, num_ranks, num_worst_tokens)
