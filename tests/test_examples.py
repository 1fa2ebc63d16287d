"""The training examples end to end: moe_ep's dispatcher against megatron's alltoall, and a two-node
torchrun launch (two agents on this host) against one agent whose ranks are cut into the same nodes."""
import importlib.util
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from moe_ep import _native  # noqa: E402
from moe_ep.launch import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_moe.py")
COMPARE = os.path.join(ROOT, "examples", "compare_dispatchers.py")
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
TINY_FP8 = os.path.join(ROOT, "configs", "tiny_cpu_fp8.yaml")
TE_FP8 = os.path.join(ROOT, "configs", "single_gpu_te_fp8.yaml")
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


def _example(path: str):
    """An example script imported as a module (its functions, without running it)."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def _wait_all(procs, timeout_s):
    """Exit codes of all processes; once one fails, the others are stopped instead of waiting out
    torchrun's exit barrier."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    return [p.wait(timeout=60) for p in procs]


def test_compare_dispatchers_trains_to_the_same_losses(tmp_path):
    """With --no-arena (which reaches moe_ep's dispatcher through train_moe.py) as with the arena, the
    default, in the other tests here: megatron's alltoall dispatcher's losses."""
    summary = tmp_path / "summary.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "compare_dispatchers.py"), "--nproc", "2",
                    "--steps", "4", "--no-arena", "--json", str(summary), "--plot", str(tmp_path / "plot.png")],
                   check=True, env=ENV, cwd=ROOT, timeout=600)
    result = json.loads(summary.read_text())
    assert result["max_loss_diff"] <= 1e-6
    assert {r["dispatcher"] for r in result["rows"]} == {"alltoall", "deepep"}
    assert (tmp_path / "plot.png").stat().st_size > 0


def _train_under_agents(tmp_path, name: str, num_agents: int, ranks_per_agent: int, args, env):
    """train_moe.py under num_agents torchrun agents on this host, started as on separate nodes (--node-rank,
    --master-addr, --master-port) -> (per-step losses from --json-log, the agents' output)."""
    port, log = free_port(), tmp_path / f"{name}.jsonl"
    outputs = [tmp_path / f"{name}_agent{node}.txt" for node in range(num_agents)]
    agents = []
    for node, output in enumerate(outputs):
        with open(output, "w") as out:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(num_agents), "--node-rank", str(node),
                 "--nproc-per-node", str(ranks_per_agent), "--master-addr", "127.0.0.1", "--master-port", str(port),
                 TRAIN, *args, "--json-log", str(log)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    codes = _wait_all(agents, timeout_s=600)
    text = "".join(output.read_text() for output in outputs)
    assert codes == [0] * num_agents, (codes, text[-4000:])
    return _losses(log), text


def _assert_rank0_lines(text: str, ranks_per_node_source: str, normal_calls: str) -> None:
    """Rank 0 alone says where the node layout came from and which backend served the calls."""
    assert text.count("train_moe: 4 ranks") == 1, text[-4000:]
    assert f"ranks per node from {ranks_per_node_source}" in text, text[-4000:]
    assert text.count("train_moe: moe_ep over 2 node(s) of 2 ranks: normal calls: ") == 1, text[-4000:]
    assert f"normal calls: {normal_calls}; low-latency calls: none made" in text, text[-4000:]


TWO_NODE_STEPS = ["--config", TINY, "--dispatcher", "deepep", "--steps", "3"]


def test_two_torchrun_agents_train_like_one_agent_cut_into_the_same_nodes(tmp_path):
    """Two agents of 2 ranks are two nodes to moe_ep (an agent's ranks, LOCAL_WORLD_SIZE, where several
    agents run, as the log says): their per-step losses equal bit for bit those of one agent of 4 ranks
    cut into nodes of 2 by --ranks-per-node: the same ranks, nodes and calls, whichever agent started them."""
    one, one_text = _train_under_agents(tmp_path, "one", 1, 4, [*TWO_NODE_STEPS, "--ranks-per-node", "2"], ENV)
    two, two_text = _train_under_agents(tmp_path, "two", 2, 2, TWO_NODE_STEPS, ENV)
    assert len(one) == 3 and two == one, (one, two)
    _assert_rank0_lines(one_text, "--ranks-per-node", "portable backend (CPU tensors)")
    _assert_rank0_lines(two_text, "LOCAL_WORLD_SIZE", "portable backend (CPU tensors)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(_native.internode_unavailable_reason() is not None,
                    reason=str(_native.internode_unavailable_reason()))
