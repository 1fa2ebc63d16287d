"""Functions the tests run on every rank of a RankPool (module level, so they can be pickled)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Buffer, Config, fp8
from moe_ep.backends.choices import overridden
from moe_ep.buffer import default_config_size_hints
from moe_ep.config import arena_bytes
from moe_ep.diagnostics import kernel_backend

from .problems import Problem, bias_for, expert_output, make_inputs, same_bits


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if os.environ.get("MOE_EP_TEST_CUDA") == "1" \
        else torch.device("cpu")


def my_inputs(p: Problem):
    inputs = make_inputs(p)[dist.get_rank()]
    return {k: v.to(device()) for k, v in inputs.items()}


def dispatch_args(buffer: Buffer, inp: dict, p: Problem) -> dict:
    """The layout and top-k arguments of a dispatch of this rank's inputs."""
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"])


def normal_buffer(hidden: int, config: Config = None, **kwargs) -> Buffer:
    num_ranks = dist.get_world_size()
    if config is not None:  # exactly what this config asks for (small configs: many windows)
        return Buffer(dist.group.WORLD, config.get_nvl_buffer_size_hint(hidden * 2, num_ranks), **kwargs)
    nvl = max(Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks),
              default_config_size_hints(hidden * 2, num_ranks)[0])
    rdma = Config().get_rdma_buffer_size_hint(hidden * 2, num_ranks)
    return Buffer(dist.group.WORLD, nvl, rdma, **kwargs)


def profiled_round(p: Problem):
    """normal_round on a Buffer of its own whose kernels profile their waits (profile_waits): (its
    results, the wait profile, the kernel log)."""

    def run():
        buffer = normal_buffer(p.hidden, **TWO_PASS)  # the two-pass kernels' phases and log
        result = normal_round(p, buffer=buffer)
        kernels = kernel_backend(buffer)
        if kernels is None:
            return result, {}, []
        return result, kernels.wait_profile(), kernels.kernel_log()

    return with_choices(dict(profile_waits=True), run)


def forced_combine_round(p: Problem, stream: bool, config: Config = None, **kwargs):
    """normal_round on a Buffer of its own with the streaming combine forced on or off (`stream`): (its
    results, the rows per ring its combine had; 0: the windowed combine ran)."""

    def run():
        wide = kwargs.get("dtype") == torch.float32
        # No arena: a combine from it would run instead of the forced one.
        buffer = normal_buffer(p.hidden * 2 if wide else p.hidden, config, **TWO_PASS)
        result = normal_round(p, buffer=buffer, config=config, **kwargs)
        kernels = kernel_backend(buffer)
        if kernels is None:
            return result, 0
        num_sms = (config or Buffer.get_combine_config(p.num_ranks)).num_sms
        rows = kernels.ops.intranode_stream_ring_rows(kernels.ctx, num_sms, p.hidden * (4 if wide else 2), p.num_topk)
        return result, rows

    return with_choices(dict(stream_combine=stream), run)


def fitted_blocks_round(p: Problem, fit: bool, num_sms: int, **kwargs):
    """normal_round at an SM budget of num_sms on a Buffer of its own without an arena (the two-pass
    kernels), and the same round on a Buffer with one (the one-pass kernels), with block fitting forced
    on or off (`fit`): (its results with the arena round's combined rows as "arena", the blocks its
    kernels ran on: the dispatches', the combines')."""

    def run():
        config = dataclasses.replace(Buffer.get_combine_config(p.num_ranks), num_sms=num_sms)
        buffer = normal_buffer(p.hidden, config, **TWO_PASS)
        result = normal_round(p, buffer=buffer, config=config, **kwargs)
        with_arena = normal_buffer(p.hidden, config, **arena_area(p))
        result["arena"] = normal_round(p, buffer=with_arena, config=config, **kwargs)["combined"]
        kernels = kernel_backend(buffer)
        if kernels is None:
            return result, (num_sms, num_sms)
        return result, (kernels.launch_blocks(num_sms), kernels.launch_blocks(num_sms, combine=True))

    return with_choices(dict(fit_blocks=fit), run)


def low_latency_buffer(p: Problem) -> Buffer:
    size = Buffer.get_low_latency_rdma_size_hint(p.max_tokens, p.hidden, p.num_ranks, p.num_experts)
    return Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=p.local_experts)


def cpu(t):
    if t is None:
        return None
    if isinstance(t, dict):
        return {k: cpu(v) for k, v in t.items()}
    if isinstance(t, (tuple, list)):
        return type(t)(cpu(v) for v in t)
    return t.cpu() if isinstance(t, torch.Tensor) else t


