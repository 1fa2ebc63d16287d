"""megatron-core MoE layers built alike for every token dispatcher: the same config apart from the
dispatcher type, and the same seeds before the parameters are made, so that layers built with "deepep"
and with "alltoall" start with equal weights and can be compared output for output.

Every rank is one expert-parallel rank (EP = world size, TP = PP = 1), as in the tests and
`moe-ep-bench megatron_layer`. The experts are megatron's local ones or, with
transformer_impl="transformer_engine", transformer-engine's grouped ones (TEGroupedMLP).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

PARAMETER_SEED = 1234


def moe_layer_config(num_experts: int, topk: int, hidden: int, dispatcher_type: str, expert_parallel: int,
                     transformer_impl: str = "local", fp8_recipe: Optional[str] = None, **config_kw):
    """A one-layer TransformerConfig for an MoE layer of `num_experts` experts over `expert_parallel`
    ranks (parameters made on the CPU, fp32 router); transformer_impl: megatron's local experts or
    transformer-engine's grouped ones; fp8_recipe: e4m3 GEMMs under that TE recipe (megatron's fp8 and
    fp8_recipe); config_kw: any other TransformerConfig field. The "deepep" type is known here:
    importing this package registered it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if transformer_impl == "transformer_engine":
        config_kw.setdefault("moe_grouped_gemm", True)  # what --moe-grouped-gemm sets beside TE's grouped experts
    if fp8_recipe is not None:
        config_kw.update(fp8="e4m3", fp8_recipe=fp8_recipe)
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=num_experts,
                             moe_router_topk=topk, moe_token_dispatcher_type=dispatcher_type,
                             expert_model_parallel_size=expert_parallel, use_cpu_initialization=True,
                             moe_router_dtype="fp32", transformer_impl=transformer_impl, **config_kw)


def seeded_moe_layer(config, num_experts: int):
    """megatron's MoELayer for config (the experts config.transformer_impl names), its parameters made
    after the same seeds every time; megatron's model-parallel groups are set up (EP = world size) if needed."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    torch.manual_seed(PARAMETER_SEED)
    model_parallel_cuda_manual_seed(PARAMETER_SEED, inference_rng_tracker=True)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    use_te = config.transformer_impl == "transformer_engine"
    spec = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=use_te)
    # A ModuleSpec where megatron-core has one; newer versions may hand back the module's class itself.
    if not callable(spec) or hasattr(spec, "module"):
        return build_module(spec, config=config, pg_collection=pg)
    return spec(config=config, pg_collection=pg)
