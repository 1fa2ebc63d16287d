"""What a Buffer tells about itself: the errors its kernels reported, counters of its calls, and how its
ranks reach each other. `Buffer.check_errors`, `stats`, `reset_stats` and `topology` delegate here.

The counters cost a call next to nothing: the host adds one to a dict entry per call, and the one-pass
kernels add to a device tensor that nobody reads until `stats()` asks (no host synchronisation and no
extra kernel in a call). `kernel_backend` hands benchmarks and white-box tests the kernel backend itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from . import _native

if TYPE_CHECKING:  # the Buffer imports this module
    from .buffer import Buffer

# The calls `stats()["calls"]` counts, by kind: a dispatch given a handle is a "cached_dispatch".
CALL_KINDS = ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine", "low_latency_dispatch",
              "low_latency_combine")
# The paths `topology()["peers"]` names: this rank, a peer's buffer mapped on this GPU or on another GPU
# of the host, a peer reached by NVSHMEM puts only, and a peer reached through torch.distributed.
PEER_PATHS = ("self", "same_gpu", "nvlink", "nvshmem_put", "portable")


def call_counts() -> Dict[str, int]:
    """A Buffer's host counters: every call kind at 0."""
    return dict.fromkeys(CALL_KINDS, 0)


def check_errors(buffer: "Buffer") -> None:
    """Waits for the Buffer's kernels and raises what they reported since the last call: a peer that did
    not arrive (TimeoutError naming it and what was awaited; the Buffer's ranks are then out of step) or a
    num_worst_tokens dispatch that received more rows than it had (ValueError; reported once). These are
    what the Buffer's next call would raise otherwise. The intranode kernels run on the communication
    stream, which it waits for; the low-latency kernels run on the callers' streams, so with them it waits
    for the device. On the portable backend it does nothing: its errors are raised in the call itself."""
    buffer._check_alive()
    normal, low = buffer._intranode, buffer._low_latency
    if normal is not None:
        normal.comm_stream.synchronize()
        normal.check_errors()
    if low is not None:
        torch.cuda.synchronize(low.peers.device)
        low.check_errors()


def _zero_arena() -> dict:
    return dict(capacity=0, in_use=0, high_water=0, regions=0)


def stats(buffer: "Buffer") -> dict:
    """Counters since the Buffer was made or since reset_stats():

    - "calls": {kind: calls}, for each of CALL_KINDS, counted on the host when a call passed its
      argument checks and went to a backend (internode_dispatch / internode_combine count as dispatch /
      combine).
    - "one_pass_calls": {"dispatch": n, "combine": m}: the calls (cached dispatches included) that the
      device ran in one pass through the arena, counted by the kernels; 0 without the intranode kernels
      or an arena.
    - "arena": {"capacity", "in_use", "high_water": bytes, "regions": live regions} of this rank's
      intranode arena: its size, what live recv_x and combine inputs hold now, the most they held at once
      (a one-pass dispatch counts the rows it kept), and how many regions they are. All 0 where there is
      no arena: the portable backend, num_arena_bytes=0, or before the first call of CUDA tensors maps
      it. After an arena of the Buffer's own grew, the numbers are the new arena's (tensors of the old one
      live on outside it).

    Reading the device counter waits for the communication stream (not allowed while a CUDA graph is
    being captured)."""
    one_pass = dict(dispatch=0, combine=0)
    arena = _zero_arena()
    kernels = buffer._intranode
    if kernels is not None:
        # Read on the communication stream, behind every call issued so far.
        with torch.cuda.stream(kernels.comm_stream):
            one_pass["dispatch"], one_pass["combine"] = kernels.one_pass_calls.tolist()
        if kernels.arena is not None:
            arena = kernels.arena.usage()
    return dict(calls=dict(buffer._calls), one_pass_calls=one_pass, arena=arena)


def reset_stats(buffer: "Buffer") -> None:
    """Every counter of stats() back to 0, and the arena's high-water mark down to the bytes in use now.
    The device counter is zeroed on the communication stream, after the calls issued before."""
    buffer._calls.update(call_counts())
    kernels = buffer._intranode
    if kernels is not None:
        with torch.cuda.stream(kernels.comm_stream):
            kernels.one_pass_calls.zero_()
        if kernels.arena is not None:
            kernels.arena.reset_high_water()


def _peer_paths(rank: int, num_ranks: int, kernels: bool, peers) -> List[Optional[str]]:
    """Per rank, how this rank reaches it (PEER_PATHS); None where the kernels serve but have not mapped
    the peers yet."""
    paths: List[Optional[str]] = []
    for r in range(num_ranks):
        if r == rank:
            paths.append("self")
        elif not kernels:
            paths.append("portable")
        elif peers is None:
            paths.append(None)
        elif r in peers.unreachable:
            paths.append("nvshmem_put")
        else:
            paths.append("same_gpu" if peers.device_ids[r] == peers.device_ids[rank] else "nvlink")
    return paths