def arena_area(p: Problem, num_worst_tokens: int = 0, num_live: int = 4) -> dict:
    """Buffer arguments of an arena with room for num_live calls' tensors (a round's are four: recv_x,
    the cached dispatch's, the combine's input and its copy) of any rows this Problem makes (float32
    rows, fp8 scales, its top-k), a call receiving at most every token of every rank, or
    num_worst_tokens rows."""
    rows = max(dist.get_world_size() * p.max_tokens, num_worst_tokens)
    return dict(num_arena_bytes=arena_bytes(rows, p.hidden * 4, p.hidden // 128 * 4, p.num_topk, num_live=num_live))


# Buffer arguments of a Buffer without an arena: every call of its kernels takes the two-pass path.
TWO_PASS = dict(num_arena_bytes=0)


def arena_kwargs(p: Problem, arena, num_worst_tokens: int = 0, num_live: int = 4) -> dict:
    """Buffer arguments for `arena`: None, the Buffer's default (an arena of its own, which grows where a
    dispatch finds no room); False, no arena (TWO_PASS); True, one with room for num_live calls'
    tensors (arena_area), fixed."""
    if arena is None:
        return {}
    return arena_area(p, num_worst_tokens, num_live) if arena else dict(TWO_PASS)


# What the kernel paths' tests compare of normal_round's results with the portable backend's.
ROUND_FIELDS = ("recv_x", "recv_idx", "recv_w", "counts", "cached", "cached_rest", "combined", "combined_w",
                "num_recv_rows")
# normal_round's variants every kernel path runs, by test id.
ROUND_VARIANTS = {
    "bf16": dict(use_fp8=False, num_biases=0),
    "fp8_biases": dict(use_fp8=True, num_biases=2),
    "alignment": dict(use_fp8=False, num_biases=1, expert_alignment=16),
    "worst_tokens": dict(use_fp8=True, num_worst_tokens=768),  # 8 ranks x 96 tokens: any load fits
    "no_topk": dict(use_fp8=False, with_topk=False),
    "stream_args": dict(use_fp8=False, stream_args=True, num_biases=2),
}


def normal_round(p: Problem, use_fp8: bool = False, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 num_biases: int = 0, with_topk: bool = True, config: Config = None, buffer: Buffer = None,
                 stream_args: bool = False, dtype: torch.dtype = torch.bfloat16, arena: bool = None,
                 combine_x: str = "tensor", busy: bool = False, ranks_per_node: int = None):
    """Layout, dispatch, cached dispatch, combine: everything a test compares, per rank. stream_args:
    the calls chain through previous_event/async_finish/allocate_on_comm_stream. arena (arena_kwargs):
    the Buffer's own arena (None), none (False: the two-pass kernels), or one with room for the round's
    four calls' tensors (True: with the kernels both dispatches store into it, so recv_x must outlive the
    cached dispatch, and the combine reads from it). combine_x: what combine's x is: a tensor of its own
    ("tensor"), Buffer.empty_combine_input ("empty_combine_input"), or the cached dispatch's recv_x,
    overwritten ("recv_x": bf16 rows only). busy: matmuls on the current stream while each call's kernels
    run (with stream_args: as a training step overlaps them). ranks_per_node: the Buffer's (None: its
    default): several nodes of ranks on this host."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    inp["x"] = inp["x"].to(dtype)
    area = arena_kwargs(p, arena, num_worst_tokens)
    if ranks_per_node is not None:
        area["ranks_per_node"] = ranks_per_node
    # normal_buffer sizes for 2-byte elements: float32 rows are twice as wide.
    buffer = buffer if buffer is not None else normal_buffer(p.hidden * (2 if dtype == torch.float32 else 1), config,
                                                             **area)
    extra = dict(config=config) if config is not None else {}
    if stream_args:
        extra.update(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    layout = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    x = fp8.per_token_cast_to_fp8(inp["x"]) if use_fp8 else inp["x"]
    topk = dict(topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"]) if with_topk else {}
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, **topk, **extra)
    if busy:
        _keep_gpu_busy()
    event.current_stream_wait()
    if stream_args:
        extra["previous_event"] = Buffer.capture()
    cached = buffer.dispatch(x, handle=handle, **extra)
    if busy:
        _keep_gpu_busy()
    cached[-1].current_stream_wait()
    recv_bf16 = fp8.per_token_cast_back(*recv_x) if use_fp8 else recv_x
    y = expert_output(recv_bf16, rank)
    cached_x = cpu(cached[0])
    if combine_x == "empty_combine_input":
        y = buffer.empty_combine_input(handle, y.shape[1], y.dtype).copy_(y)
    elif combine_x == "recv_x":  # bf16 rows; cpu() hands CPU tensors back as they are: keep their rows
        cached_x = cached_x.clone()
        y = cached[0].copy_(y)
    biases = [bias_for(p, rank, inp["x"].shape[0], i).to(device(), y.dtype) for i in range(num_biases)]
    bias = None if num_biases == 0 else (biases[0] if num_biases == 1 else tuple(biases))
    if stream_args:
        extra["previous_event"] = Buffer.capture()
    combined, combined_w, event = buffer.combine(y, handle, topk_weights=recv_w, bias=bias, **extra)
    if busy:
        _keep_gpu_busy()
    event.current_stream_wait()
    buffer.check_errors()  # a kernel that gave up reports it at the next call: ask now
    return cpu(dict(layout=(per_rank, per_rdma, per_expert, in_rank), recv_x=recv_x, recv_idx=recv_idx,
                    recv_w=recv_w, counts=counts, cached=cached_x, cached_rest=cached[1:5], y=y,
                    combined=combined, combined_w=combined_w, num_recv_rows=handle.num_recv_rows))


def internode_buffer(p: Problem, ranks_per_node: int, small: bool = False) -> Buffer:
    """A Buffer over nodes of ranks_per_node ranks, sized for any normal call of this Problem (the
    internode kernels on CUDA ranks, the portable backend on CPU ones), or with small=True a megabyte
    past the kernels' control area (their calls grow it)."""
    nvl = default_config_size_hints(p.hidden * 4, p.num_ranks)[0]
    rdma = Config().get_rdma_buffer_size_hint(p.hidden * 4, p.num_ranks)
    if device().type == "cuda" and small:
        rdma = moe_ep._native.internode_ops().layout()["control_bytes"] + (1 << 20)
    elif device().type == "cuda":
        rdma = max(rdma, Buffer.get_internode_rdma_size_hint(p.max_tokens, p.hidden * 2, p.num_ranks, ranks_per_node,
                                                             p.num_topk))
    # Destroyed after use: NVSHMEM's heap is freed collectively only, not by the garbage collector.
    return Buffer(dist.group.WORLD, nvl, rdma, ranks_per_node=ranks_per_node, explicitly_destroy=True)


def internode_round(p: Problem, ranks_per_node: int, rounds: int = 1, small: bool = False, **kwargs):
    """normal_round on an internode_buffer, `rounds` times on the same Buffer: the last round's results,
    with the bytes the kernels' buffer has at the end (0 on the portable backend)."""
    buffer = internode_buffer(p, ranks_per_node, small)
    for _ in range(rounds):
        result = normal_round(p, buffer=buffer, **kwargs)
    return _with_internode_path(buffer, result)


def _with_internode_path(buffer: Buffer, result: dict) -> dict:
    """result, with what ran the buffer's normal calls (backend, topology) and the bytes of the kernels'
    buffer (0 on the portable backend); the buffer destroyed."""
    result["backend"] = type(kernel_backend(buffer) or buffer).__name__ if device().type == "cuda" else "portable"
    topology = buffer.topology()
    result["topology"] = (topology["normal_backend"], topology["peers"]["normal"])
    kernels = kernel_backend(buffer)
    result["buffer_bytes"] = kernels.num_bytes if kernels is not None else 0
    buffer.destroy()
    return result


def internode_capture_refused(p: Problem, ranks_per_node: int):
    """On an internode_buffer: a fresh dispatch, a cached dispatch and a combine, each begun inside a CUDA
    graph capture (which the capture aborts), then an eager round on the same Buffer. -> each call's error
    (type, message), and the round's results."""
    buffer = internode_buffer(p, ranks_per_node)
    inp = my_inputs(p)
    args = dispatch_args(buffer, inp, p)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **args)
    y = expert_output(recv_x, dist.get_rank())
    torch.cuda.synchronize()
    calls = dict(fresh=lambda: buffer.dispatch(inp["x"], **args, num_worst_tokens=p.num_ranks * p.max_tokens),
                 cached=lambda: buffer.dispatch(inp["x"], handle=handle),
                 combine=lambda: buffer.combine(y, handle, topk_weights=recv_w))
    errors = {}
    for name, call in calls.items():
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                call()
        except RuntimeError as e:
            errors[name] = (type(e).__name__, str(e))
        torch.cuda.synchronize()
    return _with_internode_path(buffer, dict(errors=errors, **normal_round(p, buffer=buffer)))


def buffers_made_while_calls_run(p: Problem, num_buffers: int = 3, arena: bool = None):
    """A Buffer per layer, each made (collectively) right after the previous one's async calls were
    issued and their outputs left unread, matmuls beside every call: how megatron's dispatcher once used
    Buffers (it now shares one). -> each Buffer's (recv_x, combined), per rank."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    area = arena_kwargs(p, arena)
    buffers, outputs = [], []
    for _ in range(num_buffers):
        buffers.append(normal_buffer(p.hidden, **area))
        buffer = buffers[-1]
        args = dispatch_args(buffer, inp, p)
        # previous_event: the calls wait for it, so it is taken once their inputs are written.
        extra = dict(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
        recv_x, _, recv_w, _, handle, event = buffer.dispatch(inp["x"], **args, **extra)
        _keep_gpu_busy()
        event.current_stream_wait()
        y = expert_output(recv_x, rank)
        extra["previous_event"] = Buffer.capture()
        combined, _, event = buffer.combine(y, handle, topk_weights=recv_w, **extra)
        del y  # the combine keeps its input alive until its kernels are done (an arena combine copies it first)
        _keep_gpu_busy()
        event.current_stream_wait()
        outputs.append((recv_x, combined))  # read at the end, after every Buffer's calls
    for buffer in buffers:
        buffer.check_errors()
    return cpu(outputs)


def inputs_dropped_after_async_calls(p: Problem, num_worst_tokens: int, arena: bool = None):
    """An async dispatch and combine whose caller drops every input right after the call and writes other
    data into new tensors of the same sizes (on a GPU the caching allocator hands them the freed memory),
    while an earlier kernel still holds the communication stream: the calls must still read the inputs as
    they were. -> (recv_x, recv_idx, recv_w, combined, combined_w)"""
    rank = dist.get_rank()
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **arena_kwargs(p, arena, num_worst_tokens))
    extra = dict(async_finish=True, allocate_on_comm_stream=True, num_worst_tokens=num_worst_tokens)

    def hold_comm_stream():  # the call's kernels start only after the compute stream has moved on
        if device().type == "cuda":
            with torch.cuda.stream(buffer.get_comm_stream()):
                torch.cuda._sleep(20_000_000)

    def overwrite(tensors):  # the freed inputs' memory, taken and written on the current stream
        return [torch.full_like(t, 7 if t.dtype != torch.bool else 1) for t in tensors]

    args = {k: v.clone() for k, v in dispatch_args(buffer, inp, p).items()}
    x = inp["x"].clone()
    hold_comm_stream()
    recv_x, recv_idx, recv_w, _, handle, event = buffer.dispatch(x, **args, previous_event=Buffer.capture(),
                                                                 **extra)
    shapes = [x, *args.values()]
    del x, args
    garbage = overwrite(shapes)
    event.current_stream_wait()
    y, weights = expert_output(recv_x, rank), recv_w.clone()
    hold_comm_stream()
    combined, combined_w, event = buffer.combine(y, handle, topk_weights=weights, previous_event=Buffer.capture(),
                                                 async_finish=True, allocate_on_comm_stream=True)
    shapes = [y, weights]
    del y, weights
    garbage += overwrite(shapes)
    event.current_stream_wait()
    buffer.check_errors()
    return cpu((recv_x, recv_idx, recv_w, combined, combined_w))


_EXPERT_WEIGHTS = {}


def _expert_gemms(repeats: int):
    """An expert MLP's forward and backward, `repeats` times on the current stream, in the shapes of
    configs/single_gpu_small.yaml (2048 rows, hidden 1024, ffn 2816) and through torch's linear and
    autograd as megatron's experts run them: the GEMMs (cuBLAS grids sized to the SMs the process may
    use) that ran on a late rank's compute stream while its peers' combines waited for it in the
    training that stalled (CUDA ranks only; they only take time)."""
    if device().type != "cuda" or repeats <= 0:
        return
    if device() not in _EXPERT_WEIGHTS:
        g = torch.Generator(device=device()).manual_seed(dist.get_rank())
        _EXPERT_WEIGHTS[device()] = [
            (torch.randn(*shape, generator=g, device=device(), dtype=torch.bfloat16) * 0.03).requires_grad_()
            for shape in ((2048, 1024), (2816, 1024), (1024, 2816))]
    h, w1, w2 = _EXPERT_WEIGHTS[device()]
    for _ in range(repeats):
        y = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(h, w1)), w2)
        y.float().square().mean().backward()
    for t in (h, w1, w2):
        t.grad = None


def normal_steps_beside_gemms(p: Problem, steps: int, arena: bool = None):
    """`steps` training-like steps: an async dispatch, expert GEMMs, an async combine, with rank r running
    r + 1 times rank 0's GEMMs between the two calls, so the later ranks still compute while the earlier
    ones' combines wait for them. -> per step (recv_x, recv_idx, recv_w, counts, combined, combined_w)"""
    rank = dist.get_rank()
    inp = my_inputs(p)
    # Every step's recv_x is kept until the end, beside a step's combine input and its copy.
    buffer = normal_buffer(p.hidden, **arena_kwargs(p, arena, num_live=steps + 3))
    results = []
    for _ in range(steps):
        args = dispatch_args(buffer, inp, p)
        extra = dict(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(inp["x"], **args, **extra)
        event.current_stream_wait()
        _expert_gemms(rank + 1)
        y = expert_output(recv_x, rank)
        extra["previous_event"] = Buffer.capture()
        combined, combined_w, event = buffer.combine(y, handle, topk_weights=recv_w, **extra)
        _expert_gemms(1)  # the next layer's work beside the combine
        event.current_stream_wait()
        results.append((recv_x, recv_idx, recv_w, counts, combined, combined_w))
    buffer.check_errors()
    return cpu(results)


def low_latency_steps_beside_gemms(p: Problem, steps: int):
    """`steps` decode-like rounds (low_latency_round: fp8 dispatch, combine, both with the hook) on one
    Buffer, with rank r running r + 1 times rank 0's expert GEMMs between each send and its hook.
    -> per step what low_latency_round returns"""
    buffer = low_latency_buffer(p)
    return [low_latency_round(p, use_fp8=True, return_recv_hook=True, buffer=buffer, gemm_repeats=dist.get_rank() + 1)
            for _ in range(steps)]


def _keep_gpu_busy():
    """Matmuls between a send and its hook: they run while the data is in flight (CUDA ranks only)."""
    if device().type == "cuda":
        a = torch.randn(2048, 2048, device=device())
        for _ in range(10):
            a = (a @ a).clamp(-1, 1)


def low_latency_round(p: Problem, use_fp8: bool, round_scale: bool = False, use_ue8m0: bool = False,
                      return_recv_hook: bool = False, zero_copy: bool = False, use_out: bool = False,
                      busy_gpu: bool = False, calls_before: int = 0, buffer: Buffer = None, gemm_repeats: int = 0):
    """One dispatch + combine; `calls_before` dispatch + combine pairs run first, back to back without
    any host synchronisation (how a decode loop and the benchmark issue them). buffer: a Buffer to use
    (default: a new one sized for p). gemm_repeats: expert GEMMs (_expert_gemms) after each call, before
    its hook."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    buffer = buffer or low_latency_buffer(p)
    if calls_before:
        zeros = torch.zeros(p.local_experts, p.num_ranks * p.max_tokens, p.hidden, dtype=torch.bfloat16,
                            device=device())
        for _ in range(calls_before):
            _, _, handle, _, _ = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens,
                                                             p.num_experts, use_fp8=use_fp8)
            if zero_copy:  # both zero-copy slots in turn
                buffer.get_next_low_latency_combine_buffer(handle).zero_()
            buffer.low_latency_combine(zeros, inp["topk_idx"], inp["topk_weights"], handle, zero_copy=zero_copy)
    stats = torch.zeros(p.local_experts, dtype=torch.int32, device=device())
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, cumulative_local_expert_recv_stats=stats,
        use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=return_recv_hook)
    count_before_hook = recv_count.clone()
    if busy_gpu:
        _keep_gpu_busy()
    _expert_gemms(gemm_repeats)
    if return_recv_hook:
        hook()
    recv_bf16 = recv_x
    if use_fp8:
        recv_bf16 = fp8.per_token_cast_back(*recv_x)
    y = expert_output(recv_bf16, rank)
    # Rows past recv_count are not data: poison them, the combine must never read them.
    for j, c in enumerate(recv_count.tolist()):
        y[j, c:] = float("nan")
    out = torch.full((inp["x"].shape[0], p.hidden), float("nan"), dtype=torch.bfloat16, device=device()) \
        if use_out else None
    x_arg, in_place = y, False
    if zero_copy:
        rows = buffer.get_next_low_latency_combine_buffer(handle)
        rows.copy_(y)
        x_arg = torch.zeros_like(y)   # must be ignored: zero_copy reads the buffer
        kernels = kernel_backend(buffer, "low_latency")
        if kernels is not None:  # the kernels' rows lie in this rank's mapped buffer
            start = kernels.peers.addresses[rank]
            in_place = start <= rows.data_ptr() < start + buffer.num_rdma_bytes
    combined, _, combine_hook = buffer.low_latency_combine(
        x_arg, inp["topk_idx"], inp["topk_weights"], handle, zero_copy=zero_copy,
        return_recv_hook=return_recv_hook, out=out)
    if busy_gpu:
        _keep_gpu_busy()
    _expert_gemms(gemm_repeats)
    if return_recv_hook:
        combine_hook()
    buffer.check_errors()  # a receive that gave up reports it at the next call: ask now
    return cpu(dict(recv_x=recv_x, recv_count=recv_count, count_before_hook=count_before_hook, stats=stats,
                    y=y, combined=combined, out_is_result=out is not None and combined.data_ptr() == out.data_ptr(),
                    zero_copy_in_place=in_place))


def low_latency_combine_keeps_the_other_slot(p: Problem, calls_before: int) -> bool:
    """After calls_before plain dispatch + combine pairs: a dispatch and its combine (which owns zero-copy
    slot s), a second dispatch, slot s filled with a pattern, and the second dispatch's plain combine
    (which owns the other slot). -> whether slot s still holds the pattern afterwards."""
    inp = my_inputs(p)
    buffer = low_latency_buffer(p)
    zeros = torch.zeros(p.local_experts, p.num_ranks * p.max_tokens, p.hidden, dtype=torch.bfloat16, device=device())

    def dispatch():
        return buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, use_fp8=False)

    for _ in range(calls_before):
        handle = dispatch()[2]
        buffer.low_latency_combine(zeros, inp["topk_idx"], inp["topk_weights"], handle)
    handle = dispatch()[2]
    kept = buffer.get_next_low_latency_combine_buffer(handle)
    buffer.low_latency_combine(zeros, inp["topk_idx"], inp["topk_weights"], handle)
    recv_x, _, handle, _, _ = dispatch()
    kept.fill_(1.5)
    buffer.low_latency_combine(expert_output(recv_x, dist.get_rank()), inp["topk_idx"], inp["topk_weights"], handle)
    torch.cuda.synchronize()
    return bool((kept == 1.5).all())


def low_latency_differences(got: dict, want: dict, use_fp8: bool) -> list:
    """What differs between two low_latency_round results: recv_count, each expert's received rows (those
    before its count: the rest are not data), the combined tokens."""
    if not torch.equal(got["recv_count"], want["recv_count"]):
        return ["recv_count"]
    wrong = []
    parts_got = got["recv_x"] if use_fp8 else (got["recv_x"],)
    parts_want = want["recv_x"] if use_fp8 else (want["recv_x"],)
    for part_got, part_want in zip(parts_got, parts_want):
        for expert, n in enumerate(want["recv_count"].tolist()):
            if not same_bits(part_got[expert, :n], part_want[expert, :n]):
                wrong.append(f"expert {expert} rows")
    if not same_bits(got["combined"], want["combined"]):
        wrong.append("combined")
    return wrong


def low_latency_shape_changes(problems, use_fp8: bool, zero_copy: bool):
    """low_latency_round for each problem in turn on one Buffer sized for the largest, so that the
    shape (max tokens, hidden, experts) and with it the buffer's layout change between calls."""
    size = max(Buffer.get_low_latency_rdma_size_hint(p.max_tokens, p.hidden, p.num_ranks, p.num_experts)
               for p in problems)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True)
    return [low_latency_round(p, use_fp8, zero_copy=zero_copy, buffer=buffer) for p in problems]


