"""Tunes the intranode dispatch and combine configs for this machine: tries SM budgets and chunk sizes, and
writes the fastest Config per call kind to the config cache, which Buffer.get_dispatch_config /
get_combine_config (and calls made without config=) read from then on.

Each candidate is timed by the intranode benchmark's code (`moe-ep-bench intranode`: received GB/s per
rank, the mean over the ranks, all ranks at once, a Buffer sized by the candidate's own size hint): every
SM budget (--sms) with every receive chunk (--recv-chunks: num_max_nvl_chunked_recv_tokens, which sizes
the buffer and with it the kernels' windows), the combine also with every send chunk (--send-chunks: the
streaming combine's rows per owner and sending round; the dispatch's kernels do not read it), beside
today's defaults (Buffer.num_sms and the built-in chunks). The fastest of each kind is kept, with the
fastest chunks at each budget tried (used where Buffer.set_num_sms picks that budget).

    moe-ep-bench tune --ranks 8
    moe-ep-bench tune --ranks 2 4 8 --sms 16 24 32 --recv-chunks 256 1024 --send-chunks 8 16 32
    moe-ep-bench tune --ranks 4 --dry-run      # times and prints; writes nothing
    moe-ep-bench tune --ranks 4 --cache ./configs.json --json tune.jsonl
    moe-ep-bench tune --ranks 8 --dry-run --jsonl tune.jsonl --plot plots/   # GB/s against the SM budget

The cache: $MOE_EP_CONFIG_CACHE, else $XDG_CACHE_HOME/moe_ep/configs.json, else
~/.cache/moe_ep/configs.json (--cache overrides). Its entries are keyed by the GPU's name, the rank count,
the ranks per GPU and the kind; a run replaces the entries of its keys and keeps the others. The ranks
being tuned run without a cache, so a run starts from the built-in defaults whatever the file holds.

With --cpu the ranks run on the portable backend with CPU tensors: this checks the command anywhere, but
CPU figures are not a tuning (their entries are filed under "cpu", which only processes without a GPU
read).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch

from moe_ep import tuning
from moe_ep.config import DEFAULT_NUM_SMS, Config, default_combine_config, default_dispatch_config

from . import command_parser, intranode
from .peers import MOE_EP
from .report import Report, add_output_arguments, progress
from .torchrun import add_ranks_argument, one_node_only, rank_counts, start_ranks

# --ranks left out: none (the option is required), except under torchrun: the ranks it started.
RANKS = []

DISPATCH_MODES = tuple(m for m in intranode.MODES if m.startswith("dispatch"))
COMBINE_MODE = "combine"  # the plain combine: the one whose sending round the send chunk sets


def candidates(args) -> list:
    """[(SM budgets, receive chunks, send chunks)], one per benchmark run: today's defaults first (empty
    chunk lists: each mode's built-in chunks), then each budget with each receive chunk, its combine
    timed at every send chunk."""
    return [([DEFAULT_NUM_SMS], [], [])] + [([s], [r], args.send_chunks) for s in args.sms for r in args.recv_chunks]


def bench_args(args, num_ranks: int, sms: list, recv: list, send: list) -> argparse.Namespace:
    """The intranode benchmark's arguments for one candidate (its parser's defaults for the rest)."""
    argv = ["--ranks", str(num_ranks), "--tokens", str(args.tokens), "--hidden", str(args.hidden),
            "--topk", str(args.topk), "--experts", str(args.experts), "--warmup", str(args.warmup),
            "--iters", str(args.iters), "--modes", args.dispatch_mode, COMBINE_MODE,
            "--sms", *map(str, sms)]
    if recv:
        argv += ["--recv-tokens", *map(str, recv)]
    if send:
        argv += ["--send-tokens", *map(str, send)]
    if args.cpu:
        argv.append("--cpu")
    argv.append("--peers")  # none: a candidate's rate is moe_ep's alone
    return intranode.at_tokens(intranode.make_parser().parse_args(argv), args.tokens)


def kind_of(mode: str) -> str:
    return "combine" if mode.startswith("combine") else "dispatch"


def mean_rates(per_rank: list) -> tuple:
    """({(kind, sms, recv chunk, send chunk): mean GB/s per rank}, {refused SM budget: why}) of one
    benchmark run's rows (a budget the kernels refuse where ranks share a GPU is skipped, not timed)."""
    rates, skipped = {}, {}
    for row in (r for rows in per_rank for r in rows if r["backend"] == MOE_EP):
        if row["mode"] == intranode.SKIPPED:
            skipped[row["sms"]] = row["reason"]
            continue
        key = (kind_of(row["mode"]), row["sms"], row["recv_tokens"], row["send_tokens"])
        rates.setdefault(key, []).append(row["gbps"])
    return {k: sum(v) / len(v) for k, v in rates.items()}, skipped


