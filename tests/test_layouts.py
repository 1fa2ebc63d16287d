"""Buffer sizes: a buffer of the size a Config's hint asks for holds at least one window of the
intranode kernels, for every rank count and default config (the kernels refuse a buffer that cannot)."""
import pytest

from moe_ep import Buffer, Config
from moe_ep.config import (
    IntranodeLayout, LowLatencyLayout, intranode_header_bytes, zero_copy_combine_bytes, zero_copy_combine_slot,
    zero_copy_dispatch_bytes, zero_copy_dispatch_region, zero_copy_dispatch_slot,
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
def test_zero_copy_dispatch_slots_hold_what_their_size_says(seed):
    """The kernels write a slot at the offsets config.py computes (no other copy of the formula): every
    part 16-byte aligned, the parts in order without overlap, all inside the slot; the size helper's
    bytes hold exactly the rows asked for, and 16 bytes fewer do not hold them all."""
    import random
    rng = random.Random(seed)
    for _ in range(200):
        x_bytes = rng.choice([8, 264, 2048, 7168, 14336, 4104])
        scale_bytes = rng.choice([0, 4, 64, 224])
        num_topk = rng.randint(0, 32)
        rows = rng.randint(0, 5000)
        area = zero_copy_dispatch_bytes(rows, x_bytes, scale_bytes, num_topk)
        slot = zero_copy_dispatch_slot(area, x_bytes, scale_bytes, num_topk)
        assert slot.capacity >= rows and 2 * slot.slot_bytes <= area
        parts = [(slot.x_offset, x_bytes), (slot.scale_offset, scale_bytes), (slot.idx_offset, 8 * num_topk),
                 (slot.weight_offset, 4 * num_topk), (slot.src_offset, 4)]
        end = 0
        for offset, row_bytes in parts:
            assert offset % 16 == 0 and offset >= end
            end = offset + slot.capacity * row_bytes
        assert end <= slot.slot_bytes
        if rows:
            assert zero_copy_dispatch_slot(area - 32, x_bytes, scale_bytes, num_topk).capacity < rows


def test_zero_copy_combine_slots_hold_what_their_size_says():
    for rows, row_bytes in [(0, 14336), (1, 14336), (4096 * 8, 14336), (77, 264), (5, 8)]:
        area = zero_copy_combine_bytes(rows, row_bytes)
        slot_bytes, pitch, capacity = zero_copy_combine_slot(area, row_bytes)
        assert pitch % 16 == 0 and pitch >= row_bytes + 4 * 32
        assert capacity >= rows and 2 * slot_bytes <= area


@pytest.mark.parametrize("rows,x_bytes,scale_bytes,num_topk", [(0, 14336, 0, 8), (1, 7168, 224, 8), (777, 264, 8, 3)])
def test_an_arena_region_is_a_slot_of_exactly_its_rows(rows, x_bytes, scale_bytes, num_topk):
    """A dispatch arena's region: the parts of a slot of the same capacity, and its size their end."""
    region = zero_copy_dispatch_region(rows, x_bytes, scale_bytes, num_topk)
    assert region.capacity == rows
    assert region.slot_bytes >= rows * (x_bytes + scale_bytes + 12 * num_topk + 4)
    assert all(offset % 16 == 0 for offset in region.offsets + [region.slot_bytes])
    assert region.src_offset + 4 * rows <= region.slot_bytes
    if rows:
        slot = zero_copy_dispatch_slot(zero_copy_dispatch_bytes(rows, x_bytes, scale_bytes, num_topk), x_bytes,
                                       scale_bytes, num_topk)
        assert slot.capacity == rows and slot.offsets == region.offsets
