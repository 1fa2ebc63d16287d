"""Intranode dispatch/combine bandwidth, all ranks of one host running concurrently, with its peers
measured in the same run on the same shapes and ranks (moe_ep/bench/peers.py: DeepEP V1, NCCL's
all-to-all, the portable backend, a plain device copy).

Per rank: received bytes / wall time per call (host work included; `--iters` calls after `--warmup`,
a barrier before). bf16 rows count hidden * 2 bytes, fp8 rows hidden * (1 + 4/128) (values + scales);
combine counts the bf16 rows sent back. The *_arena modes run on a Buffer with an arena of a fixed size
(num_arena_bytes) with room for every call, so they are the one-pass calls: the dispatch stores the rows
straight into regions of the receivers' arenas, and combine_arena_input sums rows written into
empty_combine_input where they lie (combine_arena: rows of a tensor of their own, which the combine
copies into the arena first from 4 ranks up and sends the two-pass way below). The other modes run on a
Buffer without an arena (num_arena_bytes=0: the two-pass calls). Each mode's mean per rank is set against
each peer's figure for the same operation from this run: "of copy" (the device copy of the same bytes)
and "x deep_ep", "x nccl", "x portable" (moe_ep's GB/s over the peer's; "-" where the peer was skipped,
with the reason printed below the rows).

    python -m moe_ep.bench.intranode --ranks 2 4 8 --sms 24
    python -m moe_ep.bench.intranode --ranks 4 --tokens 512 1024 2048 4096 --plot plots/   # token sweep
    python -m moe_ep.bench.intranode --ranks 4 --sms 8 16 24 32 48     # SM sweep
    python -m moe_ep.bench.intranode --ranks 4 --recv-tokens 64 128 256 512   # window (buffer) sweep
    python -m moe_ep.bench.intranode --ranks 4 8 --modes combine --recv-tokens 1024 --send-tokens 8 32 128
        # the streaming combine's send chunk (rows per owner a sending round writes)
    python -m moe_ep.bench.intranode --ranks 8 --profile-waits   # where the kernels' time goes
    python -m moe_ep.bench.intranode --ranks 8 --nccl     # one rank per GPU: NCCL's all-to-all required
    python -m moe_ep.bench.intranode --ranks 4 8 --modes combine   # only some of the modes
    python -m moe_ep.bench.intranode --ranks 2 --modes dispatch_fp8_arena dispatch_fp8_arena_cached
        # *_cached: from the first call's handle, no count exchange and no host wait (DeepEP's tests' way)
    python -m moe_ep.bench.intranode --ranks 2 4 8 --modes combine combine_arena combine_arena_input
        # the combine from the arena: of x elsewhere (copied in) and of x in empty_combine_input
    python -m moe_ep.bench.intranode --ranks 4 8 --modes combine --stream-combine 0   # the windowed combine
    python -m moe_ep.bench.intranode --ranks 8 --peer-memory ipc   # peers mapped through CUDA IPC handles
    python -m moe_ep.bench.intranode --ranks 8 --peers deep_ep --jsonl out/peers.jsonl   # DeepEP alone beside it

The buffer is sized by the size hint of the largest SM budget given (the kernels size their windows
from the buffer, not from num_sms), once per --recv-tokens value. DeepEP runs on ranks of its own after
moe_ep's, with its recommended chunk configs for the rank count at each SM budget of --sms; NCCL and the
copy run on moe_ep's ranks after its calls, the portable backend on ranks of its own at the first budget.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.distributed as dist

from moe_ep import Buffer, Config
from moe_ep.config import arena_bytes
from moe_ep.diagnostics import kernel_backend
from moe_ep.backends.choices import PEER_MEMORY_KINDS, overridden
from moe_ep.backends.peers import Enumerators

from . import command_parser, copy_peer, deepep_peer, nccl_peer
from .inputs import intranode_inputs, row_bytes
from .peers import (COPY, DEEP_EP, MOE_EP, NCCL, PEERS, PORTABLE, add_peer_arguments, note_hangs, ratio,
                    run_in_own_ranks, shown_ratio, skip_reasons)
from .report import Report, add_output_arguments, progress, say
from .timing import wall_seconds_per_call
from .torchrun import add_ranks_argument, gpus_of_the_ranks, one_node_only, rank_counts, start_ranks

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = [2, 4, 8]

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
SKIPPED = "skipped"  # a result row that says an SM budget was refused, and why


def bytes_kind(mode: str) -> str:
    """What a mode's call moves, as NCCL and the copy move it: fp8 rows or bf16 rows dispatched, or rows combined."""
    if mode.startswith("combine"):
        return "combine"
    return "dispatch_fp8" if mode.startswith("dispatch_fp8") else "dispatch_bf16"


