"""What a Buffer tells about itself: the errors its kernels reported, counters of its calls, and how its
ranks reach each other. `Buffer.check_errors`, `stats`, `reset_stats` and `topology` delegate here.

The counters cost a call next to nothing: the host adds one to a dict entry per call, queues the counts
it already knows (a list reference per call, summed when read), and the one-pass kernels add to a device
tensor that nobody reads until `stats()` asks (no host synchronisation and no extra kernel in a call).
Counts that only the device has (num_worst_tokens dispatches on the kernels, the low-latency kernels)
take a few small device ops per call (one kernel per low-latency call), only while the Buffer collects
them: `reset_stats()` starts collecting, `reset_stats(collect=False)` stops. `kernel_backend` hands
benchmarks and white-box tests the kernel backend itself.
"""

from __future__ import annotations

import operator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from . import _native

if TYPE_CHECKING:  # the Buffer imports this module
    from .buffer import Buffer

# The calls `stats()["calls"]` counts, by kind: a dispatch given a handle is a "cached_dispatch".
CALL_KINDS = ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine", "low_latency_dispatch",
              "low_latency_combine")
# The paths `topology()["peers"]` names: this rank, a peer's buffer mapped on this GPU or on another GPU
# of the host, a peer reached by NVSHMEM puts only, and a peer reached through torch.distributed.
PEER_PATHS = ("self", "same_gpu", "nvlink", "nvshmem_put", "portable")


def call_counts() -> Dict[str, int]:
    """A Buffer's host counters: every call kind at 0."""
    return dict.fromkeys(CALL_KINDS, 0)


# Host counts queued before they are summed: a call appends the lists it has, a read (or every
# FOLD_AFTER calls, to bound the queue) sums them, so a call pays an append and no tensor op.
FOLD_AFTER = 256
# Bytes a top-k entry of a fresh dispatch carries: its int64 expert id and its float32 weight.
TOPK_ENTRY_BYTES = 8 + 4


def _row_bytes(t: torch.Tensor) -> int:
    return t.shape[-1] * t.element_size()


def _grown(t: torch.Tensor, n: int) -> torch.Tensor:
    """1-D t zero-padded to n entries (t itself where it has them)."""
    return t if t.numel() >= n else torch.cat([t, t.new_zeros(n - t.numel())])


