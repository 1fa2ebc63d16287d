"""The form of each call, which every rank must make alike: what the arrival gate compares across ranks
before any data moves (moe_ep.sync.ArrivalGate.enter), for the portable backend's calls and, under
MOE_EP_DEBUG=1, for the kernels' (Buffer._meet_on_kernels).

A form lists what sizes the bytes that travel, or what the receiver makes of them: the dtypes, the hidden
size, the top-k that travels with the tokens, the number of experts, the low-latency flags, and the
dispatch a handle came from (its meeting number at the gate, the same on every rank). Each entry is a
(field, phrase) pair made from Python ints and strings at hand, with no device work; the phrase is what
a mismatch message says about a rank, e.g. "rank 1 called dispatch with fp8 x".
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..checks import FP8_DTYPE
from ..sync import Form
from .base import CombineCall, DispatchCall, LowLatencyCombineCall, LowLatencyDispatchCall

_DTYPE_WORDS = {torch.bfloat16: "bf16", torch.float32: "float32", FP8_DTYPE: "fp8"}


def dispatch_form(call: DispatchCall) -> Form:
    """A cached dispatch (handle given) names its handle; a fresh one the top-k and experts it sends."""
    x = call.x_parts[0]
    if call.handle is not None:
        return (("handle", _handle_phrase("dispatch", call.handle.gate_call)), _x_dtype(x), _hidden(x.shape[1]),
                ("num_worst_tokens", f"num_worst_tokens={call.handle.num_worst_tokens}"))
    top_k = "no top-k" if call.topk_idx is None else f"top-k {call.topk_idx.shape[1]}"
    return (("handle", "no handle"), _x_dtype(x), _hidden(x.shape[1]), ("top-k", top_k),
            ("experts", f"{call.num_tokens_per_expert.shape[0]} experts"),
            ("num_worst_tokens", f"num_worst_tokens={call.num_worst_tokens}"))


def combine_form(call: CombineCall) -> Form:
    weights = ("no topk_weights" if call.topk_weights is None
               else f"topk_weights of {call.topk_weights.shape[1]} columns")
    return (("handle", _handle_phrase("dispatch", call.handle.gate_call)), _x_dtype(call.x),
            _hidden(call.x.shape[1]), ("topk_weights", weights))


def low_latency_dispatch_form(call: LowLatencyDispatchCall) -> Form:
    return (_hidden(call.x.shape[1]), ("experts", f"{call.num_experts} experts"),
            _flag("num_max_dispatch_tokens_per_rank", call.num_max_tokens), _flag("use_fp8", call.use_fp8),
            _flag("round_scale", call.round_scale), _flag("use_ue8m0", call.use_ue8m0),
            _flag("return_recv_hook", call.return_recv_hook))


def low_latency_combine_form(call: LowLatencyCombineCall) -> Form:
    return (("handle", _handle_phrase("low_latency_dispatch", call.handle.gate_call)),
            _flag("return_recv_hook", call.return_recv_hook))


def _x_dtype(x: torch.Tensor) -> Tuple[str, str]:
    return "x dtype", f"{_DTYPE_WORDS.get(x.dtype, str(x.dtype))} x"


def _hidden(hidden: int) -> Tuple[str, str]:
    return "hidden", f"hidden {hidden}"


def _flag(name: str, value) -> Tuple[str, str]:
    return name, f"{name}={value}"


def _handle_phrase(dispatch: str, gate_call: Optional[int]) -> str:
    return f"the handle of the {dispatch} at call #{gate_call}"
