"""Kernel tuning knobs (Config), tuned defaults per rank count, and buffer sizes.

The intranode buffer layout mirrors `csrc/kernels/buffer_layout.cuh` one to one, and a GPU test checks
that both give the same numbers. Every backend enforces the size hints, so a program that runs on the
portable backend runs unchanged on the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from .checks import check_int, check_num_sms

# A host's NVLink domain as the intranode kernels address it (peers mapped over CUDA IPC).
NUM_MAX_NVL_PEERS = 8
# Top-k entries a normal-mode receive queue reserves per token (top-k idx int64 + weight float32).
NUM_MAX_TOPK = 32
# A low-latency dispatch's receive index: an entry (source token, pick and call) per expert row.
LL_INDEX_ENTRY_BYTES = 8
ALIGNMENT_BYTES = 128
FP8_BLOCK = 128


def _align(n: int, to: int = ALIGNMENT_BYTES) -> int:
    return -(-n // to) * to


@dataclass
class Config:
    """Chunking of the normal-mode kernels. Positional order is deep_ep's."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        check_num_sms("num_sms", self.num_sms)
        for name in (
            "num_max_nvl_chunked_send_tokens",
            "num_max_nvl_chunked_recv_tokens",
            "num_max_rdma_chunked_send_tokens",
            "num_max_rdma_chunked_recv_tokens",
        ):
            check_int(name, getattr(self, name), minimum=1)
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "num_max_nvl_chunked_send_tokens must be smaller than num_max_nvl_chunked_recv_tokens, got "
                f"{self.num_max_nvl_chunked_send_tokens} >= {self.num_max_nvl_chunked_recv_tokens}"
            )
        if self.num_max_rdma_chunked_send_tokens > self.num_max_rdma_chunked_recv_tokens // 2:
            raise ValueError(
                "num_max_rdma_chunked_send_tokens must be at most half of num_max_rdma_chunked_recv_tokens, "
                f"got {self.num_max_rdma_chunked_send_tokens} and {self.num_max_rdma_chunked_recv_tokens}"
            )

    @property
    def num_channels(self) -> int:
        # deep_ep's accounting (a channel = one SM sending and one receiving), kept for the size hints;
        # the intranode kernels launch num_sms blocks that each both send and receive.
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        check_int("hidden_bytes", hidden_bytes, minimum=1)
        check_int("num_ranks", num_ranks, minimum=1)
        return NormalLayout(self, hidden_bytes, num_ranks).nvl_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        check_int("hidden_bytes", hidden_bytes, minimum=1)
        check_int("num_ranks", num_ranks, minimum=1)
        return NormalLayout(self, hidden_bytes, num_ranks).rdma_bytes


