"""Shrink mode: low-latency calls on Buffer(enable_shrink=True) mask a rank that stopped answering and go
on without it, their outputs those of the dense reference without that rank's experts and tokens."""
import copy

import pytest
import torch

from . import shrink_fns
from .problems import Problem, make_inputs, ref_low_latency_combine, ref_low_latency_recv, ref_low_latency_slots

# Long enough that a rank merely slowed by a loaded machine is not masked.
TIMEOUT_S = 6.0
# A call that waits out no timeout returns within this, loosely (one that did would take TIMEOUT_S).
QUICK_S = TIMEOUT_S * 0.75
# The pool's deadline for one rank function: a few timeouts and rounds.
CALL_TIMEOUT_S = 120


def _problem(seed: int, num_ranks: int) -> Problem:
    return Problem(seed, num_ranks, num_ranks * 2, 128, 3, max_tokens=12)


def _without(p: Problem, inputs, masked: set):
    """The inputs as the masked ranks' peers see them: the masked ranks have no tokens, and the others'
    top-k entries for the masked ranks' experts are -1."""
    inputs = copy.deepcopy(inputs)
    for rank, inp in enumerate(inputs):
        if rank in masked:
            inp["x"], inp["topk_idx"], inp["topk_weights"] = inp["x"][:0], inp["topk_idx"][:0], inp["topk_weights"][:0]
        else:
            owner = inp["topk_idx"] // p.local_experts
            dropped = (inp["topk_idx"] >= 0) & torch.isin(owner, torch.tensor(sorted(masked), dtype=owner.dtype))
            inp["topk_idx"] = torch.where(dropped, torch.full_like(inp["topk_idx"], -1), inp["topk_idx"])
    return inputs


def _check_round(p: Problem, rounds: dict, masked: set) -> None:
    """rounds: rank -> its round, for the ranks that took part (not in masked)."""
    reference = _without(p, make_inputs(p), masked)
    slots = [ref_low_latency_slots(p, reference, dst) for dst in range(p.num_ranks)]
    outputs = {dst: r["y"] for dst, r in rounds.items()}
    for dst, res in rounds.items():
        dst_slots, expected, _ = ref_low_latency_recv(p, reference, dst, False, False, False)
        assert res["recv_count"].tolist() == [len(s) for s in dst_slots], f"rank {dst}: recv_count"
        for j, (vals, _) in enumerate(expected):
            got = res["recv_x"][j, : len(vals)]
            assert torch.equal(got, torch.stack(vals) if vals else got), f"rank {dst} expert {j}: rows"
            assert not res["recv_x"][j, len(vals):].any(), f"rank {dst} expert {j}: rows past the count"
    for src, res in rounds.items():
        want = ref_low_latency_combine(p, reference, src, slots, outputs, reference[src]["topk_weights"])
        assert torch.equal(res["combined"], want), f"rank {src}: combined"


def _masked_list(num_ranks: int, masked: set) -> list:
    return [int(r in masked) for r in range(num_ranks)]


def _check_alone(res: dict, p: Problem) -> None:
    """A masked rank's round: it receives nothing and its tokens reach no expert."""
    assert res["recv_count"].tolist() == [0] * p.local_experts, res["recv_count"]
    assert not res["recv_x"].any() and not res["combined"].any()


@pytest.mark.parametrize("num_ranks, dead_rank", [(3, 0), (4, 2)])
def test_survivors_mask_a_rank_that_stops_calling(pools, seed, num_ranks, dead_rank):
    p = _problem(seed, num_ranks)
    results = pools(num_ranks).run(shrink_fns.rank_stops_calling, p, dead_rank, TIMEOUT_S, timeout_s=CALL_TIMEOUT_S)
    survivors = {r: res for r, res in enumerate(results) if r != dead_rank}
    for rank, (first, second, mask) in survivors.items():
        assert first["seconds"] >= TIMEOUT_S * 0.9, (rank, first["seconds"])  # the first call waited for it
        assert second["seconds"] < QUICK_S, (rank, second["seconds"])  # the next one skips it at once
        assert mask == _masked_list(num_ranks, {dead_rank}), (rank, mask)
        assert any(f"rank(s) {dead_rank} did not arrive at low_latency_dispatch" in w for w in first["warnings"]), \
            first["warnings"]
        assert second["warnings"] == [], second["warnings"]
    for which in (0, 1):
        _check_round(p, {r: res[which] for r, res in survivors.items()}, {dead_rank})


