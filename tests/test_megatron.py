"""The megatron-core dispatcher ("deepep" type) on CPU ranks: forward and gradients equal the dense
MoE layer and megatron's own alltoall dispatcher, with moe_ep's arena (the default) and without; and
moe_ep's options for it."""
import argparse
import dataclasses
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from . import megatron_fns  # noqa: E402


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("arena", [True, False])
def test_deepep_dispatcher_matches_dense_layer_and_alltoall(pools, seed, num_ranks, arena):
    args = (seed % 10000, num_ranks * 2, 2, 32)
    ours = pools(num_ranks).run(megatron_fns.moe_forward_backward, *args, "deepep", 24,
                                moe_ep_options=dict(moe_ep_arena=arena))
    theirs = pools(num_ranks).run(megatron_fns.moe_forward_backward, *args, "alltoall", 24)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for key in ("out", "grad_x", "grad_logits"):
            torch.testing.assert_close(a[key], a["ref_" + key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key} vs dense: {m}")
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key} vs alltoall: {m}")
        assert a["tokens_per_expert"] == b["tokens_per_expert"]


def test_layers_share_one_buffer(pools, seed):
    """Every MoE layer's dispatcher over a group uses one Buffer (one communication stream for all their
    calls, peers' memory mapped once), as DeepEP's megatron integration does; moe_ep.megatron.shared_buffers()
    lists it (its topology() says what served the calls)."""
    assert all(pools(2).run(megatron_fns.layers_share_a_buffer, seed % 10000, 4, 2, 32, 24))


def test_the_arena_in_the_dispatcher_changes_nothing(pools, seed):
    """With the arena (the default) the dispatcher's unpermute writes into Buffer.empty_combine_input;
    without it (moe_ep_arena=False) into a tensor of its own: the forward and the gradients are the same
    bits either way."""
    args = (seed % 10000, 4, 2, 32)
    with_arena = pools(2).run(megatron_fns.moe_forward_backward, *args, "deepep", 24)
    without = pools(2).run(megatron_fns.moe_forward_backward, *args, "deepep", 24,
                           moe_ep_options=dict(moe_ep_arena=False))
    for rank, (a, b) in enumerate(zip(with_arena, without)):
        for key in ("out", "grad_x", "grad_logits"):
            assert torch.equal(a[key], b[key]), f"rank {rank} {key}"


# Against the dense float32 layer: float32 rounding, or bfloat16's (tokens and experts in bf16).
DENSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _assert_like_dense(results, dtype):
    for rank, res in enumerate(results):
        for key in ("out", "grad_x", "grad_logits"):
            assert torch.isfinite(res[key]).all(), f"rank {rank} {key}: not finite"
            limit = DENSE_TOLERANCE[dtype] * max(1.0, float(res["ref_" + key].abs().max()))
            torch.testing.assert_close(res[key], res["ref_" + key], rtol=0, atol=limit,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arena", [True, False])
def test_deepep_dispatcher_on_cuda_ranks_runs_on_the_kernels(gpu_pools, seed, arena, dtype):
    """CUDA ranks sharing the GPU (the intranode kernels move the tokens), with the arena (the one-pass
    calls, the default) and without, tokens in float32 and in bfloat16 (what mixed-precision training
    sends): the forward and gradients of the dense layer."""
    from moe_ep import _native
    if not _native.has_kernels():
        pytest.skip(str(_native.unavailable_reason()))
    _assert_like_dense(gpu_pools(4).run(megatron_fns.moe_forward_backward, seed % 10000, 8, 2, 64, "deepep", 24,
                                        cuda=True, moe_ep_options=dict(moe_ep_arena=arena), dtype=dtype), dtype)


def test_bf16_tokens_on_cpu_ranks_match_the_dense_layer(pools, seed):
    """bfloat16 tokens and experts through the portable backend: the dense layer to bf16's rounding."""
    _assert_like_dense(pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 64, "deepep", 24,
                                    dtype=torch.bfloat16), torch.bfloat16)


