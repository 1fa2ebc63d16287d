"""The intranode backend: CUDA kernels over peers' buffers mapped with CUDA IPC (csrc/kernels/intranode/).

Used for CUDA tensors when every rank of the group is on this host (also several ranks on one GPU).
It keeps the portable backend's results bit for bit; the Buffer has checked every argument before a
call gets here. Kernels run on a dedicated communication stream with deep_ep's event semantics.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..arena import Arena, Region
from ..config import (
    INTRANODE_SLOT_ALIGN, Config, ZeroCopyDispatchSlot, zero_copy_combine_slot, zero_copy_dispatch_bytes,
    zero_copy_dispatch_region, zero_copy_dispatch_rows_within, zero_copy_dispatch_slot,
)
from ..checks import env_switch
from ..events import EventOverlap
from ..handles import DispatchHandle
from ..mps import process_sm_share
from ..sync import ArrivalGate
from .peers import (
    HOST_COMBINE_MISSING, HOST_COUNTS, HOST_DONE, HOST_ERROR, HOST_OVERFLOW, PHASE_NAMES, WAIT_NAMES, MappedBuffers,
    aligned, device_view, kernel_progress, map_peer_buffers, peer_memory,
)

# Host-side grace on top of the kernels' own deadline before the host gives up on a count exchange.
_HOST_GRACE_S = 5.0
# How many of its last calls a backend's progress_report lists.
RECENT_CALLS = 4

# The streaming combine (per-channel rings, sending and receiving blocks at once) beat the windowed one
# from 4 ranks up and lost at 2, on one GPU and on two (docs/PERFORMANCE.md, sixth session).
STREAM_COMBINE_MIN_RANKS = 4


def row_bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.shape[1] * t.element_size()


def zero_copy_dispatch_layout(area_bytes: int, x: torch.Tensor, scales: Optional[torch.Tensor],
                              num_topk: int) -> ZeroCopyDispatchSlot:
    """The slot layout of a zero-copy dispatch area for these rows (both backends check capacities with it)."""
    return zero_copy_dispatch_slot(area_bytes, row_bytes(x), row_bytes(scales), num_topk)


def zero_copy_dispatch_too_small(rank: int, rows: int, x: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int,
                                 area_bytes: int) -> str:
    """The ValueError text when a zero-copy dispatch slot cannot hold a rank's received rows."""
    needed = zero_copy_dispatch_bytes(rows, row_bytes(x), row_bytes(scales), num_topk)
    return (
        f"num_zero_copy_dispatch_bytes: rank {rank} receives {rows} rows of {row_bytes(x)} bytes "
        f"(+{row_bytes(scales)} of scales, top-{num_topk}), which need {needed} bytes (two slots); the Buffer "
        f"has {area_bytes}. Create it with at least that much (config.zero_copy_dispatch_bytes), the same on "
        "every rank."
    )


def fit_blocks() -> bool:
    """Whether the data kernels fit their block count to the ranks sharing a GPU and the combines try
    1024-thread blocks first (fitted_blocks in intranode/launch.cu; MOE_EP_FIT_BLOCKS=0 takes the SM budget as
    the count and the 512-thread shapes, as before the twentieth session)."""
    return env_switch("MOE_EP_FIT_BLOCKS", "1")


def rendezvous_first(max_ranks_on_device: int) -> bool:
    """Whether the combines and the cached dispatches start behind a one-block rendezvous kernel, so
    that their blocks take SMs only once every rank reached the call: where any GPU holds several of the
    group's ranks (else a rank's waiting grid can keep a peer's expert GEMMs from the SMs they need,
    which stalled eight ranks on one H200 until the deadline: DESIGN.md, "Ranks sharing a GPU").
    MOE_EP_RENDEZVOUS=0 turns it off (for measurement; the same on every rank)."""
    return max_ranks_on_device > 1 and env_switch("MOE_EP_RENDEZVOUS", "1")


def use_stream_combine(num_ranks: int) -> bool:
    """Whether the intranode combine streams: by rank count, or as MOE_EP_STREAM_COMBINE=1 / 0 forces.
    (The kernels fall back to windows past 32 ranks either way.)"""
    forced = os.environ.get("MOE_EP_STREAM_COMBINE")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"MOE_EP_STREAM_COMBINE: expected 0 or 1, got {forced!r}")
    return num_ranks >= STREAM_COMBINE_MIN_RANKS


def dispatch_via_zero_copy() -> bool:
    """MOE_EP_DISPATCH_VIA_ZERO_COPY=1: ordinary dispatches run as zero-copy ones into the Buffer's
    zero-copy dispatch area and copy recv_x (and its scales) out into tensors of their own. Why: across
    GPUs the zero-copy dispatch's senders store over NVLink (378 GB/s per rank on four H200s, NCCL's
    rate) where the ordinary one's receivers load (283), and the copy-out is a pass over local memory.
    Measured through this switch on two H200s: bf16 2 ranks 304-311 -> 380-382 GB/s per rank, fp8
    level; on one GPU both move the same bytes. Off by default: it needs the area, which few Buffers
    have.
    The area must hold every such dispatch's rows (else the zero-copy dispatch's ValueError), and these
    dispatches take its slots in turn with the zero-copy ones."""
    return env_switch("MOE_EP_DISPATCH_VIA_ZERO_COPY", "0")


def dispatch_arena() -> bool:
    """MOE_EP_DISPATCH_ARENA=1 (the default of Buffer's dispatch_arena): the zero-copy dispatch area
    becomes an arena, and every dispatch of the Buffer (ordinary or zero-copy) takes a region of it for
    its received rows, into which the senders store them once; recv_x and the scales are tensors over
    the region that return it when the last of them dies. Why: one pass over memory instead of two,
    with recv_x owning its memory like any tensor (the two slots' views are valid only until the second
    zero-copy dispatch after). Off by default (docs/DESIGN.md, step 4, says why). The area must hold
    every live dispatch's rows: a dispatch that finds no room raises ValueError (its rows are dropped;
    the Buffer stays usable)."""
    return env_switch("MOE_EP_DISPATCH_ARENA", "0")


