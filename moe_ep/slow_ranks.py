"""Which peers keep a rank waiting at the portable backend's host meetings (moe_ep.sync), and how long.

A meeting where this rank waited longer than a threshold (MOE_EP_SLOW_RANK_MS, default
DEFAULT_SLOW_RANK_MS) for the last of its peers counts against that peer: how often, the longest and
the total wait, read by Buffer.stats()["slow_ranks"]. Where MOE_EP_SLOW_RANK_MS is set, the first such
wait for a peer, and every LOG_EVERY-th after it, is also logged as a warning on the "moe_ep" logger;
unset, nothing is logged: on a machine with more ranks than cores (a CPU run) every rank is late now and
then, and a line per peer would read as a fault where there is none.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Tuple

# A few milliseconds: far above a meeting's own cost on one host (tens of microseconds) and the jitter
# of a loaded machine, far below the stall of a rank that is really behind.
DEFAULT_SLOW_RANK_MS = 5.0
LOG_EVERY = 100
logger = logging.getLogger("moe_ep")


def slow_rank_settings() -> Tuple[float, bool]:
    """(threshold in ms, whether late peers are logged) from MOE_EP_SLOW_RANK_MS: its value and True
    where set, else (DEFAULT_SLOW_RANK_MS, False)."""
    raw = os.environ.get("MOE_EP_SLOW_RANK_MS", "")
    if not raw:
        return DEFAULT_SLOW_RANK_MS, False
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"MOE_EP_SLOW_RANK_MS: expected a positive, finite number of milliseconds, got {raw!r}")
    return value, True


class SlowRanks:
    """This rank's waits for late peers, per peer: [count, max ms, total ms] since the last clear().
    log: also log them (the module's docstring says when)."""

    def __init__(self, rank: int, threshold_ms: float, log: bool = False):
        self.rank = rank
        self.threshold_ms = threshold_ms
        self.log = log
        self._waits: Dict[int, List[float]] = {}
        # Occurrences per peer over the Buffer's life, which clear() keeps: the log's cadence.
        self._logged_count: Dict[int, int] = {}

    def record(self, peer: int, waited_ms: float, phase: str) -> None:
        """This rank waited waited_ms at meeting `phase` for `peer`, the last to arrive."""
        if waited_ms <= self.threshold_ms:
            return
        waits = self._waits.get(peer)
        if waits is None:
            self._waits[peer] = [1, waited_ms, waited_ms]
        else:
            waits[0] += 1
            waits[1] = max(waits[1], waited_ms)
            waits[2] += waited_ms
        if not self.log:
            return
        seen = self._logged_count[peer] = self._logged_count.get(peer, 0) + 1
        if (seen - 1) % LOG_EVERY == 0:
            logger.warning("moe_ep: rank %d arrived %.1f ms after rank %d at %s (%d time%s so far)", peer, waited_ms,
                           self.rank, phase, seen, "" if seen == 1 else "s")

    def read(self) -> Dict[int, Dict[str, float]]:
        return {peer: dict(count=int(count), max_ms=most, total_ms=total)
                for peer, (count, most, total) in sorted(self._waits.items())}

    def clear(self) -> None:
        self._waits = {}
