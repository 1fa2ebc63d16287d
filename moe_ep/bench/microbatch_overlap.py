"""megatron's micro-batch overlap (`overlap_moe_expert_parallel_comm`: one micro-batch's dispatch and
combine beside another's attention and experts, megatron's combined 1F1B schedule) timed against the
same training step without it, in one run: a bf16 GPT-MoE (megatron-core's local layers, or with
--transformer-impl transformer_engine TE's layers and grouped experts), the same seeds, batches and ranks,
each step --micro-batches micro-batches of forward and backward as megatron's forward_backward_no_pipelining
runs them: one after the other, or with the overlap its combined 1F1B schedule (called directly: the
wrapper also makes CUDA tensors of its own, which CPU ranks cannot). --delay-wgrad adds a third run, the
overlap with delay_wgrad_compute (TE's layers compute their weight gradients where the schedule puts
them). Every rank is one expert-parallel rank.

Per dispatcher: ms a step without the overlap, with it (and with delayed weight gradients), their ratio to
the step without, and the largest difference between each run's first-step losses and the first run's
(bf16 rounding only: the schedule reorders the same operations).

    moe-ep-bench microbatch_overlap --ranks 4
    moe-ep-bench microbatch_overlap --ranks 4 --transformer-impl transformer_engine --delay-wgrad
    moe-ep-bench microbatch_overlap --cpu --ranks 2 --layers 1 --hidden 64 --ffn-hidden 128 --seq 16 --experts 4
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

from ..te import te_available
from . import command_parser
from .megatron_layer import DISPATCHERS, add_moe_shape_arguments, megatron_ranks, parse_rank_arguments
from .report import Report
from .timing import wall_seconds_per_call
from .torchrun import add_ranks_argument

# What --ranks left out runs (under torchrun: the ranks it started instead).
RANKS = 4
SEED = 1234
VOCAB = 1024
# The largest first-step loss difference, relative to the loss, that bf16 rounding in another order explains.
LOSS_TOLERANCE = 2e-2


def loss_function(per_token_loss):
    """Megatron-LM's loss function form: (summed loss, tokens, what it logs)."""
    loss = per_token_loss.float().sum()
    num_tokens = torch.tensor(per_token_loss.numel(), dtype=torch.int)
    return loss, num_tokens, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """A forward_step_func as Megatron-LM's pretrain_gpt.py writes it for either schedule."""
    batch = next(data_iterator)
    if return_schedule_plan:
        return model.build_schedule_plan(**batch), loss_function
    return model(**batch), loss_function


def one_by_one(model, batches) -> list:
    """Each micro-batch's forward then its backward: megatron's schedule without the overlap."""
    store = []
    for batch in batches:
        loss, num_tokens, logged = loss_function(model(**batch))
        (loss / torch.clamp(num_tokens, min=1) / len(batches)).backward()
        store.append(logged)
    return store


def combined_schedule(model, batches) -> list:
    """megatron's combined 1F1B schedule without pipelining (what forward_backward_no_pipelining runs with
    the overlap): micro-batch i's forward interleaved, layer by layer, with micro-batch i-1's backward."""
    import contextlib

    from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining

    store = []
    combined_1f1b_schedule_for_no_pipelining(
        forward_step, iter(batches), model, len(batches), None, None, store, model.config,
        collect_non_loss_data=False, first_val_step=None, forward_only=False, no_sync_func=contextlib.nullcontext,
        total_num_tokens=torch.zeros([], dtype=torch.int), check_first_val_step=lambda first: first)
    return store


def _batches(args, device) -> list:
    g = torch.Generator().manual_seed(SEED + dist.get_rank())
    causal = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1).to(device)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1).to(device)
    batches = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, VOCAB, (args.micro_batch, args.seq + 1), generator=g).to(device)
        batches.append(dict(input_ids=tokens[:, :-1], position_ids=positions, attention_mask=causal,
                            labels=tokens[:, 1:]))
    return batches


# The runs of each dispatcher, in order: (name, overlap_moe_expert_parallel_comm, delay_wgrad_compute).
RUNS = (("no overlap", False, False), ("overlap", True, False), ("overlap + delayed wgrad", True, True))
# The JSON metrics of each run after the first: its step time, its ratio to the first's, its loss difference.
METRICS = {"overlap": ("ms_overlap", "overlap_vs_not", "loss_rel_diff"),
           "overlap + delayed wgrad": ("ms_overlap_delayed_wgrad", "overlap_delayed_wgrad_vs_not",
                                       "loss_rel_diff_delayed_wgrad")}


def runs(args) -> tuple:
    return RUNS if args.delay_wgrad else RUNS[:2]


def _gpt(args, dispatcher: str, overlap: bool, delay_wgrad: bool, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                            get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn_hidden, num_attention_heads=8,
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=dist.get_world_size(), use_cpu_initialization=device.type == "cpu",
        moe_router_dtype="fp32", moe_aux_loss_coeff=0.0, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=delay_wgrad)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True)
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=args.experts, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=args.seq).to(device)
    return Float16Module(config, model)


