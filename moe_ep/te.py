"""Hand-off between moe_ep's fp8 rows and transformer-engine's blockwise tensors.

moe_ep carries a 1x128 fp8 tensor as (e4m3 [M, K], scale_inv float32 [M, K/128]), one row's scales
beside it (what Buffer.dispatch sends). TE's `Float8BlockwiseQTensor` with 1D blocks keeps the same
data as uint8 and its rowwise scale_inv "GEMM ready": transposed and padded, [K/128, roundup(M, 4)]
(Float8BlockQuantizer.get_scale_shape, transformer_engine/pytorch/tensor/float8_blockwise_tensor.py).
The layout conversions are plain torch and need no TE; building the TE tensor needs TE.
check_te_blockwise_format holds the installed TE to the format moe_ep's cast reproduces.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional, Tuple

import torch

from .checks import FP8_BLOCK, FP8_DTYPE, check_tensor
from .fp8_blockwise import blockwise_cast_to_fp8, columnwise_from_rowwise

# TE's GEMM-ready scales pad the token dimension to a multiple of 4.
SCALE_ROW_ALIGNMENT = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def scales_to_gemm_layout(scales: torch.Tensor) -> torch.Tensor:
    """scale_inv [M, K/128] -> TE's GEMM-ready rowwise layout [K/128, roundup(M, 4)] (padding zeros,
    which no GEMM reads)."""
    check_tensor("scales", scales, dtype=torch.float32, ndim=2)
    num_rows, num_blocks = scales.shape
    out = torch.zeros(num_blocks, _round_up(num_rows, SCALE_ROW_ALIGNMENT), dtype=torch.float32, device=scales.device)
    out[:, :num_rows] = scales.t()
    return out


def scales_from_gemm_layout(scale_inv: torch.Tensor, num_rows: int) -> torch.Tensor:
    """TE's GEMM-ready rowwise scale_inv [K/128, roundup(M, 4)] -> [M, K/128], as moe_ep sends them."""
    check_tensor("scale_inv", scale_inv, dtype=torch.float32, ndim=2)
    if scale_inv.shape[1] < num_rows:
        raise ValueError(f"scale_inv: {scale_inv.shape[1]} columns cannot hold the scales of {num_rows} rows")
    return scale_inv[:, :num_rows].t().contiguous()


@functools.lru_cache(maxsize=None)
def te_available() -> bool:
    """Whether transformer-engine's PyTorch blockwise tensor imports here."""
    try:
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor  # noqa: F401
    except Exception:  # ImportError, or a TE build that fails to load its library
        return False
    return True


def recipe_scaling() -> Tuple[bool, float]:
    """(power-of-two scales, amax_epsilon) of the activations' quantizer: the active TE recipe's where a
    Float8BlockScaling recipe is in force, else Float8BlockScaling's defaults (TE's own default when TE
    imports, which NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 turns to FP32 scales), else (True, 0.0)."""
    if not te_available():
        return True, 0.0
    from transformer_engine.common.recipe import Float8BlockScaling

    recipe = _active_recipe()
    if not isinstance(recipe, Float8BlockScaling):
        recipe = Float8BlockScaling()
    params = recipe.fp8_quant_fwd_inp
    return bool(params.power_2_scale), float(params.amax_epsilon)


def _active_recipe():
    manager = None
    for module in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            manager = __import__(module, fromlist=["FP8GlobalStateManager"]).FP8GlobalStateManager
            break
        except (ImportError, AttributeError):
            continue
    if manager is None or not manager.is_fp8_enabled():
        return None
    return manager.get_fp8_recipe()


