"""Buffer.profile() over a few rounds of layout, dispatch, cached dispatch and combine: every rank's
phase times, gathered on rank 0 and printed as one table.

    moe-ep-bench profile --ranks 4 --cpu
    moe-ep-bench profile --ranks 8 --tokens 4096 --hidden 7168   # CUDA ranks (the default with a GPU)
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from moe_ep import Buffer
from moe_ep.buffer import default_config_size_hints
from moe_ep.profiling import format_table

from . import command_parser
from .torchrun import add_ranks_argument, rank_counts, start_ranks

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = 4


def round_inputs(args, device: torch.device):
    """This rank's rows (bf16), top-k ids and weights for the rounds, seeded by its rank."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, args.hidden, generator=g, dtype=torch.float32).to(device, torch.bfloat16)
    scores = torch.rand(args.tokens, args.experts, generator=g, dtype=torch.float32)
    topk_idx = scores.topk(args.topk, dim=1).indices.to(device)
    topk_weights = torch.rand(args.tokens, args.topk, generator=g, dtype=torch.float32).to(device)
    return x, topk_idx, topk_weights


def normal_round(buffer: Buffer, x, topk_idx, topk_weights, num_experts: int):
    """A round of normal calls, as a function of nothing: a layout, a fresh dispatch, a cached dispatch and
    a combine."""
    def one_round():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights)
        buffer.dispatch(x, handle=handle)
        buffer.combine(recv_x, handle, topk_weights=recv_w)
    return one_round


def rank_rounds(args, use_cuda: bool):
    """args.rounds rounds on this rank under one Profile -> the gathered summaries on rank 0, else None."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    x, topk_idx, topk_weights = round_inputs(args, device)
    buffer = Buffer(dist.group.WORLD, default_config_size_hints(args.hidden * 2, dist.get_world_size())[0])
    one_round = normal_round(buffer, x, topk_idx, topk_weights, args.experts)
    one_round()  # the first round maps the kernels' buffers: not what later rounds cost
    with buffer.profile() as prof:
        for _ in range(args.rounds):
            one_round()
    return prof.gather()


def main():
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS, "ranks")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks over gloo (the default without a GPU)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    args = parser.parse_args()
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    use_cuda = not args.cpu and torch.cuda.is_available()
    with start_ranks(args.ranks, use_cuda=use_cuda) as pool:
        gathered = pool.run(rank_rounds, args, use_cuda)[0]
    print(f"Buffer.profile(): {args.rounds} rounds of layout, dispatch, cached dispatch and combine on "
          f"{args.ranks} {'CUDA' if use_cuda else 'CPU'} ranks, {args.tokens} tokens x {args.hidden} bf16, "
          f"top-{args.topk} of {args.experts} experts")
    print(format_table(gathered))


if __name__ == "__main__":
    main()
