"""Train a GPT-MoE built with megatron-core, with moe_ep's dispatcher or megatron's own.

Every rank is one expert-parallel rank (EP = world size, TP = PP = 1) and one data-parallel replica of the
dense layers. Launch with torchrun, on CPU (gloo) or GPUs (NCCL, one GPU per rank; gloo when ranks
share a GPU, under MPS via `python -m moe_ep.launch`), one agent per node:

    torchrun --nproc-per-node 4 examples/train_moe.py --config configs/tiny_cpu.yaml
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr host0 --master-port 29500 \\
        examples/train_moe.py --config configs/mixtral_8x7b_like.yaml      # node-rank 1 on the other node

The layers are megatron's own (--transformer-impl local, float32 parameters) or transformer-engine's
(--transformer-impl transformer_engine: TE's attention and linear layers, the experts TEGroupedMLP, bf16
parameters), their GEMMs in fp8 with --fp8-recipe blockwise; a config's model section may choose both
(transformer_impl, fp8_recipe, as configs/single_gpu_te_fp8.yaml does), and the flags override it:

    python -m moe_ep.launch --nproc 4 examples/train_moe.py --config configs/single_gpu_te_fp8.yaml

A rank uses GPU LOCAL_RANK (modulo the GPUs it sees). The ranks moe_ep treats as one node: --ranks-per-node,
else MOE_EP_RANKS_PER_NODE, else, where torchrun runs several agents, an agent's ranks (LOCAL_WORLD_SIZE; so
two agents on one host rehearse two nodes), else the ranks sharing a host name. Rank 0 prints, before the
first step, the layout and what moe_ep was built with, and after it which backend served the calls.

Writes one JSON line per step (loss, step time, tokens/s, the layers) to --json-log; --profile FILE writes
where rank 0's time went in three steps after the first three (torch.profiler's operator table, moe_ep's
dispatcher phases among them as `moe_ep.*` ranges); --expert-load-plot PNG draws each expert's tokens per
step as moe_ep's dispatcher logs them through megatron-core's MoE metrics (moe_ep_log_metrics).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # moe_ep, when not installed

TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_RECIPES = ("blockwise",)
# The blockwise recipe's block: 1x128 for activations and gradients, 128x128 for weights.
FP8_BLOCK = 128
# TE's fp8 GEMMs take a token count that is a multiple of 8 (transformer_engine.pytorch.utils.assert_dim_for_fp8_exec).
FP8_TOKEN_MULTIPLE = 8


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file with model/data/train sections")
    parser.add_argument("--dispatcher", choices=["deepep", "alltoall", "allgather"],
                        help="overrides model.moe_token_dispatcher_type")
    parser.add_argument("--steps", type=int, help="overrides train.steps")
    parser.add_argument("--ranks-per-node", type=positive_int,
                        help="moe_ep: ranks sharing a node (default: MOE_EP_RANKS_PER_NODE, else a torchrun agent's "
                             "ranks where several agents run, else the ranks sharing a host name)")
    parser.add_argument("--no-arena", action="store_true",
                        help="moe_ep: the two-pass intranode calls and no arena (default: the dispatcher's arena, "
                             "one pass over memory per call)")
    parser.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS,
                        help="the layers: megatron's own (local, float32 parameters) or transformer-engine's "
                             "(TE's attention and linear layers, the experts TEGroupedMLP, bf16 parameters); "
                             "overrides model.transformer_impl (default local)")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES,
                        help="train the transformer-engine layers' GEMMs in fp8 (e4m3) with this recipe (megatron's "
                             "fp8='e4m3', fp8_recipe); needs --transformer-impl transformer_engine, hidden and FFN "
                             f"sizes multiples of {FP8_BLOCK} and micro_batch_size x seq_length a multiple of "
                             f"{FP8_TOKEN_MULTIPLE}; overrides model.fp8_recipe (default: no fp8)")
    parser.add_argument("--fp8-dispatch", choices=["auto", "on", "off"], default="auto",
                        help="moe_ep: send the tokens as 1x128 fp8 with their scales (moe_ep_fp8_dispatch; "
                             "auto: on with fp8_recipe=blockwise); the hidden size must be a multiple of 128")
    parser.add_argument("--overlap-chunks", type=positive_int, default=1,
                        help="moe_ep: pipeline each MoE layer's tokens in this many chunks, their exchanges beside "
                             "the experts' GEMMs (moe_ep_overlap_chunks; default 1, no pipeline)")
    parser.add_argument("--json-log", help="JSON lines, one per step (rank 0)")
    parser.add_argument("--profile", help="rank 0's operator table of three profiled steps, written here")
    parser.add_argument("--stall-dump", type=float, metavar="S",
                        help="a step that takes longer than S seconds appends each rank's Python stacks and "
                             "its Buffer calls' progress (moe_ep.megatron.progress_reports) to stall_rank<N>.txt "
                             "in --stall-dir (where a late rank is when its peers' waits run out; faulthandler "
                             "reads the stacks without the GIL, which is safe only while the step is stuck: keep "
                             "S well above a step's time)")
    parser.add_argument("--stall-dir", default=".", help="where --stall-dump writes")
    parser.add_argument("--expert-load-plot", metavar="PNG",
                        help="moe_ep: a heatmap of each expert's tokens per step (the mean over the MoE layers, as "
                             "the dispatcher logs them with moe_ep_log_metrics), written here with its numbers "
                             "beside it as JSON (the same name, .json) and in --json-log; needs matplotlib and the "
                             "deepep dispatcher")
    return parser.parse_args(argv)


def check_expert_load_plot(args, dispatcher_type: str) -> None:
    """--expert-load-plot's needs, checked before any rank starts: the deepep dispatcher and matplotlib."""
    if not args.expert_load_plot:
        return
    if dispatcher_type != "deepep":
        raise SystemExit(f"--expert-load-plot: the expert load is logged by moe_ep's dispatcher; expected "
                         f"--dispatcher deepep, got {dispatcher_type!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--expert-load-plot: matplotlib is not installed (pip install matplotlib)") from None


