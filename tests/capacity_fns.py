"""Rank functions for megatron's capacity padding (moe_expert_capacity_factor with
moe_pad_expert_input_to_capacity) under moe_ep's dispatcher and megatron's alltoall dispatcher: the layer's
results, what its experts were handed, and whether the dispatcher's step waited for the device on the host."""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from .megatron_fns import _moe_layer, _setup

MOE_EP_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/moe_ep/"
# Tensor operations that make the host wait for a GPU (a value read on the host, a data-dependent size, a
# copy to the host). On CPU ranks they cost nothing, so _NoHostWaits refuses them by name.
_HOST_WAITS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
    torch.Tensor.cpu, torch.Tensor.numpy, torch.unique, torch.Tensor.unique, torch.Tensor.unique_consecutive,
    torch.argwhere, torch.Tensor.argwhere, torch.Tensor.nonzero_static, torch.Tensor.masked_scatter,
}


def _waits_on_host(func, args, kwargs) -> bool:
    if func in _HOST_WAITS:
        return True
    if func in (torch.Tensor.to, torch.Tensor.copy_):  # to the host
        return any(str(getattr(a, "device", a)) == "cpu" or a == "cpu" for a in list(args[1:]) + list(kwargs.values())
                   if isinstance(a, (str, torch.device)))
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        return "output_size" not in kwargs
    if func is torch.Tensor.__getitem__:  # a boolean mask selects a data-dependent number of rows
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class _NoHostWaits(TorchFunctionMode):
    """Raises on any tensor operation that would make the host wait for a GPU, except where the code that
    asks is the Buffer itself (its kernel paths under num_worst_tokens promise none; the portable backend
    running these CPU ranks exchanges counts by nature), megatron's router or megatron's experts (which read
    tokens_per_expert on the host: the test checks it is a host tensor)."""

    ALLOWED = ("megatron/core/transformer/moe/router.py", "megatron/core/transformer/moe/experts.py",
               "tests/capacity_fns.py:_experts")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _waits_on_host(func, args, kwargs) and not self._allowed():
            raise AssertionError(f"a host wait in the dispatcher's step: {getattr(func, '__qualname__', func)}")
        return func(*args, **kwargs)

    @staticmethod
    def _allowed() -> bool:
        """The innermost frame of moe_ep, megatron's router or experts, or this file's experts' wrapper decides."""
        import sys
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(MOE_EP_ROOT):
                return not path.startswith(MOE_EP_ROOT + "megatron/")
            if any(allowed in f"{path}:{frame.f_code.co_name}" for allowed in _NoHostWaits.ALLOWED):
                return True
            frame = frame.f_back
        return False


class _Unreadable(list):
    """The per-expert counts a num_worst_tokens dispatch does not have: reading them is a failure."""

    def _refuse(self, *_):
        raise AssertionError("the dispatcher read a dispatch's host counts under a capacity")

    __iter__ = __len__ = __getitem__ = __bool__ = __eq__ = _refuse


@contextlib.contextmanager
def _fresh_dispatches_recorded(calls: list):
    """Buffer.dispatch records each fresh call's num_worst_tokens, and hands back counts that refuse to be
    read wherever it had no host counts to give."""
    from moe_ep import Buffer
    original = Buffer.dispatch

    @functools.wraps(original)
    def dispatch(self, x, handle=None, *args, **kwargs):
        result = original(self, x, handle, *args, **kwargs)
        if handle is not None:
            return result
        worst = kwargs.get("num_worst_tokens", 0)
        calls.append(worst)
        return (*result[:3], _Unreadable() if worst else result[3], *result[4:])

    Buffer.dispatch = dispatch
    try:
        yield
    finally:
        Buffer.dispatch = original


@contextlib.contextmanager
def _padding_rows_unwritten():
    """Buffer.dispatch leaves a num_worst_tokens dispatch's padding rows NaN (the kernels promise nothing of
    their values; the portable backend zeroes them), fresh and cached dispatches alike."""
    from moe_ep import Buffer
    original = Buffer.dispatch

    @functools.wraps(original)
    def dispatch(self, x, handle=None, *args, **kwargs):
        result = original(self, x, handle, *args, **kwargs)
        made_by = result[4] if handle is None else handle
        if made_by.num_worst_tokens:
            padding = made_by[3] < 0  # recv_src_idx: -1 on padding
            result[0][padding] = float("nan")
        return result

    Buffer.dispatch = dispatch
    try:
        yield
    finally:
        Buffer.dispatch = original


def _experts(forward, handed: list, *args, **kwargs):
    rows, tokens_per_expert = args[0], args[1]
    handed.append((str(tokens_per_expert.device), tokens_per_expert.tolist(), rows.shape[0]))
    return forward(*args, **kwargs)


def _starved_gating(router, starved, input):
    """megatron's router gating with the starved experts' logits far below the others': no token picks them."""
    logits = torch.mm(input.reshape(-1, input.shape[-1]).float(), router.weight.float().t())
    logits[:, starved] -= 1e4
    return logits.view(*input.shape[:-1], router.weight.shape[0])


