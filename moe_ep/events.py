"""EventOverlap: a handle on asynchronous communication that the caller can wait for.

On CUDA it wraps a torch.cuda.Event recorded on the communication stream and keeps the tensors the
communication still reads or writes alive until the caller waits. On CPU (portable backend) every call
completes before it returns, so the event is empty and waiting is free.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


class EventOverlap:
    def __init__(
        self, event: Optional["torch.cuda.Event"] = None, extra_tensors: Optional[Iterable[torch.Tensor]] = None
    ):
        self.event = event
        # Held only so the caching allocator cannot reuse memory a pending kernel still touches.
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.current_stream_wait()
        return False


def capture_current_stream() -> EventOverlap:
    """An event on the current CUDA stream, or an empty one where there is no CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return EventOverlap()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return EventOverlap(event)


def wait_previous(previous_event: Optional[EventOverlap]) -> None:
    """The Buffer checks the type at its boundary (Buffer._check_events) before calling this."""
    if previous_event is not None:
        previous_event.current_stream_wait()


def finish_event(async_finish: bool, tensors) -> EventOverlap:
    """What a call returns as its event: with async_finish, one on the current stream holding `tensors`
    (None entries skipped); else an empty one (the call's work is ordered before the caller's next)."""
    if async_finish:
        event = capture_current_stream()
        return EventOverlap(event.event, [t for t in tensors if isinstance(t, torch.Tensor)])
    return EventOverlap()