def rounds_under_defaults(p: Problem, default_dtype: torch.dtype = None, default_device: str = None):
    """Whole rounds through the public API with torch's default dtype and device set as training scripts
    set them (None: left as they are), restored after: normal_round of bf16 rows and of fp8 rows (layout,
    top-k with weights, cached dispatch, combine with weights and biases) and low_latency_round of bf16
    rows (zero-copy combine) and of fp8 rows (UE8M0 scales, receives in the hooks). -> {round: what it returns}"""
    saved_dtype = torch.get_default_dtype()
    if default_dtype is not None:
        torch.set_default_dtype(default_dtype)
    if default_device is not None:
        torch.set_default_device(default_device)
    try:
        return dict(normal_bf16=normal_round(p, num_biases=1),
                    normal_fp8=normal_round(p, use_fp8=True, num_biases=2),
                    low_latency_bf16=low_latency_round(p, use_fp8=False, zero_copy=True),
                    low_latency_fp8=low_latency_round(p, use_fp8=True, round_scale=True, use_ue8m0=True,
                                                      return_recv_hook=True))
    finally:
        torch.set_default_dtype(saved_dtype)
        if default_device is not None:
            torch.set_default_device(None)


def backend_info():
    return moe_ep.backend_info()


def skip_a_call(skipping_rank: int, phase: str):
    """Every rank but skipping_rank makes the call `phase`; returns what each saw (run it through
    with_env with a short MOE_EP_TIMEOUT_S)."""
    p = Problem(11, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=4)
    inp = my_inputs(p)
    buffer = low_latency_buffer(p) if phase.startswith("low_latency") else normal_buffer(p.hidden)
    handle = None
    if phase == "low_latency_combine":
        recv, _, handle, _, _ = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens,
                                                            p.num_experts, use_fp8=False)
    if dist.get_rank() == skipping_rank:
        return "skipped"
    try:
        if phase == "dispatch":
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
            buffer.dispatch(inp["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert)
        else:
            buffer.low_latency_combine(recv, inp["topk_idx"], inp["topk_weights"], handle)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "returned"


def mismatched_calls():
    """Rank 0 dispatches while rank 1 runs a low-latency dispatch."""
    p = Problem(12, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=4)
    inp = my_inputs(p)
    size = Buffer.get_low_latency_rdma_size_hint(p.max_tokens, p.hidden, p.num_ranks, p.num_experts)
    nvl = Config().get_nvl_buffer_size_hint(p.hidden * 2, p.num_ranks)
    buffer = Buffer(dist.group.WORLD, nvl, size, low_latency_mode=True)
    try:
        if dist.get_rank() == 0:
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
            buffer.dispatch(inp["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert)
        else:
            buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "returned", ""


def buffer_lifecycle():
    """Raw buffer views, zero-copy staging cleanup, explicit destroy."""
    p = Problem(13, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=4)
    inp = my_inputs(p)
    size = Buffer.get_low_latency_rdma_size_hint(p.max_tokens, p.hidden, p.num_ranks, p.num_experts)
    buffer = Buffer(dist.group.WORLD, 4096, size, low_latency_mode=True, explicitly_destroy=True)
    view = buffer.get_local_buffer_tensor(torch.int32, (4, 8), offset=128)
    view.fill_(7)
    again = buffer.get_local_buffer_tensor(torch.int32, (4, 8), offset=128)
    _, _, handle, _, _ = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts)
    staging = buffer.get_next_low_latency_combine_buffer(handle)
    staging.fill_(1.0)
    buffer.clean_low_latency_buffer(p.max_tokens, p.hidden, p.num_experts)
    cleaned = bool((staging == 0).all())
    try:
        buffer.get_local_buffer_tensor(torch.int32, (4096,))
        too_big = "no error"
    except ValueError as exc:
        too_big = str(exc)
    buffer.destroy()
    try:
        buffer.get_local_buffer_tensor(torch.int32, (1,))
        after_destroy = "no error"
    except RuntimeError as exc:
        after_destroy = str(exc)
    return dict(shared=bool((again == 7).all()), cleaned=cleaned, too_big=too_big, after_destroy=after_destroy,
                comm_stream=type(buffer.get_comm_stream()).__name__, ranks_per_node=buffer.ranks_per_node)


def layout_across_nodes(ranks_per_node: int):
    p = Problem(14, dist.get_world_size(), dist.get_world_size() * 2, 128, 3, max_tokens=16)
    inp = my_inputs(p)
    buffer = Buffer(dist.group.WORLD, ranks_per_node=ranks_per_node)
    per_rank, per_rdma, _, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    return inp["topk_idx"], per_rdma, in_rank


def layout_tensor_reused_after_dispatch(p: Problem):
    """A dispatch, then the caller's is_token_in_rank overwritten (a static layout tensor the next layout
    reuses), then a cached dispatch and a combine of that handle. -> (recv_x, cached recv_x, combined) of
    that round and of the same round left alone."""
    buffer = normal_buffer(p.hidden)
    inp = my_inputs(p)
    rounds = []
    for reuse in (False, True):
        args = dispatch_args(buffer, inp, p)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **args)
        if reuse:
            args["is_token_in_rank"].copy_(~args["is_token_in_rank"])
        cached = buffer.dispatch(inp["x"], handle=handle)[0]
        combined = buffer.combine(expert_output(recv_x, dist.get_rank()), handle, topk_weights=recv_w)[0]
        rounds.append(cpu([recv_x, cached, combined]))
    return rounds


def worst_tokens_too_small(p: Problem):
    """Every rank learns every rank's receive count, so all raise together and the Buffer stays usable."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    try:
        buffer.dispatch(inp["x"], num_worst_tokens=1, **layout)
        outcome = "no exception"
    except ValueError as exc:
        outcome = str(exc)
    recv_x = buffer.dispatch(inp["x"], **layout)[0]
    return outcome, recv_x.shape[0]


def worst_tokens_overflow(p: Problem, num_worst_tokens: int, use_fp8: bool):
    """A num_worst_tokens dispatch that may receive more rows than that, then one without it (tried
    again where it raises: the kernels report an overflow at the rank's next call, the portable backend
    at once). Both dispatches' recv_x and top-k, and what each attempt raised."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **TWO_PASS)  # the two-pass kernels' overflow report
    args = dispatch_args(buffer, inp, p)
    x = fp8.per_token_cast_to_fp8(inp["x"]) if use_fp8 else inp["x"]

    def outputs(recv):
        return dict(x=recv[0], idx=recv[1], w=recv[2])

    outcomes, results = [], []
    for extra in (dict(num_worst_tokens=num_worst_tokens), {}):
        for _ in range(2):
            try:
                results.append(outputs(buffer.dispatch(x, **args, **extra)))
                outcomes.append("no exception")
                break
            except ValueError as exc:
                outcomes.append(str(exc))
        if device().type == "cuda":
            torch.cuda.synchronize()
    return cpu(dict(outcomes=outcomes, results=results))


def repeated_rounds(p: Problem, repeats: int, use_fp8: bool):
    """The same round `repeats` times on one Buffer: a digest of every output of every repeat."""
    buffer = normal_buffer(p.hidden)
    digests = []
    for _ in range(repeats):
        out = normal_round(p, use_fp8=use_fp8, num_biases=1, buffer=buffer)
        digests.append(_digest(out))
    return digests


def _digest(value) -> str:
    import hashlib

    h = hashlib.sha256()

    def feed(v):
        if isinstance(v, dict):
            for k in sorted(v):
                feed(k), feed(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                feed(item)
        elif isinstance(v, torch.Tensor):
            h.update(str((v.dtype, tuple(v.shape))).encode())
            h.update(v.contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        else:
            h.update(repr(v).encode())

    feed(value)
    return h.hexdigest()


def captured(step, static: dict, warmups: int):
    """step(static) captured in a CUDA graph, after `warmups` eager calls on a side stream (the allocator,
    lazy initialisation). -> (graph, step's outputs as captured)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static)
    return graph, outs


def graph_round(p: Problem, q: Problem, num_worst_tokens: int, arena: bool = None):
    """Layout, dispatch and combine captured in one CUDA graph on the inputs of p, replayed on the
    inputs of q (same shapes), next to the same calls made eagerly on q. arena (arena_kwargs): where the
    Buffer has an arena, the eager calls use it and the captured ones do not (a replay would write
    regions given back long before): they take the two-pass path."""
    inp_p, inp_q = my_inputs(p), my_inputs(q)
    assert inp_p["x"].shape == inp_q["x"].shape
    rank = dist.get_rank()
    buffer = normal_buffer(p.hidden, **arena_kwargs(p, arena, num_worst_tokens))
    static = {k: v.clone() for k, v in inp_p.items()}

    def step(inp):
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            inp["x"], **dispatch_args(buffer, inp, p), num_worst_tokens=num_worst_tokens)
        y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
        return recv_x, recv_idx, recv_w, combined, combined_w

    graph, outs = captured(step, static, warmups=2)
    results = []
    for inp in (inp_q, inp_p, inp_q):  # replays with changing data
        for k in static:
            static[k].copy_(inp[k])
        graph.replay()
        torch.cuda.synchronize()
        results.append(cpu([t.clone() for t in outs]))
    eager_q, eager_p = cpu(list(step(inp_q))), cpu(list(step(inp_p)))
    return results, eager_q, eager_p


def handle_on_the_wrong_device(p: Problem):
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    _, _, _, _, handle, _ = buffer.dispatch(inp["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert)
    try:
        buffer.dispatch(inp["x"].cpu(), handle=handle)
        return "no error"
    except ValueError as exc:
        return str(exc)


def intranode_layout_numbers(cases):
    from moe_ep import _native
    from moe_ep.config import IntranodeLayout
    return [(_native.ops().intranode_layout(*case), IntranodeLayout(*case).as_dict()) for case in cases]


def skip_after_warmup(skipping_rank: int, phase: str):
    """Every rank dispatches once (the kernels map the peers' buffers), then skipping_rank skips the
    next `phase` ("dispatch" or "combine") that the others make (and returns its progress_report()). A
    combine does not wait on the host, so its error surfaces at the next call. Run it through with_env
    with a short MOE_EP_TIMEOUT_S."""
    # Every rank sends tokens to every other (the streaming combine waits only on the ranks it trades
    # rows with, so a rank without rows for the skipping one would finish its combine).
    p = Problem(21, dist.get_world_size(), dist.get_world_size() * 2, 128, 4, max_tokens=64, drop=0.0, skew=False,
                zero_token_rank=False)
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **TWO_PASS)  # the two-pass kernels' waits (no arena: no one-pass kernel before them)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, _, _, _, handle, _ = buffer.dispatch(inp["x"], **layout)
    torch.cuda.synchronize()
    dist.barrier()
    if dist.get_rank() == skipping_rank:
        return "skipped", buffer.progress_report()
    try:
        if phase == "dispatch":
            buffer.dispatch(inp["x"], **layout)
        else:
            buffer.combine(recv_x, handle)
            torch.cuda.synchronize()  # the kernel gives up after the timeout and returns
            buffer.dispatch(inp["x"], handle=handle)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "returned"


def oversized_sm_budget(p: Problem, num_sms: int):
    """A dispatch whose blocks cannot all be resident on the GPU is refused before it starts, on every
    rank of that GPU, and the Buffer then works with a budget that fits."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    big = Config(num_sms, 1, 2)  # short queues: the Buffer's size still passes for so many channels
    try:
        buffer.dispatch(inp["x"], config=big, **layout)
        outcome = "no error"
    except ValueError as exc:
        outcome = str(exc)
    recv_x = buffer.dispatch(inp["x"], **layout)[0]
    return outcome, recv_x.shape[0]


def construction_error() -> str:
    """What a Buffer's construction raises as ValueError here ("" where it does not)."""
    try:
        Buffer(dist.group.WORLD, 1 << 20)
    except ValueError as exc:
        return str(exc)
    return ""


def outcome(fn) -> tuple:
    """What fn() did: ("returned", "") or (the exception's type name, its message)."""
    try:
        fn()
        return "returned", ""
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return type(exc).__name__, str(exc)


@contextlib.contextmanager
def restored_environment(names):
    """The environment variables `names` as they were before, whatever the body set or removed."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def with_env(env: dict, fn, *args, **kwargs):
    """fn(*args, **kwargs) with extra environment variables (read when a Buffer is created)."""
    with restored_environment(env):
        os.environ.update(env)
        return fn(*args, **kwargs)


def with_choices(choices: dict, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the kernels' choices of moe_ep.backends.choices overridden (e.g.
    stream_combine=True): the Backends of the Buffers fn makes take them. They live in the process, so
    a test enters them here, on its ranks."""
    with overridden(**choices):
        return fn(*args, **kwargs)


def low_latency_graph_round(p: Problem, q: Problem, use_fp8: bool):
    """Low-latency dispatch and combine captured in one CUDA graph on p's inputs, replayed on q's
    (same shapes), next to eager calls on q."""
    inp_p, inp_q = my_inputs(p), my_inputs(q)
    buffer = low_latency_buffer(p)
    static = {k: v.clone() for k, v in inp_p.items()}
    rank = dist.get_rank()

    def step(inp):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, use_fp8=use_fp8)
        recv = fp8.per_token_cast_back(*recv_x) if use_fp8 else recv_x
        y = (recv.float().view(-1, p.hidden) * (rank + 1)).to(torch.bfloat16).view(recv.shape)
        combined, _, _ = buffer.low_latency_combine(y, inp["topk_idx"], inp["topk_weights"], handle)
        return recv_count, combined

    graph, outs = captured(step, static, warmups=1)
    replays = []
    for inp in (inp_q, inp_p):
        for k in static:
            static[k].copy_(inp[k])
        graph.replay()
        torch.cuda.synchronize()
        replays.append(cpu([t.clone() for t in outs]))
    return replays, cpu(list(step(inp_q))), cpu(list(step(inp_p)))


def low_latency_peer_missing(skipping_rank: int):
    """After one round on every rank, skipping_rank skips the next low_latency_dispatch (run it through
    with_env with a short MOE_EP_TIMEOUT_S)."""
    p = Problem(23, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=8, zero_token_rank=False)
    inp = my_inputs(p)
    buffer = low_latency_buffer(p)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts,
                                                        use_fp8=False)
    buffer.low_latency_combine(recv, inp["topk_idx"], inp["topk_weights"], handle)
    torch.cuda.synchronize()
    dist.barrier()
    if dist.get_rank() == skipping_rank:
        return "skipped"
    try:
        buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, use_fp8=False)
        torch.cuda.synchronize()  # the receive gives up after the timeout
        buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, use_fp8=False)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "returned"


def nvshmem_put_round(num_bytes: int):
    """Rank 0 puts `num_bytes` of its NVSHMEM buffer into rank 1's, then a signal there ordered after
    them (run it through with_choices with low_latency_memory="nvshmem"). Rank 1 returns whether the bytes it
    holds once it sees the signal are the ones sent; the others return None."""
    from moe_ep import _native
    from moe_ep.backends.peers import device_view

    rank = dist.get_rank()
    buffer = Buffer(dist.group.WORLD, 0, 8 << 20, low_latency_mode=True)
    kernels = kernel_backend(buffer, "low_latency", make=True)  # maps the peers' buffers (collective)
    assert kernels is not None, "the low-latency kernels are off"
    peers = kernels.peers
    own = peers.addresses[rank]  # this PE's symmetric address: what a put names on every PE
    src_at, dst_at, signal_at, value = 1 << 20, 2 << 20, 3 << 20, 7
    payload = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(num_bytes)).to(device())
    device_view(own + src_at, num_bytes, peers.device).copy_(payload)
    torch.cuda.synchronize()
    dist.barrier()
    result = None
    if rank == 0:
        _native.internode_ops().nvshmem_put_with_signal(own + dst_at, own + src_at, num_bytes, 1, own + signal_at,
                                                        value)
        torch.cuda.synchronize()
    elif rank == 1:
        signal = device_view(own + signal_at, 8, peers.device).view(torch.int64)
        deadline = time.monotonic() + 20
        while signal.item() != value:
            if time.monotonic() > deadline:
                raise TimeoutError("rank 1: the signal of rank 0's put did not arrive within 20 s")
            time.sleep(0.001)
        result = torch.equal(device_view(own + dst_at, num_bytes, peers.device), payload)
    dist.barrier()
    return result


