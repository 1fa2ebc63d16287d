"""The intranode backend's host side without the arena, on CPU with the extension's launches stubbed
(moe_ep.bench.profile_dispatch_call.stub_backend): the outputs a fresh, a num_worst_tokens and a cached
dispatch are given, and what their handles keep. Every token of 3 ranks comes here (48 rows)."""
import pytest
import torch

from moe_ep.config import Config

_RANKS, _TOKENS, _HIDDEN, _TOPK, _EXPERTS = 3, 16, 64, 2, 6


@pytest.fixture
def stubbed(monkeypatch):
    from moe_ep.bench.profile_dispatch_call import stub_backend

    x = torch.randn(_TOKENS, _HIDDEN).to(torch.bfloat16)
    topk_idx = torch.rand(_TOKENS, _EXPERTS).topk(_TOPK, dim=1).indices
    backend, call = stub_backend(_RANKS, x, topk_idx, torch.rand(_TOKENS, _TOPK), _EXPERTS, monkeypatch.setattr)
    launched = []
    for name in ("intranode_notify", "intranode_dispatch"):
        monkeypatch.setattr(backend.ops, name, lambda *args, name=name: launched.append(name), raising=False)
    return backend, call, x, launched


def _cached(backend, x, handle):
    from moe_ep.handles import DispatchHandle

    return backend.dispatch([x], None, None, None, None, 1, 0, handle,
                            lambda **fields: DispatchHandle(buffer_serial=0, **fields), Config(24, 6, 256, 6, 128),
                            None, False, False)


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
    (recv_x,), recv_idx, recv_w, counts, new_handle, _ = _cached(backend, x, handle)
    assert recv_x.shape == (handle.num_recv_rows, _HIDDEN)
    assert (recv_idx, recv_w, counts, new_handle) == (None, None, None, None)
    assert launched == ["intranode_dispatch"]
