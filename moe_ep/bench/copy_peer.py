"""The copy peer, run on every rank at once: a plain copy of the bytes moe_ep's call moves, within the
rank's own device memory. Where ranks share a GPU they share its memory bandwidth as moe_ep's ranks do, so
their copies together are the ceiling of any exchange of those bytes; a rank with a GPU of its own copies
at its memory's rate, which the links between GPUs stay below.
"""
from __future__ import annotations

import torch

from .timing import wall_seconds_per_call


def copy_seconds(num_bytes: int, warmup: int, iters: int, device) -> float:
    """Wall seconds per copy of num_bytes bytes into another buffer of this rank (all ranks at once)."""
    src = torch.ones(max(num_bytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return wall_seconds_per_call(lambda: dst.copy_(src), warmup, iters)
