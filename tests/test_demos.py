"""The demos that need no megatron-core, end to end on CPU ranks (and the decode example on CUDA ranks
where there is a GPU): each checks itself against the dense MoE layer and prints OK (a mismatch exits
non-zero)."""
import argparse
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from moe_ep import _native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def _run(*argv: str, env: dict = ENV) -> str:
    """python argv..., which must succeed: its stdout."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _example(script: str) -> str:
    return os.path.join(ROOT, "examples", script)


@pytest.mark.parametrize("ranks,experts", [("2", "16"), ("3", "12")])
def test_demo_matches_the_dense_layer(ranks, experts):
    """Two ranks as well: the Buffer must be sized for both calls' default configs (2 ranks' combine
    windows are the largest)."""
    assert "OK: matches the dense MoE layer" in _run(_example("demo.py"), "--ranks", ranks, "--experts", experts)


@pytest.mark.parametrize("dispatch", [[], ["--bf16"]])
def test_low_latency_decode_matches_the_dense_layer(dispatch):
    out = _run(_example("decode_low_latency.py"), "--ranks", "2", "--steps", "2", *dispatch)
    assert "OK: every step matches the dense MoE layer" in out
    assert ("bf16 dispatch" if dispatch else "fp8 dispatch") in out


@pytest.mark.parametrize("script", ["demo.py", "decode_low_latency.py"])
def test_help_mentions_only_flags_the_demo_has(script):
    options = re.split(r"\n(?:options|optional arguments):\n", _run(_example(script), "--help"))[1]
    defined = set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", options, re.MULTILINE))
    assert set(re.findall(r"--[\w-]+", options)) <= defined, options


def test_compare_dispatchers_plot_shows_identical_curves_and_names_the_run(tmp_path):
    """The demo's plot on made-up logs: a title with the config, ranks and device, and two identical loss
    curves drawn apart (different line styles and markers) so that both show."""
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("compare_dispatchers", _example("compare_dispatchers.py"))
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    logs = {name: [dict(step=s, loss=5.0 / (s + 1), step_time_s=0.02 + 0.01 * (name == "alltoall")) for s in range(20)]
            for name in ("alltoall", "deepep")}
    args = argparse.Namespace(config="configs/tiny_cpu.yaml", nproc=4, torchrun_args="")
    title = compare.plot_title(args)
    assert "tiny_cpu.yaml" in title and "4 ranks" in title and title.endswith(("CPU", "CUDA")), title
    fig = compare.plot(logs, str(tmp_path / "compare.png"), title)
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig._suptitle.get_text() == title
    first, second = fig.axes[0].get_lines()
    assert first.get_ydata().tolist() == second.get_ydata().tolist()
    assert (first.get_linestyle(), first.get_marker()) != (second.get_linestyle(), second.get_marker())
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["megatron alltoall", "moe_ep (deepep)"]


def _compare_dispatchers():
    spec = importlib.util.spec_from_file_location("compare_dispatchers", _example("compare_dispatchers.py"))
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    return compare


def _short_logs(slower: str = "deepep"):
    return {name: [dict(step=s, loss=5.0 / (s + 1), step_time_s=0.02 + 0.01 * (name == slower), tokens_per_s=1e4)
                   for s in range(4)] for name in ("alltoall", "deepep")}


def test_compare_dispatchers_plot_says_the_losses_are_identical_and_what_ran(tmp_path):
    """A short run's plot: whole steps on the x axes, the losses' agreement on the loss panel, and under the
    title that moe_ep ran its portable reference backend (on CPU): no speed comparison."""
    pytest.importorskip("matplotlib")
    compare = _compare_dispatchers()
    note = compare.reference_backend_note(use_cuda=False)
    assert note == ("on CPU moe_ep runs its portable reference backend, not its CUDA kernels: a correctness demo, "
                    "not a speed comparison")
    fig = compare.plot(_short_logs(), str(tmp_path / "compare.png"), "the title", note)
    assert fig._suptitle.get_text().replace("\n", " ") == f"the title {note}"
    assert fig.axes[0].get_title() == "training loss\nidentical (max |difference| 0)"
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if 0 <= t <= 3]
        assert ticks and all(t == int(t) for t in ticks), ticks
    apart = _short_logs()
    apart["deepep"][2]["loss"] += 1e-3
    fig = compare.plot(apart, str(tmp_path / "apart.png"))
    assert fig.axes[0].get_title() == "training loss\nmax |difference| 0.001"


def test_compare_dispatchers_summary_on_cpu_makes_no_speed_claim(capsys):
    compare = _compare_dispatchers()
    logs = _short_logs()
    compare.print_summary(logs, compare.summarize(logs, 1), dict(transformer_impl="local", fp8_recipe=None),
                          compare.max_loss_diff(logs), compare.reference_backend_note(use_cuda=False))
    out = capsys.readouterr().out
    assert "losses over 4 steps: identical (max |difference| 0)" in out, out
    assert ("deepep step time = 1.50x alltoall's: on CPU moe_ep runs its portable reference backend, not its CUDA "
            "kernels: a correctness demo, not a speed comparison") in out, out


def test_the_demo_says_what_its_cpu_times_are():
    out = _run(_example("demo.py"), "--ranks", "2", "--experts", "16")
    assert ("backend: portable backend (torch.distributed), moe_ep's reference implementation: the ms column "
            "times it, not the CUDA kernels") in out, out


def test_demos_run_under_the_launcher():
    """Started as torchrun starts them (RANK, WORLD_SIZE, ...), here by moe_ep.launch: rank 0 prints."""
    for script, args in (("demo.py", ["--experts", "16"]), ("decode_low_latency.py", ["--steps", "1"])):
        out = _run("-m", "moe_ep.launch", "--nproc", "2", _example(script), *args)
        assert out.count("OK:") == 1, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason()))
@pytest.mark.parametrize("graph", [[], ["--graph"]])
def test_low_latency_decode_on_cuda_ranks(graph):
    """The low-latency kernels under the launcher (MPS where the ranks share a GPU), a step replayed from
    a CUDA graph with new tokens as well."""
    out = _run("-m", "moe_ep.launch", "--nproc", "4", _example("decode_low_latency.py"), "--device", "cuda",
               "--steps", "3", *graph, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.count("OK: every step matches the dense MoE layer") == 1, out
    assert ("CUDA graph" in out) == bool(graph), out