def test_two_torchrun_agents_on_one_gpu_run_the_internode_kernels(tmp_path):
    """The same on CUDA ranks sharing one GPU (under MPS, each with its SM share, as moe_ep.launch runs
    them): the internode kernels serve the normal calls of both runs. Megatron's layers on the GPU do
    not promise the same bits run to run, hence a tolerance."""
    from moe_ep.mps import client_sm_share, private_mps_daemon
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    with private_mps_daemon(dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=first_gpu,
                                 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(client_sm_share(4)))) as env:
        one, one_text = _train_under_agents(tmp_path, "one", 1, 4, [*TWO_NODE_STEPS, "--ranks-per-node", "2"], env)
        two, two_text = _train_under_agents(tmp_path, "two", 2, 2, TWO_NODE_STEPS, env)
    assert len(one) == 3
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-5, (one, two)
    _assert_rank0_lines(one_text, "--ranks-per-node", "internode kernels")
    _assert_rank0_lines(two_text, "LOCAL_WORLD_SIZE", "internode kernels")


def test_profiled_runs_name_both_dispatchers_phases(tmp_path):
    """compare_dispatchers.py --profile: each run's operator table of three steps on rank 0, with the
    dispatcher's phases among its rows (moe_ep's forward and backward, megatron alltoall's forward),
    so a slower step shows which phase costs it."""
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "compare_dispatchers.py"), "--nproc", "2",
                    "--steps", "4", "--config", TINY, "--profile", str(tmp_path), "--plot", str(tmp_path / "plot.png")],
                   check=True, env=ENV, cwd=ROOT, timeout=600)
    phases = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess", "token_combine",
              "combine_postprocess")
    for dispatcher, prefix, extra in (("deepep", "moe_ep", ("dispatch_backward", "combine_backward")),
                                      ("alltoall", "alltoall", ())):
        text = (tmp_path / f"profile_{dispatcher}.txt").read_text()
        assert "steps 1-3, rank 0: the dispatcher's phases" in text and "sorted by host time" in text
        for phase in phases + extra:
            assert f"{prefix}.{phase} " in text, (dispatcher, phase)


def test_expert_load_plot_draws_the_logged_load(tmp_path):
    """train_moe.py --expert-load-plot: a PNG of each expert's tokens per step, whose numbers (the JSON
    beside it) are the loads logged in --json-log; every token reaches its top-k experts, so a step's loads
    sum to tokens x top-k."""
    png, log = tmp_path / "load" / "experts.png", tmp_path / "log.jsonl"
    subprocess.run([sys.executable, "-m", "moe_ep.launch", "--nproc", "2", TRAIN, "--config", TINY, "--steps", "3",
                    "--expert-load-plot", str(png), "--json-log", str(log)], check=True, env=ENV, cwd=ROOT, timeout=600)
    data = png.read_bytes()
    assert len(data) > 0 and data.startswith(b"\x89PNG\r\n\x1a\n")
    plotted = json.loads((tmp_path / "load" / "experts.json").read_text())
    logged = [json.loads(line)["expert_tokens"] for line in log.read_text().splitlines()]
    assert plotted["expert_tokens"] == logged and len(logged) == 3
    batch, seq, topk = 4, 32, 2  # configs/tiny_cpu.yaml
    for loads in logged:
        assert len(loads) == 8 and sum(loads) == batch * seq * 2 * topk


def test_expert_load_plot_refuses_what_it_cannot_draw(tmp_path):
    """The flag needs moe_ep's dispatcher: another one is refused, naming the flag, before any rank starts."""
    run = subprocess.run([sys.executable, TRAIN, "--config", TINY, "--dispatcher", "alltoall", "--expert-load-plot",
                          str(tmp_path / "x.png")], env=ENV, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert run.returncode != 0 and "--expert-load-plot" in run.stderr and "deepep" in run.stderr
    assert not (tmp_path / "x.png").exists()


def test_expert_load_plot_without_matplotlib_says_so(monkeypatch):
    train_moe = _example(TRAIN)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match="--expert-load-plot: matplotlib is not installed"):
        train_moe.check_expert_load_plot(types.SimpleNamespace(expert_load_plot="load.png"), "deepep")


