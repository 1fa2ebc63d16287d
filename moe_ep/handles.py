"""The communication state one dispatch leaves for its combine (and for a cached dispatch).

Each handle records which Buffer made it, so that a handle passed to another Buffer, or with tensors of
another layout, is refused with a clear message. Handles also read as deep_ep's tuples (indexing, len,
iteration), so code that unpacks or indexes a deep_ep handle runs unchanged:

normal (intranode) handle, 6 entries as deep_ep's:
  [0] rank_prefix_matrix  int32 [R, R]: entry [i][j] = tokens that ranks 0..i send to rank j (column
      `rank` gives where each source's rows end in recv_x)
  [1] send_pos            int32 [N, R]: row of each local token among those sent to rank r, -1 if not
      sent (deep_ep keeps its channel prefix matrix here)
  [2] None                (deep_ep: its receive-channel prefix matrix; moe_ep has no channels)
  [3] recv_src_idx        int32 [rows]: the source token index of each received row (-1: padding)
  [4] is_token_in_rank    bool  [N, R]
  [5] None                (deep_ep: its send head; moe_ep's combine needs none)

low-latency handle, 5 entries as deep_ep's:
  [0] packed_recv_src_info    int32 [L, R * max]: source token index of each received row (-1: unused)
  [1] packed_recv_layout_range int64 [L, R]: begin << 32 | count of each source rank's rows in that
      local expert's region
  [2] num_max_dispatch_tokens_per_rank, [3] hidden, [4] num_experts
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch


class _TupleView:
    """Indexing, len and iteration over the attributes named in `_ENTRIES`, None standing for an entry
    moe_ep has no counterpart of (deep_ep's handles are tuples). Each index reads only its own entry:
    some are computed when read."""

    _ENTRIES: tuple = ()

    def _entry(self, name: Optional[str]):
        return None if name is None else getattr(self, name)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self._entry(name) for name in self._ENTRIES[index])
        return self._entry(self._ENTRIES[index])

    def __len__(self) -> int:
        return len(self._ENTRIES)

    def __iter__(self):
        return (self._entry(name) for name in self._ENTRIES)


@dataclass(eq=False)
class DispatchHandle(_TupleView):
    buffer_serial: int
    num_tokens: int  # N on this rank when the layout was made
    is_token_in_rank: torch.Tensor  # [N, R] bool: which ranks each local token was sent to
    # Tokens sent to / received from each rank (receive order). None where the kernels did not learn
    # them on the host (num_worst_tokens: no host synchronisation).
    send_counts: Optional[List[int]]
    recv_counts: Optional[List[int]]
    num_worst_tokens: int  # > 0: receive tensors were padded to this many rows
    # int32 [R, R], entry [i][j]: tokens ranks 0..i send to rank j (on the device that ran the call).
    rank_prefix_matrix: Optional[torch.Tensor] = None
    # int32 [rows]: the source token index of each received row, -1 on padding rows.
    recv_src_idx: Optional[torch.Tensor] = None
    # Filled by the backend that ran the dispatch (e.g. device-side prefix sums for the kernels).
    backend_state: Optional[object] = None
    _send_pos: Optional[torch.Tensor] = field(default=None, repr=False)
    # Tokens received per local expert (Buffer.stats): a list where the host learnt them, an int64 device
    # tensor where the device counted them while stats were collected, else None.
    recv_expert_counts: Optional[object] = field(default=None, repr=False)
    # The arrival gate's number of the meeting its dispatch passed (the same on every rank), where the
    # portable backend ran it or the kernels under MOE_EP_DEBUG=1: the calls that take the handle name
    # their dispatch by it.
    gate_call: Optional[int] = field(default=None, repr=False)

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_counts)

    @property
    def num_recv_rows(self) -> int:
        """Rows of the receive tensors (and of combine's input): padded when num_worst_tokens > 0."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens

    @property
    def send_pos(self) -> torch.Tensor:
        """int32 [N, R]: row of each local token among those sent to rank r (ascending token order), -1
        where the token is not sent there. Made on first use where the backend kept none."""
        if self._send_pos is None:
            sent = self.is_token_in_rank.to(torch.int32)
            before = torch.cumsum(sent, dim=0, dtype=torch.int32) - sent
            self._send_pos = torch.where(self.is_token_in_rank, before, torch.full_like(before, -1))
        return self._send_pos

    _ENTRIES = ("rank_prefix_matrix", "send_pos", None, "recv_src_idx", "is_token_in_rank", None)


@dataclass(eq=False)
class LowLatencyHandle(_TupleView):
    buffer_serial: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    device: torch.device
    backend_state: Optional[object] = None
    # int32 [L, R * max]: (source rank, source token) of each received row, packed as
    # source rank * max + source token, -1 where no row was received; set by the backend (its receive),
    # or a function that makes it (None before the receive ran), where making it costs device work.
    recv_source: Optional[object] = field(default=None, repr=False)
    # The dispatch's topk_idx, kept where the data checks run, for the combine to compare with.
    dispatch_topk_idx: Optional[torch.Tensor] = field(default=None, repr=False)
    # As DispatchHandle.gate_call: the meeting its low_latency_dispatch passed (portable, or debug kernels).
    gate_call: Optional[int] = field(default=None, repr=False)

    def _source(self) -> torch.Tensor:
        source = self.recv_source() if callable(self.recv_source) else self.recv_source
        if source is None:
            raise RuntimeError("handle: the dispatch has not received yet; call its hook first")
        return source

    @property
    def packed_recv_src_info(self) -> torch.Tensor:
        """int32 [L, R * max]: the source token index of each received row, -1 on rows not received."""
        source = self._source()
        return torch.where(source >= 0, source % self.num_max_dispatch_tokens_per_rank, source)

    @property
    def packed_recv_layout_range(self) -> torch.Tensor:
        """int64 [L, R]: begin << 32 | count of each source rank's rows in each local expert's region
        (rows arrive ordered by source rank, so each source's rows are one run)."""
        source = self._source().to(torch.int64)
        num_ranks = source.shape[1] // self.num_max_dispatch_tokens_per_rank
        src_rank = torch.where(source >= 0, source // self.num_max_dispatch_tokens_per_rank,
                               torch.full_like(source, num_ranks))
        ranks = torch.arange(num_ranks + 1, dtype=torch.int64, device=source.device)
        counts = (src_rank.unsqueeze(-1) == ranks).sum(dim=1)[:, :num_ranks]  # [L, R]
        begins = torch.cumsum(counts, dim=1) - counts
        return (begins << 32) | counts

    _ENTRIES = ("packed_recv_src_info", "packed_recv_layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                "num_experts")
