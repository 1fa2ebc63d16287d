"""Intranode dispatch/combine bandwidth, all ranks of one host running concurrently (measured the way
DeepEP V1 was measured on the same machine).

Per rank: received bytes / wall time per call (host work included; `--iters` calls after `--warmup`,
a barrier before). bf16 rows count hidden * 2 bytes, fp8 rows hidden * (1 + 4/128) (values + scales);
combine counts the bf16 rows sent back. The *_arena modes run on a Buffer with an arena of a fixed size
(num_arena_bytes) with room for every call, so they are the one-pass calls: the dispatch stores the rows
straight into regions of the receivers' arenas, and combine_arena_input sums rows written into
empty_combine_input where they lie (combine_arena: rows of a tensor of their own, which the combine
copies into the arena first from 4 ranks up and sends the two-pass way below). The other modes run on a
Buffer without an arena (num_arena_bytes=0: the two-pass calls). The aggregate over ranks is also given
as a fraction of one process's plain device copy of the same number of bytes, measured in the same run,
and the mean per rank against DeepEP V1's figure for the same operation where the run has that figure's
shape (4096 tokens a rank, hidden 7168, top-8 of 256 experts, 24 SMs, every rank on one GPU).

    python -m moe_ep.bench.intranode --ranks 2 4 8 --sms 24
    python -m moe_ep.bench.intranode --ranks 4 --sms 8 16 24 32 48     # SM sweep
    python -m moe_ep.bench.intranode --ranks 4 --recv-tokens 64 128 256 512   # window (buffer) sweep
    python -m moe_ep.bench.intranode --ranks 4 8 --modes combine --recv-tokens 1024 --send-tokens 8 32 128
        # the streaming combine's send chunk (rows per owner a sending round writes)
    python -m moe_ep.bench.intranode --ranks 8 --profile-waits   # where the kernels' time goes
    python -m moe_ep.bench.intranode --ranks 8 --nccl     # one rank per GPU: also NCCL's all-to-all
    python -m moe_ep.bench.intranode --ranks 4 8 --modes combine   # only some of the modes
    python -m moe_ep.bench.intranode --ranks 2 --modes dispatch_fp8_arena dispatch_fp8_arena_cached
        # *_cached: from the first call's handle, no count exchange and no host wait (DeepEP's tests' way)
    python -m moe_ep.bench.intranode --ranks 2 4 8 --modes combine combine_arena combine_arena_input
        # the combine from the arena: of x elsewhere (copied in) and of x in empty_combine_input
    python -m moe_ep.bench.intranode --ranks 4 8 --modes combine --stream-combine 0   # the windowed combine
    python -m moe_ep.bench.intranode --ranks 8 --peer-memory ipc   # peers mapped through CUDA IPC handles

The buffer is sized by the size hint of the largest SM budget given (the kernels size their windows
from the buffer, not from num_sms), once per --recv-tokens value.

With --nccl (one rank per GPU, so the group is NCCL), `torch.distributed.all_to_all_single` moves the
same bf16 rows, already grouped by destination (the collective alone: its layout exchange and
permutation are not timed, which favours it).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch
import torch.distributed as dist

from moe_ep import Buffer, Config, fp8
from moe_ep.config import arena_bytes
from moe_ep.diagnostics import kernel_backend
from moe_ep.launch import RankPool
from moe_ep.backends.choices import PEER_MEMORY_KINDS, overridden
from moe_ep.backends.peers import Enumerators

from .timing import wall_seconds_per_call

MODES = ("dispatch_fp8", "dispatch_bf16", "dispatch_fp8_arena", "dispatch_bf16_arena", "combine",
         "combine_arena_input")
# On request only: dispatches from the first call's handle (no count exchange, no host wait: the
# kernels' own rate, and how DeepEP's tests time their dispatch).
CACHED_MODES = tuple(f"{m}_cached" for m in MODES if m.startswith("dispatch"))
# Also on request: the combine from the arena of rows in a tensor of the caller's own, which it copies
# into the arena first.
ALL_MODES = MODES + CACHED_MODES + ("combine_arena",)
# The order the modes run in: every dispatch, then the combines.
RUN_ORDER = tuple(m for m in ALL_MODES if m.startswith("dispatch")) + tuple(m for m in ALL_MODES if m.startswith("combine"))
NCCL_MODE = "nccl_all_to_all_bf16"
SKIPPED = "skipped"  # a result row that says an SM budget was refused, and why
# DeepEP V1 measured this benchmark's way on one H200 (4096 tokens a rank, hidden 7168, top-8 of 256 experts,
# 24 SMs, every rank on the one GPU), GB/s per rank: fp8 dispatch, bf16 dispatch, combine.
DEEPEP_V1_ONE_H200 = {2: (201, 283, 252), 4: (220, 206, 250), 8: (105, 110, 94)}
DEEPEP_V1_SHAPE = dict(tokens=4096, hidden=7168, topk=8, experts=256, sms=24)


def deepep_v1_reference(args, num_ranks: int, num_sms: int, mode: str):
    """DeepEP V1's figure for the same operation (any of its calls: two-pass or through the arena, cached),
    where this run has that figure's shape and ranks share one GPU; else None."""
    shape = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts, sms=num_sms)
    if (args.cpu or shape != DEEPEP_V1_SHAPE or num_ranks not in DEEPEP_V1_ONE_H200
            or num_ranks <= torch.cuda.device_count()):
        return None
    fp8_dispatch, bf16_dispatch, combine = DEEPEP_V1_ONE_H200[num_ranks]
    if mode.startswith("dispatch_fp8"):
        return fp8_dispatch
    if mode.startswith("dispatch_bf16"):
        return bf16_dispatch
    return combine if mode.startswith("combine") else None