def choose_layers(args, model_cfg: dict) -> dict:
    """The transformer impl and fp8 recipe to train with: the flags, else the config's model section
    (whose keys are taken out of it: they are not passed on as they stand, see layer_fields), else
    megatron's own layers without fp8."""
    impl, recipe = model_cfg.pop("transformer_impl", "local"), model_cfg.pop("fp8_recipe", None)
    return dict(transformer_impl=args.transformer_impl or impl, fp8_recipe=args.fp8_recipe or recipe)


def check_layers(layers: dict, model_cfg: dict, data_cfg: dict) -> None:
    """The chosen layers' needs, checked before any rank communicates: known names, the fp8 recipe with
    transformer-engine's layers and sizes its blocks divide (transformer-engine's own needs: check_te)."""
    impl, recipe = layers["transformer_impl"], layers["fp8_recipe"]
    if impl not in TRANSFORMER_IMPLS:
        raise SystemExit(f"--transformer-impl (model.transformer_impl): expected one of {TRANSFORMER_IMPLS}, "
                         f"got {impl!r}")
    if recipe is None:
        return
    if recipe not in FP8_RECIPES:
        raise SystemExit(f"--fp8-recipe (model.fp8_recipe): expected one of {FP8_RECIPES}, got {recipe!r}")
    if impl != "transformer_engine":
        raise SystemExit(f"--fp8-recipe {recipe}: the fp8 GEMMs are transformer-engine's; expected --transformer-impl "
                         f"transformer_engine, got --transformer-impl {impl}")
    hidden = model_cfg["hidden_size"]
    ffn_key = "moe_ffn_hidden_size" if model_cfg.get("moe_ffn_hidden_size") else "ffn_hidden_size"
    ffn = model_cfg.get(ffn_key) or 4 * hidden  # the experts' size, with megatron's defaults
    for key, size in (("hidden_size", hidden), (ffn_key, ffn)):
        if size % FP8_BLOCK:
            raise SystemExit(f"--fp8-recipe {recipe}: model.{key} {size} is not a multiple of {FP8_BLOCK} (the "
                             f"recipe's block)")
    tokens = data_cfg["micro_batch_size"] * data_cfg["seq_length"]
    if tokens % FP8_TOKEN_MULTIPLE:
        raise SystemExit(f"--fp8-recipe {recipe}: micro_batch_size x seq_length = {tokens} tokens a rank is not a "
                         f"multiple of {FP8_TOKEN_MULTIPLE} (what TE's fp8 GEMMs take)")


