"""One megatron-core MoE layer's forward and backward with moe_ep's dispatcher ("deepep") and with
megatron's own ("alltoall"), in one run: the same seeds (equal parameters and inputs), the same shape,
the same ranks. Every rank is one expert-parallel rank (EP = --ranks); --dtype parameters and tokens,
local experts without biases (no transformer-engine), --tokens tokens a rank.

Per run: ms per forward+backward (host wall time of --iters rounds after --warmup, a barrier before,
the device synchronised after), the mean over the ranks and the slowest rank; deepep's time over
alltoall's from the same run (below 1: deepep is faster); and the largest difference of every run's
output and input gradient from the first run's on any rank, which should be summation order only (the
exit status is 1 when it is not; fp8 dispatch's quantised tokens are reported apart).

deepep also runs pipelined in chunks (--overlap-chunks), with fp8 dispatch (--fp8-dispatch) and with a
shared expert beside its exchanges (--shared-expert-ffn), and for each run its communication is
measured in --iters more rounds by its own metrics (moe_ep_log_metrics, off in the timed rounds): the
dispatches' and combines' time, the part the layer waited for, the share hidden, the share of the
unpipelined run's communication hidden (1 - (t - t_compute) / t_comm), and the payload bytes sent.

Ranks sharing one GPU (more ranks than GPUs) talk over gloo, since NCCL refuses several ranks on one
GPU: alltoall's all-to-all then goes through the host while moe_ep moves the tokens through its kernels,
which is not like for like, and the output says so. With a GPU a rank, alltoall runs over NCCL.

    moe-ep-bench megatron_layer --ranks 4 --tokens 4096 --hidden 1024 --ffn-hidden 4096 --experts 16 --topk 2
    moe-ep-bench megatron_layer --ranks 4 --dtype bfloat16 --overlap-chunks 1 2 4 --fp8-dispatch \
        --shared-expert-ffn 2816
    moe-ep-bench megatron_layer --cpu --ranks 2 --tokens 64 --hidden 128 --ffn-hidden 256   # on CPU ranks
"""
from __future__ import annotations

import statistics
import sys
import warnings

import torch
import torch.distributed as dist

from moe_ep.launch import sm_share_env

from . import command_parser
from .report import Report, add_output_arguments
from .torchrun import add_ranks_argument, gpus_of_the_ranks, rank_counts, start_ranks
from .timing import wall_seconds_per_call

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = 4

DISPATCHERS = ("deepep", "alltoall")
INPUT_SEED = 3000
DTYPES = dict(float32=torch.float32, bfloat16=torch.bfloat16)
# The largest output difference, relative to the largest output, that summation order explains, by dtype.
MATCH_TOLERANCE = dict(float32=1e-4, bfloat16=2e-2)


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


def variants(args) -> list:
    """What is timed, in order: (name, dispatcher type, options set on its config). alltoall once; deepep
    once for each --overlap-chunks count, again with fp8 dispatch where --fp8-dispatch asks, and with the
    shared expert overlapping the exchanges where the layer has one (--shared-expert-ffn)."""
    chosen = []
    for dispatcher in args.dispatchers:
        if dispatcher != "deepep":
            chosen.append((dispatcher, dispatcher, {}))
            continue
        for fp8 in (False, True) if args.fp8_dispatch else (False,):
            for chunks in args.overlap_chunks:
                name = " ".join(["deepep"] + (["fp8"] if fp8 else []) + ([f"chunks={chunks}"] if chunks > 1 else []))
                chosen.append((name, dispatcher, dict(moe_ep_fp8_dispatch="on" if fp8 else "off",
                                                      moe_ep_overlap_chunks=chunks, moe_ep_log_metrics=True)))
        if args.shared_expert_ffn:  # the shared expert beside the exchanges: unquantised rows, no chunks
            chosen.append(("deepep shared-overlap", dispatcher, dict(moe_ep_fp8_dispatch="off", moe_ep_overlap_chunks=1,
                                                                     moe_ep_log_metrics=True,
                                                                     moe_shared_expert_overlap=True)))
    return chosen


def layer_fields(args) -> dict:
    """The TransformerConfig fields --dtype and --shared-expert-ffn set."""
    fields = {}
    if args.dtype == "bfloat16":
        fields.update(bf16=True, params_dtype=torch.bfloat16)
    if args.shared_expert_ffn:
        fields["moe_shared_expert_intermediate_size"] = args.shared_expert_ffn
    return fields


