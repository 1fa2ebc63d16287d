"""Rank functions for the megatron-core integration tests (CPU, gloo)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .megatron_cpu import install_megatron_cpu_patches


def _setup(num_experts: int, topk: int, hidden: int, dispatcher_type: str, **config_kw):
    install_megatron_cpu_patches()
    import moe_ep.megatron  # noqa: F401  (registers the "deepep" type)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]
    pg = ProcessGroupCollection()
    pg.ep, pg.tp_ep, pg.expt_tp, pg.tp = dist.group.WORLD, dist.group.WORLD, singles[rank], singles[rank]
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=num_experts,
                               moe_router_topk=topk, moe_token_dispatcher_type=dispatcher_type,
                               expert_model_parallel_size=world, use_cpu_initialization=True,
                               moe_router_dtype="fp32", **config_kw)
    return config, pg


def _dispatcher(config, pg, num_experts):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from moe_ep.megatron import MoEEPTokenDispatcher
    world, rank = dist.get_world_size(), dist.get_rank()
    local = num_experts // world
    cls = MoEEPTokenDispatcher if config.moe_token_dispatcher_type == "deepep" else MoEAlltoAllTokenDispatcher
    return cls(local, [rank * local + i for i in range(local)], config=config, pg_collection=pg)


def moe_forward_backward(seed: int, num_experts: int, topk: int, hidden: int, dispatcher_type: str,
                         num_tokens: int):
    """Router -> dispatcher phases -> toy experts -> combine; returns output and gradients."""
    config, pg = _setup(num_experts, topk, hidden, dispatcher_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = num_experts // world
    dispatcher = _dispatcher(config, pg, num_experts)
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5
    g.manual_seed(seed * 31 + rank + 1)
    x = torch.randn(num_tokens, hidden, generator=g, requires_grad=True)
    logits = torch.randn(num_tokens, num_experts, generator=g, requires_grad=True)
    upstream = torch.randn(num_tokens, hidden, generator=g)
    scores = torch.softmax(logits, dim=-1)
    top_p, top_i = scores.topk(topk, dim=-1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, top_i, True)
    probs = torch.zeros(num_tokens, num_experts).scatter(1, top_i, top_p)

    h, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    h, tokens_per_expert, p = dispatcher.dispatch_postprocess(h, p)
    outs, start = [], 0
    for j, count in enumerate(tokens_per_expert.tolist()):
        rows = slice(start, start + count)
        outs.append((h[rows] @ weights[rank * local + j]) * p[rows].unsqueeze(1).to(h.dtype))
        start += count
    y = torch.cat(outs) if outs else h[:0]
    y = dispatcher.combine_preprocess(y)
    y = dispatcher.token_combine(y)
    out = dispatcher.combine_postprocess(y)
    (out * upstream).sum().backward()

    # The same layer, dense, on this rank alone.
    x_ref = x.detach().clone().requires_grad_(True)
    logits_ref = logits.detach().clone().requires_grad_(True)
    p_ref = torch.softmax(logits_ref, dim=-1)
    mask = routing_map.float()
    dense = torch.einsum("th,ehk,te->tk", x_ref, weights, p_ref * mask)
    (dense * upstream).sum().backward()
    return dict(out=out.detach(), grad_x=x.grad, grad_logits=logits.grad, ref_out=dense.detach(),
                ref_grad_x=x_ref.grad, ref_grad_logits=logits_ref.grad,
                tokens_per_expert=tokens_per_expert.tolist())
