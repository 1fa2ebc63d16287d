"""Make `moe_token_dispatcher_type="deepep"` build a MoELayer with moe_ep's dispatcher, without forking
megatron: MoELayer picks its dispatcher with a fixed if/elif, so its constructor is wrapped once."""

from __future__ import annotations

import functools
import os

from ..zero_copy_modes import ZERO_COPY_CHOICES, set_zero_copy

DISPATCHER_TYPE = "deepep"
# The cheapest built-in dispatcher to construct (no streams, no buffers); replaced right after.
_PLACEHOLDER_TYPE = "allgather"


def register() -> None:
    """Idempotent. Called on `import moe_ep.megatron`."""
    from megatron.core.transformer.moe import moe_layer

    original = moe_layer.MoELayer.__init__
    if getattr(original, "_moe_ep_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *args, **kwargs):
        if config.moe_token_dispatcher_type != DISPATCHER_TYPE:
            return original(self, config, submodules, layer_number, pg_collection, *args, **kwargs)
        from .dispatcher import MoEEPTokenDispatcher

        if pg_collection is None:
            pg_collection = moe_layer.get_default_pg_collection()
        config.moe_token_dispatcher_type = _PLACEHOLDER_TYPE
        try:
            original(self, config, submodules, layer_number, pg_collection, *args, **kwargs)
        finally:
            config.moe_token_dispatcher_type = DISPATCHER_TYPE
        self.token_dispatcher = MoEEPTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection
        )
        if self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)  # refuses, with the reason

    __init__._moe_ep_wrapped = True
    moe_layer.MoELayer.__init__ = __init__


def add_arguments(parser):
    """An `extra_args_provider` for Megatron-LM's argument parser: adds `deepep` to
    --moe-token-dispatcher-type and moe_ep's own options."""
    for action in parser._actions:
        if "--moe-token-dispatcher-type" in action.option_strings and action.choices is not None:
            if DISPATCHER_TYPE not in action.choices:
                action.choices = list(action.choices) + [DISPATCHER_TYPE]
    group = parser.add_argument_group("moe_ep (apply with moe_ep.megatron.apply_arguments(args))")
    group.add_argument(
        "--moe-ep-num-sms",
        type=int,
        default=None,
        help="SMs moe_ep's normal kernels may use (even); default: moe_ep's tuned value",
    )
    group.add_argument(
        "--moe-ep-zero-copy",
        choices=ZERO_COPY_CHOICES,
        default=None,
        help="one-pass intranode calls: the dispatches store rows straight into the receivers' zero-copy "
        "areas, the combines read the expert outputs where they lie (MOE_EP_ZERO_COPY_DISPATCH / _COMBINE; "
        "each costs a mapped area of two slots of every row a rank can receive); arena: both one pass into "
        "and from a dispatch arena whose outputs are ordinary tensors (MOE_EP_DISPATCH_ARENA; four calls' rows)",
    )
    group.add_argument(
        "--moe-ep-timeout-s",
        type=float,
        default=None,
        help="seconds to wait for a peer before raising TimeoutError (MOE_EP_TIMEOUT_S)",
    )
    return parser


def apply_arguments(args) -> None:
    """Applies the `--moe-ep-*` options parsed with add_arguments (Megatron-LM copies only options named
    like TransformerConfig fields into the config, so these are applied here)."""
    from ..buffer import Buffer

    if getattr(args, "moe_ep_num_sms", None):
        Buffer.set_num_sms(args.moe_ep_num_sms)
    if getattr(args, "moe_ep_timeout_s", None):
        os.environ["MOE_EP_TIMEOUT_S"] = str(args.moe_ep_timeout_s)
    if getattr(args, "moe_ep_zero_copy", None):
        set_zero_copy(args.moe_ep_zero_copy)

