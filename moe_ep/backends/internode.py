"""The internode kernels (csrc/kernels/internode/): normal calls of a group that spans several nodes.

A token crosses the network once per destination node, to its forwarder there (the rank with its source's
local index), which stores it over NVLink into the receive rows of each rank of that node holding one of
its experts; the combine pushes each received row back to its forwarder, which sums them per token and
puts one row per node back to the source, which adds the nodes' sums in node order. The results equal
the portable backend's bit for bit (its combine across nodes sums the same way).

Every call begins with an arrival of every rank at every other (a fresh dispatch's carries its counts,
which the host reads: the one host synchronisation of a call), so each call may reuse every region of the
buffer: one NVSHMEM buffer holds the control area and the regions of the call in flight, laid out from
that call's counts; it starts at num_rdma_bytes and a call that needs more replaces it with a larger one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import _native
from ..events import EventOverlap
from ..handles import DispatchHandle
from ..sync import ArrivalGate
from .base import Backend, CombineCall, DispatchCall
from .peers import NvshmemBuffers, aligned, device_view

_FORM = ("tokens", "row bytes", "scale bytes", "top-k", "experts", "chunks")
# Data regions of a buffer made with a smaller num_rdma_bytes, before any call grows it.
_FIRST_DATA_BYTES = 64 << 20


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def _laid_out(start: int, sizes) -> dict:
    """Byte offsets of the named (name, size) regions one after the other from `start`, 16-byte aligned,
    and their "end"."""
    regions, offset = {}, start
    for name, size in sizes:
        regions[name] = offset
        offset = _align16(offset + size)
    regions["end"] = offset
    return regions


def dispatch_regions(start: int, sent: int, forwarded: int, received: int, msg: int, row_bytes: int,
                     scale_bytes: int, num_topk: int) -> dict:
    """A dispatch's regions: the messages this rank sends and forwards (the most any rank does, `msg` bytes
    each) and its received rows, field by field."""
    return _laid_out(start, (
        ("send_region", sent * msg), ("recv_region", forwarded * msg), ("stage_x", received * row_bytes),
        ("stage_scales", received * scale_bytes), ("stage_idx", received * 8 * num_topk),
        ("stage_weights", received * 4 * num_topk), ("stage_source", received * 4), ("stage_forward", received * 8)))


def combine_regions(start: int, sent: int, forwarded: int, ranks_per_node: int, combine_row: int) -> dict:
    """A combine's regions: the node sums that come back, those this rank puts back, and the rows each
    rank of its node pushes to it."""
    return _laid_out(start, (("return_region", sent * combine_row), ("sum_region", forwarded * combine_row),
                             ("area_region", ranks_per_node * forwarded * combine_row)))


@dataclass
class InternodeDispatchState:
    """What a fresh dispatch leaves for its combine and its cached dispatches."""

    plan: torch.Tensor  # int32 device: row_base [R], then the per-node arrays that _plan_pointers names
    node_token: torch.Tensor  # int32 [messages sent]: the token of each, by node then position
    send_pos: torch.Tensor  # int32 [N, R]
    node_pos: torch.Tensor  # int32 [N, nodes]
    forward_mask: torch.Tensor  # int32 [messages forwarded]: the local ranks each went to
    recv_forward: torch.Tensor  # int32 [received, 2]: (local forwarder, slot) of each received row
    sent: int  # most messages any rank sends (regions are sized for every rank alike)
    forwarded: int  # most messages any rank forwards
    received: int  # most rows any rank receives
    num_recv: int  # rows this rank receives
    num_chunks: int
    rank_count: torch.Tensor  # int64 [source, destination] tokens, on the host
    node_count: torch.Tensor  # int64 [source, node] messages, on the host


class InternodeBackend(Backend):
    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_rdma_bytes: int, ranks_per_node: int,
                 comm_stream: torch.cuda.Stream):
        self.ops = _native.internode_ops()
        limits = self.ops.layout()
        self.control_bytes = limits["control_bytes"]
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.per_node = ranks_per_node
        self.num_nodes = self.num_ranks // ranks_per_node
        for name, value, limit in (("ranks", self.num_ranks, limits["max_ranks"]),
                                   ("ranks_per_node", ranks_per_node, limits["max_ranks_per_node"]),
                                   ("nodes", self.num_nodes, limits["max_nodes"])):
            if value > limit:
                raise ValueError(f"{name}: the internode kernels take at most {limit}, got {value}")
        self.limits = limits
        self.group, self.gate = group, gate
        self.peers = None
        # num_rdma_bytes is where the buffer starts (where it leaves room past the control area); a call
        # that needs more grows it (_grow).
        first = num_rdma_bytes if num_rdma_bytes > self.control_bytes else self.control_bytes + _FIRST_DATA_BYTES
        self._map(first)
        self.comm_stream = comm_stream
        self._nonce = 0
        self._done = torch.cuda.Event()
        # Bytes this rank put to other nodes (Buffer.stats' network_bytes), known on the host from the counts.
        self.network_bytes = 0

    # ---------------------------------------------------------------- shared
    def _map(self, num_bytes: int) -> None:
        """Collective: a symmetric buffer of num_bytes on every rank, zeroed before any peer may write to it."""
        self.peers = NvshmemBuffers(self.group, self.gate, num_bytes, "dispatch", puts_reach_all=True)
        self.num_bytes = num_bytes
        P = self.per_node
        node = self.rank // P
        node_ranks = range(node * P, (node + 1) * P)
        unmapped = [r for r in node_ranks if self.peers.addresses[r] == 0]
        if unmapped:
            raise RuntimeError(f"ranks {unmapped} share node {node} with rank {self.rank} but their buffers are not "
                               "reachable by loads and stores (NVLink): check ranks_per_node")
        self.base = self.peers.addresses[self.rank]
        self.node_peers = torch.tensor([self.peers.addresses[r] for r in node_ranks], dtype=torch.int64,
                                       device=self.peers.device)
        self.group_ctx = self.ops.Group(self.base, self.node_peers.data_ptr(), self.peers.host_info.data_ptr(),
                                        self.rank, self.num_ranks, P, self.peers.timeout_s)

    def _grow(self, needed: int) -> None:
        """Collective (every rank decides from the same sizes at the same call): the buffer replaced by one
        with room for `needed` bytes and a quarter more. Nothing reads the old one any more: this rank's
        stream is synchronised here, and the old buffer's close() synchronises every rank's device before
        the barrier that precedes its free."""
        self.comm_stream.synchronize()
        self.check_errors()  # a peer's failure reported into the old buffer's record is raised, not lost
        self.peers.close()
        self.peers = None  # freed: a growth that fails leaves the backend unusable, not pointing at it
        try:
            self._map((needed + needed // 4 + (1 << 20) - 1) >> 20 << 20)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; a call across nodes needed {needed} bytes of NVSHMEM's heap: set "
                               "NVSHMEM_SYMMETRIC_SIZE above it before the first Buffer, or pass a num_rdma_bytes "
                               "of Buffer.get_internode_rdma_size_hint") from None

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()

    def check_errors(self) -> None:
        if self.peers is None:
            raise RuntimeError("moe_ep: this Buffer's internode buffer could not be grown (an earlier call said "
                               "why); create a new Buffer")
        error = self.peers.timeout_error()
        if error is not None:
            raise error

    def _next_nonce(self) -> int:
        self.check_errors()
        self._nonce += 1
        return self._nonce

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
        for t in inputs:
            t.record_stream(self.comm_stream)
        if not allocate_on_comm_stream:
            for t in outputs:
                t.record_stream(self.comm_stream)
        else:
            for t in outputs:
                t.record_stream(compute)
        if async_finish:
            event = torch.cuda.Event()
            event.record(self.comm_stream)
            return EventOverlap(event, inputs + outputs)
        self._done.record(self.comm_stream)
        compute.wait_event(self._done)
        return EventOverlap()

    def _view(self, offset: int, num_bytes: int) -> torch.Tensor:
        return device_view(self.base + offset, max(num_bytes, 0), self.peers.device)

    def _arrive(self, nonce: int, row: Optional[torch.Tensor] = None, expert_counts: Optional[torch.Tensor] = None,
                local_experts: int = 0) -> Optional[torch.Tensor]:
        """Every rank's arrival at this call (on the current stream); with `row`, every rank's row and its
        counts of this rank's experts, read on the host."""
        if row is None:
            self.ops.arrive(self.group_ctx, nonce, 0, 0, 0, 0, 0)
            return None
        matrix = torch.empty(self.num_ranks, row.numel() + local_experts, dtype=torch.int32, device=row.device)
        self.ops.arrive(self.group_ctx, nonce, row.data_ptr(), row.numel(), expert_counts.data_ptr(), local_experts,
                        matrix.data_ptr())
        host = matrix.cpu()  # the call's one host synchronisation: it sizes the outputs
        self.check_errors()
        return host.to(torch.int64)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, call: DispatchCall):
        compute = self._enter(call.previous_event)
        with torch.cuda.stream(self.comm_stream):
            # Copies (where the kernels need other strides) on the comm stream: ordered after what it waited for.
            x_parts = [aligned(p) for p in call.x_parts]
            x, scales = x_parts[0], (x_parts[1] if len(x_parts) == 2 else None)
            num_tokens = x.shape[0]
            row_bytes = x.shape[1] * x.element_size()
            scale_bytes = 0 if scales is None else scales.shape[1] * scales.element_size()
            nonce = self._next_nonce()
            handle = call.handle
            if handle is None:
                state, per_expert = self._plan(call, num_tokens, row_bytes, scale_bytes, nonce)
            else:
                state = handle.backend_state
                self._arrive(nonce)
            num_topk = 0 if handle is not None or call.topk_idx is None else call.topk_idx.shape[1]
            msg = self.ops.message(row_bytes, scale_bytes, num_topk, self.per_node)["bytes"]
            regions = dispatch_regions(self.control_bytes, state.sent, state.forwarded, state.received, msg,
                                       row_bytes, scale_bytes, num_topk)
            if regions["end"] > self.num_bytes:  # the same on every rank: the counts and the form are everyone's
                self._grow(regions["end"])
            node = self.rank // self.per_node
            messages = int(state.node_count[self.rank].sum() - state.node_count[self.rank, node])
            self.network_bytes += messages * msg
            topk_idx = call.topk_idx.contiguous() if num_topk else None
            topk_weights = call.topk_weights.contiguous() if num_topk else None
            num_experts = call.num_tokens_per_expert.shape[0] if call.handle is None else 0
            self.ops.dispatch(self.group_ctx, nonce, call.config.num_sms, dict(
                row_bytes=row_bytes, scale_bytes=scale_bytes, num_topk=num_topk, ranks_per_node=self.per_node,
                x=x.data_ptr(), scales=0 if scales is None else scales.data_ptr(),
                topk_idx=0 if topk_idx is None else topk_idx.data_ptr(),
                topk_weights=0 if topk_weights is None else topk_weights.data_ptr(),
                send_pos=state.send_pos.data_ptr(), node_token=state.node_token.data_ptr(),
                num_chunks=state.num_chunks, experts_per_rank=num_experts // self.num_ranks if num_experts else 0,
                forward_mask=state.forward_mask.data_ptr() if call.handle is None else 0,
                **self._plan_pointers(state), **regions))
            outputs = self._receive(state, regions, row_bytes, scale_bytes, num_topk, x, scales,
                                    handle.num_worst_tokens if handle is not None else call.num_worst_tokens,
                                    compute, call.allocate_on_comm_stream, fresh=call.handle is None)
        recv_x = outputs[:2] if scales is not None else outputs[:1]
        if call.handle is not None:
            event = self._leave(compute, call.async_finish, call.allocate_on_comm_stream,
                                [*call.x_parts, *x_parts, state.plan], recv_x)
            return recv_x, None, None, None, None, event
        recv_idx, recv_weights, recv_src = outputs[len(recv_x):]
        handle, counts = self._make_handle(call, state, per_expert, recv_src)
        event = self._leave(compute, call.async_finish, call.allocate_on_comm_stream,
                            [*call.x_parts, *x_parts, call.topk_idx, call.topk_weights, topk_idx, topk_weights],
                            [*recv_x, recv_idx, recv_weights, recv_src])
        return recv_x, recv_idx, recv_weights, counts, handle, event

    def _plan(self, call: DispatchCall, num_tokens: int, row_bytes: int, scale_bytes: int, nonce: int):
        """The fresh dispatch's arrival with every rank's counts, and what they fix: -> (state, tokens this
        rank receives per local expert)."""
        R, P, N = self.num_ranks, self.per_node, self.num_nodes
        in_rank = call.is_token_in_rank
        device = in_rank.device
        in_node = in_rank.view(num_tokens, N, P).any(-1)
        num_experts = call.num_tokens_per_expert.shape[0]
        if num_experts > self.limits["max_experts"]:
            raise ValueError(f"num_tokens_per_expert: the internode kernels take at most {self.limits['max_experts']} "
                             f"experts, got {num_experts}")
        local_experts = num_experts // R
        num_topk = 0 if call.topk_idx is None else call.topk_idx.shape[1]
        num_chunks = max(1, min(self.limits["max_chunks"], call.config.num_sms // N))
        form = torch.tensor([num_tokens, row_bytes, scale_bytes, num_topk, num_experts, num_chunks], dtype=torch.int32)
        row = torch.cat([form.to(device, non_blocking=True), call.num_tokens_per_rank,
                         in_node.sum(0, dtype=torch.int32)])
        profile = call.profile
        mark = profile.start() if profile is not None else None  # on the host: it waits for the counts
        matrix = self._arrive(nonce, row, call.num_tokens_per_expert.contiguous(), local_experts)
        if profile is not None:
            profile.stop("count exchange", mark)
        forms = matrix[:, : len(_FORM)]
        for i, name in enumerate(_FORM):
            if len(set(forms[:, i].tolist())) > 1 and name != "tokens":
                raise ValueError(f"dispatch: the ranks called it with different {name}: "
                                 f"{dict(enumerate(forms[:, i].tolist()))} by rank")
        F = len(_FORM)
        rank_count = matrix[:, F : F + R]  # [source, destination]
        node_count = matrix[:, F + R : F + R + N]  # [source, node]
        per_expert = matrix[:, F + R + N :].sum(0).tolist()
        me, node, local = self.rank, self.rank // P, self.rank % P
        row_base = rank_count.cumsum(0)[me] - rank_count[me]  # where this rank's rows start on each destination
        send_count = node_count[me]
        # Where this rank's messages to node n start at its forwarder there: after those of the sources of
        # lower nodes with this local index.
        remote_offset = node_count[local : node * P : P].sum(0)
        forward_count = node_count[local::P, node]
        # Where a source's sums from this node start in its return region (laid out as its send region).
        return_offset = node_count[local::P, :node].sum(1)
        forwarded_by = [int(node_count[r % P :: P, r // P].sum()) for r in range(R)]
        plan = torch.cat([row_base, _exclusive_cumsum(send_count), send_count, remote_offset,
                          _exclusive_cumsum(forward_count), forward_count, return_offset]).to(torch.int32)
        plan = plan.pin_memory().to(device, non_blocking=True)
        node_pos = self._positions(in_node)
        state = InternodeDispatchState(
            plan=plan, node_token=self._node_tokens(node_pos, plan[R : R + N], int(send_count.sum())),
            send_pos=self._positions(in_rank), node_pos=node_pos,
            forward_mask=torch.empty(max(int(forward_count.sum()), 1), dtype=torch.int32, device=device),
            recv_forward=torch.empty(0, 2, dtype=torch.int32, device=device),
            sent=int(node_count.sum(1).max()), forwarded=max(forwarded_by), received=int(rank_count.sum(0).max()),
            num_recv=int(rank_count[:, me].sum()), num_chunks=num_chunks, rank_count=rank_count,
            node_count=node_count)
        return state, per_expert

    @staticmethod
    def _node_tokens(node_pos: torch.Tensor, send_offset: torch.Tensor, total: int) -> torch.Tensor:
        """int32 [total]: the token of each message, by destination node then position (scattered on the
        device: a nonzero() would wait for it on the host)."""
        num_tokens, num_nodes = node_pos.shape
        slot = torch.where(node_pos >= 0, node_pos + send_offset, total).view(-1).to(torch.int64)
        tokens = torch.arange(num_tokens, dtype=torch.int32, device=node_pos.device)
        into = torch.empty(total + 1, dtype=torch.int32, device=node_pos.device)  # [total]: where the unsent land
        into.scatter_(0, slot, tokens.repeat_interleave(num_nodes))
        return into[:total]

    @staticmethod
    def _positions(mask: torch.Tensor) -> torch.Tensor:
        """int32 like mask: each True's index among the Trues of its column, -1 elsewhere."""
        ones = mask.to(torch.int32)
        before = torch.cumsum(ones, dim=0, dtype=torch.int32) - ones
        return torch.where(mask, before, torch.full_like(before, -1)).contiguous()

    def _plan_pointers(self, state: InternodeDispatchState) -> dict:
        R, N = self.num_ranks, self.num_nodes
        base, step = state.plan.data_ptr(), 4
        names = ("send_offset", "send_count", "remote_offset", "forward_offset", "forward_count", "return_offset")
        pointers = dict(row_base=base)
        for i, name in enumerate(names):
            pointers[name] = base + step * (R + i * N)
        return pointers

    def _receive(self, state, regions, row_bytes, scale_bytes, num_topk, x, scales, num_worst_tokens, compute,
                 allocate_on_comm_stream: bool, fresh: bool) -> List[torch.Tensor]:
        """Copies this rank's receive rows out of the buffer (after the forwarders' flags, on the comm
        stream): [recv_x, (recv_scales)], then for a fresh dispatch [recv_topk_idx, recv_topk_weights,
        recv_src_idx]."""
        n = state.num_recv
        rows = max(n, num_worst_tokens) if num_worst_tokens else n
        stream = self.comm_stream if allocate_on_comm_stream else compute
        with torch.cuda.stream(stream):
            recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)
            recv_scales = None if scales is None else torch.empty(rows, scales.shape[1], dtype=scales.dtype,
                                                                  device=x.device)
        outputs = [recv_x] if recv_scales is None else [recv_x, recv_scales]
        for out, region, width in zip(outputs, ("stage_x", "stage_scales"), (row_bytes, scale_bytes)):
            out.view(torch.uint8)[:n] = self._view(regions[region], n * width).view(n, width)
            out.view(torch.uint8)[n:] = 0
        if not fresh:
            return outputs
        # Each row's forwarder and slot there: where its combine pushes it.
        state.recv_forward = self._view(regions["stage_forward"], n * 8).view(torch.int32).view(n, 2).clone()
        return outputs + self._receive_topk(state, regions, num_topk, rows, x.device, stream)

    def _receive_topk(self, state, regions, num_topk, rows, device, stream) -> List[torch.Tensor]:
        n = state.num_recv
        with torch.cuda.stream(stream):  # allocated there, written here (the comm stream)
            src = torch.empty(rows, dtype=torch.int32, device=device)
            idx = torch.empty(rows, num_topk, dtype=torch.int64, device=device) if num_topk else None
            weights = torch.empty(rows, num_topk, dtype=torch.float32, device=device) if num_topk else None
        src[:n] = self._view(regions["stage_source"], n * 4).view(torch.int32)
        src[n:] = -1
        if num_topk:
            idx[:n] = self._view(regions["stage_idx"], n * 8 * num_topk).view(torch.int64).view(n, num_topk)
            idx[n:] = -1
            weights[:n] = self._view(regions["stage_weights"], n * 4 * num_topk).view(torch.float32).view(n, num_topk)
            weights[n:] = 0
        return [idx, weights, src]

    def _make_handle(self, call: DispatchCall, state: InternodeDispatchState, per_expert, recv_src):
        rank_count = state.rank_count
        handle = call.make_handle(
            num_tokens=call.is_token_in_rank.shape[0], is_token_in_rank=call.is_token_in_rank,
            send_counts=rank_count[self.rank].tolist(), recv_counts=rank_count[:, self.rank].tolist(),
            num_worst_tokens=call.num_worst_tokens,
            rank_prefix_matrix=rank_count.cumsum(0).to(torch.int32).to(recv_src.device),
            recv_src_idx=recv_src, backend_state=state, recv_expert_counts=per_expert)
        handle._send_pos = state.send_pos
        align = call.expert_alignment
        counts = [] if call.num_worst_tokens > 0 else [-(-c // align) * align for c in per_expert]
        return handle, counts

    # ---------------------------------------------------------------- combine
    def combine(self, call: CombineCall):
        handle: DispatchHandle = call.handle
        state: InternodeDispatchState = handle.backend_state
        hidden, dtype, device = call.x.shape[1], call.x.dtype, call.x.device
        row_bytes = hidden * call.x.element_size()
        if row_bytes % 16:
            raise ValueError(f"x: the internode combine sums rows in 16-byte vectors: hidden * element size must be "
                             f"a multiple of 16, got {row_bytes}")
        num_weights = 0 if call.topk_weights is None else call.topk_weights.shape[1]
        combine_row = _align16(row_bytes + 4 * num_weights)
        regions = combine_regions(self.control_bytes, state.sent, state.forwarded, self.per_node, combine_row)
        needed = regions.pop("end")
        if needed > self.num_bytes:  # the same on every rank: the handle's sizes are every rank's
            self._grow(needed)
        node, local = self.rank // self.per_node, self.rank % self.per_node
        forwarded = state.node_count[local :: self.per_node, node]
        self.network_bytes += int(forwarded.sum() - forwarded[node]) * combine_row
        compute = self._enter(call.previous_event)
        with torch.cuda.stream(self.comm_stream if call.allocate_on_comm_stream else compute):
            out = torch.empty(handle.num_tokens, hidden, dtype=dtype, device=device)
            out_weights = None if num_weights == 0 else torch.empty(handle.num_tokens, num_weights,
                                                                    dtype=torch.float32, device=device)
        with torch.cuda.stream(self.comm_stream):
            # Copies (where the kernels need other strides) on the comm stream: ordered after what it waited for.
            x = aligned(call.x)
            weights = None if call.topk_weights is None else call.topk_weights.contiguous()
            biases = [aligned(b) for b in call.biases]
            nonce = self._next_nonce()
            self._arrive(nonce)
            pointers = self._plan_pointers(state)
            self.ops.combine(self.group_ctx, nonce, call.config.num_sms, dict(
                row_type=0 if x.dtype == torch.bfloat16 else 2, row_bytes=row_bytes, num_weights=num_weights,
                x=x.data_ptr(), topk_weights=0 if weights is None else weights.data_ptr(), num_rows=state.num_recv,
                forward=state.recv_forward.data_ptr(), forward_mask=state.forward_mask.data_ptr(),
                forward_offset=pointers["forward_offset"], forward_count=pointers["forward_count"],
                return_offset=pointers["return_offset"], node_pos=state.node_pos.data_ptr(),
                send_offset=pointers["send_offset"], bias0=biases[0].data_ptr() if biases else 0,
                bias1=biases[1].data_ptr() if len(biases) > 1 else 0, num_tokens=handle.num_tokens,
                forwarded=state.forwarded, num_chunks=state.num_chunks, out=out.data_ptr(),
                out_weights=0 if out_weights is None else out_weights.data_ptr(), **regions))
        event = self._leave(compute, call.async_finish, call.allocate_on_comm_stream,
                            [call.x, x, call.topk_weights, weights, *call.biases, *biases, state.plan], [out, out_weights])
        return out, out_weights, event


def rdma_size_hint(num_max_tokens: int, hidden: int, num_ranks: int, ranks_per_node: int, num_topk: int) -> int:
    """num_rdma_bytes with room for any normal call across nodes of at most num_max_tokens tokens a rank,
    rows of `hidden` columns (bf16 or fp8 dispatch, bf16 or float32 combine) and num_topk: the control
    area, and the regions of the largest call (every token to every node and rank)."""
    ops = _native.internode_ops()
    control, nodes = ops.layout()["control_bytes"], num_ranks // ranks_per_node
    scale_bytes = (hidden + 127) // 128 * 4
    msg = ops.message(2 * hidden, scale_bytes, num_topk, ranks_per_node)["bytes"]
    sent = forwarded = nodes * num_max_tokens
    dispatch = dispatch_regions(control, sent, forwarded, num_ranks * num_max_tokens, msg, 2 * hidden, scale_bytes,
                                num_topk)
    combine = combine_regions(control, sent, forwarded, ranks_per_node, _align16(4 * hidden + 4 * num_topk))
    return max(dispatch["end"], combine["end"])
