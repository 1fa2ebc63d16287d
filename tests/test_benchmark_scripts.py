"""The GPU benchmarks' scripts run end to end on CPU ranks (portable backend, tiny shapes), so a
script error shows up here and not in the GPU machine's limited time. The figures are not checked."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--cpu", "--ranks", "2", "--hidden", "256", "--experts", "16", "--topk", "4", "--warmup", "1", "--iters", "2"]


def _run(module: str, *args: str, env: dict = None) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_intranode_benchmark_sweeps(tmp_path):
    out = _run("moe_ep.bench.intranode", *TINY, "--tokens", "64", "--sms", "8", "16", "--recv-tokens", "32", "64",
               "--json", str(tmp_path / "b.jsonl"))
    lines = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    modes = {(r["sms"], r["recv_tokens"], r["mode"]) for r in lines}
    assert len(modes) == 2 * 2 * 6 and len(lines) == len(modes)
    assert "best chunk at 2 ranks, 16 SMs, combine" in out
    assert "best chunk at 2 ranks, 8 SMs, dispatch_fp8" in out


def test_intranode_benchmark_sweeps_the_send_chunk(tmp_path):
    """--send-tokens: a row per value, kept below the recv tokens (64 -> 31 with 32-token windows), for the
    plain combine only (the other modes do not read it: they run once)."""
    out = _run("moe_ep.bench.intranode", *TINY, "--tokens", "64", "--modes", "combine", "dispatch_bf16",
               "--recv-tokens", "32", "--send-tokens", "4", "64", "--json", str(tmp_path / "b.jsonl"))
    lines = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert sorted((r["mode"], r["recv_tokens"], r["send_tokens"]) for r in lines) == [
        ("combine", 32, 4), ("combine", 32, 31), ("dispatch_bf16", 32, 4)]
    assert "num_max_nvl_chunked_send_tokens=" in out


def test_an_sm_budget_the_kernels_refuse_is_skipped_not_fatal():
    from types import SimpleNamespace
    from moe_ep.bench.intranode import unfit_sm_budget

    def check_num_sms(num_sms):
        if num_sms > 33:
            raise ValueError(f"num_sms (Config): {num_sms} blocks per kernel ... use num_sms <= 33")

    kernels = SimpleNamespace(check_num_sms=check_num_sms)
    assert unfit_sm_budget(kernels, 24) == ""
    assert "use num_sms <= 33" in unfit_sm_budget(kernels, 48)
    assert unfit_sm_budget(None, 480) == ""  # the portable backend takes any


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_intranode_benchmark_sweep_skips_budgets_too_large_for_the_ranks_on_one_gpu(tmp_path):
    """8 ranks on one GPU cannot hold 400 blocks per kernel each: that budget is reported and skipped, the
    others are timed (short windows keep the buffer such a budget asks for small)."""
    assert TINY[:3] == ["--cpu", "--ranks", "2"]
    out = _run("moe_ep.bench.intranode", *TINY[3:], "--ranks", "8", "--tokens", "64", "--sms", "8", "400",
               "--recv-tokens", "32", "--modes", "dispatch_bf16", "--json", str(tmp_path / "b.jsonl"))
    assert "400  skipped: num_sms (Config)" in out, out
    assert [json.loads(line)["sms"] for line in (tmp_path / "b.jsonl").read_text().splitlines()] == [8]


def test_the_cli_lists_and_runs_the_benchmarks(tmp_path):
    """`moe-ep-bench` (python -m moe_ep.bench): the list, an unknown name refused, and a benchmark whose
    ranks are spawned processes run through it (they import the module the CLI ran)."""
    listing = _run("moe_ep.bench")
    assert all(name in listing for name in ("intranode", "low_latency", "layout", "fp8", "peer_copy"))
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "no_such_bench"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "unknown benchmark 'no_such_bench'" in done.stderr
    _run("moe_ep.bench", "intranode", *TINY, "--tokens", "32", "--modes", "dispatch_bf16", "--json",
         str(tmp_path / "b.jsonl"))
    assert json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])["mode"] == "dispatch_bf16"


def test_gpu_benchmarks_without_a_gpu_say_to_pass_cpu():
    """Without --cpu where torch sees no GPU (CUDA_VISIBLE_DEVICES hides any), `moe-ep-bench intranode` and
    the other benchmarks with --cpu say so in one line and exit with argparse's code, before any rank starts."""
    for name in ("intranode", "low_latency", "trace_kernels"):
        done = subprocess.run([sys.executable, "-m", "moe_ep.bench", name, "--ranks", "2"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
        said = "error: no GPU here: pass --cpu (CPU tensors on the portable backend)"
        assert done.stderr.strip() == f"moe-ep-bench {name}: {said}", done.stderr


def test_intranode_benchmark_times_only_the_modes_asked(tmp_path):
    _run("moe_ep.bench.intranode", *TINY, "--tokens", "64", "--modes", "combine", "--json", str(tmp_path / "b.jsonl"))
    assert [json.loads(line)["mode"] for line in (tmp_path / "b.jsonl").read_text().splitlines()] == ["combine"]


def test_intranode_benchmark_cached_dispatch_modes(tmp_path):
    """The *_cached modes (a handle, no count exchange) run only when asked, arena ones too."""
    modes = ["dispatch_fp8_cached", "dispatch_bf16_arena_cached"]
    _run("moe_ep.bench.intranode", *TINY, "--tokens", "64", "--modes", *modes, "--json", str(tmp_path / "b.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == modes and all(r["aggregate_gbps"] > 0 for r in rows)


def test_intranode_benchmark_takes_the_kernels_choices(tmp_path):
    """--stream-combine, --no-fit-blocks, --no-rendezvous, --peer-memory and --profile-waits are entered on
    every rank (the portable backend here has no use for them), beside the combines from the arena; the
    JSON lines say which combine was asked for."""
    _run("moe_ep.bench.intranode", *TINY, "--tokens", "32", "--modes", "combine", "combine_arena",
         "combine_arena_input", "--stream-combine", "0", "--no-fit-blocks", "--no-rendezvous", "--peer-memory", "ipc", "--profile-waits",
         "--json", str(tmp_path / "b.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["combine", "combine_arena_input", "combine_arena"]
    assert all(r["stream_combine"] == "0" and r["aggregate_gbps"] > 0 for r in rows)


def test_low_latency_benchmark(tmp_path):
    out = _run("moe_ep.bench.low_latency", *TINY, "--tokens", "16", "--peer-memory", "ipc", "--json",
               str(tmp_path / "b.jsonl"))
    row = json.loads((tmp_path / "b.jsonl").read_text())
    assert row["ranks"] == 2 and row["experts"] == 16 and len(row["per_rank"]) == 2 and row["peer_memory"] == "ipc"
    assert "portable" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_low_latency_benchmark_device_times_from_graphs(tmp_path):
    """--graph: the calls captured and replayed on every rank at once, next to the wall times."""
    gpu = [a for a in TINY if a != "--cpu"]
    _run("moe_ep.bench.low_latency", *gpu, "--tokens", "16", "--graph", "--json", str(tmp_path / "b.jsonl"))
    row = json.loads((tmp_path / "b.jsonl").read_text())
    for rank in row["per_rank"]:
        assert rank["backend"] == "kernels"
        assert all(rank[k] > 0 for k in ("dispatch_graph_us", "combine_graph_us", "combine_zero_copy_graph_us")), rank


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_low_latency_benchmark_through_puts(tmp_path):
    """--puts: every peer through NVSHMEM puts (moe_ep._internode's kernels), the zero-copy combine too."""
    gpu = [a for a in TINY if a != "--cpu"]
    _run("moe_ep.bench.low_latency", *gpu, "--tokens", "16", "--graph", "--puts", "--json", str(tmp_path / "b.jsonl"))
    row = json.loads((tmp_path / "b.jsonl").read_text())
    for rank in row["per_rank"]:
        assert rank["backend"] == "puts" and rank["peer_memory"] == "nvshmem", rank
        assert all(rank[k] > 0 for k in ("dispatch_graph_us", "combine_graph_us", "combine_zero_copy_graph_us")), rank


def test_kernel_trace_of_both_modes():
    for mode, tokens, extra in (("low_latency", "16", []), ("low_latency", "16", ["--dispatch-only", "--lockstep"]),
                                ("normal", "64", []), ("normal", "64", ["--arena"])):
        out = _run("moe_ep.bench.trace_kernels", *TINY[:-2], "--mode", mode, "--tokens", tokens, "--rounds", "2",
                   *extra)
        assert "wall time per round" in out and "2 ranks" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_dispatch_call_profile_times_each_launch():
    shape = (*TINY[1:3], "--hidden", "256", "--experts", "16", "--topk", "4", "--tokens", "64", "--iters", "3")
    # A fresh ordinary dispatch: the count exchange, the wait and the dispatch from one entry point.
    out = _run("moe_ep.bench.profile_dispatch_call", *shape, "--fp8", "--python-profile", "5")
    for row in ("host: whole call", "host: intranode_dispatch_fresh", "device: intranode_dispatch_fresh",
                "rank 1 under cProfile"):
        assert row in out, out
    # A fresh dispatch into the arena launches both kernels from one entry point.
    out = _run("moe_ep.bench.profile_dispatch_call", *shape, "--arena", "--fp8")
    for row in ("host: whole call", "host: wait_host_value", "device: intranode_zero_copy_dispatch_early"):
        assert row in out, out


def test_dispatch_call_profile_with_stubbed_launches():
    out = _run("moe_ep.bench.profile_dispatch_call", "--stub-kernels", "--ranks", "4", "--tokens", "256",
               "--hidden", "256", "--python-profile", "3")
    for row in ("Buffer.dispatch checks", "backend dispatch ", "backend dispatch, into the arena ",
                "backend dispatch, into the arena under cProfile", "intranode.py"):
        assert row in out, out


def test_low_latency_call_profile_with_stubbed_launches():
    out = _run("moe_ep.bench.profile_low_latency_call", "--stub-kernels", "--python-profile", "3")
    for row in ("low_latency_combine, no sync", "low_latency_dispatch under cProfile", "buffer.py"):
        assert row in out, out


def test_shell_scripts_parse():
    for script in sorted((ROOT / "scripts").rglob("*.sh")) + [ROOT / ".ci" / "run"]:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC between ranks needs a GPU")
def test_peer_copy_benchmark_moves_bytes_between_ranks(tmp_path):
    _run("moe_ep.bench.peer_copy", "--ranks", "2", "--mib", "8", "--warmup", "1", "--iters", "2",
         "--json", str(tmp_path / "b.jsonl"), env={"CUDA_VISIBLE_DEVICES": "0"})  # its ranks share one GPU
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["own -> own", "own -> peer (push)", "peer -> own (pull)", "own -> every peer"]
    assert all(len(r["per_rank_gbps"]) == 2 and min(r["per_rank_gbps"]) > 0 for r in rows)


def test_kernel_log_times_split_a_call_into_its_kernels(kernel_enums):
    """The intranode benchmark's reading of a rank's kernel log (--profile-waits): spans, the time
    before each data kernel, the opening kernel's span, the period, and the ranks' start skew."""
    from moe_ep.bench.intranode import kernel_log_times, start_skew_us

    ids = kernel_enums.kernel_id

    # Three combines (a rendezvous, then the streaming combine), times in ns: a 10-us rendezvous, a 2-us
    # launch gap, a 600-us data kernel, 100 us from one combine's end to the next call's rendezvous.
    log, t = [], 0
    for _ in range(3):
        log += [(ids.RENDEZVOUS, t, t + 10_000), (ids.STREAM_COMBINE, t + 12_000, t + 612_000)]
        t += 712_000
    times, starts = kernel_log_times(log, calls=2, kernel_ids=ids)
    assert times == {"span us": 600.0, "gap us": 2.0, "lead us": 10.0, "period us": 712.0}
    assert starts == [724_000, 1_436_000]
    # A fresh dispatch's count exchange before its data kernel: the gap holds the host's round.
    times, _ = kernel_log_times([(ids.NOTIFY, 0, 5_000), (ids.DISPATCH, 45_000, 345_000)], calls=20, kernel_ids=ids)
    assert times == {"span us": 300.0, "gap us": 40.0, "lead us": 5.0}
    # A one-pass combine behind its rendezvous.
    times, _ = kernel_log_times([(ids.RENDEZVOUS, 0, 3_000), (ids.ZERO_COPY_COMBINE, 5_000, 105_000)], calls=1,
                                kernel_ids=ids)
    assert times == {"span us": 100.0, "gap us": 2.0, "lead us": 3.0}
    assert kernel_log_times([], calls=2, kernel_ids=ids) == ({}, [])
    assert kernel_log_times([(ids.RENDEZVOUS, 0, 1)], calls=2, kernel_ids=ids) == ({}, [])
    assert start_skew_us([[0, 1_000_000], [4_000, 1_010_000]]) == 7.0
    assert start_skew_us([[0], [1, 2]]) == -1.0 and start_skew_us([]) == -1.0


def test_portable_benchmark_runs_with_two_ranks():
    """Two ranks: the Buffer sized for both calls' default configs (2 ranks' combine windows are the
    largest)."""
    out = _run("moe_ep.bench.portable", "--ranks", "2", "--tokens", "32", "--hidden", "256", "--experts", "16",
               "--topk", "4", "--iters", "2")
    assert all(name in out for name in ("dispatch", "combine", "ll_dispatch", "ll_combine")), out


def test_internode_benchmark(tmp_path):
    """Both Buffers (pretend nodes and one node) time every mode; the traffic line counts rows leaving their
    node once per node, per rank and per pick, in that order of size."""
    out = _run("moe_ep.bench.internode", "--cpu", "--nodes", "2x2", "--tokens", "32", "--hidden", "128",
               "--experts", "8", "--topk", "4", "--warmup", "1", "--iters", "1", "--json", str(tmp_path / "i.jsonl"))
    lines = [json.loads(line) for line in (tmp_path / "i.jsonl").read_text().splitlines()]
    assert sorted((r["buffer"], r["mode"]) for r in lines) == sorted(
        (b, m) for b in ("internode", "intranode") for m in ("dispatch_fp8", "dispatch_bf16", "combine"))
    traffic = next(line for line in out.splitlines() if "rows leaving their node" in line)
    messages, per_rank, per_pick = (int(w) for w in traffic.replace("(", " ").split() if w.isdigit())
    assert 0 < messages <= per_rank <= per_pick
