"""Rank functions for megatron-core's micro-batch overlap (overlap_moe_expert_parallel_comm): a small bf16
GPT-MoE trained a few steps through megatron's combined 1F1B schedule, and the same model trained with one
forward and backward a micro-batch, the schedule megatron runs with the overlap off."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from moe_ep.bench.microbatch_overlap import combined_schedule, one_by_one
from moe_ep.megatron.cpu_support import enable_cpu_execution

from .late_delivery import LateDelivery

VOCAB, SEQ, MICRO_BATCH = 64, 16, 2


def _batch(seed: int, step: int, microbatch: int, device):
    """Token sequences of a learnable rule (next = 3 * token + 1 mod vocab), different per rank."""
    g = torch.Generator().manual_seed(seed * 7919 + step * 101 + microbatch * 13 + dist.get_rank())
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=g)
    tokens = [start]
    for _ in range(SEQ):
        tokens.append((tokens[-1] * 3 + 1) % VOCAB)
    seq = torch.cat(tokens, dim=1).to(device)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(MICRO_BATCH, -1)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)
    return dict(input_ids=seq[:, :-1], position_ids=position_ids, attention_mask=causal, labels=seq[:, 1:])


def _build_model(dispatcher_type: str, overlap: bool, delay_wgrad: bool, num_layers: int, num_experts: int,
                 topk: int, hidden: int, use_te: bool, moe_ep_options: dict, device):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                            get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    extra = dict(moe_flex_dispatcher_backend="deepep") if dispatcher_type == "flex" else {}
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=2 * hidden, num_attention_heads=4,
        num_moe_experts=num_experts, moe_router_topk=topk, moe_token_dispatcher_type=dispatcher_type,
        expert_model_parallel_size=dist.get_world_size(), use_cpu_initialization=device.type == "cpu",
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=delay_wgrad,
        **extra)
    for name, value in moe_ep_options.items():  # moe_ep's options are config attributes (moe_ep.megatron.options)
        setattr(config, name, value)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ).to(device)
    return Float16Module(config, model)


def _losses(schedule, model, batches) -> list:
    """The micro-batches' losses of one step through `schedule` (the benchmark's: megatron's two schedules)."""
    return [logged["lm loss"] for logged in schedule(model, batches)]


def _average_dense_gradients(model) -> None:
    """Data-parallel all-reduce of the non-expert gradients (the experts' are sharded across the ranks)."""
    for param in model.parameters():
        if param.grad is not None and getattr(param, "allreduce", True):
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def train_gpt(seed: int, dispatcher_type: str, overlap: bool, delay_wgrad: bool = False, steps: int = 2,
              num_microbatches: int = 3, num_layers: int = 1, num_experts: int = 4, topk: int = 2,
              hidden: int = 32, use_te: bool = False, moe_ep_options: dict = None, late_delivery: bool = False,
              cuda: bool = False):
    """`steps` SGD steps of `num_microbatches` micro-batches each; per step the micro-batches' losses
    and every parameter's gradient (bf16 parameters, as the overlap requires), returned on the CPU.
    use_te: transformer-engine's layers (delay_wgrad_compute needs their split weight gradients).
    late_delivery: asynchronous Buffer calls deliver their rows only when waited for (late_delivery.py)."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        enable_cpu_execution(force=True)
    if dispatcher_type == "flex":
        from moe_ep.megatron import install_as_deep_ep
        install_as_deep_ep()
    model = _build_model(dispatcher_type, overlap, delay_wgrad, num_layers, num_experts, topk, hidden,
                                 use_te, moe_ep_options or {}, device)
    run = functools.partial(_losses, combined_schedule if overlap else one_by_one)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    for step in range(steps):
        batches = [_batch(seed, step, i, device) for i in range(num_microbatches)]
        optimizer.zero_grad(set_to_none=True)
        with LateDelivery() if late_delivery else contextlib.nullcontext():
            losses = run(model, batches)
        _average_dense_gradients(model)
        grads = {name: p.grad.detach().float().cpu() for name, p in model.named_parameters() if p.grad is not None}
        history.append(dict(losses=[loss.float().cpu() for loss in losses], grads=grads))
        optimizer.step()
    return history
