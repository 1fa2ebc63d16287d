"""`moe-ep-bench microbatch_overlap` on CPU ranks: each dispatcher's training step timed without and with
megatron's micro-batch overlap in one run, the same first-step losses either way."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from moe_ep.bench import microbatch_overlap  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_both_schedules_are_timed_and_train_alike(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "microbatch_overlap", "--cpu", "--ranks", "2",
                           "--layers", "1", "--hidden", "64", "--ffn-hidden", "128", "--seq", "16", "--experts", "4",
                           "--micro-batches", "3", "--warmup", "1", "--iters", "1", "--jsonl", str(jsonl)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = {r["metric"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    assert set(records) == {"ms_no_overlap", "ms_overlap", "overlap_vs_not", "loss_rel_diff"}
    assert all(r["backend"] == "deepep" and r["shape"]["micro_batches"] == 3 for r in records.values())
    assert records["ms_no_overlap"]["value"] > 0 and records["ms_overlap"]["value"] > 0
    assert records["overlap_vs_not"]["value"] == pytest.approx(
        records["ms_overlap"]["value"] / records["ms_no_overlap"]["value"])
    assert records["loss_rel_diff"]["value"] <= microbatch_overlap.LOSS_TOLERANCE
    assert "LOSSES DIFFER" not in done.stdout


def test_losses_that_differ_fail_the_run(capsys):
    from types import SimpleNamespace

    from moe_ep.bench.report import Report
    args = SimpleNamespace(ranks=2, layers=1, hidden=64, ffn_hidden=128, experts=4, topk=2, seq=16, micro_batch=2,
                           micro_batches=2, iters=1, warmup=1, dispatchers=["deepep"], delay_wgrad=False,
                           transformer_impl="local")
    row = dict(rank=0, ms={"deepep no overlap": 2.0, "deepep overlap": 1.0},
               losses={"deepep no overlap": [5.0, 5.0], "deepep overlap": [5.0, 6.0]})
    assert microbatch_overlap.report_results(args, [row], Report("microbatch_overlap")) is False
    assert "LOSSES DIFFER" in capsys.readouterr().out


def test_the_delayed_wgrad_run_and_te_layers_are_asked_for_by_name():
    """--delay-wgrad adds the overlap with delay_wgrad_compute, which megatron's local layers cannot do: it
    needs --transformer-impl transformer_engine, refused where transformer-engine does not import."""
    from moe_ep.te import te_available

    with pytest.raises(SystemExit):
        microbatch_overlap.parse_args(["--cpu", "--delay-wgrad"])
    args = microbatch_overlap.parse_args(["--cpu", "--ranks", "2"])
    assert [name for name, _, _ in microbatch_overlap.runs(args)] == ["no overlap", "overlap"]
    if not te_available():
        with pytest.raises(SystemExit):
            microbatch_overlap.parse_args(["--transformer-impl", "transformer_engine"])
        return
    with pytest.raises(SystemExit):
        microbatch_overlap.parse_args(["--cpu", "--transformer-impl", "transformer_engine"])
    args = microbatch_overlap.parse_args(["--ranks", "2", "--transformer-impl", "transformer_engine", "--delay-wgrad"])
    assert [name for name, _, _ in microbatch_overlap.runs(args)] == ["no overlap", "overlap", "overlap + delayed wgrad"]


def test_the_delayed_wgrad_run_is_reported_beside_the_overlap(capsys):
    from types import SimpleNamespace

    from moe_ep.bench.report import Report
    args = SimpleNamespace(ranks=2, layers=1, hidden=64, ffn_hidden=128, experts=4, topk=2, seq=16, micro_batch=2,
                           micro_batches=2, iters=1, warmup=1, dispatchers=["deepep"], delay_wgrad=True,
                           transformer_impl="transformer_engine")
    row = dict(rank=0, ms={"deepep no overlap": 2.0, "deepep overlap": 1.5, "deepep overlap + delayed wgrad": 1.0},
               losses={key: [5.0, 5.0] for key in ("deepep no overlap", "deepep overlap",
                                                    "deepep overlap + delayed wgrad")})
    report = Report("microbatch_overlap")
    assert microbatch_overlap.report_results(args, [row], report) is True
    out = capsys.readouterr().out
    assert "overlap + delayed wgrad" in out and "0.50x" in out and "transformer_engine layers" in out
