"""Timing helpers shared by the benchmarks: device events for kernels, host clock for whole calls."""
from __future__ import annotations

import statistics
import time
from typing import Callable, List


def cuda_kernel_us(fn: Callable[[], object], calls: int = 50, replays: int = 20) -> float:
    """Median device time of one call of fn, in microseconds, with the launch overhead taken out:
    `calls` calls are captured in one CUDA graph and each replay is timed with events. Timing single
    launches with events would measure the host's launch rate for kernels of a few microseconds."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph: allocator, lazy module loading
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def host_call_us(fn: Callable[[], object], iters: int = 200, warmup: int = 20, sync: Callable[[], None] = None) -> float:
    """Median wall time of one call including its completion (sync), in microseconds."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
        sync()
    samples: List[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def device_sync() -> None:
    """Waits for the GPU where this process uses one (the benchmarks' --cpu runs have none)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def wall_seconds_per_call(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Host wall time per call of `iters` back-to-back calls after `warmup`, every rank of the default
    process group starting together (a barrier before) and the device synchronised at the end."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    device_sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    device_sync()
    return (time.perf_counter() - start) / iters
