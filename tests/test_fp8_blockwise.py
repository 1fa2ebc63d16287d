"""moe_ep.fp8_blockwise and moe_ep.te against transformer-engine's blockwise format: bit for bit against
an element-by-element rendering of TE's source (tests/te_reference.py) everywhere, and against TE
itself where it imports (with a GPU)."""
import pytest
import torch

from moe_ep.fp8 import per_token_cast_to_fp8
from moe_ep.fp8_blockwise import blockwise_cast_to_fp8, blockwise_dequantize, columnwise_from_rowwise
from moe_ep.te import scales_from_gemm_layout, scales_to_gemm_layout, te_available

from . import te_reference as ref


def _inputs(dtype, seed=0):
    """Rows of ordinary values and of the edge cases: zero blocks, tiny and huge amax, amax at and next
    to 448 * 2**k, subnormals, negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 384, generator=g) * torch.logspace(-3, 3, 12).unsqueeze(1)
    x[0, :128] = 0
    x[0, 128:256] = -0.0
    x[1, :128] = 1e-6 * torch.randn(128, generator=g)
    x[2, :128] = 448.0
    x[2, 128] = 448.0 * 2 ** -3
    x[3, 5] = 448.0 * (1 + 2 ** -10)
    x[4, 7] = 7.0
    x[5, :128] = float.fromhex("0x1p-130")  # subnormal in float32; its scale 448/amax is infinite
    x[6, 0] = 6e4 if dtype is torch.float16 else 1e30  # finite inputs only
    if dtype is torch.float32:
        # amax/448 and 448/amax round to opposite sides of a power of two: moe_ep's own convention differs.
        x[7, 3] = float.fromhex("0x1.c00001p8")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_the_cast_equals_te_source_bit_for_bit(dtype, pow2, eps):
    x = _inputs(dtype)
    data, scale_inv = blockwise_cast_to_fp8(x, pow2_scales=pow2, amax_epsilon=eps)
    ref_data, ref_scale_inv = ref.quantize_rowwise(x, pow2, eps)
    assert torch.equal(data.view(torch.uint8), ref_data)
    assert torch.equal(scale_inv.view(torch.int32), ref_scale_inv.view(torch.int32))
    if pow2:
        mantissa, _ = torch.frexp(scale_inv)
        assert bool((mantissa == 0.5).all()), "power-of-two scales"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_the_cast_kernel_equals_te_source_bit_for_bit(dtype, pow2, eps):
    """On a GPU the cast is one kernel; same bytes and scales as TE's source, on the edge cases and on
    rows enough to spread over every SM."""
    from moe_ep import _native
    if not _native.has_kernels():
        pytest.skip("the CUDA extension moe_ep._C is not built")
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    many = torch.randn(3000, 384, generator=g) * torch.logspace(-4, 4, 3000).unsqueeze(1)
    x = torch.cat([_inputs(dtype).float(), many]).to(dtype)
    data, scale_inv = blockwise_cast_to_fp8(x.cuda(), pow2_scales=pow2, amax_epsilon=eps)
    ref_data, ref_scale_inv = ref.quantize_rowwise(x, pow2, eps)
    assert torch.equal(data.cpu().view(torch.uint8), ref_data)
    assert torch.equal(scale_inv.cpu().view(torch.int32), ref_scale_inv.view(torch.int32))


def test_moe_eps_own_cast_is_not_te_s_at_the_edges():
    """Why the dispatcher does not send per_token_cast_to_fp8's scales: amax floored at 1e-4 and scales
    rounded from amax/448 differ from TE's on zero blocks and next to powers of two."""
    x = _inputs(torch.float32)
    ours, ours_scale = per_token_cast_to_fp8(x, round_scale=True)
    te_data, te_scale = blockwise_cast_to_fp8(x)
    assert not torch.equal(ours_scale, te_scale)
    assert te_scale[0, 0] == 1.0 and ours_scale[0, 0] != 1.0  # an all-zero block


