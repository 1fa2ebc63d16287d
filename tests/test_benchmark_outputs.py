"""The benchmarks' outputs and peers on CPU ranks: JSON lines (one object per measurement), PNG plots,
the progress bar without tqdm, the peers measured beside moe_ep or reported as skipped with their reason,
and the ratios taken from the figures of the same run. The figures themselves are not checked."""
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from moe_ep.bench import peers, report
from moe_ep.bench.intranode import peer_mode

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = Path(__file__).resolve().parent / "deep_ep_stand_in"
TINY = ["--cpu", "--hidden", "256", "--experts", "16", "--topk", "4", "--warmup", "1", "--iters", "2"]
KEYS = {"benchmark", "mode", "shape", "ranks", "backend", "metric", "value", "unit"}
PNG = b"\x89PNG\r\n\x1a\n"


def _run(module: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _lines(path: Path) -> list:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines and all(KEYS <= set(line) for line in lines), lines[:3]
    return lines


def _one(lines: list, **match) -> dict:
    found = [r for r in lines if all((r["shape"].get(k[7:]) if k.startswith("shape__") else r.get(k)) == v
                                     for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def _plots_expected() -> bool:
    return not report.matplotlib_missing()


def test_intranode_writes_json_lines_plots_and_the_peers_of_a_token_sweep(tmp_path):
    """--tokens 32 64 on 2 CPU ranks: per token count and mode, moe_ep's figures and the copy's, the ratio
    to the copy taken from those two figures, the other peers skipped with why; a plot of the sweep."""
    out = _run("moe_ep.bench.intranode", *TINY, "--ranks", "2", "--tokens", "32", "64", "--modes", "dispatch_bf16",
               "combine", "--jsonl", str(tmp_path / "i.jsonl"), "--plot", str(tmp_path / "plots"))
    lines = _lines(tmp_path / "i.jsonl")
    assert {r["benchmark"] for r in lines} == {"intranode"} and {r["ranks"] for r in lines} == {2}
    for tokens in (32, 64):
        for mode in ("dispatch_bf16", "combine"):
            ours = _one(lines, backend="moe_ep", metric="gbps_per_rank", mode=mode, shape__tokens=tokens)
            copy = _one(lines, backend="copy", metric="gbps_per_rank", mode=mode, shape__tokens=tokens)
            versus = _one(lines, backend="moe_ep", metric="vs_copy", mode=mode, shape__tokens=tokens)
            assert ours["unit"] == copy["unit"] == "GB/s" and versus["unit"] == "x" and ours["value"] > 0
            assert versus["value"] == pytest.approx(ours["value"] / copy["value"])
            assert ours["shape"] == dict(tokens=tokens, hidden=256, topk=4, experts=16, sms=24,
                                         recv_tokens=ours["shape"]["recv_tokens"],
                                         send_tokens=ours["shape"]["send_tokens"])
            assert not [r for r in lines if r["metric"] in ("vs_deep_ep", "vs_nccl", "vs_portable")]
        for peer, why in (("deep_ep", "DeepEP's calls take CUDA tensors"), ("nccl", "NCCL moves CUDA tensors"),
                          ("portable", "moe_ep itself ran on the portable backend")):
            skipped = _one(lines, backend=peer, metric="skipped", shape__tokens=tokens)
            assert skipped["value"] is None and why in skipped["reason"]
            assert f"{peer} at 2 ranks, {tokens} tokens: skipped: CPU ranks (--cpu): {why}" in out
    plot = tmp_path / "plots" / "intranode_2ranks_24sms.png"
    if _plots_expected():
        assert plot.read_bytes().startswith(PNG) and f"plot: {plot}" in out
    else:
        assert not plot.exists()


def test_low_latency_writes_json_lines_plots_and_the_peers_of_a_rank_sweep(tmp_path):
    """--ranks 2 4: moe_ep's times per call and the copy's, moe_ep's speed over the copy taken from those
    times, the other peers skipped with why; a plot of latency against ranks."""
    out = _run("moe_ep.bench.low_latency", *TINY, "--ranks", "2", "4", "--tokens", "16", "--jsonl",
               str(tmp_path / "l.jsonl"), "--plot", str(tmp_path / "plots"), "--json", str(tmp_path / "old.jsonl"))
    lines = _lines(tmp_path / "l.jsonl")
    for ranks in (2, 4):
        for call in ("dispatch", "combine"):
            ours = _one(lines, backend="moe_ep", metric="us_per_call", mode=call, ranks=ranks)
            copy = _one(lines, backend="copy", metric="us_per_call", mode=call, ranks=ranks)
            versus = _one(lines, backend="moe_ep", metric="vs_copy", mode=call, ranks=ranks)
            assert versus["value"] == pytest.approx(copy["value"] / ours["value"]) and ours["unit"] == "us"
        for peer in ("deep_ep", "nccl", "portable"):
            assert "CPU ranks (--cpu)" in _one(lines, backend=peer, metric="skipped", ranks=ranks)["reason"]
            assert f"{peer} at {ranks} ranks, 16 experts: skipped: CPU ranks (--cpu)" in out
    old = [json.loads(line) for line in (tmp_path / "old.jsonl").read_text().splitlines()]
    assert [r["ranks"] for r in old] == [2, 4] and all("copy" in rank["peer_times"] for r in old for rank in r["per_rank"])
    plot = tmp_path / "plots" / "low_latency_us_per_call_vs_ranks.png"
    assert plot.read_bytes().startswith(PNG) if _plots_expected() else not plot.exists()


def test_the_peers_can_all_be_left_out(tmp_path):
    """--peers alone: moe_ep's figures only, no ratio, every peer reported as not asked for."""
    _run("moe_ep.bench.intranode", *TINY, "--ranks", "2", "--tokens", "32", "--modes", "combine", "--peers",
         "--jsonl", str(tmp_path / "i.jsonl"))
    lines = _lines(tmp_path / "i.jsonl")
    assert {r["backend"] for r in lines if r["metric"] != "skipped"} == {"moe_ep"}
    assert not [r for r in lines if r["metric"].startswith("vs_")]
    assert {r["backend"]: r["reason"] for r in lines if r["metric"] == "skipped"} == {
        peer: "not asked for (--peers)" for peer in peers.PEERS}


def _args(**over):
    base = dict(cpu=False, peers=list(peers.PEERS), portable_any_size=False)
    return types.SimpleNamespace(**{**base, **over})


def test_skip_reasons_say_why_each_peer_is_left_out():
    none = dict(deep_ep_check=lambda: "", portable_check=lambda: "")
    assert peers.skip_reasons(_args(), 4, 4, 1 << 20, **none) == {p: "" for p in peers.PEERS}
    shared = peers.skip_reasons(_args(), 8, 1, 1 << 20, **none)
    assert shared["nccl"].startswith("8 ranks share 1 GPU(s): NCCL refuses several ranks on one GPU")
    assert shared["deep_ep"] == shared["portable"] == shared["copy"] == ""
    big = 4096 * 7168 * 2
    assert "above the 16 MiB" in peers.skip_reasons(_args(), 4, 4, big, **none)["portable"]
    assert peers.skip_reasons(_args(portable_any_size=True), 4, 4, big, **none)["portable"] == ""
    missing = peers.skip_reasons(_args(), 2, 2, 1, deep_ep_check=lambda: "import deep_ep failed (x)",
                                 portable_check=lambda: "the CUDA extension is not built")
    assert missing["deep_ep"] == "import deep_ep failed (x)"
    assert missing["portable"] == "moe_ep itself ran on the portable backend (the CUDA extension is not built)"
    on_cpu = peers.skip_reasons(_args(cpu=True), 2, 0, 1, **none)
    assert all(on_cpu[p].startswith("CPU ranks (--cpu)") for p in ("deep_ep", "nccl", "portable")) and not on_cpu["copy"]
    assert peers.skip_reasons(_args(peers=["copy"]), 2, 2, 1, **none)["deep_ep"] == "not asked for (--peers)"


def test_each_mode_is_set_against_the_same_operation_of_each_peer():
    assert peer_mode("deep_ep", "dispatch_fp8_arena_cached") == "dispatch_fp8_cached"
    assert peer_mode("deep_ep", "combine_arena_input") == peer_mode("deep_ep", "combine_arena") == "combine"
    assert peer_mode("portable", "dispatch_bf16_arena") == "dispatch_bf16_arena"
    assert peer_mode("nccl", "dispatch_fp8_cached") == peer_mode("copy", "dispatch_fp8_arena") == "dispatch_fp8"
    assert peer_mode("nccl", "combine_arena_input") == "combine"
    assert peers.ratio(300.0, 200.0) == 1.5 and peers.ratio(300.0, None) is None and peers.ratio(None, 2.0) is None
    assert peers.shown_ratio(1.5) == "1.5x" and peers.shown_ratio(None) == "-"


def test_without_matplotlib_or_tqdm_the_benchmarks_say_so_and_go_on(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm", None)
    made = report.Report("intranode", str(tmp_path / "r.jsonl"), str(tmp_path / "plots"))
    assert "--plot: matplotlib is not importable" in capsys.readouterr().err
    made.add("combine", dict(tokens=8), 2, "moe_ep", "gbps_per_rank", 1.0, "GB/s")
    assert made.plot("p.png", "t", "x", "y", {"a": [(1, 1.0)]}) == "" and not (tmp_path / "plots").exists()
    assert json.loads((tmp_path / "r.jsonl").read_text())["metric"] == "gbps_per_rank"
    bar = report.progress(2, "sweep")
    bar.update(1)
    bar.update(1)
    assert capsys.readouterr().err == "sweep: 1/2\nsweep: 2/2\n"


@pytest.mark.skipif(bool(report.matplotlib_missing()), reason="matplotlib is not importable")
def test_a_plot_is_a_png_with_a_line_per_series(tmp_path):
    made = report.Report("tune", None, str(tmp_path))
    path = made.plot("sms.png", "tune", "SMs", "GB/s", {"dispatch": [(16, 1.0), (24, 2.0)], "combine": [(16, 3.0)]})
    assert Path(path).read_bytes().startswith(PNG)
    assert made.plot("empty.png", "tune", "SMs", "GB/s", {"dispatch": []}) == ""


@pytest.fixture
def deep_ep_stand_in(monkeypatch):
    """moe_ep under DeepEP's module name for the ranks the test starts (they take this process's sys.path)."""
    monkeypatch.syspath_prepend(str(STAND_IN))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)


def test_deep_ep_peer_times_deep_eps_calls_on_the_same_problem(deep_ep_stand_in):
    """The DeepEP peer's rank functions drive DeepEP V1's calls (here moe_ep's Buffer, which takes them):
    a row per operation and SM budget, every operation receiving the same rows; the low-latency times."""
    args = types.SimpleNamespace(cpu=True, tokens=32, hidden=256, topk=4, experts=16, warmup=1, iters=2, sms=[8, 16],
                                 graph=False)
    operations = ["combine", "dispatch_bf16", "dispatch_fp8", "dispatch_fp8_cached"]
    from moe_ep.bench import deepep_peer

    per_rank, failed = peers.run_in_own_ranks(deepep_peer.intranode_rank, (args, operations), 2, False, 120)
    assert failed == "" and len(per_rank) == 2
    for rows in per_rank:
        assert [(r["sms"], r["mode"]) for r in rows] == [(s, op) for s in (8, 16) for op in operations]
        assert len({r["rows"] for r in rows}) == 1 and all(r["backend"] == "deep_ep" and r["gbps"] > 0 for r in rows)
    times, failed = peers.run_in_own_ranks(deepep_peer.low_latency_rank, (args, 16, 2000), 2, False, 120)
    assert failed == "" and all(t[k] > 0 for t in times for k in ("dispatch_us", "combine_us", "combine_zero_copy_us"))


def test_a_peer_that_fails_is_reported_not_fatal():
    try:
        import deep_ep  # noqa: F401
        pytest.skip("deep_ep is importable here")
    except ImportError:
        pass
    from moe_ep.bench import deepep_peer

    args = types.SimpleNamespace(cpu=True, tokens=8, hidden=256, topk=4, experts=16, warmup=1, iters=1, sms=[8])
    rows, failed = peers.run_in_own_ranks(deepep_peer.intranode_rank, (args, ["combine"]), 2, False, 60)
    assert rows == [] and re.match(r"failed: 2 rank\(s\) failed; rank [01]: ModuleNotFoundError: No module named "
                                   r"'deep_ep'$", failed), failed


def test_a_peer_that_hangs_is_reported_and_not_tried_again():
    import time

    rows, failed = peers.run_in_own_ranks(time.sleep, (60,), 2, False, 3)
    assert rows == [] and "did not finish sleep in time" in failed, failed
    given_up = {}
    peers.note_hangs({"deep_ep": failed, "nccl": "", "portable": "failed: 2 rank(s) failed; rank 0: ValueError: x"},
                     given_up, "2 ranks, 64 tokens")
    assert given_up == {"deep_ep": "not tried again: it did not finish in time at 2 ranks, 64 tokens"}
    reasons = peers.skip_reasons(_args(), 4, 4, 1, deep_ep_check=lambda: "", portable_check=lambda: "",
                                 given_up=given_up)
    assert reasons["deep_ep"] == given_up["deep_ep"] and reasons["portable"] == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_nccl_is_skipped_where_ranks_share_a_gpu(tmp_path):
    over = torch.cuda.device_count() + 1
    gpu = [a for a in TINY if a != "--cpu"]
    out = _run("moe_ep.bench.intranode", *gpu, "--ranks", str(over), "--tokens", "64", "--modes", "dispatch_bf16",
               "--peers", "nccl", "copy")
    assert f"nccl at {over} ranks, 64 tokens: skipped: {over} ranks share" in out, out


@pytest.mark.skipif(bool(report.matplotlib_missing()), reason="matplotlib is not importable")
def test_a_bar_chart_is_a_png_with_a_bar_per_label(tmp_path):
    made = report.Report("megatron_layer", None, str(tmp_path))
    path = made.bar_chart("bars.png", "layer", "ms", {"deepep": 2.0, "alltoall": 3.0})
    assert Path(path).read_bytes().startswith(PNG) and made.plots_written == [path]
    assert made.bar_chart("empty.png", "layer", "ms", {}) == ""
