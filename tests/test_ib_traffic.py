"""The InfiniBand service level and traffic class of NVSHMEM's traffic (Buffer(..., ib_service_level=,
ib_traffic_class=), MOE_EP_IB_SL, MOE_EP_IB_TRAFFIC_CLASS): the environment NVSHMEM would read for each
combination, conflicts and bad values refused before any rank communicates, and the ranks' agreement.
Whether NVSHMEM's queue pairs then carry them needs two nodes on an InfiniBand / RoCE fabric."""
import os
import random

import pytest
import torch.distributed as dist

from moe_ep import Buffer, ib_traffic

from .rank_fns import outcome, restored_environment

SL, TC = "NVSHMEM_IB_SL", "NVSHMEM_IB_TRAFFIC_CLASS"


@pytest.fixture
def fresh(monkeypatch):
    """No value set by an earlier Buffer of this process."""
    monkeypatch.setattr(ib_traffic, "_set_here", {})


def _values(seed):
    rng = random.Random(seed)
    return rng.randint(0, 15), rng.randint(0, 255)


def _nvshmem_sees(arguments: dict, environ: dict, started: bool = False) -> dict:
    effective = ib_traffic.resolve(arguments, environ, started)
    ib_traffic.apply(effective, environ)
    return {name: environ.get(name) for name in (SL, TC)}


def test_the_argument_or_else_the_variable_sets_what_nvshmem_reads(fresh, seed):
    sl, tc = _values(seed)
    assert _nvshmem_sees({}, {}) == {SL: None, TC: None}, "nothing given: NVSHMEM's own defaults"
    assert _nvshmem_sees(dict(ib_service_level=sl), {}) == {SL: str(sl), TC: None}
    assert _nvshmem_sees(dict(ib_traffic_class=tc), {}) == {SL: None, TC: str(tc)}
    assert _nvshmem_sees({}, {"MOE_EP_IB_SL": str(sl), "MOE_EP_IB_TRAFFIC_CLASS": str(tc)}) == {SL: str(sl), TC: str(tc)}
    other = (sl + 1) % 16
    assert _nvshmem_sees(dict(ib_service_level=sl), {"MOE_EP_IB_SL": str(other)})[SL] == str(sl), "the argument wins"
    # An NVSHMEM variable alone is NVSHMEM's to read; the same value beside ours is no conflict.
    assert _nvshmem_sees({}, {TC: str(tc)}) == {SL: None, TC: str(tc)}
    assert _nvshmem_sees(dict(ib_traffic_class=tc), {TC: str(tc)}) == {SL: None, TC: str(tc)}


def test_an_explicit_nvshmem_variable_that_conflicts_is_an_error(fresh, seed):
    sl, tc = _values(seed)
    environ = {SL: str((sl + 3) % 16)}
    with pytest.raises(ValueError, match=rf"ib_service_level={sl} conflicts with NVSHMEM_IB_SL={(sl + 3) % 16}"):
        _nvshmem_sees(dict(ib_service_level=sl), environ)
    with pytest.raises(ValueError, match=rf"MOE_EP_IB_TRAFFIC_CLASS={tc} conflicts with NVSHMEM_IB_TRAFFIC_CLASS"):
        _nvshmem_sees({}, {"MOE_EP_IB_TRAFFIC_CLASS": str(tc), TC: str((tc + 1) % 256)})
    assert environ == {SL: str((sl + 3) % 16)}, "a refusal changes nothing"


def test_a_later_buffer_may_change_a_value_until_nvshmem_starts(fresh, seed):
    sl, _ = _values(seed)
    environ = {}
    _nvshmem_sees(dict(ib_service_level=sl), environ)
    other = (sl + 5) % 16
    assert _nvshmem_sees(dict(ib_service_level=other), environ)[SL] == str(other)
    with pytest.raises(ValueError, match="NVSHMEM has started with it"):
        _nvshmem_sees(dict(ib_service_level=sl), environ, started=True)
    assert _nvshmem_sees(dict(ib_service_level=other), environ, started=True)[SL] == str(other)


def test_a_value_the_user_spelled_otherwise_stays_theirs(fresh, seed):
    sl, _ = _values(seed)
    environ = {SL: f"0{sl}"}
    assert _nvshmem_sees(dict(ib_service_level=sl), environ)[SL] == f"0{sl}", "equal: left as written"
    with pytest.raises(ValueError, match="an explicit setting is not overridden"):
        _nvshmem_sees(dict(ib_service_level=(sl + 1) % 16), environ)