def topology(buffer: "Buffer") -> dict:
    """How this Buffer's ranks are laid out and reach each other:

    - "rank", "num_ranks", "ranks_per_node", "node_of_rank" (list: each rank's node, ranks of a node
      being contiguous).
    - "normal_backend": what runs dispatch / combine of CUDA tensors: "intranode" (the kernels) or
      "portable" (torch.distributed). "low_latency_backend": the same for the low-latency calls:
      "low_latency" (the kernels), "portable", or None (no low_latency_mode: the calls are refused).
      CPU tensors always run on the portable backend.
    - "portable_reasons": {"normal": ..., "low_latency": ...}: why the kernels do not serve those calls,
      or None where they do.
    - "mapped": {"normal": bool, "low_latency": bool}: whether the kernels have mapped the peers' buffers.
      They do so lazily, at the Buffer's first call of CUDA tensors of that kind (collectively); before
      that the entries below that depend on the mapping are None.
    - "peer_memory": {"normal": ..., "low_latency": ...}: how the peers' buffers were mapped: "vmm" (the
      driver's virtual-memory API), "ipc" (CUDA IPC handles), "nvshmem" (low-latency only), or None
      (not mapped, or the portable backend). The intranode arena is mapped like the normal buffers.
    - "peers": {"normal": [...], "low_latency": [...]}: per rank, how this rank reaches it: "self",
      "same_gpu" (a mapped buffer of a rank on this GPU), "nvlink" (a mapped buffer of a rank on another
      GPU of the host), "nvshmem_put" (NVSHMEM puts only), "portable" (torch.distributed), or None
      (the kernels serve but have not mapped the peers yet). The low-latency list is None without
      low_latency_mode.
    - "ranks_on_this_gpu": ranks of the group on this rank's GPU (1 until the normal kernels mapped).
    - "build": moe_ep.backend_info(): the extension, NVSHMEM, SM90, and which backend runs what.

    It reads host state only: no communication, no synchronisation."""
    rank, num_ranks = buffer.rank, buffer.group_size
    normal, low = buffer._intranode, buffer._low_latency
    ll_mode = buffer.low_latency_mode
    normal_reason = None if buffer._kernels else buffer._kernels_unusable(low_latency=False)
    ll_reason = None if buffer._ll_kernels else buffer._kernels_unusable(low_latency=True)
    return dict(
        rank=rank,
        num_ranks=num_ranks,
        ranks_per_node=buffer.ranks_per_node,
        node_of_rank=[r // buffer.ranks_per_node for r in range(num_ranks)],
        normal_backend="intranode" if buffer._kernels else "portable",
        low_latency_backend=("low_latency" if buffer._ll_kernels else "portable") if ll_mode else None,
        portable_reasons=dict(normal=normal_reason, low_latency=ll_reason),
        mapped=dict(normal=normal is not None, low_latency=low is not None),
        peer_memory=dict(normal=normal.peers.memory if normal is not None else None,
                         low_latency=low.peers.memory if low is not None else None),
        peers=dict(normal=_peer_paths(rank, num_ranks, buffer._kernels, normal.peers if normal else None),
                   low_latency=_peer_paths(rank, num_ranks, buffer._ll_kernels, low.peers if low else None)
                   if ll_mode else None),
        ranks_on_this_gpu=buffer.ranks_on_this_gpu,
        build=_native.backend_info(),
    )


def kernel_backend(buffer: "Buffer", kind: str = "normal", make: bool = False):
    """For benchmarks and white-box tests of the kernels' measurement switches (wait profile, kernel log,
    streaming-combine ring rows, launch blocks) and of their memory: the backend object that runs this
    Buffer's calls of CUDA tensors of `kind`, "normal" (the IntranodeBackend) or "low_latency" (the
    LowLatencyBackend), or None where the portable backend serves them or no such call has made it yet.
    make=True first makes it where the kernels serve (collective: it maps the peers' buffers as the first
    call would). Its attributes are the backends' internals, not a stable API: prefer Buffer.stats() and
    Buffer.topology() wherever they answer the question."""
    if kind not in ("normal", "low_latency"):
        raise ValueError(f"kind: expected 'normal' or 'low_latency', got {kind!r}")
    buffer._check_alive()
    if make and torch.cuda.is_available():
        probe = torch.empty(0, device=torch.device("cuda", torch.cuda.current_device()))
        (buffer._normal_backend if kind == "normal" else buffer._low_latency_backend)(probe)
    return buffer._intranode if kind == "normal" else buffer._low_latency
