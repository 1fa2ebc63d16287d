"""Buffer.check_errors, stats, reset_stats and topology (moe_ep.diagnostics): what they report on CPU
ranks (the portable backend), on the arena's own bookkeeping, and on GPU ranks (the kernels: one-pass
counts, arena bytes, peer paths, errors the kernels reported)."""
import types

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Buffer, _native, fp8
from moe_ep.arena import Arena
from moe_ep.buffer import default_config_size_hints
from moe_ep.diagnostics import (CALL_KINDS, FOLD_AFTER, Traffic, call_counts, kernel_backend,
                                stats as diagnostics_stats)
from moe_ep.events import EventOverlap
from moe_ep.handles import DispatchHandle, LowLatencyHandle
from moe_ep.slow_ranks import DEFAULT_SLOW_RANK_MS, SlowRanks

from . import rank_fns
from .problems import Problem, expert_output, make_inputs, ref_dispatch, ref_low_latency_slots
from .rank_fns import TWO_PASS, arena_area, dispatch_args, low_latency_buffer, my_inputs, normal_buffer

# The GPU tests need a CUDA device and the built extension.
kernels_only = pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason()))


# ---------------------------------------------------------------------------- dense references
def routed_rows(p: Problem, inputs, per_pick: bool = False) -> list:
    """[src][dst]: rows src sends dst: tokens with a valid expert on dst (per_pick: one per such expert,
    as low-latency calls send them), from topk_idx alone."""
    rows = [[0] * p.num_ranks for _ in range(p.num_ranks)]
    for src, inp in enumerate(inputs):
        for ids in inp["topk_idx"].tolist():
            dsts = [e // p.local_experts for e in ids if e >= 0]
            for dst in (dsts if per_pick else set(dsts)):
                rows[src][dst] += 1
    return rows


def traffic(rows: list, rank: int, row_bytes: int, back_bytes: int = 0) -> tuple:
    """(sent, received) bytes per rank of `rank` for calls moving rows[src][dst] rows of row_bytes, and each
    of them back (a combine) with back_bytes."""
    r = range(len(rows))
    sent = [rows[rank][d] * row_bytes + rows[d][rank] * back_bytes for d in r]
    received = [rows[s][rank] * row_bytes + rows[rank][s] * back_bytes for s in r]
    return sent, received


def assert_traffic(got: dict, sent: list, received: list, experts: list, last) -> None:
    assert got["sent_bytes"].tolist() == sent, (got["sent_bytes"], sent)
    assert got["recv_bytes"].tolist() == received, (got["recv_bytes"], received)
    assert got["sent_bytes"].dtype == got["recv_bytes"].dtype == got["expert_tokens"].dtype == torch.int64
    assert got["expert_tokens"].tolist() == experts, (got["expert_tokens"], experts)
    if last is None:
        assert got["expert_tokens_last"] is None
    else:
        assert got["expert_tokens_last"].tolist() == last, (got["expert_tokens_last"], last)


def check_normal_traffic(p: Problem, results: list, use_fp8: bool = False, with_topk: bool = True, cached: int = 2,
                         collect=None, expert_alignment: int = 1) -> None:
    """traffic_round's stats() against the dense reference of every rank."""
    inputs = make_inputs(p)
    rows = routed_rows(p, inputs)
    x_row = p.hidden + p.hidden // 128 * 4 if use_fp8 else p.hidden * 2
    fresh_row = x_row + (p.num_topk * 12 if with_topk else 0)
    combine_row = p.hidden * 2 + (p.num_topk * 4 if with_topk else 0)
    nvl_needed = default_config_size_hints(p.hidden * 2, p.num_ranks)[0]
    zero = [0] * p.num_ranks
    total_sent = total_received = 0
    for rank, res in enumerate(results):
        per_expert = ref_dispatch(p, inputs, rank)[3]
        before, after = res["before"], res["after_round"]
        assert before["collecting"] is bool(collect) and before["uncounted_calls"] == 0
        assert_traffic(before, zero, zero, [], [])
        assert before["buffer_high_water"] == {"nvl": 0, "rdma": 0, "arena": 0}  # nothing mapped yet
        # The dispatch alone; its counts list as num_recv_tokens_per_expert_list has them (none for num_worst_tokens).
        assert_traffic(res["after_dispatch"], *traffic(rows, rank, fresh_row), per_expert, per_expert)
        if res["counts"]:  # expert_alignment pads the list, not the counters
            assert res["counts"] == [-(-c // expert_alignment) * expert_alignment for c in per_expert]
        # The round: cached dispatches count their handle's dispatch again; the combine sends the rows back.
        sent, received = traffic(rows, rank, fresh_row + cached * x_row, combine_row)
        assert_traffic(after, sent, received, [c * (1 + cached) for c in per_expert], per_expert)
        assert after["uncounted_calls"] == 0 and after["collecting"] is bool(collect)
        assert after["calls"] == dict(call_counts(), get_dispatch_layout=1, dispatch=1, cached_dispatch=cached,
                                      combine=1)
        # The arena's entries are its own numbers (0 without one: the portable backend, num_arena_bytes=0).
        arena = after["arena"]
        assert after["buffer_capacity"] == {"nvl": res["nvl"], "rdma": res["rdma"], "arena": arena["capacity"]}
        assert after["buffer_high_water"] == {"nvl": nvl_needed, "rdma": 0, "arena": arena["high_water"]}
        assert nvl_needed <= res["nvl"]
        # reset_stats(): everything 0 (the expert counters keep their size), collecting from now on.
        reset = res["after_reset"]
        assert_traffic(reset, zero, zero, [0] * p.local_experts, [0] * p.local_experts)
        assert reset["collecting"] is True and reset["calls"] == call_counts()
        assert reset["buffer_high_water"] == {"nvl": 0, "rdma": 0, "arena": reset["arena"]["high_water"]}
        assert reset["buffer_capacity"] == after["buffer_capacity"]
        sent, received = traffic(rows, rank, 0, combine_row)
        assert_traffic(res["after_combine"], sent, received, [0] * p.local_experts, [0] * p.local_experts)
        combine_needed = Buffer.get_combine_config(p.num_ranks).get_nvl_buffer_size_hint(p.hidden * 2, p.num_ranks)
        assert res["after_combine"]["buffer_high_water"]["nvl"] == combine_needed
        total_sent += sum(after["sent_bytes"].tolist())
        total_received += sum(after["recv_bytes"].tolist())
    assert total_sent == total_received  # what one rank sends another receives


def check_low_latency_traffic(p: Problem, results: list, use_fp8: bool, rounds: int) -> None:
    inputs = make_inputs(p)
    picks = routed_rows(p, inputs, per_pick=True)
    row = p.hidden + p.hidden // 128 * 4 if use_fp8 else p.hidden * 2
    needed = Buffer.get_low_latency_rdma_size_hint(p.max_tokens, p.hidden, p.num_ranks, p.num_experts)
    for rank, res in enumerate(results):
        per_expert = [len(s) for s in ref_low_latency_slots(p, inputs, rank)]
        after = res["after_rounds"]
        sent, received = traffic(picks, rank, rounds * row, rounds * p.hidden * 2)
        assert_traffic(after, sent, received, [c * rounds for c in per_expert], per_expert if rounds else [])
        assert after["uncounted_calls"] == 0
        assert after["calls"] == dict(call_counts(), low_latency_dispatch=rounds, low_latency_combine=rounds)
        assert after["buffer_capacity"] == {"nvl": 0, "rdma": res["rdma"], "arena": 0}
        assert after["buffer_high_water"] == {"nvl": 0, "rdma": needed if rounds else 0, "arena": 0}
        # A dispatch whose hook has not run: its tokens per expert count when the hook has received them.
        assert res["before_hook"]["expert_tokens"].tolist() == after["expert_tokens"].tolist()
        sent, received = traffic(picks, rank, (rounds + 1) * row, rounds * p.hidden * 2)
        assert_traffic(res["after_hook"], sent, received, [c * (rounds + 1) for c in per_expert], per_expert)


# ---------------------------------------------------------------------------- rank functions
def counted_calls(p: Problem, cached: int, low_latency: int) -> dict:
    """A layout, a dispatch, `cached` cached dispatches, a combine, a refused dispatch, `low_latency`
    low-latency rounds and an internode_dispatch: stats() after them, after reset_stats(), and after
    one more combine."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden)
    args = dispatch_args(buffer, inp, p)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **args)
    for _ in range(cached):
        buffer.dispatch(inp["x"], handle=handle)
    y = expert_output(recv_x, dist.get_rank())
    buffer.combine(y, handle, topk_weights=recv_w)
    try:  # refused before any backend runs: not counted
        buffer.dispatch(inp["x"], **args, expert_alignment=0)
    except ValueError:
        pass
    buffer.internode_dispatch(inp["x"], handle=handle)  # deep_ep's name for the same call
    low = low_latency_buffer(p)
    for _ in range(low_latency):
        rank_fns.low_latency_round(p, use_fp8=False, buffer=low)
    counts = buffer.stats()
    low_counts = low.stats()
    buffer.reset_stats()
    after_reset = buffer.stats()
    buffer.combine(y, handle, topk_weights=recv_w)
    return dict(counts=counts, low_counts=low_counts, after_reset=after_reset, after_combine=buffer.stats())


def cpu_topology(ranks_per_node: int = None) -> dict:
    """topology() of a normal Buffer and of a low-latency one, and what check_errors() returned after a
    round on each."""
    p = Problem(5, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=8)
    extra = {} if ranks_per_node is None else dict(ranks_per_node=ranks_per_node)
    normal = normal_buffer(p.hidden, **extra)
    low = Buffer(dist.group.WORLD, 0, 1 << 22, low_latency_mode=True, **extra)
    before = normal.topology()
    rank_fns.normal_round(p, buffer=normal)  # normal_round asks check_errors() itself
    checked = normal.check_errors(), low.check_errors()
    return dict(normal=normal.topology(), before=before, low=low.topology(), checked=checked,
                build=moe_ep.backend_info())


def check_errors_after_destroy() -> str:
    buffer = Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True)
    buffer.destroy()
    try:
        buffer.check_errors()
    except RuntimeError as exc:
        return str(exc)
    return "no exception"


def one_pass_counts(p: Problem) -> dict:
    """stats() of a Buffer with an arena with room for every call (one pass: a dispatch, a cached one, a
    combine of an empty_combine_input) and of one without (two passes), the arena's numbers while the
    round's tensors live and after they died, and after reset_stats()."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    results = {}
    for name, area in (("arena", arena_area(p)), ("two_pass", TWO_PASS)):
        buffer = normal_buffer(p.hidden, **area)
        empty = buffer.stats()  # before the first call of CUDA tensors: nothing mapped yet
        args = dispatch_args(buffer, inp, p)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **args)
        cached = buffer.dispatch(inp["x"], handle=handle)[0]
        y = buffer.empty_combine_input(handle, p.hidden).copy_(expert_output(recv_x, rank))
        buffer.combine(y, handle, topk_weights=recv_w)
        live = buffer.stats()
        del recv_x, cached, y
        torch.cuda.synchronize()
        dead = buffer.stats()
        buffer.reset_stats()
        reset = buffer.stats()
        results[name] = dict(empty=empty, live=live, dead=dead, reset=reset, rows=handle.num_recv_rows,
                             size=area["num_arena_bytes"])
    return results


def gpu_topology(p: Problem) -> dict:
    """topology() of a normal and a low-latency Buffer before and after a round of each."""
    normal = normal_buffer(p.hidden)
    low = low_latency_buffer(p)
    before = normal.topology(), low.topology()
    rank_fns.normal_round(p, buffer=normal)
    rank_fns.low_latency_round(p, use_fp8=True, buffer=low)
    return dict(before=before, normal=normal.topology(), low=low.topology())


def overflow_reported(p: Problem, num_worst_tokens: int) -> list:
    """A num_worst_tokens dispatch that may receive more rows than that on the two-pass kernels, then
    check_errors() twice: what each raised ("" for nothing)."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **TWO_PASS)
    buffer.dispatch(inp["x"], **dispatch_args(buffer, inp, p), num_worst_tokens=num_worst_tokens)
    outcomes = []
    for _ in range(2):
        try:
            buffer.check_errors()
            outcomes.append("")
        except ValueError as exc:
            outcomes.append(str(exc))
    return outcomes


def traffic_round(p: Problem, num_worst_tokens: int = 0, use_fp8: bool = False, with_topk: bool = True,
                  cached: int = 2, collect=None, arena: bool = False, stream_args: bool = False,
                  expert_alignment: int = 1) -> dict:
    """A fresh dispatch, `cached` cached dispatches and a combine (reset_stats(collect=collect) first unless
    None): stats() before, after the dispatch, after the round, after reset_stats() and after one more
    combine, with the Buffer's sizes."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **rank_fns.arena_kwargs(p, arena, num_worst_tokens))
    if collect is not None:
        buffer.reset_stats(collect=collect)
    before = buffer.stats()
    args = dispatch_args(buffer, inp, p)
    if not with_topk:
        del args["topk_idx"], args["topk_weights"]
    extra = {}
    if stream_args:  # async calls on the kernels count on the communication stream, before their events
        extra = dict(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    x = fp8.per_token_cast_to_fp8(inp["x"]) if use_fp8 else inp["x"]
    recv_x, _, recv_w, counts, handle, event = buffer.dispatch(x, **args, num_worst_tokens=num_worst_tokens,
                                                               expert_alignment=expert_alignment, **extra)
    event.current_stream_wait()
    after_dispatch = buffer.stats()
    for _ in range(cached):
        if stream_args:
            extra["previous_event"] = Buffer.capture()
        buffer.dispatch(x, handle=handle, **extra)[-1].current_stream_wait()
    y = expert_output(fp8.per_token_cast_back(*recv_x) if use_fp8 else recv_x, rank)
    if stream_args:
        extra["previous_event"] = Buffer.capture()
    buffer.combine(y, handle, topk_weights=recv_w, **extra)[-1].current_stream_wait()
    after_round = buffer.stats()
    buffer.reset_stats()
    after_reset = buffer.stats()
    buffer.combine(y, handle, topk_weights=recv_w)
    return dict(before=before, after_dispatch=after_dispatch, after_round=after_round, after_reset=after_reset,
                after_combine=buffer.stats(), counts=counts, nvl=buffer.num_nvl_bytes, rdma=buffer.num_rdma_bytes)


def low_latency_traffic(p: Problem, use_fp8: bool, rounds: int, collect=None) -> dict:
    """`rounds` low-latency rounds with the hook (reset_stats(collect=collect) first unless None), then a
    dispatch whose hook has not run: stats() before the hook, after it and after the rounds."""
    buffer = low_latency_buffer(p)
    if collect is not None:
        buffer.reset_stats(collect=collect)
    for _ in range(rounds):
        rank_fns.low_latency_round(p, use_fp8=use_fp8, return_recv_hook=True, buffer=buffer)
    after_rounds = buffer.stats()
    inp = my_inputs(p)
    _, _, _, _, hook = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts,
                                                    use_fp8=use_fp8, return_recv_hook=True)
    before_hook = buffer.stats()
    hook()
    return dict(after_rounds=after_rounds, before_hook=before_hook, after_hook=buffer.stats(),
                rdma=buffer.num_rdma_bytes)


# ---------------------------------------------------------------------------- CPU ranks
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_stats_count_every_call_on_the_portable_backend(pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 128, 3, max_tokens=16)
    for res in pools(num_ranks).run(counted_calls, p, cached=2, low_latency=3):
        want = dict(call_counts(), get_dispatch_layout=1, dispatch=1, cached_dispatch=3, combine=1)
        assert res["counts"]["calls"] == want, res["counts"]
        assert res["low_counts"]["calls"] == dict(call_counts(), low_latency_dispatch=3, low_latency_combine=3)
        for counted in (res["counts"], res["low_counts"], res["after_reset"], res["after_combine"]):
            assert counted["one_pass_calls"] == {"dispatch": 0, "combine": 0}
            assert counted["arena"] == {"capacity": 0, "in_use": 0, "high_water": 0, "regions": 0}
        assert res["after_reset"]["calls"] == call_counts()
        assert res["after_combine"]["calls"] == dict(call_counts(), combine=1)
    assert set(CALL_KINDS) == set(res["counts"]["calls"])


# The dispatch variants whose counts stats() must report, on every backend.
TRAFFIC_VARIANTS = {
    "plain": {},
    "num_worst_tokens": dict(num_worst_tokens=48),  # 4 ranks of at most 12 tokens
    "fp8": dict(use_fp8=True),
    "no_topk": dict(with_topk=False),
    "collecting": dict(collect=True),
    "expert_alignment": dict(expert_alignment=4),
}


def _check_variant(p: Problem, results: list, variant: dict) -> None:
    checked = ("use_fp8", "with_topk", "cached", "collect", "expert_alignment")
    check_normal_traffic(p, results, **{k: v for k, v in variant.items() if k in checked})


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("variant", list(TRAFFIC_VARIANTS))
def test_stats_count_tokens_per_expert_and_bytes_per_peer_on_the_portable_backend(pools, seed, num_ranks, variant):
    """Skewed expert loads, -1 ids and a rank without tokens (Problem's defaults), from a fresh seed."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 3, max_tokens=12)
    kwargs = TRAFFIC_VARIANTS[variant]
    _check_variant(p, pools(num_ranks).run(traffic_round, p, **kwargs), kwargs)


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_stats_count_low_latency_tokens_and_bytes_on_the_portable_backend(pools, seed, num_ranks, use_fp8):
    p = Problem(seed, num_ranks, num_ranks * 3, 256, 3, max_tokens=10)
    results = pools(num_ranks).run(low_latency_traffic, p, use_fp8, rounds=2)
    check_low_latency_traffic(p, results, use_fp8, rounds=2)
    assert all(not res["after_hook"]["collecting"] for res in results)  # the host knew every count


def _kernel_like_handle(p: Problem, inputs, rank: int, worst: int):
    """A DispatchHandle as the kernels leave a num_worst_tokens dispatch's (no counts on the host), and its
    recv_topk_idx padded with -1 rows, made from the dense reference on CPU tensors."""
    rows = routed_rows(p, inputs)
    in_rank = torch.zeros(inputs[rank]["x"].shape[0], p.num_ranks, dtype=torch.bool)
    for t, ids in enumerate(inputs[rank]["topk_idx"].tolist()):
        for e in ids:
            if e >= 0:
                in_rank[t, e // p.local_experts] = True
    prefix = torch.tensor(rows, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    handle = DispatchHandle(buffer_serial=0, num_tokens=in_rank.shape[0], is_token_in_rank=in_rank, send_counts=None,
                            recv_counts=None, num_worst_tokens=worst, rank_prefix_matrix=prefix)
    idx_rows = ref_dispatch(p, inputs, rank)[1]
    recv_idx = torch.full((worst, p.num_topk), -1, dtype=torch.int64)
    if idx_rows:
        recv_idx[: len(idx_rows)] = torch.tensor(idx_rows, dtype=torch.int64)
    return handle, recv_idx


def test_device_side_counting_equals_the_dense_reference(seed):
    """The counting the Buffer runs on the device where only it has the counts (num_worst_tokens dispatches
    on the kernels, their cached dispatches and combines, low-latency calls on the kernels), fed CPU tensors
    as the kernels leave them: equal to the dense reference while collecting, left out (and said so) when
    not."""
    p = Problem(seed, 4, 16, 256, 3, max_tokens=12)
    inputs = make_inputs(p)
    rows, picks = routed_rows(p, inputs), routed_rows(p, inputs, per_pick=True)
    x_row, worst, sync = p.hidden * 2, 60, EventOverlap()
    fresh_row, combine_row = x_row + p.num_topk * 12, x_row + p.num_topk * 4
    for rank in range(p.num_ranks):
        per_expert = ref_dispatch(p, inputs, rank)[3]
        x = inputs[rank]["x"]
        fresh = types.SimpleNamespace(handle=None, x_parts=[x], topk_idx=inputs[rank]["topk_idx"],
                                      num_tokens_per_expert=torch.zeros(p.num_experts, dtype=torch.int32))
        y = torch.zeros(worst, p.hidden, dtype=torch.bfloat16)
        weights = torch.zeros(worst, p.num_topk, dtype=torch.float32)

        # Collecting: every count, as the host would have had it.
        counter = Traffic(rank, p.num_ranks)
        counter.collecting = True
        handle, recv_idx = _kernel_like_handle(p, inputs, rank, worst)
        counter.dispatch(fresh, handle, recv_idx, sync, None)
        assert isinstance(handle.recv_expert_counts, torch.Tensor)  # kept for the cached dispatches
        counter.dispatch(types.SimpleNamespace(handle=handle, x_parts=[x], topk_idx=None), handle, None, sync, None)
        counter.combine(types.SimpleNamespace(handle=handle, x=y, topk_weights=weights), sync, None)
        sent, received = traffic(rows, rank, fresh_row + x_row, combine_row)
        assert_traffic(counter.read(), sent, received, [2 * c for c in per_expert], per_expert)
        assert counter.uncounted == 0

        # Not collecting: nothing added, each call said to be left out.
        idle = Traffic(rank, p.num_ranks)
        handle, recv_idx = _kernel_like_handle(p, inputs, rank, worst)
        idle.dispatch(fresh, handle, recv_idx, sync, None)
        assert handle.recv_expert_counts is None
        zero = [0] * p.num_ranks
        assert_traffic(idle.read(), zero, zero, [], None)
        idle.combine(types.SimpleNamespace(handle=handle, x=y, topk_weights=None), sync, None)
        assert idle.uncounted == 2
        # Collecting from a cached dispatch of that handle on: its bytes, not its experts (never counted).
        idle.collecting = True
        idle.dispatch(types.SimpleNamespace(handle=handle, x_parts=[x], topk_idx=None), handle, None, sync, None)
        assert idle.uncounted == 3
        assert_traffic(idle.read(), *traffic(rows, rank, x_row), [], None)
        # A num_worst_tokens dispatch without topk_idx: its bytes count, its experts cannot.
        no_topk = types.SimpleNamespace(handle=None, x_parts=[x], topk_idx=None,
                                        num_tokens_per_expert=fresh.num_tokens_per_expert)
        counter = Traffic(rank, p.num_ranks)
        counter.collecting = True
        counter.dispatch(no_topk, _kernel_like_handle(p, inputs, rank, worst)[0], None, sync, None)
        assert counter.uncounted == 1
        assert_traffic(counter.read(), *traffic(rows, rank, x_row), [0] * p.local_experts, None)

        # Low-latency calls on the kernels: picks per rank from topk_idx, sources from the handle.
        slots = ref_low_latency_slots(p, inputs, rank)
        source = torch.full((p.local_experts, p.num_ranks * p.max_tokens), -1, dtype=torch.int32)
        for j, entries in enumerate(slots):
            for i, (src, t, _) in enumerate(entries):
                source[j, i] = src * p.max_tokens + t
        ll_handle = LowLatencyHandle(0, p.max_tokens, p.hidden, p.num_experts, x.shape[0], p.num_topk,
                                     torch.device("cpu"), backend_state=object(), recv_source=source)
        recv_count = torch.tensor([len(e) for e in slots], dtype=torch.int32)
        counter = Traffic(rank, p.num_ranks)
        topk_idx = inputs[rank]["topk_idx"]
        assert counter._count_low_latency(ll_handle, topk_idx, x_row, recv_count, False, False)
        recv_count.zero_()  # the caller's tensor: the last counts were copied
        assert counter._count_low_latency(ll_handle, topk_idx, p.hidden * 2, None, False, True)
        sent, received = traffic(picks, rank, x_row, p.hidden * 2)
        assert_traffic(counter.read(), sent, received, [len(e) for e in slots], [len(e) for e in slots])
        counter.clear()  # the device counters keep their size
        zero = [0] * p.num_ranks
        assert_traffic(counter.read(), zero, zero, [0] * p.local_experts, [0] * p.local_experts)


def test_host_counts_fold_over_many_calls_and_expert_counts():
    """The host queue is summed every FOLD_AFTER calls and when read; dispatches with more local experts
    grow expert_tokens."""
    counter = Traffic(1, 3)
    for i in range(FOLD_AFTER + 7):
        handle = types.SimpleNamespace(send_counts=[i, 1, 0], recv_counts=[0, 2, i], recv_expert_counts=[1, i])
        call = types.SimpleNamespace(handle=None, x_parts=[torch.zeros(0, 8, dtype=torch.bfloat16)], topk_idx=None)
        counter.dispatch(call, handle, None, EventOverlap(), None)
    assert counter._queued < FOLD_AFTER
    n = FOLD_AFTER + 7
    total = n * (n - 1) // 2
    handle = types.SimpleNamespace(send_counts=[0, 0, 0], recv_counts=[0, 0, 0], recv_expert_counts=[0, 0, 5])
    counter.dispatch(call, handle, None, EventOverlap(), None)
    got = counter.read()
    assert got["sent_bytes"].tolist() == [16 * total, 16 * n, 0]
    assert got["recv_bytes"].tolist() == [0, 32 * n, 16 * total]
    assert got["expert_tokens"].tolist() == [n, total, 5] and got["expert_tokens_last"].tolist() == [0, 0, 5]
    counter.clear()
    assert counter.read()["expert_tokens"].tolist() == [0, 0, 0]
    fresh = Traffic(0, 3)
    fresh.dispatch(call, handle, None, EventOverlap(), None)
    fresh.clear()  # queued, not yet summed: the size holds all the same
    got = fresh.read()
    assert got["expert_tokens"].tolist() == [0, 0, 0] and got["expert_tokens_last"].tolist() == [0, 0, 0]


def test_reset_stats_switches_collection(pools):
    assert pools(2).run(_collection_switch) == [[False, True, False, True]] * 2


def _collection_switch() -> list:
    buffer = Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True)
    states = [buffer.stats()["collecting"]]
    for collect in (True, False):
        buffer.reset_stats(collect=collect)
        states.append(buffer.stats()["collecting"])
    buffer.reset_stats()
    states.append(buffer.stats()["collecting"])
    try:
        buffer.reset_stats(collect=1)
    except TypeError:
        return states
    return states + ["no TypeError"]


def test_topology_and_check_errors_on_cpu_ranks(pools):
    for rank, res in enumerate(pools(3).run(cpu_topology)):
        topo, low = res["normal"], res["low"]
        assert (topo["rank"], topo["num_ranks"], topo["ranks_per_node"], topo["node_of_rank"]) == (rank, 3, 3, [0] * 3)
        assert topo["build"] == res["build"]
        # CPU tensors run on the portable backend; CUDA tensors would run on the kernels where built.
        kernels = res["build"]["cuda_kernels"]
        assert topo["normal_backend"] == ("intranode" if kernels else "portable")
        assert (topo["portable_reasons"]["normal"] is None) == kernels
        if not kernels:
            assert topo["portable_reasons"]["normal"] == res["build"]["reason"]
        assert topo["low_latency_backend"] is None and topo["peers"]["low_latency"] is None
        assert low["low_latency_backend"] == ("low_latency" if kernels else "portable")
        assert low["normal_backend"] == "portable"  # no num_nvl_bytes
        assert "num_nvl_bytes > 0" in low["portable_reasons"]["normal"] or not kernels
        for t in (topo, res["before"], low):
            assert t["mapped"] == {"normal": False, "low_latency": False}
            assert t["peer_memory"] == {"normal": None, "low_latency": None}
            assert t["ranks_on_this_gpu"] == 1
        assert res["before"] == topo
        expected = ["self" if r == rank else "portable" for r in range(3)]
        if not kernels:
            assert topo["peers"]["normal"] == expected and low["peers"]["low_latency"] == expected
        assert res["checked"] == (None, None)


def test_topology_names_each_ranks_node(pools):
    for rank, res in enumerate(pools(4).run(cpu_topology, ranks_per_node=2)):
        topo = res["normal"]
        assert topo["node_of_rank"] == [0, 0, 1, 1] and topo["ranks_per_node"] == 2
        # The kernels serve the ranks of one node: this group runs on the portable backend.
        assert topo["normal_backend"] == "portable" and topo["peers"]["normal"][rank] == "self"
        if res["build"]["cuda_kernels"]:
            assert "nodes" in topo["portable_reasons"]["normal"]


def test_check_errors_on_a_destroyed_buffer_says_so(pools):
    assert all("destroyed" in message for message in pools(2).run(check_errors_after_destroy))


def test_the_arena_counts_bytes_in_use_and_their_high_water_mark():
    arena = Arena(1024, 16)
    assert arena.usage() == {"capacity": 1024, "in_use": 0, "high_water": 0, "regions": 0}
    a = arena.alloc(100)  # 112 bytes
    b = arena.alloc(200)  # 208
    assert arena.usage() == {"capacity": 1024, "in_use": 320, "high_water": 320, "regions": 2}
    start, length = arena.reserve_largest()  # the rest, held until the call knows its size
    assert arena.usage()["in_use"] == 1024 and arena.usage()["high_water"] == 320
    arena.shrink(start, 64)  # what the call kept counts
    assert arena.usage() == {"capacity": 1024, "in_use": 384, "high_water": 384, "regions": 3}
    arena.free(a)
    arena.release(b)  # as a dying region gives it back
    assert arena.usage() == {"capacity": 1024, "in_use": 64, "high_water": 384, "regions": 1}
    start, _ = arena.reserve_largest()
    arena.free(start)  # a reservation given back unused never counts
    assert arena.usage()["high_water"] == 384
    arena.reset_high_water()
    assert arena.usage() == {"capacity": 1024, "in_use": 64, "high_water": 64, "regions": 1}


def test_stats_read_the_kernel_backends_counters_and_arena(monkeypatch):
    """Buffer.stats over an intranode backend whose launches are stubbed (test_arena.py's): the arena's
    bytes as the dispatches' regions come and go, and the device counter the one-pass kernels add to."""
    from moe_ep.bench.profile_dispatch_call import stub_backend
    from moe_ep.config import arena_dispatch_region
    from moe_ep.diagnostics import reset_stats

    tokens, hidden, topk, ranks = 16, 64, 2, 3
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    topk_idx = torch.rand(tokens, 6).topk(topk, dim=1).indices
    backend, call = stub_backend(ranks, x, topk_idx, torch.rand(tokens, topk), 6, monkeypatch.setattr, arena=True)
    buffer = types.SimpleNamespace(_intranode=backend, _internode=None, _calls=call_counts(), _traffic=Traffic(0, ranks),
                                   num_nvl_bytes=1 << 20, num_rdma_bytes=0, group_size=ranks, ranks_per_node=ranks,
                                   rank=0, _gate=types.SimpleNamespace(slow_ranks=SlowRanks(0, DEFAULT_SLOW_RANK_MS)))
    region = arena_dispatch_region(ranks * tokens, 2 * hidden, 0, topk).slot_bytes
    first, second = call([x])[0][0], call([x])[0][0]
    backend.one_pass_calls += torch.tensor([2, 1], dtype=torch.int32)  # as the kernels would count
    got = diagnostics_stats(buffer)
    assert got["one_pass_calls"] == {"dispatch": 2, "combine": 1}
    assert got["arena"] == {"capacity": backend.arena.size, "in_use": 2 * region, "high_water": 2 * region,
                            "regions": 2}
    assert got["buffer_capacity"] == {"nvl": 1 << 20, "rdma": 0, "arena": backend.arena.size}
    assert got["buffer_high_water"]["arena"] == 2 * region
    del first
    assert diagnostics_stats(buffer)["arena"] == {"capacity": backend.arena.size, "in_use": region,
                                                  "high_water": 2 * region, "regions": 1}
    reset_stats(buffer)
    got = diagnostics_stats(buffer)
    assert got["one_pass_calls"] == {"dispatch": 0, "combine": 0}
    assert got["arena"]["high_water"] == region == got["arena"]["in_use"]
    del second


# ---------------------------------------------------------------------------- GPU ranks (the kernels)
@pytest.mark.gpu
@kernels_only
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_one_pass_calls_and_arena_bytes_on_the_kernels(gpu_pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=48)
    for rank, res in enumerate(gpu_pools(num_ranks).run(one_pass_counts, p)):
        arena, two_pass = res["arena"], res["two_pass"]
        zero = {"capacity": 0, "in_use": 0, "high_water": 0, "regions": 0}
        for r in (arena, two_pass):
            assert r["empty"]["one_pass_calls"] == {"dispatch": 0, "combine": 0} and r["empty"]["arena"] == zero
            assert r["live"]["calls"] == dict(call_counts(), get_dispatch_layout=1, dispatch=1, cached_dispatch=1,
                                              combine=1)
            assert r["reset"]["one_pass_calls"] == {"dispatch": 0, "combine": 0}
        # With room for every call, each ran in one pass; without an arena none did.
        assert arena["live"]["one_pass_calls"] == {"dispatch": 2, "combine": 1}, f"seed {seed} rank {rank}"
        assert two_pass["live"]["one_pass_calls"] == {"dispatch": 0, "combine": 0}
        assert two_pass["live"]["arena"] == zero and two_pass["dead"]["arena"] == zero
        live, dead = arena["live"]["arena"], arena["dead"]["arena"]
        assert live["capacity"] == dead["capacity"] > 0 and live["capacity"] <= arena["size"]
        if arena["rows"]:  # recv_x, the cached recv_x and the combine input hold regions
            assert live["regions"] == 3 and live["in_use"] >= arena["rows"] * p.hidden * 2 * 3
        assert live["high_water"] >= live["in_use"]
        assert dead["in_use"] == 0 and dead["regions"] == 0 and dead["high_water"] == live["high_water"]
        assert arena["reset"]["arena"]["high_water"] == 0


@pytest.mark.gpu
@kernels_only
def test_topology_on_the_kernels(gpu_pools, seed):
    p = Problem(seed, 2, 8, 256, 4, max_tokens=32)
    for rank, res in enumerate(gpu_pools(2).run(gpu_topology, p)):
        normal, low = res["normal"], res["low"]
        before_normal, before_low = res["before"]
        assert before_normal["normal_backend"] == "intranode" and before_low["low_latency_backend"] == "low_latency"
        assert before_normal["mapped"]["normal"] is False and before_normal["peers"]["normal"][1 - rank] is None
        assert normal["mapped"]["normal"] and normal["peer_memory"]["normal"] in ("vmm", "ipc")
        assert low["mapped"]["low_latency"] and low["peer_memory"]["low_latency"] in ("vmm", "ipc", "nvshmem")
        for paths in (normal["peers"]["normal"], low["peers"]["low_latency"]):
            assert paths[rank] == "self"
            assert paths[1 - rank] == ("same_gpu" if normal["ranks_on_this_gpu"] == 2 else "nvlink"), paths


@pytest.mark.gpu
@kernels_only
def test_check_errors_reports_a_num_worst_tokens_overflow_once(gpu_pools, seed):
    p = Problem(seed, 3, 24, 512, 6, max_tokens=96)
    inputs = make_inputs(p)
    received = [len(ref_dispatch(p, inputs, rank)[0]) for rank in range(3)]
    worst = max(1, min(37, max(received) - 1))
    for rank, outcomes in enumerate(gpu_pools(3).run(overflow_reported, p, worst)):
        if received[rank] > worst:
            assert "num_worst_tokens" in outcomes[0] and outcomes[1] == "", outcomes
        else:
            assert outcomes == ["", ""], outcomes


def test_kernel_backend_is_none_on_the_portable_backend(pools):
    assert pools(2).run(_kernel_backends) == [(None, None)] * 2


def _kernel_backends():
    buffer = Buffer(dist.group.WORLD, 1 << 20, 1 << 22, low_latency_mode=True)
    inp = my_inputs(Problem(3, dist.get_world_size(), 8, 128, 2, max_tokens=4))
    buffer.get_dispatch_layout(inp["topk_idx"], 8)
    return kernel_backend(buffer), kernel_backend(buffer, "low_latency")


# The kernel variants: a num_worst_tokens dispatch's counts only the device has, so its round collects.
KERNEL_TRAFFIC_VARIANTS = {
    "plain": {},
    "fp8": dict(use_fp8=True),
    "expert_alignment": dict(expert_alignment=4),
    "num_worst_tokens": dict(num_worst_tokens=192, collect=True),  # 4 ranks of at most 48 tokens
    "num_worst_tokens_async": dict(num_worst_tokens=192, collect=True, stream_args=True),
    "num_worst_tokens_no_topk": dict(num_worst_tokens=192, collect=True, with_topk=False),
    "async": dict(stream_args=True, collect=True),
}


@pytest.mark.gpu
@kernels_only
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("variant", list(KERNEL_TRAFFIC_VARIANTS))
@pytest.mark.parametrize("arena", [False, None])
def test_stats_count_tokens_per_expert_and_bytes_per_peer_on_the_kernels(gpu_pools, seed, num_ranks, variant,
                                                                         arena):
    """As on the portable backend, on the two-pass kernels and on a Buffer's own arena (one pass where it
    has room)."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=48)
    kwargs = KERNEL_TRAFFIC_VARIANTS[variant]
    results = gpu_pools(num_ranks).run(traffic_round, p, arena=arena, **kwargs)
    if variant != "num_worst_tokens_no_topk":
        _check_variant(p, results, kwargs)
        return
    # Without topk_idx nothing a num_worst_tokens dispatch on the kernels receives tells its experts.
    inputs = make_inputs(p)
    rows = routed_rows(p, inputs)
    for rank, res in enumerate(results):
        after = res["after_round"]
        sent, received = traffic(rows, rank, p.hidden * 2 * 3, p.hidden * 2)
        assert after["sent_bytes"].tolist() == sent and after["recv_bytes"].tolist() == received
        assert after["uncounted_calls"] == 3 and after["expert_tokens_last"] is None  # the dispatches


@pytest.mark.gpu
@kernels_only
def test_device_side_counts_are_left_out_unless_collecting_on_the_kernels(gpu_pools, seed):
    """A num_worst_tokens round on the kernels before reset_stats(): its counts are left out, and stats()
    says so; after reset_stats() the device counts them."""
    p = Problem(seed, 2, 8, 256, 4, max_tokens=48)
    rows = routed_rows(p, make_inputs(p))
    for rank, res in enumerate(gpu_pools(2).run(traffic_round, p, num_worst_tokens=96)):
        after = res["after_round"]
        assert after["collecting"] is False and after["uncounted_calls"] == 4  # dispatch, 2 cached, combine
        assert after["expert_tokens_last"] is None and not after["sent_bytes"].any()
        assert after["expert_tokens"].tolist() == []
        combine = res["after_combine"]
        assert combine["collecting"] is True and combine["uncounted_calls"] == 0
        sent, received = traffic(rows, rank, 0, p.hidden * 2 + p.num_topk * 4)
        assert combine["sent_bytes"].tolist() == sent and combine["recv_bytes"].tolist() == received


@pytest.mark.gpu
@kernels_only
@pytest.mark.parametrize("use_fp8", [False, True])
def test_stats_count_low_latency_tokens_and_bytes_on_the_kernels(gpu_pools, seed, use_fp8):
    p = Problem(seed, 4, 12, 256, 3, max_tokens=16)
    results = gpu_pools(4).run(low_latency_traffic, p, use_fp8, rounds=2, collect=True)
    check_low_latency_traffic(p, results, use_fp8, rounds=2)
    # Not collecting: the kernels' counts are left out, and stats() says so.
    for res in gpu_pools(4).run(low_latency_traffic, p, use_fp8, rounds=1):
        after = res["after_rounds"]
        assert after["collecting"] is False and after["uncounted_calls"] == 2
        assert after["expert_tokens_last"] is None and not after["recv_bytes"].any()
