"""moe_ep: expert-parallel dispatch and combine for Mixture-of-Experts, call-compatible with deep_ep.Buffer."""

from . import fp8
from ._native import backend_info
from .buffer import Buffer, topk_idx_t
from .config import Config
from .events import EventOverlap

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "fp8", "backend_info", "__version__"]