def _metered_rounds(layer, forward_backward, rounds: int) -> dict:
    """deepep's communication over `rounds` more rounds, from its own metrics (moe_ep_log_metrics, the
    CUDA events megatron's logging reads; left out of the timed rounds): the dispatches' and combines'
    time, the part of it the layer waited for, and the payload bytes this rank sent, each a round."""
    from moe_ep.megatron import shared_buffers

    metrics = layer.token_dispatcher.metrics
    sent = lambda: sum(int(buffer.stats()["sent_bytes"].sum()) for buffer in shared_buffers())  # noqa: E731
    metrics.take()  # whatever an earlier round left
    before = sent()
    for _ in range(rounds):
        forward_backward()
    _, comm, exposed = metrics.take()  # waits for the events
    return dict(comm_ms=comm / rounds, exposed_ms=exposed / rounds, sent_bytes=(sent() - before) / rounds)


def rank_layer_times(args) -> dict:
    """On every rank: each variant's layer timed on the same input; the largest difference of its output
    and input gradient from the first variant's (absolute, and the largest output's size), fp8 dispatch
    apart; deepep's communication a round."""
    warnings.filterwarnings("ignore", module=r"megatron\.")  # its fallbacks from optional packages bury the table
    from megatron.core import parallel_state

    from moe_ep.megatron.cpu_support import enable_cpu_execution

    if args.cpu:
        enable_cpu_execution(force=True)
    from moe_ep.megatron.seeded_layer import moe_layer_config, seeded_moe_layer

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(INPUT_SEED + rank)
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dtype)
    upstream = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dtype)
    times, comm, first = {}, {}, None
    out_diff = grad_diff = out_size = fp8_diff = 0.0
    not_finite = []  # runs whose output or input gradient holds a NaN or an inf: the maxima below read NaN as 0
    for name, dispatcher, options in variants(args):
        # Experts without biases, as in the MoE models people train (megatron-core 0.16.1's expert MLP
        # also adds its bias in place on a view where one rank holds every expert, which autograd refuses).
        config = moe_layer_config(args.experts, args.topk, args.hidden, dispatcher, world,
                                  ffn_hidden_size=args.ffn_hidden, add_bias_linear=False, **layer_fields(args))
        for option, value in options.items():  # moe_ep's options are attributes, not constructor fields
            setattr(config, option, value)
        layer = seeded_moe_layer(config, args.experts).to(device, dtype)
        inputs = x.clone().requires_grad_(True)

        def forward_backward():
            inputs.grad = None
            layer.zero_grad(set_to_none=True)
            out, _ = layer(inputs)
            out.backward(upstream)
            return out

        metrics = getattr(layer.token_dispatcher, "metrics", None)
        layer.token_dispatcher.metrics = None  # the timed rounds record no events
        out = forward_backward().detach()
        if not (torch.isfinite(out).all() and torch.isfinite(inputs.grad).all()):
            not_finite.append(name)
        if first is None:
            first, out_size = (out, inputs.grad.clone()), float(out.abs().max())
        elif options.get("moe_ep_fp8_dispatch") == "on":  # quantised tokens: a difference, not a check
            fp8_diff = max(fp8_diff, float((out - first[0]).abs().max()))
        else:
            out_diff = max(out_diff, float((out - first[0]).abs().max()))
            grad_diff = max(grad_diff, float((inputs.grad - first[1]).abs().max()))
        times[name] = wall_seconds_per_call(forward_backward, args.warmup, args.iters) * 1e3
        if metrics is not None:
            layer.token_dispatcher.metrics = metrics
            comm[name] = _metered_rounds(layer, forward_backward, args.iters)
        del layer
    dist.barrier()  # every rank is done with megatron's groups before any rank takes them down
    parallel_state.destroy_model_parallel()
    return dict(rank=rank, ms=times, comm=comm, out_diff=out_diff, grad_diff=grad_diff, out_size=out_size,
                fp8_diff=fp8_diff, not_finite=not_finite)


def parse_args(argv=None):
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS, "expert-parallel ranks")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a rank (default 4096)")
    add_moe_shape_arguments(parser, ffn_hidden=4096)
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--dispatchers", nargs="+", choices=DISPATCHERS, default=list(DISPATCHERS),
                        help="megatron token dispatcher types to time (default: deepep alltoall)")
    parser.add_argument("--overlap-chunks", type=int, nargs="+", default=[1],
                        help="deepep runs once for each count of chunks its layer is pipelined in "
                             "(moe_ep_overlap_chunks; default: 1, no pipeline)")
    parser.add_argument("--fp8-dispatch", action="store_true",
                        help="deepep runs again with fp8 dispatch (moe_ep_fp8_dispatch='on'; the experts get the "
                             "tokens dequantised, as without transformer-engine)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="parameters and tokens (default float32; bfloat16: as mixed-precision training "
                             "sends them)")
    parser.add_argument("--shared-expert-ffn", type=int, metavar="N",
                        help="the layer has a shared expert of FFN hidden size N, and deepep runs once more with it "
                             "overlapping the dispatch and combine (moe_shared_expert_overlap)")
    args = parse_rank_arguments(parser, argv, RANKS)
    if len(set(args.dispatchers)) != len(args.dispatchers):
        parser.error("--dispatchers: each dispatcher once")
    if min(args.overlap_chunks) < 1 or len(set(args.overlap_chunks)) != len(args.overlap_chunks):
        parser.error("--overlap-chunks: distinct counts >= 1")
    return args


def add_moe_shape_arguments(parser, ffn_hidden: int) -> None:
    """--hidden, --ffn-hidden, --experts and --topk, which every megatron benchmark takes."""
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--ffn-hidden", type=int, default=ffn_hidden,
                        help=f"each expert's FFN hidden size (default {ffn_hidden})")
    parser.add_argument("--experts", type=int, default=16, help="experts in all, a multiple of --ranks (default 16)")
    parser.add_argument("--topk", type=int, default=2, help="experts a token is routed to (default 2)")