def test_the_cast_is_value_stable_under_a_second_cast():
    """Dequantising and casting again (what TE does with bf16 rows it is handed) gives the same values
    with power-of-two scales, so the dequantising path loses nothing more than the first cast."""
    x = _inputs(torch.bfloat16, seed=3)
    data, scale_inv = blockwise_cast_to_fp8(x)
    once = blockwise_dequantize(data, scale_inv, torch.bfloat16)
    assert torch.equal(once.float(), blockwise_dequantize(data, scale_inv, torch.float32)), "exact in bf16"
    again = blockwise_dequantize(*blockwise_cast_to_fp8(once), torch.float32)
    assert torch.equal(again, once.float())


@pytest.mark.parametrize("rows", [1, 4, 13, 130])
def test_gemm_ready_scales_follow_te_s_layout(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    data, scale_inv = blockwise_cast_to_fp8(x)
    gemm = scales_to_gemm_layout(scale_inv)
    assert tuple(gemm.shape) == ref.gemm_scale_shape(rows, 256)
    torch.testing.assert_close(ref.dequantize_vectorwise(data.view(torch.uint8), gemm),
                               blockwise_dequantize(data, scale_inv, torch.float32), rtol=0, atol=0)
    assert torch.equal(scales_from_gemm_layout(gemm, rows), scale_inv)


@pytest.mark.parametrize("rows", [5, 128, 200])
@pytest.mark.parametrize("pow2", [True, False])
def test_the_columnwise_copy_is_te_s_cast_of_the_dequantised_rows(rows, pow2):
    """The weight gradient's copy: x dequantised, transposed and cast in 1x128 blocks along the tokens
    (TE's dequantize_cast_transpose, rows past the end counting as zeros), scales [ceil(M/128), K]."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 256, generator=g) * 3).to(torch.bfloat16)
    data, scale_inv = blockwise_cast_to_fp8(x, pow2)
    col_data, col_scale_inv = columnwise_from_rowwise(data, scale_inv, pow2)
    assert col_data.shape == (256, rows) and col_scale_inv.shape == (-(-rows // 128), 256)
    values = blockwise_dequantize(data, scale_inv, torch.float32).t()
    padded = torch.zeros(256, -(-rows // 128) * 128)
    padded[:, :rows] = values
    ref_data, ref_scale_inv = ref.quantize_rowwise(padded, pow2)
    assert torch.equal(col_data.view(torch.uint8), ref_data[:, :rows])
    assert torch.equal(col_scale_inv, ref_scale_inv.t())
    back = col_data.float() * col_scale_inv.t().repeat_interleave(128, dim=1)[:, :rows]
    torch.testing.assert_close(back.t(), x.float(), rtol=2.0**-3, atol=2.0**-3 * x.float().abs().max().item())


# ------------------------------------------------------------------ against transformer-engine itself
needs_te = pytest.mark.skipif(not (te_available() and torch.cuda.is_available()),
                              reason="transformer-engine (with a GPU) is not available here")


@needs_te
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("rows", [13, 256])
def test_the_cast_equals_te_s_quantizer(pow2, rows):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from moe_ep.te import from_float8_blockwise, to_float8_blockwise
    x = _inputs(torch.bfloat16)[:, :256].repeat(-(-rows // 12), 1)[:rows].cuda()
    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True,
                                     force_pow_2_scales=pow2, amax_epsilon=0.0, block_scaling_dim=1)
    theirs = quantizer(x)
    data, scale_inv = blockwise_cast_to_fp8(x, pow2)
    assert torch.equal(theirs._rowwise_data, data.view(torch.uint8))
    assert torch.equal(scales_from_gemm_layout(theirs._rowwise_scale_inv, rows), scale_inv)
    got_data, got_scales = from_float8_blockwise(theirs)
    assert torch.equal(got_data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(got_scales, scale_inv)
    ours = to_float8_blockwise(data, scale_inv, torch.bfloat16, columnwise=True, pow2_scales=pow2)
    assert torch.equal(ours.dequantize(), theirs.dequantize())
    # The columnwise copy: TE's own columnwise cast of the dequantised rows.
    col_only = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=False, columnwise=True,
                                    force_pow_2_scales=pow2, amax_epsilon=0.0, block_scaling_dim=1)
    reference = col_only(blockwise_dequantize(data, scale_inv, torch.float32))
    assert torch.equal(ours._columnwise_data, reference._columnwise_data)
    assert torch.equal(ours._columnwise_scale_inv[:, :256], reference._columnwise_scale_inv[:, :256])
