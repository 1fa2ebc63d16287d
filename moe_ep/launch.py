"""Starting N ranks: long-lived rank processes for tests, demos and benchmarks.

`RankPool(n)` spawns n processes, each with an initialised torch.distributed process group (gloo on
CPU; on CUDA, gloo as well when several ranks share a GPU, since NCCL refuses that), and runs picklable
module-level functions on all of them on request. Starting Python and torch once per rank and reusing
the processes keeps a test suite over 2..8 ranks fast on a small machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

# A pool call that outlives this fails every rank it waits on (RankPool's call_timeout_s shortens it, as
# test runs on a machine lent for minutes do, where a stuck call would eat the whole lease).
DEFAULT_CALL_TIMEOUT_S = 600.0
# After one rank fails, how long the others get to finish before the pool is stopped.
FAILURE_GRACE_S = 10.0
# How long a stuck rank gets to write its stacks once asked (SIGUSR1) before the pool stops it.
STACK_DUMP_WAIT_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankFailure:
    """What a rank raised, carried back to the parent process."""

    rank: int
    type_name: str
    message: str
    traceback: str


class RankError(RuntimeError):
    def __init__(self, failures: List[RankFailure]):
        self.failures = failures
        first = failures[0]
        others = "".join(f"\n  rank {f.rank}: {f.type_name}: {f.message.splitlines()[0] if f.message else ''}"
                         for f in failures[1:])
        super().__init__(
            f"{len(failures)} rank(s) failed; rank {first.rank}: {first.type_name}: {first.message}\n"
            f"{first.traceback}{'the others:' + others if others else ''}"
        )


def _rank_main(rank: int, num_ranks: int, rendezvous: str, backend: str, use_cuda: bool, env: Dict[str, str], conn,
               stacks_path: str, call_timeout_s: float):
    os.environ.update(env)
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a native crash in a rank prints its Python stack instead of a bare EOF
    # A rank the parent gives up on writes where it is stuck: a hang otherwise says nothing.
    stacks = open(stacks_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=rendezvous,
        rank=rank,
        world_size=num_ranks,
        timeout=timedelta(seconds=call_timeout_s),
    )
    while True:
        message = _recv(conn)
        if message is None:
            break
        fn, args, kwargs = message
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            reply = ("err", RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc()))
        _send(conn, reply)
    dist.destroy_process_group()


# torch.save rather than multiprocessing's pickler, which would pass tensors through shared-memory
# handles that live only as long as the sending rank keeps them (and plain pickle fails on fp8).
def to_bytes(obj) -> bytes:
    """obj as bytes that from_bytes turns back into it in another process (tensors of any dtype included)."""
    import torch

    data = io.BytesIO()
    torch.save(obj, data)
    return data.getvalue()


def from_bytes(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _send(conn, obj) -> None:
    conn.send_bytes(to_bytes(obj))


def _recv(conn):
    return from_bytes(conn.recv_bytes())


class RankPool:
    def __init__(
        self,
        num_ranks: int,
        use_cuda: bool = False,
        backend: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ):
        """call_timeout_s: how long a call (and a collective inside it) may take before it fails."""
        if use_cuda:
            import torch

            if not torch.cuda.is_available():  # the ranks would each fail to pick a GPU, saying nothing clear
                raise RuntimeError("RankPool: use_cuda=True needs a GPU, and torch sees none here "
                                   "(torch.cuda.is_available() is False)")
        self._exit = contextlib.ExitStack()
        env = dict(env or {})
        shares_gpu = use_cuda and ranks_share_a_gpu(num_ranks)
        if backend is None:
            # NCCL needs one GPU per rank; several ranks per GPU talk over gloo on the host side.
            backend = "gloo" if not use_cuda or shares_gpu else "nccl"
        if shares_gpu:
            from .mps import private_mps_daemon

            env = self._exit.enter_context(private_mps_daemon(env))
        self.num_ranks = num_ranks
        self.backend = backend
        self.call_timeout_s = call_timeout_s
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        pool_dir = self._exit.enter_context(tempfile.TemporaryDirectory(prefix="moe_ep_pool_"))
        # The ranks meet at a file, not a port: a port picked free here can be taken by another process
        # before rank 0 listens on it (seen on the GPU machine as EADDRINUSE between two benchmark pools).
        rendezvous = "file://" + os.path.join(pool_dir, "rendezvous")
        self._stacks_paths = [os.path.join(pool_dir, f"rank{rank}.txt") for rank in range(num_ranks)]
        for rank in range(num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, num_ranks, rendezvous, backend, use_cuda, env, child, self._stacks_paths[rank], call_timeout_s),
                daemon=True,
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, fn: Callable, *args, timeout_s: Optional[float] = None, **kwargs) -> List[Any]:
        """fn(*args, **kwargs) on every rank; returns the per-rank results, or raises RankError."""
        return self.run_per_rank(fn, [args] * self.num_ranks, timeout_s=timeout_s, **kwargs)

    def run_per_rank(self, fn: Callable, args_per_rank, timeout_s: Optional[float] = None, **kwargs):
        """Like run, with its own arguments for each rank. When a rank fails, the others may be stuck in
        a collective it never joined: after a grace period the pool is stopped and all is reported.
        timeout_s: this call's deadline (default: the pool's call_timeout_s)."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        if not self.alive:
            raise RuntimeError("this RankPool was stopped after a failure; start a new one")
        for conn, args in zip(self._conns, args_per_rank):
            _send(conn, (fn, tuple(args), kwargs))
        name = getattr(fn, "__name__", str(fn))
        results: Dict[int, Any] = {}
        failures: List[RankFailure] = []
        deadline = time.monotonic() + timeout_s
        while len(results) < self.num_ranks:
            for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
                if rank in results:
                    continue
                message = None
                try:
                    message = _recv(conn) if conn.poll(0.05) else None
                except (EOFError, OSError):  # the rank's end closed: the process is gone
                    proc.join(timeout=5)
                if message is not None:
                    status, value = message
                    results[rank] = value
                    if status == "err":
                        failures.append(value)
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                elif not proc.is_alive():
                    results[rank] = None
                    failures.append(RankFailure(rank, "RankLost", f"exited with code {proc.exitcode} in {name}", ""))
            if len(results) < self.num_ranks and time.monotonic() > deadline:
                stuck = [rank for rank in range(self.num_ranks) if rank not in results]
                for rank, stacks in zip(stuck, self._stacks_of(stuck)):
                    where = next((line.strip() for line in stacks.splitlines() if line.strip().startswith("File")), "")
                    message = f"did not finish {name} in time" + (f"; stuck at {where}" if where else "")
                    failures.append(RankFailure(rank, "RankLost", message, stacks))
                    results[rank] = None
                self.close(force=True)
        if failures:
            failures.sort(key=lambda f: f.type_name == "RankLost")
            raise RankError(failures)
        return [results[r] for r in range(self.num_ranks)]

    def _stacks_of(self, ranks: List[int]) -> List[str]:
        """The Python stacks of the given (stuck) ranks, as faulthandler writes them on SIGUSR1."""
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        texts = []
        for rank in ranks:
            try:
                with open(self._stacks_paths[rank]) as f:
                    texts.append(f.read())
            except OSError:
                texts.append("")
        return texts

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and not force:
                try:
                    _send(conn, None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 30)
            if proc.is_alive():
                proc.kill()
        self._procs, self._conns = [], []
        self._exit.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)
        return False


