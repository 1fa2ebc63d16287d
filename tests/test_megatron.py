"""The megatron-core dispatcher ("deepep" type) on CPU ranks: forward and gradients equal the dense
MoE layer and megatron's own alltoall dispatcher."""
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from . import megatron_fns  # noqa: E402


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_deepep_dispatcher_matches_dense_layer_and_alltoall(pools, seed, num_ranks):
    args = (seed % 10000, num_ranks * 2, 2, 32)
    ours = pools(num_ranks).run(megatron_fns.moe_forward_backward, *args, "deepep", 24)
    theirs = pools(num_ranks).run(megatron_fns.moe_forward_backward, *args, "alltoall", 24)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for key in ("out", "grad_x", "grad_logits"):
            torch.testing.assert_close(a[key], a["ref_" + key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key} vs dense: {m}")
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key} vs alltoall: {m}")
        assert a["tokens_per_expert"] == b["tokens_per_expert"]