def peer_mode(peer: str, mode: str) -> str:
    """The peer's operation that moe_ep's `mode` is set against: the portable backend's same mode, DeepEP's
    same call (it has no arena: the *_arena modes meet its plain calls), NCCL's and the copy's same bytes."""
    if peer == PORTABLE:
        return mode
    if peer == DEEP_EP:
        return mode.replace("_arena_input", "").replace("_arena", "")
    return bytes_kind(mode)


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
    device = "cpu" if args.cpu else "cuda"
    x, x_fp8, topk_idx, topk_weights = intranode_inputs(args, device)
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
                results.append(dict(rank=rank, backend=MOE_EP, sms=num_sms, mode=SKIPPED, reason=refused))
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
                moved = rows * row_bytes(mode, args.hidden)
                results.append(dict(rank=rank, backend=MOE_EP, sms=num_sms,
                                    recv_tokens=config.num_max_nvl_chunked_recv_tokens,
                                    send_tokens=config.num_max_nvl_chunked_send_tokens, nvl_bytes=nvl, mode=mode,
                                    us=seconds * 1e6, rows=rows, bytes=moved,
                                    gbps=moved / seconds / 1e9, waits=waits, kernel_starts=starts,
                                    one_pass=one_pass, peer_memory=timed.topology()["peer_memory"]["normal"],
                                    blocks=kernels.launch_blocks(num_sms, combine=mode.startswith("combine"))
                                    if kernels is not None else None))
        for setup in setups.values():
            setup["buffer"].destroy()  # collective: no peer reads this rank's windows any more
        layout = setups[False]["layout"]
    # The routing is the same for every buffer: the last one's layout and row count serve the peers.
    results += peers_in_these_ranks(args, layout["num_tokens_per_rank"].tolist(), rows, device)
    return results


def peer_row(backend: str, mode: str, seconds: float, rows: int, moved: float, sms=None) -> dict:
    return dict(rank=dist.get_rank(), backend=backend, sms=sms, mode=mode, us=seconds * 1e6, rows=rows, bytes=moved,
                gbps=moved / seconds / 1e9)


def peers_in_these_ranks(args, rows_to: list, rows: int, device: str) -> list:
    """The NCCL and copy peers' rows (those in args.peers), timed on moe_ep's ranks after its calls: per
    kind of bytes the modes move, rows_to[r] rows sent to rank r, `rows` received."""
    found = []
    for kind in sorted({bytes_kind(m) for m in args.modes}):
        moved = rows * row_bytes(kind, args.hidden)
        if NCCL in args.peers:
            seconds = nccl_peer.rows_per_pair_seconds(rows_to, round(row_bytes(kind, args.hidden)), kind == "combine",
                                                      args.warmup, args.iters, device)
            found.append(peer_row(NCCL, kind, seconds, rows, moved))
        if COPY in args.peers:
            found.append(peer_row(COPY, kind, copy_peer.copy_seconds(round(moved), args.warmup, args.iters, device),
                                  rows, moved))
    return found


def add_shape_arguments(parser: argparse.ArgumentParser, token_sweep: bool = False) -> None:
    """The shape of the timed calls and how many are timed (the intranode benchmark's, which sweeps
    --tokens, and tune's)."""
    if token_sweep:
        parser.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens a rank; several: a sweep")
    else:
        parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)


def make_parser() -> argparse.ArgumentParser:
    """The command line (`moe-ep-bench tune` builds its candidates' arguments with it too)."""
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS)
    add_shape_arguments(parser, token_sweep=True)
    parser.add_argument("--sms", type=int, nargs="+", default=[24])
    parser.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(MODES),
                        help="which calls to time (default: all but the *_cached ones)")
    parser.add_argument("--recv-tokens", type=int, nargs="+", default=[],
                        help="num_max_nvl_chunked_recv_tokens values to sweep (the buffer, hence window, size); "
                             "default: the tuned config's")
    parser.add_argument("--send-tokens", type=int, nargs="+", default=[],
                        help="num_max_nvl_chunked_send_tokens values to sweep (rows per owner in a sending round of "
                             "the streaming combine; kept below the recv tokens); default: the tuned config's")
    parser.add_argument("--nccl", action="store_true",
                        help="require the NCCL peer (all_to_all_single of the same bytes): one rank per GPU")
    parser.add_argument("--json", help="append one JSON line per (ranks, tokens, sms, chunk, mode) of moe_ep here, "
                                       "its peers' GB/s inside (the lines scripts/ab_summary.py reads)")
    add_output_arguments(parser)
    add_peer_arguments(parser)
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


