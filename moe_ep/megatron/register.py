"""Make `moe_token_dispatcher_type="deepep"` build a MoELayer with moe_ep's dispatcher, without forking
megatron: MoELayer picks its dispatcher with a fixed if/elif, so its constructor is wrapped once."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import inspect
import weakref

from .microbatch_overlap import check_microbatch_overlap_supported, keep_the_inputs_deepep_needs
from .options import DispatcherOptions, set_defaults

DISPATCHER_TYPE = "deepep"
# The cheapest built-in dispatcher to construct (no streams, no buffers); replaced right after.
_PLACEHOLDER_TYPE = "allgather"
# The dispatcher type whose checks a "deepep" config passes under overlap_moe_expert_parallel_comm, and the
# options megatron accepts only with that overlap on.
_OVERLAP_CHECKED_AS = "alltoall"
_MICROBATCH_OVERLAP_OPTIONS = ["overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
                               "ep_overlap_early_attn_memory_release"]


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
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        if self.token_dispatcher.metrics is not None:  # its entries go to this layer's number
            self.token_dispatcher.metrics.layer = weakref.ref(self)

    __init__._moe_ep_wrapped = True
    moe_layer.MoELayer.__init__ = __init__
    _run_experts_in_chunks(moe_layer.MoELayer)
    _accept_deepep_in_config_checks()
    keep_the_inputs_deepep_needs()
    _publish_metrics_when_megatron_logs()
    _bind_the_routers_missing_te_gemm()


def _bind_the_routers_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router reads moe_utils.te_general_gemm, which is bound only where
    transformer-engine imports: without it every router with moe_router_dtype set raises NameError, on CPU
    and CUDA alike, whatever the dispatcher. None is what its own check expects for "no TE GEMM"."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _run_experts_in_chunks(layer_class) -> None:
    """moe_ep_overlap_chunks: MoELayer calls its experts once between the dispatcher's phases; a chunked
    dispatcher calls them once a chunk, between that chunk's dispatch and combine, so its
    routed_experts_compute hands the experts to the dispatcher (the other phases stay megatron's)."""
    original = layer_class.routed_experts_compute
    if getattr(original, "_moe_ep_wrapped", False):
        return

    @functools.wraps(original)
    def routed_experts_compute(self, hidden_states, probs):
        from .dispatcher import MoEEPTokenDispatcher

        dispatcher = self.token_dispatcher
        if not isinstance(dispatcher, MoEEPTokenDispatcher) or not dispatcher.runs_in_chunks:
            return original(self, hidden_states, probs)
        return dispatcher.experts_in_chunks(self.experts), None

    routed_experts_compute._moe_ep_wrapped = True
    layer_class.routed_experts_compute = routed_experts_compute


def _publish_metrics_when_megatron_logs() -> None:
    """moe_ep_log_metrics: the dispatchers' metrics go into megatron's MoE tracker (metrics.py) when megatron
    logs it. From megatron-core 0.17 its MoEMetricsTracker.report syncs and writes the entries it is asked
    for; the wrapped report publishes ours first and adds their names to those asked for. Before, its
    tracker is reduced across ranks before every entry is written; the wrapped reduction publishes ours
    first and leaves them out of megatron's own reduction, which would sum them over the pipeline ranks
    again."""
    from . import metrics

    try:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    except ImportError:
        MoEMetricsTracker = None
    if MoEMetricsTracker is not None:
        original = MoEMetricsTracker.report
        if getattr(original, "_moe_ep_wrapped", False):
            return
        signature = inspect.signature(original)

        @functools.wraps(original)
        def report(self, *args, **kwargs):
            call = signature.bind(self, *args, **kwargs)
            names = metrics.publish(call.arguments.get("pg_collection"))
            asked = call.arguments.get("track_names")
            if asked is not None and names:
                call.arguments["track_names"] = ([asked] if isinstance(asked, str) else list(asked)) + names
            return original(*call.args, **call.kwargs)

        report._moe_ep_wrapped = True
        MoEMetricsTracker.report = report
        return

    from megatron.core.transformer.moe import moe_utils

    original = getattr(moe_utils, "reduce_aux_losses_tracker_across_ranks", None)
    if original is None or getattr(original, "_moe_ep_wrapped", False):
        return  # a megatron-core without it: metrics.check_megatron_publishes refuses the option

    @functools.wraps(original)
    def reduce_aux_losses_tracker_across_ranks(track_names=None, pg_collection=None):
        if track_names is None:
            track_names = [name for name in moe_utils.get_moe_layer_wise_logging_tracker() if not metrics.is_metric(name)]
        metrics.publish(pg_collection)
        return original(track_names, pg_collection=pg_collection)

    reduce_aux_losses_tracker_across_ranks._moe_ep_wrapped = True
    moe_utils.reduce_aux_losses_tracker_across_ranks = reduce_aux_losses_tracker_across_ranks


def _accept_deepep_in_config_checks() -> None:
    """TransformerConfig refuses two of megatron's overlaps for our dispatcher type; its check is wrapped,
    not forked, and every other check still sees "deepep".
    overlap_moe_expert_parallel_comm (alltoall and flex only): megatron's combined 1F1B schedule drives
    ours through the same six phases as alltoall, so a copy of the config is checked as an alltoall one
    (megatron's refusals under the overlap, moe_shared_expert_overlap included), then the config itself
    with the overlap and the options that require it off, which are then put back.
    moe_shared_expert_overlap (alltoall only; ours runs the shared experts' stages too): checked with the
    flag off, then the flag is put back and the one other refusal that reads it (recomputing the shared
    experts) is applied."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__
    if getattr(original, "_moe_ep_wrapped", False):
        return

    @functools.wraps(original)
    def __post_init__(self):
        if self.moe_token_dispatcher_type != DISPATCHER_TYPE:
            return original(self)
        off = ["moe_shared_expert_overlap"]
        if getattr(self, "overlap_moe_expert_parallel_comm", False):
            check_microbatch_overlap_supported()
            as_alltoall = copy.copy(self)
            as_alltoall.moe_token_dispatcher_type = _OVERLAP_CHECKED_AS
            original(as_alltoall)
            off += _MICROBATCH_OVERLAP_OPTIONS
        saved = {name: getattr(self, name) for name in off if getattr(self, name, False)}
        for name in saved:
            setattr(self, name, False)
        try:
            original(self)
        finally:
            for name, value in saved.items():
                setattr(self, name, value)
        selective = getattr(self, "recompute_granularity", None) == "selective"
        recompute = getattr(self, "recompute_modules", None) or ()
        shared = self.moe_shared_expert_intermediate_size is not None
        if saved.get("moe_shared_expert_overlap") and selective and shared and "shared_experts" in recompute:
            raise ValueError("shared_experts recompute cannot work with --moe-shared-expert-overlap.")

    __post_init__._moe_ep_wrapped = True
    TransformerConfig.__post_init__ = __post_init__


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
        "--moe-ep-arena",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one-pass intranode calls through the Buffer's arena, which grows to what the calls need "
        "(default: on); --no-moe-ep-arena takes the two-pass calls and maps no arena",
    )
    group.add_argument(
        "--moe-ep-timeout-s",
        type=float,
        default=None,
        help="seconds to wait for a peer before raising TimeoutError (default: MOE_EP_TIMEOUT_S, else 100)",
    )
    group.add_argument(
        "--moe-ep-fp8-dispatch",
        choices=("auto", "on", "off"),
        default=None,
        help="send the tokens as 1x128 fp8 with their scales (half the bytes; gradients stay bf16); "
        "auto (default): on when training with --fp8-recipe blockwise",
    )
    group.add_argument(
        "--moe-ep-overlap-chunks",
        type=int,
        default=None,
        help="split each MoE layer's tokens into this many chunks, one chunk's experts computing while the "
        "next chunk's dispatch and the previous chunk's combine are under way, in the forward and the "
        "backward (default: 1, no chunks)",
    )
    group.add_argument(
        "--moe-ep-log-metrics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log per MoE layer the tokens each expert received and the communication time exposed and "
        "hidden, with megatron's MoE metrics (moe_ep/* entries; per layer with --moe-per-layer-logging); "
        "default: off",
    )
    return parser


def apply_arguments(args) -> None:
    """Applies the `--moe-ep-*` options parsed with add_arguments to every dispatcher built afterwards
    (Megatron-LM copies only options named like TransformerConfig fields into the config, so they
    become the defaults of configs that carry no `moe_ep_*` attribute)."""
    fields = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(DispatcherOptions)}
    set_defaults(**{name: value for name, value in fields.items() if value is not None})
