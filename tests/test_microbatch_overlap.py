"""megatron-core's micro-batch overlap (overlap_moe_expert_parallel_comm, and delay_wgrad_compute with it)
with moe_ep's dispatcher ("deepep") and with megatron's flex dispatcher on moe_ep (install_as_deep_ep):
a bf16 GPT-MoE trained through megatron's combined 1F1B schedule gives the losses and gradients it gives
one micro-batch at a time; the config checks accept what works and refuse what does not.

On CPU ranks the combined schedule runs with cpu_support's stand-ins for its streams and events: the
same nodes in the same order, each micro-batch's forward interleaved layer by layer with the previous
one's backward, so the results must be equal bit for bit. With one layer the forward and the backward
interleave on the same dispatcher. The overlapped runs go through late_delivery.LateDelivery: an
asynchronous call's rows are NaN until its event is waited for, so a node that read them early would show."""
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from . import microbatch_overlap_fns  # noqa: E402


def _assert_same_training(overlapped, one_by_one, rtol=0.0, atol=0.0):
    for rank, (ours, reference) in enumerate(zip(overlapped, one_by_one)):
        for step, (a, b) in enumerate(zip(ours, reference)):
            torch.testing.assert_close(a["losses"], b["losses"], rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank}, step {step}, losses: {m}")
            assert a["grads"].keys() == b["grads"].keys()
            for name in a["grads"]:
                torch.testing.assert_close(a["grads"][name], b["grads"][name], rtol=rtol, atol=atol,
                                           msg=lambda m: f"rank {rank}, step {step}, {name}: {m}")


def _train(pool, seed, dispatcher_type, overlap, **kw):
    return pool.run(microbatch_overlap_fns.train_gpt, seed % 10000, dispatcher_type, overlap, **kw)


@pytest.mark.parametrize("num_layers, arena", [(1, True), (2, False)])
def test_deepep_trains_alike_with_and_without_microbatch_overlap(pools, seed, num_layers, arena):
    """Three micro-batches a step, two steps; moe_ep_arena=False also lets megatron free the received
    rows and the combine's input right after their nodes' forward."""
    kw = dict(num_layers=num_layers, moe_ep_options=dict(moe_ep_arena=arena))
    overlapped = _train(pools(2), seed, "deepep", True, late_delivery=True, **kw)
    _assert_same_training(overlapped, _train(pools(2), seed, "deepep", False, **kw))


def test_flex_on_moe_ep_trains_alike_with_and_without_microbatch_overlap(pools, seed):
    overlapped = _train(pools(2), seed, "flex", True, late_delivery=True)
    _assert_same_training(overlapped, _train(pools(2), seed, "flex", False))


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_ep.megatron  # noqa: F401  (registers "deepep")
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                  moe_token_dispatcher_type="deepep", expert_model_parallel_size=2, bf16=True,
                  overlap_moe_expert_parallel_comm=True)
    return TransformerConfig(**dict(fields, **kw))


def test_the_config_accepts_microbatch_overlap_and_delayed_wgrad_with_deepep():
    assert _config().overlap_moe_expert_parallel_comm
    assert _config(delay_wgrad_compute=True).delay_wgrad_compute
    assert _config(moe_shared_expert_intermediate_size=32).overlap_moe_expert_parallel_comm
    assert _config(overlap_moe_expert_parallel_comm=False, moe_shared_expert_intermediate_size=32,
                   moe_shared_expert_overlap=True).moe_shared_expert_overlap
    assert _config().moe_token_dispatcher_type == "deepep"


def test_the_config_still_refuses_what_megatron_refuses_with_the_overlap():
    with pytest.raises(AssertionError, match="disable moe_shared_expert_overlap"):
        _config(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True)
    with pytest.raises(AssertionError, match="only supported with expert model parallelism"):
        _config(expert_model_parallel_size=1)
    with pytest.raises(AssertionError, match="only supported with bf16 or fp16"):
        _config(bf16=False)
    with pytest.raises(AssertionError, match="overlap_moe_expert_parallel_comm must be enabled"):
        _config(overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=True)


