"""One rank at fault, the others not: a spoiled argument, a disagreement, a missed or late meeting. Every
rank must raise a clear exception within the peer timeout (the faulty rank naming its argument, the
others naming that rank and the step), and the group's next Buffer (or the same one, where the ranks
stayed in step) must work."""
import re

import pytest

from moe_ep import sync

from . import fault_fns
from .rank_fns import with_env
from .fault_fns import BAD_CALLS, BAD_CONSTRUCTIONS, DISAGREEMENTS, FORM_DISAGREEMENTS, TIMEOUT_S

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
    _check_refusals_of_one_rank(results, bad_rank, BAD_CALLS, names)


def _check_refusals_of_one_rank(results, bad_rank: int, cases: dict, names) -> None:
    """Per case named (cases: name -> (exception, text, the case)): the bad rank raised it, its peers named
    it at once, and every rank then ran a valid round on the same Buffer."""
    for name in names:
        exc_type, text, _ = cases[name]
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


# Where the odd ranks' calls would hang or abort instead, the pool call gives up after this.
FORM_TEST_TIMEOUT_S = 120


def _form_differences(raised) -> str:
    """The clauses of a form mismatch's message, one per differing field."""
    exc_type, message = raised
    assert exc_type == "ValueError" and "ran on no rank: " in message, raised
    assert message.endswith("this Buffer is still usable."), message
    return message.split("ran on no rank: ", 1)[1].split(". Every rank must", 1)[0]


def _one_odd_rank(call: str, odd_rank: int, num_ranks: int, odd: str, good: str) -> str:
    """The ranks grouped by phrase, the smaller group first (the lower rank first between equals)."""
    others = [r for r in range(num_ranks) if r != odd_rank]
    if len(others) == 1 and others[0] < odd_rank:
        return f"rank {others[0]} called {call} with {good}, rank {odd_rank} with {odd}"
    return f"rank {odd_rank} called {call} with {odd}, {'ranks' if len(others) > 1 else 'rank'} " \
           f"{', '.join(map(str, others))} with {good}"


def _check_forms_of_one_odd_rank(results, odd_rank: int, num_ranks: int, kernels: bool = False) -> None:
    """Per case of FORM_DISAGREEMENTS: every rank raised the same ValueError naming the field and the
    ranks, and the same Buffer then ran a valid round on every rank. kernels: handles are compared apart
    from their meeting's number, which the kernels' own meetings (mapping the peers' buffers) move on;
    and where the odd rank's own checks refused its arguments, the others name it."""
    experts = fault_fns.experts_per_rank() * num_ranks
    numbered = (lambda text: re.sub(r"#\d+", "#n", text)) if kernels else (lambda text: text)
    for name, (call, field, odd, good, _) in FORM_DISAGREEMENTS.items():
        odd, good = (phrase.format(experts=experts, double=2 * experts) for phrase in (odd, good))
        raised = [outcomes[name][0] for outcomes in results]
        if kernels and "in different forms" not in raised[odd_rank][1]:  # refused by the odd rank's own checks
            assert raised[odd_rank][0] != "returned", (name, raised)
            for rank in set(range(num_ranks)) - {odd_rank}:
                _refused_by(odd_rank, "", raised[rank])
        else:
            assert all(r == raised[0] for r in raised), (name, raised)
            expected = f"{field}: {_one_odd_rank(call, odd_rank, num_ranks, odd, good)}"
            assert numbered(_form_differences(raised[0])) == numbered(expected), (name, raised[0])
            assert f"the ranks called {call} in different forms" in raised[0][1], (name, raised[0])
        for rank, outcomes in enumerate(results):
            assert outcomes[name][1] == ("returned", ""), (name, rank, outcomes[name][1])


@pytest.mark.parametrize("num_ranks", [2, NUM_RANKS])
def test_one_rank_making_a_call_in_another_form(pools, num_ranks):
    """Every rank raises the same ValueError naming the field and the ranks, before any data moves, and
    the same Buffer then runs a valid round exactly."""
    odd_rank = 1
    results = pools(num_ranks).run(fault_fns.form_disagreements_on_one_rank, odd_rank, list(FORM_DISAGREEMENTS),
                                   timeout_s=FORM_TEST_TIMEOUT_S)
    _check_forms_of_one_odd_rank(results, odd_rank, num_ranks)


def test_one_rank_making_a_kernel_call_in_another_form_under_debug(gpu_pools):
    """MOE_EP_DEBUG=1: the kernels' calls meet at the arrival gate too, so a call in another form on one
    rank raises on every rank before any data moves, as on the portable backend (or, where the odd
    rank's own checks refuse its arguments, it raises that and the others name it), and the same Buffer
    then runs a valid round on the kernels."""
    from moe_ep import _native
    if not _native.has_kernels():
        pytest.skip(str(_native.unavailable_reason()))
    odd_rank, num_ranks = 1, 4
    results = gpu_pools(num_ranks).run(with_env, {"MOE_EP_DEBUG": "1"}, fault_fns.on_cuda,
                                       fault_fns.form_disagreements_on_one_rank, odd_rank, list(FORM_DISAGREEMENTS),
                                       timeout_s=FORM_TEST_TIMEOUT_S)
    _check_forms_of_one_odd_rank(results, odd_rank, num_ranks, kernels=True)


def test_what_only_the_kernels_refuse_on_one_rank_under_debug(gpu_pools):
    """MOE_EP_DEBUG=1: what the kernels' backends refuse (a hook still pending, a capture that would wait on
    the host) is checked with the call's arguments, before the meeting, so the refusing rank's peers raise
    at once naming it instead of waiting in the kernels, and the same Buffer then runs a valid round."""
    from moe_ep import _native
    if not _native.has_kernels():
        pytest.skip(str(_native.unavailable_reason()))
    odd_rank, num_ranks = 1, 4
    names = list(fault_fns.KERNEL_REFUSALS)
    results = gpu_pools(num_ranks).run(with_env, {"MOE_EP_DEBUG": "1"}, fault_fns.on_cuda,
                                       fault_fns.kernel_refusals_on_one_rank, odd_rank, names,
                                       timeout_s=FORM_TEST_TIMEOUT_S)
    _check_refusals_of_one_rank(results, odd_rank, fault_fns.KERNEL_REFUSALS, names)


def test_ranks_in_three_forms_are_grouped_by_value(pools):
    """Each differing field is named once, with the ranks grouped by value, the smallest groups first."""
    results = pools(NUM_RANKS).run(fault_fns.forms_of_three_values, 2, 3, timeout_s=FORM_TEST_TIMEOUT_S)
    wide = fault_fns.WIDE
    expected = ("x dtype: rank 2 called dispatch with fp8 x, rank 3 with float32 x, ranks 0, 1 with bf16 x; "
                f"hidden: rank 3 called dispatch with hidden {wide}, ranks 0, 1, 2 with hidden {fault_fns.HIDDEN}")
    for raised, later in results:
        assert raised == results[0][0], results
        assert _form_differences(raised) == expected, raised
        assert later == ("returned", ""), later


def test_forms_without_a_shared_difference_are_compared_on_every_field():
    """Forms of different fields whose shared fields agree: the fields some rank lacks are named, read as
    none there."""
    forms = [(("handle", "no handle"), ("top-k", "top-k 2")), (("handle", "no handle"),)]
    message = sync._form_mismatch("dispatch", [sync._decode_form(sync._encode_form(f)) for f in forms])
    expected = "top-k: rank 0 called dispatch with top-k 2, rank 1 with no top-k"
    assert _form_differences(("ValueError", message)) == expected, message