def check_te(use_cuda: bool) -> str:
    """transformer-engine's version, where it imports and a GPU runs its layers; else SystemExit naming
    --transformer-impl (called on the rank's own GPU: TE's import may open a CUDA context)."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # ImportError, or a TE build whose library fails to load
        raise SystemExit(f"--transformer-impl transformer_engine: transformer-engine does not import here "
                         f"({type(error).__name__}: {error}); pass --transformer-impl local") from None
    if not use_cuda:
        raise SystemExit("--transformer-impl transformer_engine: transformer-engine's layers run on GPUs, and torch "
                         "sees none here; pass --transformer-impl local")
    return str(transformer_engine.__version__)


def layer_fields(layers: dict) -> dict:
    """The TransformerConfig fields of the chosen layers, as Megatron-LM's flags set them: transformer-engine's
    train bf16 parameters (--bf16; TE's fused attention takes no float32) with grouped experts
    (--moe-grouped-gemm), and e4m3 GEMMs under the fp8 recipe (--fp8-format e4m3 --fp8-recipe)."""
    fields = dict(transformer_impl=layers["transformer_impl"])
    if layers["transformer_impl"] == "transformer_engine":
        fields.update(bf16=True, params_dtype=torch.bfloat16, moe_grouped_gemm=True)
    if layers["fp8_recipe"]:
        fields.update(fp8="e4m3", fp8_recipe=layers["fp8_recipe"])
    return fields


def layers_label(layers: dict, te_version: Optional[str]) -> str:
    """The layers and fp8 recipe as the launch line names them."""
    impl = layers["transformer_impl"] + (f" (TE {te_version})" if te_version else "")
    return f"layers: {impl}, fp8 recipe: {layers['fp8_recipe'] or 'none'}"


class ScalarLog:
    """add_scalar as a tensorboard SummaryWriter has it, kept in a dict: what megatron logs in a step."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = float(value)


def logged_expert_load(step: int, num_layers: int, num_experts: int) -> list:
    """Each expert's tokens in this step, the mean over the MoE layers, as megatron's track_moe_metrics
    logs moe_ep's entries (collective: every rank calls it, as Megatron-LM's training loop does)."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics
    from moe_ep.megatron.metrics import expert_tokens_name
    writer = ScalarLog()
    track_moe_metrics(loss_scale=1.0, iteration=step, writer=writer, track_names=[], num_layers=num_layers)
    return [writer.scalars[expert_tokens_name(expert)] for expert in range(num_experts)]


def plot_expert_load(loads: list, path: str) -> None:
    """loads[step][expert] as an experts x steps heatmap at `path`, and the same numbers beside it as JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid = torch.tensor(loads).T  # [experts, steps]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * grid.shape[1] + 2), max(3.0, 0.3 * grid.shape[0] + 1.5)))
    image = ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("step")
    ax.set_ylabel("expert")
    ax.set_title("tokens per expert (mean over MoE layers)")
    fig.colorbar(image, ax=ax, label="tokens")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(dict(steps=list(range(len(loads))), expert_tokens=loads), f)


PROFILED_STEPS = 3


PHASES = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess", "token_combine",
          "combine_postprocess")


def label_alltoall_phases() -> None:
    """Megatron's alltoall dispatcher's six phases as `alltoall.*` ranges in a profile, next to moe_ep's
    own `moe_ep.*` ones (its backward runs inside autograd's collectives: no ranges there)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from moe_ep.megatron.dispatcher import phase_range
    for name in PHASES:
        setattr(MoEAlltoAllTokenDispatcher, name, phase_range(name, "alltoall")(getattr(MoEAlltoAllTokenDispatcher, name)))


def phase_summary(table, first: int, last: int) -> str:
    """The dispatchers' phase ranges of a profile: calls, host time in and under them."""
    phases = sorted((e for e in table if e.key.startswith(("moe_ep.", "alltoall."))), key=lambda e: -e.cpu_time_total)
    lines = [f"# steps {first}-{last}, rank 0: the dispatcher's phases (host time, ms, own code and what it calls)"]
    lines += [f"{e.key:<32} {e.count:>6} calls {e.cpu_time_total / 1e3:>10.2f} ms" for e in phases]
    return "\n".join(lines) + "\n\n"


