"""The 1x128 per-token FP8 cast against an element-by-element float32 computation."""
import math

import numpy as np
import pytest
import torch

from moe_ep import fp8


def _reference(x: torch.Tensor, round_scale: bool):
    rows = x.float().numpy()
    q = np.empty(rows.shape, dtype=np.float32)
    scales = np.empty((rows.shape[0], rows.shape[1] // 128), dtype=np.float32)
    for i, row in enumerate(rows):
        for b in range(rows.shape[1] // 128):
            block = row[b * 128:(b + 1) * 128]
            amax = max(np.float32(np.abs(block).max()), np.float32(1e-4))
            scale = np.float32(amax) / np.float32(448.0)
            inverse = np.float32(448.0) / np.float32(amax)
            if round_scale:
                scale = np.float32(2.0 ** math.ceil(math.log2(scale)))
                inverse = np.float32(1.0) / scale
            scales[i, b] = scale
            q[i, b * 128:(b + 1) * 128] = block * inverse
    return torch.from_numpy(q).to(torch.float8_e4m3fn), torch.from_numpy(scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_scale", [False, True])
def test_cast_matches_elementwise_reference(seed, dtype, round_scale):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(7, 384, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)).to(dtype)
    x[2, 128:256] = 0  # an all-zero block takes the amax floor
    q, s = fp8.per_token_cast_to_fp8(x, round_scale=round_scale)
    want_q, want_s = _reference(x, round_scale)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_cast_back_is_close_and_exact_on_representable_values(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    q, s = fp8.per_token_cast_to_fp8(x)
    back = fp8.per_token_cast_back(q, s)
    rel = (back.float() - x.float()).norm() / x.float().norm()
    assert rel < 0.05
    # Values already on the e4m3 grid with a power-of-two scale survive the round trip exactly.
    grid = q.float() * 2.0
    q2, s2 = fp8.per_token_cast_to_fp8(grid.to(torch.bfloat16), round_scale=True)
    assert torch.equal(fp8.per_token_cast_back(q2, s2, out_dtype=torch.float32), grid)


def test_ue8m0_packs_exponents_four_to_a_word(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 128 * 6, generator=g).to(torch.bfloat16)
    q, words = fp8.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    q_ref, scales = fp8.per_token_cast_to_fp8(x, round_scale=True)
    assert words.dtype == torch.int32 and words.shape == (3, 2)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    exponents = [[(int(w) >> (8 * i)) & 0xFF for w in row for i in range(4)] for row in words.tolist()]
    for r in range(3):
        for b in range(6):
            assert 2.0 ** (exponents[r][b] - 127) == scales[r, b].item()
        assert exponents[r][6:] == [0, 0]
    assert torch.equal(fp8.expand_scales(words, 128 * 6), scales)


def test_cast_rejects_hidden_not_multiple_of_block():
    with pytest.raises(ValueError, match="multiple of block=128"):
        fp8.per_token_cast_to_fp8(torch.zeros(2, 200, dtype=torch.bfloat16))


def test_ue8m0_needs_round_scale():
    with pytest.raises(ValueError, match="round_scale"):
        fp8.per_token_cast_to_fp8(torch.zeros(2, 128, dtype=torch.bfloat16), use_ue8m0=True)
