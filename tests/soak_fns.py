"""Rank functions of the long GPU runs (test_soak.py): many random rounds on the kernels, each compared
bit for bit with the same round on the portable backend (the same inputs as CPU tensors, on the same
Buffer), CUDA-graph replays with new data every replay, and a rank killed in the middle of a call.

A soak draws each round from a set of CASES random problems (each with its own seed, top-k, share of -1
ids, skew, zero-token rank and call options), whose portable-backend results it computes once: a round on
the portable backend costs tens of milliseconds of store meetings and gloo collectives, so thousands of
them would take longer than the soak's kernel rounds by far. The rounds run the cases in a random order,
so every round's shapes and routing differ from the one before. A soak's Buffer and cases live in this
module between pool calls, so that thousands of rounds span many calls (each bounded by the pool's call
timeout) on one Buffer."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time

import torch
import torch.distributed as dist

from moe_ep import Buffer, fp8

from . import rank_fns
from .problems import Problem, expert_output, same_bits

_buffers = {}
_cases = {}
HIDDEN = 256
MAX_TOKENS = 48
CASES = 64


@contextlib.contextmanager
def _on_cpu():
    """rank_fns' inputs on the CPU, where the Buffer runs the portable backend."""
    with rank_fns.restored_environment(["MOE_EP_TEST_CUDA"]):
        os.environ["MOE_EP_TEST_CUDA"] = "0"
        yield


def _problem(seed: int, i: int, num_experts: int) -> Problem:
    """Case i's problem: its own seed, top-k, share of -1 ids, skew and zero-token rank."""
    rng = random.Random(seed * 1_000_003 + i)
    return Problem(seed * 1_000_003 + i, dist.get_world_size(), num_experts, HIDDEN, rng.choice([1, 2, 4, 8]),
                   max_tokens=rng.randint(1, MAX_TOKENS), drop=rng.choice([0.0, 0.2, 0.6]),
                   skew=rng.random() < 0.7, zero_token_rank=rng.random() < 0.5)


def _normal_variant(seed: int, i: int, num_ranks: int) -> dict:
    rng = random.Random(seed * 7_000_003 + i)
    return dict(use_fp8=rng.random() < 0.5, num_biases=rng.choice([0, 1, 2]),
                expert_alignment=rng.choice([1, 1, 16]),
                num_worst_tokens=rng.choice([0, 0, num_ranks * MAX_TOKENS]),
                stream_args=rng.random() < 0.3)


def _buffer(kind: str, ranks_per_node: int) -> Buffer:
    key = (kind, ranks_per_node)
    if key not in _buffers:
        if kind == "normal":
            _buffers[key] = rank_fns.internode_buffer(
                Problem(0, dist.get_world_size(), 8 * dist.get_world_size(), HIDDEN, 8, max_tokens=MAX_TOKENS),
                ranks_per_node) if ranks_per_node else rank_fns.normal_buffer(HIDDEN)
        else:
            _buffers[key] = rank_fns.low_latency_buffer(
                Problem(0, dist.get_world_size(), 4 * dist.get_world_size(), HIDDEN, 8, max_tokens=MAX_TOKENS))
    return _buffers[key]


def _memory() -> dict:
    if not torch.cuda.is_available():
        return dict(allocated=0, reserved=0)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    return dict(allocated=stats["allocated_bytes.all.current"], reserved=stats["reserved_bytes.all.current"])


def _case_order(seed: int, start: int, count: int):
    """The case of each round start .. start + count - 1: the same on every rank (they make the same calls)."""
    rng = random.Random(seed * 5_000_011 + start)
    return [(i, rng.randrange(CASES)) for i in range(start, start + count)]


def _soak(kind: str, seed: int, start: int, count: int, make_case, run, differences, ranks_per_node: int = 0):
    buffer = _buffer(kind, ranks_per_node)
    key = (kind, seed, ranks_per_node)
    if key not in _cases:  # each case's portable-backend result, computed once
        cases = []
        for c in range(CASES):
            p, variant = make_case(seed, c)
            with _on_cpu():
                cases.append((p, variant, run(p, buffer, variant)))
        _cases[key] = cases
    mismatches = []
    for i, c in _case_order(seed, start, count):
        p, variant, want = _cases[key][c]
        got = run(p, buffer, variant)
        mismatches += [f"round {i} (case {c}: {variant}, top-{p.num_topk}): {what}" for what in differences(got, want, variant)]
    return dict(mismatches=mismatches, **_memory())


def _normal_case(seed: int, c: int):
    return _problem(seed, c, 8 * dist.get_world_size()), _normal_variant(seed, c, dist.get_world_size())