def at_tokens(args, tokens: int) -> argparse.Namespace:
    """The arguments of one run of the sweep: `tokens` a rank (what the rank functions read)."""
    return argparse.Namespace(**{**vars(args), "tokens": tokens})


def measure(args, num_ranks: int, reasons: dict, bar) -> list:
    """Every rank's rows of one run (args.tokens a rank): moe_ep's and those of the peers timed on its
    ranks, then DeepEP's and the portable backend's, each on ranks of its own; a peer that fails there
    gets its reason in `reasons` instead of rows."""
    own = [p for p in (NCCL, COPY) if not reasons[p]]
    with start_ranks(num_ranks, use_cuda=not args.cpu) as pool:
        rows = [r for rank_rows in pool.run(rank_bench, argparse.Namespace(**{**vars(args), "peers": own}))
                for r in rank_rows]
    if not reasons[DEEP_EP]:
        bar.set_postfix_str(f"{num_ranks} ranks: {DEEP_EP}")
        operations = sorted({peer_mode(DEEP_EP, m) for m in args.modes})
        found, reasons[DEEP_EP] = run_in_own_ranks(deepep_peer.intranode_rank, (args, operations), num_ranks,
                                                   not args.cpu, args.peer_timeout)
        rows += [r for rank_rows in found for r in rank_rows]
    if not reasons[PORTABLE]:
        bar.set_postfix_str(f"{num_ranks} ranks: {PORTABLE}")
        # The portable backend takes no SM budget and no chunks: its calls run once, at the first budget.
        portable = argparse.Namespace(**{**vars(args), "sms": args.sms[:1], "recv_tokens": [], "send_tokens": [],
                                         "peers": [], "profile_waits": False})
        found, reasons[PORTABLE] = run_in_own_ranks(rank_bench, (portable,), num_ranks, not args.cpu,
                                                    args.peer_timeout, env={"MOE_EP_BACKEND": "portable"})
        rows += [dict(r, backend=PORTABLE, sms=None) for rank_rows in found for r in rank_rows if r["mode"] != SKIPPED]
    return rows


def summarize(rows: list) -> dict:
    """One mode's figures over the ranks: the slowest call, the slowest and mean rank's GB/s, their sum."""
    gbps = [r["gbps"] for r in rows]
    return dict(us=max(r["us"] for r in rows), min=min(gbps), mean=sum(gbps) / len(gbps), aggregate=sum(gbps))


def peer_means(rows: list) -> dict:
    """{(peer, sms or None, operation): mean GB/s per rank} of the peers' rows of one run."""
    grouped = {}
    for r in rows:
        if r["backend"] != MOE_EP:
            grouped.setdefault((r["backend"], r["sms"], r["mode"]), []).append(r["gbps"])
    return {key: sum(v) / len(v) for key, v in grouped.items()}


def peer_figure(means: dict, peer: str, num_sms: int, mode: str):
    """The peer's mean GB/s per rank for the operation moe_ep's `mode` at num_sms is set against, or None."""
    return means.get((peer, num_sms if peer == DEEP_EP else None, peer_mode(peer, mode)))


HEADER = (f"{'ranks':>5} {'tokens':>6} {'sms':>4} {'chunk':>9} {'mode':>28} {'us/call':>9} "
          f"{'GB/s per rank (min/mean)':>25} {'aggregate GB/s':>15} {'of copy':>8} {'x deep_ep':>10} {'x nccl':>7} "
          f"{'x portable':>10}")