def test_a_rank_that_stops_calling_without_shrink_times_out_its_peers(pools, seed):
    p = _problem(seed, 3)
    results = pools(3).run(shrink_fns.rank_stops_calling_without_shrink, p, 1, TIMEOUT_S, timeout_s=CALL_TIMEOUT_S)
    assert results[1] is None
    for first, later in results[:1] + results[2:]:
        assert first[0] == "TimeoutError" and "rank(s) 1 did not arrive at low_latency_dispatch" in first[1], first
        assert later[0] == "TimeoutError" and "this Buffer can no longer be used" in later[1], later


@pytest.mark.parametrize("num_ranks", [3, 4])
def test_a_late_rank_runs_alone_until_the_mask_is_cleaned(pools, seed, num_ranks):
    late_rank = num_ranks - 1
    p = _problem(seed, num_ranks)
    results = pools(num_ranks).run(shrink_fns.rank_comes_late, p, late_rank, TIMEOUT_S, timeout_s=CALL_TIMEOUT_S)
    for rank, (late, mask, after, mask_after) in enumerate(results):
        assert mask == _masked_list(num_ranks, {late_rank}), (rank, mask)
        assert mask_after == [0] * num_ranks, (rank, mask_after)
        assert after["seconds"] < QUICK_S or rank == late_rank, (rank, after["seconds"])
    _check_alone(results[late_rank][0], p)
    assert any(f"rank {late_rank} arrived at low_latency_dispatch" in w and "masked" in w
               for w in results[late_rank][0]["warnings"]), results[late_rank][0]["warnings"]
    _check_round(p, {r: res[0] for r, res in enumerate(results) if r != late_rank}, {late_rank})
    _check_round(p, {r: res[2] for r, res in enumerate(results)}, set())


def test_masking_by_hand_takes_effect_at_the_next_call(pools, seed):
    num_ranks, masked_rank = 4, 1
    p = _problem(seed, num_ranks)
    results = pools(num_ranks).run(shrink_fns.mask_by_hand, p, masked_rank, TIMEOUT_S, timeout_s=CALL_TIMEOUT_S)
    for step, masked in enumerate([{masked_rank}, set(), {masked_rank}, set()]):
        rounds = {}
        for rank, steps in enumerate(results):
            mask, res = steps[step]
            assert mask == _masked_list(num_ranks, masked), (step, rank, mask)
            # A call that had waited out the timeout would have masked someone, and warned.
            assert res["warnings"] == [], (step, rank, res["warnings"])
            if rank in masked:
                _check_alone(res, p)
            else:
                rounds[rank] = res
        _check_round(p, rounds, masked)


def test_a_rank_lost_between_dispatch_and_combine_leaves_the_combine_sums(pools, seed):
    """The dispatch ran whole; the combine masks the rank and sums only the other ranks' experts."""
    num_ranks, dead_rank = 3, 1
    p = _problem(seed, num_ranks)
    results = pools(num_ranks).run(shrink_fns.rank_stops_after_dispatch, p, dead_rank, TIMEOUT_S,
                                   timeout_s=CALL_TIMEOUT_S)
    inputs = make_inputs(p)
    slots = [ref_low_latency_slots(p, inputs, dst) for dst in range(num_ranks)]
    without = _without(p, inputs, {dead_rank})
    for src, res in enumerate(results):
        if src == dead_rank:
            assert res is None
            continue
        round_, mask = res
        assert mask == _masked_list(num_ranks, {dead_rank}), (src, mask)
        assert any(f"rank(s) {dead_rank} did not arrive at low_latency_combine" in w for w in round_["warnings"])
        assert round_["recv_count"].tolist() == [len(s) for s in slots[src]], f"rank {src}: the whole dispatch"
        outputs = {dst: results[dst][0]["y"] for dst in range(num_ranks) if dst != dead_rank}
        want = ref_low_latency_combine(p, without, src, slots, outputs, inputs[src]["topk_weights"])
        assert torch.equal(round_["combined"], want), f"rank {src}: combined"
