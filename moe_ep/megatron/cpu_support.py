"""Running megatron-core's MoE layers on CPU ranks (gloo): stand-ins for the torch.cuda helpers megatron
calls unconditionally (streams, events, current device) and two host-side fixes. For tests, the CPU demo
and CPU training examples; `enable_cpu_execution()` does nothing where CUDA is available."""

from __future__ import annotations

import contextlib

import torch


class _NoOpStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return _NoOpEvent()

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _NoOpStream)

    def __hash__(self):
        return 0


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def install_cpu_stand_ins() -> None:
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpEvent
    torch.cuda.current_stream = lambda device=None: _NoOpStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    # megatron's combined 1F1B schedule labels its phases with NVTX ranges, which a CPU build lacks.
    torch.cuda.nvtx.range_push = lambda msg: 0
    torch.cuda.nvtx.range_pop = lambda: 0
    torch.cuda.nvtx.range = lambda msg, *args, **kwargs: contextlib.nullcontext()
    _ignore_stand_in_streams_in_record_stream()


def _ignore_stand_in_streams_in_record_stream() -> None:
    """The schedule records tensors on its streams before freeing them; a stand-in stream has no work
    pending, so there is nothing to record (torch refuses an object that is not a torch.Stream)."""
    original = torch.Tensor.record_stream
    if getattr(original, "_moe_ep_wrapped", False):
        return

    def record_stream(self, stream):
        if isinstance(stream, _NoOpStream):
            return None
        return original(self, stream)

    record_stream._moe_ep_wrapped = True
    torch.Tensor.record_stream = record_stream


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's maybe_move_tensor_to_cpu converts only CUDA tensors to numpy; on CPU its all-to-all
    then receives split sizes as tensors, which torch.distributed refuses."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def enable_cpu_execution(force: bool = False) -> None:
    """Lets megatron-core's MoE code run on CPU tensors. Without `force` it does nothing where CUDA is
    available; `force=True` (CPU ranks on a GPU machine, as in the tests) patches all the same."""
    if torch.cuda.is_available() and not force:
        return
    install_cpu_stand_ins()
    # megatron wraps small functions in torch.compile; with the stand-ins above, TorchDynamo's device
    # probing breaks, and on CPU ranks compilation buys nothing.
    from torch import _dynamo

    _dynamo.config.disable = True
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _host_copy
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
