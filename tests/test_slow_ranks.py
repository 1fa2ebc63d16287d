"""Slow ranks (moe_ep.slow_ranks): a rank that keeps its peers waiting at the portable backend's meetings
is named in their stats()["slow_ranks"], and in a warning on the "moe_ep" logger where MOE_EP_SLOW_RANK_MS
is set."""
import logging
import os
import time

import pytest
import torch.distributed as dist

from moe_ep.slow_ranks import DEFAULT_SLOW_RANK_MS, LOG_EVERY, SlowRanks, slow_rank_settings

from .problems import Problem
from .rank_fns import construction_error, dispatch_args, my_inputs, normal_buffer, restored_environment, with_env

SLEEP_S = 0.3


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def late_rank_dispatches(p: Problem, late_rank: int, rounds: int) -> dict:
    """`rounds` dispatches that late_rank enters SLEEP_S late; stats()["slow_ranks"] after them, after
    reset_stats(), after a dispatch nobody is late for, then after one more late one; the warnings logged."""
    handler = _Messages()
    logger = logging.getLogger("moe_ep")
    logger.addHandler(handler)
    try:
        inp = my_inputs(p)
        buffer = normal_buffer(p.hidden)
        args = dispatch_args(buffer, inp, p)

        def dispatch(late: bool):
            if late and dist.get_rank() == late_rank:
                time.sleep(SLEEP_S)
            buffer.dispatch(inp["x"], **args)

        for _ in range(rounds):
            dispatch(late=True)
        after_rounds = buffer.stats()["slow_ranks"]
        buffer.reset_stats()
        after_reset = buffer.stats()["slow_ranks"]
        dispatch(late=False)
        on_time = buffer.stats()["slow_ranks"]
        dispatch(late=True)
        return dict(after_rounds=after_rounds, after_reset=after_reset, on_time=on_time,
                    after_one_more=buffer.stats()["slow_ranks"], messages=handler.messages)
    finally:
        logger.removeHandler(handler)


def test_a_late_rank_is_named_in_its_peers_stats_and_log(pools, seed):
    p = Problem(seed, 3, 12, 128, 3, max_tokens=16)
    rounds, late = 4, 1
    # A threshold well above a loaded two-core machine's jitter between punctual ranks (over 20 ms seen),
    # well below the sleep.
    results = pools(3).run(with_env, {"MOE_EP_SLOW_RANK_MS": "100"}, late_rank_dispatches, p, late, rounds)
    for rank, res in enumerate(results):
        if rank == late:  # it never waited for anyone
            assert res["after_rounds"] == {} and res["messages"] == []
            continue
        waits = res["after_rounds"]
        assert list(waits) == [late], waits
        assert waits[late]["count"] == rounds
        assert SLEEP_S * 1e3 * 0.8 <= waits[late]["max_ms"] <= waits[late]["total_ms"]
        assert res["after_reset"] == {} and res["on_time"] == {}
        assert res["after_one_more"][late]["count"] == 1
        # Logged once: the first occurrence; the reset keeps the log's count.
        assert len(res["messages"]) == 1, res["messages"]
        assert res["messages"][0].startswith(f"moe_ep: rank {late} arrived ")
        assert res["messages"][0].endswith(f" ms after rank {rank} at dispatch (1 time so far)")


def without_slow_rank_setting(fn, *args):
    """fn(*args) with MOE_EP_SLOW_RANK_MS unset."""
    with restored_environment(["MOE_EP_SLOW_RANK_MS"]):
        os.environ.pop("MOE_EP_SLOW_RANK_MS", None)
        return fn(*args)


def test_without_the_setting_a_late_rank_is_counted_but_not_logged(pools, seed):
    p = Problem(seed, 2, 8, 128, 2, max_tokens=16)
    late = 1
    results = pools(2).run(without_slow_rank_setting, late_rank_dispatches, p, late, 2)
    waiting = results[1 - late]
    assert waiting["after_rounds"][late]["count"] == 2, waiting["after_rounds"]
    assert SLEEP_S * 1e3 * 0.8 <= waiting["after_rounds"][late]["max_ms"]
    assert all(res["messages"] == [] for res in results), [res["messages"] for res in results]


def test_slow_ranks_count_without_logging_unless_asked(caplog):
    quiet = SlowRanks(rank=0, threshold_ms=5.0)
    with caplog.at_level(logging.WARNING, logger="moe_ep"):
        quiet.record(1, 6.0, "dispatch")
    assert caplog.records == []
    assert quiet.read() == {1: dict(count=1, max_ms=6.0, total_ms=6.0)}


def test_slow_ranks_log_the_first_wait_and_every_hundredth(caplog):
    waits = SlowRanks(rank=0, threshold_ms=5.0, log=True)
    with caplog.at_level(logging.WARNING, logger="moe_ep"):
        waits.record(2, 4.0, "combine")  # under the threshold: not a slow rank
        for i in range(2 * LOG_EVERY + 1):
            waits.record(2, 6.0 + i % 3, "combine")
    assert [r.getMessage() for r in caplog.records] == [
        f"moe_ep: rank 2 arrived {6.0 + n % 3:.1f} ms after rank 0 at combine ({n + 1} time{'' if n == 0 else 's'} so far)"
        for n in (0, LOG_EVERY, 2 * LOG_EVERY)]
    assert waits.read() == {2: dict(count=2 * LOG_EVERY + 1, max_ms=8.0,
                                    total_ms=pytest.approx(sum(6.0 + i % 3 for i in range(2 * LOG_EVERY + 1))))}
    waits.clear()
    assert waits.read() == {}


def test_slow_rank_threshold_from_the_environment(monkeypatch):
    monkeypatch.delenv("MOE_EP_SLOW_RANK_MS", raising=False)
    assert slow_rank_settings() == (DEFAULT_SLOW_RANK_MS, False)  # counted, not logged
    monkeypatch.setenv("MOE_EP_SLOW_RANK_MS", "12.5")
    assert slow_rank_settings() == (12.5, True)
    for bad in ("0", "-1", "inf", "nan", "fast"):
        monkeypatch.setenv("MOE_EP_SLOW_RANK_MS", bad)
        with pytest.raises(ValueError, match="MOE_EP_SLOW_RANK_MS"):
            slow_rank_settings()


def test_a_bad_threshold_is_refused_at_construction(pools):
    messages = pools(2).run(with_env, {"MOE_EP_SLOW_RANK_MS": "soon"}, construction_error)
    assert all("MOE_EP_SLOW_RANK_MS" in m for m in messages), messages