class StepProfiler:
    """torch.profiler over PROFILED_STEPS steps after the warm-up (rank 0 only), its operator table
    written to `path`: by device time where a GPU runs, and by host time."""

    def __init__(self, path, steps: int, use_cuda: bool):
        self.path, self.use_cuda = path, use_cuda
        self.first = min(3, max(0, steps - PROFILED_STEPS))
        self.profiler = None

    def before_step(self, step: int) -> None:
        if self.path and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.use_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()

    def after_step(self, step: int, last: bool) -> None:
        if self.profiler is None or not (step == self.first + PROFILED_STEPS - 1 or last):
            return
        self.profiler.stop()
        table = self.profiler.key_averages()
        sections = [("host time", "cpu_time_total")]
        if self.use_cuda:
            sections.insert(0, ("device time", "self_device_time_total"))
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            f.write(phase_summary(table, self.first, step))
            for title, key in sections:
                f.write(f"# steps {self.first}-{step}, rank 0, sorted by {title}\n")
                f.write(table.table(sort_by=key, row_limit=40) + "\n\n")
        self.profiler = None


def rank_device(use_cuda: bool) -> torch.device:
    """This rank's device, made the current one: GPU LOCAL_RANK modulo the GPUs visible (the ranks of an
    agent share them round robin where they outnumber them), else the CPU."""
    if not use_cuda:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def init_distributed(device: torch.device) -> None:
    """The default process group: NCCL where each of the agent's ranks has a GPU of its own, else gloo,
    since NCCL refuses two ranks on one GPU (agents sharing a host must see different GPUs, through
    CUDA_VISIBLE_DEVICES, or all ranks share them under gloo)."""
    backend = "gloo"
    if device.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) <= torch.cuda.device_count():
        backend = "nccl"
    dist.init_process_group(backend)


def choose_ranks_per_node(requested: Optional[int]) -> Tuple[Optional[int], str]:
    """The ranks moe_ep treats as one node (None: moe_ep finds them by host name) and where that comes
    from. Where torchrun runs several agents, an agent's ranks: one agent a node is how torchrun spans
    nodes, and agents sharing a host (a rehearsal on one machine) then act as nodes, which host names
    would merge into one."""
    if requested is not None:
        return requested, "--ranks-per-node"
    if os.environ.get("MOE_EP_RANKS_PER_NODE"):
        return None, "MOE_EP_RANKS_PER_NODE"  # moe_ep reads and checks it itself
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", 0)), int(os.environ.get("WORLD_SIZE", 0))
    if 0 < local < world:
        return local, "LOCAL_WORLD_SIZE, a torchrun agent's ranks"
    return None, "host names"


def launch_line(device: torch.device, ranks_per_node_source: str, layers: str) -> str:
    """Rank 0's first line: the ranks, their nodes, this rank's device, the layers (layers_label), and what
    moe_ep was built with."""
    import moe_ep
    info = moe_ep.backend_info()
    if info["cuda_kernels"]:
        build = f"kernels, internode kernels {'built' if info['internode_kernels'] else 'absent'}"
    else:
        build = f"no kernels, {info['reason']}"
    return (f"train_moe: {dist.get_world_size()} ranks, {os.environ.get('LOCAL_WORLD_SIZE', '?')} per torchrun "
            f"agent, ranks per node from {ranks_per_node_source}; rank 0 on {device} "
            f"(LOCAL_RANK {os.environ.get('LOCAL_RANK', 0)}), {dist.get_backend()}; {layers}; moe_ep build: {build}")