def test_flex_dispatcher_runs_on_moe_ep_through_install_as_deep_ep(pools, seed):
    results = pools(2).run(megatron_fns.flex_on_moe_ep, seed % 10000, 4, 2, 32, 12)
    for rank, res in enumerate(results):
        for key in ("out", "grad_x", "grad_logits"):
            torch.testing.assert_close(res[key], res["ref_" + key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("shared_experts", [False, True])
def test_transformer_config_with_deepep_builds_an_moe_layer_on_moe_ep(pools, shared_experts):
    ours = pools(2).run(megatron_fns.build_moe_layer, 4, 2, 32, "deepep", shared_experts)
    theirs = pools(2).run(megatron_fns.build_moe_layer, 4, 2, 32, "alltoall", shared_experts)
    for (name, out, grad), (_, ref_out, ref_grad) in zip(ours, theirs):
        assert name == "MoEEPTokenDispatcher"
        assert out.shape == (6, 2, 32)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_topk", [1, 2])
def test_group_limited_routing_reaches_at_most_group_topk_nodes(pools, seed, group_topk):
    # 4 ranks as 4 "nodes" of one rank each: groups = nodes, 4 experts per node, top-4.
    for max_nodes, per_node_total, token_nodes in pools(4).run(megatron_fns.group_limited_layout,
                                                              seed % 10000, 16, 4, 1, group_topk):
        assert max_nodes <= group_topk
        assert per_node_total == token_nodes, "num_tokens_per_rdma_rank counts each token once per node"


def test_tensor_and_expert_parallel_groups(pools, seed):
    """TP=2 x EP=2 on 4 ranks: tokens reach both TP ranks of their experts' group; outputs equal the
    dense layer."""
    for rank, res in enumerate(pools(4).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 32, "deepep",
                                            16, tp=2)):
        for key in ("out", "grad_x", "grad_logits"):
            torch.testing.assert_close(res[key], res["ref_" + key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


def test_padding_for_quantization_aligns_expert_rows(pools, seed):
    """200 tokens a rank: every rank receives enough rows to pad each of its experts to a multiple of 16."""
    for rank, res in enumerate(pools(2).run(megatron_fns.moe_forward_backward, seed % 10000, 4, 2, 32, "deepep",
                                            200, pad_for_fp8=True)):
        assert all(n % 16 == 0 for n in res["tokens_per_expert"]), res["tokens_per_expert"]
        for key in ("out", "grad_x", "grad_logits"):
            torch.testing.assert_close(res[key], res["ref_" + key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


def test_dropped_routes_as_with_a_capacity_limit(pools, seed):
    """Pairs dropped from the routing map (capacity) become -1 slots; results still match alltoall.
    The capacity factor tells the dispatchers that routes may be missing (megatron-core >= 0.19 sizes a
    dropless alltoall output as tokens x top-k); the routing map itself is thinned by hand."""
    args = (seed % 10000, 8, 3, 32)
    capacity = dict(moe_expert_capacity_factor=1.0)
    ours = pools(4).run(megatron_fns.moe_forward_backward, *args, "deepep", 20, drop=0.4, **capacity)
    theirs = pools(4).run(megatron_fns.moe_forward_backward, *args, "alltoall", 20, drop=0.4, **capacity)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for key in ("out", "grad_x", "grad_logits"):
            torch.testing.assert_close(a[key], a["ref_" + key], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)


@pytest.fixture
def option_defaults():
    """moe_ep.megatron.options' process-wide defaults, put back as they were after the test."""
    from moe_ep.megatron import options
    saved = options.options_for(types.SimpleNamespace())
    yield options
    options.set_defaults(**dataclasses.asdict(saved))


def test_megatron_lm_arguments_accept_deepep(option_defaults):
    from moe_ep.megatron import add_arguments, apply_arguments
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    add_arguments(parser)
    args = parser.parse_args(["--moe-token-dispatcher-type", "deepep", "--moe-ep-num-sms", "24"])
    assert args.moe_token_dispatcher_type == "deepep" and args.moe_ep_num_sms == 24
    apply_arguments(args)
    assert option_defaults.options_for(types.SimpleNamespace()).moe_ep_num_sms == 24


def test_apply_arguments_sets_the_defaults_it_was_given(option_defaults):
    """Megatron-LM's --moe-ep-* flags become the defaults of configs without moe_ep_* attributes; a flag
    left out leaves its default alone."""
    from moe_ep.megatron import DispatcherOptions, add_arguments, apply_arguments
    parser = add_arguments(argparse.ArgumentParser())
    bare = types.SimpleNamespace()
    apply_arguments(parser.parse_args([]))
    assert option_defaults.options_for(bare) == DispatcherOptions()
    assert DispatcherOptions().moe_ep_arena is True, "the arena is on by default"
    apply_arguments(parser.parse_args(["--no-moe-ep-arena", "--moe-ep-timeout-s", "7.5"]))
    assert option_defaults.options_for(bare) == DispatcherOptions(moe_ep_arena=False, moe_ep_timeout_s=7.5)
    apply_arguments(parser.parse_args(["--moe-ep-arena", "--moe-ep-num-sms", "16"]))
    assert option_defaults.options_for(bare) == DispatcherOptions(moe_ep_arena=True, moe_ep_num_sms=16,
                                                                  moe_ep_timeout_s=7.5)
    apply_arguments(parser.parse_args(["--moe-ep-log-metrics"]))
    assert option_defaults.options_for(bare).moe_ep_log_metrics is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-ep-arena", "sometimes"])


def test_a_config_attribute_wins_over_the_defaults(option_defaults):
    """A TransformerConfig's own moe_ep_* attributes win over the process-wide defaults; where it has
    none, megatron-core's moe_deepep_num_sms gives the SM budget."""
    option_defaults.set_defaults(moe_ep_arena=False, moe_ep_num_sms=24, moe_ep_timeout_s=30.0)
    config = types.SimpleNamespace(moe_ep_arena=True, moe_ep_timeout_s=5.0)
    got = option_defaults.options_for(config)
    assert (got.moe_ep_arena, got.moe_ep_num_sms, got.moe_ep_timeout_s) == (True, 24, 5.0)
    option_defaults.set_defaults(moe_ep_num_sms=None)
    assert option_defaults.options_for(types.SimpleNamespace(moe_deepep_num_sms=20)).moe_ep_num_sms == 20
    both = types.SimpleNamespace(moe_ep_num_sms=16, moe_deepep_num_sms=20)
    assert option_defaults.options_for(both).moe_ep_num_sms == 16


def test_a_bad_option_is_refused(option_defaults):
    with pytest.raises(TypeError, match="moe_ep_arena: expected a bool, got str"):
        option_defaults.options_for(types.SimpleNamespace(moe_ep_arena="no"))
    with pytest.raises(TypeError, match="moe_ep_log_metrics: expected a bool, got int"):
        option_defaults.options_for(types.SimpleNamespace(moe_ep_log_metrics=1))
    with pytest.raises(TypeError, match="moe_ep_zero_copy"):
        option_defaults.set_defaults(moe_ep_zero_copy="both")
    assert option_defaults.options_for(types.SimpleNamespace()) == option_defaults.DispatcherOptions()


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("capacity", [False, True])
def test_logged_expert_load_equals_the_routing(pools, seed, chunks, capacity):
    """moe_ep_log_metrics: after two micro-batches through two layers, megatron's track_moe_metrics writes
    per layer each expert's tokens (what the routers routed, summed over every rank) and the mean over the
    layers; on CPU ranks every call is exposed communication (the calls end before they return). Under
    capacity padding (the counts stay on the device) the routers' drops are left out alike."""
    num_experts = 4
    options = dict(moe_ep_log_metrics=True, moe_ep_overlap_chunks=chunks)
    if capacity:
        options.update(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    for rank, (logged, routed, records) in enumerate(
            pools(2).run(megatron_fns.logged_expert_load, seed % 10000, num_experts, 2, 32, 2, options)):
        assert records == [True, True]
        for expert in range(num_experts):
            for layer in range(2):
                assert logged[f"moe/moe_ep/expert_{expert}_tokens_layer_{layer}"] == routed[layer, expert], (rank, expert)
            assert logged[f"moe_ep/expert_{expert}_tokens"] == routed[:, expert].sum().item() / 2
        for layer in range(2):
            comm = logged[f"moe/moe_ep/comm_ms_layer_{layer}"]
            assert comm > 0
            assert logged[f"moe/moe_ep/exposed_comm_ms_layer_{layer}"] == pytest.approx(comm, rel=1e-6)
            assert logged[f"moe/moe_ep/hidden_comm_ms_layer_{layer}"] == pytest.approx(0, abs=1e-6)


def test_no_metrics_are_recorded_when_off(pools, seed):
    for logged, _, records in pools(2).run(megatron_fns.logged_expert_load, seed % 10000, 4, 2, 32, 1, {}):
        assert records == [False, False]
        assert logged == {}


def test_logged_communication_time_on_cuda_ranks(gpu_pools, seed):
    """On the kernels the forward's calls run on the communication stream: the logged expert load is
    still the routing, and the exposed time is the part of the communication time the layer waited for."""
    from moe_ep import _native
    if not _native.has_kernels():
        pytest.skip(str(_native.unavailable_reason()))
    for logged, routed, _ in gpu_pools(4).run(megatron_fns.logged_expert_load, seed % 10000, 8, 2, 64, 2,
                                              dict(moe_ep_log_metrics=True), cuda=True):
        for expert in range(8):
            for layer in range(2):
                assert logged[f"moe/moe_ep/expert_{expert}_tokens_layer_{layer}"] == routed[layer, expert]
        for layer in range(2):
            comm = logged[f"moe/moe_ep/comm_ms_layer_{layer}"]
            exposed = logged[f"moe/moe_ep/exposed_comm_ms_layer_{layer}"]
            assert comm > 0 and 0 <= exposed <= comm
            assert logged[f"moe/moe_ep/hidden_comm_ms_layer_{layer}"] == pytest.approx(comm - exposed, abs=1e-3)


def test_the_router_runs_without_transformer_engine_and_without_cpu_patches():
    """megatron-core 0.16.1's router reads a name bound only where transformer-engine imports; importing
    moe_ep.megatron binds it, so a router with moe_router_dtype set runs on a machine without TE (a GPU
    one included) without the CPU stand-ins. Run in a fresh interpreter, where nothing patched megatron."""
    import subprocess
    import sys

    code = ("import torch, moe_ep.megatron\n"
            "from megatron.core.transformer.moe import moe_utils\n"
            "x, w = torch.randn(6, 8), torch.randn(4, 8)\n"
            "out = moe_utils.router_gating_linear(x, w, None, torch.float32)\n"
            "assert torch.allclose(out, x @ w.t(), atol=1e-5), out\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("fields, message", [
    (dict(moe_ep_num_sms=7), "moe_ep_num_sms: expected a multiple of 2, got 7"),
    (dict(moe_deepep_num_sms=5), "moe_deepep_num_sms: expected a multiple of 2, got 5"),
    (dict(moe_ep_timeout_s=-1), "moe_ep_timeout_s: expected a number of seconds from 0.001"),
])
def test_option_values_are_refused_under_the_configs_names(fields, message):
    """An SM budget or timeout the Buffer would refuse is refused when the options are read, naming the
    config's attribute, not the Buffer's argument."""
    import types

    from moe_ep.megatron.options import options_for
    with pytest.raises(ValueError, match=f"^{message}"):
        options_for(types.SimpleNamespace(**fields))