def _normal_run(p, buffer, variant):
    return rank_fns.normal_round(p, buffer=buffer, **variant)


def _normal_differences(got, want, variant):
    return [field for field in rank_fns.ROUND_FIELDS if not same_bits(got[field], want[field])]


def normal_soak(seed: int, start: int, count: int, ranks_per_node: int = 0) -> dict:
    """Rounds start .. start + count - 1 of normal_round (layout, dispatch, cached dispatch, combine) on
    the kernels (the intranode ones; with ranks_per_node, the internode ones), each compared field by
    field with the portable backend's result. -> mismatches (described), and the allocator's bytes after
    them."""
    return _soak("normal", seed, start, count, _normal_case, _normal_run, _normal_differences, ranks_per_node)


def _low_latency_variant(seed: int, i: int) -> dict:
    rng = random.Random(seed * 9_000_011 + i)
    use_fp8 = rng.random() < 0.6
    round_scale = use_fp8 and rng.random() < 0.5
    return dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=round_scale and rng.random() < 0.5,
                return_recv_hook=rng.random() < 0.5, zero_copy=rng.random() < 0.3, use_out=rng.random() < 0.3)


def _low_latency_case(seed: int, c: int):
    p = _problem(seed, c, 4 * dist.get_world_size())
    # The buffer's shape (max tokens, hidden, experts) stays; the tokens a rank sends and the top-k change.
    p = Problem(p.seed, p.num_ranks, p.num_experts, HIDDEN, p.num_topk, max_tokens=MAX_TOKENS, drop=p.drop,
                skew=p.skew, zero_token_rank=p.zero_token_rank)
    return p, _low_latency_variant(seed, c)


def _low_latency_run(p, buffer, variant):
    return rank_fns.low_latency_round(p, buffer=buffer, **variant)


def _low_latency_differences(got: dict, want: dict, variant: dict):
    return rank_fns.low_latency_differences(got, want, variant["use_fp8"])


def low_latency_soak(seed: int, start: int, count: int) -> dict:
    """Rounds start .. start + count - 1 of low_latency_round (dispatch and combine, with and without
    hooks, fp8 flags, zero-copy, `out`) on the low-latency kernels, each compared with the portable
    backend's result."""
    return _soak("low_latency", seed, start, count, _low_latency_case, _low_latency_run, _low_latency_differences)


def drop_soak_buffers() -> None:
    """Destroys the soaks' Buffers where they must be (collective: NVSHMEM's heap is freed by every rank at
    once); the others go to the garbage collector."""
    for buffer in _buffers.values():
        if buffer.explicitly_destroy:
            buffer.destroy()
    _buffers.clear()
    _cases.clear()


def _fixed_shape_inputs(seed: int, j: int, num_tokens: int, num_experts: int, num_topk: int) -> dict:
    """This rank's inputs of case j, on the CPU: always num_tokens tokens (a graph's shapes are fixed), new
    rows and new routing (some ids -1) every case."""
    g = torch.Generator().manual_seed((seed * 131 + j) * 64 + dist.get_rank())
    scores = torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float32)
    idx = scores.topk(num_topk, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, torch.full_like(idx, -1), idx)
    return dict(x=(torch.randn(num_tokens, HIDDEN, generator=g, dtype=torch.float32) * 3).to(torch.bfloat16),
                topk_idx=idx, topk_weights=torch.rand(num_tokens, num_topk, generator=g))


def _graph_replays(seed: int, replays: int, step, inputs_of, warmups: int) -> dict:
    """step captured in one CUDA graph on case 0's inputs, then `replays` replays, each on a case's inputs
    (CASES of them, in a random order) copied into the captured ones and compared with step on that case
    as CPU tensors (the portable backend), computed once per case."""
    static = {k: v.to(rank_fns.device()) for k, v in inputs_of(0).items()}
    graph, outs = rank_fns.captured(step, static, warmups)
    cases = [inputs_of(c) for c in range(CASES)]
    wants = [step(inp) for inp in cases]
    mismatches, memory = [], []
    for j, c in _case_order(seed, 0, replays):
        for k in static:
            static[k].copy_(cases[c][k])
        graph.replay()
        got = rank_fns.cpu([t.clone() for t in outs])
        mismatches += [f"replay {j} (case {c}): output {n}" for n, (a, b) in enumerate(zip(got, wants[c]))
                       if not same_bits(a, b)]
        if j in (0, replays - 1):  # after the first replay (whose copies took a segment) and the last
            memory.append(_memory())
    return dict(mismatches=mismatches, before=memory[0], after=memory[-1])