def rank_step_times(args) -> dict:
    """On every rank: each dispatcher's step without and with the overlap (ms), and the first step's losses."""
    warnings.filterwarnings("ignore", module=r"megatron\.")
    from megatron.core import parallel_state

    from moe_ep.megatron.cpu_support import enable_cpu_execution

    if args.cpu:
        enable_cpu_execution(force=True)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    batches = _batches(args, device)
    times, losses = {}, {}
    for dispatcher in args.dispatchers:
        for name, overlap, delay_wgrad in runs(args):
            model = _gpt(args, dispatcher, overlap, delay_wgrad, device)

            def step():
                model.zero_grad(set_to_none=True)
                return (combined_schedule if overlap else one_by_one)(model, batches)

            key = f"{dispatcher} {name}"
            losses[key] = [float(logged["lm loss"]) for logged in step()]
            times[key] = wall_seconds_per_call(step, args.warmup, args.iters) * 1e3
            del model
    dist.barrier()
    parallel_state.destroy_model_parallel()
    return dict(rank=dist.get_rank(), ms=times, losses=losses)


def parse_args(argv=None):
    parser = command_parser(__spec__, __doc__)
    add_ranks_argument(parser, RANKS, "expert-parallel ranks")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers, each with an MoE (default 2)")
    add_moe_shape_arguments(parser, ffn_hidden=2816)
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences a micro-batch (default 2)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches a step (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--iters", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--dispatchers", nargs="+", choices=DISPATCHERS, default=["deepep"],
                        help="megatron token dispatcher types to time (default: deepep)")
    parser.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                        help="megatron's layers (local, the default) or transformer-engine's, with grouped experts")
    parser.add_argument("--delay-wgrad", action="store_true",
                        help="a third run: the overlap with delay_wgrad_compute (needs --transformer-impl "
                             "transformer_engine)")
    return parse_rank_arguments(parser, argv, RANKS, checks=_check_arguments)


def _check_arguments(parser, args) -> None:
    if args.micro_batches < 2:
        parser.error("--micro-batches: at least 2 (the overlap pairs one micro-batch with another)")
    if args.delay_wgrad and args.transformer_impl != "transformer_engine":
        parser.error("--delay-wgrad: megatron's local layers cannot defer their weight gradients; "
                     "add --transformer-impl transformer_engine")
    if args.transformer_impl == "transformer_engine" and not te_available():
        parser.error("--transformer-impl transformer_engine: transformer-engine does not import here")
    if args.transformer_impl == "transformer_engine" and args.cpu:
        parser.error("--transformer-impl transformer_engine: transformer-engine's layers need CUDA ranks, not --cpu")


def report_results(args, rows: list, report: Report) -> bool:
    """The table and JSON lines; returns whether each dispatcher's runs had the first run's first-step losses."""
    shape = dict(layers=args.layers, hidden=args.hidden, ffn_hidden=args.ffn_hidden, experts=args.experts,
                 topk=args.topk, seq=args.seq, micro_batch=args.micro_batch, micro_batches=args.micro_batches,
                 transformer_impl=args.transformer_impl)
    print(f"megatron training step, {args.ranks} ranks (EP={args.ranks}), {args.micro_batches} micro-batches of "
          f"{args.micro_batch} x {args.seq} tokens, {args.layers} layers, hidden {args.hidden}, top-{args.topk} of "
          f"{args.experts} experts, bf16, {args.transformer_impl} layers; {args.iters} steps after {args.warmup}")
    print(f"{'dispatcher':<10} {'run':<24} {'ms a step':>10} {'/ no overlap':>13} {'loss diff':>10}")
    matched = True
    for dispatcher in args.dispatchers:
        baseline = sum(r["ms"][f"{dispatcher} no overlap"] for r in rows) / len(rows)
        print(f"{dispatcher:<10} {'no overlap':<24} {baseline:>10.2f}")
        report.add("step", shape, args.ranks, dispatcher, "ms_no_overlap", baseline, "ms")
        for name, _, _ in runs(args)[1:]:
            key = f"{dispatcher} {name}"
            ms = sum(r["ms"][key] for r in rows) / len(rows)
            diff = max(abs(a - b) / max(1.0, abs(a)) for r in rows
                       for a, b in zip(r["losses"][f"{dispatcher} no overlap"], r["losses"][key]))
            same = diff <= LOSS_TOLERANCE and all(len(r["losses"][key]) == args.micro_batches for r in rows)
            matched &= same
            print(f"{dispatcher:<10} {name:<24} {ms:>10.2f} {ms / baseline:>12.2f}x {diff:>10.1e}"
                  + ("" if same else "  LOSSES DIFFER"))
            for metric, value, unit in zip(METRICS[name], (ms, ms / baseline, diff), ("ms", "x", None)):
                report.add("step", shape, args.ranks, dispatcher, metric, value, unit)
    return matched


def main(argv=None) -> int:
    args = parse_args(argv)
    ranks, _ = megatron_ranks(args, bf16=True)
    report = Report("microbatch_overlap", args.jsonl, args.plot)
    with ranks as pool:
        rows = pool.run(rank_step_times, args)
    return 0 if report_results(args, rows, report) else 1


if __name__ == "__main__":
    sys.exit(main())
