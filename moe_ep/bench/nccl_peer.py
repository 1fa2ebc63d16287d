"""The NCCL peer, run on every rank of a group that is NCCL: torch.distributed.all_to_all_single moving,
per rank pair, the bytes moe_ep's call moves between them, already grouped by destination (the
collective alone: a layout exchange and the permutation into that order are not timed, which favours it).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from .timing import wall_seconds_per_call


def exchanged_counts(send_counts: List[int], device) -> List[int]:
    """What each rank sends this one, from what this one sends each rank (a collective)."""
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.tolist()


def all_to_all_seconds(send_bytes: List[int], warmup: int, iters: int, device) -> Tuple[float, int, int]:
    """Wall seconds per all_to_all_single that sends send_bytes[r] bytes to rank r (all ranks at once)
    -> (seconds, bytes sent, bytes received)."""
    recv_bytes = exchanged_counts(send_bytes, device)
    send = torch.ones(sum(send_bytes), dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=device)
    seconds = wall_seconds_per_call(lambda: dist.all_to_all_single(recv, send, recv_bytes, send_bytes), warmup, iters)
    return seconds, sum(send_bytes), sum(recv_bytes)


def rows_per_pair_seconds(rows_to: List[int], row_bytes: int, reverse: bool, warmup: int, iters: int,
                          device) -> float:
    """Seconds per all-to-all of row_bytes-byte rows, rows_to[r] of them for rank r, or (reverse: a
    combine) the rows each rank sent this one, sent back."""
    rows = exchanged_counts(rows_to, device) if reverse else rows_to
    seconds, _, _ = all_to_all_seconds([n * row_bytes for n in rows], warmup, iters, device)
    return seconds
