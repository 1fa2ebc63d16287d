"""The benchmarks under torchrun (`torchrun ... -m moe_ep.bench NAME`): one process a rank, torchrun's world
instead of ranks the benchmark spawns, rank 0 alone printing the table and writing the JSON lines; on one
node and with two agents acting as two nodes of one host; rank counts and benchmarks torchrun cannot give
refused. CPU ranks (gloo), tiny shapes: the figures are checked to be there and positive, not their size."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ep.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the torchrun command, from this interpreter
TINY = ["--hidden", "256", "--experts", "16", "--topk", "4", "--warmup", "1", "--iters", "2"]
# benchmark -> (its options on 2 CPU ranks, a line its table prints once, whether it takes --jsonl)
SINGLE_NODE = {
    "intranode": (["--cpu", *TINY, "--tokens", "32", "--modes", "dispatch_bf16", "combine", "--peers", "copy"],
                  "aggregate GB/s", True),
    "low_latency": (["--cpu", *TINY, "--tokens", "16", "--peers", "copy"], "hook: send+recv us", True),
    "megatron_layer": (["--cpu", "--tokens", "32", "--hidden", "64", "--ffn-hidden", "128", "--experts", "4",
                        "--topk", "2", "--warmup", "1", "--iters", "2"], "megatron MoE layer forward+backward", True),
    "tune": (["--cpu", *TINY, "--tokens", "32", "--sms", "8", "--recv-chunks", "32", "--send-chunks", "4",
              "--dry-run"], "per GPU", True),
    "profile": (["--cpu", "--tokens", "32", "--hidden", "256", "--experts", "16", "--topk", "4", "--rounds", "2"],
                "Buffer.profile(): 2 rounds", False),
    "observe": (["--cpu", "--tokens", "16", "--hidden", "256", "--experts", "16", "--topk", "4", "--warmup", "1",
                 "--iters", "2", "--repeats", "1"], "observation cost: 2 CPU ranks", True),
    "portable": (["--tokens", "32", "--hidden", "256", "--experts", "16", "--topk", "4", "--iters", "2"],
                 "portable backend, 2 CPU ranks", False),
    "trace_kernels": (["--cpu", "--mode", "normal", "--tokens", "32", "--hidden", "256", "--experts", "16",
                       "--topk", "4", "--warmup", "1", "--rounds", "2"], "== normal, 2 ranks", False),
}


def _env(**over) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", **over}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in over:
            env.pop(name, None)  # this test's own launcher, if any, is not the benchmark's
    return env


def _torchrun(*args: str, env: dict = None) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "moe_ep.bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env=env or _env())


def _positive_figures(records: list) -> list:
    """The records of figures (times, rates, ratios: those with a unit), each checked to be positive; a
    share ("fraction": of communication hidden, which on CPU ranks is none and can be negative) is only
    checked to be a number."""
    measured = [r for r in records if r["unit"] is not None]
    signed = [r for r in measured if r["unit"] == "fraction"]
    assert all(isinstance(r["value"], float) and r["value"] == r["value"] for r in signed), signed[:3]
    positive = [r for r in measured if r["unit"] != "fraction"]
    assert positive and all(r["value"] > 0 for r in positive), [r for r in positive if not r["value"] > 0][:3]
    return measured


@pytest.mark.parametrize("name", sorted(SINGLE_NODE))
def test_a_benchmark_runs_on_the_ranks_torchrun_started(name, tmp_path):
    """torchrun --standalone --nproc-per-node 2: the benchmark runs on those 2 ranks without --ranks, its
    table printed once (by rank 0), its JSON lines written once, every figure positive."""
    options, table_line, takes_jsonl = SINGLE_NODE[name]
    jsonl = tmp_path / "m.jsonl"
    done = _torchrun(name, *options, *(["--jsonl", str(jsonl)] if takes_jsonl else []))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(table_line) == 1, done.stdout
    if takes_jsonl:
        records = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert {r["benchmark"] for r in records} == {name} and {r["ranks"] for r in records} == {2}
        measured = _positive_figures(records)
        # One writer: no measurement twice.
        keys = [json.dumps({k: v for k, v in r.items() if k != "value"}, sort_keys=True) for r in measured]
        assert len(keys) == len(set(keys))


def test_two_torchrun_agents_on_one_host_act_as_two_nodes(tmp_path):
    """`torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2`, both agents here: internode runs on 2 nodes
    of 2 ranks (LOCAL_WORLD_SIZE), every rank's figures in one set of JSON lines, one table in all."""
    port = str(free_port())
    jsonl = tmp_path / "n.jsonl"
    agents = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", port, "-m", "moe_ep.bench", "internode", "--cpu", "--tokens", "32", "--hidden", "128",
         "--experts", "8", "--topk", "4", "--warmup", "1", "--iters", "1", "--json", str(jsonl)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240))
    finally:
        for agent in agents:
            agent.kill()
    assert [a.returncode for a in agents] == [0, 0], [(o[-2000:], e[-2000:]) for o, e in outputs]
    printed = "".join(out for out, _ in outputs)
    assert printed.count("GB/s per rank (min/mean)") == 1 and printed.count("rows leaving their node") == 1, printed
    assert "2x2 internode" in printed
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert sorted((r["buffer"], r["mode"]) for r in lines) == sorted(
        (b, m) for b in ("internode", "intranode") for m in ("dispatch_fp8", "dispatch_bf16", "combine"))
    for line in lines:
        assert (line["nodes"], line["ranks_per_node"]) == (2, 2)
        assert len(line["per_rank_gbps"]) == len(line["us"]) == 4
        assert all(v > 0 for v in line["per_rank_gbps"] + line["us"])


@pytest.mark.parametrize("args, said", [
    (["intranode", "--cpu", "--ranks", "2", "4"],
     "--ranks 2 4: under torchrun the ranks are the 2 it started (--nnodes x --nproc-per-node)"),
    (["internode", "--cpu"], "internode times calls across nodes, and torchrun started one node of 2 ranks"),
    (["fp8"], "moe-ep-bench fp8: not under torchrun: it times kernels in one process"),
])
def test_what_torchrun_cannot_give_is_refused_by_name(args, said):
    """A rank count that is not torchrun's, one node for internode, a benchmark of one process: refused
    before any rank works, said once."""
    done = _torchrun(*args)
    assert done.returncode != 0 and done.stderr.count(said) == 1, done.stderr[-3000:]


def test_a_benchmark_module_run_by_torchrun_directly_says_to_use_the_cli():
    """`torchrun -m moe_ep.bench.portable` (not through moe_ep.bench) would spawn ranks in every rank: refused."""
    env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench.portable", "--tokens", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "under torchrun, start a benchmark through moe_ep.bench: torchrun ... -m moe_ep.bench NAME" in done.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one rank a GPU under torchrun")
def test_cuda_ranks_under_torchrun_take_a_gpu_each(tmp_path):
    """On 2 GPUs: intranode and low_latency on CUDA ranks, NCCL's all-to-all measured beside moe_ep (it
    needs a GPU a rank)."""
    gpu = dict(_env(), CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"))
    for name, options in (("intranode", ["--tokens", "64", "--modes", "dispatch_bf16", "combine"]),
                          ("low_latency", ["--tokens", "16"])):
        jsonl = tmp_path / f"{name}.jsonl"
        done = _torchrun(name, *TINY, *options, "--peers", "nccl", "copy", "--jsonl", str(jsonl), env=gpu)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        records = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert {r["ranks"] for r in records} == {2}
        measured = _positive_figures(records)
        assert any(r["metric"] == "vs_nccl" for r in measured), records