def to_float8_blockwise(
    x_fp8: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    columnwise: bool = True,
    pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
):
    """(e4m3 [M, K], scale_inv [M, K/128]) -> TE's Float8BlockwiseQTensor (1D blocks, GEMM-ready scales),
    the data shared, not quantised again. columnwise: also the copy a weight gradient reads, made by
    columnwise_from_rowwise (a dequantise and a 128x1 cast: one read and one write of M*K bytes and a
    float32 temporary of M*K*4 bytes). Needs transformer-engine."""
    check_tensor("x_fp8", x_fp8, dtype=FP8_DTYPE, ndim=2)
    num_rows, hidden = x_fp8.shape
    check_tensor("scales", scales, dtype=torch.float32, shape=(num_rows, hidden // FP8_BLOCK), device=x_fp8.device)
    if not te_available():
        raise RuntimeError("to_float8_blockwise needs transformer-engine, which does not import here")
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockQuantizer,
        Float8BlockwiseQTensor,
    )

    quantizer = Float8BlockQuantizer(
        tex.DType.kFloat8E4M3,
        rowwise=True,
        columnwise=columnwise,
        amax_epsilon=amax_epsilon,
        force_pow_2_scales=pow2_scales,
        block_scaling_dim=1,
    )
    col_data = col_scale_inv = None
    if columnwise:
        data_t, scale_inv_t = columnwise_from_rowwise(x_fp8, scales, pow2_scales, amax_epsilon)
        col_data = data_t.view(torch.uint8)
        # TE pads the columnwise scales' inner (hidden) dimension to a multiple of 4; K/128 blocks of 128 are.
        col_scale_inv = scale_inv_t
    kwargs = dict(
        shape=(num_rows, hidden),
        dtype=dtype,
        rowwise_data=x_fp8.view(torch.uint8),
        rowwise_scale_inv=scales_to_gemm_layout(scales),
        columnwise_data=col_data,
        columnwise_scale_inv=col_scale_inv,
        fp8_dtype=tex.DType.kFloat8E4M3,
        quantizer=quantizer,
        is_2D_scaled=False,
    )
    gemm_ready = _gemm_ready_format()
    if gemm_ready is not None:
        kwargs["data_format"] = gemm_ready
    return Float8BlockwiseQTensor(**kwargs)


def _gemm_ready_format():
    """TE versions with a choice of scale layouts take data_format=GEMM_READY; older ones have only it."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

    names = set()
    for klass in Float8BlockwiseQTensor.__mro__:
        if "__new__" in vars(klass):
            names |= set(inspect.signature(klass.__new__).parameters)
    if "data_format" not in names:
        return None
    try:
        from transformer_engine.pytorch.tensor._internal.float8_blockwise_tensor_base import (
            Float8BlockScaleTensorFormat,
        )
    except ImportError:
        from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
            Float8BlockScaleTensorFormat,
        )
    return Float8BlockScaleTensorFormat.GEMM_READY


def from_float8_blockwise(tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A 1D-block Float8BlockwiseQTensor's rowwise copy -> (e4m3 [M, K], scale_inv [M, K/128])."""
    data: Optional[torch.Tensor] = tensor._rowwise_data
    if data is None or getattr(tensor, "_is_2D_scaled", False):
        raise ValueError("from_float8_blockwise: needs a tensor with 1x128 rowwise data")
    data = data.reshape(-1, data.shape[-1])
    num_rows, hidden = data.shape
    scale_inv = tensor._rowwise_scale_inv
    if scale_inv.shape == (num_rows, hidden // FP8_BLOCK):  # a compact layout holds them as moe_ep does
        return data.view(FP8_DTYPE), scale_inv.contiguous()
    return data.view(FP8_DTYPE), scales_from_gemm_layout(scale_inv, num_rows)


def te_version() -> str:
    import transformer_engine

    return getattr(transformer_engine, "__version__", "of unknown version")


# A probe of every magnitude an activation block can have, zeros and a block that saturates included.
_PROBE_ROWS, _PROBE_HIDDEN = 8, 2 * FP8_BLOCK


def _probe_rows(device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(_PROBE_ROWS, _PROBE_HIDDEN, generator=g)
    rows = rows * torch.logspace(-30, 30, _PROBE_ROWS, base=2.0).unsqueeze(1)
    rows[0, :FP8_BLOCK] = 0
    rows[1, FP8_BLOCK:] = 1e30
    return rows.to(device, torch.bfloat16)


def _te_rowwise_cast(rows: torch.Tensor, pow2_scales: bool, amax_epsilon: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """TE's own 1x128 quantizer on `rows`: (e4m3 [M, K], scale_inv [M, K/128])."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                     amax_epsilon=amax_epsilon, force_pow_2_scales=pow2_scales, block_scaling_dim=1)
    return from_float8_blockwise(quantizer(rows))


def blockwise_format_difference(te_cast, device, pow2_scales: bool, amax_epsilon: float) -> Optional[str]:
    """What of te_cast(rows, pow2_scales, amax_epsilon) -> (e4m3, scale_inv) differs from moe_ep's cast of
    the probe rows on `device` ("e4m3 data" or "scales"), or None where both are the same bits."""
    rows = _probe_rows(device)
    theirs = te_cast(rows, pow2_scales, amax_epsilon)
    ours = blockwise_cast_to_fp8(rows, pow2_scales, amax_epsilon)
    for what, a, b in (("e4m3 data", theirs[0].view(torch.uint8), ours[0].view(torch.uint8)),
                       ("scales", theirs[1], ours[1])):
        if a.shape != b.shape or not torch.equal(a, b):
            return what
    return None


@functools.lru_cache(maxsize=None)
def check_te_blockwise_format() -> None:
    """Where transformer-engine imports with a GPU: raises if its 1x128 quantizer, under the recipe's
    settings, does not give bit for bit the fp8 rows and scales moe_ep's cast sends (fp8 dispatch relies on
    TE's experts seeing what TE itself would have made of the same tokens). Once a process."""
    if not te_available():
        return
    try:
        pow2_scales, amax_epsilon = recipe_scaling()
        if not torch.cuda.is_available():
            return  # TE's quantizer runs on GPUs only; the recipe's fields were read
        device = torch.device("cuda", torch.cuda.current_device())
        difference = blockwise_format_difference(_te_rowwise_cast, device, pow2_scales, amax_epsilon)
    except (AttributeError, TypeError, ValueError) as error:  # a class, field or argument moved
        raise RuntimeError(
            f"moe_ep_fp8_dispatch: transformer-engine {te_version()} has no 1x128 blockwise quantizer and recipe "
            f"as moe_ep reads them ({type(error).__name__}: {error}); moe_ep was built against TE 2.20's "
            "Float8BlockQuantizer and Float8BlockScaling. Set moe_ep_fp8_dispatch='off'") from error
    if difference is not None:
        raise RuntimeError(
            f"moe_ep_fp8_dispatch: transformer-engine {te_version()}'s 1x128 blockwise cast differs from the one "
            f"moe_ep sends (the {difference} differ on a probe; power-of-two scales {pow2_scales}, amax epsilon "
            f"{amax_epsilon}), so its experts would not see TE's own fp8 rows. moe_ep matches TE 2.20's "
            "Float8BlockQuantizer; set moe_ep_fp8_dispatch='off' with this TE")
