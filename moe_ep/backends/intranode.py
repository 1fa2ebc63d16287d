"""The intranode backend: CUDA kernels over peers' buffers mapped with CUDA IPC (csrc/kernels/intranode/).

Used for CUDA tensors when every rank of the group is on this host (also several ranks on one GPU).
It keeps the portable backend's results bit for bit; the Buffer has checked every argument before a
call gets here. Kernels run on a dedicated communication stream with deep_ep's event semantics.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..arena import Arena, Region
from ..config import (
    INTRANODE_SLOT_ALIGN, Config, arena_dispatch_region, arena_dispatch_rows_within,
)
from .base import Backend, CombineCall, DispatchCall
from .choices import kernel_choices
from ..events import EventOverlap
from ..handles import DispatchHandle
from ..mps import process_sm_share
from ..profiling import Profile
from ..sync import ArrivalGate
from .peers import (
    PHASE_NAMES, WAIT_NAMES, MappedBuffers, aligned, kernel_progress, map_peer_buffers,
)

# Host-side grace on top of the kernels' own deadline before the host gives up on a count exchange.
_HOST_GRACE_S = 5.0
# How many of its last calls a backend's progress_report lists.
RECENT_CALLS = 4

# The streaming combine (per-channel rings, sending and receiving blocks at once) beat the windowed one
# from 4 ranks up and lost at 2, on one GPU and on two (`moe-ep-bench intranode --stream-combine`).
STREAM_COMBINE_MIN_RANKS = 4
# Copying a combine's x into the arena to sum it in one pass paid from 4 ranks up and lost at 2 on one
# H200 (`moe-ep-bench intranode --modes combine`): below, only an x already in the arena goes one pass.
COPY_INTO_ARENA_MIN_RANKS = 4
# An arena the Buffer sizes itself grows to room for this many regions of the largest need seen: a
# dispatch's recv_x, a cached dispatch's, a combine's input and its weights.
ARENA_GROWTH_CALLS = 4


def row_bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.shape[1] * t.element_size()


def _every_ranks(gate: ArrivalGate, phase: str, value: int) -> List[int]:
    """Every rank's non-negative int, in rank order (a bounded all-gather through the arrival gate)."""
    return [int.from_bytes(p, "little") for p in gate.exchange(phase, value.to_bytes(8, "little"))]


def rendezvous_first(max_ranks_on_device: int) -> bool:
    """Whether the combines and the cached dispatches start behind a one-block rendezvous kernel, so
    that their blocks take SMs only once every rank reached the call: where any GPU holds several of the
    group's ranks (else a rank's waiting grid can keep a peer's expert GEMMs from the SMs they need,
    which stalled eight ranks on one H200 until the deadline: DESIGN.md, "Ranks sharing a GPU")."""
    return max_ranks_on_device > 1 and kernel_choices.rendezvous


def use_stream_combine(num_ranks: int) -> bool:
    """Whether the intranode combine streams (the kernels fall back to windows past 32 ranks either way)."""
    if kernel_choices.stream_combine is not None:
        return kernel_choices.stream_combine
    return num_ranks >= STREAM_COMBINE_MIN_RANKS


@dataclass
class IntranodeDispatchState:
    """Device-side layout a kernel dispatch leaves for its combine and cached dispatches."""

    send_pos: torch.Tensor  # [N, R] int32: row of each token among those sent to rank r, -1 if not sent
    recv_info: torch.Tensor  # int32: [max tokens, total rows, base row per source (R + 1), tokens per source]
    recv_src_idx: torch.Tensor  # [rows] int32: source token index of each received row (-1: padding)