def ranks_share_a_gpu(num_ranks: int) -> bool:
    import torch

    return torch.cuda.is_available() and num_ranks > torch.cuda.device_count()


def sm_share(value: str, num_ranks: int) -> int:
    """--sm-share as a percentage: auto gives each of the ranks sharing a GPU its client_sm_share."""
    if value == "auto":
        import torch

        from .mps import client_sm_share

        return client_sm_share(-(-num_ranks // max(torch.cuda.device_count(), 1)))
    if not value.isdigit() or not 1 <= int(value) <= 100:
        raise SystemExit(f"--sm-share: expected auto or a percentage from 1 to 100, got {value!r}")
    return int(value)


def sm_share_env(value: str, num_ranks: int) -> Dict[str, str]:
    """The environment that gives each rank sm_share(value, num_ranks) of its GPU (none for all of it)."""
    share = sm_share(value, num_ranks)
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)} if share < 100 else {}


def main(argv=None) -> int:
    """`python -m moe_ep.launch --nproc N script.py [args]`: N local ranks with torchrun's environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), under a private MPS daemon when more
    ranks than GPUs share this host. For several hosts use torchrun; see README."""
    parser = argparse.ArgumentParser(prog="python -m moe_ep.launch", description=main.__doc__)
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start on this host")
    parser.add_argument(
        "--mps", choices=["auto", "on", "off"], default="auto", help="auto: start MPS when ranks outnumber GPUs"
    )
    parser.add_argument(
        "--sm-share", default="auto",
        help="where ranks share a GPU: the percentage of its SMs one rank may hold at once "
             "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; auto: (R + 1) / 2R for R ranks a GPU, which training "
             "needs, see moe_ep.mps.client_sm_share; 100: no limit, which bf16 models need: their cuBLAS "
             "GEMMs went wrong under a share on an H200). A CUDA_MPS_ACTIVE_THREAD_PERCENTAGE already set wins",
    )
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    env = dict(
        os.environ,
        WORLD_SIZE=str(opts.nproc),
        LOCAL_WORLD_SIZE=str(opts.nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    # As torchrun does: ranks sharing the host's cores would otherwise oversubscribe them.
    env.setdefault("OMP_NUM_THREADS", "1")
    with contextlib.ExitStack() as stack:
        if opts.mps == "on" or (opts.mps == "auto" and ranks_share_a_gpu(opts.nproc)):
            from .mps import private_mps_daemon

            env = stack.enter_context(private_mps_daemon(env))
            for key, value in sm_share_env(opts.sm_share, opts.nproc).items():
                env.setdefault(key, value)  # a share the user set wins
            if env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100") != "100":
                from .mps import BF16_UNDER_SHARE

                print(f"moe_ep.launch: each rank may hold {env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}% of its GPU's "
                      f"SMs; {BF16_UNDER_SHARE}: for bf16 models pass --sm-share 100", file=sys.stderr)
        procs = [
            subprocess.Popen([sys.executable, opts.script, *opts.args], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
            for r in range(opts.nproc)
        ]
        codes = [p.wait() for p in procs]
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        print(f"moe_ep.launch: rank(s) {failed} failed with exit codes {[codes[r] for r in failed]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
