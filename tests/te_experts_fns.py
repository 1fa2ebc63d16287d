"""Rank functions for megatron's transformer-engine grouped experts (TEGroupedMLP) behind each token
dispatcher, on CUDA ranks: one bf16 MoE layer's forward and backward, under TE's fp8 blockwise recipe or
not, with what the experts were handed and what they returned."""
from __future__ import annotations

import torch
import torch.distributed as dist

PARAMETER_SEED = 1234


def _te_moe_layer(dispatcher_type: str, fp8: bool, num_experts: int, topk: int, hidden: int, ffn_hidden: int,
                  moe_ep_options: dict):
    """megatron's MoELayer with TE's spec and grouped experts, made after the same seeds every time (so
    every dispatcher's layer has the same weights); EP = world size."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_ep.megatron  # noqa: F401  (registers "deepep")

    world = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    fields = dict(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn_hidden, num_attention_heads=4,
                  num_moe_experts=num_experts, moe_router_topk=topk, moe_token_dispatcher_type=dispatcher_type,
                  expert_model_parallel_size=world, moe_router_dtype="fp32", moe_grouped_gemm=True,
                  add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if fp8:
        fields.update(fp8="e4m3", fp8_recipe="blockwise")
    config = TransformerConfig(**fields)
    for name, value in moe_ep_options.items():  # moe_ep's options are config attributes
        setattr(config, name, value)
    torch.manual_seed(PARAMETER_SEED)
    model_parallel_cuda_manual_seed(PARAMETER_SEED, inference_rng_tracker=True)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    spec = get_moe_module_spec(use_te=True, num_experts=num_experts, moe_grouped_gemm=True)
    if not callable(spec) or hasattr(spec, "module"):  # a ModuleSpec (megatron-core 0.16), else a partial
        layer = build_module(spec, config=config, pg_collection=pg)
    else:
        layer = spec(config=config, pg_collection=pg)
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
