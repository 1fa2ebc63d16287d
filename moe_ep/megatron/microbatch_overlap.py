"""megatron-core's micro-batch overlap (overlap_moe_expert_parallel_comm) with moe_ep's dispatcher.

megatron's combined 1F1B schedule splits each transformer layer into nodes (attention with the router and
dispatch_preprocess; token_dispatch; dispatch_postprocess, experts and combine_preprocess; token_combine
and combine_postprocess), runs one micro-batch's nodes beside another's backward, and frees a node's
input tensors right after its forward where it knows the backward does not read them. Two of those
frees do not hold for "deepep", so its choice is wrapped here (register.py applies it)."""

from __future__ import annotations

import functools

from .options import options_for

# The nodes whose inputs are the Buffer's received rows ("mlp") and the combine's input ("moe_combine").
_NODES_OF_BUFFER_ROWS = ("mlp", "moe_combine")


def keep_the_inputs_deepep_needs() -> None:
    """Idempotent. The dispatch node's input tokens are a view of the pre-MLP layernorm's output, which
    the router's backward reads (megatron keeps them for flex's DeepEP backend as well). The received
    rows and the combine's input live in the Buffer's arena where it is on (options.moe_ep_arena): memory
    that cannot be resized away, which returns to the arena once the tensors over it die; megatron's
    free would raise there, so those inputs live until the node's backward."""
    try:
        from megatron.core.models.gpt import fine_grained_callables
    except ImportError:  # a megatron-core without the combined 1F1B schedule
        return
    original = getattr(fine_grained_callables, "should_free_input", None)
    if original is None or getattr(original, "_moe_ep_wrapped", False):
        return
    from .register import DISPATCHER_TYPE

    @functools.wraps(original)
    def should_free_input(name, is_moe, config, *args, **kwargs):
        # Later megatron-cores pass more arguments (the local experts' count) after the config.
        if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return original(name, is_moe, config, *args, **kwargs)
        if name == "moe_dispatch":
            return False
        if name in _NODES_OF_BUFFER_ROWS and options_for(config).moe_ep_arena:
            return False
        return original(name, is_moe, config, *args, **kwargs)

    should_free_input._moe_ep_wrapped = True
    fine_grained_callables.should_free_input = should_free_input
