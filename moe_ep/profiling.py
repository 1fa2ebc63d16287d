"""Buffer.profile(): how long each phase of a Buffer's calls took, per call, on this rank.

A phase of CUDA tensors is timed by two CUDA events: the first recorded on the caller's stream when the
call starts, the second on the stream its work runs on (the communication stream of an async_finish call
on the kernels, else the caller's) when it returns; nothing waits for them until summary() reads them. A
phase of CPU tensors, and the kernels' count exchange (which ends when the host holds the counts), is
timed on the host clock. While no Profile records, a call pays one attribute check and nothing else.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch

if TYPE_CHECKING:  # the Buffer imports this module
    from .buffer import Buffer

# The phases a summary lists, in this order: normal calls, then low-latency calls.
PHASES = ("layout", "count exchange", "dispatch", "cached dispatch", "combine", "low-latency dispatch",
          "low-latency combine", "hook wait")
# Pending CUDA event pairs beyond this are folded into the totals where the device has passed them, so a
# long profiled run keeps a bounded list.
FOLD_AFTER = 1024

# A phase's start: the host clock's reading, a CUDA event, or None (not timed: a CUDA graph is captured).
Mark = Union[float, torch.cuda.Event, None]


def profiling_requested() -> bool:
    """MOE_EP_PROFILE=1: every Buffer profiles its calls from construction."""
    raw = os.environ.get("MOE_EP_PROFILE", "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"MOE_EP_PROFILE: expected 0 or 1, got {raw!r}")
    return raw == "1"


class Profile:
    """Phase times of one Buffer's calls while it records: as a context manager (Buffer.profile()), from
    its entry to its exit; under MOE_EP_PROFILE=1 (Buffer.profiler), from the Buffer's construction. A
    Profile entered while another records feeds that one too. summary() reads this rank's times;
    gather() (every rank calls it) collects every rank's on rank 0."""

    def __init__(self, buffer: "Buffer"):
        # A weak reference: under MOE_EP_PROFILE=1 the Buffer holds its Profile, and must stay freeable.
        self._buffer_ref = weakref.ref(buffer)
        self._outer: Optional[Profile] = None  # the Profile that recorded before this one was entered
        self._totals: Dict[str, List[float]] = {}  # phase -> [calls, total ms, max ms]
        self._pending: List[Tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    # ------------------------------------------------------------ recording (the Buffer and backends call these)
    @staticmethod
    def start(device: Optional[torch.device] = None) -> Mark:
        """A phase starts: an event on the current stream of a CUDA device, else the host clock."""
        if device is None or device.type != "cuda":
            return time.perf_counter()
        if torch.cuda.is_current_stream_capturing():  # a captured event would time the replay, not this call
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def stop(self, phase: str, mark: Mark, stream: Optional[torch.cuda.Stream] = None) -> None:
        """The phase started at `mark` ends: now on the host clock, or behind the work queued so far on
        `stream` (default: the current stream of the mark's device)."""
        if mark is None:
            return
        if isinstance(mark, float):
            elapsed = (time.perf_counter() - mark) * 1e3
            profile = self
            while profile is not None:
                profile._add(phase, elapsed)
                profile = profile._outer
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream if stream is not None else torch.cuda.current_stream())
        profile = self
        while profile is not None:
            profile._pending.append((phase, mark, end))
            if len(profile._pending) > FOLD_AFTER:
                profile._fold(wait=False)
            profile = profile._outer

    def timed_hook(self, hook, device: torch.device):
        """A low-latency call's receive hook that times itself as "hook wait" (None stays None)."""
        if hook is None:
            return None

        def hook_timed():
            mark = self.start(device)
            hook()
            self.stop("hook wait", mark)

        return hook_timed

    def _add(self, phase: str, elapsed_ms: float) -> None:
        totals = self._totals.get(phase)
        if totals is None:
            self._totals[phase] = [1, elapsed_ms, elapsed_ms]
        else:
            totals[0] += 1
            totals[1] += elapsed_ms
            totals[2] = max(totals[2], elapsed_ms)

    def _fold(self, wait: bool) -> None:
        """Adds the pending event pairs to the totals: all of them (wait: waits for the device), or those
        the device has passed."""
        kept = []
        for phase, start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                kept.append((phase, start, end))
                continue
            self._add(phase, start.elapsed_time(end))
        self._pending = kept

    # ------------------------------------------------------------ reading
    def summary(self, phases: Tuple[str, ...] = PHASES) -> Dict[str, Dict[str, float]]:
        """{phase: {"calls", "total_ms", "mean_ms", "max_ms"}} of this rank, for those of `phases` (a
        Buffer's: PHASES; a caller that stops phases of its own names them) that ran at least once. Waits
        for the device to pass the CUDA events recorded so far."""
        self._fold(wait=True)
        return {phase: dict(calls=int(calls), total_ms=total, mean_ms=total / calls, max_ms=most)
                for phase in phases if phase in self._totals
                for calls, total, most in [self._totals[phase]]}

    def gather(self) -> Optional[Dict[int, Dict[str, Dict[str, float]]]]:
        """Every rank's summary() -> on rank 0 {rank: summary}, on the others None. Collective: every rank
        of the Buffer's group calls it, and it meets them within the Buffer's timeout (TimeoutError
        naming a rank that does not come, as a call would)."""
        buffer = self._buffer()
        buffer._check_alive()
        payloads = buffer._gate.exchange("Profile.gather", json.dumps(self.summary()).encode())
        if buffer.rank != 0:
            return None
        return {rank: json.loads(payload) for rank, payload in enumerate(payloads)}

    # ------------------------------------------------------------ recording window
    def __enter__(self) -> "Profile":
        buffer = self._buffer()
        if buffer._profile is self:
            raise RuntimeError("this Profile is already recording")
        self._outer = buffer._profile
        buffer._profile = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        buffer = self._buffer_ref()
        if buffer is not None:
            buffer._profile = self._outer
        self._outer = None
        return False

    def _buffer(self) -> "Buffer":
        buffer = self._buffer_ref()
        if buffer is None:
            raise RuntimeError("the Buffer this Profile recorded was freed; gather() and recording need it")
        return buffer


def format_table(summaries: Dict[int, Dict[str, Dict[str, float]]]) -> str:
    """gather()'s result as a table: a row per (rank, phase) with its calls, mean, max and total ms."""
    lines = [f"{'rank':>4}  {'phase':<20} {'calls':>6} {'mean ms':>10} {'max ms':>10} {'total ms':>10}"]
    for rank, summary in sorted(summaries.items()):
        for phase, row in summary.items():
            lines.append(f"{rank:>4}  {phase:<20} {row['calls']:>6} {row['mean_ms']:>10.3f} {row['max_ms']:>10.3f} "
                         f"{row['total_ms']:>10.3f}")
    return "\n".join(lines)