def capacity_layer(dispatcher_type: str, num_experts: int, topk: int, hidden: int, num_tokens: int, seed: int,
                   capacity_factor: float, chunks: int = 1, starved_rank=None, watch_host_waits: bool = False,
                   pad: bool = True, unwritten_padding: bool = False, cuda: bool = False, **config_kw):
    """An MoELayer (megatron's expert MLPs, same parameters for every dispatcher) with megatron's capacity
    padding: its output, the input's gradient, every parameter's gradient, and per experts' call the device,
    values and row count of tokens_per_expert. starved_rank: no token routes to that rank's experts (they
    get only padding). watch_host_waits ("deepep"): the forward and backward run under _NoHostWaits and the
    fresh dispatches' num_worst_tokens are returned. unwritten_padding: the dispatches' padding rows are NaN
    (_padding_rows_unwritten). pad=False: the capacity drops routes but pads nothing.
    cuda: the layer and the tokens live on this rank's GPU."""
    config, _ = _setup(num_experts, topk, hidden, dispatcher_type, ffn_hidden_size=2 * hidden, cuda=cuda,
                       moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=pad,
                       moe_token_drop_policy="probs", **config_kw)
    if dispatcher_type == "deepep":
        config.moe_ep_overlap_chunks = chunks
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    layer = _moe_layer(config, num_experts).to(device)
    handed = []
    layer.experts.forward = functools.partial(_experts, layer.experts.forward, handed)
    if starved_rank is not None:
        local = num_experts // dist.get_world_size()
        starved = list(range(starved_rank * local, (starved_rank + 1) * local))
        layer.router.gating = functools.partial(_starved_gating, layer.router, starved)
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = torch.randn(num_tokens, 1, hidden, generator=g).to(device).requires_grad_(True)
    upstream = torch.randn(x.shape, generator=g).to(device)
    dispatches, watch = [], _NoHostWaits() if watch_host_waits else contextlib.nullcontext()
    recording = _fresh_dispatches_recorded(dispatches) if watch_host_waits else contextlib.nullcontext()
    unwritten = _padding_rows_unwritten() if unwritten_padding else contextlib.nullcontext()
    with recording, watch, unwritten:
        out, _ = layer(x)
        (out * upstream).sum().backward()
    grads = {name: p.grad.cpu() for name, p in layer.named_parameters() if p.grad is not None}
    return dict(out=out.detach().cpu(), grad_x=x.grad.cpu(), grads=grads, handed=handed, dispatches=dispatches)


def capacity_step_on_cuda(num_experts: int, topk: int, hidden: int, num_tokens: int, seed: int,
                          capacity_factor: float, chunks: int):
    """An MoELayer on "deepep" with megatron's capacity padding on this rank's GPU (the kernels move the
    tokens; no router loss, whose reduction is a collective of its own): a forward and backward step under
    torch.cuda.set_sync_debug_mode("error"), then the step captured in one CUDA graph on other tokens and
    replayed on new ones, beside the same step run eagerly on them. Returns (eager, replayed) pairs of
    output, input gradient and parameter gradients."""
    config, _ = _setup(num_experts, topk, hidden, "deepep", ffn_hidden_size=2 * hidden, cuda=True,
                       moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=True,
                       moe_token_drop_policy="probs", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    config.moe_ep_overlap_chunks = chunks
    device = torch.device("cuda", torch.cuda.current_device())
    layer = _moe_layer(config, num_experts).to(device)
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())

    def tokens():
        return (torch.randn(num_tokens, 1, hidden, generator=g).to(device),
                torch.randn(num_tokens, 1, hidden, generator=g).to(device))

    def step(x, upstream):
        out, _ = layer(x)
        (out * upstream).sum().backward()
        return out

    def run_eagerly(x, upstream):
        layer.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        out = step(x, upstream)
        torch.cuda.synchronize()
        return [out.detach().cpu(), x.grad.cpu()] + [p.grad.cpu() for p in layer.parameters()]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the Buffer made and sized, lazy initialisation done
        for _ in range(2):
            run_eagerly(*tokens())
    torch.cuda.current_stream().wait_stream(side)
    x, upstream = tokens()
    layer.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x.clone().requires_grad_(True), upstream)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()

    static_x, static_upstream = (t.clone() for t in tokens())
    static_x.requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x, static_upstream)
    # The gradients the graph writes on every replay; the eager runs between replays set p.grad anew.
    static_grads = [p.grad for p in layer.parameters()]
    pairs = []
    for _ in range(2):  # replays with new tokens
        x, upstream = tokens()
        with torch.no_grad():
            static_x.copy_(x)
            static_upstream.copy_(upstream)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static_out.detach().cpu(), static_x.grad.cpu()] + [grad.cpu() for grad in static_grads]
        pairs.append((run_eagerly(x, upstream), replayed))
    return pairs