class IntranodeBackend(Backend):
    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_nvl_bytes: int, comm_stream: torch.cuda.Stream,
                 arena_bytes: int = 0, arena_grows: bool = False):
        """arena_bytes: the arena's size (0: none); arena_grows: it grows when a dispatch finds no room."""
        self.peers = map_peer_buffers(group, gate, num_nvl_bytes, "dispatch", kernel_choices.peer_memory)
        self.memory = self.peers.memory  # the arena is mapped the same way
        self.ops = self.peers.ops
        self.enums = self.peers.enums  # the host record's slots, among others, as the kernels number them
        self.rank, self.num_ranks = self.peers.rank, self.peers.num_ranks
        self.num_nvl_bytes = num_nvl_bytes
        self.timeout_s = gate.timeout_s
        self.host_info, self._host = self.peers.host_info, self.peers.host
        layout = self.ops.intranode_layout(self.num_ranks, num_nvl_bytes, 0, 0, 0)
        self.recv_info_ints = layout["recv_info_ints"]
        self.prefix_matrix_at = layout["recv_info_prefix_matrix"]  # where recv_info holds rank_prefix_matrix
        self.ctx = self.ops.IntranodeCtx(
            self.peers.pointers.data_ptr(), self.rank, self.num_ranks, num_nvl_bytes, self.host_info, self.timeout_s,
            self.peers.ranks_on_device,
        )
        self.ctx.stream_combine = use_stream_combine(self.num_ranks)
        self.ctx.fit_ranks_on_device = self.peers.max_ranks_on_device if kernel_choices.fit_blocks else 0
        self.ctx.rendezvous = rendezvous_first(self.peers.max_ranks_on_device)
        self.ctx.sm_share_percent = process_sm_share()
        # The arena: a second mapped area, of which every dispatch takes a region for its received rows
        # (the senders store them there once, at their final place, and recv_x owns the region), and
        # from which every combine reads the expert outputs where they lie.
        self.arena_area: Optional[MappedBuffers] = None
        self.arena: Optional[Arena] = None
        self.arena_grows = arena_grows
        self._group, self._gate = group, gate
        # A call with an arena queues its one-pass kernel, which chooses the path from every rank's room
        # (1: it ran), and the two-pass kernel, which runs where it chose 0.
        self._choice = torch.zeros(1, dtype=torch.int32, device=self.peers.device)
        # Calls the device ran in one pass, [dispatches, combines]: the one-pass kernels add to it where the
        # ranks chose that path, so counting costs no host synchronisation (Buffer.stats reads it).
        self.one_pass_calls = torch.zeros(2, dtype=torch.int32, device=self.peers.device)
        self._one_pass_dispatches, self._one_pass_combines = self.one_pass_calls[0:1], self.one_pass_calls[1:2]
        if arena_bytes > 0:
            sizes = _every_ranks(gate, "dispatch (arena sizes)", arena_bytes)
            if len(set(sizes)) != 1:  # all ranks of a call must run the same kernel
                raise ValueError(f"num_arena_bytes: expected the same value on every rank, got {sizes}")
            self.arena_area = map_peer_buffers(group, gate, arena_bytes, "dispatch (arena)", self.memory)
            self.arena = Arena(arena_bytes, INTRANODE_SLOT_ALIGN)
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
        # With kernel_choices.profile_waits the kernels add up, per block, the time they wait on peers (by
        # what they wait for) and their whole time; wait_profile() reads it. For benchmarks: it costs two
        # clock reads per wait.
        self._wait_rows = {} if kernel_choices.profile_waits else None
        self._wait_slots = layout["wait_slots"]
        # With the wait profile, every kernel's last block also logs (KernelId, start, end): kernel_log().
        self._kernel_log = None
        if self._wait_rows is not None:
            self._kernel_log = torch.zeros(layout["kernel_log_ints"], dtype=torch.int64, device=self.peers.device)
            self.ctx.kernel_log = self._kernel_log.data_ptr()

    def close(self) -> None:
        self.peers.close()
        if self.arena_area is None:
            return
        if self.arena.used_regions:
            # recv_x tensors of the arena still live, and own their memory: the area goes when the last
            # of them does (their regions hold it). The peers unmap theirs now.
            dist.barrier(group=self.arena_area.group)
            return
        self.arena_area.close()

    # ---------------------------------------------------------------- errors the kernels reported
    def check_errors(self) -> None:
        """Raises what an earlier kernel reported: a peer that did not arrive (the Buffer is then out of
        step and unusable), or a num_worst_tokens dispatch that received more rows than it had."""
        h, slot = self._host, self.enums.host_info
        if h[slot.OVERFLOW]:
            received, h[slot.OVERFLOW] = h[slot.OVERFLOW], 0
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
                f"{kernel_progress(self._host, self.enums)}; communication stream {stream}")

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
        and calls since the last reset (empty unless kernel_choices.profile_waits)."""
        if not self._wait_rows:
            return {}
        self.comm_stream.synchronize()
        profile = {}
        kinds, phases = self.enums.error_kind, self.enums.profile_phase
        for kernel, rows in self._wait_rows.items():
            totals = rows.sum(dim=0).tolist()
            waits = {name: totals[getattr(kinds, kind)] for kind, name in WAIT_NAMES.items()}
            profile[kernel] = {name: ns / 1e9 for name, ns in waits.items() if ns}
            profile[kernel]["kernel"] = totals[-1] / 1e9
            profile[kernel]["blocks"] = int((rows[:, -1] > 0).sum())
            spans = {name: totals[getattr(phases, phase)] for phase, name in PHASE_NAMES.items()}
            profile[kernel]["phases"] = {name: ns / 1e9 for name, ns in spans.items() if ns}
        return profile

    def kernel_log(self) -> list:
        """[(KernelId, start ns, end ns)] of this rank's intranode kernels since the last reset, in the order
        they ended (one stream: the order they ran), %globaltimer times, which every rank on a GPU shares;
        empty unless kernel_choices.profile_waits. The log keeps its first kKernelLogEntries kernels."""
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
    def dispatch(self, call: DispatchCall):
        return self._dispatch(call.x_parts, call.topk_idx, call.topk_weights, call.is_token_in_rank,
                              call.num_tokens_per_rank, call.num_tokens_per_expert, call.expert_alignment,
                              call.num_worst_tokens, call.handle,
                              call.make_handle, call.config, call.previous_event, call.async_finish,
                              call.allocate_on_comm_stream, call.profile)

    def combine(self, call: CombineCall):
        return self._combine(call.x, call.handle, call.topk_weights, call.biases, call.config, call.previous_event,
                             call.async_finish, call.allocate_on_comm_stream)

    def combine_input(self, handle: DispatchHandle, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """With an arena, a region of it (the combine then reads the rows where they lie); not in a CUDA graph,
        whose replays would write a region given back long before (as the dispatch)."""
        in_graph = torch.cuda.is_current_stream_capturing()
        tensor = None if self.arena is None or in_graph else \
            self._arena_tensor_or_none(handle.num_recv_rows, hidden, dtype)
        # Without room, an ordinary tensor: the combine then copies it into the arena or takes two passes.
        return super().combine_input(handle, hidden, dtype) if tensor is None else tensor

    def _dispatch(
        self,
        x_parts: List[torch.Tensor],
        topk_idx: Optional[torch.Tensor],
        topk_weights: Optional[torch.Tensor],
        is_token_in_rank: Optional[torch.Tensor],
        num_tokens_per_rank: Optional[torch.Tensor],
        num_tokens_per_expert: Optional[torch.Tensor],
        expert_alignment: int,
        num_worst_tokens: int,
        handle: Optional[DispatchHandle],
        make_handle: Callable[..., DispatchHandle],
        config: Config,
        previous_event: Optional[EventOverlap],
        async_finish: bool,
        allocate_on_comm_stream: bool,
        profile: Optional[Profile] = None,
    ):
        """With an arena, the senders store every row once into a region of it that recv_x owns (one
        pass) when every rank has room for its rows; otherwise the rows pass through the windows of the
        Buffer's buffer (two passes). The one-pass kernel chooses on the device from every rank's
        announcement of its room, the same on every rank, so the choice costs no host round trip."""
        self._start_call("dispatch", config.num_sms)
        capturing = torch.cuda.is_current_stream_capturing()
        # A graph would replay into the region it was captured with, long after recv_x returned it.
        into_arena = self.arena is not None and not capturing
        cached = handle is not None
        worst = handle.num_worst_tokens if cached else num_worst_tokens
        x = aligned(x_parts[0])
        scales = aligned(x_parts[1]) if len(x_parts) == 2 else None
        if not cached and topk_idx is not None:
            topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        num_topk = topk_idx.shape[1] if not cached and topk_idx is not None else 0
        local = num_tokens_per_expert.shape[0] // self.num_ranks if not cached else 0
        send_counts = recv_counts = per_expert = None
        region = None  # the arena region recv_x lies in, where it has one
        fresh = not cached and not worst
        if fresh and not into_arena:
            # The two-pass kernel needs the count for its outputs: from the count exchange to the
            # dispatch's launch in one call.
            mark = profile.start() if profile is not None else None  # on the host: it waits for the counts
            compute, state, recv_x, recv_scales, recv_idx, recv_weights, counts = self._dispatch_fresh(
                x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                local, config, previous_event, allocate_on_comm_stream)
            if profile is not None:
                profile.stop("count exchange", mark)
            recv_counts, send_counts, per_expert = counts
        elif fresh:
            # Into the arena the kernel starts before the host learns how many rows arrive: it lays them
            # out at the start of the arena's largest free range from the count it reads on the device,
            # where every rank has room (the kernel finds out from their announcements), and the host keeps what they
            # need once it knows the count (its wait overlaps the kernel). Where some rank has no room
            # the kernel returns at once, and the two-pass kernel runs behind it.
            reserved = self.arena.reserve_largest()
            start, length = reserved or (0, 0)
            # The side outputs are allocated for the most rows the whole arena could hold, not the
            # reserved range: the same size every call, so the caching allocator reuses its blocks.
            most = arena_dispatch_rows_within(self.arena.size, row_bytes(x), row_bytes(scales), num_topk)
            target = (start, most if reserved else 0, [0] * 5, length)
            try:
                mark = profile.start() if profile is not None else None  # on the host: it waits for the counts
                compute, state, recv_idx, recv_weights = self._launch_arena_early(
                    x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                    local, target, config, previous_event, allocate_on_comm_stream)
                send_counts, recv_counts, per_expert, one_pass = self._wait_choice(local)
                if profile is not None:
                    profile.stop("count exchange", mark)
            except BaseException:
                if reserved is not None:  # else the arena's largest range stays taken
                    self.arena.free(reserved[0])
                raise
            rows = sum(recv_counts)
            if one_pass:
                layout, region = self._arena_keep(reserved, rows, x, scales, num_topk)
                recv_x = self._region_tensor(region, layout.x_offset, rows, x)
                recv_scales = None if scales is None else self._region_tensor(region, layout.scale_offset, rows, scales)
                state.recv_src_idx = state.recv_src_idx[:rows]
                if recv_idx is not None:
                    recv_idx, recv_weights = recv_idx[:rows], recv_weights[:rows]
            else:
                if reserved is not None:
                    self.arena.free(reserved[0])
                recv_x, recv_scales, recv_idx, recv_weights = self._two_pass_outputs(
                    state, rows, x, scales, topk_idx, compute, allocate_on_comm_stream, cached=False)
                self._launch_dispatch(config, x, scales, topk_idx, topk_weights, local, state, recv_x, recv_scales,
                                      recv_idx, recv_weights, cached=False)
                self._grow_arena(arena_dispatch_region(rows, row_bytes(x), row_bytes(scales), num_topk).slot_bytes)
        else:
            compute = self._enter(previous_event)
            if cached:
                state: IntranodeDispatchState = handle.backend_state
                rows = handle.num_recv_rows
            else:
                state = self._launch_notify(x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert)
                rows = worst
            layout = None
            if into_arena:
                # Rows the host knows before the call: a region of exactly those, where there is room;
                # both kernels are queued and the one-pass kernel picks, so nothing waits on the host.
                layout = arena_dispatch_region(rows, row_bytes(x), row_bytes(scales), num_topk)
                start = self.arena.alloc(layout.slot_bytes)
                region = None if start is None else self._region(start, layout.slot_bytes)
            recv_x, recv_scales, recv_idx, recv_weights = self._two_pass_outputs(
                state, rows, x, scales, topk_idx, compute, allocate_on_comm_stream, cached, region, layout)
            if into_arena:
                with torch.cuda.stream(self.comm_stream):
                    ids = (None, None) if cached else (topk_idx, topk_weights)
                    self.ops.intranode_zero_copy_dispatch(
                        self.ctx, config.num_sms, x, scales, *ids, local, state.send_pos, state.recv_info,
                        layout.capacity if region else 0, recv_idx, recv_weights, state.recv_src_idx,
                        self.arena_area.pointers.data_ptr(), region.start if region else 0,
                        layout.capacity if region else -1, layout.offsets, -1, cached, self._choice,
                        self._one_pass_dispatches, 0,
                    )
            self._launch_dispatch(config, x, scales, topk_idx, topk_weights, local, state, recv_x, recv_scales, recv_idx,
                                  recv_weights, cached, choice=self._choice if into_arena else None)
        recv = [recv_x] if scales is None else [recv_x, recv_scales]
        # Arena tensors are not the caching allocator's memory (no record_stream): their regions hold it.
        event = self._leave(
            compute, async_finish, allocate_on_comm_stream,
            [x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert],
            ([] if region is not None else recv) + [recv_idx, recv_weights],
        )
        if cached:
            return recv, None, None, None, None, event
        counts_list = []
        if not worst:
            counts_list = per_expert if expert_alignment == 1 else \
                [-(-c // expert_alignment) * expert_alignment for c in per_expert]
        r = self.num_ranks
        new_handle = make_handle(
            num_tokens=x.shape[0],
            is_token_in_rank=is_token_in_rank,
            send_counts=send_counts,
            recv_counts=recv_counts,
            num_worst_tokens=worst,
            rank_prefix_matrix=state.recv_info[self.prefix_matrix_at: self.prefix_matrix_at + r * r].view(r, r),
            recv_src_idx=state.recv_src_idx,
            backend_state=state,
            _send_pos=state.send_pos,
            recv_expert_counts=None if worst else per_expert,  # the host's, where it waited for them
        )
        return recv, recv_idx, recv_weights, counts_list, new_handle, event

    def _two_pass_outputs(self, state, rows: int, x, scales, topk_idx, compute, allocate_on_comm_stream: bool,
                          cached: bool, region: Optional[Region] = None, layout=None):
        """recv_x and recv_scales (in `region` where one was taken), the received top-k and, for a fresh
        dispatch, the handle's source indices, for `rows` rows."""
        recv_idx = recv_weights = None
        if not cached:
            with torch.cuda.stream(self.comm_stream):
                state.recv_src_idx = torch.empty(rows, dtype=torch.int32, device=x.device)
        with torch.cuda.stream(self.comm_stream if allocate_on_comm_stream else compute):
            if region is not None:
                recv_x = self._region_tensor(region, layout.x_offset, rows, x)
                recv_scales = None if scales is None else self._region_tensor(region, layout.scale_offset, rows, scales)
            else:
                recv_x = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
                recv_scales = None if scales is None else torch.empty((rows, scales.shape[1]), dtype=scales.dtype,
                                                                      device=x.device)
            if not cached and topk_idx is not None:
                recv_idx = torch.empty((rows, topk_idx.shape[1]), dtype=torch.int64, device=x.device)
                recv_weights = torch.empty((rows, topk_idx.shape[1]), dtype=torch.float32, device=x.device)
        return recv_x, recv_scales, recv_idx, recv_weights

    def _launch_dispatch(self, config: Config, x, scales, topk_idx, topk_weights, local: int, state, recv_x, recv_scales,
                         recv_idx, recv_weights, cached: bool, choice: Optional[torch.Tensor] = None) -> None:
        """The two-pass dispatch kernel on the communication stream; with `choice`, it returns at once
        where the one-pass kernel queued before it ran."""
        with torch.cuda.stream(self.comm_stream):
            ids = (None, None) if cached else (topk_idx, topk_weights)
            self.ops.intranode_dispatch(
                self.ctx, config.num_sms, x, scales, *ids, local, state.send_pos, state.recv_info, recv_x,
                recv_scales, recv_idx, recv_weights, state.recv_src_idx, cached, choice,
            )

    def _grow_arena(self, needed: int) -> None:
        """After a fresh dispatch that fell back to two passes for want of room (every rank learns it in
        the same call), an arena of the Buffer's own sizing grows, so that the next calls of that size
        take the one-pass path: collectively, to room for four calls' regions of the largest rank's
        need. Regions of the old arena live on (their tensors hold its mapping)."""
        if not self.arena_grows:
            return
        sizes = _every_ranks(self._gate, "dispatch (growing the arena)", needed)
        size = max(2 * self.arena.size, ARENA_GROWTH_CALLS * max(sizes))
        # The old area stays mapped until the next growth: this call's skipped one-pass kernel was
        # queued with its addresses.
        self._retired_area = self.arena_area
        self.arena_area = map_peer_buffers(self._group, self._gate, size, "dispatch (arena)", self.memory)
        self.arena = Arena(size, INTRANODE_SLOT_ALIGN)

    def _launch_notify(self, x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert) -> IntranodeDispatchState:
        """The count exchange of a fresh dispatch, on the communication stream (after _enter)."""
        with torch.cuda.stream(self.comm_stream):
            state = IntranodeDispatchState(
                send_pos=torch.empty(x.shape[0], self.num_ranks, dtype=torch.int32, device=x.device),
                recv_info=torch.empty(self.recv_info_ints, dtype=torch.int32, device=x.device),
                recv_src_idx=None,
            )
            self._nonce += 1
            self.ops.intranode_notify(self.ctx, is_token_in_rank.contiguous(), num_tokens_per_rank.contiguous(),
                                      num_tokens_per_expert.contiguous(), state.send_pos, state.recv_info, self._nonce)
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

    def _dispatch_fresh(self, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                        num_tokens_per_expert, local: int, config: Config, previous_event: Optional[EventOverlap],
                        allocate_on_comm_stream: bool):
        """A fresh ordinary dispatch without num_worst_tokens in one call into the extension (the 2-rank
        call is bound by its host path): the stream order, the count exchange, the wait for the counts,
        the outputs and the dispatch. -> (the caller's stream, state, recv_x, recv_scales, recv_idx,
        recv_weights, (recv_counts, send_counts, per_expert_counts))"""
        order_after_caller = self._begin_fresh_call(previous_event)
        done = self.ops.intranode_dispatch_fresh(
            self.ctx, config.num_sms, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
            num_tokens_per_expert, local,
            self._nonce, self.recv_info_ints, self.comm_stream.cuda_stream, order_after_caller, allocate_on_comm_stream,
            self.enums.host_info.DONE, self.enums.host_info.COUNTS, self.timeout_s + _HOST_GRACE_S,
        )
        if done is None:
            self._count_exchange_timed_out()
        send_pos, recv_info, recv_src_idx, recv_x, recv_scales, recv_idx, recv_weights, *counts = done
        state = IntranodeDispatchState(send_pos, recv_info, recv_src_idx)
        return torch.cuda.current_stream(), state, recv_x, recv_scales, recv_idx, recv_weights, counts

    def _launch_arena_early(self, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                            num_tokens_per_expert, local: int, target: tuple, config: Config,
                            previous_event: Optional[EventOverlap], allocate_on_comm_stream: bool):
        """A fresh one-pass dispatch up to its launch in one call into the extension (the 2-rank call is
        bound by its host path): the stream order, the state, the side outputs for the most rows the
        target holds, the count exchange and the one-pass kernel (which runs where every rank has room
        for its rows). target: (offset in the arena, capacity rows, part offsets, region bytes) of the range the
        kernel lays the rows out in. -> (the caller's stream, state, recv_idx, recv_weights)."""
        order_after_caller = self._begin_fresh_call(previous_event)
        send_pos, recv_info, recv_src_idx, recv_idx, recv_weights = self.ops.intranode_zero_copy_dispatch_early(
            self.ctx, config.num_sms, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
            num_tokens_per_expert, local, self._nonce, self.recv_info_ints, self.comm_stream.cuda_stream,
            order_after_caller, allocate_on_comm_stream, self.arena_area.pointers.data_ptr(), *target, self._choice,
            self._one_pass_dispatches,
        )
        return torch.cuda.current_stream(), IntranodeDispatchState(send_pos, recv_info, recv_src_idx), recv_idx, recv_weights

    def _wait_choice(self, local: int):
        """(send counts, receive counts, per-expert counts, one pass?) of a fresh dispatch into the arena,
        read from host-mapped memory once its one-pass kernel has chosen (behind its count exchange)."""
        slot = self.enums.host_info
        if not self.ops.wait_host_value(self.host_info, slot.CHOICE_DONE, self._nonce,
                                        self.timeout_s + _HOST_GRACE_S):
            self._count_exchange_timed_out()
        return (*self._read_counts(local), bool(self._host[slot.CHOICE]))

    def _read_counts(self, local: int):
        """The count exchange's result in host-mapped memory (its kernel is done)."""
        h, r, counts = self._host, self.num_ranks, self.enums.host_info.COUNTS
        # Slices of the ctypes array: one C-level copy each (indexing per element cost ~13 us a call
        # with 128 local experts).
        recv_counts = h[counts: counts + r]
        send_counts = h[counts + r: counts + 2 * r]
        per_expert = h[counts + 2 * r: counts + 2 * r + local]
        return send_counts, recv_counts, per_expert

    def _count_exchange_timed_out(self):
        """Raises what the kernels reported (a missing peer, named), else a TimeoutError of the host's wait.
        An earlier kernel on the communication stream that still waits for a peer reports it at its own
        deadline, which can come after the host's (its wait may have begun later): the host gives it that
        long before it raises without a name."""
        self.ops.wait_host_value(self.host_info, self.enums.host_info.ERROR, 1, self.timeout_s)
        self.check_errors()
        stream = "idle (its work all done)" if self.comm_stream.query() else "still busy"
        raise TimeoutError(
            f"moe_ep: the dispatch count exchange did not finish within {self.timeout_s + _HOST_GRACE_S:g} s "
            f"on rank {self.rank}, and no kernel of this Buffer reported a missing peer in {self.timeout_s:g} s "
            "more: the communication stream did not reach it (a kernel or an event it waits for never ended). "
            f"Rank {self.rank}: {kernel_progress(self._host, self.enums)}; count exchange {self._nonce} awaited, "
            f"{self._host[self.enums.host_info.DONE]} the last finished; communication stream {stream}"
        )

    # ---------------------------------------------------------------- dispatch arena
    def _arena_keep(self, reserved, rows: int, x: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int):
        """(layout, region) of `rows` at the start of the range a one-pass call reserved, whose rest goes
        back (every rank had room for its rows: the kernel laid them out with the same formula); no
        region for no rows where nothing was free."""
        layout = arena_dispatch_region(rows, row_bytes(x), row_bytes(scales), num_topk)
        if reserved is None:
            return layout, None
        self.arena.shrink(reserved[0], layout.slot_bytes)
        return layout, self._region(reserved[0], layout.slot_bytes)

    def _region(self, start: int, nbytes: int) -> Region:
        return Region(self.arena, start, nbytes, self.arena_area.addresses[self.rank], self.arena_area.device,
                      keep=self.arena_area)

    @staticmethod
    def _region_tensor(region: Optional[Region], offset: int, rows: int, like: torch.Tensor) -> torch.Tensor:
        if region is None:  # a one-pass call of no rows where the arena had no free byte
            return torch.empty((0, like.shape[1]), dtype=like.dtype, device=like.device)
        return region.tensor(offset, rows, like.shape[1], like.dtype)

    # ---------------------------------------------------------------- combine from the dispatch arena
    def combines_from_arena(self, x: torch.Tensor) -> bool:
        """Whether a plain combine of x reads the rows from the ranks' dispatch arenas (one pass): with an
        arena, for rows of whole 16-byte vectors (the same on every rank: same hidden, same dtype), and not
        in a CUDA graph (whose replays would reuse regions the call gave back), as the dispatch."""
        return self.arena is not None and row_bytes(x) % 16 == 0 and not torch.cuda.is_current_stream_capturing()


    def _arena_tensor_or_none(self, rows: int, columns: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        nbytes = rows * columns * dtype.itemsize
        start = self.arena.alloc(nbytes)
        return None if start is None else self._region(start, nbytes).tensor(0, rows, columns, dtype)

    def _arena_combine_rows(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], inside: bool):
        """(x, (bytes from this rank's arena to x's rows, their pitch, their count or -1 if there was no
        room, bytes to room for the weights), tensors to keep until the kernel is done). x outside the
        arena is copied into a region first (a pass over its bytes: empty_combine_input spares it)."""
        rows, base = x.shape[0], self.arena_area.addresses[self.rank]
        pitch = x.stride(0) * x.element_size() if inside else row_bytes(x)
        at = x.data_ptr() - base
        kept = []
        if rows == 0:
            return x.contiguous(), (0, row_bytes(x), 0, 0), kept
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

    # ---------------------------------------------------------------- combine
    def _combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor],
        biases: List[torch.Tensor],
        config: Config,
        previous_event: Optional[EventOverlap],
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ):
        """With an arena, the owners of the tokens sum the rows where they lie in the arenas (one pass)
        when every rank has room and its x lies there (Buffer.empty_combine_input), or, from
        COPY_INTO_ARENA_MIN_RANKS ranks up, where copying x there first pays; the one-pass kernel finds
        out on the device from every rank's announcement. Otherwise the rows pass through the windows of the Buffer's buffer (two passes)."""
        self._start_call("combine", config.num_sms)
        state: IntranodeDispatchState = handle.backend_state
        from_arena = self.combines_from_arena(x)
        copy_ok = self.num_ranks >= COPY_INTO_ARENA_MIN_RANKS
        topk_weights = None if topk_weights is None else topk_weights.contiguous()
        biases = [aligned(b) for b in biases] + [None] * (2 - len(biases))
        compute = self._enter(previous_event)
        with torch.cuda.stream(self.comm_stream if allocate_on_comm_stream else compute):
            out = torch.empty((handle.num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
            out_weights = None
            if topk_weights is not None:
                out_weights = torch.empty((handle.num_tokens, topk_weights.shape[1]), dtype=torch.float32, device=x.device)
        given, kept = x, []
        with torch.cuda.stream(self.comm_stream):
            if from_arena:
                inside = self._rows_in_arena(x)
                arena_x, where = x.contiguous(), (0, row_bytes(x), -1, 0)  # no room: two passes
                if inside or copy_ok:  # x itself, or its copy into the arena (on this stream)
                    arena_x, where, kept = self._arena_combine_rows(x, topk_weights, inside)
                self.ops.intranode_zero_copy_combine(
                    self.ctx, config.num_sms, arena_x, topk_weights, state.recv_src_idx, state.recv_info,
                    state.send_pos, biases[0], biases[1], out, out_weights, self.arena_area.pointers.data_ptr(),
                    *where, self._choice, self._one_pass_combines)
            x = aligned(x)
            self.ops.intranode_combine(
                self.ctx, config.num_sms, x, topk_weights, state.recv_src_idx, state.recv_info, state.send_pos,
                biases[0], biases[1], out, out_weights, config.num_max_nvl_chunked_send_tokens,
                self._choice if from_arena else None)
        # Arena tensors are not the caching allocator's memory (record_stream skips them): an async call's
        # event holds them (their regions go back to the arena after the kernel, which ends once every
        # peer has read them); otherwise the current stream waits for the kernel before anything can
        # reuse them.
        inputs = [x, given, topk_weights, *biases, *kept]
        event = self._leave(compute, async_finish, allocate_on_comm_stream, inputs, [out, out_weights])
        return out, out_weights, event

    def _rows_in_arena(self, x: torch.Tensor) -> bool:
        """Whether x's rows lie in this rank's arena as the one-pass combine reads them (no rows: nothing
        to read, so in place)."""
        if x.shape[0] == 0:
            return True
        pitch = x.stride(0) * x.element_size() if x.dim() == 2 and x.stride(1) == 1 else -1
        at = x.data_ptr() - self.arena_area.addresses[self.rank]
        return (pitch >= row_bytes(x) and pitch % 16 == 0 and at % 16 == 0 and 0 <= at
                and at + max(x.shape[0] - 1, 0) * pitch + row_bytes(x) <= self.arena.size)
