"""Argument checks at the API boundary.

Every public call validates its inputs here, before any rank communicates, so that a bad argument
raises on the rank that passed it and leaves the Buffer usable. Messages name the argument, what was
expected and what was given.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128


def env_switch(name: str, default: str) -> bool:
    """An on/off environment variable: "1" or "0" (`default` when unset); anything else is refused,
    naming it."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return value == "1"


def debug_checks_enabled() -> bool:
    """Value checks that would cost a host synchronisation run only when MOE_EP_DEBUG=1."""
    return os.environ.get("MOE_EP_DEBUG", "0") not in ("", "0", "false", "False")


def check_tensor(
    name: str,
    t,
    *,
    dtype=None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Type, dtype, rank, shape (None entries are free) and device of one tensor argument.
    Messages are built only on failure: this runs on every call of the hot path."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:  # it has a shape but no data to send or read
        raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")
    if t.layout != torch.strided:  # sparse or nested: no rows to read where the calls read them
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, want in enumerate(shape):
            if want is not None and t.shape[axis] != want:
                raise ValueError(f"{name}: expected shape {_fmt_shape(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got one on {t.device}")
    return t


def check_int(name: str, value, *, minimum: Optional[int] = None, multiple_of: Optional[int] = None) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None:
        if value < minimum:
            raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if multiple_of is not None:
        if value % multiple_of != 0:
            raise ValueError(f"{name}: expected a multiple of {multiple_of}, got {value}")
    return value


def check_num_sms(name: str, value) -> int:
    """An SM budget of the normal kernels: two SMs a channel (Config.num_channels), so an even count >= 2."""
    return check_int(name, value, minimum=2, multiple_of=2)


def check_expert_ids(name: str, topk_idx: torch.Tensor, num_experts: int, hint: str = "") -> None:
    """-1 means "no expert"; anything else must be a valid global expert id. Reads the data.
    hint: where num_experts came from, when not from an argument of that name."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if not (lo >= -1 and hi < num_experts):
        raise ValueError(f"{name}: expert ids must be -1 or in [0, {num_experts}){hint}, got values in [{lo}, {hi}]")


def check_distinct_expert_ids(name: str, topk_idx: torch.Tensor) -> None:
    """No token lists an expert twice (-1 aside): a low-latency expert has a row for each token of each
    rank, no more. Reads the data."""
    if topk_idx.shape[1] < 2 or topk_idx.numel() == 0:
        return
    ordered = topk_idx.sort(dim=1).values
    twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(twice.any()):
        token = int(twice.any(1).nonzero()[0])
        raise ValueError(f"{name}: token {token} lists an expert more than once ({topk_idx[token].tolist()}); each "
                         "expert can take a token once")


def check_fp8_pair(name: str, x) -> tuple:
    """The fp8 form of a hidden-state argument: (e4m3 [N, H], float32 scales [N, H/128])."""
    if len(x) != 2:
        raise TypeError(f"{name}: expected a tensor or a pair (x_fp8, scales), got {len(x)} items")
    x_fp8, scales = x
    check_tensor(f"{name}[0]", x_fp8, dtype=FP8_DTYPE, ndim=2)
    num_tokens, hidden = x_fp8.shape
    if hidden % FP8_BLOCK != 0:
        raise ValueError(f"{name}[0]: fp8 hidden size must be a multiple of {FP8_BLOCK}, got {hidden}")
    check_tensor(
        f"{name}[1]", scales, dtype=torch.float32, shape=(num_tokens, hidden // FP8_BLOCK), device=x_fp8.device
    )
    return x_fp8, scales


def _fmt_shape(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