def wait_shares(profile: dict, mode: str, calls: int) -> dict:
    """What the mode's kernel blocks waited for, and their time in each phase ("in pull": waits included),
    as shares of their time (--profile-waits); "block us" is a block's mean device time per call, to
    set against the call's wall time (a call much longer than its blocks waits on the host)."""
    kernel = profile.get("combine" if mode.startswith("combine") else "dispatch")  # dispatch includes notify
    if not kernel or not kernel.get("kernel"):
        return {}
    shares = {what: sec / kernel["kernel"] for what, sec in kernel.items() if what not in ("kernel", "blocks", "phases")}
    shares.update({f"in {phase}": sec / kernel["kernel"] for phase, sec in kernel.get("phases", {}).items()})
    shares["block us"] = kernel["kernel"] / max(kernel["blocks"], 1) / calls * 1e6
    return shares


# The kernels that move a call's rows, and those that open a call, by KernelId.
DATA_KERNELS = ("DISPATCH", "COMBINE", "STREAM_COMBINE", "ZERO_COPY_DISPATCH", "ZERO_COPY_COMBINE")
LEAD_KERNELS = ("NOTIFY", "RENDEZVOUS")


def kernel_log_times(log: list, calls: int, kernel_ids: Enumerators) -> tuple:
    """From a rank's kernel log ([(KernelId, start ns, end ns)], --profile-waits; kernel_ids: the
    extension's KernelId): the means over its last `calls` data kernels, in us, of their span (block 0's
    start to the last block's end), the time from the kernel before them to their start ("gap": the host's
    part for a fresh dispatch, a launch otherwise), the span of the call's opening kernel where there is
    one (count exchange or rendezvous: "lead"), and the time from one data kernel's start to the
    next ("period", against the host's time per call); and the data kernels' start times, to set against
    the other ranks' ({} and [] without a log)."""
    kinds = [kernel_ids.name_of(entry[0]) for entry in log]
    data = [i for i, kind in enumerate(kinds) if kind in DATA_KERNELS][-calls:]
    if not data:
        return {}, []
    spans = [log[i][2] - log[i][1] for i in data]
    gaps = [log[i][1] - log[i - 1][2] for i in data if i > 0]
    leads = [log[i - 1][2] - log[i - 1][1] for i in data if i > 0 and kinds[i - 1] in LEAD_KERNELS]
    starts = [log[i][1] for i in data]
    periods = [b - a for a, b in zip(starts, starts[1:])]
    times = {"span us": spans, "gap us": gaps, "lead us": leads, "period us": periods}
    return {what: sum(v) / len(v) / 1e3 for what, v in times.items() if v}, starts


