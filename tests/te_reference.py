"""An independent, element-by-element rendering of transformer-engine's 1x128 blockwise quantizer and of
its GEMM-ready scale layout, from TE's source, for the tests to hold moe_ep's vectorised torch code to:

- scale: transformer_engine/common/transpose/compute_scale.cuh, ComputeScale (float32 arithmetic);
- cast and scale_inv: transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu,
  block_scaled_1d_cast_transpose_kernel (data = OType(x * scale), scale_inv = 1.0 / scale in double);
- e4m3: round to nearest, ties to even, saturating (__nv_cvt_float_to_fp8 with __NV_SATFINITE);
- layout: transformer_engine/pytorch/tensor/float8_blockwise_tensor.py, Float8BlockQuantizer.get_scale_shape
  (1D blocks, rowwise: (ceil(K/128), roundup(M, 4))) and Float8BlockwiseQTensorBase._dequantize_vectorwise.
numpy float32 scalars, no torch arithmetic, so the two do not share a rounding by construction.
"""
from __future__ import annotations

import math

import numpy as np
import torch

BLOCK = 128
_INF_REPLACEMENT = {  # HighPrecisionFloatScaleLimitsTrait<IType, ForcePow2>
    ("float32", False): np.finfo(np.float32).max, ("float32", True): np.float32(2.0**127),
    ("bfloat16", False): np.float32(float.fromhex("0x1.FEp127")), ("bfloat16", True): np.float32(2.0**127),
    ("float16", False): np.float32(float.fromhex("0x1.FFCp15")), ("float16", True): np.float32(2.0**15),
}


def _e4m3_table():
    codes = torch.arange(128, dtype=torch.uint8)  # the non-negative codes; 0x7f is NaN
    values = codes.view(torch.float8_e4m3fn).float().numpy()[:127]
    return values.astype(np.float64), np.arange(127)


_VALUES, _CODES = _e4m3_table()


def e4m3_code(v: np.float32) -> int:
    """The e4m3 byte nearest to v (ties to the even code), saturating at 448."""
    sign = 0x80 if np.signbit(v) else 0
    a = min(abs(float(v)), 448.0)
    i = int(np.searchsorted(_VALUES, a))
    if i < len(_VALUES) and _VALUES[i] == a:
        return sign | int(_CODES[i])
    lo, hi = i - 1, i
    dlo, dhi = a - _VALUES[lo], _VALUES[hi] - a
    pick = lo if dlo < dhi else hi if dhi < dlo else (lo if _CODES[lo] % 2 == 0 else hi)
    return sign | int(_CODES[pick])


def compute_scale(amax: np.float32, eps: float, pow2: bool, itype: str) -> np.float32:
    amax_mod = np.fmax(np.float32(amax), np.float32(eps))
    if amax_mod == 0:
        return np.float32(1.0)
    with np.errstate(divide="ignore", over="ignore"):
        scale = np.float32(448.0) / amax_mod
    if np.isinf(scale):
        return np.float32(_INF_REPLACEMENT[(itype, pow2)])
    if scale == 0:
        return scale
    if pow2:
        scale = np.array([scale], dtype=np.float32).view(np.uint32) & np.uint32(0xFF800000)
        scale = scale.view(np.float32)[0]
    return np.float32(scale)


def quantize_rowwise(x: torch.Tensor, pow2: bool = True, eps: float = 0.0):
    """x [M, K] -> (uint8 [M, K], scale_inv float32 [M, K/128]), one element at a time."""
    itype = str(x.dtype).replace("torch.", "")
    values = x.float().numpy()
    rows, cols = values.shape
    data = np.zeros((rows, cols), dtype=np.uint8)
    scale_inv = np.zeros((rows, cols // BLOCK), dtype=np.float32)
    for r in range(rows):
        for b in range(cols // BLOCK):
            block = values[r, b * BLOCK:(b + 1) * BLOCK]
            amax = np.float32(0.0)
            for v in block:
                amax = np.fmax(amax, np.float32(abs(v)))
            scale = compute_scale(amax, eps, pow2, itype)
            with np.errstate(divide="ignore"):
                scale_inv[r, b] = np.float32(1.0 / np.float64(scale))
            for j, v in enumerate(block):
                with np.errstate(over="ignore"):
                    data[r, b * BLOCK + j] = e4m3_code(np.float32(np.float32(v) * scale))
    return torch.from_numpy(data), torch.from_numpy(scale_inv)


def gemm_scale_shape(rows: int, cols: int):
    """Float8BlockQuantizer.get_scale_shape(shape=(M, K), columnwise=False) with block_scaling_dim=1."""
    return (math.ceil(cols / BLOCK), 4 * math.ceil(rows / 4))


def dequantize_vectorwise(data_u8: torch.Tensor, gemm_scale_inv: torch.Tensor) -> torch.Tensor:
    """_dequantize_vectorwise for rowwise data: scale_inv[:, :M] transposed, one per 128 columns."""
    rows, cols = data_u8.shape
    scale = gemm_scale_inv[:, :rows].transpose(-2, -1).contiguous().reshape(rows, cols // BLOCK, 1)
    q = data_u8.reshape(rows, cols // BLOCK, BLOCK).view(torch.float8_e4m3fn).to(torch.float32)
    return (q * scale).reshape(rows, cols)
