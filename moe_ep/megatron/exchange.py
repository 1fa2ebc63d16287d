"""One exchange of the megatron dispatcher (a dispatch and its combine): what the dispatch leaves for the
phases after it, and the arguments that run a Buffer call on the communication stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..buffer import Buffer
from ..events import EventOverlap


@dataclass
class CommState:
    """What one dispatch leaves for its combine and for the post-processing between them."""

    buffer: Optional[Buffer] = None
    handle: object = None
    recv_topk_idx: Optional[torch.Tensor] = None
    tokens_per_expert: Optional[List[int]] = None
    # The received (rows, weights) until autograd takes them (dispatcher._Dispatch).
    received: Optional[Tuple[object, torch.Tensor]] = None
    # FP8 dispatch: the recipe's (power-of-two scales, amax_epsilon), and the received (e4m3, scales).
    fp8_scaling: Optional[Tuple[bool, float]] = None
    recv_fp8: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    # The exchange started by token_dispatch / token_combine, waited for by the next phase.
    pending: Optional[EventOverlap] = None
    # dispatch_postprocess's permutation of the received rows, which combine_preprocess undoes.
    reversed_mapping: Optional[torch.Tensor] = None
    local_routing_map: Optional[torch.Tensor] = None
    received_shape: Optional[torch.Size] = None

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.current_stream_wait()
            self.pending = None


def async_args() -> dict:
    """Arguments that run a Buffer call on its communication stream after the work queued so far, and
    return at once with an event for its end (the Buffer records its tensors on the streams that use
    them, so the caching allocator keeps them until that work is done)."""
    return dict(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
