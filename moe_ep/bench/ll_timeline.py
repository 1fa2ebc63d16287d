"""Where the time of a low-latency call goes when ranks share a GPU, from the kernels' own clock.

Needs the extension built with MOE_EP_TIMELINE=1: then every low-latency kernel stamps the GPU's global
timer (one clock for all processes on the GPU) at the edges of its phases (csrc/kernels/reports.cuh,
TimelineColumn). Every rank captures `--calls` calls in a CUDA graph (as `bench.low_latency --graph`
times them) and replays it once with the stamps cleared; each call's stamps are then taken relative to
its earliest send block on any rank. A profiler cannot show this: it serializes the ranks' kernels.

    MOE_EP_TIMELINE=1 python setup.py build_ext --inplace
    python -m moe_ep.bench.ll_timeline --ranks 8 [--combine]
"""
from __future__ import annotations

import json
import statistics

import torch
import torch.distributed as dist

from moe_ep._native import ops
from moe_ep.backends.peers import KernelEnums

from . import command_parser
from .low_latency import RANKS, add_problem_arguments, make_problem
from .torchrun import start_ranks
from .timing import device_sync


def rank_timeline(args, num_experts: int):
    if not ops().ll_timeline_built():
        raise RuntimeError("the extension was built without MOE_EP_TIMELINE=1: no timeline to read")
    x, topk_idx, topk_weights, y, buffer = make_problem(args, num_experts, 3000)
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, args.tokens, num_experts, use_fp8=True)

    def one_round():
        buffer.low_latency_dispatch(x, topk_idx, args.tokens, num_experts, use_fp8=True)
        if args.combine:
            buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            one_round()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.calls):
            one_round()
    graph.replay()
    device_sync()
    dist.barrier()
    ops().ll_timeline_reset()
    dist.barrier()
    graph.replay()
    device_sync()
    return ops().ll_timeline().tolist()


def phases(tables, skip: int, enums: KernelEnums):
    """Per call kind, the median over calls of each phase (us): [(name, mean over ranks, worst rank)].
    enums: the extension's (timeline_column and timeline_call_kind name the tables' columns and kinds)."""
    column, kinds = enums.timeline_column, enums.timeline_call_kind
    names = [name.lower() for name in column.names()]
    rows = [{int(r[column.CALL_NUMBER]): dict(zip(names, r)) for r in table if kinds.name_of(r[column.CALL_KIND])}
            for table in tables]
    calls = sorted(set.intersection(*(set(r) for r in rows)))[skip:]
    by_kind = {}
    for n in calls:
        stamps = [r[n] for r in rows]
        t0 = min(s["send_first_start"] for s in stamps)
        end = max(s["recv_last_end"] for s in stamps)
        flags = max(s["flags_raised"] for s in stamps)
        per_rank = {
            "send starts (after the call's first)": [s["send_first_start"] - t0 for s in stamps],
            "send blocks all running": [s["send_last_start"] - s["send_first_start"] for s in stamps],
            "send span": [s["send_last_end"] - s["send_first_start"] for s in stamps],
            "last block: rows done -> flags raised": [s["flags_raised"] - s["send_last_end"] for s in stamps],
            "wait kernel starts (after own send start)": [s["wait_start"] - s["send_first_start"] for s in stamps],
            "last flag raised anywhere -> wait sees all": [s["wait_seen"] - flags for s in stamps],
            "wait sees all -> receive starts": [s["recv_first_start"] - s["wait_seen"] for s in stamps],
            "receive span": [s["recv_last_end"] - s["recv_first_start"] for s in stamps],
            "call (first send start -> last receive end)": [end - t0] * len(stamps),
        }
        following = [r.get(n + 1) for r in rows]
        if all(f is not None for f in following):
            per_rank["receive end -> own next send start"] = [f["send_first_start"] - s["recv_last_end"]
                                                              for s, f in zip(stamps, following)]
        kind = kinds.name_of(stamps[0]["call_kind"]).lower()
        for name, values in per_rank.items():
            by_kind.setdefault(kind, {}).setdefault(name, []).append(
                (sum(values) / len(values) / 1e3, max(values) / 1e3))
    return {kind: [(name, statistics.median(v[0] for v in samples), statistics.median(v[1] for v in samples))
                   for name, samples in named.items()]
            for kind, named in by_kind.items()}


def main():
    parser = command_parser(__spec__, __doc__)
    add_problem_arguments(parser)
    parser.add_argument("--calls", type=int, default=20, help="rounds captured in the graph (at most 30 with --combine)")
    parser.add_argument("--skip", type=int, default=2, help="first calls of the replay left out")
    parser.add_argument("--combine", action="store_true", help="a round is a dispatch and a combine")
    parser.add_argument("--json", help="append one JSON line per run here")
    args = parser.parse_args()
    args.ranks = args.ranks or RANKS
    if args.calls * (2 if args.combine else 1) > 60:
        parser.error("--calls: the timeline keeps the last 64 calls")
    for num_ranks in args.ranks:
        with start_ranks(num_ranks, use_cuda=True) as pool:
            tables = pool.run(rank_timeline, args, args.experts)
        result = phases(tables, args.skip, KernelEnums(ops()))
        print(f"== {num_ranks} ranks, {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}"
              f"{', dispatch + combine rounds' if args.combine else ''}: us, median over calls (mean over ranks / worst)")
        for kind, named in result.items():
            print(f"  {kind}")
            for name, mean, worst in named:
                print(f"    {name:<46} {mean:8.1f} / {worst:8.1f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(bench="ll_timeline", ranks=num_ranks, **{k: v for k, v in vars(args).items()
                                                                                   if k not in ("ranks", "json")},
                                        phases=result)) + "\n")


if __name__ == "__main__":
    main()
