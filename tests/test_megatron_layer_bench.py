"""`moe-ep-bench megatron_layer` on CPU ranks: both dispatchers timed in one run and written as JSON
lines, their outputs compared, and the transports labelled as they are. The figures are not checked."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from moe_ep.bench import megatron_layer, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"benchmark", "mode", "shape", "ranks", "backend", "metric", "value", "unit"}
SHAPE = dict(tokens=32, hidden=64, ffn_hidden=128, experts=4, topk=2)
TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


def _one(lines: list, **match) -> dict:
    found = [r for r in lines if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_both_dispatchers_are_timed_on_two_cpu_ranks_and_their_outputs_match(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "megatron_layer", "--cpu", "--ranks", "2",
                           "--tokens", "32", "--hidden", "64", "--ffn-hidden", "128", "--experts", "4", "--topk", "2",
                           "--warmup", "1", "--iters", "2", "--jsonl", str(jsonl)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert all(KEYS <= set(r) for r in lines) and {r["benchmark"] for r in lines} == {"megatron_layer"}
    assert all(r["shape"] == SHAPE and r["ranks"] == 2 for r in lines)
    assert all(r["transformer_impl"] == "local" and r["fp8_recipe"] is None for r in lines)
    means = {}
    for dispatcher in ("deepep", "alltoall"):
        mean = _one(lines, backend=dispatcher, metric="ms_mean")
        slowest = _one(lines, backend=dispatcher, metric="ms_max_rank")
        assert mean["unit"] == slowest["unit"] == "ms" and len(mean["per_rank"]) == 2
        assert 0 < mean["value"] <= slowest["value"] == max(mean["per_rank"])
        assert mean["like_for_like"] is False and "CPU ranks" in mean["transport"]
        means[dispatcher] = mean["value"]
    ratio = _one(lines, metric="vs_alltoall")
    assert ratio["unit"] == "x" and ratio["value"] == pytest.approx(means["deepep"] / means["alltoall"])
    for metric in ("output_max_abs_diff", "input_grad_max_abs_diff"):
        check = _one(lines, metric=metric)
        assert check["matched"] is True and 0 <= check["value"] < 1e-4
    assert "note: CPU ranks check the script" in done.stdout
    assert "(match: limit" in done.stdout


def test_pipelined_and_fp8_runs_report_their_communication(tmp_path):
    """--overlap-chunks and --fp8-dispatch add deepep runs; each reports its communication from its own
    metrics: the bytes a round are the same in chunks, fewer with fp8 tokens, and the chunked outputs
    still match (on CPU ranks the portable backend's calls end before they return: nothing is hidden)."""
    jsonl = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "megatron_layer", "--cpu", "--ranks", "2",
                           "--tokens", "32", "--hidden", "128", "--ffn-hidden", "128", "--experts", "4", "--topk", "2",
                           "--warmup", "1", "--iters", "2", "--dispatchers", "deepep", "--overlap-chunks", "1", "2",
                           "--fp8-dispatch", "--jsonl", str(jsonl)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    runs = ("deepep", "deepep chunks=2", "deepep fp8", "deepep fp8 chunks=2")
    sent = {run: _one(lines, backend=run, metric="sent_bytes")["value"] for run in runs}
    assert sent["deepep"] == sent["deepep chunks=2"] > sent["deepep fp8"] == sent["deepep fp8 chunks=2"] > 0
    for run in runs:
        comm, exposed = (_one(lines, backend=run, metric=m)["value"] for m in ("comm_ms", "exposed_ms"))
        assert comm > 0 and exposed == pytest.approx(comm)
        assert _one(lines, backend=run, metric="hidden")["value"] == pytest.approx(0.0, abs=1e-9)
    assert _one(lines, metric="output_max_abs_diff")["matched"] is True
    assert "fp8 dispatch:" in done.stdout


def test_hidden_shares_follow_their_definitions():
    means = {"deepep": 10.0, "deepep chunks=2": 9.0, "deepep shared-overlap": 9.5}
    comm = {"deepep": dict(comm_ms=4.0, exposed_ms=3.0), "deepep chunks=2": dict(comm_ms=5.0, exposed_ms=1.0),
            "deepep shared-overlap": dict(comm_ms=4.0, exposed_ms=2.0)}
    shares = megatron_layer.hidden_shares(means, comm)
    assert shares["deepep"] == dict(hidden=0.25, hidden_vs_serial=0.25)
    # t_compute = 10 - 3 = 7; chunks: 1 - (9 - 7) / 4 = 0.5; shared overlap: 1 - (9.5 - 7) / 4 = 0.375
    assert shares["deepep chunks=2"] == dict(hidden=0.8, hidden_vs_serial=0.5)
    assert shares["deepep shared-overlap"] == dict(hidden=0.5, hidden_vs_serial=0.375)
    assert megatron_layer.hidden_shares({"deepep chunks=2": 9.0}, {"deepep chunks=2": comm["deepep chunks=2"]}) == \
        {"deepep chunks=2": dict(hidden=0.8)}


def _args(**over):
    fields = dict(ranks=2, warmup=1, iters=2, dispatchers=["deepep", "alltoall"], overlap_chunks=[1],
                  fp8_dispatch=False, dtype="float32", shared_expert_ffn=None, transformer_impl="local",
                  fp8_recipe=None, **SHAPE)
    return SimpleNamespace(**dict(fields, **over))


def test_outputs_that_differ_beyond_float_order_fail_the_run(capsys):
    rows = [dict(rank=r, ms=dict(deepep=2.0, alltoall=4.0), out_diff=0.5, grad_diff=0.0, out_size=3.0)
            for r in range(2)]
    made = report.Report("megatron_layer")
    assert megatron_layer.report_results(_args(), rows, megatron_layer.transports(True, False), made) is False
    assert "DIFFER" in capsys.readouterr().out
    assert made.select(metric="vs_alltoall")[0]["value"] == 0.5
    rows = [dict(row, out_diff=1e-6) for row in rows]
    assert megatron_layer.report_results(_args(), rows, megatron_layer.transports(True, False), made) is True


def test_a_run_with_nan_or_inf_fails_though_every_difference_reads_zero(capsys):
    """A NaN makes every max of differences read 0 (Python's max keeps the first of incomparable values),
    so the ranks report non-finite runs by name and the run fails on them."""
    rows = [dict(rank=r, ms=dict(deepep=2.0, alltoall=4.0), out_diff=0.0, grad_diff=0.0, out_size=float("nan"),
                 not_finite=["deepep"] if r == 1 else []) for r in range(2)]
    made = report.Report("megatron_layer")
    assert megatron_layer.report_results(_args(), rows, megatron_layer.transports(True, False), made) is False
    assert "NOT FINITE: deepep's output or input gradient holds NaN or inf on ranks [1]" in capsys.readouterr().out
    assert made.select(metric="not_finite_ranks")[0]["on_ranks"] == [1]


def test_one_dispatcher_alone_is_timed_without_a_ratio_or_a_check(capsys):
    rows = [dict(rank=0, ms=dict(alltoall=4.0), out_diff=0.0, grad_diff=0.0, out_size=1.0)]
    made = report.Report("megatron_layer")
    assert megatron_layer.report_results(_args(ranks=1, dispatchers=["alltoall"]), rows,
                                         megatron_layer.transports(False, False), made) is True
    assert [r["metric"] for r in made.records] == ["ms_mean", "ms_max_rank"]
    assert "deepep / alltoall" not in capsys.readouterr().out


def test_ranks_sharing_a_gpu_are_labelled_as_alltoall_over_gloo():
    shared = megatron_layer.transports(cpu=False, ranks_share_gpu=True)
    assert shared["like_for_like"] is False and "gloo" in shared["alltoall"] and "not like for like" in shared["note"]
    own = megatron_layer.transports(cpu=False, ranks_share_gpu=False)
    assert own["like_for_like"] is True and own["alltoall"] == "NCCL"


def test_experts_must_split_evenly_over_the_ranks():
    with pytest.raises(SystemExit) as exit_:
        megatron_layer.parse_args(["--cpu", "--ranks", "3", "--experts", "4"])
    assert exit_.value.code == 2


FP8_TE = dict(transformer_impl="transformer_engine", fp8_recipe="blockwise", dtype="bfloat16")


def test_under_the_fp8_recipe_deepep_sends_what_the_recipe_asks_and_fp8_dispatch_adds_bf16_tokens():
    """--fp8-recipe: deepep's own run follows the recipe (moe_ep_fp8_dispatch "auto": fp8 tokens), and
    --fp8-dispatch, which otherwise adds fp8 tokens, adds the unquantised dispatch beside it."""
    runs = {name: options for name, _, options in megatron_layer.variants(
        _args(fp8_dispatch=True, overlap_chunks=[1, 2], shared_expert_ffn=256, **FP8_TE))}
    assert list(runs) == ["deepep", "deepep chunks=2", "deepep bf16-dispatch", "deepep bf16-dispatch chunks=2",
                          "deepep shared-overlap", "alltoall"]
    assert [runs[name].get("moe_ep_fp8_dispatch") for name in runs] == ["auto", "auto", "off", "off", "auto", None]
    plain = {name: options["moe_ep_fp8_dispatch"] for name, _, options in
             megatron_layer.variants(_args(fp8_dispatch=True)) if options}
    assert plain == {"deepep": "off", "deepep fp8": "on"}
    fields = megatron_layer.layer_fields(_args(**FP8_TE))
    assert fields == dict(transformer_impl="transformer_engine", fp8_recipe="blockwise", bf16=True,
                          params_dtype=torch.bfloat16)


def test_under_the_fp8_recipe_the_runs_are_compared_to_fp8_rounding_and_every_record_names_the_layers(capsys):
    """Every run's GEMMs quantise under the recipe: a difference bf16 rounding does not explain passes within
    fp8's, and is reported with its limit; each JSON line carries the transformer impl and the recipe."""
    rows = [dict(rank=r, ms={"deepep": 2.0, "alltoall": 4.0}, out_diff=0.05, grad_diff=0.01, out_size=1.0)
            for r in range(2)]
    made = report.Report("megatron_layer")
    assert megatron_layer.report_results(_args(**FP8_TE), rows, megatron_layer.transports(False, False), made) is True
    out = capsys.readouterr().out
    assert "fp8 rounding" in out and "transformer-engine's grouped experts, fp8 GEMMs (blockwise recipe)" in out
    check = made.select(metric="output_max_abs_diff")[0]
    assert check["value"] == 0.05 and check["limit"] == megatron_layer.FP8_MATCH_TOLERANCE
    assert all(r["transformer_impl"] == "transformer_engine" and r["fp8_recipe"] == "blockwise" for r in made.records)
    bf16 = report.Report("megatron_layer")
    assert megatron_layer.report_results(_args(dtype="bfloat16"), rows, megatron_layer.transports(False, False),
                                         bf16) is False


def _refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        megatron_layer.parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_fp8_recipe_needs_transformer_engine_layers_bf16_and_sizes_its_blocks_divide(capsys, monkeypatch):
    err = _refusal(capsys, ["--cpu", "--fp8-recipe", "blockwise"])
    assert "--fp8-recipe blockwise" in err and "--transformer-impl transformer_engine" in err, err
    monkeypatch.setattr(megatron_layer.importlib.util, "find_spec", lambda name: object())  # as if TE were installed
    monkeypatch.setattr(megatron_layer.torch.cuda, "is_available", lambda: True)
    te = ["--transformer-impl", "transformer_engine", "--fp8-recipe", "blockwise", "--experts", "4", "--ranks", "2"]
    assert "pass --dtype bfloat16" in _refusal(capsys, te)
    assert "--hidden 64 is not a multiple of 128" in _refusal(capsys, [*te, "--dtype", "bfloat16", "--hidden", "64"])
    assert "--tokens 100 is not a multiple of 8" in _refusal(capsys, [*te, "--dtype", "bfloat16", "--tokens", "100"])
    assert "drop --cpu" in _refusal(capsys, [*te, "--dtype", "bfloat16", "--cpu"])
    args = megatron_layer.parse_args([*te, "--dtype", "bfloat16", "--hidden", "256", "--ffn-hidden", "512"])
    assert (args.transformer_impl, args.fp8_recipe, args.dtype) == ("transformer_engine", "blockwise", "bfloat16")
    assert megatron_layer.parse_args(["--cpu"]).transformer_impl == "local"


@pytest.mark.skipif(TE_INSTALLED, reason="transformer-engine is installed here")
@pytest.mark.parametrize("cpu", [["--cpu"], []], ids=["cpu", "gpu"])
def test_transformer_engine_layers_are_refused_where_it_is_not_installed(capsys, cpu):
    """Named before anything else the machine lacks (here, with no GPU, before 'pass --cpu')."""
    err = _refusal(capsys, [*cpu, "--transformer-impl", "transformer_engine", "--experts", "4", "--ranks", "2"])
    assert "--transformer-impl transformer_engine: transformer-engine is not installed here" in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("recipe", [[], ["--fp8-recipe", "blockwise"]], ids=["bf16", "fp8_blockwise"])
def test_transformer_engine_experts_are_timed_with_both_dispatchers(tmp_path, recipe):
    """One GPU rank, transformer-engine's grouped experts in bf16, and with their GEMMs in fp8 under the
    blockwise recipe: both dispatchers run, their outputs agree (to fp8 rounding under the recipe), and
    every record names the layers."""
    pytest.importorskip("transformer_engine")
    jsonl = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "megatron_layer", "--ranks", "1",
                           "--transformer-impl", "transformer_engine", "--dtype", "bfloat16", *recipe,
                           "--tokens", "256", "--hidden", "256", "--ffn-hidden", "512", "--experts", "4", "--topk", "2",
                           "--warmup", "1", "--iters", "2", "--fp8-dispatch", "--jsonl", str(jsonl)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                              str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    timed = {r["backend"] for r in lines if r["metric"] == "ms_mean"}
    assert {"deepep", "alltoall"} <= timed, timed
    assert all(r["transformer_impl"] == "transformer_engine" and r["fp8_recipe"] == (recipe[-1] if recipe else None)
               for r in lines)
    assert _one(lines, metric="output_max_abs_diff")["matched"] is True