def start_skew_us(starts_by_rank: list) -> float:
    """Mean over calls of the spread between the ranks' data kernel starts (us; the ranks share a GPU and
    its %globaltimer), or -1 when the ranks' logs do not line up call by call."""
    if not starts_by_rank or len({len(starts) for starts in starts_by_rank}) != 1 or not starts_by_rank[0]:
        return -1.0
    spreads = [max(call) - min(call) for call in zip(*starts_by_rank)]
    return sum(spreads) / len(spreads) / 1e3


def variant(config: Config, num_sms: int, recv_tokens: int = 0, send_tokens: int = 0) -> Config:
    """`config` with another SM budget and, if given, another num_max_nvl_chunked_recv_tokens (which
    sizes the buffer through the size hint, and with it the kernels' windows) and send tokens (the
    streaming combine's rows per owner and sending round), the latter kept below the former."""
    recv_tokens = recv_tokens or config.num_max_nvl_chunked_recv_tokens
    send_tokens = min(send_tokens or config.num_max_nvl_chunked_send_tokens, recv_tokens - 1)
    return Config(num_sms, send_tokens, recv_tokens, config.num_max_rdma_chunked_send_tokens,
                  config.num_max_rdma_chunked_recv_tokens)


def chunk_of(row: dict) -> tuple:
    """A result's chunk: (recv tokens, send tokens), the window or ring and the streaming combine's send round."""
    return row.get("recv_tokens", 0), row.get("send_tokens", 0)


def unfit_sm_budget(kernels, num_sms: int) -> str:
    """Why the kernels (moe_ep.diagnostics.kernel_backend of a Buffer) refuse this SM budget here (its
    blocks cannot all be resident with this many ranks on one GPU), or "" if they take it. A sweep skips
    such budgets instead of stopping."""
    if kernels is None:  # the portable backend takes any budget
        return ""
    try:
        kernels.check_num_sms(num_sms)
    except ValueError as e:
        return str(e)
    return ""


def uses_arena(mode: str) -> bool:
    return "_arena" in mode


def kernel_choices_of(args) -> dict:
    """The kernels' choices the command line sets (moe_ep.backends.choices), entered on every rank."""
    return dict(peer_memory=args.peer_memory, stream_combine={"auto": None, "0": False, "1": True}[args.stream_combine],
                fit_blocks=not args.no_fit_blocks, rendezvous=not args.no_rendezvous, profile_waits=args.profile_waits)


def rank_bench(args):
    # The choices are read when a Buffer's kernel backend is made (its first dispatch of CUDA tensors).
    with overridden(**kernel_choices_of(args)):
        return _rank_bench(args)


