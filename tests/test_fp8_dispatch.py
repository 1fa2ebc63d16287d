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
        # Through the softmax's Jacobian each logit's gradient takes the fp8 errors of every expert's
        # output, weighted against their mean: up to about twice one row's bound (1.27x seen in 10,000 seeds).
        scale = res["ref_grad_logits"].abs().max()
        torch.testing.assert_close(res["grad_logits"], res["ref_grad_logits"], rtol=0, atol=2 * FP8_RTOL * scale)


def test_fp8_rows_padded_for_quantization(pools, seed):
    """moe_router_padding_for_quantization with fp8 dispatch: the extra rows (probability 0) are fp8
    rows like the others and every expert's count is aligned, as TE's grouped GEMM needs. 200 tokens a
    rank: every rank receives enough rows to pad each of its experts to the next multiple of 16."""
    results = pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 200,
                           pad_for_fp8=True, blockwise_fp8=True, moe_ep_options=dict(moe_ep_fp8_dispatch="on"))
    for res in results:
        assert all(n % 16 == 0 for n in res["tokens_per_expert"]), res["tokens_per_expert"]
        torch.testing.assert_close(res["out"], res["ref_out"], rtol=0, atol=FP8_RTOL * res["ref_out"].abs().max())
        torch.testing.assert_close(res["grad_x"], res["ref_grad_x"], rtol=1e-5, atol=1e-5)


def test_too_few_received_rows_to_pad_leave_the_counts_as_routed(pools, seed):
    """6 tokens a rank: at most 12 rows arrive, fewer than the 16 an expert's rows would pad to. The counts
    stay as routed (megatron's expert MLP pads them itself) and the layer is still right."""
    results = pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 6,
                           pad_for_fp8=True, blockwise_fp8=True, moe_ep_options=dict(moe_ep_fp8_dispatch="on"))
    for res in results:
        assert all(n <= 12 for n in res["tokens_per_expert"]), res["tokens_per_expert"]
        torch.testing.assert_close(res["out"], res["ref_out"], rtol=0, atol=FP8_RTOL * res["ref_out"].abs().max())
        torch.testing.assert_close(res["grad_x"], res["ref_grad_x"], rtol=1e-5, atol=1e-5)
    assert sum(sum(res["tokens_per_expert"]) for res in results) == 2 * 6 * 2


def test_auto_follows_the_blockwise_recipe_and_falls_back_where_hidden_does_not_fit(pools, seed):
    """"auto" sends fp8 where the config trains with fp8_recipe="blockwise"; with a hidden size that is not
    a multiple of 128 it sends the tokens as they are (warning once), while "on" refuses."""
    fp8 = pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 24, blockwise_fp8=True)
    assert all(not torch.equal(r["out"], r["ref_out"]) for r in fp8)
    plain = pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 32, "deepep", 24, blockwise_fp8=True)
    for res in plain:
        torch.testing.assert_close(res["out"], res["ref_out"], rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="multiple of 128"):
        pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 32, "deepep", 24,
                     moe_ep_options=dict(moe_ep_fp8_dispatch="on"))


def test_auto_sends_the_tokens_as_they_are_where_none_leaves_the_rank(pools, seed):
    """One rank (EP=1): no byte to save, so "auto" skips the cast under the blockwise recipe; "on" still casts."""
    for res in pools(1).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 24,
                            blockwise_fp8=True):
        torch.testing.assert_close(res["out"], res["ref_out"], rtol=1e-5, atol=1e-5)
    for res in pools(1).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 24,
                            moe_ep_options=dict(moe_ep_fp8_dispatch="on")):
        assert not torch.equal(res["out"], res["ref_out"])


def test_on_under_another_fp8_recipe_is_refused_when_the_dispatcher_is_built(pools, seed):
    """'on' sends 1x128 blockwise fp8; under megatron's delayed-scaling recipe the experts would cast those
    rows again in their own format: refused, naming the option and the recipe, before any call."""
    with pytest.raises(Exception, match="moe_ep_fp8_dispatch='on': the config trains with fp8_recipe='delayed'"):
        pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 24, pad_for_fp8=True,
                     moe_ep_options=dict(moe_ep_fp8_dispatch="on"))
    # "auto" under that recipe sends the tokens as they are, exactly.
    for res in pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 128, "deepep", 24,
                            pad_for_fp8=True):
        torch.testing.assert_close(res["out"], res["ref_out"], rtol=1e-5, atol=1e-5)


