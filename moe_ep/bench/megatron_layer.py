"""One megatron-core MoE layer's forward and backward with moe_ep's dispatcher ("deepep") and with
megatron's own ("alltoall"), in one run: the same seeds (equal parameters and inputs), the same shape,
the same ranks. Every rank is one expert-parallel rank (EP = --ranks); --dtype parameters and tokens,
experts without biases, --tokens tokens a rank. The experts are megatron's local ones, or with
--transformer-impl transformer_engine transformer-engine's grouped ones (TEGroupedMLP); --fp8-recipe
blockwise runs their GEMMs in fp8 under TE's autocast, and deepep's tokens then follow the recipe.

Per run: ms per forward+backward (host wall time of --iters rounds after --warmup, a barrier before,
the device synchronised after), the mean over the ranks and the slowest rank; deepep's time over
alltoall's from the same run (below 1: deepep is faster); and the largest difference of every run's
output and input gradient from the first run's on any rank, which should be summation order only (the
exit status is 1 when it is not; fp8 dispatch's quantised tokens are reported apart), or under
--fp8-recipe, where every run quantises, fp8 rounding.

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
    moe-ep-bench megatron_layer --ranks 4 --dtype bfloat16 --transformer-impl transformer_engine --fp8-recipe blockwise
    moe-ep-bench megatron_layer --cpu --ranks 2 --tokens 64 --hidden 128 --ffn-hidden 256   # on CPU ranks
"""
from __future__ import annotations

import functools
import importlib.util
import statistics
import sys
import warnings

import torch
import torch.distributed as dist

from moe_ep.checks import FP8_BLOCK
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
# Under the fp8 recipe every run's GEMMs quantise, and a last-bit difference in a GEMM's input may round
# to the neighbouring e4m3 value (2**-4 apart, relatively): two such roundings, the tokens' and the
# activations', through the two expert GEMMs.
FP8_MATCH_TOLERANCE = 2.0**-3
TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_RECIPES = ("blockwise",)
# TE's fp8 GEMMs take a token count that is a multiple of 8 (transformer_engine.pytorch.utils.assert_dim_for_fp8_exec).
FP8_TOKEN_MULTIPLE = 8


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


def deepep_dispatches(args) -> list:
    """(name, moe_ep_fp8_dispatch) of deepep's runs before chunks, its own dispatch first: unquantised
    tokens, and fp8 ones where --fp8-dispatch asks; under --fp8-recipe the dispatcher's choice for the
    recipe ("auto": fp8 tokens, unless one rank has nothing to send), and unquantised ones where
    --fp8-dispatch asks, so that the pair still compares the two."""
    if args.fp8_recipe:
        return [("deepep", "auto")] + ([("deepep bf16-dispatch", "off")] if args.fp8_dispatch else [])
    return [("deepep", "off")] + ([("deepep fp8", "on")] if args.fp8_dispatch else [])


def variants(args) -> list:
    """What is timed, in order: (name, dispatcher type, options set on its config). alltoall once; deepep
    once for each --overlap-chunks count and each of its dispatches (deepep_dispatches), and with the
    shared expert overlapping the exchanges where the layer has one (--shared-expert-ffn)."""
    chosen = []
    for dispatcher in args.dispatchers:
        if dispatcher != "deepep":
            chosen.append((dispatcher, dispatcher, {}))
            continue
        for name, fp8_dispatch in deepep_dispatches(args):
            for chunks in args.overlap_chunks:
                chosen.append((name + (f" chunks={chunks}" if chunks > 1 else ""), dispatcher,
                               dict(moe_ep_fp8_dispatch=fp8_dispatch, moe_ep_overlap_chunks=chunks,
                                    moe_ep_log_metrics=True)))
        if args.shared_expert_ffn:  # the shared expert beside the exchanges: deepep's own dispatch, no chunks
            chosen.append(("deepep shared-overlap", dispatcher,
                           dict(moe_ep_fp8_dispatch=deepep_dispatches(args)[0][1], moe_ep_overlap_chunks=1,
                                moe_ep_log_metrics=True, moe_shared_expert_overlap=True)))
    return chosen


def layer_fields(args) -> dict:
    """The TransformerConfig fields (and moe_layer_config's arguments) --transformer-impl, --fp8-recipe,
    --dtype and --shared-expert-ffn set."""
    fields = dict(transformer_impl=args.transformer_impl, fp8_recipe=args.fp8_recipe)
    if args.dtype == "bfloat16":
        fields.update(bf16=True, params_dtype=torch.bfloat16)
    if args.shared_expert_ffn:
        fields["moe_shared_expert_intermediate_size"] = args.shared_expert_ffn
    return fields


