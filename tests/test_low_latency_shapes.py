"""The low-latency buffer's layout depends on the call's shape (max tokens, hidden, experts): at a shape
change the kernel backend clears the new layout's flags on every rank, between two barriers. Here the
protocol, with the extension's entry points and the barriers recorded instead of run (any machine);
tests/test_low_latency_kernels.py runs shape changes on a GPU against the portable backend."""
from types import SimpleNamespace

import pytest
import torch

from moe_ep.backends.low_latency import LowLatencyBackend
from moe_ep.config import LowLatencyLayout
from moe_ep.handles import LowLatencyHandle

BASE, RANKS = 1 << 40, 4


class Recorder:
    def __init__(self):
        self.events = []

    def device_zero(self, ptr, num_bytes):
        self.events.append(("zero", ptr, num_bytes))

    def enter(self, phase):
        self.events.append(("enter", phase))

    def LowLatencyCtx(self, *args):
        return SimpleNamespace(args=args)

    # The extension's module constants (low_latency::CombineSend), as names the events can show.
    COMBINE_IN_SLOT, COMBINE_STAGE, COMBINE_PUSH = "in_slot", "stage", "push"

    def ll_combine_send(self, ctx, x, recv_count, recv_src_info, num_topk, num_tokens, out, slot, how):
        self.events.append(("combine_send", x, slot, how))
        return torch.empty(num_tokens, x.shape[-1])

    def ll_combine_recv(self, ctx, topk_idx, topk_weights, target, zero_copy_slot):
        self.events.append(("combine_recv", zero_copy_slot))


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    recorder = Recorder()
    b = LowLatencyBackend.__new__(LowLatencyBackend)
    b.ops, b._gate, b.rank, b.num_ranks = recorder, recorder, 1, RANKS
    b.peers = SimpleNamespace(addresses=[0, BASE, 0, 0], pointers=torch.zeros(1), ranks_on_device=1, host_info=None,
                              timeout_s=5.0, timeout_error=lambda: None, ops=recorder)
    b._pending, b._contexts, b._shape = None, {}, None
    return b, recorder


def handle(max_tokens, hidden, experts):
    return LowLatencyHandle(0, max_tokens, hidden, experts, 8, 4, torch.device("cpu"))


def test_the_first_shape_and_repeats_clear_nothing(backend):
    b, recorder = backend
    for _ in range(3):
        b._begin("low_latency_dispatch", handle(32, 256, 16))
    assert recorder.events == []


def test_a_new_shape_clears_its_signals_and_scratch_between_two_barriers(backend):
    b, recorder = backend
    b._begin("low_latency_dispatch", handle(32, 256, 16))
    b._begin("low_latency_dispatch", handle(16, 512, 32))
    layout = LowLatencyLayout(16, 512, RANKS, 32)
    zeros = []
    for half in range(2):
        start = BASE + layout.HEADER_BYTES + half * layout.half_bytes
        zeros += [("zero", start, layout.zero_copy_offset),
                  ("zero", start + layout.send_bytes + layout.recv_bytes, layout.signal_bytes)]
    assert [e[0] for e in recorder.events] == ["enter"] + ["zero"] * 4 + ["enter"]
    assert recorder.events[1:5] == zeros
    assert "new low-latency shape" in recorder.events[0][1]
    recorder.events.clear()
    b._begin("low_latency_combine", handle(16, 512, 32))  # the same shape again: nothing
    assert recorder.events == []


def test_clearing_refuses_while_a_hook_is_pending(backend):
    b, recorder = backend
    b._begin("low_latency_dispatch", handle(32, 256, 16))
    b._pending = "low_latency_dispatch"
    with pytest.raises(RuntimeError, match="call the hook of the previous low_latency_dispatch first"):
        b.clear_flags("clean_low_latency_buffer", (32, 256, 16))
    assert recorder.events == []


def test_clearing_refuses_inside_a_cuda_graph_capture(backend, monkeypatch):
    b, recorder = backend
    b._begin("low_latency_dispatch", handle(32, 256, 16))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        b._begin("low_latency_dispatch", handle(16, 256, 16))
    assert recorder.events == []