def backend_line(use_cuda: bool) -> str:
    """Which backend served the dispatcher's normal and low-latency calls, from its Buffer's topology()."""
    from moe_ep.megatron import shared_buffers
    buffers = shared_buffers()
    if not buffers:
        return "train_moe: moe_ep served no calls (the dispatcher is not deepep)"
    topo = buffers[0].topology()
    nodes = f"{topo['num_ranks'] // topo['ranks_per_node']} node(s) of {topo['ranks_per_node']} ranks"

    def served(backend: Optional[str], kind: str) -> str:
        if backend is None:
            return "none made (the Buffer has no low_latency_mode)"
        if not use_cuda:
            return "portable backend (CPU tensors)"
        if backend == "portable":
            return f"portable backend ({topo['portable_reasons'][kind]})"
        return f"{backend.replace('_', '-')} kernels"

    return (f"train_moe: moe_ep over {nodes}: normal calls: {served(topo['normal_backend'], 'normal')}; "
            f"low-latency calls: {served(topo['low_latency_backend'], 'low_latency')}")


def build_model(model_cfg: dict, data_cfg: dict, use_cuda: bool, seed: int, layers: dict, moe_ep_arena: bool = True,
                fp8_dispatch: str = "auto", log_metrics: bool = False, overlap_chunks: int = 1):
    """The GPT-MoE of the config with the chosen layers (choose_layers) and moe_ep's options; TransformerBlock
    enters TE's fp8 autocast around each layer itself where the config trains in fp8."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                            get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    config = TransformerConfig(**{**model_cfg, **layer_fields(layers)}, use_cpu_initialization=not use_cuda,
                               expert_model_parallel_size=dist.get_world_size(), moe_router_dtype="fp32")
    # moe_ep's dispatcher reads its options from the config it is built with (moe_ep.megatron.options).
    config.moe_ep_arena = moe_ep_arena
    config.moe_ep_fp8_dispatch = fp8_dispatch
    config.moe_ep_log_metrics = log_metrics
    config.moe_ep_overlap_chunks = overlap_chunks
    if layers["transformer_impl"] == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=data_cfg["vocab_size"], max_sequence_length=data_cfg["seq_length"])
    model = model.cuda() if use_cuda else model
    # Megatron's local layers keep float32 parameters (TF32 matrix products on the GPU): the comparison is
    # about the dispatchers. TE's train bf16 ones inside megatron's Float16Module, which casts the inputs
    # and hands the loss back in float32; AdamW steps them as they are, without the float32 main weights
    # Megatron-LM's optimizer keeps.
    return Float16Module(config, model) if config.bf16 else model


def batch(step: int, rank: int, data_cfg: dict, device):
    """Synthetic sequences with a learnable rule (next = 3 * token + 1 mod vocab), different per rank."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    b, s, v = data_cfg["micro_batch_size"], data_cfg["seq_length"], data_cfg["vocab_size"]
    start = torch.randint(0, v, (b, 1), generator=g)
    tokens = [start]
    for _ in range(s):
        tokens.append((tokens[-1] * 3 + 1) % v)
    seq = torch.cat(tokens, dim=1)
    input_ids, labels = seq[:, :-1].to(device), seq[:, 1:].to(device)
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), diagonal=1)
    return input_ids, position_ids, causal, labels


def average_dense_gradients(model) -> None:
    """Data-parallel all-reduce of the non-expert gradients (expert weights are sharded across EP)."""
    world = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None and getattr(param, "allreduce", True):
            dist.all_reduce(param.grad)
            param.grad /= world


def write_progress_reports(stall_file, step: int) -> None:
    """A stalled step's other half (faulthandler writes the stacks): where this rank's Buffer calls
    stand, from a thread that runs while the main thread waits in a call (which releases the GIL)."""
    from moe_ep.megatron import progress_reports

    for report in progress_reports():
        stall_file.write(f"step {step}, {time.strftime('%H:%M:%S')}: {report}\n")
    stall_file.flush()


