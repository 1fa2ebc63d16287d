"""Shrink mode (Buffer(enable_shrink=True)): low-latency calls go on without ranks that stopped answering.

Every rank keeps a mask of ranks. A low-latency call meets among the unmasked ranks at the Buffer's
arrival gate; a rank that has not arrived by the deadline is masked by the meeting's one verdict, so every
survivor masks the same ranks at the same call. The rows then travel through the process group's store
between the ranks that took part only, since a collective over the whole group would wait for the masked
ones. A masked rank's calls run alone: it receives nothing, and its tokens reach no expert.
"""

from __future__ import annotations

import warnings
from typing import List, Sequence, Set

import torch

from .sync import ArrivalGate, Form, MaskedByPeers


class RankMask:
    """The ranks this rank leaves out of its low-latency calls."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.ranks: Set[int] = set()

    def update(self, rank: int, masked: bool) -> None:
        if masked:
            self.ranks.add(rank)
        else:
            self.ranks.discard(rank)

    def clean(self) -> None:
        self.ranks.clear()

    def as_tensor(self) -> torch.Tensor:
        """int32 [R]: 1 where a rank is masked."""
        status = torch.zeros(self.num_ranks, dtype=torch.int32)
        status[sorted(self.ranks)] = 1
        return status


class SurvivorExchange:
    """The meetings and row exchanges of shrink-mode calls, among the ranks a mask leaves."""

    def __init__(self, gate: ArrivalGate, mask: RankMask):
        self.gate = gate
        self.mask = mask
        self.rank = gate.rank

    def meet(self, phase: str, form: Form) -> "Meeting":
        """The call's meeting: masks the ranks that did not come (on every survivor alike) -> who took part.
        A rank its peers masked before it came runs this call, and the later ones, alone."""
        if self.rank in self.mask.ranks:
            return Meeting(self.gate.pass_alone(), [])
        call = self.gate.calls
        masked_before = set(self.mask.ranks)
        try:
            return Meeting(call, self.gate.enter_survivors(phase, form, self.mask.ranks))
        except MaskedByPeers as exc:
            warnings.warn(str(exc), RuntimeWarning, stacklevel=5)
            return Meeting(call, [])
        finally:
            newly_masked = sorted(self.mask.ranks - masked_before)
            if newly_masked and self.rank not in newly_masked:
                warnings.warn(f"moe_ep: rank(s) {', '.join(map(str, newly_masked))} did not arrive at {phase} "
                              f"(call #{call} of this Buffer) within {self.gate.timeout_s:g} s and are masked from "
                              "now on (enable_shrink=True)", RuntimeWarning, stacklevel=5)

    def send_rows(self, meeting: "Meeting", tag: str, rows: torch.Tensor, counts: Sequence[int]):
        """Sends counts[r] consecutive uint8 rows to each rank r that took part (rows for other ranks must
        be absent: counts[r] == 0). -> a function that waits for the rows each of them sent here and
        returns (those rows in rank order, the count from each rank)."""
        row_bytes = rows.shape[1]
        host_rows = rows.cpu()
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        segments = {r: host_rows[starts[r] : starts[r + 1]] for r in range(len(counts))}
        for r in meeting.present:
            if r != self.rank:
                self.gate.post(meeting.call, tag, r, _to_bytes(segments[r]))

        def receive():
            peers = [r for r in meeting.present if r != self.rank]
            received = dict(zip(peers, self.gate.collect(meeting.call, tag, peers)))
            parts, recv_counts = [], [0] * len(counts)
            for r in meeting.present:
                part = segments[r] if r == self.rank else _from_bytes(received[r], row_bytes)
                parts.append(part)
                recv_counts[r] = part.shape[0]
            joined = torch.cat(parts) if parts else torch.empty(0, row_bytes, dtype=torch.uint8)
            return joined.to(rows.device), recv_counts

        return receive


class Meeting:
    """A shrink-mode call's meeting: its number and the ranks that took part (none where this rank is masked)."""

    __slots__ = ("call", "present")

    def __init__(self, call: int, present: List[int]):
        self.call = call
        self.present = present


def _to_bytes(rows: torch.Tensor) -> bytes:
    return rows.contiguous().numpy().tobytes()


def _from_bytes(payload: bytes, row_bytes: int) -> torch.Tensor:
    if not payload:
        return torch.empty(0, row_bytes, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(-1, row_bytes)
