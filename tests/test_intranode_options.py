"""Host-side options of the intranode backend (no GPU needed)."""
import pytest

from moe_ep.backends.intranode import first_role_blocks, role_share


@pytest.mark.parametrize("blocks,share,expected", [
    (20, 0.0, 0), (20, 0.5, 10), (20, 0.6, 12), (2, 0.5, 1), (2, 0.01, 1), (2, 0.99, 1), (4, 0.9, 3), (1, 0.5, 0),
])
def test_a_split_leaves_at_least_one_block_of_each_role(blocks, share, expected):
    assert first_role_blocks(blocks, share) == expected


@pytest.mark.parametrize("variable", ["MOE_EP_DISPATCH_SPLIT", "MOE_EP_COMBINE_SPLIT"])
def test_split_share_comes_from_the_environment(monkeypatch, variable):
    monkeypatch.delenv(variable, raising=False)
    assert role_share(variable) == 0
    monkeypatch.setenv(variable, "0.4")
    assert role_share(variable) == 0.4
    for bad in ("1", "-0.1", "half"):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError, match=variable):
            role_share(variable)
