"""get_dispatch_layout on the GPU: the kernel, the whole Python call, and torch ops as megatron-core
computes the same layout, side by side; all ranks run concurrently on the visible GPUs.

    python -m moe_ep.bench.layout --ranks 8 --tokens 4096 --topk 8 --experts 256
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from moe_ep import Buffer, _native

from . import command_parser
from .timing import cuda_kernel_us, host_call_us
from .torchrun import add_ranks_argument, gpus_of_the_ranks, rank_counts, start_ranks

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = [2, 4, 8]


def torch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """The layout with plain torch ops, the way megatron's dispatchers derive it from a routing map."""
    valid = topk_idx >= 0
    routing_map = torch.zeros(topk_idx.shape[0], num_experts, dtype=torch.bool, device=topk_idx.device)
    routing_map.scatter_(1, topk_idx.clamp(min=0), valid)
    per_expert = routing_map.sum(0, dtype=torch.int32)
    in_rank = routing_map.view(topk_idx.shape[0], num_ranks, -1).any(-1)
    return in_rank.sum(0, dtype=torch.int32), None, per_expert, in_rank


def rank_bench(args):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    scores = torch.rand(args.tokens, args.experts, generator=g, dtype=torch.float32, device="cpu")
    topk_idx = scores.topk(args.topk, dim=1).indices.cuda()
    buffer = Buffer(dist.group.WORLD)
    ops = _native.ops()
    dist.barrier()
    kernel = cuda_kernel_us(lambda: ops.get_dispatch_layout(topk_idx, args.experts, num_ranks, num_ranks))
    dist.barrier()
    call = host_call_us(lambda: buffer.get_dispatch_layout(topk_idx, args.experts), sync=torch.cuda.synchronize)
    dist.barrier()
    torch_kernel = cuda_kernel_us(lambda: torch_layout(topk_idx, args.experts, num_ranks))
    dist.barrier()
    torch_call = host_call_us(lambda: torch_layout(topk_idx, args.experts, num_ranks), sync=torch.cuda.synchronize)
    ours = buffer.get_dispatch_layout(topk_idx, args.experts)
    ref = torch_layout(topk_idx, args.experts, num_ranks)
    same = all(torch.equal(a, b) for a, b in zip((ours[0], ours[2], ours[3]), (ref[0], ref[2], ref[3])))
    return dict(rank=rank, mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), kernel_us=kernel, call_us=call, torch_kernel_us=torch_kernel, torch_call_us=torch_call,
                same_as_torch=same)


def main():
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--json", help="append one JSON line per rank count here")
    args = parser.parse_args()
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    # The kernel alone, in this process with no other rank on the GPU: the figure to hold to the goal.
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(args.tokens, args.experts, generator=g, dtype=torch.float32, device="cpu")
    topk_idx = scores.topk(args.topk, dim=1).indices.cuda()
    for num_ranks in args.ranks:
        solo = cuda_kernel_us(lambda: _native.ops().get_dispatch_layout(topk_idx, args.experts, num_ranks, num_ranks))
        solo_torch = cuda_kernel_us(lambda: torch_layout(topk_idx, args.experts, num_ranks))
        print(f"solo process, layout for {num_ranks} ranks: kernel {solo:.1f} us, torch ops {solo_torch:.1f} us")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(bench="layout_solo", ranks=num_ranks, kernel_us=solo, torch_us=solo_torch)) + "\n")
    print(f"{'ranks':>5} {'kernel us':>10} {'call us':>9} {'torch kernels us':>17} {'torch call us':>14} "
          f"{'speedup (call)':>15} same")
    for num_ranks in args.ranks:
        with start_ranks(num_ranks, use_cuda=True) as pool:
            rows = pool.run(rank_bench, args)
        worst = {k: max(r[k] for r in rows) for k in ("kernel_us", "call_us", "torch_kernel_us", "torch_call_us")}
        med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in worst}
        same = all(r["same_as_torch"] for r in rows)
        if not all(r["mps"] for r in rows) and num_ranks > gpus_of_the_ranks():
            print("warning: ranks share a GPU without MPS; their kernels are time-sliced")
        print(f"{num_ranks:>5} {med['kernel_us']:>10.1f} {med['call_us']:>9.1f} {med['torch_kernel_us']:>17.1f} "
              f"{med['torch_call_us']:>14.1f} {med['torch_call_us'] / med['call_us']:>14.1f}x {same}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(bench="layout", ranks=num_ranks, tokens=args.tokens, topk=args.topk,
                                        experts=args.experts, median=med, worst=worst, same=same,
                                        device=torch.cuda.get_device_name())) + "\n")


if __name__ == "__main__":
    main()
