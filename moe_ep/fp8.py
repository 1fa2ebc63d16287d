"""Per-token 1x128 block FP8 (e4m3) cast and cast-back.

The format is transformer-engine's blockwise layout: one float32 scale per 128 consecutive columns of a
row, scale = amax / 448 (448 is the largest finite e4m3 value), amax clamped below at 1e-4 so an
all-zero block gets a finite scale. `round_scale` rounds the scale up to a power of two, which makes
the quantised value exact to rescale; `use_ue8m0` stores such a scale as its 8-bit biased exponent
and packs four of them into one int32 (block b in byte b % 4 of word b // 4, little end first).

The arithmetic is fixed so that the CUDA kernel reproduces it bit for bit, and it is the convention of
DeepEP's and transformer-engine's references: amax in float32; scale = amax / 448 and, per block, the
inverse 448 / amax (each one float32 division; with round_scale the inverse is 1 / scale, exact for a
power of two); each element multiplied by the inverse, then rounded to nearest-even e4m3.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .checks import FP8_BLOCK, FP8_DTYPE, check_int, check_tensor

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
UE8M0_PER_WORD = 4


def num_ue8m0_words(hidden: int, block: int = FP8_BLOCK) -> int:
    return -(-(hidden // block) // UE8M0_PER_WORD)


def per_token_cast_to_fp8(
    x: torch.Tensor, block: int = FP8_BLOCK, round_scale: bool = False, use_ue8m0: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (bf16/fp16/fp32) -> (e4m3 [N, H], scales [N, H/block] float32, or int32 UE8M0 words)."""
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    check_int("block", block, minimum=1)
    hidden = x.shape[1]
    if hidden % block != 0:
        raise ValueError(
            f"x: the hidden size must be a multiple of block={block} for fp8, got {hidden} "
            "(moe_ep does not pad silently)"
        )
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 can only hold power-of-two scales)")
    if x.is_cuda and block == FP8_BLOCK:
        from . import _native

        if _native.has_kernels():
            return _native.ops().fp8_cast(x.contiguous(), round_scale, use_ue8m0)
    return _cast_reference(x, block, round_scale, use_ue8m0)


def per_token_cast_back(
    x_fp8: torch.Tensor, scales: torch.Tensor, block: int = FP8_BLOCK, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of per_token_cast_to_fp8 (up to the quantisation error); scales float32 or UE8M0 int32."""
    check_tensor("x_fp8", x_fp8, dtype=FP8_DTYPE)
    hidden = x_fp8.shape[-1] if x_fp8.dim() else 0
    if not (x_fp8.dim() >= 1 and hidden % block == 0):
        raise ValueError(
            f"x_fp8: the last dimension must be a multiple of block={block}, got shape {tuple(x_fp8.shape)}"
        )
    check_tensor("scales", scales, dtypes=(torch.float32, torch.int32), device=x_fp8.device)
    columns = hidden // block if scales.dtype == torch.float32 else num_ue8m0_words(hidden, block)
    if scales.shape != (*x_fp8.shape[:-1], columns):
        raise ValueError(f"scales: expected shape {(*x_fp8.shape[:-1], columns)}, got {tuple(scales.shape)}")
    if x_fp8.is_cuda and x_fp8.dim() == 2 and block == FP8_BLOCK and out_dtype in (torch.bfloat16, torch.float32):
        from . import _native

        if _native.has_kernels():
            return _native.ops().fp8_cast_back(x_fp8, scales, out_dtype)
    blocks = x_fp8.float().unflatten(-1, (-1, block))
    return (blocks * expand_scales(scales, hidden, block).unsqueeze(-1)).flatten(-2).to(out_dtype)


def expand_scales(scales: torch.Tensor, hidden: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """float32 scales as they are, or UE8M0 int32 words unpacked to float32 powers of two."""
    check_tensor("scales", scales, dtypes=(torch.float32, torch.int32))
    if scales.dtype == torch.float32:
        return scales
    exponents = scales.contiguous().view(torch.uint8)[..., : hidden // block].to(torch.int32) - 127
    return torch.ldexp(torch.ones(exponents.shape, dtype=torch.float32, device=scales.device), exponents)


def _cast_reference(x: torch.Tensor, block: int, round_scale: bool, use_ue8m0: bool):
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    # Tensor operands: torch on CUDA turns division by a Python scalar into a reciprocal multiply.
    fp8_max = torch.full_like(amax, FP8_MAX)
    scale = amax / fp8_max
    if round_scale:
        scale = _next_power_of_two(scale)
        inverse = torch.ones_like(scale) / scale
    else:
        inverse = fp8_max / amax
    x_fp8 = (blocks * inverse.unsqueeze(-1)).flatten(-2).to(FP8_DTYPE)
    if not use_ue8m0:
        return x_fp8, scale
    return x_fp8, _pack_ue8m0(scale)


def _next_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    # frexp gives scale = m * 2**e with m in [0.5, 1): a power of two has m == 0.5 and stays as it is.
    mantissa, exponent = torch.frexp(scale)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def _pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    biased = (scale.view(torch.int32) >> 23) & 0xFF
    num_tokens, num_blocks = biased.shape
    words = num_ue8m0_words(num_blocks * FP8_BLOCK)
    padded = torch.zeros(num_tokens, words * UE8M0_PER_WORD, dtype=torch.uint8, device=scale.device)
    padded[:, :num_blocks] = biased.to(torch.uint8)
    return padded.view(torch.int32)
