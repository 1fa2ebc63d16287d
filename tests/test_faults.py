"""One rank at fault, the others not: a spoiled argument, a disagreement, a missed or late meeting. Every
rank must raise a clear exception within the peer timeout (the faulty rank naming its argument, the
others naming that rank and the step), and the group's next Buffer (or the same one, where the ranks
stayed in step) must work."""
import pytest

from . import fault_fns
from .fault_fns import BAD_CALLS, BAD_CONSTRUCTIONS, DISAGREEMENTS, TIMEOUT_S

NUM_RANKS = 4
BAD_RANK = 2


def _refused_by(rank: int, text: str, outcome) -> None:
    """The peers of a refusing rank raise at once, naming it and what it refused."""
    exc_type, message = outcome
    assert exc_type == "RuntimeError", outcome
    assert f"rank {rank} refused its arguments" in message and text in message, message


@pytest.mark.parametrize("explicit_ranks_per_node", [False, True])
def test_a_bad_construction_argument_on_one_rank(pools, explicit_ranks_per_node):
    results = pools(NUM_RANKS).run(fault_fns.bad_construction_on_one_rank, BAD_RANK, explicit_ranks_per_node)
    for name, (_, _, exc_type, text) in BAD_CONSTRUCTIONS.items():
        for rank, outcomes in enumerate(results):
            made, later = outcomes[name]
            if rank == BAD_RANK:
                assert made == (exc_type.__name__, made[1]) and text in made[1], (name, made)
            else:
                _refused_by(BAD_RANK, text, made)
                assert "Buffer construction (host names) ran on no rank" in made[1], made
            assert later == ("returned", ""), (name, rank, later)


def test_one_rank_disagreeing_on_a_construction_argument(pools):
    results = pools(NUM_RANKS).run(fault_fns.construction_disagreements, 1)
    for name in DISAGREEMENTS:
        for rank, outcomes in enumerate(results):
            made, later = outcomes[name]
            if name == "ranks_per_node given":  # the given value is the one the host names give
                assert made == ("returned", ""), made
            else:
                argument = name.split()[0]
                assert made[0] == "ValueError" and f"{argument}: the ranks disagree (rank 0:" in made[1], (name, made)
            assert later == ("returned", ""), (name, rank, later)


def test_a_rank_late_to_a_construction(pools):
    """The others name it within the timeout; it raises TimeoutError when it comes; the next Buffer works."""
    results = pools(NUM_RANKS).run(fault_fns.construction_missed, BAD_RANK)
    for rank, (made, later) in enumerate(results):
        assert made[0] == "TimeoutError", made
        if rank == BAD_RANK:
            assert f"rank {BAD_RANK} arrived at Buffer construction (host names)" in made[1], made
            assert "had stopped waiting for it" in made[1], made
        else:
            assert (f"rank(s) {BAD_RANK} did not arrive at Buffer construction (host names) (call #"
                    in made[1] and f"within {TIMEOUT_S:g} s" in made[1]), made
        assert later == ("returned", ""), later


def test_a_rank_late_to_a_call(pools):
    """The others name it; it raises TimeoutError too instead of entering a collective alone; the Buffer
    says so on every later call of every rank; a new Buffer works."""
    results = pools(NUM_RANKS).run(fault_fns.late_to_a_call, 1)
    for rank, (late, later, new) in enumerate(results):
        assert late[0] == "TimeoutError", late
        if rank == 1:
            assert "rank 1 arrived at dispatch" in late[1] and "had stopped waiting for it" in late[1], late
        else:
            assert "rank(s) 1 did not arrive at dispatch" in late[1], late
        assert later[0] == "TimeoutError" and "this Buffer can no longer be used" in later[1], later
        assert "create a new Buffer" in later[1], later
        assert new == ("returned", ""), new


def test_ranks_in_different_calls_leave_the_buffer_unusable(pools):
    results = pools(NUM_RANKS).run(fault_fns.different_calls_then_more, 3)
    for first, later, new in results:
        assert first[0] == "RuntimeError" and "ranks disagree on the call" in first[1], first
        assert later[0] == "RuntimeError" and "this Buffer can no longer be used" in later[1], later
        assert new == ("returned", ""), new


def _bad_call_names():
    names = list(BAD_CALLS)
    if not fault_fns.overcommit_refuses_huge_allocations():  # the allocation would be granted, then touched
        names.remove("num_worst_tokens past memory")
    return names


@pytest.mark.parametrize("num_ranks", [3, NUM_RANKS])
def test_a_bad_call_argument_on_one_rank_leaves_the_buffer_usable(pools, num_ranks):
    bad_rank = num_ranks - 1
    names = _bad_call_names()
    results = pools(num_ranks).run(fault_fns.bad_call_on_one_rank, bad_rank, names)
    for name in names:
        exc_type, text, _ = BAD_CALLS[name]
        for rank, outcomes in enumerate(results):
            raised, later = outcomes[name]
            if rank == bad_rank:
                assert raised[0] == exc_type.__name__ and text in raised[1], (name, raised)
            else:
                _refused_by(bad_rank, text, raised)
            assert later == ("returned", ""), (name, rank, later)


def test_one_rank_with_other_default_configs(pools):
    """Calls without config= take the default configs (a config cache's where there is one): a rank whose
    defaults differ would run other kernels than its peers, so every rank refuses the Buffer."""
    for made, later in pools(NUM_RANKS).run(fault_fns.construction_with_other_configs, BAD_RANK):
        assert made[0] == "ValueError" and "default dispatch / combine configs disagree" in made[1], made
        assert later == ("returned", ""), later
