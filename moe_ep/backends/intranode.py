"""The intranode backend: CUDA kernels over peers' buffers mapped with CUDA IPC (csrc/kernels/intranode.cu).

Used for CUDA tensors when every rank of the group is on this host (also several ranks on one GPU).
It keeps the portable backend's results bit for bit; the Buffer has checked every argument before a
call gets here. Kernels run on a dedicated communication stream with deep_ep's event semantics.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .. import _native
from ..config import Config, IntranodeLayout
from ..events import EventOverlap
from ..handles import DispatchHandle
from ..sync import ArrivalGate

# host_info slots (csrc/kernels/api.cuh, intranode::HostInfo)
HOST_DONE, HOST_ERROR, HOST_ERROR_KIND, HOST_ERROR_PEER, HOST_ERROR_WINDOW, HOST_OVERFLOW = range(6)
HOST_TOTAL, HOST_MAX_TOKENS, HOST_COUNTS = 6, 7, 8
# What a failed wait was waiting for, by intranode::ErrorKind.
_WAITED_FOR = {
    1: "its token counts (dispatch)",
    2: "its tokens of dispatch window {window}",
    3: "it to finish reading this rank's dispatch window {window}",
    4: "it to accept combine rows of window {window}",
    5: "its combine rows of window {window}",
}
# Host-side grace on top of the kernels' own deadline before the host gives up on a count exchange.
_HOST_GRACE_S = 5.0


@dataclass
class IntranodeDispatchState:
    """Device-side layout a kernel dispatch leaves for its combine and cached dispatches."""

    send_pos: torch.Tensor  # [N, R] int32: row of each token among those sent to rank r, -1 if not sent
    recv_info: torch.Tensor  # int32: [max tokens, total rows, base row per source (R + 1), tokens per source]
    recv_src_idx: torch.Tensor  # [rows] int32: source token index of each received row (-1: padding)


def aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Contiguous and 16-byte aligned (the kernels move rows in 16-byte vectors)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _release(ops, own: int, opened: List[int]) -> None:
    try:
        torch.cuda.synchronize()
        for ptr in opened:
            ops.ipc_close(ptr)
        ops.device_free(own)
    except RuntimeError:  # at interpreter exit the CUDA context may already be gone, and with it the memory
        pass


class IntranodeBackend:
    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_nvl_bytes: int, comm_stream: torch.cuda.Stream):
        self.ops = _native.ops()
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.timeout_s = timeout_s = gate.timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device())
        own, handle = self.ops.ipc_alloc(num_nvl_bytes)  # zeroed before its handle is published
        # Through the store with a deadline: a rank that never makes its first CUDA dispatch is named.
        # Each rank also says which GPU it is on: ranks sharing one must fit their blocks on it together.
        device_id = str(torch.cuda.get_device_properties(self.device).uuid).encode()
        payloads = gate.exchange("dispatch (mapping the peers' buffers)", handle + device_id)
        handles = [p[: len(handle)] for p in payloads]
        self.ranks_on_device = sum(p[len(handle) :] == device_id for p in payloads)
        opened = [self.ops.ipc_open(h) for r, h in enumerate(handles) if r != self.rank]
        pointers = opened[: self.rank] + [own] + opened[self.rank :]
        self._finalizer = weakref.finalize(self, _release, self.ops, own, opened)
        self.buffers = torch.tensor(pointers, dtype=torch.int64, device=self.device)
        layout = self.ops.intranode_layout(self.num_ranks, num_nvl_bytes, 0, 0, 0)
        self.host_info = torch.zeros(layout["host_info_ints"], dtype=torch.int32, pin_memory=True)
        self._host = (ctypes.c_int32 * layout["host_info_ints"]).from_address(self.host_info.data_ptr())
        self.recv_info_ints = layout["recv_info_ints"]
        self.ctx = self.ops.IntranodeCtx(
            self.buffers.data_ptr(), self.rank, self.num_ranks, num_nvl_bytes, self.host_info, timeout_s,
            self.ranks_on_device,
        )
        self.comm_stream = comm_stream
        self._nonce = 0
        self._fitting_sms = set()  # SM budgets known to fit this GPU together with its other ranks

    def close(self) -> None:
        dist.barrier(group=self.group)  # no peer reads this rank's buffer any more
        self._finalizer()

    def layout(self, x_bytes: int, scale_bytes: int, num_topk: int) -> IntranodeLayout:
        return IntranodeLayout(self.num_ranks, self.num_nvl_bytes, x_bytes, scale_bytes, num_topk)

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
        if h[HOST_ERROR]:
            kind, peer, window = h[HOST_ERROR_KIND], h[HOST_ERROR_PEER], h[HOST_ERROR_WINDOW]
            waited = _WAITED_FOR.get(kind, "it").format(window=window)
            raise TimeoutError(
                f"moe_ep: rank {peer} did not arrive within {self.timeout_s:g} s: rank {self.rank} waited for "
                f"{waited}. Raise MOE_EP_TIMEOUT_S if the peer is only slow; the Buffer's ranks are out of "
                "step now: create a new Buffer."
            )

    def check_num_sms(self, num_sms: int) -> None:
        """ValueError (on every rank of this GPU alike) before a call starts, if its blocks cannot all be
        resident: the kernels wait on each other across ranks and would stall until the deadline."""
        if num_sms not in self._fitting_sms:
            self.ops.intranode_check_blocks(self.ctx, num_sms)
            self._fitting_sms.add(num_sms)

    # ---------------------------------------------------------------- streams and events
    def _enter(self, previous_event: Optional[EventOverlap]) -> torch.cuda.Stream:
        compute = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None:
            self.comm_stream.wait_event(previous_event.event)
        else:
            self.comm_stream.wait_stream(compute)
        return compute

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
            compute.wait_stream(self.comm_stream)
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
    ):
        self.check_errors()
        self.check_num_sms(config.num_sms)
        cached = handle is not None
        worst = handle.num_worst_tokens if cached else num_worst_tokens
        if torch.cuda.is_current_stream_capturing() and not worst:
            raise RuntimeError(
                "dispatch: capturing it in a CUDA graph needs num_worst_tokens > 0 (a dispatch without it "
                "waits on the host for the received token counts)"
            )
        x = aligned(x_parts[0])
        scales = aligned(x_parts[1]) if len(x_parts) == 2 else None
        if not cached and topk_idx is not None:
            topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        compute = self._enter(previous_event)
        local = num_tokens_per_expert.shape[0] // self.num_ranks if not cached else 0
        with torch.cuda.stream(self.comm_stream):
            send_counts = recv_counts = per_expert = None
            if cached:
                state: IntranodeDispatchState = handle.backend_state
                rows = handle.num_recv_rows
            else:
                in_rank = is_token_in_rank.contiguous()
                state = IntranodeDispatchState(
                    send_pos=torch.empty(x.shape[0], self.num_ranks, dtype=torch.int32, device=x.device),
                    recv_info=torch.empty(self.recv_info_ints, dtype=torch.int32, device=x.device),
                    recv_src_idx=None,
                )
                self._nonce += 1
                self.ops.intranode_notify(
                    self.ctx, in_rank, num_tokens_per_expert.contiguous(), state.send_pos, state.recv_info, self._nonce
                )
                if worst:
                    rows = worst
                else:
                    send_counts, recv_counts, per_expert = self._wait_counts(local)
                    rows = sum(recv_counts)
                state.recv_src_idx = torch.empty(rows, dtype=torch.int32, device=x.device)
        alloc = self.comm_stream if allocate_on_comm_stream else compute
        with torch.cuda.stream(alloc):
            recv_x = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
            recv_scales = None if scales is None else torch.empty((rows, scales.shape[1]), dtype=scales.dtype, device=x.device)
            recv_idx = recv_weights = None
            if not cached and topk_idx is not None:
                recv_idx = torch.empty((rows, topk_idx.shape[1]), dtype=torch.int64, device=x.device)
                recv_weights = torch.empty((rows, topk_idx.shape[1]), dtype=torch.float32, device=x.device)
        with torch.cuda.stream(self.comm_stream):
            self.ops.intranode_dispatch(
                self.ctx, config.num_sms, x, scales, None if cached else topk_idx, None if cached else topk_weights,
                local, state.send_pos, state.recv_info, recv_x, recv_scales, recv_idx, recv_weights, state.recv_src_idx,
            )
        recv = [recv_x] if scales is None else [recv_x, recv_scales]
        event = self._leave(
            compute, async_finish, allocate_on_comm_stream,
            [x, scales, topk_idx, topk_weights, is_token_in_rank], recv + [recv_idx, recv_weights],
        )
        if cached:
            return recv, None, None, None, None, event
        counts_list = []
        if not worst:
            counts_list = [-(-c // expert_alignment) * expert_alignment for c in per_expert]
        new_handle = make_handle(
            num_tokens=x.shape[0],
            is_token_in_rank=is_token_in_rank,
            send_counts=send_counts,
            recv_counts=recv_counts,
            num_worst_tokens=worst,
            backend_state=state,
        )
        return recv, recv_idx, recv_weights, counts_list, new_handle, event

    def _wait_counts(self, local: int):
        """The count exchange's result, read from host-mapped memory once the notify kernel is done."""
        if not self.ops.wait_host_value(self.host_info, HOST_DONE, self._nonce, self.timeout_s + _HOST_GRACE_S):
            self.check_errors()
            raise TimeoutError(
                f"moe_ep: the dispatch count exchange did not finish within {self.timeout_s + _HOST_GRACE_S:g} s "
                f"on rank {self.rank} (an earlier kernel on the communication stream may be stuck)"
            )
        h, r = self._host, self.num_ranks
        recv_counts = [h[HOST_COUNTS + s] for s in range(r)]
        send_counts = [h[HOST_COUNTS + r + d] for d in range(r)]
        per_expert = [h[HOST_COUNTS + 2 * r + e] for e in range(local)]
        return send_counts, recv_counts, per_expert

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
    ):
        self.check_errors()
        self.check_num_sms(config.num_sms)
        state: IntranodeDispatchState = handle.backend_state
        x = aligned(x)
        topk_weights = None if topk_weights is None else topk_weights.contiguous()
        biases = [aligned(b) for b in biases] + [None] * (2 - len(biases))
        compute = self._enter(previous_event)
        with torch.cuda.stream(self.comm_stream if allocate_on_comm_stream else compute):
            out = torch.empty((handle.num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
            out_weights = None
            if topk_weights is not None:
                out_weights = torch.empty((handle.num_tokens, topk_weights.shape[1]), dtype=torch.float32, device=x.device)
        with torch.cuda.stream(self.comm_stream):
            self.ops.intranode_combine(
                self.ctx, config.num_sms, x, topk_weights, state.recv_src_idx, state.recv_info, state.send_pos,
                biases[0], biases[1], out, out_weights,
            )
        event = self._leave(
            compute, async_finish, allocate_on_comm_stream, [x, topk_weights, *biases], [out, out_weights]
        )
        return out, out_weights, event
