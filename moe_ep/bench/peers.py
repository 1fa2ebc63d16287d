"""What the intranode and low-latency benchmarks measure beside moe_ep in the same run, with the same
shapes and ranks, and why a peer is left out where it is:

- deep_ep: DeepEP V1's Buffer (get_dispatch_layout / dispatch / combine, low_latency_dispatch / combine),
  where `import deep_ep` works (a build of DeepEP's source on PYTHONPATH), and for the low-latency calls
  where every rank has a GPU of its own (DEEP_EP_LOW_LATENCY_SHARED_GPU says why);
- nccl: torch.distributed.all_to_all_single moving the same bytes per rank pair, where every rank has a
  GPU of its own (NCCL refuses several ranks on one GPU);
- portable: moe_ep's own calls on the portable backend (MOE_EP_BACKEND=portable), where moe_ep itself
  runs on the kernels and the shape is small enough for the host to move in a few seconds;
- copy: every rank at once copying the bytes it moves within its own device memory, the ceiling.

Ratios are moe_ep's rate over the peer's (GB/s over GB/s, or the peer's time over moe_ep's): above 1,
moe_ep is faster.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

DEEP_EP, NCCL, PORTABLE, COPY = "deep_ep", "nccl", "portable", "copy"
PEERS = (DEEP_EP, NCCL, PORTABLE, COPY)
MOE_EP = "moe_ep"
# Above this many bytes of bf16 input rows a rank, the portable peer is left out unless asked for: it
# moves every row through the host, a call taking tens of milliseconds at the benchmarks' default shape.
PORTABLE_CHEAP_BYTES = 16 << 20
# DeepEP's low-latency mode starts NVSHMEM with its InfiniBand GPUDirect Async transport forced on
# (NVSHMEM_IB_ENABLE_IBGDA=1, whatever the caller set), which does not start for ranks sharing a GPU: the
# peer's ranks would wait out --peer-timeout at their first call instead.
DEEP_EP_LOW_LATENCY_SHARED_GPU = ("{ranks} ranks share {gpus} GPU(s): DeepEP's low-latency mode starts NVSHMEM's "
                                  "IBGDA transport, which needs a GPU a rank (run with one rank per GPU)")


def add_peer_arguments(parser) -> None:
    """The options that choose the peers (the intranode and the low-latency benchmark's)."""
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                        help="what to measure beside moe_ep in the same run, each where it can run (default: all; "
                             "--peers alone: none)")
    parser.add_argument("--portable-any-size", action="store_true",
                        help=f"time the portable peer above {PORTABLE_CHEAP_BYTES >> 20} MiB of bf16 rows a rank too")
    parser.add_argument("--peer-timeout", type=float, default=120.0,
                        help="seconds a peer's ranks may take before the peer is reported as failed (and, having "
                             "hung, is not tried again in the run); under torchrun the peers run on its ranks, "
                             "bounded by the process group's timeout instead")


def deep_ep_missing() -> str:
    """Why `import deep_ep` fails here, or ""."""
    try:
        import deep_ep  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken build raises more than ImportError
        return f"import deep_ep failed ({type(e).__name__}: {e}): build DeepEP V1 and put it on PYTHONPATH"
    return ""


def moe_ep_on_portable() -> str:
    """Why moe_ep's CUDA calls run on the portable backend here (then it is no peer of itself), or ""."""
    from moe_ep import _native

    if _native.requested_backend() == "portable":
        return "MOE_EP_BACKEND=portable"
    return _native.unavailable_reason() or ""  # asks no GPU: this process makes no CUDA context


def skip_reasons(args, num_ranks: int, num_gpus: int, input_bytes: int,
                 deep_ep_check: Callable[[], str] = deep_ep_missing,
                 portable_check: Callable[[], str] = moe_ep_on_portable,
                 given_up: Optional[Dict[str, str]] = None, low_latency: bool = False) -> Dict[str, str]:
    """{peer: why it is not measured in this run at num_ranks ranks} for every peer of PEERS ("" where it
    is measured); input_bytes: a rank's bf16 input rows; given_up: {peer: why} of peers that hung earlier;
    low_latency: the peers of the low-latency calls (else of the normal ones)."""
    reasons = {}
    on_portable = portable_check() if PORTABLE in args.peers and not args.cpu else ""
    for peer in PEERS:
        if peer not in args.peers:
            reasons[peer] = "not asked for (--peers)"
        elif given_up and peer in given_up:
            reasons[peer] = given_up[peer]
        elif peer == DEEP_EP:
            if args.cpu:
                reasons[peer] = "CPU ranks (--cpu): DeepEP's calls take CUDA tensors"
            else:
                reasons[peer] = deep_ep_check()
                if not reasons[peer] and low_latency and num_ranks > num_gpus:
                    reasons[peer] = DEEP_EP_LOW_LATENCY_SHARED_GPU.format(ranks=num_ranks, gpus=num_gpus)
        elif peer == NCCL:
            if args.cpu:
                reasons[peer] = "CPU ranks (--cpu): NCCL moves CUDA tensors"
            elif num_ranks > num_gpus:
                reasons[peer] = (f"{num_ranks} ranks share {num_gpus} GPU(s): NCCL refuses several ranks on one GPU "
                                 "(run with one rank per GPU)")
            else:
                reasons[peer] = ""
        elif peer == PORTABLE:
            if args.cpu:
                reasons[peer] = "CPU ranks (--cpu): moe_ep itself ran on the portable backend"
            elif on_portable:
                reasons[peer] = f"moe_ep itself ran on the portable backend ({on_portable})"
            elif input_bytes > PORTABLE_CHEAP_BYTES and not args.portable_any_size:
                reasons[peer] = (f"{input_bytes / 2**20:.0f} MiB of bf16 rows a rank, above the "
                                 f"{PORTABLE_CHEAP_BYTES >> 20} MiB it is timed at by default (--portable-any-size)")
            else:
                reasons[peer] = ""
        else:
            reasons[peer] = ""
    return reasons


def run_in_own_ranks(fn, args_for_ranks: tuple, num_ranks: int, use_cuda: bool, timeout_s: float,
                     env: Optional[Dict[str, str]] = None) -> Tuple[List, str]:
    """fn(*args_for_ranks) on num_ranks fresh ranks of their own (under torchrun: on its ranks, with no
    timeout) -> (per-rank results, "") or ([], why it failed): a peer that fails or hangs is reported, and
    moe_ep's figures of the run stand."""
    from moe_ep.launch import RankError

    from .torchrun import start_ranks

    try:
        with start_ranks(num_ranks, use_cuda=use_cuda, env=env, call_timeout_s=timeout_s) as pool:
            return pool.run(fn, *args_for_ranks), ""
    except (RankError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [], f"failed: {first}"


def note_hangs(reasons: Dict[str, str], given_up: Dict[str, str], where: str) -> None:
    """Records in given_up each peer whose ranks did not finish in time (`where`: the problem it hung on):
    one that hangs would most likely hang again, and each try costs --peer-timeout."""
    for peer, reason in reasons.items():
        if "did not finish" in reason and peer not in given_up:
            given_up[peer] = f"not tried again: it did not finish in time at {where}"


def ratio(ours: Optional[float], theirs: Optional[float]) -> Optional[float]:
    """ours / theirs, or None where either was not measured (or theirs is zero)."""
    if ours is None or not theirs:
        return None
    return ours / theirs


def shown_ratio(value: Optional[float]) -> str:
    return f"{value:.3g}x" if value is not None else "-"
