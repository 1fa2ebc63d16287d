"""Bounded waiting for peers on the host side.

Before the portable backend starts a collective, every rank records its arrival at the phase in the
process group's key-value store and waits, with a deadline, for all the others. A rank that does not
arrive in time is then named in a TimeoutError on every rank that did, instead of a collective that
hangs for the process group's timeout (30 minutes by default) and reports nothing useful.
"""

from __future__ import annotations

import datetime
import itertools
import os
from typing import List

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 100.0
_buffer_serials = itertools.count()


def next_buffer_serial() -> int:
    """Buffers are created collectively, in the same order on every rank, so the serial taken here
    names the same Buffer on every rank of its group."""
    return next(_buffer_serials)


def timeout_seconds() -> float:
    """MOE_EP_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get("MOE_EP_TIMEOUT_S", "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"MOE_EP_TIMEOUT_S: expected a number of seconds, got {raw!r}") from None
    return check_timeout("MOE_EP_TIMEOUT_S", value)


def check_timeout(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: expected a positive, finite number of seconds, got {value!r}")
    return float(value)


class ArrivalGate:
    """One per Buffer, keyed by the Buffer's serial."""

    def __init__(self, group: dist.ProcessGroup, serial: int, timeout_s: float):
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self._store = dist.PrefixStore(
            f"moe_ep/{group.group_name}/{serial}", dist.distributed_c10d._get_default_store()
        )
        self._calls = itertools.count()

    def enter(self, phase: str) -> None:
        """Returns once every rank of the group has entered the same call; raises TimeoutError
        naming the missing ranks after the deadline, RuntimeError if ranks are in different calls."""
        self.exchange(phase, b"")

    def exchange(self, phase: str, payload: bytes) -> List[bytes]:
        """enter(), and every rank's payload comes back in rank order (a bounded all-gather)."""
        call = next(self._calls)
        keys = [f"{call}/{r}" for r in range(self.num_ranks)]
        self._store.set(keys[self.rank], phase.encode() + b"\0" + payload)
        try:
            self._store.wait(keys, self.timeout)
        except RuntimeError:  # DistStoreError on timeout
            missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
            raise TimeoutError(
                f"moe_ep: rank(s) {_fmt_ranks(missing)} did not arrive at {phase} (call #{call} of this Buffer) "
                f"within {self.timeout_s:g} s; rank {self.rank} waited. Raise MOE_EP_TIMEOUT_S if the peer is "
                "only slow; after this error the Buffer's ranks are out of step: create a new Buffer."
            ) from None
        entries = [bytes(v).split(b"\0", 1) for v in self._store.multi_get(keys)]
        others = {r: p.decode() for r, (p, _) in enumerate(entries) if p.decode() != phase}
        if others:
            raise RuntimeError(
                f"moe_ep: ranks disagree on the call: rank {self.rank} is in {phase}, but "
                + ", ".join(f"rank {r} is in {p}" for r, p in others.items())
                + ". Every rank of the group must make the same sequence of Buffer calls."
            )
        if call >= 2:
            # Every rank set its key for this call only after passing call - 1, so nobody reads
            # call - 2 any more.
            self._store.delete_key(f"{call - 2}/{self.rank}")
        return [value for _, value in entries]


def _fmt_ranks(ranks: List[int]) -> str:
    return ", ".join(str(r) for r in ranks)
