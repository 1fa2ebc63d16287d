"""Choices the kernel backends make by themselves, open to benchmarks and tests.

The library picks each of these (the fastest path that fits); a benchmark that compares paths, or a test
that must reach one, overrides them in its own process with `overridden(...)`. Nothing here is read
from the environment: a user has no reason to turn them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

PEER_MEMORY_KINDS = ("auto", "vmm", "ipc")
LOW_LATENCY_MEMORY_KINDS = PEER_MEMORY_KINDS + ("nvshmem",)


@dataclass
class KernelChoices:
    # How peers' buffers are mapped: "auto" takes the driver's virtual-memory API where every rank can
    # share file descriptors, CUDA IPC handles otherwise.
    peer_memory: str = "auto"
    # The same for the low-latency buffers; "nvshmem" maps them through NVSHMEM's symmetric heap.
    low_latency_memory: str = "auto"
    # Low-latency calls reach every peer through NVSHMEM puts even where loads and stores could (so that
    # the put path runs on one host).
    low_latency_puts: bool = False
    # The streaming (True) or windowed (False) intranode combine; None: by rank count.
    stream_combine: Optional[bool] = None
    # The data kernels fit their block count to the ranks sharing a GPU (False: the SM budget as given).
    fit_blocks: bool = True
    # Combines and cached dispatches meet every rank in a one-block kernel first where ranks share a GPU.
    rendezvous: bool = True
    # The intranode kernels add up where their time goes and log when each ran (wait_profile, kernel_log).
    profile_waits: bool = False

    def __post_init__(self):
        if self.peer_memory not in PEER_MEMORY_KINDS:
            raise ValueError(f"peer_memory: expected one of {PEER_MEMORY_KINDS}, got {self.peer_memory!r}")
        if self.low_latency_memory not in LOW_LATENCY_MEMORY_KINDS:
            raise ValueError(f"low_latency_memory: expected one of {LOW_LATENCY_MEMORY_KINDS}, "
                             f"got {self.low_latency_memory!r}")


# One object for the process, changed in place, so that every module that imported it sees the change.
kernel_choices = KernelChoices()


@contextlib.contextmanager
def overridden(**fields):
    """Backends created inside the block (and calls whose choice is made per call) take these choices."""
    saved = dataclasses.asdict(kernel_choices)
    KernelChoices(**{**saved, **fields})  # checks the values
    for name, value in fields.items():
        setattr(kernel_choices, name, value)
    try:
        yield kernel_choices
    finally:
        for name, value in saved.items():
            setattr(kernel_choices, name, value)