def normal_graph_replays(seed: int, replays: int, use_fp8: bool) -> dict:
    """Layout, dispatch (num_worst_tokens: no host synchronisation) and combine captured in one CUDA graph
    and replayed on new tokens and routing every time, each replay equal to the portable backend."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts, num_topk = 8 * num_ranks, 4
    num_tokens = 0 if rank == num_ranks - 1 else 16 + 8 * rank  # one rank sends nothing
    worst = num_ranks * MAX_TOKENS
    buffer = rank_fns.normal_buffer(HIDDEN)

    def step(inp):
        x = fp8.per_token_cast_to_fp8(inp["x"]) if use_fp8 else inp["x"]
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"], num_worst_tokens=worst)
        rows = fp8.per_token_cast_back(*recv_x) if use_fp8 else recv_x
        combined, combined_w, _ = buffer.combine(expert_output(rows, rank), handle, topk_weights=recv_w)
        return [*(recv_x if use_fp8 else (recv_x,)), recv_idx, recv_w, combined, combined_w]

    return _graph_replays(seed, replays, step,
                          lambda c: _fixed_shape_inputs(seed, c, num_tokens, num_experts, num_topk), warmups=2)


def low_latency_graph_replays(seed: int, replays: int, use_fp8: bool) -> dict:
    """Low-latency dispatch and combine captured in one CUDA graph and replayed on new inputs every time,
    each replay equal to the portable backend."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts, num_topk = 4 * num_ranks, 4
    num_tokens = 0 if rank == num_ranks - 1 else MAX_TOKENS - 4 * rank
    buffer = rank_fns.low_latency_buffer(Problem(0, num_ranks, num_experts, HIDDEN, num_topk, max_tokens=MAX_TOKENS))

    def step(inp):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            inp["x"], inp["topk_idx"], MAX_TOKENS, num_experts, use_fp8=use_fp8)
        rows = fp8.per_token_cast_back(*recv_x) if use_fp8 else recv_x
        y = expert_output(rows.view(-1, HIDDEN), rank).view(rows.shape)
        combined, _, _ = buffer.low_latency_combine(y, inp["topk_idx"], inp["topk_weights"], handle)
        return [recv_count, combined]

    return _graph_replays(seed, replays, step,
                          lambda c: _fixed_shape_inputs(seed, c, num_tokens, num_experts, num_topk), warmups=1)


def killed_mid_call(kind: str, dead_rank: int, out_dir: str) -> str:
    """A round on every rank, then dead_rank is SIGKILLed in the middle of the next one: for "normal",
    as its peers wait in the dispatch for it; for "low_latency", after its dispatch sent its rows, so the
    peers' dispatch completes and their combine waits for it. Each survivor writes to out_dir what its
    calls raised and after how long (the pool loses the dead rank, and with it every result)."""
    rank = dist.get_rank()
    p = Problem(5, dist.get_world_size(), 4 * dist.get_world_size(), HIDDEN, 4, max_tokens=16,
                zero_token_rank=False)
    inp = rank_fns.my_inputs(p)
    if kind == "normal":
        buffer = rank_fns.normal_buffer(HIDDEN)
        rank_fns.normal_round(p, buffer=buffer)
    else:
        buffer = rank_fns.low_latency_buffer(p)
        rank_fns.low_latency_round(p, use_fp8=True, buffer=buffer)
    torch.cuda.synchronize()
    dist.barrier()
    started = time.monotonic()
    outcome = {"rank": rank, "timeout_s": buffer.timeout_s}
    try:
        if kind == "normal":
            if rank == dead_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            rank_fns.normal_round(p, buffer=buffer)
        else:
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens,
                                                                  p.num_experts, use_fp8=False)
            if rank == dead_rank:
                torch.cuda.synchronize()  # its rows are sent
                os.kill(os.getpid(), signal.SIGKILL)
            combined, _, _ = buffer.low_latency_combine(recv_x, inp["topk_idx"], inp["topk_weights"], handle)
            torch.cuda.synchronize()
            buffer.check_errors()
        outcome["raised"] = None
    except Exception as exc:  # noqa: BLE001
        outcome["raised"] = [type(exc).__name__, str(exc)]
    outcome["after_s"] = time.monotonic() - started
    try:  # a round on the Buffer afterwards
        if kind == "normal":
            rank_fns.normal_round(p, buffer=buffer)
        else:
            rank_fns.low_latency_round(p, use_fp8=True, buffer=buffer)
        outcome["later"] = None
    except Exception as exc:  # noqa: BLE001
        outcome["later"] = [type(exc).__name__, str(exc)]
    outcome["later_after_s"] = time.monotonic() - started - outcome["after_s"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    return "survived"