def _rank_bench(args):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000 + rank)
    device = "cpu" if args.cpu else "cuda"
    scores = torch.rand(args.tokens, args.experts, dtype=torch.float32, device=device)
    topk_idx = scores.topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    x_fp8 = fp8.per_token_cast_to_fp8(x)
    defaults = {m: (Buffer.get_combine_config if m.startswith("combine") else Buffer.get_dispatch_config)(num_ranks)
                for m in ALL_MODES}
    # The *_arena modes' Buffer: every row this rank could receive (all tokens of all ranks), as bf16 rows
    # with fp8 scales (either kind of row fits), for the tensors alive at once: the first dispatch's
    # recv_x, the combine input in the arena, a call's outputs and a combine's copy of its input and its
    # weights, with room to spare, since a call that finds none falls back to two passes unseen.
    arena = arena_bytes(args.tokens * num_ranks, args.hidden * 2, args.hidden // 128 * 4, args.topk, num_live=6) \
        if any(uses_arena(m) for m in args.modes) else 0
    results = []
    for recv_tokens in args.recv_tokens or [0]:
        configs = {m: [variant(defaults[m], s, recv_tokens) for s in args.sms] for m in ALL_MODES}
        nvl = max(c.get_nvl_buffer_size_hint(args.hidden * 2, num_ranks) for cs in configs.values() for c in cs)
        # The two-pass modes' Buffer and, for the *_arena ones, another with the arena: per Buffer, what its
        # calls need (the Buffer, its first dispatch's handle and weights, the rows to combine).
        setups = {}
        for with_arena in ([False, True] if arena else [False]):
            buffer = Buffer(dist.group.WORLD, nvl, explicitly_destroy=True, num_arena_bytes=arena if with_arena else 0)
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
            layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=topk_idx, topk_weights=topk_weights)
            smallest = min(range(len(args.sms)), key=lambda i: args.sms[i])
            recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, config=configs["dispatch_bf16"][smallest], **layout)
            rows = recv_x.shape[0]
            y = recv_x.clone()
            y_in_arena = buffer.empty_combine_input(handle, args.hidden).copy_(y) if with_arena else None
            setups[with_arena] = dict(buffer=buffer, layout=layout, handle=handle, recv_w=recv_w, y=y,
                                      y_in_arena=y_in_arena)

        def call(mode: str, config: Config):
            """One call of `mode`; its name says what it is (fp8 or bf16 rows, through the arena, from the handle)."""
            setup = setups[uses_arena(mode)]
            buffer, handle = setup["buffer"], setup["handle"]
            if mode.startswith("combine"):
                rows_in = setup["y_in_arena"] if mode == "combine_arena_input" else setup["y"]
                return buffer.combine(rows_in, handle, topk_weights=setup["recv_w"], config=config)
            rows_in = x_fp8 if mode.startswith("dispatch_fp8") else x
            route = dict(handle=handle) if mode.endswith("_cached") else setup["layout"]
            return buffer.dispatch(rows_in, config=config, **route)

        send_values = args.send_tokens or [0]  # 0: each config's own send chunk
        for (i, num_sms), send_tokens in itertools.product(enumerate(args.sms), send_values):
            # Both Buffers' ranks share the GPUs alike: the two-pass one's kernels answer for both.
            refused = unfit_sm_budget(kernel_backend(setups[False]["buffer"]), num_sms)
            if refused:  # the same on every rank of this GPU: all skip it
                results.append(dict(rank=rank, sms=num_sms, mode=SKIPPED, reason=refused))
                continue
            for mode in RUN_ORDER:
                if mode not in args.modes:
                    continue
                if mode != "combine" and send_tokens != send_values[0]:
                    continue  # only the plain combine streams: the other modes ran with the first send chunk
                timed = setups[uses_arena(mode)]["buffer"]
                kernels = kernel_backend(timed)  # the wait profile and kernel log; None on the portable backend
                if kernels is not None:
                    kernels.reset_wait_profile()
                config = variant(configs[mode][i], num_sms, 0, send_tokens)
                kind = "combine" if mode.startswith("combine") else "dispatch"
                one_pass_before = timed.stats()["one_pass_calls"][kind]
                seconds = wall_seconds_per_call(functools.partial(call, mode, config), args.warmup, args.iters)
                # The share of the mode's calls the device ran in one pass (the *_arena modes expect all).
                one_pass = (timed.stats()["one_pass_calls"][kind] - one_pass_before) / (args.warmup + args.iters)
                waits = wait_shares(kernels.wait_profile(), mode, args.warmup + args.iters) if kernels is not None else {}
                times, starts = (kernel_log_times(kernels.kernel_log(), args.iters, kernels.enums.kernel_id)
                                 if kernels is not None else ({}, []))
                waits.update(times)
                row_bytes = args.hidden * (1 + 4 / 128) if mode.startswith("dispatch_fp8") else args.hidden * 2
                results.append(dict(rank=rank, sms=num_sms, recv_tokens=config.num_max_nvl_chunked_recv_tokens,
                                    send_tokens=config.num_max_nvl_chunked_send_tokens, nvl_bytes=nvl, mode=mode,
                                    us=seconds * 1e6, rows=rows, bytes=rows * row_bytes,
                                    gbps=rows * row_bytes / seconds / 1e9, waits=waits, kernel_starts=starts,
                                    one_pass=one_pass, peer_memory=timed.topology()["peer_memory"]["normal"],
                                    blocks=kernels.launch_blocks(num_sms, combine=mode.startswith("combine"))
                                    if kernels is not None else None))
        for setup in setups.values():
            setup["buffer"].destroy()  # collective: no peer reads this rank's windows any more
        layout = setups[False]["layout"]
    if args.nccl:  # the routing is the same for every buffer: the last one's layout serves
        results.append(nccl_reference(args, x, layout["is_token_in_rank"], layout["num_tokens_per_rank"], rows))
    return results


