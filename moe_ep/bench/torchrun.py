"""The benchmarks under torchrun: the ranks torchrun started, one process each, in place of the ranks a
benchmark otherwise spawns on this host (moe_ep.launch.RankPool).

`torchrun ... -m moe_ep.bench NAME [options]`: rank 0 runs the benchmark's command line, so it alone
prints the tables and writes JSON lines and plots; every other rank waits for the functions rank 0 hands
out (what a spawned rank would run), runs them and sends back what they return or raise. CUDA ranks take
a GPU each (LOCAL_RANK picks it), CUDA tensors travel over NCCL and CPU tensors over gloo; without a GPU,
gloo alone. Ranks per node are torchrun's LOCAL_WORLD_SIZE (MOE_EP_RANKS_PER_NODE, where not set), so
two agents on one host act as two nodes.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional

from moe_ep.launch import DEFAULT_CALL_TIMEOUT_S, RankError, RankFailure, RankPool, from_bytes, to_bytes

# What torchrun (and python -m moe_ep.launch) sets in each process it starts.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long the other ranks wait for rank 0's next function: its own work between two (tables, plots, the
# layout benchmark's timings in one process) is not bounded by a call's timeout.
IDLE_TIMEOUT = timedelta(hours=12)
# The benchmarks that start no ranks, or need ranks sharing one GPU: why torchrun cannot run them.
NOT_UNDER_TORCHRUN = {
    "fp8": "it times kernels in one process",
    "profile_layout_call": "it times one process",
    "profile_low_latency_call": "it times one process",
    "peer_copy": "its ranks share one GPU, which torchrun's one rank a GPU cannot",
    "ll_timeline": "its ranks share one GPU (one clock for all), which torchrun's one rank a GPU cannot",
}


@dataclass(frozen=True)
class World:
    """The ranks torchrun started: this process's place among them."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


def launched_world() -> Optional[World]:
    """torchrun's world of this process, from its environment; None where torchrun did not start it."""
    if not all(os.environ.get(name) for name in TORCHRUN_VARIABLES):
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = os.environ[name]
        if not raw.isdigit():
            raise SystemExit(f"moe-ep-bench: {name}: expected a non-negative integer from torchrun, got {raw!r}")
        values[name] = int(raw)
    world = World(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
    if not 0 < world.local_world_size <= world.world_size or world.world_size % world.local_world_size:
        raise SystemExit(f"moe-ep-bench: LOCAL_WORLD_SIZE {world.local_world_size} does not divide WORLD_SIZE "
                         f"{world.world_size}: every torchrun agent must start as many ranks (--nproc-per-node)")
    return world


_joined: Optional[World] = None  # this process's world once it has joined it
_control = None  # the gloo group that the functions and their results travel on
_no_gpu_a_rank = ""  # why CUDA ranks cannot run here under torchrun, or ""


def joined() -> Optional[World]:
    """The torchrun world this process runs a benchmark in, or None (the benchmark spawns its ranks)."""
    return _joined


def run_benchmark(world: World, main: Callable[[], object]) -> None:
    """Joins torchrun's world; rank 0 runs `main` (the benchmark's command line), the others serve it."""
    import torch.distributed as dist

    _join(world)
    code = 0
    try:
        if world.rank == 0:
            try:
                code = main() or 0
            finally:
                _hand_out(None)  # the other ranks stop, whether or not the benchmark finished
        else:
            _serve()
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where torch's profiler (trace_kernels) aborted a
    # finished rank now and then on a loaded machine ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _join(world: World) -> None:
    global _joined, _control, _no_gpu_a_rank
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if world.local_world_size <= gpus:
            torch.cuda.set_device(world.local_rank)
            backend = "cpu:gloo,cuda:nccl"
        else:
            _no_gpu_a_rank = (f"torchrun started {world.local_world_size} ranks a node and this host has {gpus} "
                              "GPU(s); under torchrun every CUDA rank needs a GPU of its own (to share one, run the "
                              "benchmark without torchrun: it starts its ranks under MPS)")
    os.environ.setdefault("MOE_EP_RANKS_PER_NODE", str(world.local_world_size))
    dist.init_process_group(backend, timeout=timedelta(seconds=DEFAULT_CALL_TIMEOUT_S))
    _control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _joined = world


def _hand_out(message) -> None:
    """Rank 0: `message` (fn, per-rank args, kwargs, env; None: stop) to every other rank."""
    import torch.distributed as dist

    dist.broadcast_object_list([None if message is None else to_bytes(message)], src=0, group=_control)


def _receive():
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0, group=_control)
    return None if box[0] is None else from_bytes(box[0])


def _serve() -> None:
    """Every rank but 0: runs what rank 0 hands out until it says stop."""
    import torch.distributed as dist

    while True:
        message = _receive()
        if message is None:
            return
        fn, args_per_rank, kwargs, env = message
        reply = _call(fn, args_per_rank[_joined.rank], kwargs, env)
        dist.gather_object(to_bytes(reply), None, dst=0, group=_control)