def test_a_value_given_after_nvshmem_started_without_it_is_an_error(fresh, seed):
    sl, tc = _values(seed)
    with pytest.raises(ValueError, match=rf"ib_service_level={sl}: NVSHMEM has started in this process without"):
        _nvshmem_sees(dict(ib_service_level=sl), {}, started=True)
    with pytest.raises(ValueError, match=rf"MOE_EP_IB_TRAFFIC_CLASS={tc}: NVSHMEM has started"):
        _nvshmem_sees({}, {"MOE_EP_IB_TRAFFIC_CLASS": str(tc)}, started=True)
    assert _nvshmem_sees({}, {SL: str(sl)}, started=True) == {SL: str(sl), TC: None}, "nothing asked: no error"


@pytest.mark.parametrize("arguments, environ, error, message", [
    (dict(ib_service_level=16), {}, ValueError, "ib_service_level: expected an int from 0 to 15, got 16"),
    (dict(ib_service_level=-1), {}, ValueError, "ib_service_level: expected an int from 0 to 15, got -1"),
    (dict(ib_traffic_class=256), {}, ValueError, "ib_traffic_class: expected an int from 0 to 255, got 256"),
    (dict(ib_traffic_class=True), {}, TypeError, "ib_traffic_class: expected an int from 0 to 255, got bool"),
    (dict(ib_service_level="3"), {}, TypeError, "ib_service_level: expected an int from 0 to 15, got str"),
    ({}, {"MOE_EP_IB_SL": "high"}, ValueError, "MOE_EP_IB_SL: expected an int from 0 to 15, got 'high'"),
    ({}, {"MOE_EP_IB_TRAFFIC_CLASS": "300"}, ValueError, "MOE_EP_IB_TRAFFIC_CLASS: expected an int from 0 to 255"),
    ({}, {SL: "-2"}, ValueError, "NVSHMEM_IB_SL: expected an int from 0 to 15, got '-2'"),
    ({}, {"MOE_EP_IB_SL": "\u0663"}, ValueError, "MOE_EP_IB_SL: expected an int from 0 to 15"),  # an Arabic-Indic 3
])
def test_bad_values_are_refused(fresh, arguments, environ, error, message):
    with pytest.raises(error, match=message):
        ib_traffic.resolve(arguments, dict(environ), False)


# ------------------------------------------------------------------ through Buffer(...) on CPU ranks

def _restoring_environment(fn, *args):
    """fn(*args) on this rank, the NVSHMEM and moe_ep variables and the module's record put back after."""
    names = [name for setting in ib_traffic.SETTINGS for name in (setting.variable, setting.nvshmem_variable)]
    record = dict(ib_traffic._set_here)
    try:
        with restored_environment(names):
            return fn(*args)
    finally:
        ib_traffic._set_here.clear()
        ib_traffic._set_here.update(record)


def _buffers(per_rank_kwargs: list):
    """Buffer(..., **per_rank_kwargs[rank]) -> (its outcome, what NVSHMEM would read, a plain Buffer's outcome)."""
    def run():
        made = outcome(lambda: Buffer(dist.group.WORLD, 1 << 20, **per_rank_kwargs[dist.get_rank()]))
        seen = {name: os.environ.get(name) for name in (SL, TC)}
        return made, seen, outcome(lambda: Buffer(dist.group.WORLD, 1 << 20))
    return _restoring_environment(run)


def test_a_buffer_sets_them_and_the_ranks_agree(pools, seed):
    sl, tc = _values(seed)
    for made, seen, later in pools(2).run(_buffers, [dict(ib_service_level=sl, ib_traffic_class=tc)] * 2):
        assert made == ("returned", "") and later == ("returned", "")
        assert seen == {SL: str(sl), TC: str(tc)}


def test_a_bad_value_on_one_rank_is_refused_on_every_rank(pools, seed):
    """Refused by its own checks before the construction's meeting: the peers raise naming that rank, nothing
    is set, and the next Buffer is made."""
    sl, _ = _values(seed)
    results = pools(2).run(_buffers, [dict(ib_service_level=sl), dict(ib_service_level=99)])
    (made0, seen0, later0), (made1, seen1, later1) = results
    assert made1 == ("ValueError", "ib_service_level: expected an int from 0 to 15, got 99")
    assert made0[0] == "RuntimeError" and "rank 1" in made0[1] and "ib_service_level" in made0[1], made0
    assert seen0 == seen1 == {SL: None, TC: None}
    assert later0 == later1 == ("returned", "")


def test_ranks_that_disagree_all_raise(pools, seed):
    sl, _ = _values(seed)
    results = pools(2).run(_buffers, [dict(ib_service_level=sl), dict(ib_service_level=(sl + 1) % 16)])
    for made, seen, later in results:
        assert made[0] == "ValueError" and "ib_service_level: the ranks disagree (rank 0:" in made[1], made
        assert seen == {SL: None, TC: None}
        assert later == ("returned", "")