@dataclass
class IntranodeDispatchState:
    """Device-side layout a kernel dispatch leaves for its combine and cached dispatches."""

    send_pos: torch.Tensor  # [N, R] int32: row of each token among those sent to rank r, -1 if not sent
    recv_info: torch.Tensor  # int32: [max tokens, total rows, base row per source (R + 1), tokens per source]
    recv_src_idx: torch.Tensor  # [rows] int32: source token index of each received row (-1: padding)


class IntranodeBackend:
    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_nvl_bytes: int, comm_stream: torch.cuda.Stream,
                 zero_copy_bytes: int = 0, zero_copy_dispatch_bytes: int = 0, arena: bool = False):
        self.peers = map_peer_buffers(group, gate, num_nvl_bytes, "dispatch", peer_memory())
        self.memory = self.peers.memory  # the zero-copy areas are mapped the same way
        self.ops = self.peers.ops
        self.rank, self.num_ranks = self.peers.rank, self.peers.num_ranks
        self.num_nvl_bytes = num_nvl_bytes
        self.timeout_s = gate.timeout_s
        self.host_info, self._host = self.peers.host_info, self.peers.host
        layout = self.ops.intranode_layout(self.num_ranks, num_nvl_bytes, 0, 0, 0)
        self.recv_info_ints = layout["recv_info_ints"]
        self.ctx = self.ops.IntranodeCtx(
            self.peers.pointers.data_ptr(), self.rank, self.num_ranks, num_nvl_bytes, self.host_info, self.timeout_s,
            self.peers.ranks_on_device,
        )
        self.ctx.stream_combine = use_stream_combine(self.num_ranks)
        self.ctx.fit_ranks_on_device = self.peers.max_ranks_on_device if fit_blocks() else 0
        self.ctx.rendezvous = rendezvous_first(self.peers.max_ranks_on_device)
        self.ctx.sm_share_percent = process_sm_share()
        # Zero-copy combine: a second mapped area of two slots, where callers write their combine rows
        # (get_next_combine_buffer) and the ranks that own the tokens read them.
        self.zero_copy: Optional[MappedBuffers] = None
        self.zero_copy_bytes = zero_copy_bytes
        self._zero_copy_views = {}
        if zero_copy_bytes > 0:
            self.zero_copy = self._zero_copy_area(group, gate, zero_copy_bytes, "combine")
        # Zero-copy dispatch: a third mapped area of two slots, into which the senders store the rows
        # at their final place (zero_copy_dispatch_slot), so that recv_x is a view of it.
        self.zero_copy_dispatch: Optional[MappedBuffers] = None
        self.zero_copy_dispatch_bytes = zero_copy_dispatch_bytes
        self._dispatch_next = 0
        self._dispatch_slot_bytes = {}  # (slot, slot bytes): that slot as a uint8 tensor
        if zero_copy_dispatch_bytes > 0:
            # The arena's switch too: with it every plain combine reads its rows from the arenas, and all
            # ranks of a call must run the same kernel.
            self.zero_copy_dispatch = self._zero_copy_area(group, gate, zero_copy_dispatch_bytes, "dispatch",
                                                           arena=arena)
        self.arena: Optional[Arena] = None
        if self.zero_copy_dispatch is not None and arena:
            self.arena = Arena(zero_copy_dispatch_bytes, INTRANODE_SLOT_ALIGN)
        self.via_zero_copy = self.zero_copy_dispatch is not None and self.arena is None and dispatch_via_zero_copy()
        self.comm_stream = comm_stream
        # The last calls' [kind, host time, event the communication stream waited for] (progress_report).
        self._recent_calls = deque(maxlen=RECENT_CALLS)
        # The stream orderings every call makes, on events kept for it: Stream.wait_stream creates and
        # destroys an event each time (two more CUDA API calls per ordering on the call's host path). The
        # caller's stream is marked on one of RECENT_CALLS events in turn, so that no call progress_report
        # lists has had its event recorded again by a later call.
        self._compute_ready = [torch.cuda.Event() for _ in range(RECENT_CALLS)]
        self._compute_ready_next = 0
        self._comm_done = torch.cuda.Event()
        self._nonce = 0
        self._fitting_sms = set()  # SM budgets known to fit this GPU together with its other ranks
        # MOE_EP_PROFILE_WAITS=1: the kernels add up, per block, the time they wait on peers (by what
        # they wait for) and their whole time; wait_profile() reads it. For benchmarks: it costs two
        # clock reads per wait.
        self._wait_rows = {} if os.environ.get("MOE_EP_PROFILE_WAITS") == "1" else None
        self._wait_slots = layout["wait_slots"]
        # With the wait profile, every kernel's last block also logs (KernelId, start, end): kernel_log().
        self._kernel_log = None
        if self._wait_rows is not None:
            self._kernel_log = torch.zeros(layout["kernel_log_ints"], dtype=torch.int64, device=self.peers.device)
            self.ctx.kernel_log = self._kernel_log.data_ptr()

    def _zero_copy_area(self, group, gate, size: int, kind: str, arena: bool = False) -> MappedBuffers:
        """A mapped area for zero-copy calls. Every rank's slots must hold the same rows, since the
        kernels bound peers' rows by their own capacity."""
        settings = [None] * self.num_ranks
        dist.all_gather_object(settings, (size, arena), group=group)
        if len({size for size, _ in settings}) != 1:
            raise ValueError(f"num_zero_copy_{kind}_bytes: expected the same value on every rank, "
                             f"got {[size for size, _ in settings]}")
        if len({arena for _, arena in settings}) != 1:
            raise ValueError("dispatch_arena (MOE_EP_DISPATCH_ARENA): expected the same on every rank, got "
                             f"{[arena for _, arena in settings]}")
        self.ctx.zero_copy_bases = True  # notify finds where this rank's rows start at every peer
        return map_peer_buffers(group, gate, size, f"zero-copy {kind} area", self.memory)

    def close(self) -> None:
        self.peers.close()
        for area in (self.zero_copy, self.zero_copy_dispatch):
            if area is None:
                continue
            if area is self.zero_copy_dispatch and self.arena is not None and self.arena.used_regions:
                # recv_x tensors of the arena still live, and own their memory: the area goes when the
                # last of them does (their regions hold it). The peers unmap theirs now.
                dist.barrier(group=area.group)
                continue
            area.close()

    # ---------------------------------------------------------------- errors the kernels reported
    def check_errors(self) -> None:
        """Raises what an earlier kernel reported: a peer that did not arrive (the Buffer is then out of
        step and unusable), or a num_worst_tokens dispatch that received more rows than it had."""
        h = self._host
        if h[HOST_OVERFLOW]:
            received, h[HOST_OVERFLOW] = h[HOST_OVERFLOW], 0
            raise ValueError(
                f"num_worst_tokens: an earlier dispatch on rank {self.rank} received {received} tokens, more than "
                "its num_worst_tokens rows; the rows past it were dropped. Pass a larger num_worst_tokens."
            )
        error = self.peers.timeout_error()
        if error is not None:
            raise error

    def check_num_sms(self, num_sms: int) -> None:
        """ValueError (on every rank of this GPU alike) before a call starts, if its blocks cannot all be
        resident: the kernels wait on each other across ranks and would stall until the deadline."""
        if num_sms not in self._fitting_sms:
            self.ops.intranode_check_blocks(self.ctx, num_sms)
            self._fitting_sms.add(num_sms)

    def launch_blocks(self, num_sms: int, combine: bool = False) -> int:
        """The blocks a dispatch (or with `combine`, a combine) kernel runs on for an SM budget of num_sms:
        fewer where ranks share a GPU and fewer blocks of a larger shape hold more threads (the combines
        try 1024-thread blocks first); the same on every rank."""
        self.check_num_sms(num_sms)
        return self.ops.intranode_launch_blocks(self.ctx, num_sms, combine)

    def _start_call(self, kernel: str, num_sms: int) -> None:
        """What every dispatch and combine does first: report what an earlier kernel found, refuse an SM
        budget that cannot be resident, and point the kernels at this kernel's wait-profile rows."""
        self.check_errors()
        self.check_num_sms(num_sms)
        self.ctx.wait_ns = self._profile_rows(kernel, num_sms)
        self._recent_calls.append([kernel, time.monotonic(), None])

    def progress_report(self) -> str:
        """Where this rank's last calls stand, for a stalled program's report: when its host launched
        each, whether the caller's stream had reached the call's start (the event the communication stream
        waits for), which kernels the device started and finished last, and whether the stream is idle.
        A call whose caller's stream was reached but whose kernel never started was held by the device."""
        now = time.monotonic()
        calls, recent = [], list(self._recent_calls)
        for i, (kind, launched, event) in enumerate(recent):
            if event is None:
                reached = "ordered inside the extension"
            elif event.query():
                reached = "its caller's stream had reached it"
            elif any(later[2] is event for later in recent[i + 1:]):  # a caller's event, recorded again since
                reached = "unknown whether its caller's stream had reached it"
            else:
                reached = "its caller's stream had NOT reached it"
            calls.append(f"{kind} {now - launched:.2f} s ago ({reached})")
        stream = "idle" if self.comm_stream.query() else "busy"
        return (f"rank {self.rank}: calls launched by the host, oldest first: {', '.join(calls) or 'none'}; device: "
                f"{kernel_progress(self._host)}; communication stream {stream}")

    # ---------------------------------------------------------------- wait profile
    def _profile_rows(self, kernel: str, num_blocks: int) -> int:
        """Device address of `kernel`'s wait-profile rows (one per block; notify's blocks use them too),
        or 0 when profiling is off."""
        if self._wait_rows is None:
            return 0
        rows = self._wait_rows.get(kernel)
        needed = max(num_blocks, self.num_ranks)
        if rows is None or rows.shape[0] < needed:
            with torch.cuda.stream(self.comm_stream):
                grown = torch.zeros(needed, self._wait_slots, dtype=torch.int64, device=self.peers.device)
                if rows is not None:
                    grown[: rows.shape[0]] += rows
            self._wait_rows[kernel] = rows = grown
        return rows.data_ptr()

    def wait_profile(self) -> dict:
        """{"dispatch" / "combine": {what was waited for: seconds, ..., "kernel": seconds, "blocks": n,
        "phases": {"stage" / "pull" / "push" / "reduce": seconds, waits included}}}, summed over blocks
        and calls since the last reset (empty when MOE_EP_PROFILE_WAITS is not 1)."""
        if not self._wait_rows:
            return {}
        self.comm_stream.synchronize()
        profile = {}
        for kernel, rows in self._wait_rows.items():
            totals = rows.sum(dim=0).tolist()
            profile[kernel] = {name: totals[kind] / 1e9 for kind, name in WAIT_NAMES.items() if totals[kind]}
            profile[kernel]["kernel"] = totals[-1] / 1e9
            profile[kernel]["blocks"] = int((rows[:, -1] > 0).sum())
            profile[kernel]["phases"] = {name: totals[slot] / 1e9 for slot, name in PHASE_NAMES.items() if totals[slot]}
        return profile

    def kernel_log(self) -> list:
        """[(KernelId, start ns, end ns)] of this rank's intranode kernels since the last reset, in the order
        they ended (one stream: the order they ran), %globaltimer times, which every rank on a GPU shares;
        empty when MOE_EP_PROFILE_WAITS is not 1. The log keeps its first kKernelLogEntries kernels."""
        if self._kernel_log is None:
            return []
        self.comm_stream.synchronize()
        log = self._kernel_log.tolist()
        count = min(log[0], (len(log) - 1) // 3)
        return [tuple(log[1 + 3 * i: 4 + 3 * i]) for i in range(count)]

    def reset_wait_profile(self) -> None:
        for rows in (self._wait_rows or {}).values():
            rows.zero_()
        if self._kernel_log is not None:
            self._kernel_log.zero_()

    # ---------------------------------------------------------------- streams and events
    def _enter(self, previous_event: Optional[EventOverlap]) -> torch.cuda.Stream:
        compute = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None:
            self._wait_before_call(previous_event.event)
        else:
            ready = self._compute_ready[self._compute_ready_next]
            self._compute_ready_next = (self._compute_ready_next + 1) % len(self._compute_ready)
            ready.record(compute)
            self._wait_before_call(ready)
        return compute

    def _wait_before_call(self, event: torch.cuda.Event) -> None:
        """The communication stream waits for `event` before this call's kernels; progress_report asks it
        whether the caller's stream got there."""
        self.comm_stream.wait_event(event)
        self._recent_calls[-1][2] = event

    def _leave(self, compute, async_finish: bool, allocate_on_comm_stream: bool, inputs, outputs) -> EventOverlap:
        inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
        outputs = [t for t in outputs if isinstance(t, torch.Tensor)]
        if async_finish:
            for t in inputs + outputs:
                t.record_stream(self.comm_stream)
            event = torch.cuda.Event()
            event.record(self.comm_stream)
            result = EventOverlap(event, inputs + outputs)
        else:
            self._comm_done.record(self.comm_stream)
            compute.wait_event(self._comm_done)
            result = EventOverlap()
        if allocate_on_comm_stream:
            for t in outputs:
                t.record_stream(compute)
        return result

    # ---------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x_parts: List[torch.Tensor],
        topk_idx: Optional[torch.Tensor],
        topk_weights: Optional[torch.Tensor],
        is_token_in_rank: Optional[torch.Tensor],
        num_tokens_per_expert: Optional[torch.Tensor],
        expert_alignment: int,
        num_worst_tokens: int,
        handle: Optional[DispatchHandle],
        make_handle: Callable[..., DispatchHandle],
        config: Config,
        previous_event: Optional[EventOverlap],
        async_finish: bool,
        allocate_on_comm_stream: bool,
        zero_copy: bool = False,
    ):
        """zero_copy: the senders store the rows into this rank's zero-copy dispatch area, and recv_x (and
        the scales) are views of its next slot. With a dispatch arena (MOE_EP_DISPATCH_ARENA=1) every
        dispatch stores them into a region of it that recv_x owns."""
        self._start_call("dispatch", config.num_sms)
        capturing = torch.cuda.is_current_stream_capturing()
        # A graph would replay into the region it was captured with, long after recv_x returned it.
        into_arena = self.arena is not None and not capturing
        if zero_copy and self.arena is not None and capturing:
            raise RuntimeError("dispatch: zero_copy=True cannot be captured in a CUDA graph while the Buffer's "
                               "zero-copy dispatch area is an arena (dispatch_arena, MOE_EP_DISPATCH_ARENA=1)")
        # MOE_EP_DISPATCH_VIA_ZERO_COPY: through a slot, then out of it; an arena already gives recv_x its place.
        copy_out = not zero_copy and self.via_zero_copy and not into_arena
        zero_copy = (zero_copy or copy_out) and not into_arena
        cached = handle is not None
        worst = handle.num_worst_tokens if cached else num_worst_tokens
        if capturing and not worst:
            raise RuntimeError(
                "dispatch: capturing it in a CUDA graph needs num_worst_tokens > 0 (a dispatch without it "
                "waits on the host for the received token counts)"
            )
        x = aligned(x_parts[0])
        scales = aligned(x_parts[1]) if len(x_parts) == 2 else None
        if not cached and topk_idx is not None:
            topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        num_topk = topk_idx.shape[1] if not cached and topk_idx is not None else 0
        slot = region = None
        if zero_copy:
            slot = zero_copy_dispatch_layout(self.zero_copy_dispatch_bytes, x, scales, num_topk)
            if worst > slot.capacity:  # before the count exchange: every rank finds the same
                raise ValueError(zero_copy_dispatch_too_small(self.rank, worst, x, scales, num_topk,
                                                              self.zero_copy_dispatch_bytes))
        local = num_tokens_per_expert.shape[0] // self.num_ranks if not cached else 0
        send_counts = recv_counts = per_expert = None
        recv_x = recv_scales = recv_idx = recv_weights = None
        slot_index = self._dispatch_next
        # A zero-copy dispatch without num_worst_tokens starts before the host learns how many rows
        # arrive (the kernel reads the count on the device): its side outputs are allocated for a full
        # slot and cut to the count afterwards, and the host's wait overlaps the kernel. Into an arena,
        # the call takes the largest free range, the kernel lays the rows out at its start, and the host
        # keeps what they need once it knows the count. An ordinary one needs the count for its
        # outputs: from the count exchange to the dispatch's launch in one call.
        fresh = not cached and not worst
        early = fresh and (slot is not None or into_arena)
        if fresh and not early:
            compute, state, recv_x, recv_scales, recv_idx, recv_weights, counts = self._dispatch_fresh(
                x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, local, config,
                previous_event, allocate_on_comm_stream)
            recv_counts, send_counts, per_expert = counts
            overflow = 0
        elif early:
            if into_arena:
                reserved = self.arena.reserve_largest()
                start, length = reserved or (0, 0)
                # The side outputs are allocated for the most rows the whole arena could hold, not the
                # reserved range: the same size every call, so the caching allocator reuses its blocks
                # (the range's length changes from call to call).
                most = zero_copy_dispatch_rows_within(self.arena.size, row_bytes(x), row_bytes(scales), num_topk)
                target = (start, most if reserved else 0, [0] * 5, length)
            else:
                target = (slot_index * slot.slot_bytes, slot.capacity, slot.offsets, -1)
                self._dispatch_next ^= 1
            try:
                compute, state, recv_idx, recv_weights = self._launch_zero_copy_early(
                    x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, local, target, config,
                    previous_event, allocate_on_comm_stream)
                send_counts, recv_counts, per_expert = self._wait_counts(local)
            except BaseException:
                if into_arena and reserved is not None:  # else the arena's largest range stays taken
                    self.arena.free(reserved[0])
                raise
            rows = sum(recv_counts)
            if into_arena:
                slot, region = self._arena_keep(reserved, rows, x, scales, num_topk)
            overflow = rows if rows > slot.capacity else 0
            bound = min(rows, slot.capacity)
            state.recv_src_idx = state.recv_src_idx[:bound]
            if recv_idx is not None:
                recv_idx, recv_weights = recv_idx[:bound], recv_weights[:bound]
        else:
            compute = self._enter(previous_event)
            if cached:
                state: IntranodeDispatchState = handle.backend_state
                rows = handle.num_recv_rows
            else:
                state = self._launch_notify(x, is_token_in_rank, num_tokens_per_expert)
                if worst:
                    rows = worst
                else:
                    send_counts, recv_counts, per_expert = self._wait_counts(local)
                    rows = sum(recv_counts)
            if into_arena:
                slot, region = self._arena_region(rows, x, scales, num_topk)
            # Rows the outputs are allocated for. More rows than a zero-copy slot holds: the kernel still
            # runs (the peers' kernels wait for this rank's) and drops the rows past it; a ValueError follows.
            bound = min(rows, slot.capacity) if slot is not None else rows
            overflow = rows if slot is not None and rows > slot.capacity else 0
            if not cached:
                with torch.cuda.stream(self.comm_stream):
                    state.recv_src_idx = torch.empty(bound, dtype=torch.int32, device=x.device)
            alloc = self.comm_stream if allocate_on_comm_stream else compute
            with torch.cuda.stream(alloc):
                if slot is None:
                    recv_x = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
                    recv_scales = None if scales is None else torch.empty((rows, scales.shape[1]), dtype=scales.dtype,
                                                                          device=x.device)
                if not cached and topk_idx is not None:
                    recv_idx = torch.empty((bound, topk_idx.shape[1]), dtype=torch.int64, device=x.device)
                    recv_weights = torch.empty((bound, topk_idx.shape[1]), dtype=torch.float32, device=x.device)
            with torch.cuda.stream(self.comm_stream):
                ids = (None, None) if cached else (topk_idx, topk_weights)
                if slot is None:
                    self.ops.intranode_dispatch(
                        self.ctx, config.num_sms, x, scales, *ids, local, state.send_pos, state.recv_info, recv_x,
                        recv_scales, recv_idx, recv_weights, state.recv_src_idx, cached,
                    )
                else:
                    # This rank's receiving layout: a slot (the same on every rank) or its own region.
                    start = slot_index * slot.slot_bytes if not into_arena else region.start if region else 0
                    self.ops.intranode_zero_copy_dispatch(
                        self.ctx, config.num_sms, x, scales, *ids, local, state.send_pos, state.recv_info, bound,
                        recv_idx, recv_weights, state.recv_src_idx, self.zero_copy_dispatch.pointers.data_ptr(),
                        start, slot.capacity, slot.offsets, -1, cached,
                    )
                    if not into_arena:
                        self._dispatch_next ^= 1
        if into_arena:
            recv_x = self._region_tensor(region, slot.x_offset, bound, x)
            recv_scales = None if scales is None else self._region_tensor(region, slot.scale_offset, bound, scales)
        elif slot is not None:
            recv_x = self._zero_copy_dispatch_view(slot, slot_index, slot.x_offset, bound, x)
            recv_scales = None if scales is None else self._zero_copy_dispatch_view(slot, slot_index, slot.scale_offset,
                                                                                    bound, scales)
        recv = [recv_x] if scales is None else [recv_x, recv_scales]
        if copy_out:
            with torch.cuda.stream(self.comm_stream if allocate_on_comm_stream else compute):
                owned = [torch.empty(view.shape, dtype=view.dtype, device=view.device) for view in recv]
            with torch.cuda.stream(self.comm_stream):  # after the kernel, before the call's event
                for out, view in zip(owned, recv):
                    out.copy_(view)
            recv = owned
        # A zero-copy slot is not the caching allocator's memory (no record_stream): the Buffer keeps it.
        event = self._leave(
            compute, async_finish, allocate_on_comm_stream,
            [x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert],
            (recv if (slot is None and not into_arena) or copy_out else []) + [recv_idx, recv_weights],
        )
        if overflow:
            self.comm_stream.synchronize()
            self._host[HOST_OVERFLOW] = 0  # reported here, not as a num_worst_tokens overflow
            if into_arena:
                raise ValueError(self._arena_full(overflow, x, scales, num_topk))
            raise ValueError(zero_copy_dispatch_too_small(self.rank, overflow, x, scales, num_topk,
                                                          self.zero_copy_dispatch_bytes))
        if cached:
            return recv, None, None, None, None, event
        counts_list = []
        if not worst:
            counts_list = per_expert if expert_alignment == 1 else \
                [-(-c // expert_alignment) * expert_alignment for c in per_expert]
        new_handle = make_handle(
            num_tokens=x.shape[0],
            is_token_in_rank=is_token_in_rank,
            send_counts=send_counts,
            recv_counts=recv_counts,
            num_worst_tokens=worst,
            backend_state=state,
        )
        return recv, recv_idx, recv_weights, counts_list, new_handle, event

    def _launch_notify(self, x, is_token_in_rank, num_tokens_per_expert) -> IntranodeDispatchState:
        """The count exchange of a fresh dispatch, on the communication stream (after _enter)."""
        with torch.cuda.stream(self.comm_stream):
            state = IntranodeDispatchState(
                send_pos=torch.empty(x.shape[0], self.num_ranks, dtype=torch.int32, device=x.device),
                recv_info=torch.empty(self.recv_info_ints, dtype=torch.int32, device=x.device),
                recv_src_idx=None,
            )
            self._nonce += 1
            self.ops.intranode_notify(self.ctx, is_token_in_rank.contiguous(), num_tokens_per_expert.contiguous(),
                                      state.send_pos, state.recv_info, self._nonce)
        return state

    def _begin_fresh_call(self, previous_event: Optional[EventOverlap]) -> bool:
        """What a fresh dispatch made in one extension call does first: the communication stream waits for
        previous_event if one is given, and the count exchange takes the next nonce. -> whether the
        extension must order the communication stream after the caller's stream instead."""
        order_after_caller = previous_event is None or previous_event.event is None
        if not order_after_caller:
            self._wait_before_call(previous_event.event)
        self._nonce += 1
        return order_after_caller

    def _dispatch_fresh(self, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                        local: int, config: Config, previous_event: Optional[EventOverlap],
                        allocate_on_comm_stream: bool):
        """A fresh ordinary dispatch without num_worst_tokens in one call into the extension (the 2-rank
        call is bound by its host path): the stream order, the count exchange, the wait for the counts,
        the outputs and the dispatch. -> (the caller's stream, state, recv_x, recv_scales, recv_idx,
        recv_weights, (recv_counts, send_counts, per_expert_counts))"""
        order_after_caller = self._begin_fresh_call(previous_event)
        done = self.ops.intranode_dispatch_fresh(
            self.ctx, config.num_sms, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, local,
            self._nonce, self.recv_info_ints, self.comm_stream.cuda_stream, order_after_caller, allocate_on_comm_stream,
            HOST_DONE, HOST_COUNTS, self.timeout_s + _HOST_GRACE_S,
        )
        if done is None:
            self._count_exchange_timed_out()
        send_pos, recv_info, recv_src_idx, recv_x, recv_scales, recv_idx, recv_weights, *counts = done
        state = IntranodeDispatchState(send_pos, recv_info, recv_src_idx)
        return torch.cuda.current_stream(), state, recv_x, recv_scales, recv_idx, recv_weights, counts

    def _launch_zero_copy_early(self, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                                local: int, target: tuple, config: Config, previous_event: Optional[EventOverlap],
                                allocate_on_comm_stream: bool):
        """A fresh zero-copy dispatch up to its launch in one call into the extension (the 2-rank call is
        bound by its host path): the stream order, the state, the side outputs for the most rows the
        target holds, the count exchange and the dispatch. target: (offset in the area, capacity rows,
        part offsets, region bytes), a slot's (region bytes -1) or an arena range's that the kernel lays
        out. -> (the caller's stream, state, recv_idx, recv_weights)."""
        order_after_caller = self._begin_fresh_call(previous_event)
        send_pos, recv_info, recv_src_idx, recv_idx, recv_weights = self.ops.intranode_zero_copy_dispatch_early(
            self.ctx, config.num_sms, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, local,
            self._nonce, self.recv_info_ints, self.comm_stream.cuda_stream, order_after_caller, allocate_on_comm_stream,
            self.zero_copy_dispatch.pointers.data_ptr(), *target,
        )
        return torch.cuda.current_stream(), IntranodeDispatchState(send_pos, recv_info, recv_src_idx), recv_idx, recv_weights

    def _wait_counts(self, local: int):
        """The count exchange's result, read from host-mapped memory once the notify kernel is done."""
        if not self.ops.wait_host_value(self.host_info, HOST_DONE, self._nonce, self.timeout_s + _HOST_GRACE_S):
            self._count_exchange_timed_out()
        h, r = self._host, self.num_ranks
        # Slices of the ctypes array: one C-level copy each (indexing per element cost ~13 us a call
        # with 128 local experts).
        recv_counts = h[HOST_COUNTS: HOST_COUNTS + r]
        send_counts = h[HOST_COUNTS + r: HOST_COUNTS + 2 * r]
        per_expert = h[HOST_COUNTS + 2 * r: HOST_COUNTS + 2 * r + local]
        return send_counts, recv_counts, per_expert

    def _count_exchange_timed_out(self):
        """Raises what the kernels reported (a missing peer, named), else a TimeoutError of the host's wait.
        An earlier kernel on the communication stream that still waits for a peer reports it at its own
        deadline, which can come after the host's (its wait may have begun later): the host gives it that
        long before it raises without a name."""
        self.ops.wait_host_value(self.host_info, HOST_ERROR, 1, self.timeout_s)
        self.check_errors()
        stream = "idle (its work all done)" if self.comm_stream.query() else "still busy"
        raise TimeoutError(
            f"moe_ep: the dispatch count exchange did not finish within {self.timeout_s + _HOST_GRACE_S:g} s "
            f"on rank {self.rank}, and no kernel of this Buffer reported a missing peer in {self.timeout_s:g} s "
            "more: the communication stream did not reach it (a kernel or an event it waits for never ended). "
            f"Rank {self.rank}: {kernel_progress(self._host)}; count exchange {self._nonce} awaited, "
            f"{self._host[HOST_DONE]} the last finished; communication stream {stream}"
        )

    # ---------------------------------------------------------------- dispatch arena
    def _arena_region(self, rows: int, x: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int):
        """(layout, region) for `rows` received rows; with no room in the arena, a layout of no rows and
        no region: the kernel still runs (the peers' kernels wait for this rank's) and drops the rows."""
        layout = zero_copy_dispatch_region(rows, row_bytes(x), row_bytes(scales), num_topk)
        start = self.arena.alloc(layout.slot_bytes)
        if start is None:
            return self._no_rows(x, scales, num_topk)
        return layout, self._region(start, layout.slot_bytes)

    def _arena_keep(self, reserved, rows: int, x: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int):
        """(layout, region) of `rows` at the start of the range a call reserved (None: the arena had no
        free byte), whose rest goes back; if they do not fit (the kernel, with the same formula, kept
        none), a layout of no rows and no region."""
        layout = zero_copy_dispatch_region(rows, row_bytes(x), row_bytes(scales), num_topk)
        if reserved is None or layout.slot_bytes > reserved[1]:
            if reserved is not None:
                self.arena.free(reserved[0])
            return self._no_rows(x, scales, num_topk)
        self.arena.shrink(reserved[0], layout.slot_bytes)
        return layout, self._region(reserved[0], layout.slot_bytes)

    @staticmethod
    def _no_rows(x: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int):
        """(layout, region) of a dispatch that found no room: a layout of no rows, no region."""
        return zero_copy_dispatch_region(0, row_bytes(x), row_bytes(scales), num_topk), None

    def _region(self, start: int, nbytes: int) -> Region:
        return Region(self.arena, start, nbytes, self.zero_copy_dispatch.addresses[self.rank],
                      self.zero_copy_dispatch.device, keep=self.zero_copy_dispatch)

    @staticmethod
    def _region_tensor(region: Optional[Region], offset: int, rows: int, like: torch.Tensor) -> torch.Tensor:
        if region is None:  # no room: no rows (a ValueError follows)
            return torch.empty((0, like.shape[1]), dtype=like.dtype, device=like.device)
        return region.tensor(offset, rows, like.shape[1], like.dtype)

    def _arena_full(self, rows: int, x: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int) -> str:
        needed = zero_copy_dispatch_region(rows, row_bytes(x), row_bytes(scales), num_topk).slot_bytes
        if needed > self.arena.size:
            why = f"more than the whole arena ({self.arena.size} bytes)"
        else:
            why = (f"{self.arena.free_bytes} of its {self.arena.size} are free, the rest held by "
                   f"{self.arena.used_regions} live recv_x tensors of earlier dispatches (drop them sooner)")
        return (
            f"num_zero_copy_dispatch_bytes: rank {self.rank} receives {rows} rows, which need {needed} bytes of "
            f"the dispatch arena (Buffer's dispatch_arena, MOE_EP_DISPATCH_ARENA=1): {why}. Or create the Buffer "
            "with a larger area (config.zero_copy_dispatch_bytes sizes it)."
        )

    # ---------------------------------------------------------------- zero-copy dispatch
    def _zero_copy_dispatch_view(self, slot: ZeroCopyDispatchSlot, index: int, offset: int, rows: int,
                                 like: torch.Tensor) -> torch.Tensor:
        """[rows, like's columns] of like's dtype at `offset` of this rank's zero-copy dispatch slot `index`."""
        key = (index, slot.slot_bytes)
        base = self._dispatch_slot_bytes.get(key)
        if base is None:  # kept: a view of mapped memory costs host time, slicing it little
            address = self.zero_copy_dispatch.addresses[self.rank] + index * slot.slot_bytes
            base = self._dispatch_slot_bytes[key] = device_view(address, slot.slot_bytes, self.zero_copy_dispatch.device)
        width = like.shape[1] * like.element_size()
        return base[offset: offset + rows * width].view(like.dtype).view(rows, like.shape[1])

    # ---------------------------------------------------------------- zero-copy combine
    def zero_copy_view(self, num_rows: int, hidden: int, dtype: torch.dtype, slot: int) -> torch.Tensor:
        """Slot `slot` of this rank's zero-copy area as [num_rows, hidden] rows `pitch` bytes apart."""
        if self.zero_copy is None:
            raise ValueError(
                "get_next_combine_buffer: this Buffer has no zero-copy combine area; pass "
                "num_zero_copy_combine_bytes (the same on every rank) when creating it"
            )
        element = dtype.itemsize
        slot_bytes, pitch, capacity = zero_copy_combine_slot(self.zero_copy_bytes, hidden * element)
        if num_rows > capacity:
            raise ValueError(
                f"num_zero_copy_combine_bytes: {num_rows} received rows of hidden {hidden} need "
                f"{2 * num_rows * pitch} bytes (two slots; config.zero_copy_combine_bytes), the Buffer has "
                f"{self.zero_copy_bytes}"
            )
        key = (num_rows, hidden, dtype, slot)
        if key not in self._zero_copy_views:  # kept: a view costs host time, and shapes repeat
            address = self.zero_copy.addresses[self.rank] + slot * slot_bytes
            base = device_view(address, slot_bytes, self.zero_copy.device)
            if len(self._zero_copy_views) > 64:
                self._zero_copy_views.clear()
            self._zero_copy_views[key] = base.view(dtype).as_strided((num_rows, hidden), (pitch // element, 1))
        return self._zero_copy_views[key]

    # ---------------------------------------------------------------- combine from the dispatch arena
    def combines_from_arena(self, x: torch.Tensor) -> bool:
        """Whether a plain combine of x reads the rows from the ranks' dispatch arenas (one pass): with an
        arena, for rows of whole 16-byte vectors (the same on every rank: same hidden, same dtype), and not
        in a CUDA graph (whose replays would reuse regions the call gave back), as the dispatch."""
        return self.arena is not None and row_bytes(x) % 16 == 0 and not torch.cuda.is_current_stream_capturing()

    def arena_tensor(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, hidden] of dtype in this rank's dispatch arena, owning its region like recv_x."""
        tensor = self._arena_tensor_or_none(rows, hidden, dtype)
        if tensor is None:
            raise ValueError(self._arena_no_room(f"a combine input of {rows} rows", rows * hidden * dtype.itemsize))
        return tensor

    def _arena_tensor_or_none(self, rows: int, columns: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        nbytes = rows * columns * dtype.itemsize
        start = self.arena.alloc(nbytes)
        return None if start is None else self._region(start, nbytes).tensor(0, rows, columns, dtype)

    def _arena_combine_rows(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor]):
        """(x, (bytes from this rank's dispatch area to x's rows, their pitch, their count or -1 if there
        was no room, bytes to room for the weights), tensors to keep until the kernel is done). x outside
        the arena is copied into a region first (a pass over its bytes: empty_combine_input spares it)."""
        rows, base = x.shape[0], self.zero_copy_dispatch.addresses[self.rank]
        pitch = x.stride(0) * x.element_size() if x.dim() == 2 and x.stride(1) == 1 else -1
        at = x.data_ptr() - base
        inside = pitch >= row_bytes(x) and pitch % 16 == 0 and at % 16 == 0 and \
            0 <= at and at + max(rows - 1, 0) * pitch + row_bytes(x) <= self.arena.size
        kept = []
        if rows == 0:
            return x, (0, row_bytes(x), 0, 0), kept
        if not inside:
            copy = self._arena_tensor_or_none(rows, x.shape[1], x.dtype)
            if copy is None:
                return x.contiguous(), (0, row_bytes(x), -1, 0), kept
            copy.copy_(x)
            x, at, pitch = copy, copy.data_ptr() - base, row_bytes(x)
            kept.append(copy)
        weights_at = 0
        if topk_weights is not None:
            weights = self._arena_tensor_or_none(rows, topk_weights.shape[1], torch.float32)
            if weights is None:
                return x, (0, pitch, -1, 0), kept
            weights_at = weights.data_ptr() - base
            kept.append(weights)
        return x, (at, pitch, rows, weights_at), kept

    def _arena_combine_full(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> str:
        needed = x.shape[0] * (row_bytes(x) + row_bytes(topk_weights))
        return (self._arena_no_room(f"a combine of {x.shape[0]} rows (x's copy, where x lies outside the arena, "
                                    "and the weights)", needed)
                + " Its rows were left out of every rank's output of this combine (the others raise at the end "
                "of this combine or their next). Write x into Buffer.empty_combine_input to spare the copy.")

    def _arena_no_room(self, what: str, needed: int) -> str:
        return (f"num_zero_copy_dispatch_bytes: rank {self.rank}'s dispatch arena has no room for {what}, "
                f"{needed} bytes: {self.arena.free_bytes} of its {self.arena.size} are free, the rest held by "
                f"{self.arena.used_regions} live tensors over it (recv_x, combine inputs).")

    # ---------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor],
        biases: List[torch.Tensor],
        config: Config,
        previous_event: Optional[EventOverlap],
        async_finish: bool,
        allocate_on_comm_stream: bool,
        zero_copy_slot: Optional[int] = None,
    ):
        """zero_copy_slot: None, or the slot of zero_copy_view that x is (its rows stay where they lie).
        With a dispatch arena, a combine of rows of whole 16-byte vectors reads them from the arenas
        (combines_from_arena)."""
        self._start_call("combine", config.num_sms)
        state: IntranodeDispatchState = handle.backend_state
        from_arena = zero_copy_slot is None and self.combines_from_arena(x)
        x = aligned(x) if zero_copy_slot is None and not from_arena else x
        topk_weights = None if topk_weights is None else topk_weights.contiguous()
        biases = [aligned(b) for b in biases] + [None] * (2 - len(biases))
        compute = self._enter(previous_event)
        with torch.cuda.stream(self.comm_stream if allocate_on_comm_stream else compute):
            out = torch.empty((handle.num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
            out_weights = None
            if topk_weights is not None:
                out_weights = torch.empty((handle.num_tokens, topk_weights.shape[1]), dtype=torch.float32, device=x.device)
        with torch.cuda.stream(self.comm_stream):
            if from_arena:  # x itself, or its copy into the arena (on this stream)
                given = x
                x, where, kept = self._arena_combine_rows(x, topk_weights)
            args = (self.ctx, config.num_sms, x, topk_weights, state.recv_src_idx, state.recv_info, state.send_pos,
                    biases[0], biases[1], out, out_weights)
            if from_arena:
                self.ops.intranode_zero_copy_combine(*args, self.zero_copy_dispatch.pointers.data_ptr(), *where)
            elif zero_copy_slot is None:
                self.ops.intranode_combine(*args, config.num_max_nvl_chunked_send_tokens)
            else:
                slot_bytes, pitch, capacity = zero_copy_combine_slot(self.zero_copy_bytes, x.shape[1] * x.element_size())
                self.ops.intranode_zero_copy_combine(
                    *args, self.zero_copy.pointers.data_ptr(), zero_copy_slot * slot_bytes, pitch, capacity, -1
                )
        # The zero-copy view is not the caching allocator's memory (record_stream skips it): the Buffer
        # keeps it. Arena tensors neither: an async call's event holds them (their regions go back to the
        # arena after the kernel, which ends once every peer has read them); otherwise the current stream
        # waits for the kernel before anything can reuse them.
        inputs = [x, topk_weights, *biases] if zero_copy_slot is None else [topk_weights, *biases]
        if from_arena:  # and the caller's x where it was copied: the copy reads it on this stream
            inputs += kept + ([given] if given is not x else [])
        event = self._leave(compute, async_finish, allocate_on_comm_stream, inputs, [out, out_weights])
        if from_arena and where[2] < 0:
            raise ValueError(self._arena_combine_full(x, topk_weights))
        self._report_missing_rows()
        return out, out_weights, event

    def _report_missing_rows(self) -> None:
        """ValueError if a combine from the arena (this one, if its kernel already ran, or an earlier one)
        lacked a peer's rows, which that peer had no room for. Raised once this call's kernel is queued,
        so that every rank ran the same kernels: the Buffer stays in step."""
        h = self._host
        if h[HOST_COMBINE_MISSING]:
            missing, h[HOST_COMBINE_MISSING] = h[HOST_COMBINE_MISSING] - 1, 0
            raise ValueError(
                f"num_zero_copy_dispatch_bytes: rank {missing} had no room in its dispatch arena for its rows of a "
                f"combine (this one or an earlier one), whose output on rank {self.rank} left them out (rank "
                f"{missing} raised at that call)."
            )
