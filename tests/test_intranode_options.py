"""Host-side options of the intranode backend (no GPU needed)."""
import pytest

from moe_ep.backends.intranode import combine_pusher_share, combine_pushers


@pytest.mark.parametrize("blocks,share,expected", [
    (20, 0.0, 0), (20, 0.5, 10), (20, 0.6, 12), (2, 0.5, 1), (2, 0.01, 1), (2, 0.99, 1), (4, 0.9, 3), (1, 0.5, 0),
])
def test_pushing_blocks_leave_at_least_one_of_each_role(blocks, share, expected):
    assert combine_pushers(blocks, share) == expected


def test_split_share_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("MOE_EP_COMBINE_SPLIT", raising=False)
    assert combine_pusher_share() == 0
    monkeypatch.setenv("MOE_EP_COMBINE_SPLIT", "0.4")
    assert combine_pusher_share() == 0.4
    for bad in ("1", "-0.1", "half"):
        monkeypatch.setenv("MOE_EP_COMBINE_SPLIT", bad)
        with pytest.raises(ValueError, match="MOE_EP_COMBINE_SPLIT"):
            combine_pusher_share()
