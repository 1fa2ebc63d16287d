"""`moe-ep-bench NAME [options]` (or `python -m moe_ep.bench NAME [options]`): runs benchmark NAME, on ranks
it starts itself, or under torchrun on torchrun's (`torchrun ... -m moe_ep.bench NAME [options]`)."""

from __future__ import annotations

import importlib
import runpy
import sys

from . import torchrun

# Name -> what it measures (the module moe_ep.bench.NAME).
BENCHMARKS = {
    "intranode": "intranode dispatch/combine bandwidth: received GB/s per rank, all ranks of one host at once, "
                 "beside DeepEP V1, NCCL, the portable backend and a device copy",
    "internode": "normal calls across nodes (ranks cut into nodes) against the intranode calls on the same ranks",
    "low_latency": "low-latency dispatch/combine latency (us a call) and bandwidth, with and without the receive "
                   "hook, beside the same peers",
    "layout": "get_dispatch_layout: kernel and whole-call time",
    "fp8": "the 1x128 FP8 cast and cast-back kernels",
    "portable": "the portable backend (torch.distributed) on CPU or GPU ranks",
    "profile": "Buffer.profile() phase times of dispatch/combine rounds on every rank (CPU or CUDA ranks)",
    "observe": "what Buffer.stats() collection and Buffer.profile() cost a round, against neither, in one run",
    "peer_copy": "plain copies into and out of a peer's mapped buffer (ranks on one GPU)",
    "trace_kernels": "device time per kernel inside the calls (torch.profiler)",
    "profile_layout_call": "host time of a layout call, piece by piece",
    "profile_low_latency_call": "host time of a low-latency call, piece by piece",
    "profile_dispatch_call": "host and device time of an intranode dispatch call, launch by launch",
    "tune": "searches SM budgets and chunk sizes; writes the fastest configs to the cache get_*_config read",
    "megatron_layer": "one megatron-core MoE layer's forward+backward with moe_ep's dispatcher (deepep) and "
                      "megatron's alltoall, same seeds, shape and ranks; their outputs compared",
    "microbatch_overlap": "a megatron training step with and without megatron's micro-batch overlap "
                          "(overlap_moe_expert_parallel_comm), same seeds and ranks",
    "ll_timeline": "where a low-latency call's time goes with ranks sharing a GPU (a MOE_EP_TIMELINE=1 build)",
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        width = max(map(len, BENCHMARKS))
        listing = "\n".join(f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items())
        print(f"usage: moe-ep-bench NAME [options]   (NAME --help for its options)\n\n{listing}")
        if argv and argv[0] not in ("-h", "--help"):
            sys.exit(f"moe-ep-bench: unknown benchmark {argv[0]!r}")
        return
    name = argv[0]
    sys.argv = [f"moe-ep-bench {name}", *argv[1:]]
    world = torchrun.launched_world()
    if world is None:
        runpy.run_module(f"moe_ep.bench.{name}", run_name="__main__", alter_sys=True)
        return
    if name in torchrun.NOT_UNDER_TORCHRUN:
        # Rank 0 says why and fails the run; the others leave quietly, since a rank that failed first would
        # have torchrun stop rank 0 before it said anything.
        if world.rank == 0:
            print(f"moe-ep-bench {name}: not under torchrun: {torchrun.NOT_UNDER_TORCHRUN[name]}; run it without "
                  "torchrun", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    # Imported, not run as __main__: the functions rank 0 hands out must be found by their module's name.
    module = importlib.import_module(f"moe_ep.bench.{name}")
    torchrun.run_benchmark(world, module.main)


if __name__ == "__main__":
    main()
