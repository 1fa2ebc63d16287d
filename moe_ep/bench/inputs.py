"""The rows the benchmarks move: each rank's random inputs, drawn from a seed of its own so that moe_ep and
every peer measured beside it route the same tokens to the same experts, and the bytes a row counts."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_ep import fp8

INTRANODE_SEED = 1000
LOW_LATENCY_SEED = 2000


def row_bytes(mode: str, hidden: int) -> float:
    """The bytes an intranode row of `mode` counts: a fp8 row its values and its 1x128 block scales, a bf16
    row (dispatched or combined) hidden * 2."""
    return hidden * (1 + 4 / 128) if mode.startswith("dispatch_fp8") else hidden * 2


def low_latency_selection_bytes(hidden: int) -> dict:
    """The bytes a (token, expert) selection counts in a low-latency call (DeepEP's metric): a fp8 row with
    its scales and 16 bytes of routing to dispatch, a bf16 row to combine."""
    return dict(dispatch=hidden + hidden // 128 * 4 + 16, combine=hidden * 2)


def intranode_inputs(args, device: str):
    """This rank's tokens for the intranode calls: (x bf16, x as fp8 with scales, top-k ids, top-k weights)."""
    torch.manual_seed(INTRANODE_SEED + dist.get_rank())
    scores = torch.rand(args.tokens, args.experts, dtype=torch.float32, device=device)
    topk_idx = scores.topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    return x, fp8.per_token_cast_to_fp8(x), topk_idx, topk_weights


def low_latency_inputs(args, num_experts: int, seed: int, device: str):
    """This rank's tokens for the low-latency calls: (x, top-k ids, top-k weights) and the experts' outputs
    for the combine (y, [local experts, ranks x tokens, hidden])."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    topk_idx = torch.rand(args.tokens, num_experts, dtype=torch.float32, device=device).topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    local, rows = num_experts // num_ranks, num_ranks * args.tokens
    y = torch.randn(local, rows, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    return x, topk_idx, topk_weights, y


def selections_per_rank(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> list:
    """How many of this rank's (token, expert) selections go to each rank (experts in contiguous blocks)."""
    chosen = topk_idx[topk_idx >= 0] // (num_experts // num_ranks)
    return torch.bincount(chosen.flatten().cpu(), minlength=num_ranks).tolist()
