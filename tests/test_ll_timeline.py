"""The timeline tool's arithmetic (moe_ep.bench.ll_timeline.phases) on stamps made up here, in the columns
of csrc/kernels/reports.cuh (the kernel_enums fixture); the stamps themselves come from a MOE_EP_TIMELINE
build on a GPU."""
from moe_ep.bench.ll_timeline import phases


def stamps(enums, call, kind, start, offsets):
    """A timeline row: call `call` of `kind` (a TimelineCallKind's name) whose send starts at `start` ns
    and whose other columns lie `offsets[name]` ns after it."""
    row = dict(call_number=call, call_kind=getattr(enums.timeline_call_kind, kind), send_first_start=start)
    row.update({name: start + offset for name, offset in offsets.items()})
    return [row[name.lower()] for name in enums.timeline_column.names()]


def test_phases_are_taken_per_call_relative_to_the_first_send(kernel_enums):
    # Two ranks; rank 1 starts 2 us after rank 0 and its receive takes 3 us longer.
    common = dict(send_last_start=1_000, send_last_end=10_000, flags_raised=11_000, wait_start=500)
    tables = [[], []]
    for call in range(4):
        base = call * 100_000
        tables[0].append(stamps(kernel_enums, call, "DISPATCH", base,
                                dict(common, wait_seen=14_000, recv_first_start=16_000, recv_last_end=30_000)))
        tables[1].append(stamps(kernel_enums, call, "DISPATCH", base + 2_000,
                                dict(common, wait_seen=12_000, recv_first_start=14_000, recv_last_end=31_000)))
    tables[0].append([0] * len(kernel_enums.timeline_column.names()))  # an unused slot of the ring
    result = dict((name, (mean, worst)) for name, mean, worst in phases(tables, 1, kernel_enums)["dispatch"])
    assert result["send starts (after the call's first)"] == (1.0, 2.0)
    assert result["send span"] == (10.0, 10.0)
    # The last flag anywhere: rank 1's, at 2 + 11 us; rank 0 sees all at 14 us, rank 1 at 2 + 12.
    assert result["last flag raised anywhere -> wait sees all"] == (1.0, 1.0)
    assert result["receive span"] == (15.5, 17.0)
    assert result["call (first send start -> last receive end)"] == (33.0, 33.0)
    # The next call starts 100 us after this one: rank 0 ends at 30, rank 1 at 2 + 31.
    assert result["receive end -> own next send start"] == (69.5, 70.0)


def test_calls_missing_on_a_rank_are_left_out(kernel_enums):
    row = dict(send_last_start=1, send_last_end=2, flags_raised=3, wait_start=1, wait_seen=4, recv_first_start=5,
               recv_last_end=6)
    tables = [[stamps(kernel_enums, 0, "COMBINE", 0, row), stamps(kernel_enums, 1, "COMBINE", 1_000, row)],
              [stamps(kernel_enums, 1, "COMBINE", 1_000, row)]]
    result = phases(tables, 0, kernel_enums)
    assert list(result) == ["combine"]
    assert dict((n, w) for n, _, w in result["combine"])["receive span"] == 0.001
