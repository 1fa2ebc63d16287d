"""transformer-engine's 1x128 blockwise FP8 (e4m3) cast, reproduced in torch bit for bit.

This is the arithmetic of TE's `Float8BlockQuantizer(block_scaling_dim=1)` (the activations of the
`Float8BlockScaling` recipe), from transformer_engine/common/transpose/compute_scale.cuh
(`ComputeScale`) and quantize_transpose_vector_blockwise.cu (`block_scaled_1d_cast_transpose_kernel`):
per block of 128 columns, amax in float32; amax = max(amax, amax_epsilon); amax == 0 gives scale 1;
otherwise scale = 448 / amax (one float32 division), an infinite scale becomes the largest finite
(or, with power-of-two scales, the largest power-of-two) value of the input dtype, and power-of-two
scaling clears the mantissa bits (rounds the scale down); data = e4m3(x * scale) with rounding to
nearest-even; the stored dequantisation factor is scale_inv = 1 / scale.

moe_ep's own cast (moe_ep.fp8.per_token_cast_to_fp8: scale = amax / 448, amax floored at 1e-4, scales
rounded up) is DeepEP's convention and can differ from TE's in the last bit of a scale or for blocks
of tiny amax; the megatron dispatcher's fp8 path uses this module so that its experts see what TE's
quantizer would have produced from the same input.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .checks import FP8_BLOCK, FP8_DTYPE, check_tensor

FP8_MAX = 448.0
_MANTISSA_CLEAR = -8388608  # 0xFF800000 as an int32: sign and exponent bits kept

# HighPrecisionFloatScaleLimitsTrait (compute_scale.cuh): what an infinite scale becomes, by the dtype of
# the input and whether scales are powers of two.
_INF_SCALE_REPLACEMENT = {
    (torch.float32, False): torch.finfo(torch.float32).max,
    (torch.float32, True): 2.0**127,
    (torch.bfloat16, False): float.fromhex("0x1.FEp127"),
    (torch.bfloat16, True): 2.0**127,
    (torch.float16, False): float.fromhex("0x1.FFCp15"),
    (torch.float16, True): 2.0**15,
}


def compute_scale(amax: torch.Tensor, input_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float = 0.0):
    """TE's ComputeScale on a float32 tensor of block amaxes: the quantisation factors (x * scale)."""
    amax = amax.float()
    if amax_epsilon > 0:
        amax = torch.clamp(amax, min=amax_epsilon)
    # A tensor numerator: torch on CUDA turns division by a Python scalar into a reciprocal multiply.
    scale = torch.full_like(amax, FP8_MAX) / amax
    if pow2_scales:
        # Finite, non-zero scales: clear the mantissa (a power of two at most the scale), as TE does.
        masked = (scale.view(torch.int32) & _MANTISSA_CLEAR).view(torch.float32)
        scale = torch.where(torch.isfinite(scale) & (scale != 0), masked, scale)
    scale = torch.where(torch.isinf(scale), _INF_SCALE_REPLACEMENT[(input_dtype, pow2_scales)], scale)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def blockwise_cast_to_fp8(
    x: torch.Tensor, pow2_scales: bool = True, amax_epsilon: float = 0.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (bf16/fp16/fp32, H a multiple of 128) -> (e4m3 [N, H], scale_inv float32 [N, H/128]):
    TE's 1x128 quantizer, rowwise, with the recipe's settings (Float8BlockScaling's defaults: power-of-two
    scales, amax_epsilon 0); x ~ e4m3 * scale_inv per block."""
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    if x.shape[1] % FP8_BLOCK != 0:
        raise ValueError(f"x: the hidden size must be a multiple of {FP8_BLOCK} for fp8, got {x.shape[1]}")
    if x.is_cuda:
        from . import _native

        # One kernel: a read of x, a write of the bytes and scales; equal to the torch rendering below for
        # finite x (the kernel's amax skips a NaN, where torch's amax returns NaN).
        if _native.has_kernels():
            inf_factor = _INF_SCALE_REPLACEMENT[(x.dtype, pow2_scales)]
            return _native.ops().fp8_blockwise_cast(x, pow2_scales, float(amax_epsilon), inf_factor)
    blocks = x.float().unflatten(-1, (-1, FP8_BLOCK))
    scale = compute_scale(blocks.abs().amax(dim=-1), x.dtype, pow2_scales, amax_epsilon)
    scaled = blocks * scale.unsqueeze(-1)
    # TE converts with saturation (__NV_SATFINITE); torch's cast turns overflow into NaN.
    scaled = scaled.clamp(-FP8_MAX, FP8_MAX)
    return scaled.flatten(-2).to(FP8_DTYPE), torch.ones_like(scale) / scale


def blockwise_dequantize(x_fp8: torch.Tensor, scale_inv: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """(e4m3 [N, H], scale_inv [N, H/128]) -> x [N, H]: each block times its scale_inv, in float32."""
    check_tensor("x_fp8", x_fp8, dtype=FP8_DTYPE, ndim=2)
    check_tensor("scale_inv", scale_inv, dtype=torch.float32, shape=(x_fp8.shape[0], x_fp8.shape[1] // FP8_BLOCK))
    blocks = x_fp8.float().unflatten(-1, (-1, FP8_BLOCK)) * scale_inv.unsqueeze(-1)
    return blocks.flatten(-2).to(out_dtype)


def columnwise_from_rowwise(
    x_fp8: torch.Tensor, scale_inv: torch.Tensor, pow2_scales: bool = True, amax_epsilon: float = 0.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The columnwise copy a weight gradient needs, from the rowwise one: (e4m3 [H, N] (x transposed),
    scale_inv float32 [ceil(N/128), H]: one scale per 128 rows of x for each column).

    Dequantises in float32 and quantises again in 128x1 blocks, as TE's dequantize_cast_transpose
    kernel (nvte_transpose_blockwise) does; rows past N count as zeros. It quantises the dequantised
    values, not the original input: with power-of-two scales each dequantised value is exact, so the
    only error added is the second rounding to e4m3 along the other dimension."""
    num_rows, hidden = x_fp8.shape
    values = blockwise_dequantize(x_fp8, scale_inv, torch.float32)
    padded = -(-num_rows // FP8_BLOCK) * FP8_BLOCK
    transposed = torch.zeros(hidden, padded, dtype=torch.float32, device=x_fp8.device)
    transposed[:, :num_rows] = values.t()
    data_t, scale_inv_t = blockwise_cast_to_fp8(transposed, pow2_scales, amax_epsilon)
    return data_t[:, :num_rows].contiguous(), scale_inv_t.t().contiguous()
