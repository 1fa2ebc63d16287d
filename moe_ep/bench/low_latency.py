"""Low-latency dispatch/combine latency and bandwidth, all ranks running at once.

Per rank, wall time per call (after `--warmup` calls, a barrier before, synchronized at the end),
for the whole call, for a zero-copy combine (the expert outputs already in the Buffer's rows), and,
with the hook, for the send part and the receive part (hook) separately. `--graph` adds each call's
device time: calls captured in a CUDA graph and replayed (no host work per call), so the host's share
of a call is the difference.
Bandwidth in DeepEP's metric: dispatch moves (hidden + hidden/128 * 4 + 16) bytes per (token, expert)
selection in fp8, combine hidden * 2 bytes per selection.

    python -m moe_ep.bench.low_latency --ranks 8                 # 288 experts with 8 ranks
    python -m moe_ep.bench.low_latency --ranks 8 --peer-memory ipc   # the buffers mapped through CUDA IPC
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
from moe_ep.launch import RankError, RankPool

from .timing import cuda_kernel_us, device_sync, wall_seconds_per_call


def add_problem_arguments(parser: argparse.ArgumentParser, experts_help: Optional[str] = None) -> None:
    """The shape of the low-latency problem (the timeline benchmark, ll_timeline, takes the same)."""
    parser.add_argument("--ranks", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256, help=experts_help)


def make_problem(args, num_experts: int, seed: int, device: str = "cuda"):
    """This rank's random inputs (x, top-k ids and weights), the experts' outputs for the combine (y,
    [local experts, ranks x tokens, hidden]) and a low-latency Buffer sized for them."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    topk_idx = torch.rand(args.tokens, num_experts, dtype=torch.float32, device=device).topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    local, rows = num_experts // num_ranks, num_ranks * args.tokens
    y = torch.randn(local, rows, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    size = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=local)
    return x, topk_idx, topk_weights, y, buffer


def rank_bench(args, num_experts: int):
    # The choice is read when the Buffer's kernel backend is made (its first low-latency call of CUDA tensors).
    with overridden(low_latency_memory=args.peer_memory):
        return _rank_bench(args, num_experts)


def _rank_bench(args, num_experts: int):
    x, topk_idx, topk_weights, y, buffer = make_problem(args, num_experts, 2000, "cpu" if args.cpu else "cuda")
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
    fp8_bytes = args.hidden + args.hidden // 128 * 4 + 16
    results["dispatch_gbps"] = selections * fp8_bytes / results["dispatch_us"] / 1e3
    results["combine_gbps"] = selections * args.hidden * 2 / results["combine_us"] / 1e3
    topology = buffer.topology()
    results["backend"] = "kernels" if topology["mapped"]["low_latency"] else "portable"
    # How the peers' buffers were mapped (the mapping moves these figures: `--peer-memory vmm` / `ipc`).
    results["peer_memory"] = topology["peer_memory"]["low_latency"]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser, experts_help="with 8 ranks the run uses 288 as well")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="append one JSON line per run here")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (portable backend): checks the script anywhere")
    parser.add_argument("--graph", action="store_true", help="also the device time per call, from CUDA-graph replays")
    parser.add_argument("--peer-memory", choices=LOW_LATENCY_MEMORY_KINDS, default="auto",
                        help="how the low-latency buffers are mapped (the kernels' low_latency_memory choice): the "
                             "virtual-memory API (vmm), CUDA IPC handles (ipc), NVSHMEM's symmetric heap (nvshmem), "
                             "or auto (vmm where the GPU can)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        # The message alone: the usage that parser.error prints first would bury it.
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    print(f"{'ranks':>5} {'experts':>7} {'backend':>8} {'dispatch us':>11} {'GB/s':>6} {'combine us':>10} {'GB/s':>6} "
          f"{'zero-copy us':>12} {'hook: send+recv us (dispatch / combine)':>40}")
    failed = False
    for num_ranks in args.ranks:
        for num_experts in sorted({args.experts, 288 if num_ranks == 8 else args.experts}):
            try:
                with RankPool(num_ranks, use_cuda=not args.cpu) as pool:
                    rows = pool.run(rank_bench, args, num_experts)
            except RankError as error:  # the next shape still runs
                print(f"{num_ranks:>5} {num_experts:>7} FAILED: {error}")
                failed = True
                continue
            worst = {k: max(r[k] for r in rows) for k in rows[0] if k.endswith("_us")}
            mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("dispatch_gbps", "combine_gbps")}
            print(f"{num_ranks:>5} {num_experts:>7} {rows[0]['backend']:>8} {worst['dispatch_us']:>11.1f} "
                  f"{mean['dispatch_gbps']:>6.1f} {worst['combine_us']:>10.1f} {mean['combine_gbps']:>6.1f} "
                  f"{worst['combine_zero_copy_us']:>12.1f} "
                  f"{worst['dispatch_send_us']:>9.1f}+{worst['dispatch_recv_us']:<9.1f} / "
                  f"{worst['combine_send_us']:>7.1f}+{worst['combine_recv_us']:<7.1f}"
                  + (f"  graph: {worst['dispatch_graph_us']:.1f} / {worst['combine_graph_us']:.1f} / "
                     f"{worst['combine_zero_copy_graph_us']:.1f} us" if "dispatch_graph_us" in worst else ""))
            if args.json:
                with open(args.json, "a") as f:
                    options = {k: v for k, v in vars(args).items() if k not in ("ranks", "experts", "json", "cpu", "graph")}
                    f.write(json.dumps(dict(bench="low_latency", ranks=num_ranks, experts=num_experts, **options,
                                            per_rank=rows)) + "\n")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
