"""Rank functions for megatron's transformer-engine grouped experts (TEGroupedMLP) behind each token
dispatcher, on CUDA ranks: one bf16 MoE layer's forward and backward, under TE's fp8 blockwise recipe or
not, with what the experts were handed and what they returned."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _te_moe_layer(dispatcher_type: str, fp8: bool, num_experts: int, topk: int, hidden: int, ffn_hidden: int,
                  moe_ep_options: dict):
    """megatron's MoELayer with TE's grouped experts, bf16, built alike for every dispatcher (seeded_layer)."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from moe_ep.megatron.seeded_layer import moe_layer_config, seeded_moe_layer

    config = moe_layer_config(num_experts, topk, hidden, dispatcher_type, dist.get_world_size(),
                              transformer_impl="transformer_engine", fp8_recipe="blockwise" if fp8 else None,
                              ffn_hidden_size=ffn_hidden, add_bias_linear=False, bf16=True,
                              params_dtype=torch.bfloat16, moe_router_load_balancing_type="none",
                              moe_aux_loss_coeff=0.0)
    for name, value in moe_ep_options.items():  # moe_ep's options are config attributes
        setattr(config, name, value)
    layer = seeded_moe_layer(config, num_experts)
    assert isinstance(layer.experts, TEGroupedMLP), type(layer.experts)
    return config, layer.cuda()


def te_layer_round(seed: int, dispatcher_type: str, fp8: bool, num_tokens: int = 256, num_experts: int = 8,
                   topk: int = 2, hidden: int = 256, ffn_hidden: int = 512, moe_ep_options: dict = None) -> dict:
    """One forward and backward of the layer on this rank's tokens (seeded by `seed` and the rank), under
    megatron's fp8 context where fp8. Returns, on the CPU: the output, the input's and every parameter's
    gradient, the experts' input rows, counts and output rows (a forward hook on TEGroupedMLP), and the
    payload bytes moe_ep sent (0 for other dispatchers)."""
    from megatron.core.fp8_utils import get_fp8_context

    from moe_ep.megatron import shared_buffers

    config, layer = _te_moe_layer(dispatcher_type, fp8, num_experts, topk, hidden, ffn_hidden, moe_ep_options or {})
    seen = {}

    def keep(module, args, output):
        seen.update(rows=args[0].detach().float().cpu(), counts=[int(n) for n in args[1]],
                    out=output[0].detach().float().cpu())

    hook = layer.experts.register_forward_hook(keep)
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank() + 1)
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(num_tokens, 1, hidden, generator=g).to(device, torch.bfloat16).requires_grad_(True)
    upstream = torch.randn(num_tokens, 1, hidden, generator=g).to(device, torch.bfloat16)
    sent = lambda: sum(int(b.stats()["sent_bytes"].sum()) for b in shared_buffers())  # noqa: E731
    before = sent()
    with get_fp8_context(config):
        out, _ = layer(x)
    out.backward(upstream)
    torch.cuda.synchronize()
    hook.remove()
    grads = {name: p.grad.detach().float().cpu() for name, p in layer.named_parameters() if p.grad is not None}
    return dict(out=out.detach().float().cpu(), grad_x=x.grad.float().cpu(), grads=grads,
                expert_rows=seen["rows"], expert_counts=seen["counts"], expert_out=seen["out"],
                sent_bytes=sent() - before)
