"""One megatron-core MoE layer's forward and backward with moe_ep's dispatcher ("deepep") and with
megatron's own ("alltoall"), in one run: the same seeds (equal parameters and inputs), the same shape,
the same ranks. Every rank is one expert-parallel rank (EP = --ranks); float32 parameters, local experts
(no transformer-engine), --tokens tokens a rank.

Per dispatcher: ms per forward+backward (host wall time of --iters rounds after --warmup, a barrier
before, the device synchronised after), the mean over the ranks and the slowest rank; deepep's time over
alltoall's from the same run (below 1: deepep is faster); and the largest difference between the two
layers' outputs and input gradients on any rank, which should be float rounding only (the exit status
is 1 when it is not).

Ranks sharing one GPU (more ranks than GPUs) talk over gloo, since NCCL refuses several ranks on one
GPU: alltoall's all-to-all then goes through the host while moe_ep moves the tokens through its kernels,
which is not like for like, and the output says so. With a GPU a rank, alltoall runs over NCCL.

    moe-ep-bench megatron_layer --ranks 4 --tokens 4096 --hidden 1024 --ffn-hidden 4096 --experts 16 --topk 2
    moe-ep-bench megatron_layer --cpu --ranks 2 --tokens 64 --hidden 128 --ffn-hidden 256   # on CPU ranks
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.distributed as dist

from moe_ep.launch import sm_share_env

from .report import Report, add_output_arguments
from .torchrun import add_ranks_argument, gpus_of_the_ranks, rank_counts, start_ranks
from .timing import wall_seconds_per_call

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = 4

DISPATCHERS = ("deepep", "alltoall")
INPUT_SEED = 3000
# The largest output difference, relative to the largest output, that float summation order explains.
MATCH_TOLERANCE = 1e-4


def transports(cpu: bool, ranks_share_gpu: bool) -> dict:
    """How each dispatcher's tokens travel, and whether the two are compared like for like."""
    if cpu:
        return dict(deepep="moe_ep's portable backend over gloo (CPU ranks)", alltoall="gloo (CPU ranks)",
                    like_for_like=False, note="CPU ranks check the script: their times are no GPU comparison")
    if ranks_share_gpu:
        return dict(deepep="moe_ep's kernels (ranks sharing a GPU)",
                    alltoall="gloo through the host (NCCL refuses several ranks on one GPU)", like_for_like=False,
                    note="ranks share a GPU, so alltoall runs over gloo, not NCCL: not like for like")
    return dict(deepep="moe_ep's kernels", alltoall="NCCL", like_for_like=True, note="a GPU a rank: like for like")


def rank_layer_times(args) -> dict:
    """On every rank: each dispatcher's layer timed on the same input, and the largest difference of its
    output and input gradient from the first dispatcher's (absolute, and the largest output's size)."""
    warnings.filterwarnings("ignore", module=r"megatron\.")  # its fallbacks from optional packages bury the table
    from megatron.core import parallel_state

    from moe_ep.megatron.cpu_support import enable_cpu_execution

    if args.cpu:
        enable_cpu_execution(force=True)
    from moe_ep.megatron.seeded_layer import moe_layer_config, seeded_moe_layer

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(INPUT_SEED + rank)
    x = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device)
    upstream = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device)
    times, first = {}, None
    out_diff = grad_diff = out_size = 0.0
    for dispatcher in args.dispatchers:
        config = moe_layer_config(args.experts, args.topk, args.hidden, dispatcher, world,
                                  ffn_hidden_size=args.ffn_hidden)
        layer = seeded_moe_layer(config, args.experts).to(device)
        inputs = x.clone().requires_grad_(True)

        def forward_backward():
            inputs.grad = None
            layer.zero_grad(set_to_none=True)
            out, _ = layer(inputs)
            out.backward(upstream)
            return out

        out = forward_backward().detach()
        if first is None:
            first, out_size = (out, inputs.grad.clone()), float(out.abs().max())
        else:
            out_diff = max(out_diff, float((out - first[0]).abs().max()))
            grad_diff = max(grad_diff, float((inputs.grad - first[1]).abs().max()))
        times[dispatcher] = wall_seconds_per_call(forward_backward, args.warmup, args.iters) * 1e3
        del layer
    dist.barrier()  # every rank is done with megatron's groups before any rank takes them down
    parallel_state.destroy_model_parallel()
    return dict(rank=rank, ms=times, out_diff=out_diff, grad_diff=grad_diff, out_size=out_size)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ranks_argument(parser, RANKS, "expert-parallel ranks")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a rank (default 4096)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--ffn-hidden", type=int, default=4096, help="each expert's FFN hidden size (default 4096)")
    parser.add_argument("--experts", type=int, default=16, help="experts in all, a multiple of --ranks (default 16)")
    parser.add_argument("--topk", type=int, default=2, help="experts a token is routed to (default 2)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--dispatchers", nargs="+", choices=DISPATCHERS, default=list(DISPATCHERS),
                        help="megatron token dispatcher types to time (default: deepep alltoall)")
    parser.add_argument("--sm-share", default="auto",
                        help="where ranks share a GPU: the percentage of its SMs one rank may hold at once, as "
                             "python -m moe_ep.launch --sm-share (auto: (R + 1) / 2R for R ranks a GPU)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks over gloo: checks the script anywhere")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} is not a multiple of --ranks {args.ranks}")
    if len(set(args.dispatchers)) != len(args.dispatchers):
        parser.error("--dispatchers: each dispatcher once")
    if not args.cpu and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    return args


