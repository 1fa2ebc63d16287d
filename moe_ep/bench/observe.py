"""What observing a Buffer costs: the same rounds of calls timed with nothing observed ("off"), with the
device-side counters collected (`Buffer.reset_stats()`: "stats") and inside `Buffer.profile()`
("profile"), in one run on the same ranks, Buffers and inputs.

A normal round is a layout, a fresh dispatch, a cached dispatch and a combine; a low-latency round a
dispatch (fp8) and a combine. The settings take turns: --repeats times, each setting times --iters rounds
after --warmup, in an order rotated every repeat, so that drift on a shared GPU falls on all of them;
the table gives each setting's median us a round and its ratio to "off" from this run.

    moe-ep-bench observe             # CUDA ranks where a GPU is present, else CPU ranks
    moe-ep-bench observe --cpu       # CPU ranks, sized to finish in seconds

Without a GPU (or with --cpu) each option left out takes its CPU value (DEFAULTS): two ranks and a small
problem, since CPU ranks run the portable backend, whose costs say nothing of the kernels'.
"""
from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist

from moe_ep import Buffer
from moe_ep.buffer import default_config_size_hints

from . import command_parser
from .profile import normal_round, round_inputs
from .report import Report, add_output_arguments
from .timing import wall_seconds_per_call
from .torchrun import rank_counts, start_ranks

# What each option left out takes, on CUDA ranks and on CPU ranks (--ranks: under torchrun, the ranks it
# started instead). On CPU the portable backend serves every call: the GPU's shapes and rounds would take
# minutes there to time a path that is not the kernels'.
DEFAULTS = {
    "cuda": dict(ranks=4, tokens=128, hidden=7168, topk=8, experts=256, warmup=5, iters=50, repeats=5),
    "cpu": dict(ranks=2, tokens=64, hidden=256, topk=4, experts=16, warmup=1, iters=5, repeats=3),
}
SETTINGS = ("off", "stats", "profile")
KINDS = ("normal", "low_latency")


@contextlib.contextmanager
def observed(buffer: Buffer, setting: str):
    """The Buffer observed as `setting` says for the calls made inside."""
    if setting == "stats":
        buffer.reset_stats(collect=True)
        try:
            yield
        finally:
            buffer.reset_stats(collect=False)
    elif setting == "profile":
        with buffer.profile():
            yield
    else:
        yield


def _low_latency_round(buffer: Buffer, x, topk_idx, topk_weights, num_experts: int):
    # The experts' outputs the combine sends back: [local experts, ranks x tokens, hidden], made once.
    num_ranks = dist.get_world_size()
    y = torch.randn(num_experts // num_ranks, num_ranks * x.shape[0], x.shape[1]).to(x.device, torch.bfloat16)

    def one_round():
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, x.shape[0], num_experts, use_fp8=True)
        buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
    return one_round


def rank_costs(args, use_cuda: bool) -> dict:
    """This rank's us a round per kind and setting, one list entry per repeat."""
    num_ranks = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    x, topk_idx, topk_weights = round_inputs(args, device)
    times = {}
    for kind in args.kinds:
        if kind == "normal":
            buffer = Buffer(dist.group.WORLD, default_config_size_hints(args.hidden * 2, num_ranks)[0],
                            explicitly_destroy=True)
            one_round = normal_round(buffer, x, topk_idx, topk_weights, args.experts)
        else:
            size = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, args.experts)
            buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, explicitly_destroy=True,
                            num_qps_per_rank=args.experts // num_ranks)
            one_round = _low_latency_round(buffer, x, topk_idx, topk_weights, args.experts)
        one_round()  # the first round maps the peers' buffers: not what later rounds cost
        times[kind] = {setting: [] for setting in SETTINGS}
        for repeat in range(args.repeats):
            for setting in SETTINGS[repeat % len(SETTINGS):] + SETTINGS[:repeat % len(SETTINGS)]:
                with observed(buffer, setting):
                    seconds = wall_seconds_per_call(one_round, args.warmup, args.iters)
                times[kind][setting].append(seconds * 1e6)
        buffer.destroy()
    return times


def parse_args(argv=None):
    parser = command_parser(__spec__, __doc__)
    gpu, cpu = DEFAULTS["cuda"], DEFAULTS["cpu"]
    parser.add_argument("--ranks", type=int, help=f"ranks (default {gpu['ranks']} CUDA, {cpu['ranks']} CPU; under "
                                                   "torchrun the ranks it started)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks over gloo (the default without a GPU)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="calls to time (default: both)")
    for name, what in (("tokens", "tokens a rank"), ("hidden", "hidden size"), ("topk", "experts a token is routed to"),
                       ("experts", "experts in all"), ("warmup", "untimed rounds before each timing"),
                       ("iters", "timed rounds a timing"), ("repeats", "timings of each setting, taking turns")):
        parser.add_argument(f"--{name}", type=int, help=f"{what} (default {gpu[name]} CUDA, {cpu[name]} CPU)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.cpu = args.cpu or not torch.cuda.is_available()
    defaults = DEFAULTS["cpu" if args.cpu else "cuda"]
    for name, value in defaults.items():
        if getattr(args, name) is None and name != "ranks":
            setattr(args, name, value)
    args.ranks = rank_counts(parser, args.ranks, defaults["ranks"])
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    return args


def report_costs(args, rows: list, use_cuda: bool, report: Report) -> None:
    shape = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts)
    print(f"observation cost: {args.ranks} {'CUDA' if use_cuda else 'CPU'} ranks, {args.tokens} tokens x "
          f"{args.hidden} bf16, top-{args.topk} of {args.experts} experts; median over {args.repeats} timings of "
          f"{args.iters} rounds, the slowest rank's")
    if not use_cuda:
        print("CPU ranks run the portable backend (torch.distributed): these are its costs, not the kernels'")
    print(f"{'kind':<12} {'setting':<8} {'us a round':>11} {'vs off':>7}")
    for kind in args.kinds:
        medians = {s: max(statistics.median(r[kind][s]) for r in rows) for s in SETTINGS}
        for setting in SETTINGS:
            ratio = medians[setting] / medians["off"]
            print(f"{kind:<12} {setting:<8} {medians[setting]:>11.1f} {ratio:>6.3f}x")
            report.add(kind, shape, args.ranks, setting, "us_per_round", medians[setting], "us",
                       per_rank=[statistics.median(r[kind][setting]) for r in rows])
            report.add(kind, shape, args.ranks, setting, "vs_off", ratio, "x")


def main(argv=None) -> None:
    args = parse_args(argv)
    use_cuda = not args.cpu
    report = Report("observe", args.jsonl, args.plot)
    with start_ranks(args.ranks, use_cuda=use_cuda) as pool:
        rows = pool.run(rank_costs, args, use_cuda)
    report_costs(args, rows, use_cuda, report)


if __name__ == "__main__":
    main()
