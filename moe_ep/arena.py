"""Regions of a mapped area handed out as tensors that own them.

The one-pass dispatch stores rows straight into the receiver's mapped memory. To give an ordinary
dispatch that speed, recv_x has to live there and still behave like any tensor: its region comes back
to the area when the last tensor over it dies, not when some later call reuses it. `Arena` keeps the
free list; `Region.tensor` makes the tensors (through `__cuda_array_interface__`, or the buffer
protocol for host memory: either way torch holds the object that describes the memory, and with it
the region, until the storage dies).
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import threading
from typing import List, Optional, Tuple

import torch


class Arena:
    """First-fit allocation of byte ranges of [0, size), each a multiple of `align` and starting at one.
    Thread-safe: a region is returned by whichever thread drops its last tensor, and at any moment the
    garbage collector frees it (`release` only queues the range, so that a collection that runs while
    this thread holds the lock cannot wait on it)."""

    def __init__(self, size: int, align: int):
        if align <= 0 or size < 0:
            raise ValueError(f"Arena: size must be >= 0 and align > 0, got {size}, {align}")
        self.size = size // align * align
        self.align = align
        self._lock = threading.Lock()
        self._free: List[Tuple[int, int]] = [(0, self.size)] if self.size else []  # (start, length), sorted
        self._used = {}  # start -> length
        self._released = collections.deque()  # starts given back by `release`, not yet merged
        self._in_use = 0  # bytes of the used ranges
        # The most bytes held at once since the last reset_high_water, counted where a range is kept
        # (alloc, shrink): a reservation that `shrink` trims, or that is freed unused, does not count whole.
        self._high_water = 0

    def release(self, start: int) -> None:
        """Give back the range at start later (at the arena's next use): safe where the lock may be held."""
        self._released.append(start)

    def _merge_released(self) -> None:  # with the lock held
        while self._released:
            self._free_range(self._released.popleft())

    def alloc(self, nbytes: int) -> Optional[int]:
        """The start of a free range of at least nbytes (rounded up to align), or None if none is left."""
        length = max(self.align, -(-nbytes // self.align) * self.align)
        with self._lock:
            self._merge_released()
            for i, (start, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[i]
                    else:
                        self._free[i] = (start + length, free - length)
                    self._used[start] = length
                    self._in_use += length
                    self._high_water = max(self._high_water, self._in_use)
                    return start
        return None

    def reserve_largest(self) -> Optional[Tuple[int, int]]:
        """(start, length) of the largest free range, now used; None if nothing is free. For a call that
        learns its size only after it starts: it gives back what it did not need with `shrink`."""
        with self._lock:
            self._merge_released()
            if not self._free:
                return None
            i = max(range(len(self._free)), key=lambda j: self._free[j][1])
            start, length = self._free.pop(i)
            self._used[start] = length
            self._in_use += length
            return start, length

    def shrink(self, start: int, nbytes: int) -> None:
        """Keep the first nbytes (rounded up to align, at least align) of the used range at start and free
        the rest."""
        keep = max(self.align, -(-nbytes // self.align) * self.align)
        with self._lock:
            length = self._used[start]
            if keep > length:
                raise ValueError(f"Arena.shrink: {keep} bytes is more than the {length} used at {start}")
            if keep < length:
                self._used[start] = keep
                self._used[start + keep] = length - keep
                self._free_range(start + keep)  # merges the tail with the free range after it
            self._high_water = max(self._high_water, self._in_use)

    def free(self, start: int) -> None:
        with self._lock:
            self._merge_released()
            self._free_range(start)

    def _free_range(self, start: int) -> None:  # with the lock held
        length = self._used.pop(start)  # a KeyError here is a double free: a bug, not bad input
        self._in_use -= length
        i = bisect.bisect_left(self._free, (start, 0))
        # Merge with the neighbours it touches, so that large regions stay available.
        if i < len(self._free) and start + length == self._free[i][0]:
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, length))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._merge_released()
            return sum(length for _, length in self._free)

    @property
    def used_regions(self) -> int:
        with self._lock:
            self._merge_released()
            return len(self._used)

    def usage(self) -> dict:
        """{"capacity", "in_use", "high_water": bytes, "regions": used ranges}, read at one moment."""
        with self._lock:
            self._merge_released()
            return dict(capacity=self.size, in_use=self._in_use, high_water=self._high_water,
                        regions=len(self._used))

    def reset_high_water(self) -> None:
        """The high-water mark starts again from the bytes in use now."""
        with self._lock:
            self._merge_released()
            self._high_water = self._in_use


class Region:
    """`nbytes` of an arena at `start`, which lies at device address `base + start` here. Returned to the
    arena when this object dies: the tensors from `tensor` keep it alive. `keep`: what must outlive the
    region (the mapping of the memory: it is released when nothing holds it)."""

    def __init__(self, arena: Arena, start: int, nbytes: int, base: int, device: torch.device, keep=None):
        self.arena, self.start, self.nbytes, self.address, self.device = arena, start, nbytes, base + start, device
        self.keep = keep

    def tensor(self, offset: int, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, columns] of dtype at `offset` bytes into the region."""
        element = dtype.itemsize
        nbytes = rows * columns * element
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"Region.tensor: bytes [{offset}, {offset + nbytes}) lie outside the region's {self.nbytes}")
        if nbytes == 0:
            return torch.empty((rows, columns), dtype=dtype, device=self.device)
        if self.device.type == "cpu":  # host memory (tests, stubbed runs): the buffer protocol holds the region
            host_bytes = (ctypes.c_uint8 * nbytes).from_address(self.address + offset)
            host_bytes.region = self
            raw = torch.frombuffer(host_bytes, dtype=torch.uint8)
        else:
            raw = torch.as_tensor(_RegionBytes(self, self.address + offset, nbytes), dtype=torch.uint8,
                                  device=self.device)
        return raw.view(dtype).view(rows, columns)

    def __del__(self):
        self.arena.release(self.start)


class _RegionBytes:
    """uint8 bytes of a region for torch.as_tensor; torch holds this object, and with it the region,
    until the tensor's storage dies."""

    def __init__(self, region: Region, address: int, nbytes: int):
        self.region = region
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 2}