def _per_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int64 [num_buckets]: how many of ids (any shape, entries in [0, num_buckets]) fall in each bucket;
    entries equal to num_buckets are dropped. A scatter-add: no host synchronisation (bincount has one)."""
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_buckets + 1, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_buckets]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _record(stream, *tensors) -> None:
    """Keeps CUDA tensors read on `stream` from being reused before it is done with them (not while a
    graph is being captured: its memory is the graph's)."""
    for t in tensors:
        if t is not None and t.is_cuda and not torch.cuda.is_current_stream_capturing():
            t.record_stream(stream)


def _on(stream):
    """The stream context of device counting (none for CPU tensors, which the tests count the same way)."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


class Traffic:
    """What stats() reports beside the call counts: tokens received per local expert, payload bytes per
    peer (stats() defines both) and the buffer bytes the calls needed.

    Counts the host knows (every count of the portable backend on CPU tensors; a dispatch on the kernels
    that waited for its counts, its cached dispatches and combines) are queued as the lists the call
    already has. Counts only the device has are added by a few small torch ops per call (a low-latency
    call on the kernels: one kernel) into an int64 tensor per stream ([sent bytes R | received bytes R |
    expert tokens]), only while `collecting`; a call whose counts were left out counts in `uncounted`.
    (The device path takes CPU tensors too, as the tests give it.)"""

    def __init__(self, rank: int, num_ranks: int):
        self.rank, self.num_ranks = rank, num_ranks
        self.collecting = False
        self._device: Dict[tuple, torch.Tensor] = {}  # (device, stream id) -> accumulator
        # (device, stream id) -> the last low-latency dispatch's tokens per local expert, counted by the kernel
        self._device_last: Dict[tuple, torch.Tensor] = {}
        self.clear()

    def clear(self) -> None:
        if hasattr(self, "_queued"):
            self._fold()  # for the size of expert_tokens, which a reset keeps
        if self._device:  # every stream done with them, zeroed, and the zeros in place before any later op
            self._synchronize({key[0] for key in self._device})
            for acc in self._device.values():
                acc.zero_()
            self._synchronize({key[0] for key in self._device})
        # Row bytes -> (lists of rows sent to each rank, lists of rows received from each), by call.
        self._rows_queue: Dict[int, tuple] = {}
        self._experts_queue: List[list] = []
        self._queued = 0
        self._bytes = [[0] * self.num_ranks, [0] * self.num_ranks]  # sent, received
        # A reset keeps the size expert_tokens had, on the host or the device.
        local = max([len(getattr(self, "_experts", []))]
                    + [acc.numel() - 2 * self.num_ranks for acc in self._device.values()])
        self._experts = [0] * local
        self._last = [0] * local  # the last dispatch's expert counts: a list, a device tensor, or None
        self.uncounted = 0
        self.needed = dict(nvl=0, rdma=0)

    # ------------------------------------------------------------ what the calls report
    def need(self, nvl: int, rdma: int) -> None:
        """A call that needed these buffer sizes (the size hints its checks compared)."""
        if nvl > self.needed["nvl"]:
            self.needed["nvl"] = nvl
        if rdma > self.needed["rdma"]:
            self.needed["rdma"] = rdma

    def dispatch(self, call, handle, recv_idx, event, comm_stream) -> None:
        """After a normal dispatch; handle: the new one, or the cached dispatch's. comm_stream: where an
        async_finish call on the kernels ran (device counting goes there, before its event), else None."""
        fresh = call.handle is None
        parts = call.x_parts
        row = _row_bytes(parts[0]) + (_row_bytes(parts[1]) if len(parts) == 2 else 0)
        if fresh and call.topk_idx is not None:
            row += call.topk_idx.shape[1] * TOPK_ENTRY_BYTES
        host_rows = handle.send_counts is not None
        experts = handle.recv_expert_counts
        if host_rows:
            self._queue_rows(row, handle.send_counts, handle.recv_counts)
        if isinstance(experts, list):
            self._experts_queue.append(experts)
            self._queued += 1
            self._last = experts
        self._fold_if_long()
        if host_rows and isinstance(experts, list):
            return
        local = call.num_tokens_per_expert.shape[0] // self.num_ranks if fresh else None
        if not (self.collecting and self._count_normal(handle, row, False, not isinstance(experts, list),
                                                       recv_idx if fresh else None, local, event, comm_stream)):
            self.uncounted += 1
            if not isinstance(experts, list):
                self._last = None

    def combine(self, call, event, comm_stream) -> None:
        """After a normal combine: every returned row carries x's row and, where given, its weights."""
        handle = call.handle
        row = _row_bytes(call.x) + (0 if call.topk_weights is None else _row_bytes(call.topk_weights))
        if handle.send_counts is not None:
            self._queue_rows(row, handle.recv_counts, handle.send_counts)
            self._fold_if_long()
        elif not (self.collecting and self._count_normal(handle, row, True, False, None, None, event, comm_stream)):
            self.uncounted += 1

    def low_latency_dispatch(self, call, recv_x, recv_count: torch.Tensor, hook):
        """After a low-latency dispatch: counts what it receives once it has (now, or when the hook ran).
        -> the hook to hand the caller."""
        row = sum(_row_bytes(p) for p in (recv_x if isinstance(recv_x, tuple) else (recv_x,)))
        state = call.handle.backend_state
        host_rows = isinstance(getattr(state, "send_counts", None), list)  # the portable backend's
        if host_rows:
            self._queue_rows(row, state.send_counts, state.recv_counts)
            self._fold_if_long()
        on_host = not recv_count.is_cuda
        if not (on_host or self.collecting):
            self.uncounted += 1
            self._last = None
            return hook

        def count():
            if on_host:
                self._last = recv_count.tolist()
                self._experts_queue.append(self._last)
                self._queued += 1
            elif not self._count_low_latency(call.handle, call.topk_idx, row, recv_count, host_rows, False):
                self.uncounted += 1
                self._last = None

        if hook is None:
            count()
            return None

        def counted_hook():
            hook()
            count()

        return counted_hook

    def low_latency_combine(self, call) -> None:
        """After a low-latency combine: one bf16 row back per row its dispatch delivered."""
        row = call.handle.hidden * 2
        state = call.handle.backend_state
        if isinstance(getattr(state, "send_counts", None), list):
            self._queue_rows(row, state.recv_counts, state.send_counts)
            self._fold_if_long()
        elif not (self.collecting and self._count_low_latency(call.handle, call.topk_idx, row, None, False, True)):
            self.uncounted += 1

    # ------------------------------------------------------------ device counting (only while collecting)
    @staticmethod
    def _synchronize(devices) -> None:
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    @staticmethod
    def _stream(device: torch.device, comm_stream=None):
        """Where a call's device counting runs: comm_stream, else the caller's stream; None on CPU."""
        if device.type != "cuda":
            return None
        return comm_stream if comm_stream is not None else torch.cuda.current_stream(device)

    def _accumulator(self, device: torch.device, stream, local: int) -> Optional[torch.Tensor]:
        """This stream's int64 [2R + experts] accumulator with room for `local` experts (made or grown on
        the stream); None while a graph is captured and it would have to be made."""
        key = (device, None if stream is None else stream.cuda_stream)
        acc = self._device.get(key)
        length = 2 * self.num_ranks + local
        if acc is not None and acc.numel() >= length:
            return acc
        if _capturing(device):
            return None
        with _on(stream):
            grown = torch.zeros(length, dtype=torch.int64, device=device)
            if acc is not None:
                grown[: acc.numel()] += acc
        self._device[key] = grown
        return grown

    def _count_normal(self, handle, row: int, reverse: bool, experts: bool, recv_idx, local, event,
                      comm_stream) -> bool:
        """Adds a kernel call's rows per rank (from the handle's is_token_in_rank and rank prefix matrix;
        reverse: a combine's, which go the other way) times `row` bytes where the host did not know them,
        and with `experts` its tokens per local expert: the handle's, else counted from a fresh dispatch's
        recv_idx (and kept on the handle for its cached dispatches). Runs on the caller's stream, which a
        synchronous call has ordered after its kernels, or for an async_finish call on the communication
        stream, re-recording the call's event behind it. -> whether every count was added."""
        device = handle.is_token_in_rank.device
        stream = self._stream(device, comm_stream)
        counts = handle.recv_expert_counts if experts else None
        complete = not experts or isinstance(counts, torch.Tensor) or recv_idx is not None
        if isinstance(counts, torch.Tensor):
            local = counts.numel()
        with _on(stream):
            acc = self._accumulator(device, stream, local or 0)
            if acc is None:
                return False
            r = self.num_ranks
            if handle.send_counts is None:
                _record(stream, handle.is_token_in_rank, handle.rank_prefix_matrix)
                sent = handle.is_token_in_rank.sum(0, dtype=torch.int64)
                column = handle.rank_prefix_matrix[:, self.rank].to(torch.int64)
                received = torch.diff(column, prepend=column.new_zeros(1))
                rows = torch.cat([received, sent] if reverse else [sent, received])
                acc[: 2 * r] += rows * row
            if experts and counts is None and recv_idx is not None:
                _record(stream, recv_idx)
                # Padding rows hold -1 only: the true received counts. -1 entries go to bucket 0, dropped.
                counts = handle.recv_expert_counts = _per_bucket(recv_idx + 1, local + 1)[1:]
            if isinstance(counts, torch.Tensor):
                _record(stream, counts)
                acc[2 * r: 2 * r + local] += counts
                self._last = counts
        if comm_stream is not None and event.event is not None:
            event.event.record(comm_stream)
        return complete

    def _count_low_latency(self, handle, topk_idx, row: int, recv_count, host_rows: bool, combine: bool) -> bool:
        """On the caller's stream, where the kernels ran: the rows per rank of a low-latency call (one per
        (token, expert) pick: sent from topk_idx, received from the handle's sources; a combine's go the
        other way) times `row` bytes, unless the host knew them; with recv_count, the dispatch's tokens
        per local expert."""
        stream = self._stream(topk_idx.device)
        local = handle.num_experts // self.num_ranks
        acc = self._accumulator(topk_idx.device, stream, local)
        if acc is None:
            return False
        state = handle.backend_state
        if not host_rows and stream is not None and hasattr(state, "recv_src_info") and _native.has_kernels():
            return self._count_low_latency_kernel(handle, topk_idx, row, acc, stream, local, combine)
        r = self.num_ranks
        if not host_rows:
            picks = torch.where(topk_idx >= 0, torch.div(topk_idx, local, rounding_mode="floor"), r)
            sent = _per_bucket(picks, r)
            source = handle._source()
            sources = torch.where(source >= 0, torch.div(source, handle.num_max_dispatch_tokens_per_rank,
                                                          rounding_mode="floor"), r)
            received = _per_bucket(sources, r)
            acc[: 2 * r] += torch.cat([received, sent] if combine else [sent, received]) * row
        if recv_count is not None:
            self._last = recv_count.to(torch.int64)  # a copy: the caller owns recv_count
            acc[2 * r: 2 * r + local] += self._last
        return True

    def _count_low_latency_kernel(self, handle, topk_idx, row: int, acc, stream, local: int, combine: bool) -> bool:
        """_count_low_latency's counts for the kernels' handles in one launch (the torch ops above took two
        dozen small kernels a call); a dispatch's tokens per local expert land in a buffer kept per stream."""
        key = (topk_idx.device, stream.cuda_stream)
        last = self._device_last.get(key)
        if last is None or last.numel() < local:
            if _capturing(topk_idx.device):
                return False
            last = self._device_last[key] = torch.zeros(local, dtype=torch.int64, device=topk_idx.device)
        state = handle.backend_state
        _native.ops().count_low_latency_rows(topk_idx.contiguous(), local, state.recv_src_info, state.recv_count,
                                             topk_idx.shape[1], handle.num_max_dispatch_tokens_per_rank, combine,
                                             row, acc, last)
        if not combine:
            self._last = last[:local]
        return True

    # ------------------------------------------------------------ reading
    def _queue_rows(self, row: int, sent: list, received: list) -> None:
        queued = self._rows_queue.get(row)
        if queued is None:
            queued = self._rows_queue[row] = ([], [])
        queued[0].append(sent)
        queued[1].append(received)
        self._queued += 1

    def _fold_if_long(self) -> None:
        if self._queued >= FOLD_AFTER:
            self._fold()

    def _fold(self) -> None:
        """Sums the queued host counts into the host totals (column sums over Python ints: the cheapest
        way from lists, about 20 ns an entry)."""
        for row, queued in self._rows_queue.items():  # calls of equal row bytes: one product per rank
            for i, lists in enumerate(queued):
                self._bytes[i] = [total + row * sum(column) for total, column in zip(self._bytes[i], zip(*lists))]
        self._rows_queue = {}
        if self._experts_queue:
            for local in {len(q) for q in self._experts_queue}:
                self._experts += [0] * (local - len(self._experts))
                sums = [sum(column) for column in zip(*(q for q in self._experts_queue if len(q) == local))]
                self._experts[:local] = map(operator.add, self._experts[:local], sums)
            self._experts_queue = []
        self._queued = 0

    def read(self) -> dict:
        """The counters as stats() reports them (waits for the devices the device counters are on)."""
        self._fold()
        totals = torch.tensor(self._bytes, dtype=torch.int64)
        experts = torch.tensor(self._experts, dtype=torch.int64)
        devices = {key[0] for key in self._device}
        if isinstance(self._last, torch.Tensor):
            devices.add(self._last.device)
        self._synchronize(devices)
        r = self.num_ranks
        for acc in self._device.values():
            acc = acc.cpu()
            totals += acc[: 2 * r].view(2, r)
            experts = _grown(experts, acc.numel() - 2 * r)
            experts[: acc.numel() - 2 * r] += acc[2 * r:]
        last = self._last
        if last is not None:
            last = last.to("cpu", copy=True) if isinstance(last, torch.Tensor) else \
                torch.tensor(last, dtype=torch.int64)
        return dict(expert_tokens=experts, expert_tokens_last=last, sent_bytes=totals[0], recv_bytes=totals[1])


def check_errors(buffer: "Buffer") -> None:
    """Waits for the Buffer's kernels and raises what they reported since the last call: a peer that did
    not arrive (TimeoutError naming it and what was awaited; the Buffer's ranks are then out of step) or a
    num_worst_tokens dispatch that received more rows than it had (ValueError; reported once). These are
    what the Buffer's next call would raise otherwise. The intranode kernels run on the communication
    stream, which it waits for; the low-latency kernels run on the callers' streams, so with them it waits
    for the device. On the portable backend it does nothing: its errors are raised in the call itself."""
    buffer._check_alive()
    normal, low = _normal_kernels(buffer), buffer._low_latency
    if normal is not None:
        normal.comm_stream.synchronize()
        normal.check_errors()
    if low is not None:
        torch.cuda.synchronize(low.peers.device)
        low.check_errors()


def _normal_kernels(buffer: "Buffer"):
    """The kernel backend of the Buffer's normal calls (intranode or internode), or None before one exists."""
    return buffer._internode if buffer._internode is not None else buffer._intranode


def _zero_arena() -> dict:
    return dict(capacity=0, in_use=0, high_water=0, regions=0)


def stats(buffer: "Buffer") -> dict:
    """Counters since the Buffer was made or since reset_stats():

    - "calls": {kind: calls}, for each of CALL_KINDS, counted on the host when a call passed its
      argument checks and went to a backend (internode_dispatch / internode_combine count as dispatch /
      combine).
    - "one_pass_calls": {"dispatch": n, "combine": m}: the calls (cached dispatches included) that the
      device ran in one pass through the arena, counted by the kernels; 0 without the intranode kernels
      or an arena.
    - "arena": {"capacity", "in_use", "high_water": bytes, "regions": live regions} of this rank's
      intranode arena: its size, what live recv_x and combine inputs hold now, the most they held at once
      (a one-pass dispatch counts the rows it kept), and how many regions they are. All 0 where there is
      no arena: the portable backend, num_arena_bytes=0, or before the first call of CUDA tensors maps
      it. After an arena of the Buffer's own grew, the numbers are the new arena's (tensors of the old one
      live on outside it).
    - "expert_tokens": int64 [local experts]: tokens received per local expert, summed over dispatches:
      a normal dispatch's true received counts (num_recv_tokens_per_expert_list of a fresh dispatch
      without expert_alignment's padding; a num_worst_tokens dispatch's received rows, not its padded
      ones; a cached dispatch counts what its handle's dispatch received), a low-latency dispatch's
      recv_count. Sized by the most local experts a dispatch had (empty before the first).
    - "expert_tokens_last": the same for the last dispatch alone; None where that dispatch was not
      counted (see "uncounted_calls").
    - "sent_bytes" / "recv_bytes": int64 [R]: payload bytes this rank sent to / received from each rank
      (entry [rank]: rows it sends itself), summed over dispatches and combines. What counts: a normal
      dispatch moves one row per (token, destination rank) of x's row bytes, plus its scales' (fp8),
      plus, on a fresh dispatch given topk_idx, 12 bytes per top-k entry (int64 id, float32 weight); a
      combine moves each received row back: x's row bytes plus 4 per top-k weight where topk_weights is
      given; a low-latency dispatch moves one row per (token, expert) pick: x's row (bf16), or fp8 bytes
      plus its scales; a low-latency combine returns each as a bf16 row. Handle metadata (source
      indices, flags, counts) and padding rows are not counted.
    - "network_bytes": bytes this rank sent to ranks of other nodes (ranks_per_node), summed over normal
      dispatches and combines: on the internode kernels what they put across nodes, once per destination
      node (a message: the row, its scales, top-k ids and weights, its source index and its rows on that
      node's ranks; a combine sum: the row and its top-k weights), counted on the host; elsewhere the
      sent_bytes to other nodes' ranks (one copy per rank). 0 where the group is one node.
    - "buffer_capacity": {"nvl": num_nvl_bytes, "rdma": num_rdma_bytes, "arena": the arena's bytes}.
    - "buffer_high_water": {"nvl", "rdma": the size hints of the calls made (the largest
      Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint of the normal calls' rows and configs,
      and Buffer.get_low_latency_rdma_size_hint of the low-latency shapes): the bytes that would have
      sufficed for them; "arena": the arena's high-water mark}.
    - "collecting": whether the device-side counters are collected (reset_stats() starts, and
      reset_stats(collect=False) stops, collecting them).
    - "uncounted_calls": calls whose counts were left out of expert_tokens / sent_bytes / recv_bytes, in
      whole or in part (0: those counters are exact). The counts the host knows are always counted: every
      call of the portable backend on CPU tensors; on the kernels a dispatch without num_worst_tokens
      (which waits for its counts on the host), its cached dispatches and combines. The others, which only
      the device has (num_worst_tokens dispatches on the kernels, their cached dispatches and combines,
      low-latency calls on the kernels or on CUDA tensors), are counted only while collecting; even then
      a num_worst_tokens dispatch on the kernels without topk_idx leaves its expert counts out (nothing
      received tells them), as does a cached dispatch of a handle whose dispatch was not counted, and so
      does a first device-counted call made while a CUDA graph is captured.
    - "slow_ranks": {peer rank: {"count", "max_ms", "total_ms"}}: the meetings where this rank waited
      longer than MOE_EP_SLOW_RANK_MS (default moe_ep.slow_ranks.DEFAULT_SLOW_RANK_MS) for that peer, the
      last to arrive, with the longest and the total of those waits. Only the portable backend's host
      meetings (every call of CPU tensors, and of CUDA tensors the kernels do not serve) and the kernels'
      host set-up meetings tell this: the kernels wait for their peers on the device, which says nothing
      here. The first such wait for a peer, and every 100th after it, is logged as a warning on the
      "moe_ep" logger.

    Tensors are CPU tensors. Reading the device counters waits for the communication stream and, with
    device-side counters, for the device (not allowed while a CUDA graph is being captured). A call
    replayed from a CUDA graph adds to the device-side counters at every replay, to the host ones once."""
    one_pass = dict(dispatch=0, combine=0)
    arena = _zero_arena()
    kernels = buffer._intranode
    if kernels is not None:
        # Read on the communication stream, behind every call issued so far.
        with torch.cuda.stream(kernels.comm_stream):
            one_pass["dispatch"], one_pass["combine"] = kernels.one_pass_calls.tolist()
        if kernels.arena is not None:
            arena = kernels.arena.usage()
    traffic = buffer._traffic
    counted = traffic.read()
    if buffer._internode is not None:
        network = buffer._internode.network_bytes
    else:
        nodes = torch.arange(buffer.group_size) // buffer.ranks_per_node
        network = int(counted["sent_bytes"][nodes != buffer.rank // buffer.ranks_per_node].sum())
    return dict(
        calls=dict(buffer._calls), one_pass_calls=one_pass, arena=arena, **counted, network_bytes=network,
        buffer_capacity=dict(nvl=buffer.num_nvl_bytes, rdma=buffer.num_rdma_bytes, arena=arena["capacity"]),
        buffer_high_water=dict(traffic.needed, arena=arena["high_water"]),
        collecting=traffic.collecting, uncounted_calls=traffic.uncounted,
        slow_ranks=buffer._gate.slow_ranks.read(),
    )


def reset_stats(buffer: "Buffer", collect: bool = True) -> None:
    """Every counter of stats() back to 0 (expert_tokens keeps its size), the arena's high-water mark down
    to the bytes in use now, and the device-side counters collected from now on (collect=True) or not.
    The one-pass counter is zeroed on the communication stream, after the calls issued before; the
    device-side counters after the device finished them."""
    if not isinstance(collect, bool):
        raise TypeError(f"collect: expected a bool, got {type(collect).__name__}")
    buffer._calls.update(call_counts())
    buffer._traffic.clear()
    buffer._gate.slow_ranks.clear()
    buffer._traffic.collecting = collect
    if buffer._internode is not None:
        buffer._internode.network_bytes = 0
    kernels = buffer._intranode
    if kernels is not None:
        with torch.cuda.stream(kernels.comm_stream):
            kernels.one_pass_calls.zero_()
        if kernels.arena is not None:
            kernels.arena.reset_high_water()


def _peer_paths(rank: int, num_ranks: int, kernels: bool, peers, per_node: int = 0) -> List[Optional[str]]:
    """Per rank, how this rank reaches it (PEER_PATHS); None where the kernels serve but have not mapped
    the peers yet. per_node > 0: the internode kernels, which put to every rank of another node."""
    paths: List[Optional[str]] = []
    for r in range(num_ranks):
        if r == rank:
            paths.append("self")
        elif not kernels:
            paths.append("portable")
        elif peers is None:
            paths.append(None)
        elif r in peers.unreachable or (per_node and r // per_node != rank // per_node):
            paths.append("nvshmem_put")
        else:
            paths.append("same_gpu" if peers.device_ids[r] == peers.device_ids[rank] else "nvlink")
    return paths


def topology(buffer: "Buffer") -> dict:
    """How this Buffer's ranks are laid out and reach each other:

    - "rank", "num_ranks", "ranks_per_node", "node_of_rank" (list: each rank's node, ranks of a node
      being contiguous).
    - "normal_backend": what runs dispatch / combine of CUDA tensors: "intranode" (the kernels of one
      node), "internode" (the kernels across nodes) or "portable" (torch.distributed).
      "low_latency_backend": the same for the low-latency calls: "low_latency" (the kernels), "portable",
      or None (no low_latency_mode: the calls are refused).
      CPU tensors always run on the portable backend.
    - "portable_reasons": {"normal": ..., "low_latency": ...}: why the kernels do not serve those calls,
      or None where they do.
    - "mapped": {"normal": bool, "low_latency": bool}: whether the kernels have mapped the peers' buffers.
      They do so lazily, at the Buffer's first call of CUDA tensors of that kind (collectively); before
      that the entries below that depend on the mapping are None.
    - "peer_memory": {"normal": ..., "low_latency": ...}: how the peers' buffers were mapped: "vmm" (the
      driver's virtual-memory API), "ipc" (CUDA IPC handles), "nvshmem" (NVSHMEM's heap), or None
      (not mapped, or the portable backend). The intranode arena is mapped like the normal buffers.
    - "peers": {"normal": [...], "low_latency": [...]}: per rank, how this rank reaches it: "self",
      "same_gpu" (a mapped buffer of a rank on this GPU), "nvlink" (a mapped buffer of a rank on another
      GPU of the host), "nvshmem_put" (NVSHMEM puts only), "portable" (torch.distributed), or None
      (the kernels serve but have not mapped the peers yet). The low-latency list is None without
      low_latency_mode.
    - "ranks_on_this_gpu": ranks of the group on this rank's GPU (1 until the normal kernels mapped).
    - "build": moe_ep.backend_info(): the extension, NVSHMEM, SM90, and which backend runs what.

    It reads host state only: no communication, no synchronisation."""
    rank, num_ranks = buffer.rank, buffer.group_size
    normal, low = _normal_kernels(buffer), buffer._low_latency
    across_nodes = buffer.ranks_per_node < num_ranks
    ll_mode = buffer.low_latency_mode
    normal_reason = None if buffer._kernels else buffer._kernels_unusable(low_latency=False)
    ll_reason = None if buffer._ll_kernels else buffer._kernels_unusable(low_latency=True)
    return dict(
        rank=rank,
        num_ranks=num_ranks,
        ranks_per_node=buffer.ranks_per_node,
        node_of_rank=[r // buffer.ranks_per_node for r in range(num_ranks)],
        normal_backend=("internode" if across_nodes else "intranode") if buffer._kernels else "portable",
        low_latency_backend=("low_latency" if buffer._ll_kernels else "portable") if ll_mode else None,
        portable_reasons=dict(normal=normal_reason, low_latency=ll_reason),
        mapped=dict(normal=normal is not None, low_latency=low is not None),
        peer_memory=dict(normal=normal.peers.memory if normal is not None else None,
                         low_latency=low.peers.memory if low is not None else None),
        peers=dict(normal=_peer_paths(rank, num_ranks, buffer._kernels, normal.peers if normal else None,
                                      buffer.ranks_per_node if across_nodes else 0),
                   low_latency=_peer_paths(rank, num_ranks, buffer._ll_kernels, low.peers if low else None)
                   if ll_mode else None),
        ranks_on_this_gpu=buffer.ranks_on_this_gpu,
        build=_native.backend_info(),
    )


def kernel_backend(buffer: "Buffer", kind: str = "normal", make: bool = False):
    """For benchmarks and white-box tests of the kernels' measurement switches (wait profile, kernel log,
    streaming-combine ring rows, launch blocks) and of their memory: the backend object that runs this
    Buffer's calls of CUDA tensors of `kind`, "normal" (the IntranodeBackend, or the InternodeBackend where
    the group spans nodes) or "low_latency" (the
    LowLatencyBackend), or None where the portable backend serves them or no such call has made it yet.
    make=True first makes it where the kernels serve (collective: it maps the peers' buffers as the first
    call would). Its attributes are the backends' internals, not a stable API: prefer Buffer.stats() and
    Buffer.topology() wherever they answer the question."""
    if kind not in ("normal", "low_latency"):
        raise ValueError(f"kind: expected 'normal' or 'low_latency', got {kind!r}")
    buffer._check_alive()
    if make and torch.cuda.is_available():
        probe = torch.empty(0, device=torch.device("cuda", torch.cuda.current_device()))
        (buffer._normal_backend if kind == "normal" else buffer._low_latency_backend)(probe)
    return _normal_kernels(buffer) if kind == "normal" else buffer._low_latency
