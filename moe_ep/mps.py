"""A private CUDA MPS daemon for several ranks on one GPU.

Without MPS the kernels of different processes on one GPU are time-sliced, so a spin-wait on a flag
another rank sets costs milliseconds per round trip instead of microseconds (measured on an H200:
4.5 ms against 1.5 us for an NVSHMEM ping-pong). The daemon must run before the rank processes touch
CUDA; its pipe directory travels to them through the environment.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

# What several NVSHMEM PEs on one GPU need, and what the shared machines require (no NVLink multicast).
MULTI_PE_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NVSHMEM_DISABLE_NCCL": "1",
    "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def client_sm_share(ranks_per_gpu: int) -> int:
    """The percentage of a GPU's SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) that one of ranks_per_gpu
    training ranks may hold at once, so that its kernels always leave the other ranks' communication
    kernels their SMs: (R + 1) / 2R, 62% for four ranks.

    The intranode kernels keep their blocks resident while they wait for peers, each rank's on about
    1 / 2R of the SMs at most (their launch fits 2R of them on the GPU, one block an SM in the shapes
    tried first). Without a share, one rank's persistent
    GEMM (cuBLAS sizes its grid to the whole GPU, and its blocks can wait on each other) took the SMs the
    others' waiting kernels left, could not place the rest of its blocks, and never reached the call
    those kernels waited for: megatron training with four ranks on one H200 stalled until a kernel's
    deadline, one rank's combine with 8 of its 16 blocks placed (`scripts/train_check.sh`).
    With a share, a rank's grids fit in what the others' kernels leave. The share limits how many SMs a
    rank holds, not which: the other half of the fix is that a combine's grid takes SMs only once every
    rank reached the call (the intranode rendezvous kernel; DESIGN.md, "Synchronisation"), without which
    eight ranks under this share still stalled. With the rendezvous, training with 4 and 8 ranks on one
    H200 also ran without a share (4 runs of 4 under `python -m moe_ep.launch --sm-share 100`); the
    share stays as a guard for the waits the rendezvous does not cover."""
    return 100 if ranks_per_gpu <= 1 else (100 * (ranks_per_gpu + 1)) // (2 * ranks_per_gpu)


def process_sm_share(env: Optional[Dict[str, str]] = None) -> int:
    """This process's SM share in percent (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, rounded up), 100 where none
    is set or the value is not a percentage. Under a share CUDA reports only the share's SMs, and the
    intranode kernels' residency check needs the whole GPU's too (estimated from the two). A share the
    daemon sets for every client is not visible here: the check then takes the reported SMs for the
    whole GPU, which refuses more SM budgets than need be, never fewer."""
    env = os.environ if env is None else env
    try:
        share = math.ceil(float(env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")))
    except ValueError:
        return 100
    return share if 1 <= share <= 100 else 100


# Measured on one H200 (torch 2.11 + CUDA 13.0, 2026-12-02): under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75,
# cuBLAS bf16 GEMMs of 1000-8192 x 1024 x 2816 came back wrong (max error 0.9 of the largest value, or
# NaN) while float32 ones were exact, and the same bf16 GEMMs without a share were right.
BF16_UNDER_SHARE = ("bf16 GEMMs (cuBLAS) under an MPS SM share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) returned "
                    "wrong values and NaN on an H200, where float32 ones and bf16 ones without a share were right")


def bf16_share_warning(bf16: bool, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """What to tell a bf16 training program whose process runs under an MPS SM share; None otherwise."""
    share = process_sm_share(env)
    if not bf16 or share >= 100:
        return None
    return (f"moe_ep: this rank computes in bf16 under an SM share of {share}%: {BF16_UNDER_SHARE}. Check "
            "your losses, or start the ranks without a share (python -m moe_ep.launch --sm-share 100).")


def missing_sm_share(ranks_on_gpu: int, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """What to tell a training program whose ranks share a GPU with no SM share in their environment
    (None where they do not share one, or a share is set): it can stall as client_sm_share says."""
    env = os.environ if env is None else env
    if ranks_on_gpu <= 1 or "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in env:
        return None
    return (f"moe_ep: {ranks_on_gpu} ranks share this GPU and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is not set: "
            "a rank's GEMMs can take the SMs the other ranks' waiting communication kernels need, and training "
            "can then stall until a kernel's deadline (TimeoutError). Start the ranks with python -m moe_ep.launch, "
            f"or set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={client_sm_share(ranks_on_gpu)} in their environment "
            "(unless your MPS daemon sets a default share).")


def mps_control_binary() -> Optional[str]:
    found = shutil.which("nvidia-cuda-mps-control")
    if found:
        return found
    fallback = "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
    return fallback if os.access(fallback, os.X_OK) else None


def mps_active() -> bool:
    """An MPS daemon this process would connect to is already running (ours or the user's)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


@contextmanager
def private_mps_daemon(env: Optional[Dict[str, str]] = None) -> Iterator[Dict[str, str]]:
    """Starts a daemon in fresh directories unless one is active; yields the environment for ranks
    (also applied to os.environ while the context is open); stops the daemon on exit."""
    env = dict(env) if env is not None else os.environ
    for key, value in MULTI_PE_ENV.items():
        env.setdefault(key, value)
    binary = mps_control_binary()
    if binary is None or mps_active():
        yield env
        return
    pipe, log = tempfile.mkdtemp(prefix="mps-pipe."), tempfile.mkdtemp(prefix="mps-log.")
    env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"] = pipe, log
    daemon_env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
    subprocess.run([binary, "-d"], env=daemon_env, check=True)
    try:
        yield env
    finally:
        subprocess.run(
            [binary], input=b"quit\n", env=daemon_env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        shutil.rmtree(pipe, ignore_errors=True)
