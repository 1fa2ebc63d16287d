"""Buffer.profile() (moe_ep.profiling): the phases it times on CPU ranks, that nothing records outside it,
MOE_EP_PROFILE=1, and gather() on rank 0."""
import types
import weakref

import pytest
import torch
import torch.distributed as dist

from moe_ep import Buffer
from moe_ep.bench.profile import rank_rounds
from moe_ep.buffer import default_config_size_hints
from moe_ep.profiling import PHASES, format_table

from .problems import Problem, expert_output
from .rank_fns import construction_error, cpu, my_inputs, with_env

# The round's calls per phase: a layout, a dispatch and its count exchange, two cached dispatches, a
# combine, a low-latency dispatch and combine, each given a hook.
ROUND_CALLS = {"layout": 1, "count exchange": 1, "dispatch": 1, "cached dispatch": 2, "combine": 1,
               "low-latency dispatch": 1, "low-latency combine": 1, "hook wait": 2}


def profiled_buffer(p: Problem) -> Buffer:
    """A Buffer for normal and low-latency calls of p's shapes."""
    nvl = default_config_size_hints(p.hidden * 2, p.num_ranks)[0]
    rdma = Buffer.get_low_latency_rdma_size_hint(p.max_tokens, p.hidden, p.num_ranks, p.num_experts)
    return Buffer(dist.group.WORLD, nvl, rdma, low_latency_mode=True)


def one_round(buffer: Buffer, p: Problem) -> dict:
    """Every kind of call once (cached dispatches twice): their results, on CPU."""
    inp = my_inputs(p)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    recv_x, _, recv_w, counts, handle, _ = buffer.dispatch(
        inp["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"])
    cached = [buffer.dispatch(inp["x"], handle=handle)[0] for _ in range(2)]
    combined, combined_w, _ = buffer.combine(expert_output(recv_x, dist.get_rank()), handle, topk_weights=recv_w)
    ll_x, ll_count, ll_handle, _, hook = buffer.low_latency_dispatch(
        inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, use_fp8=False, return_recv_hook=True)
    hook()
    ll_combined, _, combine_hook = buffer.low_latency_combine(
        expert_output(ll_x, dist.get_rank()), inp["topk_idx"], inp["topk_weights"], ll_handle, return_recv_hook=True)
    combine_hook()
    return cpu(dict(recv_x=recv_x, counts=counts, cached=cached, combined=combined, combined_w=combined_w,
                    ll_x=ll_x, ll_count=ll_count, ll_combined=ll_combined))


def profiled_round(p: Problem) -> dict:
    """A round under profile(), a round after it; what the Profile and the Buffer tell."""
    buffer = profiled_buffer(p)
    before = buffer.profiler
    with buffer.profile() as prof:
        during = buffer.profiler is prof
        results = one_round(buffer, p)
    summary = prof.summary()
    after_exit = buffer.profiler
    plain = one_round(buffer, p)  # not recorded
    return dict(before=before, during=during, after_exit=after_exit, summary=summary,
                summary_after=prof.summary(), results=results, plain=plain, calls=buffer.stats()["calls"])


def unprofiled_round(p: Problem) -> dict:
    buffer = profiled_buffer(p)
    results = one_round(buffer, p)
    return dict(profiler=buffer.profiler, results=results, stats=buffer.stats())


def profiled_from_construction(p: Problem) -> dict:
    """Under MOE_EP_PROFILE=1: a round with no profile() entered, then one inside one (which the
    construction's Profile records too)."""
    buffer = profiled_buffer(p)
    one_round(buffer, p)
    with buffer.profile() as inner:
        one_round(buffer, p)
    return dict(whole=buffer.profiler.summary(), inner=inner.summary(), stays=buffer.profiler is not None)


def gathered_round(p: Problem):
    buffer = profiled_buffer(p)
    with buffer.profile() as prof:
        one_round(buffer, p)
    return prof.summary(), prof.gather()


