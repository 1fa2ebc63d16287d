"""Peer buffers: one device allocation per rank, mapped into every other rank of the group with CUDA
IPC (between GPUs of one host over NVLink, or between processes on one GPU), and the pinned record
the kernels report failures into. Shared by the intranode and the low-latency backends.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import _native
from ..sync import ArrivalGate

# host_info slots (csrc/kernels/api.cuh, intranode::HostInfo)
HOST_DONE, HOST_ERROR, HOST_ERROR_KIND, HOST_ERROR_PEER, HOST_ERROR_WINDOW, HOST_OVERFLOW = range(6)
HOST_TOTAL, HOST_MAX_TOKENS, HOST_COUNTS = 6, 7, 8
# What a failed wait was waiting for, by intranode::ErrorKind.
WAITED_FOR = {
    1: "its token counts (dispatch)",
    2: "its tokens of dispatch window {window}",
    3: "it to finish reading this rank's dispatch window {window}",
    4: "it to accept combine rows of window {window}",
    5: "its combine rows of window {window}",
    6: "its tokens for expert {window} (low_latency_dispatch)",
    7: "its rows (low_latency_combine)",
}


def aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Contiguous and 16-byte aligned (the kernels move rows in 16-byte vectors)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _release(ops, own: int, opened: List[int]) -> None:
    try:
        torch.cuda.synchronize()
        for ptr in opened:
            ops.ipc_close(ptr)
        ops.device_free(own)
    except RuntimeError:  # at interpreter exit the CUDA context may already be gone, and with it the memory
        pass


class PeerBuffers:
    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_bytes: int, call: str):
        """Collective: every rank of `group` makes it in the same call (named `call` in a timeout)."""
        self.ops = ops = _native.ops()
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_bytes = num_bytes
        self.timeout_s = gate.timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device())
        own, handle = ops.ipc_alloc(num_bytes)  # zeroed before its handle is published
        # Through the store with a deadline: a rank that never makes this call is named. Each rank
        # also says which GPU it is on: ranks sharing one must fit their blocks on it together.
        device_id = str(torch.cuda.get_device_properties(self.device).uuid).encode()
        payloads = gate.exchange(f"{call} (mapping the peers' buffers)", handle + device_id)
        handles = [p[: len(handle)] for p in payloads]
        self.ranks_on_device = sum(p[len(handle) :] == device_id for p in payloads)
        opened = [ops.ipc_open(h) for r, h in enumerate(handles) if r != self.rank]
        self._finalizer = weakref.finalize(self, _release, ops, own, opened)
        pointers = opened[: self.rank] + [own] + opened[self.rank :]
        self.pointers = torch.tensor(pointers, dtype=torch.int64, device=self.device)
        size = ops.intranode_layout(self.num_ranks, 0, 0, 0, 0)["host_info_ints"]
        self.host_info = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.host = (ctypes.c_int32 * size).from_address(self.host_info.data_ptr())

    def close(self) -> None:
        dist.barrier(group=self.group)  # no peer touches this rank's buffer any more
        self._finalizer()

    def timeout_error(self) -> Optional[TimeoutError]:
        """The failure a kernel reported, if any: a peer that did not arrive (the Buffer's ranks are
        then out of step)."""
        h = self.host
        if not h[HOST_ERROR]:
            return None
        waited = WAITED_FOR.get(h[HOST_ERROR_KIND], "it").format(window=h[HOST_ERROR_WINDOW])
        return TimeoutError(
            f"moe_ep: rank {h[HOST_ERROR_PEER]} did not arrive within {self.timeout_s:g} s: rank {self.rank} waited "
            f"for {waited}. Raise MOE_EP_TIMEOUT_S if the peer is only slow; the Buffer's ranks are out of step "
            "now: create a new Buffer."
        )