def config_for(kind: str, num_ranks: int, sms: int, recv: int, send: int) -> Config:
    """The Config a candidate was timed with: its budget and chunks, the built-in RDMA chunks."""
    base = (default_combine_config if kind == "combine" else default_dispatch_config)(num_ranks, sms)
    return Config(sms, send, recv, base.num_max_rdma_chunked_send_tokens, base.num_max_rdma_chunked_recv_tokens)


def best_entries(rates: dict, args, num_ranks: int, device: str, ranks_per_gpu: int, command: str) -> dict:
    """The cache entries of the fastest candidates, per kind, from rates ({(kind, sms, recv, send): GB/s})."""
    entries = {}
    for kind in tuning.KINDS:
        timed = {k[1:]: gbps for k, gbps in rates.items() if k[0] == kind}
        if not timed:
            continue
        default = (default_combine_config if kind == "combine" else default_dispatch_config)(num_ranks, DEFAULT_NUM_SMS)
        default_key = (DEFAULT_NUM_SMS, default.num_max_nvl_chunked_recv_tokens, default.num_max_nvl_chunked_send_tokens)
        best = max(timed, key=timed.get)
        by_sms = {}
        for sms in sorted({k[0] for k in timed}):
            at = max((k for k in timed if k[0] == sms), key=timed.get)
            by_sms[str(sms)] = vars(config_for(kind, num_ranks, *at))
        entries[tuning.entry_key(device, num_ranks, ranks_per_gpu, kind)] = dict(
            device=device, num_ranks=num_ranks, ranks_per_gpu=ranks_per_gpu, kind=kind,
            config=vars(config_for(kind, num_ranks, *best)), by_sms=by_sms,
            gbps_per_rank=timed[best], default_gbps_per_rank=timed.get(default_key, 0.0),
            mode=mode_of(kind, args),
            shape=dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts),
            command=command, tuned_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch=torch.__version__)
    return entries


def tune_ranks(args, num_ranks: int, json_lines: list, report: Report) -> dict:
    """Times every candidate at num_ranks ranks; returns {(kind, sms, recv, send): GB/s per rank}."""
    runs = candidates(args)
    rates = {}
    bar = progress(len(runs), f"tune {num_ranks} ranks", unit="candidate")
    try:
        # The tuned ranks read no cache: each run starts from the built-in configs.
        with start_ranks(num_ranks, use_cuda=not args.cpu, env={tuning.CACHE_ENV: ""}) as pool:
            for sms, recv, send in runs:
                found, skipped = mean_rates(pool.run(intranode.rank_bench, bench_args(args, num_ranks, sms, recv, send)))
                for num_sms, reason in skipped.items():
                    bar.write(f"{num_ranks} ranks, {num_sms} SMs skipped: {reason}")
                for key, value in found.items():
                    rates[key] = value
                    json_lines.append(dict(bench="tune", ranks=num_ranks, kind=key[0], sms=key[1], recv_tokens=key[2],
                                           send_tokens=key[3], gbps_per_rank=value, default=not recv,
                                           cpu=args.cpu, tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                                           experts=args.experts))
                    shape = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                                 sms=key[1], recv_tokens=key[2], send_tokens=key[3])
                    report.add(mode_of(key[0], args), shape, num_ranks, MOE_EP, "gbps_per_rank", value, "GB/s",
                               kind=key[0], default=not recv)
                best = {kind: max((v for k, v in rates.items() if k[0] == kind), default=0) for kind in tuning.KINDS}
                bar.set_postfix_str(", ".join(f"best {kind} {gbps:.3g} GB/s" for kind, gbps in best.items()))
                bar.update(1)
    finally:
        bar.close()
    return rates


def mode_of(kind: str, args) -> str:
    """The intranode benchmark mode a kind's candidates are timed with."""
    return args.dispatch_mode if kind == "dispatch" else COMBINE_MODE