def low_latency_round_and_path(p: Problem, **variant):
    """low_latency_round on a new Buffer, with how its kernels reached the peers: the kernels' module
    (moe_ep._C, or moe_ep._internode where a peer is reached through puts), the peers' memory and the ranks
    reached through puts."""
    buffer = low_latency_buffer(p)
    result = low_latency_round(p, buffer=buffer, **variant)
    kernels = kernel_backend(buffer, "low_latency")
    assert kernels is not None, "the low-latency kernels are off"
    result["path"] = dict(module=kernels.ops.__name__, memory=kernels.peers.memory,
                          unreachable=list(kernels.peers.unreachable), ranks_per_node=buffer.ranks_per_node)
    return result


def low_latency_layout_numbers(cases):
    from moe_ep import _native
    from moe_ep.config import LowLatencyLayout
    return [(_native.ops().low_latency_layout(*case), LowLatencyLayout(*case).as_dict()) for case in cases]


def stall_on_rank(stalling_rank: int, seconds: float):
    """stalling_rank sleeps for `seconds` (past the pool call's timeout); the others return at once."""
    if dist.get_rank() == stalling_rank:
        time.sleep(seconds)
    return dist.get_rank()


def arena_combine_rounds(p: Problem, num_biases: int, repeats: int, cached: bool = False):
    """A dispatch (and a cached dispatch when `cached`) on a Buffer with an arena and on one without,
    then `repeats` combines of the expert outputs on each: on the arena's Buffer from
    empty_combine_input (read where they lie) and from a tensor of their own (copied into the arena
    first where that pays, else the two-pass way), on the other the two-pass combine. Per repeat (in
    place, its weights, from a tensor, its weights, two-pass, its weights)."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **arena_area(p))
    bare = normal_buffer(p.hidden, **TWO_PASS)
    args = dispatch_args(bare, inp, p)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **args)
    bare_x, _, bare_w, _, bare_handle, _ = bare.dispatch(inp["x"], **args)
    if cached:
        recv_x = buffer.dispatch(inp["x"], handle=handle)[0]
        bare_x = bare.dispatch(inp["x"], handle=bare_handle)[0]
    biases = [bias_for(p, rank, inp["x"].shape[0], i).to(device()) for i in range(num_biases)]
    bias = None if num_biases == 0 else (biases[0] if num_biases == 1 else tuple(biases))
    results = []
    for i in range(repeats):
        y = expert_output(recv_x, rank + i)
        in_place = buffer.empty_combine_input(handle, p.hidden).copy_(y)
        results.append(cpu((*buffer.combine(in_place, handle, topk_weights=recv_w, bias=bias)[:2],
                            *buffer.combine(y, handle, topk_weights=recv_w, bias=bias)[:2],
                            *bare.combine(expert_output(bare_x, rank + i), bare_handle, topk_weights=bare_w,
                                          bias=bias)[:2])))
    return results


def combine_input_misuse():
    """What empty_combine_input refuses: (exception type, message) each."""
    p = Problem(5, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=8)
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden)
    recv_x, _, _, _, handle, _ = buffer.dispatch(inp["x"], **dispatch_args(buffer, inp, p))
    outcomes = []
    for attempt in (lambda: buffer.empty_combine_input(handle, 0),
                    lambda: buffer.empty_combine_input(handle, p.hidden, torch.float16),
                    lambda: buffer.empty_combine_input(recv_x, p.hidden)):
        try:
            attempt()
            outcomes.append(("returned", ""))
        except Exception as exc:  # noqa: BLE001
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


def combine_of_empty_combine_input():
    p = Problem(9, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=8)
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden * 2)  # float32 rows
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **dispatch_args(buffer, inp, p))
    x = buffer.empty_combine_input(handle, p.hidden, torch.float32)
    if x.shape != (recv_x.shape[0], p.hidden) or x.dtype != torch.float32:
        return False
    x.copy_(recv_x)
    a, a_w, _ = buffer.combine(x, handle, topk_weights=recv_w)
    b, b_w, _ = buffer.combine(recv_x.float(), handle, topk_weights=recv_w)
    return torch.equal(a, b) and torch.equal(a_w, b_w)


def dispatches_into_arena(p: Problem, use_fp8: bool, num_worst_tokens: int = 0):
    """Six dispatches of different rows into a Buffer's arena, and a cached one, each next to the same
    dispatch on a Buffer without an arena (the two-pass kernels): (per dispatch: its outputs, the bare
    Buffer's, whether its recv_x still held its rows after all of them; whether the arena was whole
    again once every output was dropped)."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **arena_area(p, num_worst_tokens, num_live=8))  # the six recv_x kept, and more
    bare = normal_buffer(p.hidden, **TWO_PASS)
    args = dict(dispatch_args(buffer, inp, p), num_worst_tokens=num_worst_tokens)
    results, kept = [], []
    handle = bare_handle = None
    for i in range(6):
        x = inp["x"] * (i + 1)
        x = fp8.per_token_cast_to_fp8(x) if use_fp8 else x
        out = buffer.dispatch(x, **args)
        reference = bare.dispatch(x, **args)
        handle, bare_handle = handle or out[4], bare_handle or reference[4]
        recv = out[0][0] if use_fp8 else out[0]
        kept.append((recv, recv.clone()))
        results.append([cpu(out[:4]), cpu(reference[:4])])
    x = fp8.per_token_cast_to_fp8(inp["x"]) if use_fp8 else inp["x"]
    results.append([cpu(buffer.dispatch(x, handle=handle)[:1]), cpu(bare.dispatch(x, handle=bare_handle)[:1])])
    kept.append((None, None))
    for result, (recv, copy) in zip(results, kept):
        result.append(recv is None or torch.equal(recv.view(torch.uint8), copy.view(torch.uint8)))
    del kept, recv, out, handle
    torch.cuda.synchronize()
    arena = buffer.stats()["arena"]
    return results, arena["in_use"] == 0 and arena["regions"] == 0