def nccl_reference(args, x, in_rank, per_rank, rows):
    """all_to_all_single of the same rows (bf16), grouped by destination beforehand."""
    rank = dist.get_rank()
    order = in_rank.t().nonzero(as_tuple=True)[1]  # destination major, token minor
    send = x[order].contiguous()
    send_counts = per_rank.tolist()
    recv_counts_t = torch.empty_like(per_rank)
    dist.all_to_all_single(recv_counts_t, per_rank.clone())
    recv_counts = recv_counts_t.tolist()
    recv = torch.empty(sum(recv_counts), args.hidden, dtype=x.dtype, device=x.device)
    assert recv.shape[0] == rows
    seconds = wall_seconds_per_call(lambda: dist.all_to_all_single(recv, send, recv_counts, send_counts),
                                    args.warmup, args.iters)
    row_bytes = args.hidden * 2
    return dict(rank=rank, sms=args.sms[0], mode=NCCL_MODE, us=seconds * 1e6, rows=rows, bytes=rows * row_bytes,
                gbps=rows * row_bytes / seconds / 1e9)


def copy_gbps(num_bytes: int, iters: int = 20, device: str = "cuda") -> float:
    """Payload rate of a plain device copy of num_bytes (one process alone on the GPU)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    if device == "cpu":
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        return num_bytes * iters / (time.perf_counter() - start) / 1e9
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return num_bytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape of the timed calls and how many are timed (the intranode benchmark's, and tune's)."""
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)


