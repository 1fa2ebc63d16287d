"""The communication state one dispatch leaves for its combine (and for a cached dispatch).

Handles are opaque to callers. Each records which Buffer made it, so that a handle passed to another
Buffer, or with tensors of another layout, is refused with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class DispatchHandle:
    buffer_serial: int
    num_tokens: int  # N on this rank when the layout was made
    is_token_in_rank: torch.Tensor  # [N, R] bool: which ranks each local token was sent to
    # Tokens sent to / received from each rank (receive order). None where the kernels did not learn
    # them on the host (num_worst_tokens: no host synchronisation).
    send_counts: Optional[List[int]]
    recv_counts: Optional[List[int]]
    num_worst_tokens: int  # > 0: receive tensors were padded to this many rows
    # Filled by the backend that ran the dispatch (e.g. device-side prefix sums for the kernels).
    backend_state: Optional[object] = None

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_counts)

    @property
    def num_recv_rows(self) -> int:
        """Rows of the receive tensors (and of combine's input): padded when num_worst_tokens > 0."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens


@dataclass
class LowLatencyHandle:
    buffer_serial: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    device: torch.device
    backend_state: Optional[object] = None
