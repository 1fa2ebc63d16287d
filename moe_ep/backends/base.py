"""The one interface every backend answers, and the calls the Buffer hands it.

The Buffer checks every argument where the user's data enters and then hands a call to the backend
that serves it: the portable backend (torch.distributed) answers every call; the intranode kernels
answer the normal calls, the low-latency kernels the low-latency ones. A backend gets a call only after
all of its checks have passed, and owns whatever state its calls leave (handles' device state, the
arena, the low-latency zero-copy rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch

from ..config import Config
from ..events import EventOverlap
from ..handles import DispatchHandle, LowLatencyHandle

if TYPE_CHECKING:
    from ..profiling import Profile


@dataclass
class DispatchCall:
    x_parts: List[torch.Tensor]  # [x] or [fp8 x, scales]
    handle: Optional[DispatchHandle]  # a cached dispatch's; then the layout arguments are None
    num_tokens_per_rank: Optional[torch.Tensor]
    is_token_in_rank: Optional[torch.Tensor]
    num_tokens_per_expert: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    expert_alignment: int
    num_worst_tokens: int
    config: Config
    previous_event: Optional[EventOverlap]
    async_finish: bool
    allocate_on_comm_stream: bool
    make_handle: Callable[..., DispatchHandle]
    profile: Optional["Profile"] = None  # times the count exchange where the backend has one


@dataclass
class CombineCall:
    x: torch.Tensor
    handle: DispatchHandle
    topk_weights: Optional[torch.Tensor]
    biases: List[torch.Tensor]  # none, one or two
    config: Config
    previous_event: Optional[EventOverlap]
    async_finish: bool
    allocate_on_comm_stream: bool


@dataclass
class LowLatencyDispatchCall:
    x: torch.Tensor
    topk_idx: torch.Tensor
    num_max_tokens: int
    num_experts: int
    stats: Optional[torch.Tensor]  # cumulative_local_expert_recv_stats
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    async_finish: bool
    return_recv_hook: bool
    handle: LowLatencyHandle  # made by the Buffer; the backend fills its state


@dataclass
class LowLatencyCombineCall:
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: LowLatencyHandle
    zero_copy: bool  # x is what low_latency_combine_buffer returned last
    async_finish: bool
    return_recv_hook: bool
    out: Optional[torch.Tensor]


# (recv_x parts, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)
DispatchResult = Tuple[List[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[List[int]],
                       Optional[DispatchHandle], EventOverlap]


class Backend:
    """What each backend answers; a backend that does not serve a kind of call says so."""

    def dispatch(self, call: DispatchCall) -> DispatchResult:
        raise NotImplementedError(f"{type(self).__name__} serves no normal dispatch")

    def combine(self, call: CombineCall) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        raise NotImplementedError(f"{type(self).__name__} serves no normal combine")

    def combine_input(self, handle: DispatchHandle, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised [received rows, hidden] tensor for a combine of `handle` (Buffer.empty_combine_input)."""
        return torch.empty((handle.num_recv_rows, hidden), dtype=dtype, device=handle.is_token_in_rank.device)

    def low_latency_dispatch(self, call: LowLatencyDispatchCall):
        """-> (recv_x or (recv_x, scales), recv_count, event, hook or None)"""
        raise NotImplementedError(f"{type(self).__name__} serves no low-latency dispatch")

    def low_latency_combine(self, call: LowLatencyCombineCall):
        """-> (combined_x, event, hook or None)"""
        raise NotImplementedError(f"{type(self).__name__} serves no low-latency combine")

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The [L, R * max, H] bf16 rows the next low_latency_combine(zero_copy=True) reads."""
        raise NotImplementedError(f"{type(self).__name__} serves no low-latency combine")

    def clean_low_latency_buffer(self, shape: Tuple[int, int, int]) -> None:
        """Clears what low-latency calls of shape (max tokens, hidden, experts) left (collective)."""

    def close(self) -> None:
        """Releases what the backend mapped (collective where the mapping was)."""


def refuse_capture_on_the_kernels(call: str, across_nodes: bool, waits_for_counts: bool = False) -> None:
    """What a CUDA graph cannot hold on the normal kernels: any call across nodes, whose flags take their
    values from the host's count of calls (a replay would reuse the captured ones, and its waits would
    pass at once), and a dispatch that waits on the host for its received token counts (waits_for_counts:
    one without num_worst_tokens)."""
    if not torch.cuda.is_current_stream_capturing():
        return
    if across_nodes:
        raise RuntimeError(
            f"{call}: calls across nodes cannot be captured in a CUDA graph (their flags' values come from "
            "the host's count of calls, which a replay would repeat); run them eagerly"
        )
    if waits_for_counts:
        raise RuntimeError(
            f"{call}: capturing it in a CUDA graph needs num_worst_tokens > 0 (a dispatch without it "
            "waits on the host for the received token counts)"
        )
