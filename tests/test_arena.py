"""The arena's allocator and its regions' lifetime (moe_ep/arena.py), and the intranode backend's host
side of the dispatches into it and the combines from it (launches stubbed); the kernels over it run on
a GPU (tests/test_intranode.py)."""
import random
import threading
import time

import pytest
import torch

from moe_ep.arena import Arena, Region


def test_regions_are_aligned_first_fit_and_coalesce_when_freed():
    arena = Arena(1000, 16)
    assert arena.size == 992 and arena.free_bytes == 992
    a, b, c = arena.alloc(100), arena.alloc(1), arena.alloc(200)
    assert (a, b, c) == (0, 112, 128)  # 100 -> 112 bytes, 1 -> 16
    assert arena.alloc(992) is None  # not enough left in one piece
    arena.free(b)
    assert arena.alloc(16) == 112  # the first hole that fits
    arena.free(112)
    arena.free(a)
    arena.free(c)
    assert arena.free_bytes == 992 and arena.used_regions == 0
    assert arena.alloc(992) == 0  # the three ranges merged back into one


def test_a_double_free_is_a_key_error():
    arena = Arena(64, 16)
    start = arena.alloc(16)
    arena.free(start)
    with pytest.raises(KeyError):
        arena.free(start)


def test_random_alloc_and_free_never_overlap(seed):
    rng = random.Random(seed)
    arena = Arena(1 << 16, 16)
    live = {}
    for _ in range(3000):
        if live and rng.random() < 0.5:
            start = rng.choice(list(live))
            del live[start]
            arena.free(start)
        else:
            n = rng.randint(0, 3000)
            start = arena.alloc(n)
            if start is None:
                assert arena.free_bytes < (1 << 16)
                continue
            length = max(16, -(-n // 16) * 16)
            assert start % 16 == 0 and start + length <= arena.size
            assert all(start + length <= s or s + l <= start for s, l in live.items())
            live[start] = length
        assert arena.free_bytes + sum(live.values()) == arena.size
    for start in list(live):
        arena.free(start)
    assert arena.alloc(arena.size) == 0


def test_a_call_reserves_the_largest_free_range_and_gives_back_the_tail():
    arena = Arena(1024, 16)
    a, b = arena.alloc(256), arena.alloc(128)
    arena.free(a)  # free: [0, 256) and [384, 1024)
    assert arena.reserve_largest() == (384, 640)
    arena.shrink(384, 100)  # keeps 112 bytes, frees [496, 1024)
    assert arena.free_bytes == 256 + 528 and arena.used_regions == 2
    assert arena.alloc(528) == 496
    with pytest.raises(ValueError, match="more than"):
        arena.shrink(b, 129)
    arena.shrink(b, 0)  # at least one align unit stays: [272, 384) is free now
    assert arena.free_bytes == 256 + 112
    for start in (b, 384, 496):
        arena.free(start)
    assert arena.reserve_largest() == (0, 1024) and arena.used_regions == 1


def test_a_full_arena_reserves_nothing():
    arena = Arena(32, 16)
    assert arena.reserve_largest() == (0, 32)
    assert arena.reserve_largest() is None
    arena.shrink(0, 0)
    assert arena.reserve_largest() == (16, 16)


def test_threads_may_free_what_others_allocated():
    arena = Arena(1 << 20, 16)
    starts = [arena.alloc(256) for _ in range(2000)]

    def free(part):
        for start in part:
            arena.free(start)

    threads = [threading.Thread(target=free, args=(starts[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert arena.free_bytes == arena.size and arena.used_regions == 0


def test_a_region_returns_to_its_arena_when_it_dies():
    arena = Arena(4096, 16)
    region = Region(arena, arena.alloc(1000), 1000, base=1 << 40, device=torch.device("cpu"))
    assert region.address == (1 << 40) and arena.used_regions == 1
    with pytest.raises(ValueError, match="outside the region"):
        region.tensor(992, 1, 16, torch.uint8)
    del region
    assert arena.used_regions == 0 and arena.free_bytes == 4096


def test_a_region_dying_while_the_arena_is_locked_does_not_wait_for_it():
    """The garbage collector may free a region (one in a reference cycle, say) in the middle of an
    arena call on the same thread: its return is queued, and merged at the arena's next use."""
    arena = Arena(4096, 16)
    holder = [Region(arena, arena.alloc(100), 100, base=0, device=torch.device("cpu"))]
    with arena._lock:  # as inside alloc, when a collection runs
        dropped = threading.Thread(target=holder.clear)
        dropped.start()
        dropped.join(timeout=10)
        assert not dropped.is_alive(), "a region's return waited on the arena's lock"
    assert arena.used_regions == 0 and arena.free_bytes == 4096


def test_tensors_over_a_region_keep_it_until_the_last_view_dies():
    backing = torch.zeros(4096, dtype=torch.uint8)
    arena = Arena(backing.numel(), 16)
    region = Region(arena, arena.alloc(1024), 1024, base=backing.data_ptr(), device=torch.device("cpu"))
    rows = region.tensor(0, 4, 64, torch.bfloat16)  # 512 bytes
    scales = region.tensor(512, 4, 8, torch.float32)
    rows.fill_(1.5)
    assert backing[region.start: region.start + 512].view(torch.bfloat16).eq(1.5).all()
    del region
    part = rows[1:3]
    del rows
    assert arena.used_regions == 1  # the scales and a view of the rows still hold it
    del scales
    assert arena.used_regions == 1
    del part
    assert arena.used_regions == 0 and arena.free_bytes == arena.size


# The backend's arena path on CPU: the extension's launches stubbed (moe_ep.bench.profile_dispatch_call,
# whose one-pass kernels choose from this rank's room alone), so what is checked is the host's side: the range a fresh
# dispatch reserves, what it keeps, what it gives back, recv_x's place, and what a call without room
# falls back to. Every token of 3 ranks comes here: 48 rows of bf16 [.., 64].
_RANKS, _TOKENS, _HIDDEN, _TOPK = 3, 16, 64, 2


@pytest.fixture
def stubbed(monkeypatch):
    from moe_ep.bench.profile_dispatch_call import stub_backend

    x = torch.randn(_TOKENS, _HIDDEN).to(torch.bfloat16)
    topk_idx = torch.rand(_TOKENS, 6).topk(_TOPK, dim=1).indices
    backend, call = stub_backend(_RANKS, x, topk_idx, torch.rand(_TOKENS, _TOPK), 6, monkeypatch.setattr, arena=True)
    launched = []  # per fresh dispatch: (offset, rows the side outputs hold, part offsets, bytes) of its range
    early = backend.ops.intranode_zero_copy_dispatch_early
    monkeypatch.setattr(backend.ops, "intranode_zero_copy_dispatch_early",
                        lambda *args: launched.append(args[-6:-2]) or early(*args))
    backend.call = call  # the other ways into the arena
    return backend, (lambda: call([x])[0][0]), launched


def _region_bytes(rows: int) -> int:
    from moe_ep.config import arena_dispatch_region

    return arena_dispatch_region(rows, 2 * _HIDDEN, 0, _TOPK).slot_bytes


def _in_arena(backend, t: torch.Tensor) -> bool:
    base = backend.arena_area.addresses[0]
    return base <= t.data_ptr() < base + backend.arena.size


def test_a_fresh_dispatch_reserves_the_largest_range_and_keeps_what_its_rows_need(stubbed):
    backend, dispatch, launched = stubbed
    arena, base, rows = backend.arena, backend.arena_area.addresses[0], _RANKS * _TOKENS
    first = dispatch()
    start, capacity, _, region_bytes = launched[0]
    assert (start, region_bytes) == (0, arena.size)  # the whole arena was free: the kernel may use it all
    assert capacity >= rows
    assert first.shape == (rows, _HIDDEN) and first.data_ptr() == base
    assert arena.used_regions == 1 and arena.free_bytes == arena.size - _region_bytes(rows)
    second = dispatch()  # lands right after the first, which lives on
    assert launched[1][0] == _region_bytes(rows) and launched[1][3] == arena.size - _region_bytes(rows)
    assert second.data_ptr() == base + _region_bytes(rows)
    second.fill_(1.0)
    del first, second
    assert arena.used_regions == 0 and arena.free_bytes == arena.size


def test_without_room_a_dispatch_takes_two_passes_and_gives_the_range_back(stubbed, monkeypatch):
    """A rank has no room: the range goes back, recv_x is an ordinary tensor that the two-pass
    kernel (queued behind the one-pass one, which returns at once) fills."""
    backend, dispatch, _ = stubbed
    two_pass = []
    monkeypatch.setattr(backend.ops, "intranode_dispatch", lambda *args: two_pass.append(args), raising=False)
    kept = [dispatch(), dispatch()]  # the arena holds two dispatches' rows
    assert two_pass == []
    free = backend.arena.free_bytes
    third = dispatch()
    assert third.shape == (_RANKS * _TOKENS, _HIDDEN) and not _in_arena(backend, third) and len(two_pass) == 1
    assert backend.arena.free_bytes == free and backend.arena.used_regions == 2
    kept.pop()
    assert _in_arena(backend, dispatch()) and len(two_pass) == 1  # room again once a recv_x died


def test_a_count_exchange_that_times_out_gives_the_range_back(stubbed, monkeypatch):
    backend, dispatch, _ = stubbed
    backend.timeout_s = 0.05
    monkeypatch.setattr(backend.ops, "wait_host_value", lambda *args: False)
    # The progress marks as the kernels write them: KernelId, then the call number's low bits.
    slot, kernel, bits = backend.enums.host_info, backend.enums.kernel_id, backend.enums.progress_mark.CALL_BITS
    backend._host[slot.KERNEL_STARTED] = kernel.DISPATCH << bits | 17
    backend._host[slot.KERNEL_FINISHED] = kernel.ZERO_COPY_COMBINE << bits | 16
    with pytest.raises(TimeoutError, match="count exchange.*no kernel of this Buffer reported a missing peer") as raised:
        dispatch()
    assert "last kernel to start: the dispatch of call 17; last to finish: the zero-copy combine of call 16" in \
        str(raised.value)
    assert backend.arena.used_regions == 0 and backend.arena.free_bytes == backend.arena.size


def test_a_count_exchange_stuck_behind_a_kernel_names_the_peer_that_kernel_reports(stubbed, monkeypatch):
    """The host's wait ends first, an earlier kernel's own deadline later: the host waits for its report
    and raises the peer it names rather than a TimeoutError without one."""
    backend, dispatch, _ = stubbed
    backend.timeout_s = 5.0
    error = backend.enums.host_info.ERROR

    def wait_host_value(host_info, index, value, timeout_s):  # the counts never come; a report does
        deadline = time.monotonic() + timeout_s
        while index == error and backend._host[index] != value and time.monotonic() < deadline:
            time.sleep(0.01)
        return index == error and backend._host[index] == value

    monkeypatch.setattr(backend.ops, "wait_host_value", wait_host_value)
    backend.peers.timeout_error = lambda: TimeoutError("rank 2 did not arrive") if backend._host[error] else None
    late_report = threading.Timer(0.1, lambda: backend._host.__setitem__(error, 1))
    late_report.start()
    try:
        with pytest.raises(TimeoutError, match="rank 2 did not arrive"):
            dispatch()
    finally:
        late_report.cancel()
        backend._host[error] = 0


def test_scales_num_worst_tokens_and_cached_dispatches_take_regions_too(stubbed, monkeypatch):
    from moe_ep.config import arena_dispatch_region

    backend, _, launched = stubbed
    arena, base, rows = backend.arena, backend.arena_area.addresses[0], _RANKS * _TOKENS
    x = torch.randn(_TOKENS, _HIDDEN).to(torch.float8_e4m3fn)
    scales = torch.rand(_TOKENS, _HIDDEN // 32)  # 8 bytes of scales a row
    (recv_x, recv_scales), *_ = backend.call([x, scales])
    layout = arena_dispatch_region(rows, _HIDDEN, 8, _TOPK)
    assert recv_x.dtype == x.dtype and recv_x.shape == (rows, _HIDDEN) and recv_x.data_ptr() == base
    assert recv_scales.shape == (rows, 2) and recv_scales.data_ptr() == base + layout.scale_offset
    del recv_x
    assert arena.used_regions == 1  # the scales hold the region
    del recv_scales
    # Rows the host knows before the call: the one-pass kernel (its region's offset, rows and part
    # offsets) and the two-pass one behind it are both queued.
    stored, one_pass = [], backend.ops.intranode_zero_copy_dispatch
    monkeypatch.setattr(backend.ops, "intranode_zero_copy_dispatch",
                        lambda *args: stored.append(args[-8:-5]) or one_pass(*args))
    (worst, _), *_, handle, _ = backend.call([x, scales], num_worst_tokens=rows + 5)  # rows known: no reservation
    worst_layout = arena_dispatch_region(rows + 5, _HIDDEN, 8, _TOPK)
    assert len(launched) == 1 and worst.shape[0] == rows + 5 and worst.data_ptr() == base
    assert stored == [(0, rows + 5, worst_layout.offsets)] and backend._choice.item() == 1
    (cached, cached_scales), *rest = backend.call([x, scales], handle=handle)  # no count exchange, a region of its own
    assert len(launched) == 1 and rest[:4] == [None] * 4 and cached.shape[0] == rows + 5
    assert cached.data_ptr() == base + worst_layout.slot_bytes and stored[1][0] == worst_layout.slot_bytes
    del worst, cached, cached_scales, handle
    assert arena.used_regions == 0 and arena.free_bytes == arena.size


def test_a_num_worst_tokens_dispatch_without_room_takes_two_passes(stubbed):
    backend, _, launched = stubbed
    x = torch.randn(_TOKENS, _HIDDEN).to(torch.bfloat16)
    (recv_x,), *_ = backend.call([x], num_worst_tokens=10 * _RANKS * _TOKENS)  # more than the whole arena
    assert backend._choice.item() == 0 and not _in_arena(backend, recv_x) and launched == []
    assert backend.arena.used_regions == 0


# The combine from the arena, host side (the launch stubbed): where the rows are said to lie, the copy
# of an x elsewhere where that pays, and two passes where there is no room.
@pytest.fixture
def combining(stubbed, monkeypatch):
    from moe_ep.backends.base import CombineCall
    from moe_ep.config import Config

    backend, _, _ = stubbed
    x = torch.randn(_TOKENS, _HIDDEN).to(torch.bfloat16)
    (recv_x,), _, recv_weights, _, handle, _ = backend.call([x])
    launched, one_pass = [], backend.ops.intranode_zero_copy_combine
    monkeypatch.setattr(backend.ops, "intranode_zero_copy_combine", lambda *args: launched.append(args) or one_pass(*args))
    config = Config(24, 6, 256, 6, 128)

    def combine(rows):
        return backend.combine(CombineCall(x=rows, handle=handle, topk_weights=recv_weights, biases=[], config=config,
                                           previous_event=None, async_finish=False, allocate_on_comm_stream=False))

    backend.handle = handle
    return backend, combine, launched, recv_x.shape[0]


def _where(launch):
    """(x given to the one-pass kernel, bytes from the arena's start to its rows, pitch, rows or -1 (no
    room), weights' bytes)"""
    return (launch[2], *launch[-6:-2])


def test_a_combine_input_in_the_arena_is_read_where_it_lies(combining):
    backend, combine, launched, rows = combining
    arena, base = backend.arena, backend.arena_area.addresses[0]
    x = backend.combine_input(backend.handle, _HIDDEN, torch.bfloat16)
    assert _in_arena(backend, x) and x.shape == (rows, _HIDDEN)
    used, free = arena.used_regions, arena.free_bytes
    combine(x)
    given, at, pitch, count, weights_at = _where(launched[-1])
    assert given is x and (at, pitch, count) == (x.data_ptr() - base, 2 * _HIDDEN, rows)
    assert not (at <= weights_at < at + rows * pitch)  # the weights' room is a region of its own
    assert backend._choice.item() == 1
    assert (arena.used_regions, arena.free_bytes) == (used, free)  # which went back after the call


def test_an_x_elsewhere_is_copied_into_the_arena_only_where_that_pays(combining, monkeypatch):
    """Below COPY_INTO_ARENA_MIN_RANKS ranks (3 here) an x outside the arena takes two passes and is
    not copied; from there up it is copied into a region first."""
    from moe_ep.backends import intranode

    backend, combine, launched, rows = combining
    arena, base = backend.arena, backend.arena_area.addresses[0]
    free = arena.free_bytes
    y = torch.randn(rows, _HIDDEN).to(torch.bfloat16)
    combine(y)
    given, _, _, count, _ = _where(launched[-1])
    assert not _in_arena(backend, given) and count == -1 and backend._choice.item() == 0
    monkeypatch.setattr(intranode, "COPY_INTO_ARENA_MIN_RANKS", _RANKS)
    combine(y)
    given, at, pitch, count, _ = _where(launched[-1])
    assert given is not y and torch.equal(given, y) and given.data_ptr() == base + at
    assert (pitch, count) == (2 * _HIDDEN, rows) and backend._choice.item() == 1
    del given
    launched.clear()
    assert arena.free_bytes == free


def test_no_room_for_the_copy_takes_two_passes_and_gives_everything_back(combining, monkeypatch):
    from moe_ep.backends import intranode

    backend, combine, launched, rows = combining
    monkeypatch.setattr(intranode, "COPY_INTO_ARENA_MIN_RANKS", _RANKS)
    arena = backend.arena
    filler = []
    while (taken := arena.reserve_largest()) is not None:  # every free byte of the arena held
        filler.append(backend._region(*taken))
    x = backend.combine_input(backend.handle, _HIDDEN, torch.bfloat16)
    assert not _in_arena(backend, x), "without room, empty_combine_input hands out an ordinary tensor"
    combine(x.copy_(torch.randn(rows, _HIDDEN).to(torch.bfloat16)))
    assert _where(launched[-1])[3] == -1 and backend._choice.item() == 0  # the two-pass kernel reads x
    launched.clear()
    filler.clear()
    assert arena.free_bytes == arena.size and arena.used_regions == 0
