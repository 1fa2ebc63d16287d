"""Low-latency dispatch/combine latency and bandwidth, all ranks running at once.

Per rank, wall time per call (after `--warmup` calls, a barrier before, synchronized at the end),
for the whole call, for a zero-copy combine (the expert outputs already in the Buffer's rows), and,
with the hook, for the send part and the receive part (hook) separately. `--graph` adds each call's
device time: calls captured in a CUDA graph and replayed (no host work per call), so the host's share
of a call is the difference.
Bandwidth in DeepEP's metric: dispatch moves (hidden + hidden/128 * 4 + 16) bytes per (token, expert)
selection in fp8, combine hidden * 2 bytes per selection.

Beside moe_ep, in the same run and on the same problem (moe_ep/bench/peers.py): DeepEP V1's low-latency
calls where `import deep_ep` works and every rank has a GPU of its own (on ranks of their own), NCCL's all_to_all_single of the same bytes per
rank pair where every rank has a GPU of its own, the portable backend (ranks of their own, no --graph),
and a device copy of the same bytes; each peer's row gives moe_ep's speed over the peer's (the peer's
time over moe_ep's), and a skipped peer its reason.

    python -m moe_ep.bench.low_latency --ranks 8                 # 288 experts with 8 ranks
    python -m moe_ep.bench.low_latency --ranks 2 4 8 --graph --plot plots/   # latency against ranks
    python -m moe_ep.bench.low_latency --ranks 8 --peer-memory ipc   # the buffers mapped through CUDA IPC
    python -m moe_ep.bench.low_latency --ranks 8 --puts    # every peer through NVSHMEM puts, as on other hosts
    MOE_EP_BACKEND=portable python -m moe_ep.bench.low_latency ...   # the portable backend on the GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from moe_ep import Buffer
from moe_ep.backends.choices import LOW_LATENCY_MEMORY_KINDS, overridden
from moe_ep.launch import RankError

from . import command_parser, copy_peer, deepep_peer, nccl_peer
from .inputs import LOW_LATENCY_SEED, low_latency_inputs, low_latency_selection_bytes, selections_per_rank
from .peers import (COPY, DEEP_EP, MOE_EP, NCCL, PORTABLE, add_peer_arguments, note_hangs, ratio, run_in_own_ranks,
                    shown_ratio, skip_reasons)
from .report import Report, add_output_arguments, progress, say
from .timing import cuda_kernel_us, device_sync, wall_seconds_per_call
from .torchrun import add_ranks_argument, gpus_of_the_ranks, rank_counts, start_ranks

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = [8]


def add_problem_arguments(parser: argparse.ArgumentParser, experts_help: Optional[str] = None) -> None:
    """The shape of the low-latency problem (the timeline benchmark, ll_timeline, takes the same)."""
    add_ranks_argument(parser, RANKS)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256, help=experts_help)


def make_problem(args, num_experts: int, seed: int, device: str = "cuda"):
    """This rank's random inputs (x, top-k ids and weights), the experts' outputs for the combine (y,
    [local experts, ranks x tokens, hidden]) and a low-latency Buffer sized for them."""
    num_ranks = dist.get_world_size()
    x, topk_idx, topk_weights, y = low_latency_inputs(args, num_experts, seed, device)
    size = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks)
    return x, topk_idx, topk_weights, y, buffer


def rank_bench(args, num_experts: int):
    # The choice is read when the Buffer's kernel backend is made (its first low-latency call of CUDA tensors).
    memory = "nvshmem" if args.puts else args.peer_memory
    with overridden(low_latency_memory=memory, low_latency_puts=args.puts):
        return _rank_bench(args, num_experts)


def _rank_bench(args, num_experts: int):
    device = "cpu" if args.cpu else "cuda"
    x, topk_idx, topk_weights, y, buffer = make_problem(args, num_experts, LOW_LATENCY_SEED, device)
    selections = int((topk_idx >= 0).sum())
    device_sync()
    dist.barrier()
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, args.tokens, num_experts, use_fp8=True)
    results = {}

    def dispatch():
        return buffer.low_latency_dispatch(x, topk_idx, args.tokens, num_experts, use_fp8=True)

    def combine():
        return buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

    def combine_in_place():  # x is ignored: the rows are read where get_next_low_latency_combine_buffer put them
        return buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=True)

    results["dispatch_us"] = wall_seconds_per_call(dispatch, args.warmup, args.iters) * 1e6
    results["combine_us"] = wall_seconds_per_call(combine, args.warmup, args.iters) * 1e6
    for _ in range(2):  # both zero-copy slots hold the expert outputs
        buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
        combine_in_place()
    results["combine_zero_copy_us"] = wall_seconds_per_call(combine_in_place, args.warmup, args.iters) * 1e6
    if args.graph and not args.cpu:  # every rank captures and replays the same calls, so they pair up
        dist.barrier()
        results["dispatch_graph_us"] = cuda_kernel_us(dispatch, calls=args.iters, replays=5)
        results["combine_graph_us"] = cuda_kernel_us(combine, calls=args.iters, replays=5)
        results["combine_zero_copy_graph_us"] = cuda_kernel_us(combine_in_place, calls=args.iters, replays=5)
    # With the hook: time the send and the receive parts on their own.
    sends, recvs = [], []
    for i in range(args.warmup + args.iters):
        device_sync()
        dist.barrier()
        t0 = time.perf_counter()
        _, _, h, _, hook = buffer.low_latency_dispatch(x, topk_idx, args.tokens, num_experts, use_fp8=True,
                                                       return_recv_hook=True)
        device_sync()
        t1 = time.perf_counter()
        hook()
        device_sync()
        t2 = time.perf_counter()
        _, _, chook = buffer.low_latency_combine(y, topk_idx, topk_weights, h, return_recv_hook=True)
        device_sync()
        t3 = time.perf_counter()
        chook()
        device_sync()
        t4 = time.perf_counter()
        if i >= args.warmup:
            sends.append(((t1 - t0) * 1e6, (t3 - t2) * 1e6))
            recvs.append(((t2 - t1) * 1e6, (t4 - t3) * 1e6))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    results["dispatch_send_us"], results["combine_send_us"] = med([s[0] for s in sends]), med([s[1] for s in sends])
    results["dispatch_recv_us"], results["combine_recv_us"] = med([r[0] for r in recvs]), med([r[1] for r in recvs])
    per_selection = low_latency_selection_bytes(args.hidden)
    results["selections"] = selections
    results["dispatch_gbps"] = selections * per_selection["dispatch"] / results["dispatch_us"] / 1e3
    results["combine_gbps"] = selections * per_selection["combine"] / results["combine_us"] / 1e3
    topology = buffer.topology()
    # "puts" where any rank of the group reaches a peer through NVSHMEM puts (--puts, or a peer on another
    # host): then every rank runs the kernels that put and pushes its combine rows.
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, "nvshmem_put" in (topology["peers"]["low_latency"] or []))
    puts = any(said)
    results["backend"] = ("puts" if puts else "kernels") if topology["mapped"]["low_latency"] else "portable"
    # How the peers' buffers were mapped (the mapping moves these figures: `--peer-memory vmm` / `ipc`).
    results["peer_memory"] = topology["peer_memory"]["low_latency"]
    results["peer_times"] = peers_in_these_ranks(args, selections_per_rank(topk_idx, num_experts, dist.get_world_size()),
                                                 device)
    return results


def peers_in_these_ranks(args, selections_to: list, device: str) -> dict:
    """{peer: {"dispatch_us", "combine_us"}} of the NCCL and copy peers in args.peers, timed on moe_ep's
    ranks after its calls: the bytes of selections_to[r] selections sent to rank r, and back."""
    per_selection = low_latency_selection_bytes(args.hidden)
    times = {}
    for call, reverse in (("dispatch", False), ("combine", True)):
        if NCCL in args.peers:
            seconds = nccl_peer.rows_per_pair_seconds(selections_to, per_selection[call], reverse, args.warmup,
                                                      args.iters, device)
            times.setdefault(NCCL, {})[f"{call}_us"] = seconds * 1e6
        if COPY in args.peers:
            seconds = copy_peer.copy_seconds(sum(selections_to) * per_selection[call], args.warmup, args.iters, device)
            times.setdefault(COPY, {})[f"{call}_us"] = seconds * 1e6
    return times


def make_parser() -> argparse.ArgumentParser:
    parser = command_parser(__spec__, __doc__)
    add_problem_arguments(parser, experts_help="with 8 ranks the run uses 288 as well")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="append one JSON line per run of moe_ep here (its peers' times inside)")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (portable backend): checks the script anywhere")
    parser.add_argument("--graph", action="store_true", help="also the device time per call, from CUDA-graph replays")
    parser.add_argument("--peer-memory", choices=LOW_LATENCY_MEMORY_KINDS, default="auto",
                        help="how the low-latency buffers are mapped (the kernels' low_latency_memory choice): the "
                             "virtual-memory API (vmm), CUDA IPC handles (ipc), NVSHMEM's symmetric heap (nvshmem), "
                             "or auto (vmm where the GPU can)")
    parser.add_argument("--puts", action="store_true",
                        help="every peer reached through NVSHMEM puts, as peers on other hosts are (the buffers on "
                             "NVSHMEM's heap; the kernels of moe_ep._internode)")
    add_output_arguments(parser)
    add_peer_arguments(parser)
    return parser


def peer_skip_reasons(args, num_ranks: int, num_gpus: int, given_up: dict, **checks) -> dict:
    """peers.skip_reasons of the low-latency calls at num_ranks ranks on num_gpus GPUs (checks: its
    deep_ep_check and portable_check, where a test gives its own)."""
    return skip_reasons(args, num_ranks, num_gpus, args.tokens * args.hidden * 2, given_up=given_up,
                        low_latency=True, **checks)


def measure_peers(args, num_ranks: int, num_experts: int, rows: list, reasons: dict) -> dict:
    """{peer: its rows (a dict per rank of "*_us" times)} of this problem: NCCL's and the copy's from moe_ep's
    ranks, then DeepEP's and the portable backend's from ranks of their own; a peer that fails there gets
    its reason in `reasons` instead."""
    found = {peer: [r["peer_times"][peer] for r in rows] for peer in (NCCL, COPY) if not reasons[peer]}
    use_cuda = not args.cpu
    if not reasons[DEEP_EP]:
        found[DEEP_EP], reasons[DEEP_EP] = run_in_own_ranks(deepep_peer.low_latency_rank,
                                                            (args, num_experts, LOW_LATENCY_SEED), num_ranks,
                                                            use_cuda, args.peer_timeout)
    if not reasons[PORTABLE]:
        # The portable backend synchronises with the host inside its calls: no CUDA graph can hold them.
        portable = argparse.Namespace(**{**vars(args), "graph": False, "peers": []})
        found[PORTABLE], reasons[PORTABLE] = run_in_own_ranks(rank_bench, (portable, num_experts), num_ranks, use_cuda,
                                                              args.peer_timeout, env={"MOE_EP_BACKEND": "portable"})
    return {peer: peer_rows for peer, peer_rows in found.items() if peer_rows}


# The times set against the peers' (the hook's parts are moe_ep's alone).
COMPARED = ("dispatch_us", "combine_us", "combine_zero_copy_us", "dispatch_graph_us", "combine_graph_us",
            "combine_zero_copy_graph_us")


def call_and_metric(key: str) -> tuple:
    """A time's key in moe_ep's or a peer's rows ("dispatch_us", "combine_zero_copy_graph_us", ...) -> (call, metric)."""
    name = key[:-3]
    return (name[:-6], "graph_us_per_call") if name.endswith("_graph") else (name, "us_per_call")