def test_training_in_chunks_follows_the_unchunked_run(tmp_path):
    """train_moe.py --overlap-chunks 2 on two CPU ranks: the same losses as one chunk, to float32 rounding
    (the experts' GEMMs see fewer rows at a time), step after step."""
    losses = {}
    for chunks in (1, 2):
        log = tmp_path / f"chunks{chunks}.jsonl"
        subprocess.run([sys.executable, "-m", "moe_ep.launch", "--nproc", "2", TRAIN, "--config", TINY, "--steps", "5",
                        "--overlap-chunks", str(chunks), "--json-log", str(log)], check=True, env=ENV, cwd=ROOT,
                       timeout=600)
        losses[chunks] = _losses(log)
    assert len(losses[1]) == 5 and losses[1][-1] < losses[1][0]
    assert losses[2] == pytest.approx(losses[1], rel=1e-5), losses


def _config_model(path: str) -> dict:
    import yaml
    with open(path) as f:
        return dict(yaml.safe_load(f)["model"])


def test_layer_flags_choose_the_layers_over_the_config():
    """--transformer-impl and --fp8-recipe parse with Megatron-LM's names; left out, the config's model section
    chooses (configs/single_gpu_te_fp8.yaml: TE layers, blockwise fp8), else megatron's own layers without fp8;
    the model section's keys are taken out, for train_moe.py sets the fields they stand for itself."""
    train_moe = _example(TRAIN)
    args = train_moe.parse_args(["--config", TINY, "--transformer-impl", "transformer_engine",
                                 "--fp8-recipe", "blockwise"])
    assert (args.transformer_impl, args.fp8_recipe) == ("transformer_engine", "blockwise")
    plain = train_moe.parse_args(["--config", TINY])
    assert train_moe.choose_layers(plain, _config_model(TINY)) == dict(transformer_impl="local", fp8_recipe=None)
    model = _config_model(TE_FP8)
    assert train_moe.choose_layers(plain, model) == dict(transformer_impl="transformer_engine", fp8_recipe="blockwise")
    assert "transformer_impl" not in model and "fp8_recipe" not in model
    local = train_moe.parse_args(["--config", TE_FP8, "--transformer-impl", "local"])
    assert train_moe.choose_layers(local, _config_model(TE_FP8))["transformer_impl"] == "local"
    fields = train_moe.layer_fields(dict(transformer_impl="transformer_engine", fp8_recipe="blockwise"))
    assert fields == dict(transformer_impl="transformer_engine", bf16=True, params_dtype=torch.bfloat16,
                          moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="blockwise")
    assert train_moe.layer_fields(dict(transformer_impl="local", fp8_recipe=None)) == dict(transformer_impl="local")
    with pytest.raises(SystemExit):
        train_moe.parse_args(["--config", TINY, "--fp8-recipe", "delayed"])


def test_fp8_recipe_without_transformer_engine_layers_is_refused_before_any_rank_starts():
    """fp8 GEMMs are transformer-engine's: --fp8-recipe with megatron's own layers is refused, naming both flags
    (from the command line, or the config's recipe under --transformer-impl local)."""
    run = subprocess.run([sys.executable, TRAIN, "--config", TINY_FP8, "--fp8-recipe", "blockwise"], env=ENV, cwd=ROOT,
                         timeout=300, capture_output=True, text=True)
    assert run.returncode != 0, run.stdout
    assert "--fp8-recipe blockwise" in run.stderr and "--transformer-impl transformer_engine" in run.stderr, run.stderr
    assert "init_process_group" not in run.stderr  # refused before the rank looked for its peers
    train_moe = _example(TRAIN)
    args = train_moe.parse_args(["--config", TE_FP8, "--transformer-impl", "local"])
    model = _config_model(TE_FP8)
    with pytest.raises(SystemExit, match="--fp8-recipe blockwise: .*--transformer-impl transformer_engine"):
        train_moe.check_layers(train_moe.choose_layers(args, model), model, dict(micro_batch_size=4, seq_length=1024))


def test_fp8_recipe_refuses_sizes_its_blocks_do_not_divide():
    train_moe = _example(TRAIN)
    layers = dict(transformer_impl="transformer_engine", fp8_recipe="blockwise")
    data = dict(micro_batch_size=4, seq_length=32)
    with pytest.raises(SystemExit, match="model.hidden_size 64 is not a multiple of 128"):
        train_moe.check_layers(layers, _config_model(TINY), data)
    with pytest.raises(SystemExit, match="model.ffn_hidden_size 200 is not a multiple of 128"):
        train_moe.check_layers(layers, dict(hidden_size=128, ffn_hidden_size=200), data)
    with pytest.raises(SystemExit, match="= 12 tokens a rank is not a multiple of 8"):
        train_moe.check_layers(layers, _config_model(TINY_FP8), dict(micro_batch_size=3, seq_length=4))
    train_moe.check_layers(layers, _config_model(TINY_FP8), data)


