"""The parts of the API around the data path: configs, size hints, events, lifetime, backend info."""
import pytest
import torch

import moe_ep
from moe_ep import Buffer, Config, EventOverlap
from moe_ep.buffer import default_config_size_hints

from . import rank_fns


def test_module_exports_the_deep_ep_names():
    assert moe_ep.topk_idx_t is torch.int64
    assert isinstance(moe_ep.__version__, str)
    for name in ("Buffer", "Config", "EventOverlap", "fp8", "backend_info"):
        assert hasattr(moe_ep, name)


def test_backend_info_says_why_without_the_extension():
    info = moe_ep.backend_info()
    assert info["cpu_tensors_run_on"].startswith("portable")
    if not info["cuda_kernels"]:
        assert info["reason"] and "portable" in info["cuda_tensors_run_on"]
        assert Buffer.is_sm90_compiled() is False


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5, 8, 16, 24, 64])
def test_configs_exist_for_any_rank_count_and_hints_grow_with_hidden(num_ranks):
    for config in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
        assert config.num_sms == Buffer.num_sms
        small = config.get_nvl_buffer_size_hint(2048, num_ranks)
        large = config.get_nvl_buffer_size_hint(14336, num_ranks)
        assert 0 < small < large and large % 128 == 0
        rdma = config.get_rdma_buffer_size_hint(14336, num_ranks)
        assert (rdma > 0) == (num_ranks > 8)


def test_low_latency_hint_covers_both_halves_of_the_buffer():
    hint = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    # At least two receive regions of one bf16 row per (expert, token) slot.
    assert hint >= 2 * 256 * 128 * 7168 * 2
    assert hint < 4 * 2 * 256 * 128 * 7168 * 2
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288) > hint


def test_set_num_sms_changes_the_default_configs():
    before = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        assert Buffer.get_dispatch_config(8).num_sms == 24
    finally:
        Buffer.set_num_sms(before)