def slowest(rows: list) -> dict:
    """Every "*_us" time of the rows (one per rank), the slowest rank's."""
    return {k: max(r[k] for r in rows) for k in rows[0] if k.endswith("_us")}


def report_problem(args, num_ranks: int, num_experts: int, rows: list, peer_rows: dict, reasons: dict,
                   report: Report, bar) -> None:
    """Prints moe_ep's row of one problem, then each peer's with moe_ep's speed over it, then why a peer
    was skipped; records them all in the report."""
    shape = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=num_experts)
    worst = slowest(rows)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("dispatch_gbps", "combine_gbps")}
    say(bar, f"{num_ranks:>5} {num_experts:>7} {rows[0]['backend']:>8} {worst['dispatch_us']:>11.1f} "
             f"{mean['dispatch_gbps']:>6.1f} {worst['combine_us']:>10.1f} {mean['combine_gbps']:>6.1f} "
             f"{worst['combine_zero_copy_us']:>12.1f} "
             f"{worst['dispatch_send_us']:>9.1f}+{worst['dispatch_recv_us']:<9.1f} / "
             f"{worst['combine_send_us']:>7.1f}+{worst['combine_recv_us']:<7.1f}"
             + (f"  graph: {worst['dispatch_graph_us']:.1f} / {worst['combine_graph_us']:.1f} / "
                f"{worst['combine_zero_copy_graph_us']:.1f} us" if "dispatch_graph_us" in worst else ""))
    for key, value in worst.items():
        call, metric = call_and_metric(key)
        report.add(call, shape, num_ranks, MOE_EP, metric, value, "us")
    for call in ("dispatch", "combine"):
        report.add(call, shape, num_ranks, MOE_EP, "gbps_per_rank", mean[f"{call}_gbps"], "GB/s")
    selections = [r["selections"] for r in rows]
    per_selection = low_latency_selection_bytes(args.hidden)
    for peer, timed in peer_rows.items():
        theirs = {k: v for k, v in slowest(timed).items() if k in COMPARED}
        speed = {key: ratio(theirs[key], worst[key]) for key in theirs if key in worst}  # their time over ours
        gbps = {call: sum(n * per_selection[call] / t[f"{call}_us"] / 1e3 for n, t in zip(selections, timed)) / len(timed)
                for call in ("dispatch", "combine")}
        zero_copy = f"{theirs['combine_zero_copy_us']:>12.1f}" if "combine_zero_copy_us" in theirs else f"{'-':>12}"
        faster = ", ".join(f"{key[:-3]} {shown_ratio(value)}" for key, value in speed.items())
        say(bar, f"{num_ranks:>5} {num_experts:>7} {peer:>8} {theirs['dispatch_us']:>11.1f} {gbps['dispatch']:>6.1f} "
                 f"{theirs['combine_us']:>10.1f} {gbps['combine']:>6.1f} {zero_copy}  moe_ep faster by: {faster}")
        for key, value in theirs.items():
            call, metric = call_and_metric(key)
            report.add(call, shape, num_ranks, peer, metric, value, "us")
            if speed.get(key) is not None:
                report.add(call, shape, num_ranks, MOE_EP, f"vs_{peer}" + ("_graph" if "graph" in metric else ""),
                           speed[key], "x", peer=peer)
        for call in ("dispatch", "combine"):
            report.add(call, shape, num_ranks, peer, "gbps_per_rank", gbps[call], "GB/s")
    for peer, reason in reasons.items():
        if reason:
            say(bar, f"  {peer} at {num_ranks} ranks, {num_experts} experts: "
                     f"{'' if reason.startswith('failed') else 'skipped: '}{reason}")
            report.skipped("all", shape, num_ranks, peer, reason)
    if args.json:
        with open(args.json, "a") as f:
            options = {k: v for k, v in vars(args).items()
                       if k not in ("ranks", "experts", "json", "cpu", "graph", "jsonl", "plot", "peers")}
            f.write(json.dumps(dict(bench="low_latency", ranks=num_ranks, experts=num_experts, **options,
                                    per_rank=rows)) + "\n")