def plot_sm_sweeps(report: Report, args) -> None:
    """GB/s per rank against the SM budget, a plot per rank count: a line per kind, its best chunks at each budget."""
    for num_ranks in args.ranks:
        series = {}
        for record in report.select(metric="gbps_per_rank", ranks=num_ranks):
            points = series.setdefault(f"{record['kind']} ({record['mode']})", {})
            sms = record["shape"]["sms"]
            points[sms] = max(points.get(sms, 0.0), record["value"])
        report.plot(f"tune_{num_ranks}ranks_sms.png", f"tune, {num_ranks} ranks: the best chunks at each SM budget",
                    "SMs", "GB/s per rank (mean)", {label: sorted(points.items()) for label, points in series.items()})


def print_table(entries: dict) -> None:
    print(f"{'ranks':>5} {'per GPU':>7} {'kind':>8} {'sms':>4} {'recv':>5} {'send':>5} {'GB/s per rank':>14} "
          f"{'default':>8} {'gain':>6}  device")
    for entry in entries.values():
        c = entry["config"]
        default = entry["default_gbps_per_rank"]
        gain = f"{entry['gbps_per_rank'] / default:.2f}x" if default else "-"
        print(f"{entry['num_ranks']:>5} {entry['ranks_per_gpu']:>7} {entry['kind']:>8} {c['num_sms']:>4} "
              f"{c['num_max_nvl_chunked_recv_tokens']:>5} {c['num_max_nvl_chunked_send_tokens']:>5} "
              f"{entry['gbps_per_rank']:>14.4g} {default:>8.4g} {gain:>6}  {entry['device']}")


def make_parser() -> argparse.ArgumentParser:
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS, "rank counts to tune, each on its own; required outside torchrun")
    parser.add_argument("--sms", type=int, nargs="+", default=[16, 24, 32], help="SM budgets to try")
    parser.add_argument("--recv-chunks", type=int, nargs="+", default=[64, 256, 1024],
                        help="num_max_nvl_chunked_recv_tokens values to try")
    parser.add_argument("--send-chunks", type=int, nargs="+", default=[4, 8, 16, 32],
                        help="num_max_nvl_chunked_send_tokens values to try for the combine (kept below the "
                             "receive chunk)")
    parser.add_argument("--dispatch-mode", choices=DISPATCH_MODES, default="dispatch_bf16",
                        help="the dispatch timed for the dispatch config (an intranode benchmark mode)")
    intranode.add_shape_arguments(parser)
    parser.add_argument("--cache", help=f"the cache file to write (default: ${tuning.CACHE_ENV}, else "
                                        "$XDG_CACHE_HOME/moe_ep/configs.json, else ~/.cache/moe_ep/configs.json)")
    parser.add_argument("--dry-run", action="store_true", help="time and print the best configs; write no cache")
    parser.add_argument("--json", help="append one JSON line per timed candidate and kind here")
    add_output_arguments(parser)
    parser.add_argument("--cpu", action="store_true",
                        help="CPU tensors on the portable backend: checks the command anywhere; CPU figures are not "
                             "a tuning")
    return parser


def main(argv=None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    args.ranks = rank_counts(parser, args.ranks, RANKS)
    if not args.ranks:
        parser.error("the following arguments are required: --ranks")
    one_node_only(parser, "tune times the intranode calls")
    if not args.cpu and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    path = args.cache or tuning.cache_path()
    if path is None and not args.dry_run:
        parser.error(f"{tuning.CACHE_ENV} is empty (no cache): pass --cache PATH or --dry-run")
    command = shlex.join(["moe-ep-bench", "tune", *(sys.argv[1:] if argv is None else argv)])
    entries, json_lines = {}, []
    report = Report("tune", args.jsonl, args.plot)
    for num_ranks in args.ranks:
        device, ranks_per_gpu = ("cpu", num_ranks) if args.cpu else tuning.this_machine(num_ranks)
        rates = tune_ranks(args, num_ranks, json_lines, report)
        entries.update(best_entries(rates, args, num_ranks, device, ranks_per_gpu, command))
    print_table(entries)
    plot_sm_sweeps(report, args)
    report.say_plots()
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in json_lines)
    if args.dry_run:
        print(f"dry run: {len(entries)} entries not written to {path}")
    else:
        written = tuning.write_entries(entries, path)
        print(f"wrote {len(entries)} entries to {written}")


if __name__ == "__main__":
    main()
