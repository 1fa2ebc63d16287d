"""Normal calls across nodes: the internode kernels against the intranode kernels on the same ranks, in one
run. The group's ranks are cut into nodes of --nodes' shape (2x4: 2 nodes of 4 ranks); on one GPU every
"node" shares it, with NVSHMEM puts standing in for the network (no real network is crossed).

Per rank: received bytes / wall time per fresh call (host work and the count exchange included), as the
intranode benchmark counts them (bf16 rows hidden * 2 bytes, fp8 rows hidden * (1 + 4/128); combine: the
bf16 rows sent back). "network GB/s": the bytes this rank put to other nodes (Buffer.stats'
network_bytes: each token once per destination node, with its scales, top-k and routing fields) per
second. The intranode rows time the same calls on a Buffer of one node of all the ranks. The traffic table
sets the network bytes of a dispatch against a flat exchange's (one row per destination rank on another
node) and against one row per top-k pick on another node (no deduplication at all).

    python -m moe_ep.bench.internode --nodes 2x4 4x2
    python -m moe_ep.bench.internode --nodes 2x4 --group-topk 2     # each token's experts on at most 2 nodes

Under torchrun the nodes are its agents (--nnodes of --nproc-per-node ranks); the intranode rows need every
rank on one host (or CPU tensors) and are left out otherwise.
"""
from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.distributed as dist

from moe_ep import Buffer, fp8
from moe_ep.buffer import default_config_size_hints

from . import command_parser
from .intranode import add_shape_arguments
from .timing import wall_seconds_per_call
from .torchrun import host_name, joined, start_ranks

MODES = ("dispatch_fp8", "dispatch_bf16", "combine")


def node_shape(text: str):
    try:
        nodes, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NODESxRANKS_PER_NODE such as 2x4, got {text!r}") from None
    if nodes < 2 or per_node < 1:
        raise argparse.ArgumentTypeError(f"expected at least 2 nodes of at least 1 rank, got {text!r}")
    return nodes, per_node


def routing(args, num_ranks: int, ranks_per_node: int, device):
    """topk_idx [tokens, topk]: the top experts by random scores; with --group-topk G only among the
    experts of the G nodes whose best expert scores highest (group-limited routing)."""
    scores = torch.rand(args.tokens, args.experts, dtype=torch.float32, device=device)
    if args.group_topk:
        nodes = num_ranks // ranks_per_node
        by_node = scores.view(args.tokens, nodes, -1)
        chosen = by_node.amax(-1).topk(args.group_topk, dim=1).indices
        keep = torch.zeros(args.tokens, nodes, dtype=torch.bool, device=device).scatter_(1, chosen, True)
        scores = torch.where(keep.unsqueeze(-1), by_node, torch.full_like(by_node, -1.0)).view(args.tokens, -1)
    return scores.topk(args.topk, dim=1).indices