def plot_rank_sweep(report: Report, args) -> None:
    """Latency against ranks, a line per call and backend, at --experts: wall time, and with --graph device time."""
    for metric, what in (("us_per_call", "wall time"), ("graph_us_per_call", "device time (CUDA graph)")):
        series = {}
        for record in report.select(metric=metric, shape__experts=args.experts):
            if record["mode"] in ("dispatch", "combine", "combine_zero_copy"):
                series.setdefault(f"{record['backend']} {record['mode']}", []).append((record["ranks"], record["value"]))
        report.plot(f"low_latency_{metric}_vs_ranks.png", f"low-latency calls, {args.tokens} tokens a rank: {what}",
                    "ranks", "us per call (slowest rank)", series)


def main():
    parser = make_parser()
    args = parser.parse_args()
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    if not args.cpu and not torch.cuda.is_available():
        # The message alone: the usage that parser.error prints first would bury it.
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    num_gpus = 0 if args.cpu else gpus_of_the_ranks()
    report = Report("low_latency", args.jsonl, args.plot)
    problems = [(n, e) for n in args.ranks for e in sorted({args.experts, 288 if n == 8 else args.experts})]
    bar = progress(len(problems), "low_latency", unit="problem")
    failed = False
    given_up = {}
    try:
        say(bar, f"{'ranks':>5} {'experts':>7} {'backend':>8} {'dispatch us':>11} {'GB/s':>6} {'combine us':>10} "
                 f"{'GB/s':>6} {'zero-copy us':>12} {'hook: send+recv us (dispatch / combine)':>40}")
        for num_ranks, num_experts in problems:
            bar.set_postfix_str(f"{num_ranks} ranks, {num_experts} experts")
            reasons = peer_skip_reasons(args, num_ranks, num_gpus, given_up)
            own = argparse.Namespace(**{**vars(args), "peers": [p for p in (NCCL, COPY) if not reasons[p]]})
            try:
                with start_ranks(num_ranks, use_cuda=not args.cpu) as pool:
                    rows = pool.run(rank_bench, own, num_experts)
            except RankError as error:  # the next shape still runs
                say(bar, f"{num_ranks:>5} {num_experts:>7} FAILED: {error}")
                failed = True
                bar.update(1)
                continue
            peer_rows = measure_peers(args, num_ranks, num_experts, rows, reasons)
            note_hangs(reasons, given_up, f"{num_ranks} ranks, {num_experts} experts")
            report_problem(args, num_ranks, num_experts, rows, peer_rows, reasons, report, bar)
            bar.update(1)
    finally:
        bar.close()
    plot_rank_sweep(report, args)
    report.say_plots()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
