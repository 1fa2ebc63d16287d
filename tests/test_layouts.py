"""Buffer sizes: a buffer of the size a Config's hint asks for holds at least one window of the
intranode kernels, for every rank count and default config (the kernels refuse a buffer that cannot)."""
import pytest

from moe_ep import Buffer, Config
from moe_ep.config import IntranodeLayout, LowLatencyLayout, intranode_header_bytes


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("hidden,fp8", [(7168, False), (7168, True), (4096, False), (132, False)])
def test_a_hinted_buffer_holds_a_window(num_ranks, hidden, fp8):
    configs = [Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks), Config(2, 1, 2, 1, 2)]
    for config in configs:
        size = config.get_nvl_buffer_size_hint(hidden * 2, num_ranks)
        x_bytes = hidden if fp8 else hidden * 2
        scale_bytes = hidden // 128 * 4 if fp8 else 0
        layout = IntranodeLayout(num_ranks, size, x_bytes, scale_bytes, 32)
        assert layout.header_bytes == intranode_header_bytes(num_ranks) < size
        assert layout.dispatch_window_tokens >= 1, (config, layout.as_dict())
        assert IntranodeLayout(num_ranks, size, hidden * 2, 0, 32).combine_window_tokens >= 1, config


def test_low_latency_layout_has_room_for_every_slot():
    layout = LowLatencyLayout(128, 7168, 8, 288)
    assert layout.recv_bytes >= 288 * 128 * layout.dispatch_message_bytes
    assert layout.signal_bytes >= (288 + 8) * 8
    assert layout.total_bytes == LowLatencyLayout.HEADER_BYTES + 2 * layout.half_bytes
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288) == layout.total_bytes
