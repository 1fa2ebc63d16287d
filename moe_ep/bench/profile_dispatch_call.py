"""Where one intranode dispatch call's time goes, host and device side by side, all ranks running.

The benchmark's wall time per call can exceed the kernels' device time (at 2 ranks the one-pass
dispatch's blocks run ~1/3 of it): this says whether the host or the GPU is the bottleneck. Every
launch the call makes (count exchange, dispatch kernel) and the host's wait for the counts is timed
on the host clock, and device events around each launch give the kernels' durations and the gaps
between them (a fresh dispatch makes all three in one call into the extension, timed as one). Medians
over the timed calls, per rank; the whole call also by its mean (the benchmark's measure), 90th
percentile and slowest.

    python -m moe_ep.bench.profile_dispatch_call --ranks 2 [--arena] [--fp8] [--python-profile 15]

--python-profile N: after the timed calls, as many again under cProfile, and each rank's N functions
(Python and C: torch's calls included) of the largest own time per call: where the host's time before
and between the launches goes (cProfile adds about a microsecond per function call: the shares matter,
not the sums).

With --stub-kernels (any machine, one process): the Python layer alone, CPU tensors, the extension's
entry points and torch.cuda's stream calls replaced by no-ops: Buffer.dispatch's checks, and the kernel
backend's dispatch as if the counts of `--ranks` ranks had arrived.
"""
from __future__ import annotations

import collections
import statistics
import time

import torch
import torch.distributed as dist

from moe_ep import Buffer, fp8
from moe_ep.arena import Arena
from moe_ep.backends.base import DispatchCall
from moe_ep.config import INTRANODE_SLOT_ALIGN, Config, arena_bytes, arena_dispatch_region
from moe_ep.diagnostics import kernel_backend
from moe_ep.events import EventOverlap
from moe_ep.handles import DispatchHandle
from moe_ep.launch import free_port

from . import command_parser
from .timing import host_call_us, own_time_per_call, print_own_times
from .torchrun import add_ranks_argument, joined, one_node_only, rank_counts, start_ranks

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = [2]

LAUNCHES = ("intranode_notify", "intranode_dispatch", "intranode_zero_copy_dispatch",
             "intranode_zero_copy_dispatch_early", "intranode_dispatch_fresh")
# Entry points called on the caller's stream that launch on the communication stream (a fresh dispatch:
# its count exchange and its kernel from one call).
LAUNCHES_TO_COMM = ("intranode_zero_copy_dispatch_early", "intranode_dispatch_fresh")


class TimedOps:
    """The extension's entry points, each call timed on the host; a launch also gets device events
    before and after it on the stream it goes to (the current one, where the backend enters the
    communication stream around its launches; `comm_stream` for LAUNCHES_TO_COMM)."""

    def __init__(self, ops, marks: list, comm_stream):
        self._ops, self._marks, self._comm_stream = ops, marks, comm_stream

    def __getattr__(self, name):
        fn = getattr(self._ops, name)

        def timed(*args):
            launch = name in LAUNCHES
            if launch:
                stream = self._comm_stream if name in LAUNCHES_TO_COMM else torch.cuda.current_stream()
                before = torch.cuda.Event(enable_timing=True)
                before.record(stream)
            start = time.perf_counter()
            result = fn(*args)
            host_us = (time.perf_counter() - start) * 1e6
            after = None
            if launch:
                after = torch.cuda.Event(enable_timing=True)
                after.record(stream)
            self._marks.append((name, start, host_us, before if launch else None, after))
            return result

        return timed


