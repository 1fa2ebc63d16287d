"""The launcher's SM share for ranks that share a GPU (moe_ep.launch --sm-share, moe_ep.mps)."""
import pytest

from moe_ep.launch import sm_share
from moe_ep.mps import client_sm_share


def test_each_rank_leaves_the_others_kernels_their_sms():
    # A rank's intranode kernels hold at most 1 / 2R of the SMs; the other R - 1 ranks' kernels and one
    # rank's share must fit the GPU together.
    for ranks in range(2, 17):
        share = client_sm_share(ranks)
        assert share / 100 + (ranks - 1) / (2 * ranks) <= 1, ranks
        assert share / 100 > 0.5  # still most of a GPU for a rank's own GEMMs
    assert client_sm_share(1) == 100 and client_sm_share(4) == 62 and client_sm_share(8) == 56


def test_sm_share_option():
    assert sm_share("70", 4) == 70 and sm_share("100", 4) == 100
    for bad in ("0", "101", "most"):
        with pytest.raises(SystemExit, match="--sm-share: expected auto or a percentage from 1 to 100"):
            sm_share(bad, 4)
