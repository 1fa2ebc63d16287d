"""SMs that matmuls leave to the communication kernels where several ranks share a GPU.

The intranode kernels keep their blocks resident while they wait for peers. On a GPU of its own that
costs a rank's matmuls only the SMs of its own calls; where ranks share a GPU, a rank's matmul runs
beside the other ranks' kernels too. cuBLAS and CUTLASS size persistent GEMMs to the whole GPU, and
their blocks can wait on each other (stream-K), so a GEMM with some of its blocks unplaced can stall
until the peers' kernels end, while those kernels wait for the very rank whose GEMM stalls: megatron
training with four ranks on one H200 stalled this way until a kernel's deadline (PERFORMANCE.md,
twenty-seventh session). torch's SM carveout makes its matmuls target fewer SMs; this module sets it
to the SMs the communication kernels of every rank on this GPU can hold.
"""

from __future__ import annotations

import os

import torch

_ENV = "MOE_EP_MATMUL_SM_CARVEOUT"


def requested_carveout(ranks_on_device: int, blocks_per_rank: int) -> int:
    """SMs to keep from matmuls: every rank's kernel on this GPU holds at most one SM per block.
    0 with a GPU per rank, or where MOE_EP_MATMUL_SM_CARVEOUT=0; a number there overrides it."""
    value = os.environ.get(_ENV, "auto")
    if value != "auto":
        try:
            carveout = int(value)
        except ValueError:
            carveout = -1
        if carveout < 0:
            raise ValueError(f"{_ENV}: expected auto or a number of SMs >= 0, got {value!r}")
        return carveout
    return ranks_on_device * blocks_per_rank if ranks_on_device > 1 else 0


def keep_sms_from_matmuls(carveout: int, device: torch.device) -> int:
    """Raises torch's matmul SM carveout to `carveout` (never lowers one the program set), leaving
    matmuls at least 8 SMs. -> the carveout in force (0: none)."""
    current = torch._C._get_sm_carveout_experimental() if hasattr(torch._C, "_get_sm_carveout_experimental") else None
    if carveout <= 0 or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        return current or 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    carveout = min(carveout, sms - 8)
    if current is None or current < carveout:
        torch._C._set_sm_carveout_experimental(carveout)
        return carveout
    return current