def rank_profile(args):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7 + rank)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    if args.fp8:
        x = fp8.per_token_cast_to_fp8(x)
    topk_idx = torch.rand(args.tokens, args.experts, dtype=torch.float32, device="cuda").topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device="cuda")
    config = Buffer.get_dispatch_config(num_ranks)
    # Every row a rank could receive, as bf16 with fp8 scales (an upper bound for either kind of row).
    received = args.tokens * num_ranks
    arena = arena_bytes(received, args.hidden * 2, args.hidden // 128 * 4, args.topk) if args.arena else 0
    buffer = Buffer(dist.group.WORLD, config.get_nvl_buffer_size_hint(args.hidden * 2, num_ranks),
                    explicitly_destroy=True, num_arena_bytes=arena)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=topk_weights)

    def call():
        return buffer.dispatch(x, config=config, **layout)

    for _ in range(5):
        call()
    marks = []
    kernels = kernel_backend(buffer)  # its extension calls are wrapped to time each launch
    kernels.ops = TimedOps(kernels.ops, marks, kernels.comm_stream)
    torch.cuda.synchronize()
    dist.barrier()
    calls = []
    for _ in range(args.iters):
        first = len(marks)
        start = time.perf_counter()
        call()
        calls.append((start, (time.perf_counter() - start) * 1e6, first, len(marks)))
    torch.cuda.synchronize()
    kernels.ops = kernels.ops._ops
    python_profile = []
    if args.python_profile:
        torch.cuda.synchronize()
        dist.barrier()
        python_profile = own_time_per_call(call, args.iters, args.python_profile)
        torch.cuda.synchronize()
    buffer.destroy()

    rows = {}

    def add(key, value):
        rows.setdefault(key, []).append(value)

    previous_end = None
    for start, wall_us, first, last in calls:
        add("host: whole call", wall_us)
        mine = marks[first:last]
        for name, at, host_us, before, after in mine:
            add(f"host: {name}", host_us)
            add(f"host: call start -> {name}", (at - start) * 1e6)
            if before is not None:
                add(f"device: {name}", before.elapsed_time(after) * 1e3)
        launches = [(name, before, after) for name, _, _, before, after in mine if before is not None]
        for (_, _, end_a), (name_b, start_b, _) in zip(launches, launches[1:]):
            add(f"device gap before {name_b}", end_a.elapsed_time(start_b) * 1e3)
        if previous_end is not None and launches:
            add("device gap since the previous call", previous_end.elapsed_time(launches[0][1]) * 1e3)
        if launches:
            previous_end = launches[-1][2]
    summary = {key: statistics.median(values) for key, values in rows.items()}
    # The benchmark's figure is a mean over back-to-back calls: a tail of slow calls shows here.
    whole = sorted(rows["host: whole call"])
    summary["host: whole call, mean"] = statistics.fmean(whole)
    summary["host: whole call, 90th percentile"] = whole[int(0.9 * (len(whole) - 1))]
    summary["host: whole call, slowest"] = whole[-1]
    return summary, python_profile