def _call(fn, args, kwargs, env: Dict[str, str]):
    """fn(*args, **kwargs) under env -> ("ok", its result) or ("err", a RankFailure), as a spawned rank replies."""
    import traceback

    with _environment(env):
        try:
            return "ok", fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure must reach rank 0
            return "err", RankFailure(_joined.rank, type(exc).__name__, str(exc), traceback.format_exc())


@contextlib.contextmanager
def _environment(env: Dict[str, str]):
    """os.environ with env set, as it was afterwards (a spawned rank's env lives as long as its pool)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class TorchrunRanks:
    """RankPool's run / run_per_rank on torchrun's ranks, called on rank 0. A call's timeout does not apply
    here (no rank can be stopped): a rank stuck in a collective fails after the process group's timeout."""

    def __init__(self, env: Optional[Dict[str, str]] = None):
        self.env = dict(env or {})
        self.num_ranks = _joined.world_size

    def run(self, fn: Callable, *args, timeout_s: Optional[float] = None, **kwargs) -> List:
        return self.run_per_rank(fn, [args] * self.num_ranks, timeout_s=timeout_s, **kwargs)

    def run_per_rank(self, fn: Callable, args_per_rank, timeout_s: Optional[float] = None, **kwargs) -> List:
        import torch.distributed as dist

        args_per_rank = [tuple(args) for args in args_per_rank]
        _hand_out((fn, args_per_rank, kwargs, self.env))
        replies = [None] * self.num_ranks
        dist.gather_object(to_bytes(_call(fn, args_per_rank[0], kwargs, self.env)), replies, dst=0, group=_control)
        replies = [from_bytes(reply) for reply in replies]
        failures = [value for status, value in replies if status == "err"]
        if failures:
            raise RankError(failures)
        return [value for _, value in replies]

    def close(self, force: bool = False) -> None:
        pass  # the ranks are torchrun's: they serve the benchmark's next call

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def start_ranks(num_ranks: int, use_cuda: bool = False, env: Optional[Dict[str, str]] = None,
                call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
    """The ranks a benchmark runs its rank functions on: torchrun's where it started this process (their
    count must be num_ranks: the benchmarks check their options first), else num_ranks spawned here."""
    if _joined is None:
        if launched_world() is not None:
            raise SystemExit("moe-ep-bench: under torchrun, start a benchmark through moe_ep.bench: "
                             "torchrun ... -m moe_ep.bench NAME [options]")
        return RankPool(num_ranks, use_cuda=use_cuda, env=env, call_timeout_s=call_timeout_s)
    if num_ranks != _joined.world_size:
        raise ValueError(f"num_ranks: torchrun started {_joined.world_size} ranks, got {num_ranks}")
    if use_cuda and _no_gpu_a_rank:
        raise SystemExit(f"moe-ep-bench: {_no_gpu_a_rank}; or pass --cpu")
    return TorchrunRanks(env)


def add_ranks_argument(parser, default, what: str = "rank counts, each a run") -> None:
    """--ranks: the rank count (default an int) or counts (a list) a benchmark runs; left out it is None,
    which rank_counts resolves (to `default`, or under torchrun to the ranks it started)."""
    many = isinstance(default, list)
    shown = " ".join(map(str, default)) if many else default
    parser.add_argument("--ranks", type=int, nargs="+" if many else None,
                        help=f"{what} (default {shown or 'none'}; under torchrun the ranks it started)")


def rank_counts(parser, given, default, option: str = "--ranks"):
    """The rank count(s) a benchmark runs (a list where `default` is one): `given`, else `default`; under
    torchrun its world's size, and a count given that is not it is refused, naming the option."""
    if _joined is None:
        return default if given is None else given
    size = _joined.world_size
    if given is not None and list(given if isinstance(given, list) else [given]) != [size]:
        shown = " ".join(map(str, given)) if isinstance(given, list) else given
        parser.error(f"{option} {shown}: under torchrun the ranks are the {size} it started (--nnodes x "
                     f"--nproc-per-node); leave {option} out or give {size}")
    return [size] if isinstance(default, list) or isinstance(given, list) else size


def one_node_only(parser, what: str) -> None:
    """Refuses a torchrun world of several nodes for a benchmark of one node's ranks (`what` it times)."""
    if _joined is not None and _joined.nodes > 1:
        parser.error(f"{what} on the ranks of one node, and torchrun started {_joined.nodes} nodes of "
                     f"{_joined.local_world_size} ranks: run it with --nnodes 1 (moe-ep-bench internode times "
                     "calls across nodes)")


def gpus_of_the_ranks() -> int:
    """The GPUs the ranks can run on: this host's, on every node under torchrun."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count() * (_joined.nodes if _joined is not None else 1)


def host_name() -> str:
    """This rank's host (a rank function: every rank's says whether the ranks share one host)."""
    return socket.gethostname()