def train(args) -> list:
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    model_cfg, data_cfg, train_cfg = dict(cfg["model"]), cfg["data"], cfg["train"]
    if args.dispatcher:
        model_cfg["moe_token_dispatcher_type"] = args.dispatcher
    layers = choose_layers(args, model_cfg)
    steps = args.steps or train_cfg["steps"]
    check_expert_load_plot(args, model_cfg["moe_token_dispatcher_type"])
    check_layers(layers, model_cfg, data_cfg)
    use_cuda = torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = True
    device = rank_device(use_cuda)
    te_version = check_te(use_cuda) if layers["transformer_impl"] == "transformer_engine" else None
    init_distributed(device)
    import moe_ep.megatron  # noqa: F401  (registers moe_token_dispatcher_type="deepep")
    from moe_ep.megatron.cpu_support import enable_cpu_execution
    enable_cpu_execution()
    ranks_per_node, ranks_per_node_source = choose_ranks_per_node(args.ranks_per_node)
    if ranks_per_node is not None:
        os.environ["MOE_EP_RANKS_PER_NODE"] = str(ranks_per_node)
    if args.profile:
        label_alltoall_phases()
    rank = dist.get_rank()
    if rank == 0:
        print(launch_line(device, ranks_per_node_source, layers_label(layers, te_version)), flush=True)
    torch.manual_seed(train_cfg["seed"])
    model = build_model(model_cfg, data_cfg, use_cuda, train_cfg["seed"], layers, moe_ep_arena=not args.no_arena,
                        fp8_dispatch=args.fp8_dispatch, log_metrics=bool(args.expert_load_plot),
                        overlap_chunks=args.overlap_chunks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg["lr"])
    tokens_per_step = data_cfg["micro_batch_size"] * data_cfg["seq_length"] * dist.get_world_size()
    progress = None
    if rank == 0:
        try:
            from tqdm import tqdm
            progress = tqdm(total=steps, desc=f"{model_cfg['moe_token_dispatcher_type']:>9}", unit="step")
        except ImportError:
            pass
    log = []
    profiler = StepProfiler(args.profile if rank == 0 else None, steps, use_cuda)
    stall_file = None
    if args.stall_dump:
        os.makedirs(args.stall_dir, exist_ok=True)
        stall_file = open(os.path.join(args.stall_dir, f"stall_rank{rank}.txt"), "a")
    for step in range(steps):
        if stall_file is not None:
            faulthandler.dump_traceback_later(args.stall_dump, file=stall_file)
            stall_probe = threading.Timer(args.stall_dump, write_progress_reports, (stall_file, step))
            stall_probe.daemon = True
            stall_probe.start()
        profiler.before_step(step)
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        input_ids, position_ids, mask, labels = batch(step, rank, data_cfg, device)
        loss = model(input_ids, position_ids, mask, labels=labels).float().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_dense_gradients(model)
        optimizer.step()
        if use_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        record = dict(step=step, loss=mean_loss.item() / dist.get_world_size(), step_time_s=elapsed,
                      tokens_per_s=tokens_per_step / elapsed, **layers)
        if args.expert_load_plot:
            record["expert_tokens"] = logged_expert_load(step, model_cfg["num_layers"], model_cfg["num_moe_experts"])
        log.append(record)
        if stall_file is not None:
            faulthandler.cancel_dump_traceback_later()
            stall_probe.cancel()
        profiler.after_step(step, last=step == steps - 1)
        if rank == 0 and step == 0:  # the dispatcher made its Buffer in the first step
            (progress.write if progress is not None else print)(backend_line(use_cuda))
            sys.stdout.flush()
        if progress is not None:
            progress.set_postfix(loss=f"{record['loss']:.4f}")
            progress.update()
    if progress is not None:
        progress.close()
    if stall_file is not None:
        stall_file.close()
    if rank == 0 and args.json_log:
        with open(args.json_log, "w") as f:
            for record in log:
                f.write(json.dumps(record) + "\n")
    if rank == 0 and args.expert_load_plot:
        plot_expert_load([record["expert_tokens"] for record in log], args.expert_load_plot)
    # Tear down together: a rank that destroys its groups while a peer still uses them can abort.
    from megatron.core import parallel_state
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return log


if __name__ == "__main__":
    train(parse_args())