class _NoLaunches:
    """The extension's intranode entry points doing nothing; the count wait finds the counts there, and a
    one-pass kernel chooses from this rank's room alone (as if every peer had room too)."""

    def __init__(self, host, enums):
        self._host = host  # the backend's host-mapped ints, where a fresh dispatch's choice lands
        self._enums = enums  # the backend's KernelEnums: the host record's slots

    def wait_host_value(self, host_info, index, value, timeout_s):
        host_info[index] = value
        return True

    def intranode_zero_copy_dispatch_early(self, ctx, num_sms, x, scales, topk_idx, topk_weights, in_rank, per_rank,
                                           per_expert, local, nonce, recv_info_ints, *rest):
        # rest ends with the target the kernel lays the rows out in (its offset, the most rows the side
        # outputs hold, part offsets, its bytes), then the choice and the one-pass count.
        capacity, length, num_topk = rest[-5], rest[-3], topk_idx.shape[1]
        rows = x.shape[0] * in_rank.shape[1]  # every token to every rank, as stub_backend's counts say
        needed = arena_dispatch_region(rows, x.shape[1] * x.element_size(),
                                       0 if scales is None else scales.shape[1] * scales.element_size(), num_topk)
        self._host[self._enums.host_info.CHOICE] = int(capacity > 0 and needed.slot_bytes <= length)
        ints = dict(dtype=torch.int32, device="cpu")
        return (torch.empty(x.shape[0], in_rank.shape[1], **ints), torch.empty(recv_info_ints, **ints),
                torch.empty(capacity, **ints), torch.empty(capacity, num_topk, dtype=torch.int64, device="cpu"),
                torch.empty(capacity, num_topk, dtype=torch.float32, device="cpu"))

    def intranode_dispatch_fresh(self, ctx, num_sms, x, scales, topk_idx, topk_weights, in_rank, per_rank, per_expert,
                                 local, nonce, recv_info_ints, *rest):
        # The counts stubbed_python_layer put in host memory: every token to every rank.
        ranks, num_topk, ints = in_rank.shape[1], topk_idx.shape[1], dict(dtype=torch.int32, device="cpu")
        rows = x.shape[0] * ranks
        return (torch.empty(x.shape[0], ranks, **ints), torch.empty(recv_info_ints, **ints), torch.empty(rows, **ints),
                torch.empty(rows, x.shape[1], dtype=x.dtype, device="cpu"), None,
                torch.empty(rows, num_topk, dtype=torch.int64, device="cpu"),
                torch.empty(rows, num_topk, dtype=torch.float32, device="cpu"),
                [x.shape[0]] * ranks, [x.shape[0]] * ranks,
                [x.shape[0] * ranks // local] * local)

    def intranode_zero_copy_dispatch(self, *args):
        choice, capacity_rows = args[-3], args[15]
        choice[0] = int(capacity_rows >= 0)

    def intranode_zero_copy_combine(self, *args):
        choice, capacity_rows = args[-2], args[-4]
        choice[0] = int(capacity_rows >= 0)

    def __getattr__(self, name):
        return lambda *args: None


class _NoStream:
    cuda_stream = 0

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoEvent:
    def record(self, stream=None):
        pass


def stub_backend(ranks: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: int,
                 setattr_=setattr, arena: bool = False):
    """An IntranodeBackend on CPU tensors whose launches and torch.cuda stream calls do nothing (they are
    replaced through setattr_: pytest's monkeypatch.setattr undoes it), with `ranks` ranks' counts in its
    host memory (every token of x to every rank) and, with `arena`, a fixed arena in host memory with
    room for two such dispatches' rows, whose calls take one pass where this rank has room (its peers
    are taken to agree). -> (backend, call(x_parts, num_worst_tokens=0, handle=None) -> what the
    backend's dispatch returns)"""
    import contextlib
    import ctypes
    import types

    from moe_ep.backends import intranode
    from moe_ep.backends.peers import kernel_enums

    tokens, topk = x.shape[0], topk_idx.shape[1]
    setattr_(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    setattr_(torch.cuda, "current_stream", lambda *a: _NoStream())
    setattr_(torch.cuda, "is_current_stream_capturing", lambda: False)
    backend = intranode.IntranodeBackend.__new__(intranode.IntranodeBackend)
    backend.enums = kernel_enums()  # the extension's numbers, or the header's where none is built
    counts = backend.enums.host_info.COUNTS
    host_info = torch.zeros(counts + 2 * ranks + experts + 64, dtype=torch.int32, device="cpu")
    backend.host_info = host_info  # read as the real one is: a ctypes view of pinned memory
    backend._host = (ctypes.c_int32 * host_info.numel()).from_address(host_info.data_ptr())
    backend.ops = _NoLaunches(backend._host, backend.enums)
    backend.rank, backend.num_ranks, backend.recv_info_ints, backend.timeout_s = 0, ranks, 64, 20.0
    backend.prefix_matrix_at, backend._choice = 0, torch.zeros(1, dtype=torch.int32)
    backend.one_pass_calls = torch.zeros(2, dtype=torch.int32)
    backend._one_pass_dispatches, backend._one_pass_combines = backend.one_pass_calls[0:1], backend.one_pass_calls[1:2]
    backend.ctx, backend.comm_stream = types.SimpleNamespace(wait_ns=0), _NoStream()
    backend._compute_ready, backend._compute_ready_next = [_NoEvent() for _ in range(intranode.RECENT_CALLS)], 0
    backend._comm_done = _NoEvent()
    backend._nonce, backend._fitting_sms, backend._wait_rows = 0, set(), None
    backend._recent_calls = collections.deque(maxlen=intranode.RECENT_CALLS)
    backend.peers = types.SimpleNamespace(timeout_error=lambda: None)
    backend._host[counts: counts + ranks] = [tokens] * ranks
    backend.arena_area = backend.arena = None
    if arena:
        area = arena_bytes(tokens * ranks, x.shape[1] * x.element_size(), 0, topk, num_live=2)
        memory = torch.empty(area, dtype=torch.uint8, device="cpu")
        backend.arena_area = types.SimpleNamespace(addresses=[memory.data_ptr()] * ranks, device=torch.device("cpu"),
                                                   pointers=torch.zeros(ranks, dtype=torch.int64, device="cpu"), memory=memory)
        backend.arena = Arena(area, INTRANODE_SLOT_ALIGN)
    backend.arena_grows = False  # growing maps a new area, collectively: not on a stub
    local = experts // ranks
    in_rank = torch.ones(tokens, ranks, dtype=torch.bool, device="cpu")
    per_expert = torch.full((experts,), tokens // local, dtype=torch.int32, device="cpu")
    config = Config(24, 6, 256, 6, 128)

    def call(x_parts, num_worst_tokens=0, handle=None):
        # A cached dispatch (handle) gets no layout, as Buffer.dispatch passes none with a handle.
        layout = dict(num_tokens_per_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                      topk_weights=None)
        if handle is None:
            layout.update(num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
        return backend.dispatch(DispatchCall(
            x_parts=x_parts, handle=handle, **layout, expert_alignment=1, num_worst_tokens=num_worst_tokens,
            config=config, previous_event=None, async_finish=False, allocate_on_comm_stream=False,
            make_handle=lambda **fields: DispatchHandle(buffer_serial=0, **fields)))

    return backend, call


def stubbed_python_layer(args) -> None:
    """Host time of the Python around a dispatch, with nothing launched (CPU tensors)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ranks = args.ranks[0]
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    topk_idx = torch.rand(args.tokens, args.experts, dtype=torch.float32, device="cpu").topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device="cpu")
    buffer = Buffer(dist.group.WORLD, Buffer.get_dispatch_config(ranks).get_nvl_buffer_size_hint(args.hidden * 2, 1))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)

    # Buffer.dispatch: its checks and stats' counting of host-known counts, the backend's call answered
    # at once with one handle of `ranks` ranks' counts, as a dispatch that waited for them leaves.
    local = args.experts // ranks
    handle = DispatchHandle(buffer_serial=buffer.serial, num_tokens=args.tokens, is_token_in_rank=in_rank,
                            send_counts=[args.tokens] * ranks, recv_counts=[args.tokens] * ranks, num_worst_tokens=0,
                            recv_expert_counts=[args.tokens * args.topk // args.experts] * local)

    class Answer:
        def dispatch(self, call):
            return call.x_parts, call.topk_idx, call.topk_weights, [], handle, EventOverlap()

    answer = Answer()
    buffer._normal_backend, buffer._check_data = (lambda t: answer), (lambda *a: False)
    checks = host_call_us(lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                  topk_weights=topk_weights), iters=2000, warmup=100)

    # The kernel backend's dispatch, `ranks` ranks' worth of counts, torch.cuda's stream calls stubbed:
    # the two-pass one, then one into an arena.
    print(f"intranode dispatch, Python layer only (launches and stream calls stubbed), {ranks} ranks' counts, "
          f"{args.experts} experts: median us per call")
    print(f"  {'Buffer.dispatch checks':<40} {checks:8.1f}")
    for arena, name in ((False, "backend dispatch"), (True, "backend dispatch, into the arena")):
        _, backend_call = stub_backend(ranks, x, topk_idx, topk_weights, args.experts, arena=arena)
        us = host_call_us(lambda: backend_call([x]), iters=2000, warmup=100)
        print(f"  {name:<40} {us:8.1f}")
        if args.python_profile:
            print_own_times(name, own_time_per_call(lambda: backend_call([x]), 2000, args.python_profile))
    dist.destroy_process_group()


def main():
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--fp8", action="store_true", help="fp8 rows with 1x128 scales (default bf16)")
    parser.add_argument("--arena", action="store_true",
                        help="Buffer(num_arena_bytes=...): the one-pass dispatch, recv_x in the arena")
    parser.add_argument("--python-profile", type=int, default=0, metavar="N",
                        help="also each rank's N functions of most own time per call, under cProfile (with "
                             "--stub-kernels: the backend's two-pass and arena dispatches)")
    parser.add_argument("--stub-kernels", action="store_true",
                        help="the Python layer alone, launches stubbed (CPU, one process; --ranks: whose counts)")
    args = parser.parse_args()
    if args.stub_kernels and joined() is not None:
        parser.error("--stub-kernels runs in one process: run it without torchrun")
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    one_node_only(parser, "profile_dispatch_call times intranode dispatches")
    if args.stub_kernels:
        stubbed_python_layer(args)
        return
    if not torch.cuda.is_available():
        parser.error("needs a GPU: it times the kernels' launches")
    for num_ranks in args.ranks:
        with start_ranks(num_ranks, use_cuda=True) as pool:
            results = pool.run(rank_profile, args)
        per_rank = [timings for timings, _ in results]
        kind = ("fp8" if args.fp8 else "bf16") + (" arena" if args.arena else "")
        print(f"== {num_ranks} ranks, {kind} dispatch, {args.tokens} tokens, hidden {args.hidden}: median us per "
              f"call (rank 0 .. {num_ranks - 1})")
        for key in sorted(per_rank[0], key=lambda k: (not k.startswith("host: whole"), k)):
            print(f"  {key:<52} " + " ".join(f"{r.get(key, float('nan')):8.1f}" for r in per_rank))
        for rank, (_, profile) in enumerate(results):
            if profile:
                print_own_times(f"rank {rank}", profile)


if __name__ == "__main__":
    main()