class NormalLayout:
    """Size hints of the normal-mode buffers (the sizes a Config asks for).

    The intranode buffer is a header (IntranodeLayout) and two window halves; the hint gives the
    halves together room for num_channels * num_max_nvl_chunked_recv_tokens slots per peer, a slot
    holding a row (hidden_bytes counts 2 bytes per element), its fp8 scales and top-k metadata. The
    kernels size their windows from the bytes actually given, so a larger buffer means fewer windows.
    """

    def __init__(self, config: Config, hidden_bytes: int, num_ranks: int):
        nvl_peers = min(num_ranks, NUM_MAX_NVL_PEERS)
        rdma_ranks = -(-num_ranks // NUM_MAX_NVL_PEERS)
        scale_bytes = (hidden_bytes // 2 // FP8_BLOCK) * 4
        token_meta = 4 + NUM_MAX_TOPK * (8 + 4)  # source index, top-k ids and weights
        slot_bytes = hidden_bytes + scale_bytes + token_meta
        windows = config.num_channels * nvl_peers * config.num_max_nvl_chunked_recv_tokens * slot_bytes
        self.nvl_bytes = _align(intranode_header_bytes(nvl_peers) + windows)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            self.rdma_bytes = 0
        else:
            rdma_queues = (
                config.num_channels * rdma_ranks * config.num_max_rdma_chunked_recv_tokens * slot_bytes * 2
            )  # send and receive sides
            self.rdma_bytes = _align(rdma_queues + config.num_channels * rdma_ranks * 4 * 4)


# ---------------------------------------------------------------------------- intranode buffer layout
# Mirrors csrc/kernels/buffer_layout.cuh (tests/test_layout_formulas.py compiles the header for the host
# and compares; tests/test_intranode.py checks the extension's numbers on a GPU).
INTRANODE_HEADER_ALIGN = 4096
INTRANODE_SLOT_ALIGN = 16
INTRANODE_MAX_EXPERTS = 16384
_INTRANODE_FIXED_SIGNALS = 16
_INTRANODE_SIGNAL_ARRAYS = 7
_INTRANODE_STREAM_SIGNALS = 2 * 32  # the streaming combine's two [channel][rank] ring counters
_INTRANODE_LAYOUT_FIELDS = 7  # a zero-copy dispatch's receiving layout, per rank


def intranode_header_bytes(num_ranks: int) -> int:
    signals = (_INTRANODE_FIXED_SIGNALS + (_INTRANODE_SIGNAL_ARRAYS + _INTRANODE_STREAM_SIGNALS
                                           + _INTRANODE_LAYOUT_FIELDS) * num_ranks) * 8
    # The counts area: a row per source of [tokens, tokens for this rank, tokens per rank, per expert].
    counts = 2 * num_ranks + num_ranks * num_ranks + INTRANODE_MAX_EXPERTS
    return _align(signals + 4 * counts, INTRANODE_HEADER_ALIGN)


class IntranodeLayout:
    """Windows of the intranode kernels for one buffer size and row shape."""

    def __init__(self, num_ranks: int, num_nvl_bytes: int, x_bytes: int, scale_bytes: int, num_topk: int):
        a = INTRANODE_SLOT_ALIGN
        self.header_bytes = intranode_header_bytes(num_ranks)
        spare = num_nvl_bytes - self.header_bytes
        self.half_bytes = 0 if spare <= 0 else spare // 2 // a * a
        self.dispatch_slot_bytes = (
            _align(4 * num_ranks, a) + _align(x_bytes, a) + _align(scale_bytes, a)
            + _align(8 * num_topk, a) + _align(4 * num_topk, a)
        )
        self.combine_slot_bytes = _align(x_bytes, a) + _align(4 * num_topk, a)
        cap = 1 << 22
        self.dispatch_window_tokens = min(self.half_bytes // self.dispatch_slot_bytes, cap)
        combine_bytes = self.combine_slot_bytes * num_ranks
        self.combine_window_tokens = min(self.half_bytes // combine_bytes, cap) if combine_bytes else 0

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class ArenaRegion:
    """The layout of an arena region holding exactly `capacity` received rows (ZeroCopyDispatchArgs in
    csrc/kernels/api.cuh): `capacity` rows of x, then as many of scales, of top-k local ids (int64), of
    top-k weights (float32) and of source token indices (int32), each part 16-byte aligned. The kernels
    take these numbers from here, except where an early-launched dispatch lays its region out on the
    device (`dispatch_region` in buffer_layout.cuh: the same formula as `_arena_parts`)."""

    slot_bytes: int
    capacity: int
    x_offset: int
    scale_offset: int
    idx_offset: int
    weight_offset: int
    src_offset: int

    @property
    def offsets(self) -> list:
        return [self.x_offset, self.scale_offset, self.idx_offset, self.weight_offset, self.src_offset]


def _arena_row_bytes(x_bytes: int, scale_bytes: int, num_topk: int) -> int:
    return x_bytes + scale_bytes + 12 * num_topk + 4


def _arena_parts(capacity: int, x_bytes: int, scale_bytes: int, num_topk: int) -> List[int]:
    """Offsets of the five parts of `capacity` rows (x, scales, top-k ids, top-k weights, source
    tokens), then the end of the last."""
    offsets = [0]
    for part_row_bytes in (x_bytes, scale_bytes, 8 * num_topk, 4 * num_topk, 4):
        offsets.append(_align(offsets[-1] + capacity * part_row_bytes, INTRANODE_SLOT_ALIGN))
    return offsets


def arena_dispatch_region(rows: int, x_bytes: int, scale_bytes: int, num_topk: int) -> ArenaRegion:
    """The layout of exactly `rows` received rows: slot_bytes is the region's size."""
    parts = _arena_parts(rows, x_bytes, scale_bytes, num_topk)
    return ArenaRegion(parts[5], rows, *parts[:5])


def arena_dispatch_rows_within(nbytes: int, x_bytes: int, scale_bytes: int, num_topk: int) -> int:
    """The most rows whose region (arena_dispatch_region) could fit in nbytes: a bound, since the
    parts' alignment may take a little more."""
    return nbytes // _arena_row_bytes(x_bytes, scale_bytes, num_topk)


def arena_bytes(num_rows: int, x_bytes: int, scale_bytes: int = 0, num_topk: int = 0, num_live: int = 4) -> int:
    """num_arena_bytes for a Buffer whose ranks each receive at most num_rows rows per dispatch (x_bytes
    per row, plus scale_bytes of fp8 scales, plus top-k ids and weights), with room for num_live such
    calls' tensors alive at once: a dispatch's recv_x, a cached dispatch's, a combine's input
    (Buffer.empty_combine_input) and a copy of a combine input written elsewhere are four. The same
    value must be passed on every rank."""
    check_int("num_rows", num_rows, minimum=0)
    check_int("num_live", num_live, minimum=1)
    one = arena_dispatch_region(num_rows, x_bytes, scale_bytes, num_topk).slot_bytes + INTRANODE_SLOT_ALIGN
    return num_live * _align(one, INTRANODE_SLOT_ALIGN)


class LowLatencyLayout:
    """Low-latency buffer (mirrors low_latency::regions in csrc/kernels/buffer_layout.cuh): a 4 KB header
    and two identical halves used by alternate calls, so that one call's receive buffers stay valid
    while the next call is issued. Each half holds a send region (the send kernel's scratch, the rows
    of a zero-copy combine, then a dispatch's outbox: a message per token of this rank), a receive
    region (a dispatch's index and a message per source token and rank, or a combine's rows), and one
    signal per (local expert, source rank) and per rank."""

    HEADER_BYTES = 4096

    def __init__(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int):
        # A bf16 row is the largest message: fp8 rows with their scales are smaller (H + H/32 < 2H).
        dispatch_msg = _align(hidden * 2)  # a row, 128-byte pitch
        combine_msg = _align(hidden * 2, 16)
        slots = num_experts * num_max_dispatch_tokens_per_rank
        self.dispatch_message_bytes = dispatch_msg
        self.combine_message_bytes = combine_msg
        # Entry lists (E x max int32), a zero-copy combine's rows ([L, R x max, H] bf16), the outbox.
        self.zero_copy_offset = _align(slots * 4)
        self.outbox_offset = self.zero_copy_offset + _align(slots * combine_msg)
        self.send_bytes = self.outbox_offset + num_max_dispatch_tokens_per_rank * dispatch_msg
        # A dispatch's index (an entry per expert row), then a message per (source rank, token); a
        # combine's row per (expert row).
        self.dispatch_messages_offset = _align(slots * LL_INDEX_ENTRY_BYTES)
        self.recv_bytes = _align(max(self.dispatch_messages_offset + num_ranks * num_max_dispatch_tokens_per_rank *
                                     dispatch_msg, slots * combine_msg))
        self.signal_bytes = _align((num_experts + num_ranks) * 8)
        self.half_bytes = self.send_bytes + self.recv_bytes + self.signal_bytes
        self.total_bytes = self.HEADER_BYTES + 2 * self.half_bytes

    def as_dict(self) -> dict:
        return dict(vars(self))


def low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
    check_int("hidden", hidden, minimum=1)
    check_int("num_ranks", num_ranks, minimum=1)
    check_int("num_experts", num_experts, minimum=1)
    return LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).total_bytes


# Defaults per rank count: (num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens). The
# receive chunk sizes the buffer through the size hint, hence the kernels' windows. These were the
# fastest of 64/256/1024 at 24 SMs on an H200 (combine: at 16 and 32 SMs too; dispatch: 256 is within
# 3% of the best at every rank count and SM budget): `moe-ep-bench intranode --ranks 2 4 8 --sms 24
# --recv-tokens 64 256 1024`. The kernels' windows follow the buffer's bytes, and a buffer sized for both
# configs (deep_ep's idiom) takes the larger receive chunk: at 2 ranks the combine's 1024 gives the
# dispatch 1024-token windows too (4-7% faster than 256, same command with `--ranks 2`).
# The dispatch's send chunk does not steer its kernels (deep_ep's meaning, kept valid). The combine's
# is the streaming combine's sending round (rows per owner written before they are released; it
# streams from 4 ranks): the fastest of 2-48 at 4 and 8 ranks, 24 SMs, on one H200 and, at 4 ranks, on
# four (`moe-ep-bench intranode --ranks 4 8 --sms 24 --modes combine --send-tokens 2 4 8 16 32 48`); the
# generic 16 is within 5% of the best at both. At 8 ranks on one H200 the combine's blocks are 14 Full,
# at which 16 rows gave 152 GB/s per rank against 142 for 4 and 148 for 32 (same command with
# `--ranks 8 --send-tokens 4 16 32`); at 4 ranks 32 is the best of 4/16/32/63.
# Any rank count not listed gets the generic entry.
_DISPATCH_CONFIGS = {
    2: (24, 256),
    4: (6, 256),
    8: (6, 256),
}
_COMBINE_CONFIGS = {
    2: (10, 1024),
    4: (32, 64),
    8: (16, 64),
}
_GENERIC_DISPATCH = (6, 256)
_GENERIC_COMBINE = (16, 256)


# Buffer.num_sms before any Buffer.set_num_sms: at this budget a tuned config's own budget is taken.
DEFAULT_NUM_SMS = 20


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """The built-in dispatch config (the table above), whatever the config cache holds."""
    send, recv = _DISPATCH_CONFIGS.get(num_ranks, _GENERIC_DISPATCH)
    return Config(num_sms, send, recv, 6, 128)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    """The built-in combine config (the table above), whatever the config cache holds."""
    send, recv = _COMBINE_CONFIGS.get(num_ranks, _GENERIC_COMBINE)
    return Config(num_sms, send, recv, 6, 128)


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """The dispatch config of num_ranks ranks at num_sms: the config cache's for this machine where
    `moe-ep-bench tune` wrote one (its own SM budget where num_sms is DEFAULT_NUM_SMS; moe_ep.tuning), else
    the built-in one."""
    from .tuning import tuned_config

    return tuned_config("dispatch", num_ranks, num_sms, DEFAULT_NUM_SMS) or default_dispatch_config(num_ranks, num_sms)


def combine_config(num_ranks: int, num_sms: int) -> Config:
    """The combine config of num_ranks ranks at num_sms, as dispatch_config."""
    from .tuning import tuned_config

    return tuned_config("combine", num_ranks, num_sms, DEFAULT_NUM_SMS) or default_combine_config(num_ranks, num_sms)