def test_overlap_chunks_are_refused_with_microbatch_overlap():
    from moe_ep.megatron.options import options_for

    with pytest.raises(ValueError, match="moe_ep_overlap_chunks: expected 1 with overlap_moe_expert_parallel_comm"):
        options_for(types.SimpleNamespace(moe_ep_overlap_chunks=2, overlap_moe_expert_parallel_comm=True))
    assert options_for(types.SimpleNamespace(moe_ep_overlap_chunks=2)).moe_ep_overlap_chunks == 2


def test_the_policy_keeps_what_deepep_reads_wherever_megatron_keeps_it():
    """megatron-core moved should_free_input between 0.16 and 0.19: the installed one's is wrapped, and a
    "deepep" layer's dispatch input (the router's input) is never freed, nor the arena's rows."""
    import inspect

    from moe_ep.megatron import microbatch_overlap

    wrapped = microbatch_overlap.keep_the_inputs_deepep_needs()
    assert wrapped, "no should_free_input wrapped in this megatron-core"
    for module_name in wrapped:
        policy = __import__(module_name, fromlist=["should_free_input"]).should_free_input
        assert policy._moe_ep_wrapped
        extra = (2,) if len(inspect.signature(policy.__wrapped__).parameters) > 3 else ()
        for arena in (True, False):
            config = _config(moe_token_dispatcher_type="deepep")
            config.moe_ep_arena = arena
            assert not policy("moe_dispatch", True, config, *extra)
            for name in ("mlp", "moe_combine"):
                if arena:
                    assert not policy(name, True, config, *extra)
                else:  # the two-pass rows are ordinary tensors: megatron's own choice stands
                    assert policy(name, True, config, *extra) == policy.__wrapped__(name, True, config, *extra)


def test_a_megatron_core_without_a_known_policy_refuses_the_overlap(monkeypatch):
    """A megatron-core whose combined 1F1B schedule frees inputs by a policy moe_ep cannot find would free
    the router's input: the config check refuses the overlap, naming it, instead of training on freed memory."""
    from moe_ep.megatron import microbatch_overlap

    monkeypatch.setattr(microbatch_overlap, "_POLICY_MODULES", ("megatron.core.no_such_module",))
    with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm .*should_free_input"):
        _config()
    assert not _config(overlap_moe_expert_parallel_comm=False).overlap_moe_expert_parallel_comm


# bf16 parameters: on a GPU the streams may order the exchanges differently, not the arithmetic; the
# tolerance allows a last-bit difference where a kernel's reduction order depends on its launch.
GPU_TOLERANCE = dict(rtol=1.6e-2, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("arena", [True, False])
def test_microbatch_overlap_on_cuda_ranks(gpu_pools, seed, arena):
    """The schedule's real streams and events, the Buffer's kernels, and with the arena the received rows
    kept in it until their node's backward."""
    kw = dict(num_layers=2, moe_ep_options=dict(moe_ep_arena=arena), cuda=True)
    overlapped = _train(gpu_pools(2), seed, "deepep", True, **kw)
    _assert_same_training(overlapped, _train(gpu_pools(2), seed, "deepep", False, **kw), **GPU_TOLERANCE)


@pytest.mark.gpu
def test_delayed_wgrad_on_cuda_ranks(gpu_pools, seed):
    """delay_wgrad_compute: transformer-engine's layers compute their weight gradients when the schedule
    asks (megatron has no such split without transformer-engine)."""
    pytest.importorskip("transformer_engine", reason="delay_wgrad_compute needs transformer-engine's layers")
    kw = dict(num_layers=2, use_te=True, cuda=True)
    overlapped = _train(gpu_pools(2), seed, "deepep", True, delay_wgrad=True, **kw)
    _assert_same_training(overlapped, _train(gpu_pools(2), seed, "deepep", False, **kw), **GPU_TOLERANCE)
