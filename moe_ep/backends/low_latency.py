"""The low-latency kernels (csrc/kernels/low_latency.cu) over peer buffers mapped with CUDA IPC, the
driver's virtual-memory API or NVSHMEM, and NVSHMEM puts to the peers that no mapping reaches.

Each call launches a send kernel that waits for nothing and returns; the receive kernel runs at once,
or when the caller runs the hook (`return_recv_hook=True`), so no kernel is resident while data is in
flight. Calls alternate between the two halves of every rank's buffer (by a call number on the device),
so a hook must run before the Buffer's next low-latency call (enforced here), on the same stream. Results equal the portable backend's bit for bit
(rows past recv_count are not written). The Buffer has checked every argument before a call gets here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import _native
from ..config import LowLatencyLayout
from ..events import finish_event
from ..handles import LowLatencyHandle
from ..sync import ArrivalGate
from .base import Backend, LowLatencyCombineCall, LowLatencyDispatchCall
from .peers import aligned, device_view, map_peer_buffers


@dataclass
class LowLatencyKernelState:
    """What a kernel dispatch leaves for its combine."""

    recv_count: torch.Tensor  # [L] int32
    recv_src_info: torch.Tensor  # [L, R * max] int32: (source rank * max + token) * top-k + slot
    received: bool = False


class LowLatencyBackend(Backend):
    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_rdma_bytes: int, memory: str = "auto"):
        """memory: "vmm" (the driver's virtual-memory API), "ipc" (CUDA IPC handles), "nvshmem"
        (NVSHMEM's symmetric heap, bootstrapped through `group`) or "auto": peers.peer_memory."""
        self.peers = map_peer_buffers(group, gate, num_rdma_bytes, "low_latency_dispatch", memory)
        # The kernels' module: where a rank of the group reaches a peer through NVSHMEM puts only (another
        # host), the kernels built with NVSHMEM's device library, on every rank alike (their combines push
        # rows, where mapped ranks' pull them); else those without it, faster on one host (setup.py says why).
        self.ops = _native.internode_ops() if self.peers.puts_anywhere else self.peers.ops
        self.rank, self.num_ranks = self.peers.rank, self.peers.num_ranks
        self._gate = gate
        self._pending: Optional[str] = None  # the call whose hook has not run yet
        self._contexts = {}
        self._shape = None  # (max tokens, hidden, experts) of the last call: the buffer's layout now
        # The zero-copy rows slot (0 or 1) the next combine owns, and the views handed out of each.
        self._combine_next = 0
        self._combine_rows: List[Optional[torch.Tensor]] = [None, None]

    # ---------------------------------------------------------------- the Backend interface
    def low_latency_dispatch(self, call: LowLatencyDispatchCall):
        recv_x, recv_count, hook = self._dispatch(
            call.x, call.topk_idx, call.stats, call.use_fp8, call.round_scale, call.use_ue8m0,
            call.return_recv_hook, call.handle)
        return recv_x, recv_count, finish_event(call.async_finish, [call.x, recv_count]), hook

    def low_latency_combine(self, call: LowLatencyCombineCall):
        # The combine owns the zero-copy slot: the caller's rows, or x's rows staged there.
        slot, self._combine_next = self._combine_next, self._combine_next ^ 1
        combined, hook = self._combine(call.x, call.topk_idx, call.topk_weights, call.handle, call.return_recv_hook,
                                       call.out, slot=slot, zero_copy=call.zero_copy)
        return combined, finish_event(call.async_finish, [call.x, combined]), hook

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        rows = self._combine_rows[self._combine_next]
        shape = (handle.num_experts // self.num_ranks, self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
                 handle.hidden)
        if rows is None or tuple(rows.shape) != shape:
            rows = self._combine_rows[self._combine_next] = self.zero_copy_rows(handle, self._combine_next)
        return rows

    def clean_low_latency_buffer(self, shape) -> None:
        self.clear_flags("clean_low_latency_buffer", shape)

    def close(self) -> None:
        self.peers.close()

    def check_call(self, call: str, handle: LowLatencyHandle, dispatched: bool = False) -> None:
        """What these kernels refuse of a call, raised before any rank communicates: the Buffer runs it with
        the call's argument checks, so that under MOE_EP_DEBUG=1 the peers learn of the refusal and every
        rank leaves the call. handle: the dispatch's (for a dispatch, the one it will return); dispatched:
        the call is a combine of that dispatch."""
        if self._pending is not None:
            raise RuntimeError(
                f"{call}: call the hook of the previous {self._pending} first (the kernels alternate between two "
                "halves of the buffer, so a receive must finish before the next call is issued)"
            )
        if dispatched and not handle.backend_state.received:
            raise RuntimeError(
                "handle: its low_latency_dispatch has not received yet: call the dispatch's hook() first"
            )
        shape = (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        if self._shape is not None and shape != self._shape:
            _refuse_capture(call, shape)

    def _begin(self, call: str, handle: LowLatencyHandle):
        """The call's context (the Buffer ran check_call)."""
        self.check_errors()
        shape = (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        if self._shape is not None and shape != self._shape:
            self.clear_flags(call, shape)
        self._shape = shape
        ctx = self._contexts.get(shape)
        if ctx is None:  # one per shape: a decode loop makes the same calls every step
            ctx = self._contexts[shape] = self.ops.LowLatencyCtx(
                self.peers.pointers.data_ptr(), self.rank, self.num_ranks, self.peers.ranks_on_device,
                self.peers.host_info, self.peers.timeout_s, *shape,
            )
        return ctx

    def check_errors(self) -> None:
        """Raises what an earlier kernel reported: a peer that did not arrive (the Buffer's ranks are then
        out of step)."""
        error = self.peers.timeout_error()
        if error is not None:
            raise error

    def clear_flags(self, call: str, shape) -> None:
        """Zeroes, on every rank, the signals and send scratch of both halves as laid out for `shape`.
        The layout depends on the shape, so after a change they lie where the previous shape kept rows,
        whose bytes would read as raised flags and row counts. Collective: every rank makes the same
        calls, so all meet here; between two barriers, so that no peer still reads this buffer for an
        old call, nor writes it for a new one, while it is cleared."""
        if self._pending is not None:
            raise RuntimeError(f"{call}: call the hook of the previous {self._pending} first (its receive "
                               "waits for the flags that this would clear)")
        _refuse_capture(call, shape)
        torch.cuda.synchronize()  # this rank's kernels of the old shape are done
        self._gate.enter(f"{call} (a new low-latency shape: the old calls are done)")
        layout = LowLatencyLayout(shape[0], shape[1], self.num_ranks, shape[2])
        for half in range(2):
            start = self.peers.addresses[self.rank] + layout.HEADER_BYTES + half * layout.half_bytes
            self.peers.ops.device_zero(start, layout.zero_copy_offset)  # the send kernel's scratch
            self.peers.ops.device_zero(start + layout.send_bytes + layout.recv_bytes, layout.signal_bytes)
        self._gate.enter(f"{call} (a new low-latency shape: the flags are cleared)")
        self._shape = shape

    def _deferred(self, call: str, receive, return_recv_hook: bool):
        """Runs `receive` now, or returns it as the hook (once only)."""
        if not return_recv_hook:
            receive()
            return None
        self._pending = call
        done = []

        def hook():
            if done:
                raise RuntimeError(f"the hook of this {call} already ran")
            done.append(True)
            self._pending = None
            receive()

        return hook

    def _dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        stats: Optional[torch.Tensor],
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        return_recv_hook: bool,
        handle: LowLatencyHandle,
    ):
        ctx = self._begin("low_latency_dispatch", handle)
        x, topk_idx = aligned(x), topk_idx.contiguous()
        # The extension allocates the outputs ([L, R * max, H] rows, scales, counts, sources).
        recv_x, recv_scales, recv_count, recv_src_info = self.ops.ll_dispatch_send(
            ctx, x, topk_idx, use_fp8, round_scale, use_ue8m0
        )
        state = LowLatencyKernelState(recv_count, recv_src_info)
        handle.backend_state = state
        handle.recv_source = functools.partial(self._recv_source, state, topk_idx.shape[1])

        def receive():
            self.ops.ll_dispatch_recv(
                ctx, topk_idx.shape[1], use_fp8, use_ue8m0, recv_x, recv_scales, recv_count, stats, state.recv_src_info
            )
            state.received = True

        hook = self._deferred("low_latency_dispatch", receive, return_recv_hook)
        return ((recv_x, recv_scales) if use_fp8 else recv_x), recv_count, hook

    @staticmethod
    def _recv_source(state: LowLatencyKernelState, num_topk: int) -> Optional[torch.Tensor]:
        """The handle's (source rank * max + source token) of each received row, -1 past each expert's
        count; None before the receive ran."""
        if not state.received:
            return None
        rows = torch.arange(state.recv_src_info.shape[1], dtype=torch.int32, device=state.recv_src_info.device)
        source = torch.div(state.recv_src_info, num_topk, rounding_mode="floor")
        return torch.where(rows < state.recv_count.unsqueeze(1), source, torch.full_like(source, -1))

    def zero_copy_rows(self, handle: LowLatencyHandle, slot: int) -> torch.Tensor:
        """Slot `slot` (0 or 1) of this rank's zero-copy combine rows: [L, R x max, H] bf16 inside its
        mapped buffer, where the peers' combine receives read them in place (no row is copied; where the group
        reaches a peer through puts, the rows are pushed from there). Valid while the Buffer lives."""
        max_tokens, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        layout = LowLatencyLayout(max_tokens, hidden, self.num_ranks, num_experts)
        local, rows = num_experts // self.num_ranks, self.num_ranks * max_tokens
        address = (self.peers.addresses[self.rank] + layout.HEADER_BYTES + slot * layout.half_bytes
                   + layout.zero_copy_offset)
        view = device_view(address, local * rows * hidden * 2, self.peers.device)
        return view.view(torch.bfloat16).view(local, rows, hidden)

    def _combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        return_recv_hook: bool,
        out: Optional[torch.Tensor],
        slot: int,
        zero_copy: bool = False,
    ):
        """slot: the zero-copy rows (0 or 1) this combine owns; with zero_copy, x is zero_copy_rows(slot).
        Where every rank is mapped, the tokens' ranks read the rows there: x's received rows are copied into
        that slot first unless zero_copy (a local copy and a pull: pushing them into the peers' buffers is
        several times slower with ranks sharing a GPU). Where the group puts, every rank pushes its rows."""
        state: LowLatencyKernelState = handle.backend_state
        if self.peers.puts_anywhere:
            # A peer reached through puts cannot read rows in place: they are pushed (a put stages its row in
            # this combine's slot, where zero-copy rows lie already), and the receive reads its own region.
            how, read_slot = self.ops.COMBINE_PUSH, -1
        else:
            how, read_slot = (self.ops.COMBINE_IN_SLOT if zero_copy else self.ops.COMBINE_STAGE), slot
        ctx = self._begin("low_latency_combine", handle)
        x = aligned(x)
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        # The kernel writes 16-byte vectors: an unaligned `out` gets the result by a copy.
        direct = out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0
        target = self.ops.ll_combine_send(
            ctx, x, state.recv_count, state.recv_src_info, handle.num_topk, handle.num_tokens, out if direct else None,
            slot, how,
        )

        def receive():
            self.ops.ll_combine_recv(ctx, topk_idx, topk_weights, target, read_slot)
            if out is not None and not direct:
                out.copy_(target)

        hook = self._deferred("low_latency_combine", receive, return_recv_hook)
        return (out if out is not None else target), hook


def _refuse_capture(call: str, shape) -> None:
    """A new shape's flags are cleared between two meetings of the ranks, which no CUDA graph can hold."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{call}: the first call of a new low-latency shape {shape} (max tokens, hidden, experts) "
            "clears the buffer's flags on every rank and cannot be captured in a CUDA graph: make one "
            "call of that shape before capturing"
        )
