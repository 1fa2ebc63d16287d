"""Decode steps of one MoE layer on the low-latency calls: each step dispatches every rank's new tokens
(fp8 by default), runs the local experts on the received rows, and combines; both receives are deferred
to a hook, so other work (here a stand-in for the next micro-batch's attention) runs while the tokens
travel and no SM waits for them. Every step is checked against the same layer computed densely.

    python examples/decode_low_latency.py                         # 4 ranks on CPU (portable backend)
    python examples/decode_low_latency.py --device cuda           # CUDA ranks (the low-latency kernels)
    python examples/decode_low_latency.py --device cuda --graph   # one step captured in a CUDA graph, replayed
    torchrun --nproc-per-node 8 examples/decode_low_latency.py --device cuda   # or any torchrun launch

Every rank holds all experts' weights (two float32 matrices of hidden x 2 hidden each) for its dense
check: keep the shapes small. The experts see fixed shapes ([local experts, ranks x max tokens, hidden]:
rows past each expert's recv_count are not data and are never combined), which is what lets a decode
step be captured once and replayed with new tokens in the same tensors.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moe_ep  # noqa: E402
from moe_ep import Buffer, fp8  # noqa: E402

from demo import dense_layer, expert_mlp, experts, print_table, run_ranks, tokens_of  # noqa: E402  (demo.py's layer)


def side_work(x: torch.Tensor) -> torch.Tensor:
    """Compute that overlaps a transfer (a decode step would run the next micro-batch's attention)."""
    return torch.tanh(x.float() @ x.float().t()).sum()


def decode(args):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    local = args.experts // num_ranks
    w1, w2 = (w.to(device) for w in experts(args.experts, args.hidden, args.seed))
    mine = slice(rank * local, (rank + 1) * local)
    w1_local, w2_local = w1[mine], w2[mine]
    size = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, args.experts)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=local)
    # The step's inputs live in fixed tensors, refilled every step (a CUDA graph replays on them).
    x = torch.zeros(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(args.tokens, args.topk, dtype=torch.int64, device=device)
    weights = torch.zeros(args.tokens, args.topk, dtype=torch.float32, device=device)

    def step() -> torch.Tensor:
        recv, _, handle, _, hook = buffer.low_latency_dispatch(x, idx, args.tokens, args.experts,
                                                               use_fp8=args.fp8, return_recv_hook=True)
        side_work(x)
        hook()
        rows = fp8.per_token_cast_back(*recv) if args.fp8 else recv  # [local, ranks x max, hidden]
        y = torch.stack([expert_mlp(rows[j], w1_local[j], w2_local[j]) for j in range(local)]).to(torch.bfloat16)
        out, _, hook = buffer.low_latency_combine(y, idx, weights, handle, return_recv_hook=True)
        side_work(x)
        hook()
        return out

    graph = out = None
    errors, step_ms = [], []
    for s in range(args.steps):
        new_x, new_idx, new_weights = tokens_of(rank, args, step=s, count=args.tokens)
        x.copy_(new_x)
        idx.copy_(new_idx)
        weights.copy_(new_weights)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()  # every rank starts the step together: the time is the step's, not a peer's dense check
        start = time.perf_counter()
        if args.graph and graph is None:
            step()  # a first call of the shape runs outside the capture (it sets the buffer up)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
        if graph is not None:
            graph.replay()
        else:
            out = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - start) * 1e3)
        dense = dense_layer(x, idx, weights, w1, w2)
        errors.append(((out.float() - dense).norm() / dense.norm().clamp(min=1e-9)).item())
    # The first step sets the buffer up (and with --graph captures): the median of the others.
    timed = step_ms[1:] or step_ms
    return dict(rank=rank, tokens=args.tokens, steps=args.steps, worst_error=max(errors),
                step_ms=sorted(timed)[len(timed) // 2], graph=graph is not None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256,
                        help="a multiple of 128 for the fp8 dispatch (the default), of 8 with --bf16")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a rank decodes per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", dest="fp8", action="store_false", help="bf16 dispatch (default: fp8, 1x128 scales)")
    parser.add_argument("--graph", action="store_true", help="capture one step in a CUDA graph and replay it")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.graph and args.device != "cuda":
        parser.error("--graph needs --device cuda")
    rows = run_ranks(args, decode)
    if rows is None:  # a rank other than 0 of a torchrun job
        return
    print_table(
        [{"rank": r["rank"], "tokens a step": r["tokens"], "steps": r["steps"],
          "worst rel. error": f"{r['worst_error']:.2e}", "step ms (median)": f"{r['step_ms']:.2f}"} for r in rows],
        f"moe_ep {moe_ep.__version__}: low-latency decode, {args.ranks} ranks, {args.experts} experts, "
        f"top-{args.topk}, hidden {args.hidden}, {'fp8' if args.fp8 else 'bf16'} dispatch, {args.device}"
        + (", CUDA graph" if args.graph else ""))
    worst = max(r["worst_error"] for r in rows)
    # fp8 rows (e4m3, one scale per 128 values) and the bf16 expert outputs bound the error.
    bound = 6e-2 if args.fp8 else 1e-2
    if worst > bound:
        raise SystemExit(f"mismatch against the dense MoE layer: relative error {worst:.3e} (bound {bound:g})")
    print(f"OK: every step matches the dense MoE layer (worst relative error {worst:.2e})")


if __name__ == "__main__":
    main()
