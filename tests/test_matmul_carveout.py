"""The matmul SM carveout where ranks share a GPU (moe_ep.matmul_carveout)."""
import types

import pytest
import torch

from moe_ep import matmul_carveout
from moe_ep.matmul_carveout import keep_sms_from_matmuls, requested_carveout


def test_the_carveout_is_every_rank_on_the_gpu_times_its_blocks(monkeypatch):
    monkeypatch.delenv("MOE_EP_MATMUL_SM_CARVEOUT", raising=False)
    assert requested_carveout(4, 16) == 64
    assert requested_carveout(1, 24) == 0  # a GPU per rank: matmuls keep every SM
    monkeypatch.setenv("MOE_EP_MATMUL_SM_CARVEOUT", "0")
    assert requested_carveout(4, 16) == 0
    monkeypatch.setenv("MOE_EP_MATMUL_SM_CARVEOUT", "40")
    assert requested_carveout(1, 24) == 40
    for bad in ("-3", "half"):
        monkeypatch.setenv("MOE_EP_MATMUL_SM_CARVEOUT", bad)
        with pytest.raises(ValueError, match="MOE_EP_MATMUL_SM_CARVEOUT: expected auto or a number"):
            requested_carveout(4, 16)


@pytest.fixture
def carveout_state(monkeypatch):
    """torch's carveout as a plain variable, on a GPU of 132 SMs."""
    state = {"carveout": None}
    fake_c = types.SimpleNamespace(_get_sm_carveout_experimental=lambda: state["carveout"],
                                   _set_sm_carveout_experimental=lambda c: state.update(carveout=c))
    monkeypatch.setattr(matmul_carveout.torch, "_C", fake_c)
    monkeypatch.setattr(matmul_carveout.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    return state


def test_the_carveout_only_grows_and_leaves_matmuls_some_sms(carveout_state):
    device = torch.device("cuda", 0)
    assert keep_sms_from_matmuls(0, device) == 0 and carveout_state["carveout"] is None
    assert keep_sms_from_matmuls(64, device) == 64 == carveout_state["carveout"]
    assert keep_sms_from_matmuls(32, device) == 64 == carveout_state["carveout"]  # never lowered
    assert keep_sms_from_matmuls(500, device) == 124 == carveout_state["carveout"]  # 8 SMs stay
