"""Timing helpers shared by the benchmarks: device events for kernels, host clock for whole calls."""
from __future__ import annotations

import statistics
import time
from typing import Callable, List


def cuda_kernel_us(fn: Callable[[], object], iters: int = 200, warmup: int = 20) -> float:
    """Median device time of fn in microseconds, from CUDA events around each call."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


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