@pytest.mark.skipif(TE_INSTALLED, reason="transformer-engine is installed here")
@pytest.mark.parametrize("choice", [["--config", TINY, "--transformer-impl", "transformer_engine"],
                                    ["--config", TE_FP8]], ids=["flag", "config"])
def test_transformer_engine_layers_are_refused_where_it_does_not_import(choice):
    """Chosen by the flag or by the config, transformer-engine's layers are refused at once where TE does not
    import, naming the flag, before the rank looks for its peers."""
    run = subprocess.run([sys.executable, TRAIN, *choice], env=ENV, cwd=ROOT, timeout=300, capture_output=True,
                         text=True)
    assert run.returncode != 0, run.stdout
    assert "--transformer-impl transformer_engine: transformer-engine does not import here" in run.stderr, run.stderr
    assert "init_process_group" not in run.stderr


def test_transformer_engine_that_fails_to_import_is_named(monkeypatch):
    """The same check wherever TE is installed, with its import made to fail."""
    train_moe = _example(TRAIN)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import transformer_engine raises ImportError
    with pytest.raises(SystemExit, match="--transformer-impl transformer_engine: transformer-engine does not import"):
        train_moe.check_te(use_cuda=True)


def test_compare_dispatchers_gives_both_runs_the_layer_flags():
    """Both dispatchers' train_moe.py commands carry --transformer-impl and --fp8-recipe where given, and leave
    them to the config where not."""
    compare = _example(COMPARE)
    args = compare.parse_args(["--nproc", "4", "--transformer-impl", "transformer_engine", "--fp8-recipe", "blockwise"])
    for dispatcher in compare.DISPATCHERS:
        cmd = compare.train_command(dispatcher, args, "log.jsonl")
        flags = cmd[cmd.index(TRAIN) + 1:]
        assert ["--dispatcher", dispatcher] == flags[flags.index("--dispatcher"):flags.index("--dispatcher") + 2]
        assert flags[flags.index("--transformer-impl") + 1] == "transformer_engine", cmd
        assert flags[flags.index("--fp8-recipe") + 1] == "blockwise", cmd
    plain = compare.train_command("deepep", compare.parse_args([]), "log.jsonl")
    assert "--transformer-impl" not in plain and "--fp8-recipe" not in plain


def test_compare_dispatchers_summary_names_the_layers_trained(tmp_path, monkeypatch, capsys):
    """The summary and its JSON say which layers and fp8 recipe both runs trained, as train_moe.py logged them."""
    compare = _example(COMPARE)
    logged = dict(transformer_impl="transformer_engine", fp8_recipe="blockwise")
    monkeypatch.setattr(compare, "run", lambda dispatcher, args, path: [
        dict(step=s, loss=1.0 / (s + 1), step_time_s=0.01, tokens_per_s=1e5, **logged) for s in range(4)])
    summary = tmp_path / "summary.json"
    assert compare.main(["--json", str(summary), "--plot", str(tmp_path / "plot.png"), "--warmup", "1"]) == 0
    result = json.loads(summary.read_text())
    assert (result["transformer_impl"], result["fp8_recipe"]) == ("transformer_engine", "blockwise")
    assert "both with transformer_engine layers, fp8 recipe blockwise" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("recipe", [[], ["--fp8-recipe", "blockwise"]], ids=["bf16", "fp8_blockwise"])
def test_compare_dispatchers_trains_transformer_engine_layers(tmp_path, recipe):
    """One GPU rank, configs/tiny_cpu_fp8.yaml (sizes the blockwise recipe takes) with transformer-engine's
    layers, bf16 or fp8: both dispatchers train, and the summary names the layers."""
    pytest.importorskip("transformer_engine")
    summary = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, COMPARE, "--nproc", "1", "--steps", "3", "--config", TINY_FP8,
                           "--transformer-impl", "transformer_engine", *recipe, "--json", str(summary),
                           "--plot", str(tmp_path / "plot.png")], cwd=ROOT, timeout=600, capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "layers: transformer_engine (TE " in done.stdout, done.stdout[-3000:]
    result = json.loads(summary.read_text())
    assert {r["dispatcher"] for r in result["rows"]} == {"alltoall", "deepep"}
    assert (result["transformer_impl"], result["fp8_recipe"]) == ("transformer_engine", recipe[-1] if recipe else None)
    assert all(r["final_loss"] == r["final_loss"] for r in result["rows"])  # not NaN
