"""moe_ep_overlap_chunks: one MoE layer's tokens in chunks, each chunk's exchanges travelling while its
neighbours' experts compute, in the forward (MoEEPTokenDispatcher.experts_in_chunks) and the backward.

The backward mirrors the forward. Autograd meets the chunks last first; for chunk i it runs the
combine's backward (the output gradient's cached dispatch), the experts' backward, then the dispatch's
backward (the input gradient's combine). ChunkedBackward starts chunk i-1's gradient dispatch before
chunk i's experts' backward runs and leaves chunk i's gradient combine in flight while chunk i-1's
experts compute; SplitChunks, where the chunks' input gradients meet, waits for every gradient combine.
docs/DESIGN.md says why no gradient is read before it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..events import EventOverlap
from .exchange import CommState, async_args, timed_call, wait_for


class ChunkedBackward:
    """One layer's backward exchanges in chunks: the output gradients' dispatches, started one chunk
    ahead of the chunk whose experts read them, and the input gradients' combines, waited for together."""

    def __init__(self, states: Sequence[CommState]):
        self.states = list(states)
        self._output_grads: List[Optional[torch.Tensor]] = []
        # Started gradient dispatches not yet handed to their chunk's experts: (received rows, event, the
        # device whose wait moe_ep_log_metrics times, or None); the gradient combines in flight likewise.
        self._dispatches: Dict[int, Tuple[torch.Tensor, EventOverlap, Optional[torch.device]]] = {}
        self._combines: List[Tuple[EventOverlap, CommState, Optional[torch.device]]] = []
        self._next_dispatch = -1  # the chunk whose gradient dispatch starts next; they start last chunk first

    def take_output_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """Every chunk's output gradient (JoinChunks' backward, where a backward pass reaches the layer)."""
        self._output_grads = list(grads)
        self._dispatches.clear()
        self._combines.clear()
        self._next_dispatch = len(self._output_grads) - 1

    def received_gradient(self, index: int) -> torch.Tensor:
        """Chunk `index`'s output gradient at the ranks of its experts (its combine's backward), once it
        arrived; the next chunk's gradient dispatch is started first, so that it travels while this
        chunk's experts' backward computes. Any chunk autograd skipped is started too, in the same order
        on every rank."""
        while self._next_dispatch >= max(index - 1, 0):
            self._start_dispatch(self._next_dispatch)
        received, event, timed_device = self._dispatches.pop(index)
        # The rows are read on the caller's stream only after they arrived.
        wait_for(event, self.states[index], timed_device)
        return received

    def _start_dispatch(self, index: int) -> None:
        state, grad = self.states[index], self._output_grads[index]
        self._output_grads[index] = None  # the Buffer's event holds it until the call is done
        with timed_call(state.metrics, state.buffer, grad.device, asynchronous=True) as time_the_wait:
            received, *_, event = state.buffer.dispatch(grad.contiguous(), handle=state.handle, **async_args())
        self._dispatches[index] = (received, event, grad.device if time_the_wait else None)
        self._next_dispatch = index - 1

    def combine_started(self, event: EventOverlap, state: CommState, timed_device: Optional[torch.device]) -> None:
        """A chunk's input gradient combine is in flight; its rows are read after wait_for_combines."""
        self._combines.append((event, state, timed_device))

    def wait_for_combines(self) -> None:
        for event, state, timed_device in self._combines:
            wait_for(event, state, timed_device)
        self._combines.clear()


@dataclass
class Chunks:
    """One layer's forward in chunks: each chunk's rows of the tokens, their probabilities and top-k ids,
    its own exchange state and combined rows, and the backward's exchanges."""

    hidden_states: Tuple[torch.Tensor, ...]
    probs: Tuple[torch.Tensor, ...]
    topk_idx: Tuple[torch.Tensor, ...]
    states: List[CommState]
    backward: ChunkedBackward
    combined: List[torch.Tensor] = field(default_factory=list)


def split_into_chunks(hidden_states: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor,
                      states: List[CommState]) -> Chunks:
    """Contiguous token ranges as even as possible (tensor_split); a rank with fewer tokens than chunks
    has empty ones, which still make their Buffer calls (every rank makes the same calls in order)."""
    count = len(states)
    backward = ChunkedBackward(states)
    parts = SplitChunks.apply(hidden_states, probs, count, backward)
    return Chunks(parts[:count], parts[count:], topk_idx.tensor_split(count), states, backward)


class SplitChunks(torch.autograd.Function):
    """The tokens and their probabilities in chunks (views). Backward: the chunks' gradients joined, once
    every chunk's input gradient combine is done (their rows are written on the communication stream)."""

    @staticmethod
    def forward(ctx, hidden_states, probs, count: int, backward: ChunkedBackward):
        ctx.count, ctx.backward = count, backward
        return (*hidden_states.tensor_split(count), *probs.tensor_split(count))

    @staticmethod
    def backward(ctx, *grads):
        ctx.backward.wait_for_combines()
        return torch.cat(grads[:ctx.count]), torch.cat(grads[ctx.count:]), None, None


class JoinChunks(torch.autograd.Function):
    """The chunks' combined rows in one tensor. Backward: every chunk's gradient handed to the backward's
    exchanges, which dispatch each one ahead of its chunk's turn."""

    @staticmethod
    def forward(ctx, backward: ChunkedBackward, *combined):
        ctx.backward, ctx.rows = backward, [rows.shape[0] for rows in combined]
        return torch.cat(combined)

    @staticmethod
    def backward(ctx, grad):
        grads = grad.split(ctx.rows)
        ctx.backward.take_output_grads(grads)
        return (None, *grads)