def test_config_positional_order_is_deep_eps():
    c = Config(24, 8, 256, 6, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (24, 8, 256, 6, 128)


def test_the_combine_streams_from_four_ranks_unless_forced():
    from moe_ep.backends.choices import overridden
    from moe_ep.backends.intranode import use_stream_combine
    assert [use_stream_combine(r) for r in (2, 3, 4, 8)] == [False, False, True, True]
    with overridden(stream_combine=True):
        assert use_stream_combine(2)
    with overridden(stream_combine=False):
        assert not use_stream_combine(8)
    assert use_stream_combine(8), "the choice is the default again after the block"


def test_kernel_choices_are_overridden_for_a_block_and_checked():
    """The kernels' own choices: the library's picks by default, another value inside overridden() only,
    and a bad value or name refused without changing any."""
    from moe_ep.backends.choices import KernelChoices, kernel_choices, overridden
    assert kernel_choices == KernelChoices()
    assert (kernel_choices.peer_memory, kernel_choices.low_latency_memory, kernel_choices.stream_combine) == \
        ("auto", "auto", None)
    assert kernel_choices.fit_blocks and kernel_choices.rendezvous
    assert not kernel_choices.profile_waits and not kernel_choices.low_latency_puts
    with overridden(fit_blocks=False, rendezvous=False, profile_waits=True) as inside:
        assert inside is kernel_choices
        assert (inside.fit_blocks, inside.rendezvous, inside.profile_waits) == (False, False, True)
    assert kernel_choices == KernelChoices()
    with pytest.raises(RuntimeError, match="raised inside"):
        with overridden(peer_memory="ipc"):
            raise RuntimeError("raised inside")
    assert kernel_choices == KernelChoices(), "an exception in the block leaves the defaults behind too"
    with pytest.raises(ValueError, match="low_latency_memory: expected one of"):
        with overridden(fit_blocks=False, low_latency_memory="shared"):
            pass
    with pytest.raises(TypeError, match="fit"):
        with overridden(fit=False):
            pass
    assert kernel_choices == KernelChoices()


def test_backend_environment_variable(monkeypatch):
    """MOE_EP_BACKEND=portable keeps CUDA tensors on the portable backend and says so; an unknown value is
    refused by name."""
    monkeypatch.setenv("MOE_EP_BACKEND", "portable")
    info = moe_ep.backend_info()
    assert info["cuda_kernels"] is False and info["reason"] == "MOE_EP_BACKEND=portable"
    monkeypatch.setenv("MOE_EP_BACKEND", "fast")
    with pytest.raises(ValueError, match="MOE_EP_BACKEND: expected one of auto, portable, kernels, got 'fast'"):
        moe_ep.backend_info()


@pytest.mark.parametrize("backend", ["kernels", "portable"])
def test_buffers_the_kernels_cannot_serve(pools, backend):
    """MOE_EP_BACKEND=kernels: a Buffer the kernels cannot serve (here a group of two one-rank nodes where
    the internode module is not built, or on a machine without the extension any Buffer) raises a
    RuntimeError that says why, for its normal and its low-latency calls alike; MOE_EP_BACKEND=portable
    takes it on the portable backend. Where the internode module is built, its kernels serve both."""
    from moe_ep import _native
    outcomes = pools(2).run(rank_fns.with_env, {"MOE_EP_BACKEND": backend}, rank_fns.buffers_the_kernels_cannot_serve)
    reason = _native.internode_unavailable_reason()
    why = _native.unavailable_reason() or f"the group spans 2 nodes of 1 ranks and {reason}"
    for (normal, low_latency) in outcomes:
        if backend == "portable" or reason is None:
            assert normal == low_latency == ("returned", ""), (normal, low_latency)
            continue
        for (kind, message), calls in ((normal, "normal"), (low_latency, "low-latency")):
            assert kind == "RuntimeError", (kind, message)
            assert message.startswith(f"MOE_EP_BACKEND=kernels: the kernels cannot serve this Buffer's {calls} calls")
            assert why in message, message


def test_event_overlap_on_cpu_is_an_empty_event():
    event = Buffer.capture()
    assert isinstance(event, EventOverlap)
    with event:
        pass
    event.current_stream_wait()
    assert EventOverlap(None, [torch.zeros(1)]).extra_tensors[0].numel() == 1


def test_buffer_views_cleanup_and_destroy(pools):
    for res in pools(2).run(rank_fns.buffer_lifecycle):
        assert res["shared"], "two views of the same bytes see the same data"
        assert res["cleaned"], "clean_low_latency_buffer zeroes the staging buffer"
        assert "exceed the nvl buffer of 4096 bytes" in res["too_big"]
        assert "destroyed" in res["after_destroy"]
        # A stream object does not pickle (a GPU machine's CPU ranks get the current CUDA stream): its type.
        assert res["comm_stream"] == ("Stream" if torch.cuda.is_available() else "NoneType")
        assert res["ranks_per_node"] == 2, "both ranks run on this host"


def test_layout_counts_tokens_once_per_node(pools):
    for topk_idx, per_rdma, in_rank in pools(4).run(rank_fns.layout_across_nodes, 2):
        experts_per_node = 2 * 2
        want = torch.zeros(2, dtype=torch.int32)
        for row in topk_idx.tolist():
            for node in {e // experts_per_node for e in row if e >= 0}:
                want[node] += 1
        assert torch.equal(per_rdma, want)
        assert torch.equal(in_rank.view(-1, 2, 2).any(-1).sum(0, dtype=torch.int32), want)


def test_default_config_size_hints_cover_both_calls_default_configs():
    for num_ranks in (2, 3, 8, 16):
        nvl, rdma = default_config_size_hints(7168 * 2, num_ranks)
        for config in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
            assert nvl >= config.get_nvl_buffer_size_hint(7168 * 2, num_ranks)
            assert rdma >= config.get_rdma_buffer_size_hint(7168 * 2, num_ranks)
        assert nvl in {c.get_nvl_buffer_size_hint(7168 * 2, num_ranks)
                       for c in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))}


def test_kernel_calls_a_graph_cannot_hold_are_refused_in_a_capture(monkeypatch):
    """Inside a CUDA-graph capture the normal kernels refuse every call across nodes (its flags' values
    come from the host) and, on one node, a dispatch that would wait on the host for its counts."""
    import torch

    from moe_ep.backends.base import refuse_capture_on_the_kernels

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    refuse_capture_on_the_kernels("dispatch", across_nodes=True, waits_for_counts=True)  # not capturing
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    refuse_capture_on_the_kernels("dispatch", across_nodes=False)
    refuse_capture_on_the_kernels("combine", across_nodes=False)
    with pytest.raises(RuntimeError, match="^dispatch: capturing it in a CUDA graph needs num_worst_tokens > 0"):
        refuse_capture_on_the_kernels("dispatch", across_nodes=False, waits_for_counts=True)
    for call in ("dispatch", "combine"):
        with pytest.raises(RuntimeError, match=f"^{call}: calls across nodes cannot be captured"):
            refuse_capture_on_the_kernels(call, across_nodes=True)


def test_buffers_let_go_of_their_group_at_exit_once_it_was_destroyed():
    """A script's global Buffer outlives destroy_process_group(); at exit it lets go of what it holds (a gloo
    group that the interpreter's own teardown destroyed aborted the process now and then), and not before
    the groups are destroyed."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch.distributed as dist
        from moe_ep import Buffer
        from moe_ep.buffer import _let_go_of_destroyed_groups
        from moe_ep.launch import free_port
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        buffer = Buffer(dist.group.WORLD)
        _let_go_of_destroyed_groups()
        print("alive", "group" in buffer.__dict__)
        dist.destroy_process_group()
        _let_go_of_destroyed_groups()
        print("destroyed", "group" in buffer.__dict__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["alive", "True", "destroyed", "False"], done.stdout
