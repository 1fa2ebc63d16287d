"""Loads the compiled extensions (`moe_ep._C`, and `moe_ep._internode` for the kernels across nodes) when
they were built, and says why when they were not."""

from __future__ import annotations

import functools
import importlib
import os
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def _load_module(name: str, what: str):
    """(moe_ep.<name>, None), or (None, why not) where setup.py did not build it."""
    try:
        return importlib.import_module(f"{__package__}.{name}"), None
    except ImportError as exc:
        return None, f"the {what} moe_ep.{name} is not built ({exc})"


def _load():
    return _load_module("_C", "CUDA extension")  # built by setup.py where CUDA is present


def _load_internode():
    return _load_module("_internode", "internode extension")  # built by setup.py where NVSHMEM is found


def _required(loaded):
    module, reason = loaded
    if module is None:
        raise RuntimeError(reason)
    return module


def ops():
    return _required(_load())


@functools.lru_cache(maxsize=None)
def has_kernels() -> bool:
    """Compiled kernels are usable: the extension is built and a CUDA device is visible (asked once:
    this sits on every call's path)."""
    module, _ = _load()
    return module is not None and torch.cuda.is_available()


def internode_ops():
    return _required(_load_internode())


def internode_unavailable_reason() -> Optional[str]:
    """Why the kernels across nodes cannot run here, or None."""
    reason = unavailable_reason()
    return reason if reason is not None else _load_internode()[1]


def has_nvshmem() -> bool:
    module, _ = _load()
    return module is not None and bool(getattr(module, "WITH_NVSHMEM", False))


def has_nvshmem_device() -> bool:
    """Built with NVSHMEM's device library (moe_ep._internode, where setup.py found NVSHMEM): the internode
    kernels and the low-latency kernels that put to peers on other hosts."""
    return _load_internode()[0] is not None


def is_sm90_compiled() -> bool:
    module, _ = _load()
    return module is not None and bool(getattr(module, "SM90_COMPILED", False))


def unavailable_reason() -> Optional[str]:
    module, reason = _load()
    if module is None:
        return reason
    if not torch.cuda.is_available():
        return "the CUDA extension is built but no CUDA device is visible"
    return None


BACKEND_CHOICES = ("auto", "portable", "kernels")


def requested_backend() -> str:
    """MOE_EP_BACKEND: "auto" (the kernels where they can serve, else the portable backend), "portable"
    (torch.distributed for everything: comparisons, debugging) or "kernels" (the kernels, or an error
    saying why they cannot serve)."""
    value = os.environ.get("MOE_EP_BACKEND", "") or "auto"
    if value not in BACKEND_CHOICES:
        raise ValueError(f"MOE_EP_BACKEND: expected one of {', '.join(BACKEND_CHOICES)}, got {value!r}")
    return value


def backend_info() -> dict:
    """Which backend runs CUDA tensors and why; CPU tensors always run on the portable backend."""
    reason = unavailable_reason()
    if requested_backend() == "portable":
        reason = "MOE_EP_BACKEND=portable"
    info = {
        "cuda_kernels": reason is None,
        "nvshmem": has_nvshmem(),
        "nvshmem_device": has_nvshmem_device(),
        "sm90": is_sm90_compiled(),
        "internode_kernels": reason is None and _load_internode()[0] is not None,
        "cuda_tensors_run_on": "cuda kernels" if reason is None else "portable backend (torch.distributed)",
        "cpu_tensors_run_on": "portable backend (torch.distributed)",
        "reason": reason or "extension loaded",
    }
    if _load()[0] is not None and torch.cuda.is_available():  # how peers' buffers are mapped by default
        info["peer_memory_vmm"] = bool(ops().vmm_supported())
    if _load()[0] is not None and not info["nvshmem"]:
        module, _ = _load()
        info["nvshmem_reason"] = getattr(module, "NVSHMEM_REASON", "built without NVSHMEM")
    return info
