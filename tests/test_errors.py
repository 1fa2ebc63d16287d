"""Bad input raises a clear exception before any communication and leaves the Buffer usable; a rank
that never arrives is named in a TimeoutError."""
import pytest

from moe_ep.launch import RankError, RankPool

from . import bad_inputs, rank_fns
from .problems import Problem, make_inputs

# Peers that never come are named after this long.
SHORT_TIMEOUT = {"MOE_EP_TIMEOUT_S": "1.5"}


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_bad_inputs_raise_named_errors_and_leave_the_buffer_usable(pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 2, 256, 2, max_tokens=8)
    results = pools(num_ranks).run(bad_inputs.run_cases, p)
    assert len(bad_inputs.CASES) >= 20
    for rank, outcomes in enumerate(results):
        for (name, exc_type, text, _), (got_name, got_type, message) in zip(bad_inputs.CASES, outcomes):
            assert got_name == name
            assert got_type == exc_type.__name__, f"rank {rank}, {name}: raised {got_type}: {message}"
            assert text in message, f"rank {rank}, {name}: message {message!r} lacks {text!r}"


def test_an_unknown_buffer_argument_on_one_rank_is_refused_and_later_buffers_work(pools, seed):
    p = Problem(seed, 2, 4, 128, 2, max_tokens=8)
    bad = 1
    results = pools(2).run(rank_fns.with_env, SHORT_TIMEOUT, bad_inputs.unknown_argument_on_one_rank, p, bad)
    inputs = make_inputs(p)
    for rank, ((exc_type, message), combined_shape) in enumerate(results):
        if rank == bad:
            assert (exc_type, message) == ("TypeError", "num_nvl_byte: not an argument of Buffer() (did you mean "
                                                        "num_nvl_bytes?)")
        else:
            assert exc_type == "RuntimeError", message
            assert f"rank {bad} refused its arguments (TypeError: num_nvl_byte: not an argument" in message, message
        assert combined_shape == tuple(inputs[rank]["x"].shape)  # the Buffers after it work


def test_a_dispatch_packs_only_the_rows_it_sends(pools):
    """x: stride-0 rows whose full copy no machine holds, of which each rank sends one."""
    for count, equal in pools(2).run(bad_inputs.a_few_rows_of_a_huge_x):
        assert (count, equal) == (1, True)


def test_rows_past_memory_are_refused_before_any_rank_communicates(pools, seed):
    p = Problem(seed, 2, 4, 128, 2, max_tokens=8)
    bad = 0
    results = pools(2).run(rank_fns.with_env, SHORT_TIMEOUT, bad_inputs.more_rows_than_memory_on_one_rank, p, bad)
    inputs = make_inputs(p)
    for rank, ((exc_type, message), combined_shape) in enumerate(results):
        if rank == bad:
            assert exc_type == "ValueError", message
            assert message.startswith(f"x: cannot allocate the {2 * bad_inputs.HUGE_TOKENS} rows of "
                                      f"{2 * bad_inputs.HUGE_HIDDEN + 4} bytes this rank sends on cpu ("), message
        else:
            assert exc_type == "RuntimeError", message
            assert f"rank {bad} refused its arguments (ValueError: x: cannot allocate" in message, message
        assert combined_shape == tuple(inputs[rank]["x"].shape)  # the Buffer stays usable


def test_missing_rank_is_named_in_a_timeout(pools):
    results = pools(4).run(rank_fns.with_env, SHORT_TIMEOUT, rank_fns.skip_a_call, 1, "dispatch")
    for rank, outcome in enumerate(results):
        if rank == 1:
            assert outcome == "skipped"
        else:
            assert outcome[0] == "TimeoutError", outcome
            assert "rank(s) 1 did not arrive at dispatch" in outcome[1]


def test_missing_rank_in_low_latency_combine(pools):
    results = pools(3).run(rank_fns.with_env, SHORT_TIMEOUT, rank_fns.skip_a_call, 2, "low_latency_combine")
    for rank in (0, 1):
        assert results[rank][0] == "TimeoutError"
        assert "rank(s) 2 did not arrive at low_latency_combine" in results[rank][1]


def test_ranks_in_different_calls_are_reported(pools):
    results = pools(2).run(rank_fns.mismatched_calls)
    for rank, (exc_type, message) in enumerate(results):
        assert exc_type == "RuntimeError", message
        assert "ranks disagree on the call" in message


def test_a_stuck_rank_is_reported_with_where_it_is_stuck():
    """A rank that outlives the pool call's timeout is reported with its stack (a kernel or collective
    that never returns says nothing otherwise), and the pool is stopped."""
    pool = RankPool(2)
    try:
        with pytest.raises(RankError) as raised:
            pool.run(rank_fns.stall_on_rank, 1, 120.0, timeout_s=8.0)
        failure = next(f for f in raised.value.failures if f.rank == 1)
        assert "did not finish stall_on_rank in time; stuck at" in failure.message, failure.message
        assert "rank_fns.py" in failure.message and "stall_on_rank" in failure.traceback, failure.traceback
        assert not pool.alive
    finally:
        pool.close(force=True)


def test_the_default_configs_follow_the_sm_budget(pools, seed):
    p = Problem(seed, 2, 4, 256, 2, max_tokens=8)
    for first, larger, again in pools(2).run(rank_fns.calls_after_the_sm_budget_changes, p):
        assert first == again == "passed", (first, again)
        assert "num_nvl_bytes=" in larger and "is too small for" in larger, larger