def report_results(args, rows: list, transport: dict, report: Report) -> bool:
    """The table and the JSON lines of the ranks' results; returns whether the layers' outputs matched."""
    shape = dict(tokens=args.tokens, hidden=args.hidden, ffn_hidden=args.ffn_hidden, experts=args.experts,
                 topk=args.topk)
    print(f"megatron MoE layer forward+backward, {args.ranks} ranks (EP={args.ranks}), {args.tokens} tokens a rank, "
          f"hidden {args.hidden}, ffn hidden {args.ffn_hidden}, top-{args.topk} of {args.experts} experts, "
          f"float32, {args.iters} rounds after {args.warmup}")
    print(f"note: {transport['note']}")
    print(f"{'dispatcher':<10} {'ms mean':>9} {'ms max rank':>12}  transport")
    means = {}
    for dispatcher in args.dispatchers:
        per_rank = [r["ms"][dispatcher] for r in rows]
        means[dispatcher] = sum(per_rank) / len(per_rank)
        print(f"{dispatcher:<10} {means[dispatcher]:>9.2f} {max(per_rank):>12.2f}  {transport[dispatcher]}")
        common = dict(per_rank=per_rank, transport=transport[dispatcher], like_for_like=transport["like_for_like"])
        report.add("forward_backward", shape, args.ranks, dispatcher, "ms_mean", means[dispatcher], "ms", **common)
        report.add("forward_backward", shape, args.ranks, dispatcher, "ms_max_rank", max(per_rank), "ms", **common)
    if len(means) < 2:
        return True
    ratio = means["deepep"] / means["alltoall"]
    caveat = "" if transport["like_for_like"] else f" ({transport['note']})"
    print(f"deepep / alltoall: {ratio:.2f}x the time (mean over ranks){caveat}")
    report.add("forward_backward", shape, args.ranks, "deepep", "vs_alltoall", ratio, "x",
               like_for_like=transport["like_for_like"])
    out_diff, grad_diff = max(r["out_diff"] for r in rows), max(r["grad_diff"] for r in rows)
    limit = MATCH_TOLERANCE * max(1.0, max(r["out_size"] for r in rows))
    matched = out_diff <= limit and grad_diff <= limit
    print(f"outputs: max |deepep - alltoall| {out_diff:.3e}, input gradients {grad_diff:.3e} "
          f"({'match' if matched else 'DIFFER'}: limit {limit:.1e})")
    for metric, value in (("output_max_abs_diff", out_diff), ("input_grad_max_abs_diff", grad_diff)):
        report.add("check", shape, args.ranks, "deepep", metric, value, None, against="alltoall", matched=matched)
    report.bar_chart(f"megatron_layer_{args.ranks}ranks.png",
                     f"MoE layer forward+backward, {args.ranks} ranks, {args.tokens} tokens a rank"
                     + ("" if transport["like_for_like"] else "\n(" + transport["note"] + ")"),
                     "ms (mean over ranks)", means)
    return matched


def main(argv=None) -> int:
    args = parse_args(argv)
    shares_gpu = not args.cpu and args.ranks > gpus_of_the_ranks()
    env = sm_share_env(args.sm_share, args.ranks) if shares_gpu else {}
    transport = transports(args.cpu, shares_gpu)
    report = Report("megatron_layer", args.jsonl, args.plot)
    with start_ranks(args.ranks, use_cuda=not args.cpu, env=env) as pool:
        rows = pool.run(rank_layer_times, args)
    matched = report_results(args, rows, transport, report)
    report.say_plots()
    return 0 if matched else 1


if __name__ == "__main__":
    sys.exit(main())
