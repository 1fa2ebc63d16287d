"""Run code written for `deep_ep` on moe_ep unchanged, e.g. megatron's `flex` dispatcher with
`moe_flex_dispatcher_backend="deepep"`: `install_as_deep_ep()` before megatron imports deep_ep."""

from __future__ import annotations

import importlib
import sys
import types

import torch

from ..events import EventOverlap, capture_current_stream


class EventHandle:
    """deep_ep.utils.EventHandle: an event on the current stream (nothing to wait for on CPU)."""

    def __init__(self):
        self.event = capture_current_stream().event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class _DeepEPEventOverlap(EventOverlap):
    """Accepts deep_ep's EventHandle as well as a torch.cuda.Event."""

    def __init__(self, event=None, extra_tensors=None):
        super().__init__(event.event if isinstance(event, EventHandle) else event, extra_tensors)


def install_as_deep_ep() -> types.ModuleType:
    """Registers moe_ep under the module names `deep_ep` and `deep_ep.utils`. megatron-core imports
    deep_ep when its MoE modules load and defines the flex dispatcher's fused_dispatch/fused_combine only
    if that import worked, so modules already loaded are reloaded and rebound here."""
    import moe_ep

    utils = types.ModuleType("deep_ep.utils")
    utils.EventHandle = EventHandle
    utils.EventOverlap = _DeepEPEventOverlap
    package = types.ModuleType("deep_ep")
    package.__path__ = []
    for name in ("Buffer", "Config", "topk_idx_t", "__version__"):
        setattr(package, name, getattr(moe_ep, name))
    package.EventOverlap = _DeepEPEventOverlap
    package.utils = utils
    sys.modules["deep_ep"], sys.modules["deep_ep.utils"] = package, utils
    fused = sys.modules.get("megatron.core.transformer.moe.fused_a2a")
    if fused is not None:
        fused = importlib.reload(fused)
        dispatcher_module = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
        if dispatcher_module is not None:
            for name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
                setattr(dispatcher_module, name, getattr(fused, name))
    return package
