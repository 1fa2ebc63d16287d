"""moe_ep for megatron-core: `moe_token_dispatcher_type="deepep"`, and deep_ep compatibility.

Importing this package registers the dispatcher type (see register.py)."""

from .compat import install_as_deep_ep
from .dispatcher import MoEEPTokenDispatcher, progress_reports, shared_buffers
from .options import DispatcherOptions
from .register import DISPATCHER_TYPE, add_arguments, apply_arguments, register

register()

__all__ = [
    "MoEEPTokenDispatcher",
    "progress_reports",
    "shared_buffers",
    "register",
    "add_arguments",
    "apply_arguments",
    "DispatcherOptions",
    "install_as_deep_ep",
    "DISPATCHER_TYPE",
]
