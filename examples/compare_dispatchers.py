"""Train the same GPT-MoE config with megatron's `alltoall` dispatcher and with moe_ep's `deepep`
dispatcher, then print step time, tokens/s and losses side by side and plot them.

    python examples/compare_dispatchers.py --config configs/tiny_cpu.yaml --nproc 4 --plot out/compare.png
    python examples/compare_dispatchers.py --config configs/single_gpu_small.yaml --nproc 4 \
        --transformer-impl transformer_engine --fp8-recipe blockwise

Both runs train the same layers: --transformer-impl and --fp8-recipe go to train_moe.py for each (else the
config's model section chooses them), and the summary names what they were.

Each run starts --nproc ranks on this host with `python -m moe_ep.launch` (which starts MPS when ranks
share a GPU), or a torchrun job when --torchrun-args is given (e.g. "--nnodes 2 --node-rank 0 ...").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISPATCHERS = ("alltoall", "deepep")


def train_command(dispatcher: str, args, log_path: str) -> list:
    """The command line of one dispatcher's train_moe.py run."""
    if args.torchrun_args:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
                    *args.torchrun_args.split()]
    else:
        launcher = [sys.executable, "-m", "moe_ep.launch", "--nproc", str(args.nproc)]
    cmd = [*launcher, os.path.join(ROOT, "examples", "train_moe.py"), "--config", args.config,
           "--dispatcher", dispatcher, "--json-log", log_path]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if dispatcher == "deepep" and args.no_arena:
        cmd += ["--no-arena"]
    if args.profile:
        cmd += ["--profile", os.path.join(args.profile, f"profile_{dispatcher}.txt")]
    if args.transformer_impl:
        cmd += ["--transformer-impl", args.transformer_impl]
    if args.fp8_recipe:
        cmd += ["--fp8-recipe", args.fp8_recipe]
    return cmd


def run(dispatcher: str, args, log_path: str) -> list:
    """One dispatcher's run, its JSON log's records."""
    cmd = train_command(dispatcher, args, log_path)
    # megatron-core warns at length about optional packages it falls back from; keep the table readable.
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    with open(log_path) as f:
        return [json.loads(line) for line in f]


def layers_trained(logs: dict) -> dict:
    """The transformer impl and fp8 recipe the runs trained with, as train_moe.py logged them."""
    first = next(iter(logs.values()))[0]
    return dict(transformer_impl=first.get("transformer_impl"), fp8_recipe=first.get("fp8_recipe"))


def layers_text(layers: dict) -> str:
    """The layers and fp8 recipe in words, for the summary and the plot's title."""
    return f"{layers['transformer_impl']} layers, fp8 recipe {layers['fp8_recipe'] or 'none'}"


def summarize(logs: dict, warmup: int) -> list:
    rows = []
    for name, log in logs.items():
        timed = log[warmup:] or log
        rows.append(dict(dispatcher=name, step_ms=statistics.mean(r["step_time_s"] for r in timed) * 1e3,
                         tokens_per_s=statistics.mean(r["tokens_per_s"] for r in timed), final_loss=log[-1]["loss"]))
    return rows


def max_loss_diff(logs: dict) -> float:
    """The largest |loss difference| between the two runs at any step."""
    return max(abs(a["loss"] - b["loss"]) for a, b in zip(logs["alltoall"], logs["deepep"]))


def loss_agreement(max_diff: float) -> str:
    """How far apart the runs' losses are, in words."""
    return f"identical (max |difference| {max_diff:g})" if max_diff == 0 else f"max |difference| {max_diff:.3g}"


def reference_backend_note(use_cuda: bool) -> str:
    """Where moe_ep ran its portable reference backend (every CPU run; a CUDA run without the kernels), why
    its step times are no speed claim; else ""."""
    from moe_ep import _native

    caveat = "a correctness demo, not a speed comparison"
    if not use_cuda:
        return f"on CPU moe_ep runs its portable reference backend, not its CUDA kernels: {caveat}"
    why = "MOE_EP_BACKEND=portable" if _native.requested_backend() == "portable" else _native.unavailable_reason()
    if why is None:
        return ""
    return f"moe_ep ran its portable reference backend, not its CUDA kernels ({why}): {caveat}"


