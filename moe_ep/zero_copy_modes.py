"""Which intranode calls are one-pass (zero-copy) ones, chosen by name: a module without megatron-core so
that scripts can offer the same choices before they import it."""

from __future__ import annotations

import os

# none, dispatch, combine, both: the MOE_EP_ZERO_COPY_DISPATCH / _COMBINE switches; arena: both calls
# one pass through a dispatch arena whose outputs are ordinary tensors (MOE_EP_DISPATCH_ARENA).
ZERO_COPY_CHOICES = ("none", "dispatch", "combine", "both", "arena")


def set_zero_copy(which: str) -> None:
    """Which calls of the Buffers and dispatchers made from now on are one-pass ones: none, dispatch,
    combine or both (sets MOE_EP_ZERO_COPY_DISPATCH and MOE_EP_ZERO_COPY_COMBINE), or arena: both calls
    one pass through a dispatch arena, their outputs ordinary tensors (MOE_EP_DISPATCH_ARENA)."""
    if which not in ZERO_COPY_CHOICES:
        raise ValueError(f"zero copy: expected one of {ZERO_COPY_CHOICES}, got {which!r}")
    os.environ["MOE_EP_ZERO_COPY_DISPATCH"] = "1" if which in ("dispatch", "both") else "0"
    os.environ["MOE_EP_ZERO_COPY_COMBINE"] = "1" if which in ("combine", "both") else "0"
    os.environ["MOE_EP_DISPATCH_ARENA"] = "1" if which == "arena" else "0"
