"""A small MoE step on N ranks: route, dispatch, run the experts, combine, and check the result.

Every rank holds E/R experts (a tiny two-layer MLP each). The tokens of every rank are routed to their
top-k experts; moe_ep moves them to the experts' ranks and back; the result is compared with the same
MoE layer computed densely on one rank from the same seed.

    python examples/demo.py                 # 4 ranks on CPU (gloo), started by the script itself
    python examples/demo.py --device cuda   # CUDA tensors (ranks share the GPUs, under MPS)
    torchrun --nproc-per-node 4 examples/demo.py   # or any torchrun launch, one or several nodes
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moe_ep  # noqa: E402
from moe_ep import Buffer  # noqa: E402
from moe_ep.buffer import default_config_size_hints  # noqa: E402
from moe_ep.launch import RankPool  # noqa: E402


def experts(num_experts: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, hidden, 2 * hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, 2 * hidden, hidden, generator=g) / (2 * hidden) ** 0.5
    return w1, w2


def tokens_of(rank: int, args, step: int = 0, count: int = None):
    """A rank's tokens (`count`, default between half of args.tokens and all of them), their top-k experts
    by a router shared by all ranks, and the renormalised weights."""
    g = torch.Generator().manual_seed((args.seed * 1000 + rank) * 1000 + step)
    n = int(torch.randint(args.tokens // 2, args.tokens + 1, (1,), generator=g)) if count is None else count
    x = torch.randn(n, args.hidden, generator=g)
    router = torch.randn(args.hidden, args.experts, generator=torch.Generator().manual_seed(args.seed))
    probs = torch.softmax(x @ router, dim=-1)
    weights, idx = probs.topk(args.topk, dim=-1)
    return x.to(torch.bfloat16), idx, weights / weights.sum(-1, keepdim=True)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.gelu(x.float() @ w1) @ w2)


def dense_layer(x, idx, weights, w1, w2) -> torch.Tensor:
    """The MoE layer on one rank: every token's top-k experts, weighted, in float32."""
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device)
    for k in range(idx.shape[1]):
        for e in idx[:, k].unique().tolist():
            rows = (idx[:, k] == e).nonzero(as_tuple=True)[0]
            out[rows] += weights[rows, k].unsqueeze(1) * expert_mlp(x[rows], w1[e], w2[e])
    return out


def moe_step(args):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    local = args.experts // num_ranks
    w1, w2 = (w.to(device) for w in experts(args.experts, args.hidden, args.seed))
    x, idx, weights = (t.to(device) for t in tokens_of(rank, args))
    # Room for the default configs of both calls (each has its own window sizes).
    buffer = Buffer(dist.group.WORLD, default_config_size_hints(args.hidden * 2, num_ranks)[0])

    start = time.perf_counter()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, args.experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=weights)
    # The caller reduces over its local experts; combine then sums the partial results across ranks.
    y = torch.zeros(recv_x.shape[0], args.hidden, device=device)
    for j in range(local):
        rows, slot = (recv_idx == j).nonzero(as_tuple=True)
        e = rank * local + j
        y[rows] += recv_w[rows, slot].unsqueeze(1) * expert_mlp(recv_x[rows], w1[e], w2[e])
    out, _, _ = buffer.combine(y.to(torch.bfloat16), handle)
    elapsed = time.perf_counter() - start

    dense = dense_layer(x, idx, weights, w1, w2)
    err = ((out.float() - dense).norm() / dense.norm().clamp(min=1e-9)).item()
    return dict(rank=rank, tokens=x.shape[0], sent=int(per_rank.sum()), received=recv_x.shape[0],
                per_expert=counts, rel_error=err, ms=elapsed * 1e3)


def print_table(rows, title: str):
    """rows: dicts of one rank each (the same keys), printed under title; with rich where installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    headers = list(rows[0])
    cells = [[str(r[h]) for h in headers] for r in rows]
    if Console is not None:
        table = Table(title=title)
        for h in headers:
            table.add_column(h.replace("_", " "), justify="right")
        for c in cells:
            table.add_row(*c)
        Console().print(table)
    else:
        print(title)
        for line in [headers] + cells:
            print(" | ".join(f"{c:>12}" for c in line))


def run_ranks(args, rank_fn):
    """rank_fn(args) on every rank -> every rank's result on rank 0 (None on the others). Started by
    torchrun or moe_ep.launch (RANK and WORLD_SIZE set), this process is one rank: gloo on CPU, NCCL with
    one GPU per rank. Otherwise it starts args.ranks ranks itself (under MPS where they share a GPU)."""
    if not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        with RankPool(args.ranks, use_cuda=args.device == "cuda") as pool:
            return pool.run(rank_fn, args)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        backend = "nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) <= torch.cuda.device_count() else "gloo"
    dist.init_process_group(backend)
    args.ranks = dist.get_world_size()
    row = rank_fn(args)
    rows = [None] * args.ranks
    dist.all_gather_object(rows, row)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rows if rank == 0 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run_ranks(args, moe_step)
    if rows is None:  # a rank other than 0 of a torchrun job
        return
    print_table(
        [{"rank": r["rank"], "tokens": r["tokens"], "sent (token x rank)": r["sent"], "received": r["received"],
          "tokens per local expert": r["per_expert"], "rel. error": f"{r['rel_error']:.2e}", "ms": f"{r['ms']:.1f}"}
         for r in rows],
        f"moe_ep {moe_ep.__version__}: one MoE step, {args.ranks} ranks, {args.experts} experts, top-{args.topk}, "
        f"hidden {args.hidden}, {args.device}")
    worst = max(r["rel_error"] for r in rows)
    # bf16 rounding of the expert outputs on the way back bounds the error at a few 1e-3.
    if worst > 1e-2:
        raise SystemExit(f"mismatch against the dense MoE layer: relative error {worst:.3e}")
    backend = moe_ep.backend_info()["cpu_tensors_run_on" if args.device == "cpu" else "cuda_tensors_run_on"]
    if backend.startswith("portable"):  # the ms column then says nothing of the kernels' speed
        backend += ", moe_ep's reference implementation: the ms column times it, not the CUDA kernels"
    print(f"backend: {backend}")
    print(f"OK: matches the dense MoE layer (worst relative error {worst:.2e})")


if __name__ == "__main__":
    main()
