"""Receive sizes the dispatcher knows without looking at the routing, under megatron's token capacity
(`moe_expert_capacity_factor` with `moe_pad_expert_input_to_capacity`).

megatron's router then routes at most `capacity` of a rank's tokens to each expert, and every rank of the
group passes the same number of tokens (megatron's alltoall dispatcher relies on both as well). So each
local expert receives at most `capacity` rows from each of the group's ranks, and each rank at most
`min(tokens, local experts x capacity)` of a rank's tokens: the dispatch runs with that bound as its
`num_worst_tokens` (no host synchronisation) and each local expert gets a block of a fixed number of rows,
its received rows first, then padding rows of probability 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.moe.moe_utils import get_capacity


@dataclass(frozen=True)
class FixedRows:
    """One dispatch's sizes under a capacity."""

    per_expert: int  # rows of each local expert's block, what the experts are told as tokens_per_expert
    received: int  # the dispatch's num_worst_tokens: the most rows it can receive (at least 1)


def capacity_padded(config) -> bool:
    """Whether the experts' inputs are padded to a capacity (megatron's drop-and-pad mode)."""
    return config.moe_expert_capacity_factor is not None and bool(config.moe_pad_expert_input_to_capacity)


def layer_capacity(config, num_tokens: int) -> int:
    """megatron's capacity of each expert for a rank's num_tokens tokens (as its router and alltoall
    dispatcher compute it)."""
    return get_capacity(num_tokens=num_tokens * config.moe_router_topk, num_experts=config.num_moe_experts,
                        capacity_factor=config.moe_expert_capacity_factor)


def fixed_rows(capacity: int, num_tokens: int, num_local_experts: int, num_ranks: int,
               alignment: int = 1) -> FixedRows:
    """Sizes of a dispatch of num_tokens tokens a rank (a layer's, or one chunk's of them) under `capacity`
    per expert and source rank; each expert's block rounded up to `alignment` rows (the fp8/fp4 GEMMs')."""
    per_source = min(capacity, num_tokens)  # a chunk holds fewer routes per expert than its tokens
    per_expert = -(-per_source * num_ranks // alignment) * alignment
    # Megatron's drop-and-pad permute takes each block from the received rows, so they are at least one block.
    received = max(num_ranks * min(num_tokens, num_local_experts * per_source), per_expert, 1)
    return FixedRows(per_expert, received)
