"""Timing helpers shared by the benchmarks: device events for kernels, host clock for whole calls."""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time
from typing import Callable, List, Tuple


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


def host_call_us(fn: Callable[[], object], iters: int = 200, warmup: int = 20, sync: Callable[[], None] = None,
                 settle: Callable[[], None] = None) -> float:
    """Median wall time of one call including its completion (sync), in microseconds. settle runs
    before each call, untimed: with a device synchronize there, calls that only launch are timed with an
    empty launch queue (thousands of calls in a row fill it, and then a launch waits for the device)."""
    sync, settle = sync or (lambda: None), settle or (lambda: None)
    for _ in range(warmup):
        fn()
        sync()
    samples: List[float] = []
    for _ in range(iters):
        settle()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def own_time_per_call(call: Callable[[], object], iters: int, top: int) -> List[Tuple[str, float, float]]:
    """[(function, own us per call, calls per call)] of the `top` functions (Python and C, torch's calls
    included) with the most own time over `iters` calls of `call` under cProfile, which adds about a
    microsecond per function call: the shares matter, not the sums."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        call()
    profiler.disable()
    rows = []
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(profiler).stats.items():
        where = name if path == "~" else f"{os.path.basename(path)}:{line} {name}"  # "~": a C function
        rows.append((where, own / iters * 1e6, calls / iters))
    return sorted(rows, key=lambda row: -row[1])[:top]


def print_own_times(title: str, rows: List[Tuple[str, float, float]]) -> None:
    """own_time_per_call's rows under a title line."""
    print(f"  -- {title} under cProfile: own us per call, calls per call")
    for where, us, calls in rows:
        print(f"     {where[:70]:<70} {us:8.1f} {calls:6.1f}")


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
