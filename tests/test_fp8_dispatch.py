"""FP8 dispatch through the megatron dispatcher (moe_ep_fp8_dispatch) on CPU ranks: tokens cast once
with transformer-engine's 1x128 quantizer, sent with their scales, permuted together and dequantised
for experts that are not TE's; gradients in bf16/fp32 as before."""
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from . import megatron_fns  # noqa: E402

# One e4m3 rounding of each token (3 mantissa bits: relative error at most 2**-4) through a linear expert.
FP8_RTOL = 2.0**-4


@pytest.mark.parametrize("arena", [True, False])
def test_fp8_dispatch_matches_the_dense_layer_within_fp8_tolerance(pools, seed, arena):
    results = pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 24,
                           moe_ep_options=dict(moe_ep_fp8_dispatch="on", moe_ep_arena=arena))
    for rank, res in enumerate(results):
        scale = res["ref_out"].abs().max()
        torch.testing.assert_close(res["out"], res["ref_out"], rtol=0, atol=FP8_RTOL * scale,
                                   msg=lambda m: f"rank {rank} out: {m}")
        assert not torch.equal(res["out"], res["ref_out"]), "the tokens should have travelled as fp8"
        # A linear expert's input gradient does not depend on its input: the bf16 backward is exact.
        torch.testing.assert_close(res["grad_x"], res["ref_grad_x"], rtol=1e-5, atol=1e-5)
        scale = res["ref_grad_logits"].abs().max()
        torch.testing.assert_close(res["grad_logits"], res["ref_grad_logits"], rtol=0, atol=FP8_RTOL * scale)
