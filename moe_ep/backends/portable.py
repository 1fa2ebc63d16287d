"""The portable backend: every stage written with torch ops and torch.distributed collectives.

This is the executable specification of moe_ep. It runs on CPU tensors over gloo (and on CUDA tensors
over NCCL, or over gloo by staging through host memory), and the CUDA kernels are tested bit for bit
against it. Where an operation rounds, the order of operations here is the contract:

* combine: per token, acc = 0.0f; acc += bias0; acc += bias1; then acc += row from rank r for every
  rank r the token was sent to, in ascending r; all in float32; one rounding to the output dtype.
  Where the group spans several nodes (ranks_per_node < group size) the sum follows the traffic: per
  node, part = 0.0f; part += row from rank r for the node's ranks r in ascending order, rounded to the
  output dtype (what crosses the network back); then acc = 0.0f; acc += bias0; acc += bias1; acc +=
  part of each node the token went to, in ascending node order; one rounding. Combined top-k weights
  follow the same order in float32.
* low-latency combine: per token, acc = 0.0f; for k ascending with topk_idx[k] >= 0:
  acc = acc + (weight[k] * row[k]) with the product rounded to float32 before the sum (no FMA).

Rows travel as raw bytes, so dtypes that a collective does not know (fp8, bf16 on gloo) move exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import fp8
from ..checks import FP8_DTYPE
from ..events import finish_event, wait_previous
from ..handles import DispatchHandle, LowLatencyHandle
from ..profiling import Profile
from ..shrink import SurvivorExchange
from ..sync import ArrivalGate, Form
from .base import Backend, CombineCall, DispatchCall, LowLatencyCombineCall, LowLatencyDispatchCall
from .forms import combine_form, dispatch_form, low_latency_combine_form, low_latency_dispatch_form


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int):
    """(num_tokens_per_rank, num_tokens_per_rdma_rank or None, num_tokens_per_expert, is_token_in_rank)."""
    experts_per_rank = num_experts // num_ranks
    num_tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    expert = topk_idx.clamp(min=0)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
    num_tokens_per_expert.index_add_(0, expert[valid], torch.ones_like(expert[valid], dtype=torch.int32))
    is_token_in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
    rows = torch.arange(num_tokens, dtype=torch.int64, device=topk_idx.device).unsqueeze(1).expand_as(topk_idx)
    is_token_in_rank[rows[valid], (expert // experts_per_rank)[valid]] = True
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_rdma_rank = None
    if ranks_per_node < num_ranks:
        num_nodes = num_ranks // ranks_per_node
        in_node = is_token_in_rank.view(num_tokens, num_nodes, ranks_per_node).any(-1)
        num_tokens_per_rdma_rank = in_node.sum(0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank


def pack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """2-D tensors with equal row counts -> one uint8 matrix, a row of each part's bytes per token."""
    return torch.cat([_row_bytes(p) for p in parts], dim=1)


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    if t.numel() == 0:  # empty tensors may carry strides that a byte view rejects
        return torch.empty(t.shape[0], row_bytes, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


def unpack_rows(rows: torch.Tensor, specs: Sequence[Tuple[torch.dtype, int]]) -> List[torch.Tensor]:
    """Inverse of pack_rows: specs lists (dtype, columns) of each part in order."""
    parts, offset = [], 0
    for dtype, cols in specs:
        nbytes = cols * dtype.itemsize
        # A copy, not .contiguous(): a one-row slice is "contiguous" at an offset a wider dtype rejects.
        part = rows[:, offset : offset + nbytes].clone(memory_format=torch.contiguous_format)
        parts.append(part.view(dtype).reshape(rows.shape[0], cols))
        offset += nbytes
    return parts


def row_specs(parts: Sequence[torch.Tensor]) -> List[Tuple[torch.dtype, int]]:
    return [(p.dtype, p.shape[1]) for p in parts]


@dataclass
class _LowLatencyState:
    send_token: torch.Tensor  # [M] source token of each message sent, in send order
    send_slot: torch.Tensor  # [M] its top-k slot
    send_counts: List[int]  # messages sent to each rank
    # Messages received from each rank: in shrink mode filled in place by the receive, which learns them.
    recv_counts: List[int]
    arrival_expert: Optional[torch.Tensor] = None  # [M'] local expert of each received message
    arrival_row: Optional[torch.Tensor] = None  # [M'] its row in recv_x[expert]


class PortableBackend(Backend):
    """Every call completes before it returns (its event is empty unless async_finish asks for one)."""

    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, ranks_per_node: Optional[int] = None,
                 survivors: Optional[SurvivorExchange] = None):
        """survivors: where low-latency calls meet and move rows in shrink mode (None: every rank takes part)."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        # Nodes of the group: several make the combine sum per node first (the module's docstring).
        self.ranks_per_node = self.num_ranks if ranks_per_node is None else ranks_per_node
        self.gate = gate
        self.survivors = survivors
        # gloo moves host memory only; NCCL moves device memory.
        self.comm_on_host = dist.get_backend(group) == "gloo"
        # The two [L, R * max, H] row sets low_latency_combine(zero_copy=True) alternates between.
        self._combine_rows: List[Optional[torch.Tensor]] = [None, None]
        self._combine_next = 0

    # ---------------------------------------------------------------- the Backend interface
    def dispatch(self, call: DispatchCall):
        wait_previous(call.previous_event)
        recv_x, recv_idx, recv_weights, counts, handle = self._dispatch(
            call.x_parts, call.topk_idx, call.topk_weights, call.is_token_in_rank, call.num_tokens_per_rank,
            call.num_tokens_per_expert, call.expert_alignment, call.num_worst_tokens, call.handle, call.make_handle,
            dispatch_form(call), call.profile)
        return recv_x, recv_idx, recv_weights, counts, handle, finish_event(call.async_finish, [*call.x_parts, *recv_x])

    def combine(self, call: CombineCall):
        wait_previous(call.previous_event)
        combined_x, combined_w = self._combine(call.x, call.handle, call.topk_weights, call.biases, combine_form(call))
        return combined_x, combined_w, finish_event(call.async_finish, [call.x, combined_x])

    def low_latency_dispatch(self, call: LowLatencyDispatchCall):
        recv_x, recv_count, hook = self._low_latency_dispatch(
            call.x, call.topk_idx, call.num_max_tokens, call.num_experts, call.stats, call.use_fp8, call.round_scale,
            call.use_ue8m0, call.return_recv_hook, call.handle, low_latency_dispatch_form(call))
        return recv_x, recv_count, finish_event(call.async_finish, [call.x, recv_count]), hook

    def low_latency_combine(self, call: LowLatencyCombineCall):
        self._combine_next ^= 1
        combined, hook = self._low_latency_combine(call.x, call.topk_idx, call.topk_weights, call.handle,
                                                   call.return_recv_hook, call.out, low_latency_combine_form(call))
        return combined, finish_event(call.async_finish, [call.x, combined]), hook

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        shape = (handle.num_experts // self.num_ranks, self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
                 handle.hidden)
        rows = self._combine_rows[self._combine_next]
        if rows is None or tuple(rows.shape) != shape or rows.device != handle.device:
            rows = self._combine_rows[self._combine_next] = torch.zeros(shape, dtype=torch.bfloat16,
                                                                        device=handle.device)
        return rows

    def clean_low_latency_buffer(self, shape) -> None:
        for rows in self._combine_rows:
            if rows is not None:
                rows.zero_()

    # ---------------------------------------------------------------- collectives on raw bytes
    def _comm_device(self, like: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.comm_on_host else like.device

    def _exchange_rows(
        self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], async_op: bool = False
    ):
        """All-to-all of uint8 rows: send_counts[r] rows to rank r, recv_counts[r] rows from it, in
        rank order. Returns the received rows (and the pending work when async_op)."""
        row_bytes = rows.shape[1]
        device = rows.device
        send = rows.to(self._comm_device(rows)).reshape(-1)
        recv = torch.empty(sum(recv_counts) * row_bytes, dtype=torch.uint8, device=send.device)
        work = dist.all_to_all_single(
            recv,
            send,
            [c * row_bytes for c in recv_counts],
            [c * row_bytes for c in send_counts],
            group=self.group,
            async_op=async_op,
        )

        def result() -> torch.Tensor:
            if work is not None:
                work.wait()
            return recv.view(-1, row_bytes).to(device)

        return result if async_op else result()

    def _exchange_counted_rows(self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]):
        """_exchange_rows started now -> a function that waits for it: (received rows, recv_counts)."""
        exchange = self._exchange_rows(rows, send_counts, recv_counts, async_op=True)
        return lambda: (exchange(), list(recv_counts))

    @staticmethod
    def _rank_of_each(counts: Sequence[int], device: torch.device) -> torch.Tensor:
        """The rank of each row, for rows grouped by rank with counts[r] rows of rank r."""
        return torch.repeat_interleave(torch.arange(len(counts), device=device),
                                       torch.tensor(list(counts), dtype=torch.int64, device=device))

    @staticmethod
    def _on_ranks(ranks: torch.Tensor, present: List[int]) -> torch.Tensor:
        """Where `ranks` holds one of `present`."""
        return torch.isin(ranks, torch.tensor(present, dtype=ranks.dtype, device=ranks.device))

    def _all_gather_ints(self, values: torch.Tensor) -> torch.Tensor:
        """[n] int64 from every rank -> [R, n]."""
        local = values.to(torch.int64).to(self._comm_device(values))
        gathered = [torch.empty_like(local) for _ in range(self.num_ranks)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).cpu()

    def _all_to_all_ints(self, values: Sequence[int]) -> List[int]:
        send = torch.tensor(list(values), dtype=torch.int64, device="cpu")
        recv = torch.empty_like(send)
        if not self.comm_on_host:
            send, recv = send.cuda(), recv.cuda()
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()

    # ---------------------------------------------------------------- normal mode
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
        form: Form,
        profile: Optional[Profile] = None,
    ):
        num_tokens = x_parts[0].shape[0]
        device = x_parts[0].device
        # Before any rank communicates, so that a size that cannot be had fails on this rank alone, naming
        # the argument, with every rank still in step: the rows this rank sends, selected before they are
        # packed (a rank's x may be far larger than what it sends, stride-0 views of one row among them),
        # and fixed-size receive tensors.
        send_order = self._send_order(is_token_in_rank if handle is None else handle.is_token_in_rank)
        fresh = handle is None  # each row then carries its source token (the handle's recv_src_idx) and top-k
        topk = [t for t in (topk_idx, topk_weights) if t is not None] if fresh else []
        specs = row_specs(x_parts) + ([(torch.int32, 1)] + row_specs(topk) if fresh else [])
        row_bytes = sum(cols * dtype.itemsize for dtype, cols in specs)
        try:
            sent = [p[send_order] for p in x_parts]
            if fresh:
                sent += [send_order.to(torch.int32).unsqueeze(1)] + [t[send_order] for t in topk]
            packed = pack_rows(sent)
        except (RuntimeError, MemoryError) as exc:
            raise self._refused_dispatch(f"x: cannot allocate the {len(send_order)} rows of {row_bytes} bytes this "
                                         f"rank sends on {device} ({str(exc).splitlines()[0]})") from None
        del sent  # packed holds them
        num_rows = handle.num_worst_tokens if handle is not None else num_worst_tokens
        padded = None
        if num_rows > 0:
            try:
                padded = [torch.empty(num_rows, cols, dtype=dtype, device=device) for dtype, cols in specs]
            except (RuntimeError, MemoryError) as exc:
                raise self._refused_dispatch(
                    f"num_worst_tokens={num_rows}: cannot allocate the receive tensors of {num_rows} rows of "
                    f"{row_bytes} bytes on {device} ({str(exc).splitlines()[0]})") from None
        gate_call = self.gate.enter("dispatch", form)
        if handle is None:
            num_experts = num_tokens_per_expert.shape[0]
            local = num_experts // self.num_ranks
            mark = profile.start(device) if profile is not None else None
            counts = self._all_gather_ints(torch.cat([num_tokens_per_rank, num_tokens_per_expert]))
            if profile is not None:
                profile.stop("count exchange", mark)
            recv_matrix = counts[:, : self.num_ranks]  # [src, dst]
            if num_worst_tokens > 0:
                totals = recv_matrix.sum(0)
                over = [r for r in range(self.num_ranks) if totals[r] > num_worst_tokens]
                if over:
                    raise ValueError(
                        f"num_worst_tokens={num_worst_tokens} is too small: rank(s) {over} would receive "
                        f"{[int(totals[r]) for r in over]} tokens"
                    )
            expert_counts = counts[:, self.num_ranks + self.rank * local : self.num_ranks + (self.rank + 1) * local]
            per_expert = expert_counts.sum(0).tolist()
            recv_counts_list = (
                [] if num_worst_tokens > 0 else [-(-c // expert_alignment) * expert_alignment for c in per_expert]
            )
            handle = make_handle(
                num_tokens=num_tokens,
                # A copy: the combine and cached dispatches order their rows by it, and a caller may reuse
                # its tensor for the next layout meanwhile (deep_ep's combine never reads it).
                is_token_in_rank=is_token_in_rank.clone(),
                send_counts=recv_matrix[self.rank].tolist(),
                recv_counts=recv_matrix[:, self.rank].tolist(),
                num_worst_tokens=num_worst_tokens,
                rank_prefix_matrix=torch.cumsum(recv_matrix, dim=0).to(dtype=torch.int32, device=x_parts[0].device),
                recv_expert_counts=per_expert,
                gate_call=gate_call,
            )
            cached = False
        else:
            cached = True
        received = self._exchange_rows(packed, handle.send_counts, handle.recv_counts)
        outs = unpack_rows(received, specs)
        if padded is not None:
            for into, rows in zip(padded, outs):
                into[: rows.shape[0]] = rows
                into[rows.shape[0] :] = 0
            outs = padded
        recv_x = outs[: len(x_parts)]
        if cached:
            return recv_x, None, None, None, None
        handle.recv_src_idx = outs[len(x_parts)].view(-1)
        handle.recv_src_idx[handle.num_recv_tokens:] = -1
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            recv_topk_idx, recv_topk_weights = self._to_local_experts(outs[-2], outs[-1], num_experts)
            recv_topk_idx[handle.num_recv_tokens :] = -1
        return recv_x, recv_topk_idx, recv_topk_weights, recv_counts_list, handle

    def _refused_dispatch(self, message: str) -> ValueError:
        """This rank's dispatch cannot be had (message says why): the peers are told, and raise naming
        this rank; -> the ValueError for this rank to raise."""
        self.gate.refuse("dispatch", f"ValueError: {message}")
        return ValueError(message)

    def _to_local_experts(self, idx: torch.Tensor, weights: torch.Tensor, num_experts: int):
        local = num_experts // self.num_ranks
        first = self.rank * local
        is_local = (idx >= first) & (idx < first + local)
        return (
            torch.where(is_local, idx - first, torch.full_like(idx, -1)),
            torch.where(is_local, weights, torch.zeros_like(weights)),
        )

    @staticmethod
    def _send_order(is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """Token indices in send order: destination rank major, token index minor."""
        return is_token_in_rank.t().nonzero(as_tuple=True)[1]

    def _combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                 biases: List[torch.Tensor], form: Form):
        self.gate.enter("combine", form)
        valid = handle.num_recv_tokens
        parts = [x[:valid]] + ([topk_weights[:valid]] if topk_weights is not None else [])
        received = self._exchange_rows(pack_rows(parts), handle.recv_counts, handle.send_counts)
        outs = unpack_rows(received, row_specs(parts))
        send_order = self._send_order(handle.is_token_in_rank)
        combined_x = self._reduce_by_rank(outs[0], send_order, handle, biases, x.dtype)
        combined_w = None
        if topk_weights is not None:
            combined_w = self._reduce_by_rank(outs[1], send_order, handle, [], torch.float32)
        return combined_x.to(x.dtype), combined_w

    def _reduce_by_rank(self, rows: torch.Tensor, send_order: torch.Tensor, handle: DispatchHandle,
                        biases: List[torch.Tensor], part_dtype: torch.dtype) -> torch.Tensor:
        """float32 [N, cols]: the biases, then the rows each rank returned, in the contract's order
        (across nodes: each node's rows summed and rounded to part_dtype first)."""
        acc = torch.zeros(handle.num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
        for bias in biases:
            acc += bias.float()
        per_node = self.ranks_per_node
        starts = [0]
        for count in handle.send_counts:
            starts.append(starts[-1] + count)
        for node in range(self.num_ranks // per_node):
            part = acc if per_node == self.num_ranks else torch.zeros_like(acc)
            for r in range(node * per_node, (node + 1) * per_node):  # rank order: the contract's summation order
                tokens = send_order[starts[r] : starts[r + 1]]
                part[tokens] += rows[starts[r] : starts[r + 1]].float()
            if part is not acc:
                reached = handle.is_token_in_rank[:, node * per_node : (node + 1) * per_node].any(1)
                acc[reached] += part[reached].to(part_dtype).float()
        return acc

    # ---------------------------------------------------------------- low-latency mode
    def _low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_tokens: int,
        num_experts: int,
        stats: Optional[torch.Tensor],
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        return_recv_hook: bool,
        handle: LowLatencyHandle,
        form: Form,
    ):
        meeting = None
        if self.survivors is None:
            handle.gate_call = self.gate.enter("low_latency_dispatch", form)
        else:
            meeting = self.survivors.meet("low_latency_dispatch", form)
            handle.gate_call = meeting.call
        local = num_experts // self.num_ranks
        hidden = x.shape[1]
        routed = topk_idx >= 0
        if meeting is not None:  # rows for the experts of ranks that took no part are dropped
            routed &= self._on_ranks(topk_idx // local, meeting.present)
        token, slot = routed.nonzero(as_tuple=True)  # ordered by token, then slot
        expert = topk_idx[token, slot]
        order = torch.sort(expert // local, stable=True).indices
        token, slot, expert = token[order], slot[order], expert[order]
        send_counts = torch.bincount(expert // local, minlength=self.num_ranks).tolist()
        if use_fp8:
            token_parts = list(fp8.per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0))
        else:
            token_parts = [x]
        meta = torch.stack([expert % local, token], dim=1).to(torch.int32)
        specs = row_specs(token_parts) + [(torch.int32, 2)]
        payload = torch.cat([pack_rows(token_parts)[token], pack_rows([meta])], dim=1)
        if meeting is None:
            recv_counts = self._all_to_all_ints(send_counts)
            pending = self._exchange_counted_rows(payload, send_counts, recv_counts)
        else:
            recv_counts = [0] * self.num_ranks
            pending = self.survivors.send_rows(meeting, "dispatch", payload, send_counts)

        rows = num_max_tokens * self.num_ranks
        recv_x = torch.zeros(local, rows, hidden, dtype=FP8_DTYPE if use_fp8 else x.dtype, device=x.device)
        recv_scales = None
        if use_fp8:
            scale_cols = token_parts[1].shape[1]
            recv_scales = torch.zeros(local, rows, scale_cols, dtype=token_parts[1].dtype, device=x.device)
        recv_count = torch.zeros(local, dtype=torch.int32, device=x.device)
        state = _LowLatencyState(token, slot, send_counts, recv_counts)
        handle.backend_state = state

        def receive():
            received, recv_counts = pending()
            state.recv_counts[:] = recv_counts
            parts = unpack_rows(received, specs)
            arrival_expert = parts[-1][:, 0].long()
            # Arrivals come grouped by source rank, each group in source token order; a stable sort
            # by expert keeps that order within every expert.
            by_expert = torch.sort(arrival_expert, stable=True).indices
            counts = torch.bincount(arrival_expert, minlength=local)
            starts = torch.cumsum(counts, 0) - counts
            arrival_row = torch.empty_like(arrival_expert)
            arrival_row[by_expert] = (
                torch.arange(by_expert.numel(), dtype=torch.int64, device=by_expert.device)
                - starts[arrival_expert[by_expert]]
            )
            recv_x[arrival_expert, arrival_row] = parts[0]
            if recv_scales is not None:
                recv_scales[arrival_expert, arrival_row] = parts[1]
            recv_count.copy_(counts.to(torch.int32))
            if stats is not None:
                stats.add_(counts.to(stats.dtype))
            state.arrival_expert, state.arrival_row = arrival_expert, arrival_row
            sources = torch.repeat_interleave(torch.arange(self.num_ranks, dtype=torch.int32, device="cpu"),
                                              torch.tensor(recv_counts, dtype=torch.int64, device="cpu")).to(x.device)
            source = torch.full((local, rows), -1, dtype=torch.int32, device=x.device)
            source[arrival_expert, arrival_row] = sources * num_max_tokens + parts[-1][:, 1]
            handle.recv_source = source

        hook = receive
        if not return_recv_hook:
            receive()
            hook = None
        recv = (recv_x, recv_scales) if use_fp8 else recv_x
        return recv, recv_count, hook

    def _low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        return_recv_hook: bool,
        out: Optional[torch.Tensor],
        form: Form,
    ):
        state: _LowLatencyState = handle.backend_state
        if state is None or state.arrival_expert is None:
            message = "handle: its low_latency_dispatch has not received yet: call the dispatch's hook() first"
            self.gate.refuse("low_latency_combine", f"RuntimeError: {message}")
            raise RuntimeError(message)
        rows = x[state.arrival_expert, state.arrival_row]
        if self.survivors is None:
            self.gate.enter("low_latency_combine", form)
            pending = self._exchange_counted_rows(pack_rows([rows]), state.recv_counts, state.send_counts)
        else:
            meeting = self.survivors.meet("low_latency_combine", form)
            returning = [c if r in meeting.present else 0 for r, c in enumerate(state.recv_counts)]
            kept = self._on_ranks(self._rank_of_each(state.recv_counts, rows.device), meeting.present)
            pending = self.survivors.send_rows(meeting, "combine", pack_rows([rows[kept]]), returning)
        num_tokens, num_topk = topk_idx.shape
        combined = (
            out if out is not None else torch.empty(num_tokens, x.shape[2], dtype=torch.bfloat16, device=x.device)
        )

        def receive():
            received, returned_counts = pending()
            (returned,) = unpack_rows(received, [(x.dtype, x.shape[2])])
            token, slot = state.send_token, state.send_slot
            # A rank that returned nothing was masked: its experts' rows leave the sum, as if never routed.
            masked = [r for r, (sent, came) in enumerate(zip(state.send_counts, returned_counts)) if sent and not came]
            if masked:
                back = ~self._on_ranks(self._rank_of_each(state.send_counts, x.device), masked)
                token, slot = token[back], slot[back]
            per_slot = torch.zeros(num_tokens, num_topk, x.shape[2], dtype=torch.float32, device=x.device)
            per_slot[token, slot] = returned.float()
            reached = torch.zeros(num_tokens, num_topk, dtype=torch.bool, device=x.device)
            reached[token, slot] = True
            acc = torch.zeros(num_tokens, x.shape[2], dtype=torch.float32, device=x.device)
            for k in range(num_topk):
                take = reached[:, k : k + 1]
                acc = torch.where(take, acc + topk_weights[:, k : k + 1] * per_slot[:, k], acc)
            combined.copy_(acc.to(combined.dtype))

        hook = receive
        if not return_recv_hook:
            receive()
            hook = None
        return combined, hook

