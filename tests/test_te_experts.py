"""megatron's transformer-engine grouped experts (TEGroupedMLP, the TE spec with moe_grouped_gemm=True)
behind moe_ep's dispatcher, against the same layer behind megatron's alltoall dispatcher, on CUDA ranks
sharing a GPU (transformer-engine needed: these tests skip elsewhere).

Under the fp8 blockwise recipe "deepep" sends the tokens as 1x128 fp8 with their scales and hands the
experts the rows dequantised; alltoall sends bf16 and TE casts them. TE's cast of the dequantised rows
gives back the fp8 values moe_ep sent (power-of-two scales), so the experts compute on the same fp8
operands: their output is the same bits, and only the combine's summation order separates the layers."""
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformer_engine", reason="TE's grouped experts need transformer-engine")

from moe_ep.fp8_blockwise import blockwise_cast_to_fp8, blockwise_dequantize  # noqa: E402

from . import te_experts_fns  # noqa: E402

pytestmark = pytest.mark.gpu

RANKS = 2
# The layer's output and input gradient: bf16 rows summed over the top-k in another order by each dispatcher.
COMBINE_TOLERANCE = dict(rtol=2e-2, atol=2e-2)
# An expert weight's gradient reads TE's 128x1 (columnwise) cast of the expert's input: of the bf16 rows
# (alltoall) or of their fp8 rounding (deepep), a rounding of at most 2**-4 relative each.
WGRAD_RTOL = 2.0**-3


def _rounds(gpu_pools, seed, fp8, **kw):
    pool = gpu_pools(RANKS)
    return {name: pool.run(te_experts_fns.te_layer_round, seed % 10000, name, fp8, **kw)
            for name in ("alltoall", "deepep")}


def _close(ours, theirs, what, **tolerance):
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance.get("rtol", 0) * scale + tolerance.get("atol", 0),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("arena", [True, False])
def test_fp8_dispatch_hands_te_s_experts_the_fp8_rows_te_would_make(gpu_pools, seed, arena):
    runs = _rounds(gpu_pools, seed, fp8=True, moe_ep_options=dict(moe_ep_arena=arena))
    for rank, (ours, theirs) in enumerate(zip(runs["deepep"], runs["alltoall"])):
        where = f"rank {rank}"
        assert ours["expert_counts"] == theirs["expert_counts"], where
        # The rows travelled as TE's 1x128 cast of alltoall's bf16 rows: one rounding, no other.
        fp8_rows = blockwise_dequantize(*blockwise_cast_to_fp8(theirs["expert_rows"].to(torch.bfloat16)),
                                        torch.float32)
        assert torch.equal(ours["expert_rows"], fp8_rows), where
        assert not torch.equal(ours["expert_rows"], theirs["expert_rows"]), f"{where}: the rows should be fp8's"
        # TE cast them again into the same fp8 operands: the experts' output is the same bits.
        assert torch.equal(ours["expert_out"], theirs["expert_out"]), where
        _close(ours["out"], theirs["out"], f"{where} output", **COMBINE_TOLERANCE)
        _close(ours["grad_x"], theirs["grad_x"], f"{where} input gradient", **COMBINE_TOLERANCE)
        assert ours["grads"].keys() == theirs["grads"].keys()
        for name, grad in theirs["grads"].items():
            tolerance = dict(rtol=WGRAD_RTOL) if name.startswith("experts.") else COMBINE_TOLERANCE
            _close(ours["grads"][name], grad, f"{where} {name}", **tolerance)


def test_fp8_dispatch_sends_fp8_under_the_blockwise_recipe_and_bf16_without(gpu_pools, seed):
    """"auto" follows the recipe: fp8 rows and their scales (hidden + 4 * hidden / 128 bytes a row) under
    blockwise fp8, bf16 rows (2 * hidden bytes) without; in bf16 the experts get alltoall's rows exactly.
    A round moves four times a dispatch's rows (dispatch, combine, and their backward, all bf16 but the
    fp8 dispatch), so fp8 saves about (1 - 0.516) / 4 of the round's bytes."""
    fp8 = _rounds(gpu_pools, seed, fp8=True)
    bf16 = _rounds(gpu_pools, seed, fp8=False)
    for rank in range(RANKS):
        assert torch.equal(bf16["deepep"][rank]["expert_rows"], bf16["alltoall"][rank]["expert_rows"])
        _close(bf16["deepep"][rank]["out"], bf16["alltoall"][rank]["out"], f"rank {rank} bf16 output",
               **COMBINE_TOLERANCE)
        fp8_bytes, bf16_bytes = fp8["deepep"][rank]["sent_bytes"], bf16["deepep"][rank]["sent_bytes"]
        assert 0.08 < 1 - fp8_bytes / bf16_bytes < 0.13, (fp8_bytes, bf16_bytes)