def report_run(args, num_ranks: int, rows: list, reasons: dict, report: Report, bar) -> None:
    """Prints one run's rows (moe_ep's with their ratios to the peers, then the peers' own, then why a peer
    was skipped) and records them in the report and the --json file."""
    base_shape = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts)
    for num_sms in sorted({r["sms"] for r in rows if r["mode"] == SKIPPED}):
        reason = next(r["reason"] for r in rows if r["mode"] == SKIPPED and r["sms"] == num_sms)
        say(bar, f"{num_ranks:>5} {args.tokens:>6} {num_sms:>4}  skipped: {reason}")
    ours = [r for r in rows if r["backend"] == MOE_EP and r["mode"] != SKIPPED]
    means = peer_means(rows)
    best = {}
    for num_sms, chunk in sorted({(r["sms"], chunk_of(r)) for r in ours}):
        recv_tokens, send_tokens = chunk
        shape = dict(base_shape, sms=num_sms, recv_tokens=recv_tokens, send_tokens=send_tokens)
        for mode in (m for m in ALL_MODES if m in args.modes):
            timed = [r for r in ours if r["sms"] == num_sms and chunk_of(r) == chunk and r["mode"] == mode]
            if not timed:
                continue
            figures = summarize(timed)
            if figures["mean"] > best.get((num_sms, mode), (0, 0))[0]:
                best[(num_sms, mode)] = (figures["mean"], chunk)
            versus = {peer: ratio(figures["mean"], peer_figure(means, peer, num_sms, mode)) for peer in PEERS}
            say(bar, moe_ep_line(num_ranks, args.tokens, num_sms, chunk, mode, timed, figures, versus, args.cpu))
            record_moe_ep(report, mode, shape, num_ranks, figures, versus)
            if args.json:
                write_json_line(args, num_ranks, num_sms, chunk, mode, timed, figures, means)
    for (peer, num_sms, operation), _ in sorted(means.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
        timed = [r for r in rows if (r["backend"], r["sms"], r["mode"]) == (peer, num_sms, operation)]
        figures = summarize(timed)
        shown_sms = "-" if num_sms is None else num_sms
        say(bar, f"{num_ranks:>5} {args.tokens:>6} {shown_sms:>4} {'-':>9} {peer + ' ' + operation:>28} "
                 f"{figures['us']:>9.0f} {figures['min']:>12.0f} / {figures['mean']:<10.0f} {figures['aggregate']:>15.0f}")
        shape = dict(base_shape, sms=num_sms, recv_tokens=None, send_tokens=None)
        report.add(operation, shape, num_ranks, peer, "gbps_per_rank", figures["mean"], "GB/s")
        report.add(operation, shape, num_ranks, peer, "us_per_call", figures["us"], "us")
    for peer, reason in reasons.items():
        if reason:
            say(bar, f"  {peer} at {num_ranks} ranks, {args.tokens} tokens: {'' if reason.startswith('failed') else 'skipped: '}"
                     f"{reason}")
            report.skipped("all", base_shape, num_ranks, peer, reason)
    if len(args.recv_tokens) > 1 or len(args.send_tokens) > 1:
        for (num_sms, mode), (gbps, (recv_tokens, send_tokens)) in sorted(best.items()):
            say(bar, f"  best chunk at {num_ranks} ranks, {num_sms} SMs, {mode}: num_max_nvl_chunked_recv_tokens="
                     f"{recv_tokens}, num_max_nvl_chunked_send_tokens={send_tokens} ({gbps:.0f} GB/s per rank)")


def mean_waits(timed: list) -> dict:
    """The kernels' profile of one mode (--profile-waits), the mean over the ranks, with their start skew."""
    waits = {}
    for r in timed:
        for what, share in r.get("waits", {}).items():
            waits[what] = waits.get(what, 0.0) + share / len(timed)
    skew = start_skew_us([r.get("kernel_starts", []) for r in timed])  # -1 without kernel logs
    if skew >= 0:
        waits["start skew us"] = skew
    return waits


def moe_ep_line(num_ranks, tokens, num_sms, chunk, mode, timed, figures, versus, cpu: bool) -> str:
    """A table line of moe_ep's figures for one mode, with the kernels' profile where --profile-waits took one."""
    waited = ", ".join(f"{what} {share:.0f}" if what.endswith(" us") else f"{what} {share:.0%}"
                       for what, share in mean_waits(timed).items())
    recv_tokens, send_tokens = chunk
    shown = f"{recv_tokens}/{send_tokens}" if recv_tokens else "-"
    of_copy = f"{versus[COPY]:.0%}" if versus[COPY] is not None else "-"
    # An arena mode whose calls fell back to two passes (Buffer.stats) is not the one-pass figure.
    one_pass = min(r.get("one_pass", 1.0) for r in timed)
    fell_back = f"  only {one_pass:.0%} of calls one-pass" if uses_arena(mode) and not cpu and one_pass < 1 else ""
    return (f"{num_ranks:>5} {tokens:>6} {num_sms:>4} {shown:>9} {mode:>28} {figures['us']:>9.0f} "
            f"{figures['min']:>12.0f} / {figures['mean']:<10.0f} {figures['aggregate']:>15.0f} {of_copy:>8} "
            f"{shown_ratio(versus[DEEP_EP]):>10} {shown_ratio(versus[NCCL]):>7} {shown_ratio(versus[PORTABLE]):>10}"
            + (f"  profile: {waited}" if waited else "") + fell_back)


def record_moe_ep(report: Report, mode: str, shape: dict, num_ranks: int, figures: dict, versus: dict) -> None:
    report.add(mode, shape, num_ranks, MOE_EP, "gbps_per_rank", figures["mean"], "GB/s")
    report.add(mode, shape, num_ranks, MOE_EP, "gbps_per_rank_min", figures["min"], "GB/s")
    report.add(mode, shape, num_ranks, MOE_EP, "aggregate_gbps", figures["aggregate"], "GB/s")
    report.add(mode, shape, num_ranks, MOE_EP, "us_per_call", figures["us"], "us")
    for peer, value in versus.items():
        if value is not None:  # moe_ep's GB/s over the peer's, both from this run
            report.add(mode, shape, num_ranks, MOE_EP, f"vs_{peer}", value, "x", peer=peer,
                       peer_operation=peer_mode(peer, mode))


def write_json_line(args, num_ranks, num_sms, chunk, mode, timed, figures, means) -> None:
    """The --json line of one moe_ep mode (the form scripts/ab_summary.py reads), its peers' GB/s beside it."""
    recv_tokens, send_tokens = chunk
    peer_gbps = {peer: peer_figure(means, peer, num_sms, mode) for peer in PEERS}
    with open(args.json, "a") as f:
        f.write(json.dumps(dict(bench="intranode", ranks=num_ranks, sms=num_sms, recv_tokens=recv_tokens,
                                send_tokens=send_tokens, nvl_bytes=timed[0].get("nvl_bytes"), mode=mode,
                                tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                                per_rank_gbps=[r["gbps"] for r in timed], us=[r["us"] for r in timed],
                                aggregate_gbps=figures["aggregate"],
                                copy_gbps=peer_gbps[COPY] * len(timed) if peer_gbps[COPY] else None,
                                peer_gbps={p: v for p, v in peer_gbps.items() if v is not None},
                                waits=mean_waits(timed), peer_memory=timed[0].get("peer_memory"),
                                one_pass=[r.get("one_pass") for r in timed], blocks=timed[0].get("blocks"),
                                stream_combine=args.stream_combine)) + "\n")


def plot_token_sweeps(report: Report, args) -> None:
    """GB/s per rank against tokens a rank, a plot per (ranks, SM budget): a line per moe_ep mode (its
    best chunk) and per peer operation."""
    for num_ranks, num_sms in itertools.product(args.ranks, args.sms):
        series = {}
        for record in report.select(metric="gbps_per_rank", ranks=num_ranks):
            # moe_ep and DeepEP at this budget; the other peers take none.
            takes_sms = record["backend"] in (MOE_EP, DEEP_EP)
            if record["shape"]["sms"] != (num_sms if takes_sms else None):
                continue
            points = series.setdefault(f"{record['backend']} {record['mode']}", {})
            tokens = record["shape"]["tokens"]
            points[tokens] = max(points.get(tokens, 0.0), record["value"])
        report.plot(f"intranode_{num_ranks}ranks_{num_sms}sms.png",
                    f"intranode, {num_ranks} ranks, {num_sms} SMs", "tokens a rank", "GB/s per rank (mean)",
                    {label: sorted(points.items()) for label, points in series.items()}, log_x=True)


def main():
    parser = make_parser()
    args = parser.parse_args()
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    one_node_only(parser, "intranode times the calls")
    if not args.cpu and not torch.cuda.is_available():
        # The message alone: the usage that parser.error prints first would bury it.
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    num_gpus = 0 if args.cpu else gpus_of_the_ranks()
    if args.nccl and (args.cpu or any(n > num_gpus for n in args.ranks)):
        parser.error("--nccl needs one rank per GPU (NCCL refuses two ranks on one GPU)")
    if args.nccl and NCCL not in args.peers:
        args.peers.append(NCCL)
    report = Report("intranode", args.jsonl, args.plot)
    runs = list(itertools.product(args.ranks, args.tokens))
    bar = progress(len(runs), "intranode", unit="run")
    given_up = {}
    try:
        say(bar, HEADER)
        for num_ranks, tokens in runs:
            bar.set_postfix_str(f"{num_ranks} ranks, {tokens} tokens")
            run_args = at_tokens(args, tokens)
            reasons = skip_reasons(run_args, num_ranks, num_gpus, tokens * args.hidden * 2, given_up=given_up)
            rows = measure(run_args, num_ranks, reasons, bar)
            note_hangs(reasons, given_up, f"{num_ranks} ranks, {tokens} tokens")
            report_run(run_args, num_ranks, rows, reasons, report, bar)
            bar.update(1)
    finally:
        bar.close()
    plot_token_sweeps(report, args)
    report.say_plots()


if __name__ == "__main__":
    main()
