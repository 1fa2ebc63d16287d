"""One exchange of the megatron dispatcher (a dispatch and its combine): what the dispatch leaves for the
phases after it, and the arguments that run a Buffer call on the communication stream."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..buffer import Buffer
from ..events import EventOverlap
from .capacity import FixedRows
from .metrics import LayerMetrics


@dataclass
class CommState:
    """What one dispatch leaves for its combine and for the post-processing between them."""

    buffer: Optional[Buffer] = None
    handle: object = None
    recv_topk_idx: Optional[torch.Tensor] = None
    tokens_per_expert: Optional[List[int]] = None
    # Under a capacity: the dispatch's sizes, known on the host without the counts (capacity.py).
    fixed: Optional[FixedRows] = None
    # The received (rows, weights) until autograd takes them (dispatcher._Dispatch).
    received: Optional[Tuple[object, torch.Tensor]] = None
    # FP8 dispatch: the recipe's (power-of-two scales, amax_epsilon), and the received (e4m3, scales).
    fp8_scaling: Optional[Tuple[bool, float]] = None
    recv_fp8: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    # The exchange started by token_dispatch / token_combine, waited for by the next phase.
    pending: Optional[EventOverlap] = None
    # moe_ep_log_metrics: where the counts and times go, and the device of a pending call whose wait is timed.
    metrics: Optional[LayerMetrics] = None
    timed_wait: Optional[torch.device] = None
    # dispatch_postprocess's permutation of the received rows, which combine_preprocess undoes.
    reversed_mapping: Optional[torch.Tensor] = None
    local_routing_map: Optional[torch.Tensor] = None
    received_shape: Optional[torch.Size] = None
    # Under a capacity: which permuted rows are received rows of their expert (the others are padding).
    routed_rows: Optional[torch.Tensor] = None

    def wait(self) -> None:
        if self.pending is not None:
            wait_for(self.pending, self, self.timed_wait)
            self.pending = None


def timed_call(metrics: Optional[LayerMetrics], buffer: Buffer, device: torch.device, asynchronous: bool):
    """A Buffer call timed for moe_ep_log_metrics (yields whether its wait is to be timed); off: nothing."""
    if metrics is None:
        return contextlib.nullcontext(False)
    return metrics.call(buffer, device, asynchronous)


def wait_for(event: EventOverlap, state: CommState, timed_device: Optional[torch.device]) -> None:
    """The caller's stream waits for a call's event; timed as exposed communication where the call asked."""
    if timed_device is not None:
        state.metrics.wait(event, state.buffer, timed_device)
    else:
        event.current_stream_wait()


def async_args() -> dict:
    """Arguments that run a Buffer call on its communication stream after the work queued so far, and
    return at once with an event for its end (the Buffer records its tensors on the streams that use
    them, so the caching allocator keeps them until that work is done)."""
    return dict(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
