"""The intranode backend's host side without the arena, on CPU with the extension's launches stubbed
(moe_ep.bench.profile_dispatch_call.stub_backend): the outputs a fresh, a num_worst_tokens and a cached
dispatch are given, and what their handles keep. Every token of 3 ranks comes here (48 rows)."""
import functools

import pytest
import torch

_RANKS, _TOKENS, _HIDDEN, _TOPK, _EXPERTS = 3, 16, 64, 2, 6


@pytest.fixture
def stubbed(monkeypatch):
    from moe_ep.bench.profile_dispatch_call import stub_backend

    x = torch.randn(_TOKENS, _HIDDEN).to(torch.bfloat16)
    topk_idx = torch.rand(_TOKENS, _EXPERTS).topk(_TOPK, dim=1).indices
    backend, call = stub_backend(_RANKS, x, topk_idx, torch.rand(_TOKENS, _TOPK), _EXPERTS, monkeypatch.setattr)
    launched = []
    # The data kernels' last argument, `cached`: where ranks share a GPU such a launch starts behind a
    # rendezvous kernel (the others behind their count exchange).
    backend.cached_launches = []

    def launch(*args, name):
        launched.append(name)
        if name != "intranode_notify":
            backend.cached_launches.append(args[-1])

    for name in ("intranode_notify", "intranode_dispatch", "intranode_zero_copy_dispatch"):
        monkeypatch.setattr(backend.ops, name, functools.partial(launch, name=name), raising=False)
    return backend, call, x, launched


def test_a_fresh_dispatch_sizes_its_outputs_by_the_counts(stubbed):
    _, call, x, _ = stubbed
    (recv_x,), recv_idx, recv_w, counts, handle, _ = call([x], False)
    rows = _RANKS * _TOKENS
    assert recv_x.shape == (rows, _HIDDEN) and recv_idx.shape == recv_w.shape == (rows, _TOPK)
    assert handle.recv_counts == [_TOKENS] * _RANKS and handle.num_recv_rows == rows
    assert handle.num_worst_tokens == 0 and len(counts) == _EXPERTS // _RANKS


def test_num_worst_tokens_pads_the_outputs_and_learns_no_counts(stubbed):
    _, call, x, launched = stubbed
    worst = _RANKS * _TOKENS + 7
    (recv_x,), recv_idx, recv_w, counts, handle, _ = call([x], False, num_worst_tokens=worst)
    assert recv_x.shape == (worst, _HIDDEN) and recv_idx.shape == recv_w.shape == (worst, _TOPK)
    assert counts == [] and handle.num_worst_tokens == worst and handle.num_recv_rows == worst
    assert launched == ["intranode_notify", "intranode_dispatch"]  # the count exchange, then the dispatch


def test_a_cached_dispatch_reuses_the_layout_without_a_count_exchange(stubbed):
    backend, call, x, launched = stubbed
    *_, handle, _ = call([x], False, num_worst_tokens=_RANKS * _TOKENS + 3)
    launched.clear()
    (recv_x,), recv_idx, recv_w, counts, new_handle, _ = call([x], False, handle=handle)
    assert recv_x.shape == (handle.num_recv_rows, _HIDDEN)
    assert (recv_idx, recv_w, counts, new_handle) == (None, None, None, None)
    assert launched == ["intranode_dispatch"]
    assert backend.cached_launches == [False, True]


def _in_area(backend, t: torch.Tensor) -> bool:
    slots = backend.zero_copy_dispatch.slots
    return slots.data_ptr() <= t.data_ptr() < slots.data_ptr() + slots.numel()


def test_zero_copy_dispatches_alternate_slots_and_return_views_of_them(stubbed):
    backend, call, x, launched = stubbed
    rows = _RANKS * _TOKENS
    (fresh,), *_ = call([x], True)  # early: launched with the count exchange from one entry point
    assert fresh.shape == (rows, _HIDDEN) and _in_area(backend, fresh) and backend._dispatch_next == 1
    (worst,), *_ = call([x], True, num_worst_tokens=rows)  # the stub's area holds two slots of `rows`
    assert worst.shape == (rows, _HIDDEN) and _in_area(backend, worst) and backend._dispatch_next == 0
    assert launched == ["intranode_notify", "intranode_zero_copy_dispatch"]


def test_a_zero_copy_dispatch_beyond_its_slot_is_refused_before_the_count_exchange(stubbed):
    backend, call, x, launched = stubbed
    with pytest.raises(ValueError, match="num_zero_copy_dispatch_bytes"):
        call([x], True, num_worst_tokens=10 * _RANKS * _TOKENS)
    assert launched == [] and backend._dispatch_next == 0


def test_via_zero_copy_copies_recv_x_out_of_the_slot(stubbed):
    backend, call, x, _ = stubbed
    backend.via_zero_copy = True  # MOE_EP_DISPATCH_VIA_ZERO_COPY=1
    (recv_x,), recv_idx, *_ = call([x], False)
    assert recv_x.shape == (_RANKS * _TOKENS, _HIDDEN) and not _in_area(backend, recv_x)
    assert recv_idx.shape == (_RANKS * _TOKENS, _TOPK) and backend._dispatch_next == 1


def test_a_cached_zero_copy_dispatch_takes_the_other_slot(stubbed):
    backend, call, x, launched = stubbed
    rows = _RANKS * _TOKENS
    *_, handle, _ = call([x], True, num_worst_tokens=rows)
    assert backend._dispatch_next == 1
    launched.clear()
    (again,), *_ = call([x], True, handle=handle)
    assert again.shape == (rows, _HIDDEN) and _in_area(backend, again) and backend._dispatch_next == 0
    assert launched == ["intranode_zero_copy_dispatch"]  # no count exchange
    assert backend.cached_launches == [False, True]


def test_no_listed_call_shares_its_ordering_event_with_a_later_one(stubbed):
    """progress_report asks each listed call's event whether the caller's stream got there: a call whose
    event a later call recorded again could not be answered (rows known before the launch: the Buffer
    marks the caller's stream itself)."""
    backend, call, x, _ = stubbed
    for _ in range(6):
        call([x], False, num_worst_tokens=_RANKS * _TOKENS)
    events = [event for _, _, event in backend._recent_calls]
    assert len(events) == 4 and len({id(e) for e in events}) == 4


def test_the_rendezvous_is_taken_where_any_gpu_holds_several_ranks(monkeypatch):
    from moe_ep.backends.intranode import rendezvous_first

    monkeypatch.delenv("MOE_EP_RENDEZVOUS", raising=False)
    assert not rendezvous_first(1) and rendezvous_first(2) and rendezvous_first(8)
    monkeypatch.setenv("MOE_EP_RENDEZVOUS", "0")
    assert not rendezvous_first(8)
    monkeypatch.setenv("MOE_EP_RENDEZVOUS", "yes")
    with pytest.raises(ValueError, match="MOE_EP_RENDEZVOUS: expected 0 or 1"):
        rendezvous_first(8)
