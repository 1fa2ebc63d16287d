"""moe_ep's options for the megatron dispatcher, carried from the model's config (or Megatron-LM's
command line) to the dispatcher; never through environment variables.

Each option is a `moe_ep_*` attribute a TransformerConfig may carry (set it on the config before the
model is built); where the config has none, the value `set_defaults` (which `apply_arguments` calls
for Megatron-LM's `--moe-ep-*` flags) gave, else the field's default here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..checks import check_num_sms
from ..sync import check_timeout


@dataclass
class DispatcherOptions:
    # The one-pass intranode path: every dispatch stores its rows once into a region of the Buffer's
    # arena and the local unpermute writes into the arena, so the combine reads the rows where they lie.
    # Costs a mapped arena (the Buffer's own sizing, grown to four calls' rows); off: two passes, no arena.
    moe_ep_arena: bool = True
    # SMs the normal kernels may use (even); None: moe_ep's tuned value.
    moe_ep_num_sms: Optional[int] = None
    # Seconds to wait for a peer before TimeoutError; None: MOE_EP_TIMEOUT_S, else 100.
    moe_ep_timeout_s: Optional[float] = None
    # FP8 dispatch: tokens cast once to 1x128 e4m3 (transformer-engine's blockwise quantizer, bit for bit)
    # and sent with their scales, half the bytes of bf16; the gradients travel in bf16. "auto": on where the
    # config trains with transformer-engine's blockwise recipe (fp8 set, fp8_recipe="blockwise").
    moe_ep_fp8_dispatch: str = "auto"
    # Splits a layer's tokens into this many chunks and pipelines them, forward and backward: chunk i's
    # experts compute while its neighbours' dispatch and combine are under way. 1: one exchange a layer.
    moe_ep_overlap_chunks: int = 1
    # Per layer, the tokens each expert received and the communication time exposed and hidden, written
    # into megatron-core's MoE logging tracker (moe_ep.megatron.metrics); off: no event, no extra work.
    moe_ep_log_metrics: bool = False


FP8_DISPATCH_CHOICES = ("auto", "on", "off")

_defaults = DispatcherOptions()
# megatron-core's own name for the SM budget of its DeepEP path, honoured as well.
_MEGATRON_NUM_SMS = "moe_deepep_num_sms"


def set_defaults(**fields) -> None:
    """Process-wide values for configs that carry no `moe_ep_*` attribute of their own."""
    global _defaults
    _defaults = dataclasses.replace(_defaults, **fields)


def options_for(config) -> DispatcherOptions:
    """The options a dispatcher built from `config` runs with."""
    values = {}
    for f in dataclasses.fields(DispatcherOptions):
        values[f.name] = getattr(config, f.name, getattr(_defaults, f.name))
    num_sms_name = "moe_ep_num_sms"
    if values["moe_ep_num_sms"] is None:
        values["moe_ep_num_sms"] = getattr(config, _MEGATRON_NUM_SMS, None)
        num_sms_name = _MEGATRON_NUM_SMS
    for name in ("moe_ep_arena", "moe_ep_log_metrics"):
        if not isinstance(values[name], bool):
            raise TypeError(f"{name}: expected a bool, got {type(values[name]).__name__}")
    if values["moe_ep_fp8_dispatch"] not in FP8_DISPATCH_CHOICES:
        raise ValueError(
            f"moe_ep_fp8_dispatch: expected one of {FP8_DISPATCH_CHOICES}, got {values['moe_ep_fp8_dispatch']!r}"
        )
    _check_overlap_chunks(values["moe_ep_overlap_chunks"])
    # Checked here under the names the config uses (the Buffer would name its own arguments, later).
    if values["moe_ep_num_sms"] is not None:
        check_num_sms(num_sms_name, values["moe_ep_num_sms"])
    if values["moe_ep_timeout_s"] is not None:
        check_timeout("moe_ep_timeout_s", values["moe_ep_timeout_s"])
    if values["moe_ep_overlap_chunks"] > 1 and getattr(config, "overlap_moe_expert_parallel_comm", False):
        # Both hide the exchanges behind compute, each by running the phases in its own order.
        raise ValueError(f"moe_ep_overlap_chunks: expected 1 with overlap_moe_expert_parallel_comm (megatron's "
                         f"micro-batch overlap hides the dispatch and combine already), got "
                         f"{values['moe_ep_overlap_chunks']}")
    return DispatcherOptions(**values)


def _check_overlap_chunks(chunks) -> None:
    # bool is an int to Python, but True would silently mean one chunk.
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"moe_ep_overlap_chunks: expected an int >= 1, got {chunks!r}")


def _fp8_recipe(config) -> Optional[str]:
    """The config's fp8 recipe by name ("blockwise", "delayed", ...), None where it does not train in fp8."""
    if not getattr(config, "fp8", None):
        return None
    recipe = getattr(config, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe))


def fp8_dispatch_wanted(options: DispatcherOptions, config) -> bool:
    """Whether moe_ep_fp8_dispatch asks for fp8 tokens with this config ("auto": TE's blockwise recipe)."""
    if options.moe_ep_fp8_dispatch != "auto":
        return options.moe_ep_fp8_dispatch == "on"
    return _fp8_recipe(config) == "blockwise"


def check_fp8_dispatch_recipe(options: DispatcherOptions, config) -> None:
    """moe_ep_fp8_dispatch='on' sends TE's 1x128 blockwise fp8: under another fp8 recipe the experts would
    cast those rows again in their own format, a second rounding no recipe asked for."""
    recipe = _fp8_recipe(config)
    if options.moe_ep_fp8_dispatch == "on" and recipe not in (None, "blockwise"):
        raise ValueError(
            f"moe_ep_fp8_dispatch='on': the config trains with fp8_recipe={recipe!r}, whose experts quantise their "
            "input in another format than the 1x128 blockwise fp8 the dispatch sends (fp8_recipe='blockwise'); "
            "use 'auto' (fp8 dispatch under the blockwise recipe) or 'off'")