def test_options_and_megatron_lm_flag():
    import argparse
    import types
    from moe_ep.megatron import add_arguments, apply_arguments, options
    from moe_ep.megatron.options import fp8_dispatch_wanted, options_for
    saved = options_for(types.SimpleNamespace())
    try:
        assert saved.moe_ep_fp8_dispatch == "auto"
        blockwise = types.SimpleNamespace(fp8="e4m3", fp8_recipe="blockwise")
        assert fp8_dispatch_wanted(options_for(blockwise), blockwise)
        for other in (types.SimpleNamespace(fp8=None, fp8_recipe="blockwise"),
                      types.SimpleNamespace(fp8="e4m3", fp8_recipe="delayed"), types.SimpleNamespace()):
            assert not fp8_dispatch_wanted(options_for(other), other)
        forced = types.SimpleNamespace(moe_ep_fp8_dispatch="on")
        assert fp8_dispatch_wanted(options_for(forced), forced)
        off = types.SimpleNamespace(fp8="e4m3", fp8_recipe="blockwise", moe_ep_fp8_dispatch="off")
        assert not fp8_dispatch_wanted(options_for(off), off)
        with pytest.raises(ValueError, match="moe_ep_fp8_dispatch"):
            options_for(types.SimpleNamespace(moe_ep_fp8_dispatch=True))
        parser = add_arguments(argparse.ArgumentParser())
        apply_arguments(parser.parse_args(["--moe-ep-fp8-dispatch", "on"]))
        assert options_for(types.SimpleNamespace()).moe_ep_fp8_dispatch == "on"
        with pytest.raises(SystemExit):
            parser.parse_args(["--moe-ep-fp8-dispatch", "sometimes"])
    finally:
        options.set_defaults(**{f: getattr(saved, f) for f in saved.__dataclass_fields__})


def test_without_transformer_engine_no_te_tensor_is_made():
    from moe_ep.te import check_te_blockwise_format, te_available
    if te_available():
        pytest.skip("transformer-engine imports here")
    check_te_blockwise_format()  # nothing to hold to a format
    with pytest.raises(RuntimeError, match="transformer-engine"):
        from moe_ep.te import to_float8_blockwise
        to_float8_blockwise(torch.zeros(4, 128).to(torch.float8_e4m3fn), torch.ones(4, 1))


def test_training_30_steps_with_fp8_dispatch_tracks_the_bf16_run(tmp_path):
    """EP=2 on CPU ranks: the GPT-MoE of configs/tiny_cpu_fp8.yaml trained 30 steps with the tokens sent
    as fp8 (dequantised for megatron's local experts) and as they are: the losses agree step by step
    within fp8's tolerance, and the fp8 run did send fp8 (its losses are not the same bits)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    losses = {}
    for mode in ("on", "off"):
        log = tmp_path / f"{mode}.jsonl"
        train = os.path.join(root, "examples", "train_moe.py")
        config = os.path.join(root, "configs", "tiny_cpu_fp8.yaml")
        subprocess.run([sys.executable, "-m", "moe_ep.launch", "--nproc", "2", train, "--config", config, "--steps", "30",
                        "--fp8-dispatch", mode, "--json-log", str(log)], check=True, env=env, cwd=root, timeout=600)
        losses[mode] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    fp8, full = losses["on"], losses["off"]
    assert len(fp8) == len(full) == 30
    diffs = [abs(a - b) for a, b in zip(fp8, full)]
    assert max(diffs) <= 0.05, list(zip(fp8, full))
    assert max(diffs) > 0, "the fp8 run should differ in its last bits"
    assert fp8[-1] < 0.25 * fp8[0], "it trains"


def test_a_te_cast_that_differs_from_moe_ep_s_is_found():
    """The check a dispatcher with fp8 dispatch makes of the installed transformer-engine, with stand-ins
    for TE's quantizer: the same cast passes; a scale or a byte off anywhere in the probe is named."""
    from moe_ep.fp8_blockwise import blockwise_cast_to_fp8
    from moe_ep.te import blockwise_format_difference

    def scale_off(rows, pow2, eps):
        data, scales = blockwise_cast_to_fp8(rows, pow2, eps)
        scales = scales.clone()
        scales[-1, -1] *= 2
        return data, scales

    def byte_off(rows, pow2, eps):
        data, scales = blockwise_cast_to_fp8(rows, pow2, eps)
        data = data.view(torch.uint8).clone()
        data[3, 7] ^= 1
        return data.view(torch.float8_e4m3fn), scales

    def compact_layout_missing(rows, pow2, eps):
        data, scales = blockwise_cast_to_fp8(rows, pow2, eps)
        return data, scales.t().contiguous()

    cpu = torch.device("cpu")
    for pow2 in (True, False):
        assert blockwise_format_difference(blockwise_cast_to_fp8, cpu, pow2, 0.0) is None
        assert blockwise_format_difference(scale_off, cpu, pow2, 0.0) == "scales"
        assert blockwise_format_difference(byte_off, cpu, pow2, 0.0) == "e4m3 data"
        assert blockwise_format_difference(compact_layout_missing, cpu, pow2, 0.0) == "scales"
