"""megatron-core's micro-batch overlap (overlap_moe_expert_parallel_comm) with moe_ep's dispatcher.

megatron's combined 1F1B schedule splits each transformer layer into nodes (attention with the router and
dispatch_preprocess; token_dispatch; dispatch_postprocess, experts and combine_preprocess; token_combine
and combine_postprocess), runs one micro-batch's nodes beside another's backward, and frees a node's
input tensors right after its forward (`untyped_storage().resize_(0)`) where its policy,
`should_free_input`, says the backward does not read them. That policy is megatron's guess per dispatcher
type; for "deepep" two of its frees are wrong, so the policy is wrapped here (register.py applies it)."""

from __future__ import annotations

import functools
import importlib
from typing import List

from .options import options_for

# The nodes whose inputs are the Buffer's received rows ("mlp") and the combine's input ("moe_combine").
_NODES_OF_BUFFER_ROWS = ("mlp", "moe_combine")
# Where megatron-core keeps the policy: models/common/utils.py from 0.17 on (its schedule nodes look it up
# there at construction), models/gpt/fine_grained_callables.py before.
_POLICY_MODULES = ("megatron.core.models.common.utils", "megatron.core.models.gpt.fine_grained_callables")
# The module of the combined 1F1B schedule, whose nodes free their inputs.
_SCHEDULE_MODULE = "megatron.core.pipeline_parallel.combined_1f1b"


def deepep_frees_input(name: str, is_moe: bool, config, original) -> bool:
    """Whether the node `name` of a "deepep" layer may free its input after its forward.
    moe_dispatch: its input tokens are a view of the pre-MLP layernorm's output, which the router's
    backward reads (megatron keeps them for flex's DeepEP backend as well); freed, that backward reads
    released memory (an illegal address on a GPU). mlp, moe_combine: with the arena on
    (options.moe_ep_arena) the received rows and the combine's input live in the Buffer's arena, memory
    that cannot be resized away and returns to the arena once the tensors over it die."""
    if name == "moe_dispatch":
        return False
    if name in _NODES_OF_BUFFER_ROWS and options_for(config).moe_ep_arena:
        return False
    return original()


def _wrap(original):
    from .register import DISPATCHER_TYPE

    @functools.wraps(original)
    def should_free_input(name, is_moe, config, *args, **kwargs):
        # megatron-core 0.17 and later pass the local experts' count after the config.
        ask_megatron = functools.partial(original, name, is_moe, config, *args, **kwargs)
        if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return ask_megatron()
        return deepep_frees_input(name, is_moe, config, ask_megatron)

    should_free_input._moe_ep_wrapped = True
    return should_free_input


def keep_the_inputs_deepep_needs() -> List[str]:
    """Idempotent. Wraps megatron's policy wherever this megatron-core defines it; returns the modules
    whose policy is wrapped (none: a megatron-core without the combined 1F1B schedule, or one that moved
    the policy, which check_microbatch_overlap_supported then refuses)."""
    wrapped = []
    for module_name in _POLICY_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, "should_free_input", None)
        if original is None:
            continue
        if not getattr(original, "_moe_ep_wrapped", False):
            module.should_free_input = _wrap(original)
        wrapped.append(module_name)
    return wrapped


def check_microbatch_overlap_supported() -> None:
    """Refuses overlap_moe_expert_parallel_comm with "deepep" on a megatron-core whose combined 1F1B
    schedule frees node inputs by a policy this module cannot find: it would free the router's input."""
    try:
        importlib.import_module(_SCHEDULE_MODULE)
    except ImportError:
        return  # no combined 1F1B schedule: megatron's own config check refuses the overlap
    if keep_the_inputs_deepep_needs():
        return
    from megatron.core import __version__

    raise ValueError(
        f"overlap_moe_expert_parallel_comm with moe_token_dispatcher_type='deepep': megatron-core {__version__} "
        f"has no should_free_input in {' or '.join(_POLICY_MODULES)}, so moe_ep cannot keep the inputs its "
        "dispatcher's backward reads (the schedule would free the router's input); turn the overlap off or use "
        "a megatron-core moe_ep supports (0.16 to 0.19)")
