"""The portable backend on CPU ranks (gloo): the baseline later backends are compared with.

    python -m moe_ep.bench.portable --ranks 4 --tokens 512 --hidden 1024
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from moe_ep import Buffer
from moe_ep.buffer import default_config_size_hints

from . import command_parser
from .torchrun import add_ranks_argument, rank_counts, start_ranks

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = 4


def timed(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def rank_bench(args):
    torch.set_num_threads(1)
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=g, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    scores = torch.rand(args.tokens, args.experts, generator=g, dtype=torch.float32, device="cpu")
    idx = scores.topk(args.topk, dim=1).indices
    weights = torch.rand(args.tokens, args.topk, generator=g, dtype=torch.float32, device="cpu")
    nvl = default_config_size_hints(args.hidden * 2, num_ranks)[0]
    rdma = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, args.experts)
    buffer = Buffer(dist.group.WORLD, nvl, rdma, low_latency_mode=True)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=weights)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    ll = buffer.low_latency_dispatch(x, idx, args.tokens, args.experts, use_fp8=False)
    return dict(
        dispatch_ms=timed(lambda: buffer.dispatch(x, **layout), args.iters),
        combine_ms=timed(lambda: buffer.combine(recv_x, handle), args.iters),
        ll_dispatch_ms=timed(lambda: buffer.low_latency_dispatch(x, idx, args.tokens, args.experts, use_fp8=False),
                             args.iters),
        ll_combine_ms=timed(lambda: buffer.low_latency_combine(ll[0], idx, weights, ll[2]), args.iters),
        recv_tokens=recv_x.shape[0],
    )


def main():
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS, "ranks")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    with start_ranks(args.ranks) as pool:
        rows = pool.run(rank_bench, args)
    print(f"portable backend, {args.ranks} CPU ranks (gloo), {args.tokens} tokens x {args.hidden} bf16, "
          f"top-{args.topk} of {args.experts} experts; median ms per call, slowest rank")
    for key in ("dispatch_ms", "combine_ms", "ll_dispatch_ms", "ll_combine_ms"):
        worst = max(r[key] for r in rows)
        mb = sum(r["recv_tokens"] for r in rows) / len(rows) * args.hidden * 2 / 1e6
        extra = f"  ({mb / worst:.2f} GB/s received per rank)" if key == "dispatch_ms" else ""
        print(f"  {key[:-3]:<12} {worst:8.2f} ms{extra}")


if __name__ == "__main__":
    main()
