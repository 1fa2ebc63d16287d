"""Training scripts set torch's default device and dtype (torch.set_default_device('cuda'),
torch.set_default_dtype(torch.bfloat16)) before they use the library: whole rounds through the public
API must give the bits they give under torch's own defaults, every tensor the library makes naming its
device and dtype.

On CPU ranks the default device is "meta" besides: a tensor made there holds no data, so one the library
made without naming its device fails the round instead of passing unnoticed.
"""
import pytest
import torch

from moe_ep import _native, fp8

from . import rank_fns
from .problems import Problem
from .problems import same_bits as _same

NORMAL_ROUNDS = ("normal_bf16", "normal_fp8")
NORMAL_FIELDS = ("layout", "recv_x", "recv_idx", "recv_w", "counts", "cached", "cached_rest", "combined", "combined_w",
                 "num_recv_rows")
LOW_LATENCY_ROUNDS = ("low_latency_bf16", "low_latency_fp8")
KERNELS = {"MOE_EP_BACKEND": "kernels"}


def _problem(seed, num_ranks):
    return Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=32)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _compare(seed, got, want):
    """rank_fns.rounds_under_defaults' results, per rank: the same bits (rows of a low-latency recv_x
    past recv_count are not data and are not compared)."""
    for rank, (g, w) in enumerate(zip(got, want)):
        for name in NORMAL_ROUNDS:
            for field in NORMAL_FIELDS:
                assert _same(g[name][field], w[name][field]), f"seed {seed} rank {rank}: {name} {field}"
        for name in LOW_LATENCY_ROUNDS:
            where = f"seed {seed} rank {rank}: {name}"
            gr, wr = g[name], w[name]
            for field in ("recv_count", "stats", "combined"):
                assert _same(gr[field], wr[field]), f"{where} {field}"
            assert gr["count_before_hook"].sum() == wr["count_before_hook"].sum(), f"{where} counts before the hook"
            assert gr["zero_copy_in_place"] == wr["zero_copy_in_place"], f"{where} zero-copy rows"
            parts_g = gr["recv_x"] if isinstance(gr["recv_x"], tuple) else (gr["recv_x"],)
            parts_w = wr["recv_x"] if isinstance(wr["recv_x"], tuple) else (wr["recv_x"],)
            assert len(parts_g) == len(parts_w), f"{where} recv_x parts"
            for part_g, part_w in zip(parts_g, parts_w):
                assert part_g.dtype == part_w.dtype and part_g.shape == part_w.shape, f"{where} recv_x"
                for expert, n in enumerate(wr["recv_count"].tolist()):
                    assert torch.equal(_bits(part_g[expert, :n]), _bits(part_w[expert, :n])), \
                        f"{where} expert {expert} rows"


def test_ue8m0_scales_expand_to_float32_under_any_default_dtype():
    x = torch.randn(3, 512, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    _, scales = fp8.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    want = fp8.expand_scales(scales, 512)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = fp8.expand_scales(scales, 512)
    finally:
        torch.set_default_dtype(saved)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("default_device", [None, "meta"])
def test_rounds_under_a_bf16_default_dtype_give_the_same_bits(pools, seed, num_ranks, default_device):
    p = _problem(seed, num_ranks)
    want = pools(num_ranks).run(rank_fns.rounds_under_defaults, p)
    got = pools(num_ranks).run(rank_fns.rounds_under_defaults, p, torch.bfloat16, default_device)
    _compare(seed, got, want)
    # The defaults are restored: later calls in the same ranks run under torch's own.
    _compare(seed, pools(num_ranks).run(rank_fns.rounds_under_defaults, p), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason()))
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_rounds_under_a_cuda_default_device_give_the_same_bits(gpu_pools, seed, num_ranks):
    """The kernels' calls (intranode and low-latency) with CUDA tensors, under
    torch.set_default_device('cuda') and a bf16 default dtype."""
    p = _problem(seed, num_ranks)
    want = gpu_pools(num_ranks).run(rank_fns.with_env, KERNELS, rank_fns.rounds_under_defaults, p)
    got = gpu_pools(num_ranks).run(rank_fns.with_env, KERNELS, rank_fns.rounds_under_defaults, p, torch.bfloat16,
                                   "cuda")
    _compare(seed, got, want)