def print_summary(logs: dict, rows: list, layers: dict, max_diff: float, backend_note: str) -> None:
    print(f"\nalltoall vs deepep, both with {layers_text(layers)}")
    print(f"{'dispatcher':<10} {'step ms':>9} {'tokens/s':>10} {'final loss':>11}")
    for r in rows:
        print(f"{r['dispatcher']:<10} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} {r['final_loss']:>11.5f}")
    speed = rows[0]["step_ms"] / rows[1]["step_ms"]
    print(f"losses over {len(logs['deepep'])} steps: {loss_agreement(max_diff)}")
    print(f"deepep step time = {1 / speed:.2f}x alltoall's" + (f": {backend_note}" if backend_note else ""))


LABELS = {"alltoall": "megatron alltoall", "deepep": "moe_ep (deepep)"}
# The loss curves agree bit for bit on CPU: the first is drawn wide and pale, the later ones dashed on top,
# so that every one stays visible.
STYLES = (dict(linestyle="-", linewidth=4, alpha=0.45, marker="o", markersize=7),
          dict(linestyle="--", linewidth=1.5, marker="x", markersize=6))


def plot(logs: dict, path: str, title: str = "", backend_note: str = ""):
    """Loss and step time per step of each run, saved to `path`; returns the figure. The loss panel says
    how far the runs' losses are apart; backend_note (reference_backend_note), where given, goes under the
    title."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    note = textwrap.wrap(backend_note, 90)  # the figure's width holds about 100 characters of a title
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(10, 4.4 + 0.25 * len(note)))
    for i, (name, log) in enumerate(logs.items()):
        steps = [r["step"] for r in log]
        style = dict(STYLES[min(i, len(STYLES) - 1)], label=LABELS.get(name, name),
                     markevery=max(1, len(steps) // 20), zorder=2 + i)
        ax_loss.plot(steps, [r["loss"] for r in log], **style)
        ax_time.plot(steps, [r["step_time_s"] * 1e3 for r in log], **style)
    agreement = f"\n{loss_agreement(max_loss_diff(logs))}" if {"alltoall", "deepep"} <= set(logs) else ""
    ax_loss.set(xlabel="step", ylabel="loss", title=f"training loss{agreement}")
    ax_time.set(xlabel="step", ylabel="ms", title="step time")
    for ax in (ax_loss, ax_time):
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title or note:
        fig.suptitle("\n".join([title] * bool(title) + note))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def use_cuda() -> bool:
    """Whether the runs' ranks have CUDA devices: train_moe.py takes one wherever torch sees a GPU."""
    import torch

    return torch.cuda.is_available()


def plot_title(args, layers: Optional[dict] = None) -> str:
    """The run's config, ranks, layers where given (layers_trained) and device, as train_moe.py picks it
    (CUDA wherever torch sees a GPU)."""
    ranks = f"{args.nproc} ranks" + (" per node" if args.torchrun_args else "")
    trained = f"{layers_text(layers)}, " if layers else ""
    device = "CUDA" if use_cuda() else "CPU"
    return f"megatron alltoall vs moe_ep: {os.path.basename(args.config)}, {ranks}, {trained}{device}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_cpu.yaml"))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--torchrun-args", default="", help="extra torchrun arguments, e.g. multi-node")
    parser.add_argument("--plot", default=os.path.join(ROOT, "out", "compare_dispatchers.png"))
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--no-arena", action="store_true",
                        help="moe_ep's two-pass intranode calls and no arena for the deepep run (train_moe.py "
                             "--no-arena)")
    parser.add_argument("--profile", metavar="DIR",
                        help="write each run's operator table of three steps here (train_moe.py --profile)")
    parser.add_argument("--transformer-impl", choices=["local", "transformer_engine"],
                        help="both runs' layers (train_moe.py --transformer-impl; default: the config's, else local)")
    parser.add_argument("--fp8-recipe", choices=["blockwise"],
                        help="both runs' fp8 recipe (train_moe.py --fp8-recipe; needs --transformer-impl "
                             "transformer_engine; default: the config's, else no fp8)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        logs = {d: run(d, args, os.path.join(tmp, f"{d}.jsonl")) for d in DISPATCHERS}
    rows, layers, max_diff = summarize(logs, args.warmup), layers_trained(logs), max_loss_diff(logs)
    backend_note = reference_backend_note(use_cuda())
    print_summary(logs, rows, layers, max_diff, backend_note)
    try:
        plot(logs, args.plot, plot_title(args, layers), backend_note)
        print(f"plot: {args.plot}")
    except ImportError:
        print("plot skipped: matplotlib is not installed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, max_loss_diff=max_diff, **layers), f, indent=1)
    if args.profile:
        print(f"profiles: {', '.join(os.path.join(args.profile, f'profile_{d}.txt') for d in DISPATCHERS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