def parse_rank_arguments(parser, argv, default_ranks: int):
    """The options every megatron benchmark shares (--sm-share, --cpu, the outputs) added, the command line
    parsed and its ranks resolved, --experts checked against them; no GPU without --cpu refused."""
    parser.add_argument("--sm-share", default="auto",
                        help="where ranks share a GPU: the percentage of its SMs one rank may hold at once, as "
                             "python -m moe_ep.launch --sm-share (auto: (R + 1) / 2R for R ranks a GPU, and no "
                             "share for bf16, whose GEMMs went wrong under one on an H200)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks over gloo: checks the script anywhere")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.ranks = rank_counts(parser, args.ranks, default_ranks)
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} is not a multiple of --ranks {args.ranks}")
    if not args.cpu and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    return args


def megatron_ranks(args, bf16: bool):
    """(the ranks to run on, whether they share a GPU): under MPS with --sm-share where they do; with
    --sm-share auto and bf16 GEMMs, without a share (moe_ep.mps.BF16_UNDER_SHARE)."""
    shares_gpu = not args.cpu and args.ranks > gpus_of_the_ranks()
    share = "100" if bf16 and args.sm_share == "auto" else args.sm_share
    env = sm_share_env(share, args.ranks) if shares_gpu else {}
    return start_ranks(args.ranks, use_cuda=not args.cpu, env=env), shares_gpu


def hidden_shares(means: dict, comm: dict) -> dict:
    """Per deepep variant with its communication measured: "hidden", the share of its own communication
    time the layer did not wait for (its metrics: 1 - exposed / comm); "hidden_vs_serial", the share of the
    unpipelined layer's communication that this variant hides, 1 - (t - t_compute) / t_comm, with t_comm
    and t_compute = t - exposed from the same dispatch without chunks or shared-expert overlap (absent when
    that was not run)."""
    shares = {}
    for name, c in comm.items():
        share = dict(hidden=1 - c["exposed_ms"] / c["comm_ms"] if c["comm_ms"] > 0 else None)
        serial = name.split(" chunks=")[0].replace(" shared-overlap", "")
        if serial in comm and comm[serial]["comm_ms"] > 0:
            compute = means[serial] - comm[serial]["exposed_ms"]
            share["hidden_vs_serial"] = 1 - (means[name] - compute) / comm[serial]["comm_ms"]
        shares[name] = share
    return shares