def arena_tensor_outlives_its_buffer(p: Problem) -> bool:
    """Whether a recv_x from the arena kept past its Buffer's destroy() still holds the two-pass
    dispatch's rows (the arena is released when the last such tensor dies)."""
    inp = my_inputs(p)
    bare = normal_buffer(p.hidden, **TWO_PASS)
    buffer = normal_buffer(p.hidden, explicitly_destroy=True, **arena_area(p))
    args = dispatch_args(bare, inp, p)
    recv = buffer.dispatch(inp["x"], **args)[0]
    torch.cuda.synchronize()
    buffer.destroy()
    expected = bare.dispatch(inp["x"], **args)[0]
    return torch.equal(recv.cpu(), expected.cpu())


def arena_too_small(p: Problem, capacity_rows: int):
    """A fixed arena that holds one region of `capacity_rows` bf16 rows, against a Buffer without an
    arena: whether each equals the other's outputs for a dispatch that some ranks' rows do not fit, a
    num_worst_tokens dispatch past the capacity (no rank has room: both take two passes), and then a
    dispatch of at most one token a rank (every rank has room: one pass), with a combine of each; and
    the rows the first dispatch brings this rank."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, num_arena_bytes=arena_bytes(capacity_rows, p.hidden * 2, 0, p.num_topk,
                                                                 num_live=1))
    bare = normal_buffer(p.hidden, **TWO_PASS)
    one = {k: v[:1] for k, v in inp.items()}  # at most a row from each rank: within the capacity
    same, received = [], None
    for rows_in, extra in ((inp, {}), (inp, dict(num_worst_tokens=capacity_rows + 100)), (one, {})):
        args = dict(dispatch_args(bare, rows_in, p), **extra)
        outputs = []
        for b in (buffer, bare):
            recv_x, recv_idx, recv_w, _, handle, _ = b.dispatch(rows_in["x"], **args)
            combined = b.combine(expert_output(recv_x, rank), handle, topk_weights=recv_w)[:2]
            outputs.append(cpu((recv_x, recv_idx, recv_w, *combined)))
        received = outputs[1][0].shape[0] if received is None else received
        same.append(same_bits(*outputs))
    return same, received


def nvshmem_mapping_exchange(unreachable_rank: int, cannot_put_rank: int):
    """NvshmemBuffers' mapping with the extension's entry points faked (any machine): unreachable_rank
    (-1: none) reaches rank 0 only through puts, and cannot_put_rank's build (-1: none) has no NVSHMEM
    device library. -> (puts_anywhere, None, released) or (None, the error's message, released), where
    released says whether this rank freed its share of the heap."""
    from types import SimpleNamespace

    from moe_ep.backends import peers
    from moe_ep.sync import ArrivalGate, next_buffer_serial, timeout_seconds

    rank = dist.get_rank()
    released = []
    ops = SimpleNamespace(nvshmem_alloc=lambda n: 1 << 40, device_zero=lambda ptr, n: None,
                          nvshmem_peer_pointer=lambda own, r: 0 if (rank, r) == (unreachable_rank, 0) else own + r,
                          nvshmem_release=released.append)

    def start(self, group):
        self.ops, self.rank, self.num_ranks = ops, rank, dist.get_world_size(group)
        self.unreachable, self.puts_anywhere, self.device_id = [], False, b"gpu"

    saved = (peers.bootstrap_nvshmem, peers.NvshmemBuffers._start, peers.NvshmemBuffers._finish,
             peers._native.has_nvshmem_device)
    peers.bootstrap_nvshmem = lambda *args: None
    peers.NvshmemBuffers._start, peers.NvshmemBuffers._finish = start, lambda *args: None
    peers._native.has_nvshmem_device = lambda: rank != cannot_put_rank
    try:
        gate = ArrivalGate(dist.group.WORLD, next_buffer_serial(), timeout_seconds())
        mapped = peers.NvshmemBuffers(dist.group.WORLD, gate, 4096, "low_latency_dispatch")
        return mapped.puts_anywhere, None, bool(released)
    except RuntimeError as e:
        return None, str(e), bool(released)
    finally:
        (peers.bootstrap_nvshmem, peers.NvshmemBuffers._start, peers.NvshmemBuffers._finish,
         peers._native.has_nvshmem_device) = saved


def descriptor_round(skipping_rank: int = -1, unreachable_rank: int = -1):
    """Every rank hands a file holding its rank to every other through exchange_descriptors (what the
    peer memory's descriptors travel by); returns (payloads, what each received file holds), or the
    error a rank met (its type's name and message) when skipping_rank never makes the call or
    unreachable_rank cannot reach its peers' sockets."""
    import tempfile

    from moe_ep.backends import descriptors
    from moe_ep.sync import ArrivalGate, next_buffer_serial, timeout_seconds

    rank = dist.get_rank()
    gate = ArrivalGate(dist.group.WORLD, next_buffer_serial(), timeout_seconds())
    if rank == skipping_rank:
        return None
    fetch = descriptors._fetch
    if rank == unreachable_rank:  # as if its peers' sockets were in another network namespace
        def refused(name, peer, timeout_s):
            raise RuntimeError(f"could not fetch rank {peer}'s memory descriptor (test: refused)")
        descriptors._fetch = refused
    with tempfile.TemporaryFile() as f:
        f.write(f"rank {rank}".encode())
        f.flush()
        try:
            payloads, fds = descriptors.exchange_descriptors(gate, "descriptor test", f.fileno(),
                                                             bytes([rank]) * (rank + 1))
        except (TimeoutError, descriptors.DescriptorsUnavailable) as e:
            return type(e).__name__, str(e)
        finally:
            descriptors._fetch = fetch
    try:
        return payloads, {peer: os.pread(fd, 64, 0).decode() for peer, fd in fds.items()}
    finally:
        for fd in fds.values():
            os.close(fd)


def mapped_memory_kinds(p: Problem):
    """How a Buffer's peers' buffers were mapped with the kernels' choices as they are: (intranode, low
    latency), after one round of each on their own Buffers."""
    normal = normal_buffer(p.hidden)
    normal_round(p, buffer=normal)
    low = low_latency_buffer(p)
    low_latency_round(p, use_fp8=True, buffer=low)
    return normal.topology()["peer_memory"]["normal"], low.topology()["peer_memory"]["low_latency"]


def buffers_the_kernels_cannot_serve():
    """Buffers over a group split into nodes of one rank (which the kernels do not serve), made under the
    caller's MOE_EP_BACKEND: for the normal and for the low-latency calls, (exception type, message) or
    ("returned", "")."""
    outcomes = []
    for args, kwargs in (((1 << 20,), {}), ((0, 1 << 20), dict(low_latency_mode=True))):
        try:
            Buffer(dist.group.WORLD, *args, ranks_per_node=1, **kwargs)
            outcomes.append(("returned", ""))
        except Exception as exc:  # noqa: BLE001
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


def calls_after_the_sm_budget_changes(p: Problem):
    """A Buffer sized for the default Configs at the current SM budget: its calls pass, then fail with a
    larger budget (the default Configs follow Buffer.set_num_sms however often a call ran before), and
    pass again at the first budget. -> what each of the three rounds gave."""
    inp = my_inputs(p)
    before = Buffer.num_sms
    buffer = normal_buffer(p.hidden)
    outcomes = []
    try:
        for num_sms in (before, before * 4, before):
            Buffer.set_num_sms(num_sms)
            try:
                recv_x, _, _, _, handle, _ = buffer.dispatch(inp["x"], **dispatch_args(buffer, inp, p))
                buffer.combine(recv_x, handle)
                outcomes.append("passed")
            except ValueError as exc:
                outcomes.append(str(exc))
    finally:
        Buffer.set_num_sms(before)
    return outcomes


def handle_tuples(p: Problem, num_worst_tokens: int = 0):
    """The fields of a dispatch handle and a low-latency handle read as deep_ep's tuples, per rank."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden)
    args = dispatch_args(buffer, inp, p)
    _, _, _, _, handle, _ = buffer.dispatch(inp["x"], num_worst_tokens=num_worst_tokens, **args)
    normal = list(handle)
    ll_buffer = low_latency_buffer(p)
    _, _, ll_handle, _, hook = ll_buffer.low_latency_dispatch(inp["x"], inp["topk_idx"], p.max_tokens,
                                                              p.num_experts, use_fp8=False, return_recv_hook=True)
    try:
        ll_handle[0]
        before_hook = "no error"
    except RuntimeError as e:
        before_hook = str(e)
    hook()
    return cpu(dict(normal=normal, normal_len=len(handle), normal_index=[handle[i] for i in range(len(handle))],
                    low_latency=list(ll_handle), low_latency_len=len(ll_handle), before_hook=before_hook,
                    recv_rows=handle.num_recv_rows))


def killed_on_rank(dead_rank: int):
    """dead_rank's process is SIGKILLed; the others return their rank."""
    import signal

    if dist.get_rank() == dead_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()