def layers_label(args) -> str:
    """The experts and their GEMMs' precision, as the table's heading names them."""
    experts = "transformer-engine's grouped experts" if args.transformer_impl == "transformer_engine" else \
        "megatron's local experts"
    return experts + (f", fp8 GEMMs ({args.fp8_recipe} recipe)" if args.fp8_recipe else "")


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
    from megatron.core.fp8_utils import get_fp8_context

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
            # TE's fp8 autocast with the config's recipe where it has one (megatron's TransformerBlock enters
            # it around each layer), else no context; the backward runs outside, as TE has it.
            with get_fp8_context(config):
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
                        help="deepep runs again with fp8 dispatch (moe_ep_fp8_dispatch='on'; the local experts get "
                             "the tokens dequantised); under --fp8-recipe, whose tokens are fp8 already, again with "
                             "bf16 tokens (moe_ep_fp8_dispatch='off')")
    parser.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                        help="the experts: megatron's local ones (default) or transformer-engine's grouped ones "
                             "(TEGroupedMLP), as Megatron-LM's --transformer-impl builds them")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES,
                        help="the layer's GEMMs in fp8 (e4m3) under transformer-engine's recipe, its forward under "
                             "TE's fp8 autocast (megatron's fp8='e4m3' and fp8_recipe), and deepep's tokens as the "
                             "recipe asks (moe_ep_fp8_dispatch='auto'); needs --transformer-impl transformer_engine, "
                             "--dtype bfloat16, --hidden, --ffn-hidden and --shared-expert-ffn multiples of 128 and "
                             f"--tokens a multiple of {FP8_TOKEN_MULTIPLE}")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="parameters and tokens (default float32; bfloat16: as mixed-precision training "
                             "sends them)")
    parser.add_argument("--shared-expert-ffn", type=int, metavar="N",
                        help="the layer has a shared expert of FFN hidden size N, and deepep runs once more with it "
                             "overlapping the dispatch and combine (moe_shared_expert_overlap)")
    args = parse_rank_arguments(parser, argv, RANKS, checks=check_layers)
    if len(set(args.dispatchers)) != len(args.dispatchers):
        parser.error("--dispatchers: each dispatcher once")
    if min(args.overlap_chunks) < 1 or len(set(args.overlap_chunks)) != len(args.overlap_chunks):
        parser.error("--overlap-chunks: distinct counts >= 1")
    return args


def check_layers(parser, args) -> None:
    """--transformer-impl's and --fp8-recipe's needs, refused before any rank starts: transformer-engine
    that imports, GPU ranks, and for fp8 bf16 tokens and sizes the recipe's blocks divide."""
    recipe = f"--fp8-recipe {args.fp8_recipe}"
    if args.fp8_recipe and args.transformer_impl != "transformer_engine":
        parser.error(f"{recipe}: the fp8 GEMMs are transformer-engine's; pass --transformer-impl transformer_engine "
                     f"(got --transformer-impl {args.transformer_impl})")
    if args.transformer_impl == "transformer_engine":
        # Looked up, not imported: importing TE here could open a CUDA context before the ranks' MPS daemon.
        if importlib.util.find_spec("transformer_engine") is None:
            parser.error("--transformer-impl transformer_engine: transformer-engine is not installed here (it does "
                         "not import); pass --transformer-impl local")
        if args.cpu:
            parser.error("--transformer-impl transformer_engine: transformer-engine's layers run on GPUs; drop --cpu")
    if not args.fp8_recipe:
        return
    if args.dtype != "bfloat16":
        parser.error(f"{recipe}: pass --dtype bfloat16 (fp8 training keeps bf16 parameters and tokens, as "
                     f"Megatron-LM's with --bf16)")
    for flag, size in (("--hidden", args.hidden), ("--ffn-hidden", args.ffn_hidden),
                       ("--shared-expert-ffn", args.shared_expert_ffn)):
        if size and size % FP8_BLOCK:
            parser.error(f"{recipe}: {flag} {size} is not a multiple of {FP8_BLOCK} (the recipe's block)")
    if args.tokens % FP8_TOKEN_MULTIPLE:
        parser.error(f"{recipe}: --tokens {args.tokens} is not a multiple of {FP8_TOKEN_MULTIPLE} "
                     f"(what TE's fp8 GEMMs take)")


def add_moe_shape_arguments(parser, ffn_hidden: int) -> None:
    """--hidden, --ffn-hidden, --experts and --topk, which every megatron benchmark takes."""
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--ffn-hidden", type=int, default=ffn_hidden,
                        help=f"each expert's FFN hidden size (default {ffn_hidden})")
    parser.add_argument("--experts", type=int, default=16, help="experts in all, a multiple of --ranks (default 16)")
    parser.add_argument("--topk", type=int, default=2, help="experts a token is routed to (default 2)")


def parse_rank_arguments(parser, argv, default_ranks: int, checks=None):
    """The options every megatron benchmark shares (--sm-share, --cpu, the outputs) added, the command line
    parsed and its ranks resolved, --experts checked against them; checks(parser, args), the benchmark's
    own, before no GPU without --cpu is refused (so that a flag the machine cannot serve is named first)."""
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
    if checks is not None:
        checks(parser, args)
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


