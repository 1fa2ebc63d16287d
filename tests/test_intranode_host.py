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
    # The data kernels' argument `cached` (before the one-pass kernel's choice, which they run behind):
    # where ranks share a GPU such a launch starts behind a rendezvous kernel (the others behind their
    # count exchange).
    backend.cached_launches = []

    def launch(*args, name):
        launched.append(name)
        if name != "intranode_notify":
            backend.cached_launches.append(args[-2])

    for name in ("intranode_notify", "intranode_dispatch"):
        monkeypatch.setattr(backend.ops, name, functools.partial(launch, name=name), raising=False)
    return backend, call, x, launched


def test_a_fresh_dispatch_sizes_its_outputs_by_the_counts(stubbed):
    _, call, x, _ = stubbed
    (recv_x,), recv_idx, recv_w, counts, handle, _ = call([x])
    rows = _RANKS * _TOKENS
    assert recv_x.shape == (rows, _HIDDEN) and recv_idx.shape == recv_w.shape == (rows, _TOPK)
    assert handle.recv_counts == [_TOKENS] * _RANKS and handle.num_recv_rows == rows
    assert handle.num_worst_tokens == 0 and len(counts) == _EXPERTS // _RANKS


def test_num_worst_tokens_pads_the_outputs_and_learns_no_counts(stubbed):
    _, call, x, launched = stubbed
    worst = _RANKS * _TOKENS + 7
    (recv_x,), recv_idx, recv_w, counts, handle, _ = call([x], num_worst_tokens=worst)
    assert recv_x.shape == (worst, _HIDDEN) and recv_idx.shape == recv_w.shape == (worst, _TOPK)
    assert counts == [] and handle.num_worst_tokens == worst and handle.num_recv_rows == worst
    assert launched == ["intranode_notify", "intranode_dispatch"]  # the count exchange, then the dispatch


def test_a_cached_dispatch_reuses_the_layout_without_a_count_exchange(stubbed):
    backend, call, x, launched = stubbed
    *_, handle, _ = call([x], num_worst_tokens=_RANKS * _TOKENS + 3)
    launched.clear()
    (recv_x,), recv_idx, recv_w, counts, new_handle, _ = call([x], handle=handle)
    assert recv_x.shape == (handle.num_recv_rows, _HIDDEN)
    assert (recv_idx, recv_w, counts, new_handle) == (None, None, None, None)
    assert launched == ["intranode_dispatch"]
    assert backend.cached_launches == [False, True]


def test_no_listed_call_shares_its_ordering_event_with_a_later_one(stubbed):
    """progress_report asks each listed call's event whether the caller's stream got there: a call whose
    event a later call recorded again could not be answered (rows known before the launch: the Buffer
    marks the caller's stream itself)."""
    backend, call, x, _ = stubbed
    for _ in range(6):
        call([x], num_worst_tokens=_RANKS * _TOKENS)
    events = [event for _, _, event in backend._recent_calls]
    assert len(events) == 4 and len({id(e) for e in events}) == 4


def test_the_rendezvous_is_taken_where_any_gpu_holds_several_ranks():
    from moe_ep.backends.choices import overridden
    from moe_ep.backends.intranode import rendezvous_first

    assert not rendezvous_first(1) and rendezvous_first(2) and rendezvous_first(8)
    with overridden(rendezvous=False):
        assert not rendezvous_first(8)
