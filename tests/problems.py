"""Random MoE routing problems and a dense single-process reference of every operation.

All ranks' inputs come from one seed, so each rank process can rebuild its own slice while the test
process rebuilds them all and computes what every rank must receive with plain Python loops, written
independently of the backends' vectorised code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from moe_ep import fp8


@dataclass(frozen=True)
class Problem:
    seed: int
    num_ranks: int
    num_experts: int
    hidden: int
    num_topk: int
    max_tokens: int = 24
    drop: float = 0.2          # probability that a top-k entry is -1
    skew: bool = True          # uneven expert popularity
    zero_token_rank: bool = True

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks


def problem_where(make: Callable[[int], Problem], seed: int, holds: Callable[[Problem], bool]) -> Problem:
    """make(s) for the first s of seed, seed + 1, ... whose problem holds a test's premise that a rare draw
    breaks (some rank has tokens, say): a fresh problem each run, the same one for a pinned seed."""
    for s in range(seed, seed + 1000):
        p = make(s)
        if holds(p):
            return p
    raise AssertionError(f"no problem from seed {seed} to {seed + 999} holds the test's premise")


def make_inputs(p: Problem) -> List[Dict[str, torch.Tensor]]:
    """Per rank: x [N, H] bf16, topk_idx [N, K] int64 with -1 entries, topk_weights [N, K] float32."""
    g = torch.Generator().manual_seed(p.seed)
    # Every tensor names its dtype and device: the inputs must not follow torch's defaults.
    cpu = dict(device="cpu")
    f32 = dict(dtype=torch.float32, device="cpu")
    counts = torch.randint(0, p.max_tokens + 1, (p.num_ranks,), generator=g, **cpu)
    if p.zero_token_rank:
        counts[torch.randint(0, p.num_ranks, (1,), generator=g, **cpu)] = 0
    popularity = (torch.exp(torch.randn(p.num_experts, generator=g, **f32) * 2) if p.skew
                  else torch.ones(p.num_experts, **f32))
    ranks = []
    for n in counts.tolist():
        if n:
            idx = torch.multinomial(popularity.expand(n, -1), p.num_topk, replacement=False, generator=g)
        else:
            idx = torch.empty(0, p.num_topk, dtype=torch.int64, **cpu)
        idx = torch.where(torch.rand(idx.shape, generator=g, **f32) < p.drop, torch.full_like(idx, -1), idx)
        ranks.append({
            "x": (torch.randn(n, p.hidden, generator=g, **f32) * 3).to(torch.bfloat16),
            "topk_idx": idx,
            "topk_weights": torch.rand(n, p.num_topk, generator=g, **f32),
        })
    return ranks


def bias_for(p: Problem, rank: int, n: int, which: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(p.seed * 7919 + rank * 31 + which)
    return torch.randn(n, p.hidden, generator=g, dtype=torch.float32, device="cpu").to(torch.bfloat16)


def expert_output(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """What the 'experts' of a rank return for its received rows in the tests: any fixed function
    (float32 rows stay float32, everything else becomes bf16)."""
    out_dtype = torch.float32 if recv_x.dtype == torch.float32 else torch.bfloat16
    return (recv_x.float() * (rank + 2) - 1.0).to(out_dtype)


# ------------------------------------------------------------------------ normal mode reference
def ref_dispatch(p: Problem, inputs, dst: int):
    """Rows rank dst receives: [(src, token)], recv_topk_idx, recv_topk_weights, per-expert counts."""
    lo, hi = dst * p.local_experts, (dst + 1) * p.local_experts
    sources, idx_rows, weight_rows = [], [], []
    per_expert = [0] * p.local_experts
    for src, inp in enumerate(inputs):
        for t in range(inp["x"].shape[0]):
            ids = inp["topk_idx"][t].tolist()
            if not any(lo <= e < hi for e in ids):
                continue
            sources.append((src, t))
            idx_rows.append([e - lo if lo <= e < hi else -1 for e in ids])
            weight_rows.append([w if lo <= e < hi else 0.0 for e, w in zip(ids, inp["topk_weights"][t].tolist())])
            for e in ids:
                if lo <= e < hi:
                    per_expert[e - lo] += 1
    return sources, idx_rows, weight_rows, per_expert


def ref_recv_x(inputs, sources, key="x") -> torch.Tensor:
    rows = [inputs[s][key][t] for s, t in sources]
    if rows:
        return torch.stack(rows)
    return torch.empty(0, *inputs[0][key].shape[1:], dtype=inputs[0][key].dtype)


def ref_combine(p: Problem, inputs, received_sources: List[List[Tuple[int, int]]],
                returned: List[torch.Tensor], src: int, biases: List[torch.Tensor],
                ranks_per_node: Optional[int] = None) -> torch.Tensor:
    """Combine on rank src: float32 bias0 + bias1 + rows from each destination rank in rank order. Across
    nodes (ranks_per_node < ranks): each node's rows summed from 0 in rank order and rounded to bf16,
    then bias0 + bias1 + those sums in node order."""
    per_node = p.num_ranks if ranks_per_node is None else ranks_per_node
    n = inputs[src]["x"].shape[0]
    out = torch.empty(n, p.hidden, dtype=torch.bfloat16)
    position = [{st: i for i, st in enumerate(srcs)} for srcs in received_sources]
    for t in range(n):
        acc = torch.zeros(p.hidden, dtype=torch.float32)
        for b in biases:
            acc = acc + b[t].float()
        for node in range(p.num_ranks // per_node):
            flat = per_node == p.num_ranks  # one node: every row straight into acc
            part, reached = (acc if flat else torch.zeros(p.hidden, dtype=torch.float32)), False
            for dst in range(node * per_node, (node + 1) * per_node):
                i = position[dst].get((src, t))
                if i is not None:
                    part, reached = part + returned[dst][i].float(), True
            if flat:
                acc = part
            elif reached:
                acc = acc + part.to(torch.bfloat16).float()
        out[t] = acc.to(torch.bfloat16)
    return out


# ------------------------------------------------------------------------ low-latency reference
def ref_low_latency_slots(p: Problem, inputs, dst: int) -> List[List[Tuple[int, int, int]]]:
    """For each local expert of dst: the (src, token, k) entries it receives, in row order."""
    slots = [[] for _ in range(p.local_experts)]
    for src, inp in enumerate(inputs):
        for t in range(inp["x"].shape[0]):
            for k, e in enumerate(inp["topk_idx"][t].tolist()):
                if e >= 0 and e // p.local_experts == dst:
                    slots[e % p.local_experts].append((src, t, k))
    return slots


def ref_low_latency_recv(p: Problem, inputs, dst: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool):
    slots = ref_low_latency_slots(p, inputs, dst)
    rows = p.num_ranks * p.max_tokens
    casts = [fp8.per_token_cast_to_fp8(inp["x"], round_scale=round_scale, use_ue8m0=use_ue8m0)
             if use_fp8 and inp["x"].shape[0] else None for inp in inputs]
    expected = []
    for j, entries in enumerate(slots):
        if use_fp8:
            vals = [casts[s][0][t] for s, t, _ in entries]
            scales = [casts[s][1][t] for s, t, _ in entries]
            expected.append((vals, scales))
        else:
            expected.append(([inputs[s]["x"][t] for s, t, _ in entries], None))
    return slots, expected, rows


def ref_low_latency_combine(p: Problem, inputs, src: int, slots_per_rank, outputs_per_rank,
                            topk_weights: torch.Tensor) -> torch.Tensor:
    """acc = 0; for k ascending with a valid expert: acc = acc + (w * row) in float32."""
    n = inputs[src]["x"].shape[0]
    where: Dict[Tuple[int, int], Tuple[int, int, int]] = {}
    for dst, slots in enumerate(slots_per_rank):
        for j, entries in enumerate(slots):
            for row, (s, t, k) in enumerate(entries):
                if s == src:
                    where[(t, k)] = (dst, j, row)
    out = torch.empty(n, p.hidden, dtype=torch.bfloat16)
    for t in range(n):
        acc = torch.zeros(p.hidden, dtype=torch.float32)
        for k, e in enumerate(inputs[src]["topk_idx"][t].tolist()):
            if e < 0:
                continue
            dst, j, row = where[(t, k)]
            acc = acc + topk_weights[t, k] * outputs_per_rank[dst][j, row].float()
        out[t] = acc.to(torch.bfloat16)
    return out


def maybe(value: Optional[torch.Tensor]):
    return None if value is None else value.clone()


def same_bits(a, b) -> bool:
    """Tensors (any dtype, fp8 too) with the same dtype, shape and bits; tuples and lists of them
    element by element; anything else by ==."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b

