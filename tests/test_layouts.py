"""Buffer sizes: a buffer of the size a Config's hint asks for holds at least one window of the
intranode kernels, for every rank count and default config (the kernels refuse a buffer that cannot)."""
import pytest

from moe_ep import Buffer, Config
from moe_ep.arena import Arena
from moe_ep.config import (
    INTRANODE_SLOT_ALIGN, IntranodeLayout, LowLatencyLayout, arena_bytes, arena_dispatch_region,
    arena_dispatch_rows_within, intranode_header_bytes,
)


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
    # A dispatch's index (8 bytes per expert row), then a bf16 row per (source rank, token), lines apart.
    assert layout.dispatch_message_bytes >= 7168 * 2 and layout.dispatch_message_bytes % 128 == 0
    assert layout.dispatch_messages_offset >= 288 * 128 * 8
    assert layout.recv_bytes >= layout.dispatch_messages_offset + 8 * 128 * layout.dispatch_message_bytes
    # A combine row per (expert, source, token).
    assert layout.recv_bytes >= 288 * 128 * layout.combine_message_bytes
    # The send region: scratch, a zero-copy combine's rows, then an outbox message per token of this rank.
    assert layout.outbox_offset >= layout.zero_copy_offset + 288 * 128 * layout.combine_message_bytes
    assert layout.send_bytes >= layout.outbox_offset + 128 * layout.dispatch_message_bytes
    assert layout.signal_bytes >= (288 + 8) * 8
    assert layout.total_bytes == LowLatencyLayout.HEADER_BYTES + 2 * layout.half_bytes
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288) == layout.total_bytes


@pytest.mark.parametrize("seed", range(5))
def test_arena_regions_hold_what_their_size_says(seed):
    """The kernels write a region at the offsets config.py computes (an early dispatch lays them out on
    the device by the same formula: tests/test_layout_formulas.py): every part 16-byte aligned, the parts
    in order without overlap, all inside the region; arena_dispatch_rows_within bounds the rows from
    above, and an arena of arena_bytes holds num_live such regions one after another."""
    import random
    rng = random.Random(seed)
    for _ in range(200):
        x_bytes = rng.choice([8, 264, 2048, 7168, 14336, 4104])
        scale_bytes = rng.choice([0, 4, 64, 224])
        num_topk = rng.randint(0, 32)
        rows = rng.randint(0, 5000)
        region = arena_dispatch_region(rows, x_bytes, scale_bytes, num_topk)
        assert region.capacity == rows and region.slot_bytes % 16 == 0
        parts = [(region.x_offset, x_bytes), (region.scale_offset, scale_bytes), (region.idx_offset, 8 * num_topk),
                 (region.weight_offset, 4 * num_topk), (region.src_offset, 4)]
        end = 0
        for offset, row_bytes in parts:
            assert offset % 16 == 0 and offset >= end
            end = offset + rows * row_bytes
        assert end <= region.slot_bytes < end + 16
        assert arena_dispatch_rows_within(region.slot_bytes, x_bytes, scale_bytes, num_topk) >= rows
        num_live = rng.randint(1, 6)
        arena = Arena(arena_bytes(rows, x_bytes, scale_bytes, num_topk, num_live=num_live), INTRANODE_SLOT_ALIGN)
        assert all(arena.alloc(region.slot_bytes) is not None for _ in range(num_live))


@pytest.mark.parametrize("rows,x_bytes,scale_bytes,num_topk", [(0, 14336, 0, 8), (1, 7168, 224, 8), (777, 264, 8, 3)])
def test_an_arena_region_is_exactly_its_rows(rows, x_bytes, scale_bytes, num_topk):
    """A region holds its rows' parts and ends with the last of them (16-byte aligned)."""
    region = arena_dispatch_region(rows, x_bytes, scale_bytes, num_topk)
    assert region.capacity == rows
    assert region.slot_bytes >= rows * (x_bytes + scale_bytes + 12 * num_topk + 4)
    assert all(offset % 16 == 0 for offset in region.offsets + [region.slot_bytes])
    assert region.src_offset + 4 * rows <= region.slot_bytes


def test_arena_bytes_checks_its_arguments():
    assert arena_bytes(0, 14336) > 0  # room for the parts' alignment even without rows
    assert arena_bytes(100, 14336, num_live=2) < arena_bytes(100, 14336, num_live=3)
    with pytest.raises(ValueError, match="num_live: expected an int >= 1"):
        arena_bytes(100, 14336, num_live=0)
    with pytest.raises(ValueError, match="num_rows: expected an int >= 0"):
        arena_bytes(-1, 14336)