def rank_bench(args, ranks_per_node: int, with_intranode: bool = True):
    """Every mode's rows on an internode Buffer of ranks_per_node ranks a node and, with_intranode, on an
    intranode Buffer of all ranks; and this rank's traffic counts."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000 + rank)
    device = "cpu" if args.cpu else "cuda"
    topk_idx = routing(args, num_ranks, ranks_per_node, device)
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    x_fp8 = fp8.per_token_cast_to_fp8(x)
    nvl = default_config_size_hints(args.hidden * 2, num_ranks)[0]
    rdma = 0 if args.cpu else Buffer.get_internode_rdma_size_hint(args.tokens, args.hidden, num_ranks, ranks_per_node,
                                                                   args.topk)
    results = []
    buffers = [("internode", ranks_per_node)] + ([("intranode", num_ranks)] if with_intranode else [])
    for label, per_node in buffers:
        buffer = Buffer(dist.group.WORLD, nvl, rdma if per_node < num_ranks else 0, ranks_per_node=per_node,
                        explicitly_destroy=True)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk_idx, topk_weights=topk_weights)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, **layout)
        rows = recv_x.shape[0]
        y = recv_x.clone()

        def call(mode: str):
            if mode == "combine":
                return buffer.combine(y, handle, topk_weights=recv_w)
            return buffer.dispatch(x_fp8 if mode == "dispatch_fp8" else x, **layout)

        for mode in MODES:
            buffer.reset_stats(collect=False)
            seconds = wall_seconds_per_call(functools.partial(call, mode), args.warmup, args.iters)
            network = buffer.stats()["network_bytes"] / (args.warmup + args.iters)
            row_bytes = args.hidden * (1 + 4 / 128) if mode == "dispatch_fp8" else args.hidden * 2
            results.append(dict(rank=rank, buffer=label, mode=mode, us=seconds * 1e6, rows=rows,
                                gbps=rows * row_bytes / seconds / 1e9, network_bytes=network,
                                network_gbps=network / seconds / 1e9))
        buffer.destroy()
    # What leaves this rank's node: messages (one per token and destination node), rows of a flat exchange
    # (one per token and destination rank) and top-k picks.
    nodes = torch.arange(num_ranks, device=device) // ranks_per_node
    other = nodes != rank // ranks_per_node
    in_node = in_rank.view(args.tokens, -1, ranks_per_node).any(-1)
    picks = topk_idx >= 0
    pick_nodes = (topk_idx.clamp(min=0) // (args.experts // num_ranks)) // ranks_per_node
    results.append(dict(rank=rank, buffer="traffic", messages=int(in_node[:, other.view(-1, ranks_per_node)[:, 0]].sum()),
                        flat_rows=int(in_rank[:, other].sum()),
                        topk_rows=int((picks & (pick_nodes != rank // ranks_per_node)).sum())))
    return results


def node_shapes(parser, given):
    """The (nodes, ranks a node) shapes to run: --nodes, else 2x4 and 4x2; under torchrun its own, and a
    --nodes that is not it is refused."""
    world = joined()
    if world is None:
        return given or [(2, 4), (4, 2)]
    started = (world.nodes, world.local_world_size)
    if world.nodes < 2:
        parser.error(f"internode times calls across nodes, and torchrun started one node of {world.world_size} ranks: "
                     "start two agents or more (--nnodes 2, on one host or several)")
    if given and given != [started]:
        parser.error(f"--nodes {' '.join(f'{n}x{p}' for n, p in given)}: under torchrun the nodes are the "
                     f"{started[0]}x{started[1]} it started (--nnodes x --nproc-per-node); leave --nodes out")
    return [started]


def main():
    parser = command_parser(__spec__, __doc__)
    parser.add_argument("--nodes", type=node_shape, nargs="+",
                        help="NODESxRANKS_PER_NODE shapes (default 2x4 4x2; under torchrun its --nnodes x "
                             "--nproc-per-node)")
    add_shape_arguments(parser)
    parser.add_argument("--group-topk", type=int, default=0,
                        help="each token's experts on at most this many nodes (0: any)")
    parser.add_argument("--json", help="append one JSON line per (shape, buffer, mode) here")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (portable backend): checks the script anywhere")
    args = parser.parse_args()
    args.nodes = node_shapes(parser, args.nodes)
    if not args.cpu and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: no GPU here: pass --cpu (CPU tensors on the portable backend)\n")
    print(f"{'shape':>5} {'buffer':>9} {'mode':>13} {'us/call':>9} {'GB/s per rank (min/mean)':>25} "
          f"{'network GB/s':>13} {'of intranode':>13}")
    for nodes, per_node in args.nodes:
        num_ranks = nodes * per_node
        with start_ranks(num_ranks, use_cuda=not args.cpu) as pool:
            # The intranode kernels reach ranks of one host only; spawned ranks are all on this one.
            hosts = set(pool.run(host_name)) if joined() is not None else {"this host"}
            with_intranode = args.cpu or len(hosts) == 1
            flat = [r for rows in pool.run(rank_bench, args, per_node, with_intranode) for r in rows]
        shape = f"{nodes}x{per_node}"
        if not with_intranode:
            print(f"{shape:>5} intranode rows left out: the ranks are on {len(hosts)} hosts")
        means = {}
        for label in ("intranode", "internode"):
            for mode in MODES:
                rows = [r for r in flat if r["buffer"] == label and r["mode"] == mode]
                if not rows:
                    continue
                mean = sum(r["gbps"] for r in rows) / len(rows)
                means[(label, mode)] = mean
                network = sum(r["network_gbps"] for r in rows) / len(rows)
                intranode = means.get(("intranode", mode)) if label == "internode" else None
                ratio = f"{mean / intranode:.0%}" if intranode else ""
                print(f"{shape:>5} {label:>9} {mode:>13} {max(r['us'] for r in rows):>9.0f} "
                      f"{min(r['gbps'] for r in rows):>12.0f} / {mean:<10.0f} {network:>13.1f} {ratio:>13}")
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(dict(bench="internode", nodes=nodes, ranks_per_node=per_node,
                                                buffer=label, mode=mode, tokens=args.tokens, hidden=args.hidden,
                                                topk=args.topk, experts=args.experts, group_topk=args.group_topk,
                                                per_rank_gbps=[r["gbps"] for r in rows],
                                                us=[r["us"] for r in rows],
                                                network_bytes=[r["network_bytes"] for r in rows])) + "\n")
        traffic = [r for r in flat if r["buffer"] == "traffic"]
        messages, flat_rows, picks = (sum(r[k] for r in traffic) for k in ("messages", "flat_rows", "topk_rows"))
        print(f"{shape:>5} rows leaving their node per dispatch, all ranks: {messages} messages (once per node) "
              f"against {flat_rows} (once per rank, {1 - messages / max(flat_rows, 1):.0%} saved) and {picks} "
              f"(once per top-k pick, {1 - messages / max(picks, 1):.0%} saved)")


if __name__ == "__main__":
    main()
