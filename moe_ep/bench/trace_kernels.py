"""Device time of each kernel in a call, every rank running: torch.profiler (CUPTI) around a few rounds.

The benchmarks give wall time per call; this says what the GPU spent inside it, kernel by kernel (the
low-latency send and receive kernels, the intranode notify/dispatch/combine kernels, allocations'
memsets), so the gap between the two is host work and queueing. Per kernel: launches per round and
mean device microseconds per launch, the mean and the worst over ranks.

    python -m moe_ep.bench.trace_kernels --ranks 8 --mode low_latency     # 128 tokens, 7168, top-8 of 256
    python -m moe_ep.bench.trace_kernels --ranks 4 --mode normal          # 4096 tokens, fp8 dispatch + combine
    python -m moe_ep.bench.trace_kernels --ranks 2 --mode normal --trace-dir out/traces   # + chrome traces
    python -m moe_ep.bench.trace_kernels --ranks 8 --dispatch-only --lockstep   # one dispatch a round, rounds in step
    python -m moe_ep.bench.trace_kernels --ranks 8 --mode normal --arena   # the one-pass calls

With --cpu (portable backend on CPU tensors) it reports the CPU operators instead, which checks the
script anywhere.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from moe_ep import Buffer, fp8
from moe_ep.buffer import default_config_size_hints
from moe_ep.config import arena_bytes

from . import command_parser
from .timing import device_sync
from .torchrun import add_ranks_argument, rank_counts, start_ranks

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = [8]


def _low_latency_round(args, device):
    """A round = one low-latency dispatch and one combine, as a decode step makes them."""
    num_ranks = dist.get_world_size()
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    topk_idx = torch.rand(args.tokens, args.experts, dtype=torch.float32, device=device).topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    local = args.experts // num_ranks
    y = torch.randn(local, num_ranks * args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    size = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, args.experts)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=local)

    def one_round():
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, args.tokens, args.experts, use_fp8=True)
        if not args.dispatch_only:
            buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

    return one_round


def _normal_round(args, device):
    """A round = one fp8 dispatch (with its count exchange) and one combine of the received rows; with
    --arena both are the one-pass calls through the Buffer's arena (the rows copied into
    empty_combine_input first)."""
    num_ranks = dist.get_world_size()
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    x_fp8 = fp8.per_token_cast_to_fp8(x)
    topk_idx = torch.rand(args.tokens, args.experts, dtype=torch.float32, device=device).topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    dispatch_config, combine_config = Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)
    nvl = default_config_size_hints(args.hidden * 2, num_ranks)[0]
    rows = args.tokens * num_ranks  # the most a rank can receive
    # Room for the first dispatch's recv_x, a round's and its combine input (bf16 rows with fp8 scales
    # bound the fp8 ones).
    arena = arena_bytes(rows, args.hidden * 2, args.hidden // 128 * 4, args.topk) if args.arena else 0
    buffer = Buffer(dist.group.WORLD, nvl, num_arena_bytes=arena)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=topk_weights, config=dispatch_config)
    (recv, _), _, _, _, _, _ = buffer.dispatch(x_fp8, **layout)
    # Same routing every round: same rows.
    y = torch.randn(recv.shape, dtype=torch.float32, device=device).to(torch.bfloat16)

    def one_round():
        _, _, recv_w, _, handle, _ = buffer.dispatch(x_fp8, **layout)
        rows = buffer.empty_combine_input(handle, args.hidden).copy_(y) if args.arena else y
        buffer.combine(rows, handle, topk_weights=recv_w, config=combine_config)

    return one_round


def rank_trace(args):
    rank = dist.get_rank()
    torch.manual_seed(3000 + rank)
    device = "cpu" if args.cpu else "cuda"
    one_round = (_low_latency_round if args.mode == "low_latency" else _normal_round)(args, device)
    for _ in range(args.warmup):
        one_round()
    device_sync()
    dist.barrier()
    activities = [ProfilerActivity.CPU] + ([] if args.cpu else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.rounds):
            if args.lockstep:
                device_sync()
                dist.barrier()
            one_round()
        device_sync()
        wall_us = (time.perf_counter() - start) * 1e6 / args.rounds
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"{args.mode}_{dist.get_world_size()}ranks_rank{rank}.json"))
    rows = {}
    for event in prof.key_averages():
        # Kernels carry device time; on CPU the operators' own time stands in.
        spent = event.self_cpu_time_total if args.cpu else event.self_device_time_total
        if spent > 0 and (args.cpu or event.device_type != torch.autograd.DeviceType.CPU):
            rows[event.key] = (event.count / args.rounds, spent / event.count)
    return dict(wall_us=wall_us, kernels=rows)


def report(results, top: int) -> None:
    names = sorted({name for r in results for name in r["kernels"]},
                   key=lambda n: -sum(r["kernels"].get(n, (0, 0))[0] * r["kernels"].get(n, (0, 0))[1] for r in results))
    walls = [r["wall_us"] for r in results]
    print(f"wall time per round: mean {sum(walls) / len(walls):.1f} us, worst rank {max(walls):.1f} us")
    print(f"{'per round':>9} {'us each (mean / worst rank)':>28}  kernel")
    for name in names[:top]:
        present = [r["kernels"][name] for r in results if name in r["kernels"]]
        per_round = sum(p[0] for p in present) / len(present)
        each = [p[1] for p in present]
        print(f"{per_round:>9.1f} {sum(each) / len(each):>14.1f} / {max(each):<11.1f}  {name[:90]}")


def main():
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS)
    parser.add_argument("--mode", choices=("low_latency", "normal"), default="low_latency")
    parser.add_argument("--tokens", type=int, help="default: 128 (low_latency) or 4096 (normal)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--top", type=int, default=15, help="kernels listed, by device time per round")
    parser.add_argument("--trace-dir", help="also write each rank's chrome trace here")
    parser.add_argument("--arena", action="store_true",
                        help="normal mode: the one-pass dispatch and combine, through an arena (num_arena_bytes)")
    parser.add_argument("--dispatch-only", action="store_true", help="low_latency mode: a round is one dispatch")
    parser.add_argument("--lockstep", action="store_true",
                        help="a device sync and a barrier before every round: no rank runs rounds ahead of the "
                             "others (the barrier's own skew between ranks stays)")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (portable backend): checks the script anywhere")
    args = parser.parse_args()
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    if not args.cpu and not torch.cuda.is_available():
        # The message alone: the usage that parser.error prints first would bury it.
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    if args.tokens is None:
        args.tokens = 128 if args.mode == "low_latency" else 4096
    for num_ranks in args.ranks:
        print(f"== {args.mode}, {num_ranks} ranks, {args.tokens} tokens, hidden {args.hidden}, "
              f"top-{args.topk} of {args.experts}")
        with start_ranks(num_ranks, use_cuda=not args.cpu) as pool:
            report(pool.run(rank_trace, args), args.top)


if __name__ == "__main__":
    main()