def assert_round_summary(summary: dict, rounds: int = 1) -> None:
    assert list(summary) == [phase for phase in PHASES if phase in ROUND_CALLS]
    for phase, row in summary.items():
        assert row["calls"] == ROUND_CALLS[phase] * rounds, (phase, row)
        assert 0 <= row["max_ms"] <= row["total_ms"] and row["max_ms"] >= row["mean_ms"] > 0, (phase, row)
        assert row["mean_ms"] == pytest.approx(row["total_ms"] / row["calls"])


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_profile_times_every_phase_of_a_round(pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 128, 3, max_tokens=16)
    for res in pools(num_ranks).run(profiled_round, p):
        assert res["before"] is None and res["during"] and res["after_exit"] is None
        assert_round_summary(res["summary"])
        assert res["summary_after"] == res["summary"]  # the round after the exit is not recorded
        torch.testing.assert_close(res["results"], res["plain"], rtol=0, atol=0)
        assert res["calls"]["dispatch"] == 2 and res["calls"]["cached_dispatch"] == 4


def test_without_profile_nothing_records_and_results_are_the_same(pools, seed):
    p = Problem(seed, 2, 8, 128, 3, max_tokens=16)
    profiled = pools(2).run(profiled_round, p)
    plain = pools(2).run(unprofiled_round, p)
    for with_profile, without in zip(profiled, plain):
        assert without["profiler"] is None
        torch.testing.assert_close(without["results"], with_profile["results"], rtol=0, atol=0)
        assert without["stats"]["calls"] == {k: v // 2 for k, v in with_profile["calls"].items()}


def test_profile_env_records_from_construction(pools, seed):
    p = Problem(seed, 2, 8, 128, 3, max_tokens=16)
    for res in pools(2).run(with_env, {"MOE_EP_PROFILE": "1"}, profiled_from_construction, p):
        assert res["stays"]
        assert_round_summary(res["whole"], rounds=2)
        assert_round_summary(res["inner"])


def profiled_buffer_freed(p: Problem) -> dict:
    """Whether a Buffer profiled from construction is freed as soon as it is dropped (no cycle with its
    Profile), and what its Profile says then."""
    buffer = profiled_buffer(p)
    one_round(buffer, p)
    prof, freed = buffer.profiler, weakref.ref(buffer)
    del buffer
    try:
        prof.gather()
        gather_error = ""
    except RuntimeError as exc:
        gather_error = str(exc)
    return dict(freed=freed() is None, summary=prof.summary(), gather_error=gather_error)


def test_a_profiled_buffer_is_freed_when_dropped(pools, seed):
    p = Problem(seed, 2, 8, 128, 3, max_tokens=16)
    for res in pools(2).run(with_env, {"MOE_EP_PROFILE": "1"}, profiled_buffer_freed, p):
        assert res["freed"]
        assert_round_summary(res["summary"])
        assert "was freed" in res["gather_error"]


def test_profile_env_refuses_other_values(pools):
    message = pools(2).run(with_env, {"MOE_EP_PROFILE": "yes"}, construction_error)
    assert all("MOE_EP_PROFILE" in m for m in message)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_gather_returns_every_ranks_summary_on_rank_zero(pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 128, 3, max_tokens=16)
    results = pools(num_ranks).run(gathered_round, p)
    gathered = results[0][1]
    assert sorted(gathered) == list(range(num_ranks))
    for rank, (summary, mine) in enumerate(results):
        assert gathered[rank] == summary
        assert_round_summary(summary)
        if rank:
            assert mine is None
    table = format_table(gathered)
    assert all(f"{phase:<20}" in table for phase in ROUND_CALLS)


def test_bench_profile_rounds_gather_every_rank_on_rank_zero(pools):
    args = types.SimpleNamespace(rounds=3, tokens=32, hidden=128, topk=2, experts=8)
    gathered, other = pools(2).run(rank_rounds, args, False)
    assert other is None and sorted(gathered) == [0, 1]
    for summary in gathered.values():
        assert {phase: row["calls"] for phase, row in summary.items()} == {
            "layout": 3, "count exchange": 3, "dispatch": 3, "cached dispatch": 3, "combine": 3}