def report_results(args, rows: list, transport: dict, report: Report) -> bool:
    """The table and the JSON lines of the ranks' results; returns whether the layers' outputs matched
    (fp8 dispatch's outputs are reported, not checked: its tokens are quantised)."""
    shape = dict(tokens=args.tokens, hidden=args.hidden, ffn_hidden=args.ffn_hidden, experts=args.experts,
                 topk=args.topk)
    runs = variants(args)
    names = [name for name, _, _ in runs]
    print(f"megatron MoE layer forward+backward, {args.ranks} ranks (EP={args.ranks}), {args.tokens} tokens a rank, "
          f"hidden {args.hidden}, ffn hidden {args.ffn_hidden}, top-{args.topk} of {args.experts} experts, "
          f"{args.dtype}"
          + (f", a shared expert of FFN {args.shared_expert_ffn}" if args.shared_expert_ffn else "")
          + f", {args.iters} rounds after {args.warmup}")
    print(f"note: {transport['note']}")
    means, comm = {}, {}
    for name in names:
        per_rank = [r["ms"][name] for r in rows]
        means[name] = statistics.fmean(per_rank)
        if all(name in r.get("comm", {}) for r in rows):
            comm[name] = {key: statistics.fmean(r["comm"][name][key] for r in rows)
                          for key in ("comm_ms", "exposed_ms", "sent_bytes")}
    shares = hidden_shares(means, comm)
    print(f"{'run':<22} {'ms mean':>9} {'ms max rank':>12} {'comm ms':>8} {'exposed':>8} {'hidden':>7} "
          f"{'vs serial':>9} {'MB sent':>8}  transport")
    for name, dispatcher, _ in runs:
        per_rank = [r["ms"][name] for r in rows]
        c, share = comm.get(name), shares.get(name, {})
        pct = lambda v: f"{v:>6.0%}" if v is not None else f"{'-':>6}"  # noqa: E731
        figures = (f" {c['comm_ms']:>8.2f} {c['exposed_ms']:>8.2f} {pct(share['hidden'])} "
                   f"{pct(share.get('hidden_vs_serial')):>9} {c['sent_bytes'] / 1e6:>8.2f}") if c else f"{'':>46}"
        print(f"{name:<22} {means[name]:>9.2f} {max(per_rank):>12.2f}{figures}  {transport[dispatcher]}")
        common = dict(per_rank=per_rank, transport=transport[dispatcher], like_for_like=transport["like_for_like"])
        report.add("forward_backward", shape, args.ranks, name, "ms_mean", means[name], "ms", **common)
        report.add("forward_backward", shape, args.ranks, name, "ms_max_rank", max(per_rank), "ms", **common)
        if c:
            for metric, unit in (("comm_ms", "ms"), ("exposed_ms", "ms"), ("sent_bytes", "bytes")):
                report.add("communication", shape, args.ranks, name, metric, c[metric], unit)
            for metric, value in share.items():
                if value is not None:  # None: no communication to hide
                    report.add("communication", shape, args.ranks, name, metric, value, "fraction")
    if comm:
        print("comm ms: the dispatches' and combines' time a round, forward and backward (mean over ranks); exposed: "
              "the part the layer waited for; hidden: 1 - exposed / comm; vs serial: 1 - (t - t_compute) / t_comm "
              "against the same run without chunks or shared-expert overlap; MB sent: payload a rank sends a round")
    if "deepep fp8" in means and "deepep" in means:
        fp8_diff = max(r.get("fp8_diff", 0.0) for r in rows)
        print(f"fp8 dispatch: {means['deepep fp8'] / means['deepep']:.2f}x the {args.dtype} dispatch's time; "
              f"outputs differ from the first run's by at most {fp8_diff:.3e} (quantised tokens)")
    matched = True
    if "deepep" in means and "alltoall" in means:
        ratio = means["deepep"] / means["alltoall"]
        caveat = "" if transport["like_for_like"] else f" ({transport['note']})"
        print(f"deepep / alltoall: {ratio:.2f}x the time (mean over ranks){caveat}")
        report.add("forward_backward", shape, args.ranks, "deepep", "vs_alltoall", ratio, "x",
                   like_for_like=transport["like_for_like"])
    finite = True
    for name in names:
        ranks = [r["rank"] for r in rows if name in r.get("not_finite", ())]
        if ranks:
            finite = matched = False
            print(f"NOT FINITE: {name}'s output or input gradient holds NaN or inf on ranks {ranks}")
            report.add("check", shape, args.ranks, name, "not_finite_ranks", len(ranks), None, on_ranks=ranks,
                       matched=False)
    if len(means) > 1:
        out_diff, grad_diff = max(r["out_diff"] for r in rows), max(r["grad_diff"] for r in rows)
        limit = MATCH_TOLERANCE[args.dtype] * max(1.0, max(r["out_size"] for r in rows))
        matched = finite and out_diff <= limit and grad_diff <= limit
        print(f"outputs: max |run - {names[0]}| {out_diff:.3e}, input gradients {grad_diff:.3e} "
              f"({'match' if matched else 'DIFFER'}: limit {limit:.1e})")
        for metric, value in (("output_max_abs_diff", out_diff), ("input_grad_max_abs_diff", grad_diff)):
            report.add("check", shape, args.ranks, names[0], metric, value, None, against="the other runs",
                       matched=matched)
    report.bar_chart(f"megatron_layer_{args.ranks}ranks.png",
                     f"MoE layer forward+backward, {args.ranks} ranks, {args.tokens} tokens a rank"
                     + ("" if transport["like_for_like"] else "\n(" + transport["note"] + ")"),
                     "ms (mean over ranks)", means)
    return matched


def main(argv=None) -> int:
    args = parse_args(argv)
    ranks, shares_gpu = megatron_ranks(args, bf16=args.dtype == "bfloat16")
    transport = transports(args.cpu, shares_gpu)
    report = Report("megatron_layer", args.jsonl, args.plot)
    with ranks as pool:
        rows = pool.run(rank_layer_times, args)
    matched = report_results(args, rows, transport, report)
    report.say_plots()
    return 0 if matched else 1


if __name__ == "__main__":
    sys.exit(main())
