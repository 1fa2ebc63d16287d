"""What the benchmarks write besides their tables, the same way for every one of them: JSON lines (one
object per measurement, `--jsonl PATH`), PNG line plots and bar charts (`--plot DIR`, with matplotlib)
and a progress bar over a sweep's steps (tqdm, else a line per step on stderr).

A JSON line holds: benchmark, mode, shape (a dict), ranks, backend (moe_ep or the peer measured beside
it), metric, value and unit; a peer that was not measured has metric "skipped", value null and its
reason.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Tuple

# A plot's lines: label -> [(x, y)].
Series = Dict[str, List[Tuple[float, float]]]


def add_output_arguments(parser) -> None:
    """The options every benchmark with a Report takes."""
    parser.add_argument("--jsonl", help="append one JSON object per measurement here (benchmark, mode, shape, ranks, "
                                        "backend, metric, value, unit)")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots of the sweep into DIR (needs matplotlib)")


def matplotlib_missing() -> str:
    """Why plots cannot be drawn here, or "" when matplotlib imports."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display is needed or wanted
        import matplotlib.pyplot  # noqa: F401
    except ImportError as e:
        return f"matplotlib is not importable ({e}); install it (pip install matplotlib, or moe_ep[bench])"
    return ""


class Report:
    """The measurements of one benchmark run, written as JSON lines as they come and plotted at the end."""

    def __init__(self, benchmark: str, jsonl: Optional[str] = None, plot_dir: Optional[str] = None):
        self.benchmark = benchmark
        self.jsonl = jsonl
        self.plot_dir = plot_dir
        self.records: List[dict] = []
        self.plots_written: List[str] = []
        self.no_plots = matplotlib_missing() if plot_dir else ""
        if self.no_plots:  # said before the sweep starts, not after it has run for minutes
            print(f"--plot: {self.no_plots}; no plots will be written", file=sys.stderr)

    def add(self, mode: str, shape: dict, ranks: int, backend: str, metric: str, value: Optional[float],
            unit: Optional[str], **extra) -> dict:
        """One measurement; its JSON line is appended at once, so a run stopped halfway keeps what it measured."""
        record = dict(benchmark=self.benchmark, mode=mode, shape=dict(shape), ranks=ranks, backend=backend,
                      metric=metric, value=value, unit=unit, **extra)
        self.records.append(record)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def skipped(self, mode: str, shape: dict, ranks: int, backend: str, reason: str) -> dict:
        """A peer (or a mode) that was not measured, and why."""
        return self.add(mode, shape, ranks, backend, "skipped", None, None, reason=reason)

    def select(self, **match) -> List[dict]:
        """The records whose fields equal every one given (a shape field may be given as shape__NAME)."""
        found = []
        for record in self.records:
            if all((record["shape"].get(key[7:]) if key.startswith("shape__") else record.get(key)) == value
                   for key, value in match.items()):
                found.append(record)
        return found

    def plot(self, filename: str, title: str, xlabel: str, ylabel: str, series: Series, log_x: bool = False) -> str:
        """A line plot of `series` as DIR/filename; returns its path, or "" without --plot, matplotlib or data."""
        if not self.plot_dir or self.no_plots or not any(series.values()):
            return ""
        import matplotlib.ticker

        fig, ax = self._figure((8, 5))
        for label, points in sorted(series.items()):
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=label)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 4096, not 2^12
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        return self._save(fig, filename)

    def bar_chart(self, filename: str, title: str, ylabel: str, bars: Dict[str, float]) -> str:
        """A bar per label of `bars` as DIR/filename; returns its path, or "" without --plot, matplotlib or data."""
        if not self.plot_dir or self.no_plots or not bars:
            return ""
        fig, ax = self._figure((9, 5))
        labels, values = list(bars), list(bars.values())
        drawn = ax.bar(labels, values)
        ax.bar_label(drawn, fmt="%.3g")
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        return self._save(fig, filename)

    def _figure(self, size):
        """A figure and its axes, drawn off screen (benchmark machines have no display)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(self.plot_dir, exist_ok=True)
        return plt.subplots(figsize=size)

    def _save(self, fig, filename: str) -> str:
        """fig as DIR/filename, closed; -> its path."""
        import matplotlib.pyplot as plt

        fig.tight_layout()
        path = os.path.join(self.plot_dir, filename)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        self.plots_written.append(path)
        return path

    def say_plots(self) -> None:
        """Where the plots went (stdout, after the tables)."""
        for path in self.plots_written:
            print(f"plot: {path}")


class _Lines:
    """tqdm's part that the benchmarks use, as a line per step on stderr where tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def set_postfix_str(self, text: str) -> None:
        pass

    def write(self, text: str, file=None) -> None:
        print(text, file=file or sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, desc: str, unit: str = "step"):
    """A progress bar on stderr over `total` steps: tqdm where it imports, else a line per step."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, desc)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def say(bar, text: str) -> None:
    """A table line on stdout while `bar` (progress) runs on stderr, without tearing the bar."""
    bar.write(text, file=sys.stdout)
