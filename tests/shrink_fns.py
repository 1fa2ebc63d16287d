"""Rank functions of tests/test_shrink.py: low-latency rounds on a Buffer(enable_shrink=True) while one rank
stops calling, comes late, or is masked by hand; each returns what the rounds received and combined, the
mask the rank saw, how long the calls took and what they raised or warned."""
from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from moe_ep import Buffer

from .rank_fns import outcome
from .problems import Problem, expert_output, make_inputs


def shrink_buffer(p: Problem, timeout_s: float, enable_shrink: bool = True) -> Buffer:
    size = Buffer.get_low_latency_rdma_size_hint(p.max_tokens, p.hidden, p.num_ranks, p.num_experts)
    return Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, enable_shrink=enable_shrink, timeout_s=timeout_s)


def mask_of(buffer: Buffer) -> list:
    status = torch.full((dist.get_world_size(),), -1, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    return status.tolist()


def timed_round(p: Problem, buffer: Buffer) -> dict:
    """A bf16 low-latency dispatch, the test's expert outputs and their combine, with the seconds it took
    and the warnings it gave."""
    inp = make_inputs(p)[dist.get_rank()]
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens,
                                                                      p.num_experts, use_fp8=False)
        y = expert_output(recv_x, dist.get_rank())
        combined, _, _ = buffer.low_latency_combine(y, inp["topk_idx"], inp["topk_weights"], handle)
    return dict(recv_x=recv_x, recv_count=recv_count, y=y, combined=combined,
                seconds=time.perf_counter() - start, warnings=[str(w.message) for w in caught])


def rank_stops_calling(p: Problem, dead_rank: int, timeout_s: float):
    """dead_rank makes the Buffer, then no call; the others run two rounds.
    -> None on dead_rank, else (first round, second round, the mask after them)."""
    buffer = shrink_buffer(p, timeout_s)
    if dist.get_rank() == dead_rank:
        return None
    first = timed_round(p, buffer)
    second = timed_round(p, buffer)
    return first, second, mask_of(buffer)


def rank_stops_calling_without_shrink(p: Problem, dead_rank: int, timeout_s: float):
    """As rank_stops_calling on a Buffer without shrink mode: -> None on dead_rank, else (what the first
    round raised, what a later call raised)."""
    buffer = shrink_buffer(p, timeout_s, enable_shrink=False)
    if dist.get_rank() == dead_rank:
        return None
    first = outcome(lambda: timed_round(p, buffer))
    later = outcome(lambda: timed_round(p, buffer))
    return first, later


def rank_comes_late(p: Problem, late_rank: int, timeout_s: float):
    """late_rank comes to a round after its peers masked it; then every rank cleans the mask and runs a
    round. -> (the late round, the mask after it, the round after the clean, the mask after that)."""
    buffer = shrink_buffer(p, timeout_s)
    if dist.get_rank() == late_rank:
        time.sleep(timeout_s * 1.5)
    late = timed_round(p, buffer)
    masked = mask_of(buffer)
    dist.barrier()  # every rank has finished the late round before anyone unmasks
    buffer.low_latency_clean_mask_buffer()
    after = timed_round(p, buffer)
    return late, masked, after, mask_of(buffer)


def mask_by_hand(p: Problem, masked_rank: int, timeout_s: float):
    """Every rank masks masked_rank and runs a round, unmasks it with update_mask_buffer and runs one, masks
    it again, cleans the mask and runs one. -> (mask, round) after each step."""
    buffer = shrink_buffer(p, timeout_s)
    steps = []
    for change in (lambda: buffer.low_latency_update_mask_buffer(masked_rank, mask=True),
                   lambda: buffer.low_latency_update_mask_buffer(masked_rank, mask=False),
                   lambda: buffer.low_latency_update_mask_buffer(masked_rank, mask=True)):
        change()
        mask = mask_of(buffer)
        steps.append((mask, timed_round(p, buffer)))
    buffer.low_latency_clean_mask_buffer()
    mask = mask_of(buffer)
    steps.append((mask, timed_round(p, buffer)))
    return steps


def rank_stops_after_dispatch(p: Problem, dead_rank: int, timeout_s: float):
    """Every rank dispatches; dead_rank then makes no combine. -> None on dead_rank, else (the round, the
    mask after it)."""
    buffer = shrink_buffer(p, timeout_s)
    inp = make_inputs(p)[dist.get_rank()]
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens,
                                                                  p.num_experts, use_fp8=False)
    if dist.get_rank() == dead_rank:
        return None
    y = expert_output(recv_x, dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        combined, _, _ = buffer.low_latency_combine(y, inp["topk_idx"], inp["topk_weights"], handle)
    return dict(recv_x=recv_x, recv_count=recv_count, y=y, combined=combined,
                warnings=[str(w.message) for w in caught]), mask_of(buffer)