def test_what_the_kernels_refuse_is_checked_before_any_call(backend, monkeypatch):
    """check_call, which the Buffer runs with a call's argument checks (before any rank communicates):
    a pending hook, a combine before its dispatch received, a new shape inside a capture; a repeated shape
    inside a capture passes."""
    from moe_ep.backends.low_latency import LowLatencyKernelState

    b, recorder = backend
    b._begin("low_latency_dispatch", handle(32, 256, 16))
    b.check_call("low_latency_dispatch", handle(32, 256, 16))
    b._pending = "low_latency_dispatch"
    with pytest.raises(RuntimeError, match="call the hook of the previous low_latency_dispatch first"):
        b.check_call("low_latency_combine", handle(32, 256, 16))
    b._pending = None
    dispatched = handle(32, 256, 16)
    dispatched.backend_state = LowLatencyKernelState(torch.zeros(4, dtype=torch.int32), torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="has not received yet"):
        b.check_call("low_latency_combine", dispatched, dispatched=True)
    dispatched.backend_state.received = True
    b.check_call("low_latency_combine", dispatched, dispatched=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    b.check_call("low_latency_dispatch", handle(32, 256, 16))
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        b.check_call("low_latency_dispatch", handle(16, 256, 16))
    assert recorder.events == []


@pytest.mark.parametrize("puts_anywhere", [False, True])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_the_group_pulls_or_pushes_combine_rows(backend, puts_anywhere, zero_copy):
    """Where every rank is mapped, a combine's rows are read in its slot (staged there first unless
    zero-copy); where any rank of the group puts, every rank pushes them from x (a zero-copy combine's
    slot included), staging its puts in the slot the combine owns, and the receive reads its own region."""
    from moe_ep.backends.low_latency import LowLatencyKernelState

    b, recorder = backend
    b.peers.puts_anywhere = puts_anywhere
    h = handle(32, 256, 16)
    h.backend_state = LowLatencyKernelState(torch.zeros(4, dtype=torch.int32), torch.zeros(4, 128), received=True)
    x = torch.zeros(4, 128, 256, dtype=torch.bfloat16)
    idx, w = torch.zeros(8, 4, dtype=torch.int64), torch.zeros(8, 4)
    for own in (1, 0):  # the host's slot, whatever the call's parity on the device
        recorder.events.clear()
        b._combine(x, idx, w, h, return_recv_hook=False, out=None, slot=own, zero_copy=zero_copy)
        (_, sent, slot, how), (_, read_slot) = [e for e in recorder.events if e[0].startswith("combine")]
        assert slot == own
        assert read_slot == (-1 if puts_anywhere else own)
        assert how == ("push" if puts_anywhere else "in_slot" if zero_copy else "stage")
        assert sent.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("unreachable_rank, cannot_put_rank", [(-1, -1), (-1, 1), (2, -1), (2, 2), (2, 0)])
def test_the_group_agrees_on_puts_when_it_maps(pools, unreachable_rank, cannot_put_rank):
    """NvshmemBuffers' one exchange at mapping: where any rank reaches a peer only through puts, every rank
    learns it (and pushes its combine rows); where a rank whose build cannot put would then have to, every
    rank raises the same error naming it and frees the heap it allocated with the others, instead of the
    others waiting for a rank that gave up."""
    from . import rank_fns

    results = pools(3).run(rank_fns.nvshmem_mapping_exchange, unreachable_rank, cannot_put_rank)
    if unreachable_rank >= 0 and cannot_put_rank >= 0:
        messages = {message for _, message, _ in results}
        assert len(messages) == 1 and None not in messages, results
        message = messages.pop()
        assert f"rank(s) [{unreachable_rank}] reach some peers only through NVSHMEM puts" in message, message
        assert f"the build of rank(s) [{cannot_put_rank}] cannot" in message, message
        assert all(released for _, _, released in results), results
    else:
        assert results == [(unreachable_rank >= 0, None, False)] * 3, results
