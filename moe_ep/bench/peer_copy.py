"""Is a store into another rank's buffer slower than a load from it? Ranks on one GPU map each other's
buffers as the kernels do (--peer-memory: vmm, ipc or auto) and, all at once, move the same bytes four
ways with elementwise kernels: within their own buffer, from their buffer into the next rank's (a push), from
the next rank's buffer into theirs (a pull), and from their buffer into every other rank's, a kernel
per peer, each into its own 1/R of the peer's destination (pushes to every peer, one peer at a time:
what the one-pass dispatch does, except that it interleaves the peers row by row). The combine pushes
and the dispatch pulls; the per-phase profile shows the push taking twice the pull's time for the same
bytes (`moe-ep-bench intranode --ranks 8 --sms 24 --profile-waits`).

    python -m moe_ep.bench.peer_copy --ranks 2 4 8 --mib 256
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from moe_ep.backends.choices import PEER_MEMORY_KINDS
from moe_ep.backends.peers import device_view, map_peer_buffers
from moe_ep.sync import ArrivalGate

from . import command_parser
from .timing import wall_seconds_per_call
from .torchrun import start_ranks

MODES = ("own -> own", "own -> peer (push)", "peer -> own (pull)", "own -> every peer")


def rank_copy(args):
    """Per mode: (seconds per call, bytes each rank moves per call), every rank copying at the same time."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    size = args.mib << 20
    # Each rank's buffer: [source | destination]; rank r pushes into rank r + 1's destination and pulls
    # from rank r + 1's source, so every destination has one writer.
    gate = ArrivalGate(dist.group.WORLD, serial=0, timeout_s=60.0)  # the process's only gate
    buffers = map_peer_buffers(dist.group.WORLD, gate, 2 * size, "bench_peer_copy", args.peer_memory)
    try:
        nxt = (rank + 1) % num_ranks

        def half(r: int, which: int) -> torch.Tensor:
            return device_view(buffers.addresses[r] + which * size, size, buffers.device).view(torch.bfloat16)

        own_src, own_dst, next_src, next_dst = half(rank, 0), half(rank, 1), half(nxt, 0), half(nxt, 1)
        own_src.normal_()
        # Every peer's destination in R parts: part `rank` is this rank's, filled from part p of its source.
        part = own_src.numel() // num_ranks
        peers = [p for p in range(num_ranks) if p != rank]
        to_peers = [(own_src[p * part:(p + 1) * part], half(p, 1)[rank * part:(rank + 1) * part]) for p in peers]

        def to_every_peer():
            for src, dst in to_peers:
                torch.neg(src, out=dst)

        torch.cuda.synchronize()
        dist.barrier()
        # torch.neg: one read and one write of every element, on the SMs (a plain copy may go to a copy engine).
        calls = {
            MODES[0]: lambda: torch.neg(own_src, out=own_dst),
            MODES[1]: lambda: torch.neg(own_src, out=next_dst),
            MODES[2]: lambda: torch.neg(next_src, out=own_dst),
            MODES[3]: to_every_peer,
        }
        moved = {mode: size for mode in MODES}
        moved[MODES[3]] = len(peers) * part * own_src.element_size()
        results = {}
        for mode, fn in calls.items():
            results[mode] = (wall_seconds_per_call(fn, args.warmup, args.iters), moved[mode])
            # The pull left the next rank's source, negated, here; checked before the barrier, after
            # which the peers push into this destination.
            if mode == MODES[2] and not torch.equal(own_dst, -next_src):
                raise RuntimeError("bench_peer_copy: the pulled bytes differ from the peer's")
            dist.barrier()  # its copies are done on every rank: the next mode writes other destinations
        # The last mode left part `p` of every peer's source, negated, in part p of this rank's destination.
        for p in peers:
            if not torch.equal(own_dst[p * part:(p + 1) * part], -half(p, 0)[rank * part:(rank + 1) * part]):
                raise RuntimeError(f"bench_peer_copy: the bytes rank {p} pushed here differ from its source")
        return results
    finally:
        buffers.close()


def main():
    parser = command_parser(__spec__, __doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mib", type=int, default=256, help="bytes each rank moves per copy, in MiB")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", help="append one JSON line per (ranks, mode) here")
    parser.add_argument("--peer-memory", choices=PEER_MEMORY_KINDS, default="auto",
                        help="how the ranks map each other's buffers, as the kernels' peer_memory choice: the "
                             "virtual-memory API (vmm), CUDA IPC handles (ipc), or auto (vmm where the GPU can)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a GPU (CUDA IPC between the ranks' processes)")
    if torch.cuda.device_count() > 1:
        parser.error("measures ranks sharing one GPU: make one visible (CUDA_VISIBLE_DEVICES=0)")
    print(f"{'ranks':>5} {'mode':>20} {'us/copy (max)':>14} {'GB/s per rank (min)':>20} {'aggregate GB/s':>15}")
    for num_ranks in args.ranks:
        with start_ranks(num_ranks, use_cuda=True) as pool:
            per_rank = pool.run(rank_copy, args)
        for mode in MODES:
            seconds = [r[mode][0] for r in per_rank]
            gbps = [r[mode][1] / r[mode][0] / 1e9 for r in per_rank]
            print(f"{num_ranks:>5} {mode:>20} {max(seconds) * 1e6:>14.0f} {min(gbps):>20.0f} {sum(gbps):>15.0f}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(dict(bench="peer_copy", ranks=num_ranks, mode=mode, mib=args.mib,
                                            peer_memory=args.peer_memory,
                                            us=[s * 1e6 for s in seconds], per_rank_gbps=gbps)) + "\n")


if __name__ == "__main__":
    main()