def make_parser() -> argparse.ArgumentParser:
    """The command line (`moe-ep-bench tune` builds its candidates' arguments with it too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    add_shape_arguments(parser)
    parser.add_argument("--sms", type=int, nargs="+", default=[24])
    parser.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(MODES),
                        help="which calls to time (default: all but the *_cached ones)")
    parser.add_argument("--recv-tokens", type=int, nargs="+", default=[],
                        help="num_max_nvl_chunked_recv_tokens values to sweep (the buffer, hence window, size); "
                             "default: the tuned config's")
    parser.add_argument("--send-tokens", type=int, nargs="+", default=[],
                        help="num_max_nvl_chunked_send_tokens values to sweep (rows per owner in a sending round of "
                             "the streaming combine; kept below the recv tokens); default: the tuned config's")
    parser.add_argument("--nccl", action="store_true", help="also time NCCL all_to_all_single (one rank per GPU)")
    parser.add_argument("--json", help="append one JSON line per (ranks, sms, mode) here")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (portable backend): checks the script anywhere")
    parser.add_argument("--profile-waits", action="store_true",
                        help="print what the kernels' blocks wait for, as shares of their time, and their kernel "
                             "log's spans and gaps")
    parser.add_argument("--stream-combine", choices=("auto", "0", "1"), default="auto",
                        help="the streaming (1) or the windowed (0) intranode combine; auto: by rank count")
    parser.add_argument("--no-fit-blocks", action="store_true",
                        help="the data kernels run on the SM budget's block count even where ranks share a GPU")
    parser.add_argument("--no-rendezvous", action="store_true",
                        help="combines and cached dispatches start without the one-block rendezvous where ranks "
                             "share a GPU")
    parser.add_argument("--peer-memory", choices=PEER_MEMORY_KINDS, default="auto",
                        help="how peers' buffers are mapped: the virtual-memory API (vmm), CUDA IPC handles (ipc), "
                             "or auto (vmm where the GPU can)")
    return parser


def main():
    parser = make_parser()
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        # The message alone: the usage that parser.error prints first would bury it.
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    if args.nccl and (args.cpu or any(n > torch.cuda.device_count() for n in args.ranks)):
        parser.error("--nccl needs one rank per GPU (NCCL refuses two ranks on one GPU)")
    print(f"{'ranks':>5} {'sms':>4} {'chunk':>9} {'mode':>20} {'us/call':>9} {'GB/s per rank (min/mean)':>25} "
          f"{'aggregate GB/s':>15} {'of copy':>8} {'x DeepEP V1':>12}")
    for num_ranks in args.ranks:
        with RankPool(num_ranks, use_cuda=not args.cpu) as pool:
            per_rank = pool.run(rank_bench, args)
        flat = [r for rows in per_rank for r in rows]
        for num_sms in sorted({r["sms"] for r in flat if r["mode"] == SKIPPED}):
            reason = next(r["reason"] for r in flat if r["mode"] == SKIPPED and r["sms"] == num_sms)
            print(f"{num_ranks:>5} {num_sms:>4}  skipped: {reason}")
        flat = [r for r in flat if r["mode"] != SKIPPED]
        best = {}
        for num_sms, chunk in sorted({(r["sms"], chunk_of(r)) for r in flat}):
            recv_tokens, send_tokens = chunk
            modes = tuple(m for m in ALL_MODES if m in args.modes) + ((NCCL_MODE,) if args.nccl and num_sms == args.sms[0] else ())
            for mode in modes:
                rows = [r for r in flat if r["sms"] == num_sms and chunk_of(r) == chunk and r["mode"] == mode]
                if not rows:
                    continue
                aggregate_bytes = sum(r["bytes"] for r in rows)
                aggregate = sum(r["gbps"] for r in rows)
                copy = copy_gbps(int(aggregate_bytes), device="cpu" if args.cpu else "cuda")
                mean = aggregate / len(rows)
                if mode != NCCL_MODE and mean > best.get((num_sms, mode), (0, 0))[0]:
                    best[(num_sms, mode)] = (mean, chunk)
                waits = {}
                for r in rows:
                    for what, share in r.get("waits", {}).items():
                        waits[what] = waits.get(what, 0.0) + share / len(rows)
                skew = start_skew_us([r.get("kernel_starts", []) for r in rows])  # -1 without kernel logs
                if skew >= 0:
                    waits["start skew us"] = skew
                waited = ", ".join(f"{what} {share:.0f}" if what.endswith(" us") else f"{what} {share:.0%}"
                                   for what, share in waits.items())
                shown = f"{recv_tokens}/{send_tokens}" if recv_tokens else "-"
                reference = deepep_v1_reference(args, num_ranks, num_sms, mode)
                versus = f"{mean / reference:.2f}x" if reference else "-"
                # An arena mode whose calls fell back to two passes (Buffer.stats) is not the one-pass figure.
                one_pass = min(r.get("one_pass", 1.0) for r in rows)
                fell_back = f"  only {one_pass:.0%} of calls one-pass" if uses_arena(mode) and not args.cpu \
                    and one_pass < 1 else ""
                print(f"{num_ranks:>5} {num_sms:>4} {shown:>9} {mode:>20} {max(r['us'] for r in rows):>9.0f} "
                      f"{min(r['gbps'] for r in rows):>12.0f} / {mean:<10.0f} {aggregate:>15.0f} "
                      f"{aggregate / copy:>7.0%} {versus:>12}" + (f"  profile: {waited}" if waited else "")
                      + fell_back)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(dict(bench="intranode", ranks=num_ranks, sms=num_sms,
                                                recv_tokens=recv_tokens, send_tokens=send_tokens,
                                                nvl_bytes=rows[0].get("nvl_bytes"),
                                                mode=mode, tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                                                experts=args.experts, per_rank_gbps=[r["gbps"] for r in rows],
                                                us=[r["us"] for r in rows], aggregate_gbps=aggregate,
                                                copy_gbps=copy, deepep_v1_gbps=reference, waits=waits,
                                                peer_memory=rows[0].get("peer_memory"),
                                                one_pass=[r.get("one_pass") for r in rows],
                                                blocks=rows[0].get("blocks"),
                                                stream_combine=args.stream_combine)) + "\n")
        if len(args.recv_tokens) > 1 or len(args.send_tokens) > 1:
            for (num_sms, mode), (gbps, (recv_tokens, send_tokens)) in sorted(best.items()):
                print(f"  best chunk at {num_ranks} ranks, {num_sms} SMs, {mode}: num_max_nvl_chunked_recv_tokens="
                      f"{recv_tokens}, num_max_nvl_chunked_send_tokens={send_tokens} ({gbps:.0f} GB/s per rank)")

if __name__ == "__main__":
    main()