def fp8_dispatch_pair(args) -> tuple:
    """(deepep's run with fp8 tokens, its run with unquantised ones) where --fp8-dispatch asks for both."""
    own, other = (name for name, _ in deepep_dispatches(args))
    return (own, other) if args.fp8_recipe else (other, own)


def report_results(args, rows: list, transport: dict, report: Report) -> bool:
    """The table and the JSON lines of the ranks' results, each line naming the layers' transformer impl
    and fp8 recipe; returns whether the layers' outputs matched (fp8 dispatch's outputs into unquantised
    experts are reported, not checked: its tokens are quantised; under the fp8 recipe every run quantises,
    and the check allows fp8 rounding)."""
    shape = dict(tokens=args.tokens, hidden=args.hidden, ffn_hidden=args.ffn_hidden, experts=args.experts,
                 topk=args.topk)
    record = functools.partial(report.add, transformer_impl=args.transformer_impl, fp8_recipe=args.fp8_recipe)
    runs = variants(args)
    names = [name for name, _, _ in runs]
    print(f"megatron MoE layer forward+backward, {args.ranks} ranks (EP={args.ranks}), {args.tokens} tokens a rank, "
          f"hidden {args.hidden}, ffn hidden {args.ffn_hidden}, top-{args.topk} of {args.experts} experts, "
          f"{args.dtype}, {layers_label(args)}"
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
        record("forward_backward", shape, args.ranks, name, "ms_mean", means[name], "ms", **common)
        record("forward_backward", shape, args.ranks, name, "ms_max_rank", max(per_rank), "ms", **common)
        if c:
            for metric, unit in (("comm_ms", "ms"), ("exposed_ms", "ms"), ("sent_bytes", "bytes")):
                record("communication", shape, args.ranks, name, metric, c[metric], unit)
            for metric, value in share.items():
                if value is not None:  # None: no communication to hide
                    record("communication", shape, args.ranks, name, metric, value, "fraction")
    if comm:
        print("comm ms: the dispatches' and combines' time a round, forward and backward (mean over ranks); exposed: "
              "the part the layer waited for; hidden: 1 - exposed / comm; vs serial: 1 - (t - t_compute) / t_comm "
              "against the same run without chunks or shared-expert overlap; MB sent: payload a rank sends a round")
    if "deepep" in args.dispatchers and args.fp8_dispatch:
        fp8_run, unquantised_run = fp8_dispatch_pair(args)
        print(f"fp8 dispatch: {means[fp8_run] / means[unquantised_run]:.2f}x the {args.dtype} dispatch's time"
              + ("" if args.fp8_recipe else f"; outputs differ from the first run's by at most "
                 f"{max(r.get('fp8_diff', 0.0) for r in rows):.3e} (quantised tokens)"))
    matched = True
    if "deepep" in means and "alltoall" in means:
        ratio = means["deepep"] / means["alltoall"]
        caveat = "" if transport["like_for_like"] else f" ({transport['note']})"
        print(f"deepep / alltoall: {ratio:.2f}x the time (mean over ranks){caveat}")
        record("forward_backward", shape, args.ranks, "deepep", "vs_alltoall", ratio, "x",
               like_for_like=transport["like_for_like"])
    finite = True
    for name in names:
        ranks = [r["rank"] for r in rows if name in r.get("not_finite", ())]
        if ranks:
            finite = matched = False
            print(f"NOT FINITE: {name}'s output or input gradient holds NaN or inf on ranks {ranks}")
            record("check", shape, args.ranks, name, "not_finite_ranks", len(ranks), None, on_ranks=ranks,
                   matched=False)
    if len(means) > 1:
        out_diff, grad_diff = max(r["out_diff"] for r in rows), max(r["grad_diff"] for r in rows)
        tolerance = FP8_MATCH_TOLERANCE if args.fp8_recipe else MATCH_TOLERANCE[args.dtype]
        limit = tolerance * max(1.0, max(r["out_size"] for r in rows))
        matched = finite and out_diff <= limit and grad_diff <= limit
        print(f"outputs: max |run - {names[0]}| {out_diff:.3e}, input gradients {grad_diff:.3e} "
              f"({'match' if matched else 'DIFFER'}: limit {limit:.1e}"
              + (", fp8 rounding: every run's GEMMs quantise)" if args.fp8_recipe else ")"))
        for metric, value in (("output_max_abs_diff", out_diff), ("input_grad_max_abs_diff", grad_diff)):
            record("check", shape, args.ranks, names[0], metric, value, None, against="the other runs",
                   matched=matched, limit=limit)
    report.bar_chart(f"megatron_layer_{args.ranks}ranks.png",
                     f"MoE layer forward+backward, {args.ranks} ranks, {args.tokens} tokens a rank, "
                     f"{layers_label(args)}"
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
