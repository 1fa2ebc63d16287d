"""Peer buffers: one device buffer per rank that every other rank of the group can load from and store
to (GPUs of one host over NVLink, or processes on one GPU), a device table of their addresses, and the
pinned record the kernels report failures into. Shared by the intranode and the low-latency backends.

Three ways to map them (`map_peer_buffers`): the driver's virtual-memory API (`VmmBuffers`, the default
where the GPU has it: each allocation exported as a file descriptor that the peers import), CUDA IPC
handles (`PeerBuffers`), or NVSHMEM's symmetric heap with `nvshmem_ptr` (`NvshmemBuffers`, bootstrapped
through the Buffer's process group). Stores into IPC-opened mappings are slower when many ranks
scatter rows into each other's buffers (docs/DESIGN.md, "Peer memory").
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _native
from ..sync import ArrivalGate
from .choices import kernel_choices
from .descriptors import DescriptorsUnavailable, exchange_descriptors
from .reports import read_header


class Enumerators:
    """One enum of csrc/kernels/reports.cuh by the names the extension exports: each enumerator an int
    attribute (HOST_INFO's DONE, ERROR, ...), plain ints since a call's path reads them (an IntEnum
    member costs about a microsecond a read), and name_of for the way back."""

    def __init__(self, table: Dict[str, int]):
        self.__dict__.update(table)
        self._names = {value: name for name, value in table.items()}

    def name_of(self, value: int) -> Optional[str]:
        """The enumerator of that value, or None where there is none (a record no kernel wrote)."""
        return self._names.get(value)

    def names(self) -> Tuple[str, ...]:
        """Every enumerator, in the order of their values."""
        return tuple(self._names[value] for value in sorted(self._names))


class KernelEnums:
    """The numbers the kernels report to the host by, as csrc/kernels/reports.cuh (their one definition)
    names them, from the tables an extension module exports: moe_ep._C, or the same tables read from the
    header where none is built (kernel_enums). Each table is read when first used."""

    def __init__(self, ops):
        self._ops = ops

    @functools.cached_property
    def host_info(self) -> Enumerators:
        """intranode::HostInfo: the slots of a rank's host record."""
        return Enumerators(self._ops.HOST_INFO)

    @functools.cached_property
    def kernel_id(self) -> Enumerators:
        """intranode::KernelId: the kernel a progress mark or a kernel log entry names."""
        return Enumerators(self._ops.KERNEL_IDS)

    @functools.cached_property
    def progress_mark(self) -> Enumerators:
        """intranode::ProgressMark: a progress mark is KernelId << CALL_BITS | the call number's low bits."""
        return Enumerators(self._ops.PROGRESS_MARK)

    @functools.cached_property
    def error_kind(self) -> Enumerators:
        """intranode::ErrorKind: what a failed wait waited for; the wait profile's first slots."""
        return Enumerators(self._ops.ERROR_KINDS)

    @functools.cached_property
    def profile_phase(self) -> Enumerators:
        """intranode::ProfilePhase: the wait profile's slots after the waits."""
        return Enumerators(self._ops.PROFILE_PHASES)

    @functools.cached_property
    def timeline_column(self) -> Enumerators:
        """low_latency::TimelineColumn: the columns of the low-latency kernels' timeline."""
        return Enumerators(self._ops.TIMELINE_COLUMNS)

    @functools.cached_property
    def timeline_call_kind(self) -> Enumerators:
        """low_latency::TimelineCallKind: what the timeline's CALL_KIND column holds."""
        return Enumerators(self._ops.TIMELINE_CALL_KINDS)


@functools.lru_cache(maxsize=None)
def kernel_enums() -> KernelEnums:
    """The extension's tables where it is built, else csrc/kernels/reports.cuh's read in Python: for what
    runs the Python layer with the kernels stubbed (the --stub-kernels tools, CPU tests). A Buffer's
    backends read the extension they launch (MappedBuffers.enums)."""
    try:
        return KernelEnums(_native.ops())
    except RuntimeError:
        return KernelEnums(read_header())


# The words a progress mark names each kernel by, by KernelId.
KERNEL_NAMES = {"NOTIFY": "notify (count exchange)", "DISPATCH": "dispatch", "COMBINE": "combine",
                "STREAM_COMBINE": "streaming combine", "ZERO_COPY_DISPATCH": "zero-copy dispatch",
                "ZERO_COPY_COMBINE": "zero-copy combine", "RENDEZVOUS": "rendezvous"}
# What a failed wait was waiting for, by ErrorKind.
WAITED_FOR = {
    "NOTIFY": "its token counts (dispatch)",
    "STAGED": "its tokens of dispatch window {window}",
    "RELEASED": "it to finish reading this rank's dispatch window {window} (or its rows of a combine from the "
                "dispatch arena)",
    "OPEN": "it to accept combine rows of window {window}",
    "PUSHED": "its combine rows of window {window}",
    "LOW_LATENCY_DISPATCH": "its tokens for expert {window} (low_latency_dispatch)",
    "LOW_LATENCY_COMBINE": "its rows (low_latency_combine)",
    "RING_ROOM": "it to take the combine rows in its ring of channel {window}",
    "RING_ROWS": "its combine rows of channel {window}",
    "RENDEZVOUS": "it to reach this call's {kernel} (ranks sharing a GPU start it together)",
    "INTERNODE_ARRIVE": "it to arrive at this call (internode)",
    "INTERNODE_CHUNK": "chunk {window} of its dispatch messages (internode)",
    "INTERNODE_FORWARDED": "the rows it forwards to this rank (internode dispatch)",
    "INTERNODE_PUSHED": "its combine rows for this forwarder (internode combine)",
    "INTERNODE_SUMS": "chunk {window} of its node's combine sums (internode combine)",
}
# The intranode kinds again, named short for the wait profile (IntranodeBackend.wait_profile), and
# the kernels' phases after them (ProfilePhase).
WAIT_NAMES = {"NOTIFY": "token counts", "STAGED": "staged tokens", "RELEASED": "window read", "OPEN": "window open",
              "PUSHED": "rows pushed"}
PHASE_NAMES = {"STAGE": "stage", "PULL": "pull", "PUSH": "push", "REDUCE": "reduce"}


def aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Contiguous and 16-byte aligned (the kernels move rows in 16-byte vectors)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _DeviceBytes:
    """`size` bytes at a device address, as __cuda_array_interface__ describes them to torch."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}


def device_view(address: int, size: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `size` bytes of mapped memory at `address` (this rank's buffer or a peer's).
    It does not own them: it is valid while the mapping lives."""
    return torch.as_tensor(_DeviceBytes(address, size), dtype=torch.uint8, device=device)


def _release(steps: List[Callable[[], None]]) -> None:
    """Unmaps and frees a mapping's buffers, in order, once the device is done with them."""
    try:
        torch.cuda.synchronize()
        for step in steps:
            step()
    except RuntimeError:  # at interpreter exit the CUDA context may already be gone, and with it the memory
        pass


def _kernel_name(kernel_id: int, enums: KernelEnums) -> str:
    """An intranode::KernelId in words."""
    return KERNEL_NAMES.get(enums.kernel_id.name_of(kernel_id), f"kernel {kernel_id}")


def _mark_call(value: int, enums: KernelEnums) -> int:
    """The call number's low bits a progress mark keeps (intranode::ProgressMark), of a mark or a call."""
    return value & ((1 << enums.progress_mark.CALL_BITS) - 1)


def _kernel_mark(value: int, enums: KernelEnums) -> str:
    """A progress mark (intranode::ProgressMark: KernelId, then the call number's low bits) in words."""
    if value == 0:
        return "none"
    return f"the {_kernel_name(value >> enums.progress_mark.CALL_BITS, enums)} of call {_mark_call(value, enums)}"


def kernel_progress(host, enums: KernelEnums) -> str:
    """Which of a rank's intranode kernels started and finished last, from its host record's progress
    marks: where its communication stream stands when a host wait ran out with no kernel's report."""
    slot = enums.host_info
    return (f"last kernel to start: {_kernel_mark(host[slot.KERNEL_STARTED], enums)}; "
            f"last to finish: {_kernel_mark(host[slot.KERNEL_FINISHED], enums)}")


def peer_progress(host, enums: KernelEnums) -> str:
    """What a failed intranode wait found of the peer it waited for: its last kernel to start, and
    whether that was the waited call's (then it was inside the kernel) or an earlier one's (then its
    stream never reached this call: held up by its host, an event, or SMs other kernels held)."""
    slot = enums.host_info
    mark = host[slot.ERROR_PEER_STARTED]
    if mark < 0:  # the low-latency kernels keep no marks
        return ""
    if mark == 0:
        return " It had started no kernel of this Buffer."
    if _mark_call(mark, enums) == _mark_call(host[slot.ERROR_CALL], enums):
        # Fewer blocks started than the kernel has: the rest found no SM free (other kernels held them).
        started, blocks = host[slot.ERROR_PEER_BLOCKS], host[slot.ERROR_BLOCKS]
        where = f"it was inside this call's kernel, {started} of its {blocks} blocks started"
        if started < blocks:
            where += f" (the rest found no free SM{_SHARED_GPU_HINT})"
    else:
        where = ("it had not started this call's kernel: its stream was held up before it (its host, an event "
                 f"it waited for, or no free SMs{_SHARED_GPU_HINT})")
    return (f" Its last kernel to start was {_kernel_mark(mark, enums)}, "
            f"{host[slot.ERROR_PEER_STARTED_MS] / 1000:.1f} s before the wait gave up: {where}.")


# Where ranks share a GPU, one rank's GEMM can take the SMs the others' waiting kernels leave and wait
# with them (moe_ep.mps.client_sm_share).
_SHARED_GPU_HINT = ("; where ranks share a GPU, cap each rank's SMs: moe_ep.launch --sm-share, or "
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


class MappedBuffers:
    """What every mapping shares: the address table, the host record, and the failure it reports."""

    memory = ""  # which mapping: each kind names itself ("vmm", "ipc", "nvshmem")

    def _start(self, group: dist.ProcessGroup):
        self.ops = _native.ops()
        self.enums = KernelEnums(self.ops)
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.unreachable: List[int] = []  # ranks reached through puts (no mapping: NVSHMEM only)
        self.puts_anywhere = False  # some rank of the group reaches some peer through puts
        # Ranks sharing one GPU must fit their blocks on it together: the GPU is part of each payload.
        self.device_id = str(torch.cuda.get_device_properties(self.device).uuid).encode()

    def _finish(self, group: dist.ProcessGroup, gate: ArrivalGate, pointers: List[int], device_ids: List[bytes]):
        """device_ids: every rank's GPU (device_id), from the exchange that mapped the buffers."""
        self.group = group
        self.timeout_s = gate.timeout_s
        self.ranks_on_device = device_ids.count(self.device_id)
        self.device_ids = list(device_ids)  # every rank's GPU, by rank: which peers share this one (topology)
        # The most ranks that any GPU of the group holds: what every rank must choose alike (the intranode
        # kernels' block count) rests on it, not on this GPU's own count.
        self.max_ranks_on_device = max(device_ids.count(d) for d in device_ids)
        self.pointers = torch.tensor(pointers, dtype=torch.int64, device=self.device)
        self.addresses = list(pointers)  # the same, on the host
        size = self.ops.intranode_layout(self.num_ranks, 0, 0, 0, 0)["host_info_ints"]
        self.host_info = torch.zeros(size, dtype=torch.int32, device="cpu", pin_memory=True)
        self.host = (ctypes.c_int32 * size).from_address(self.host_info.data_ptr())

    def timeout_error(self) -> Optional[TimeoutError]:
        """The failure a kernel reported, if any: a peer that did not arrive (the Buffer's ranks are
        then out of step)."""
        h, enums = self.host, self.enums
        slot = enums.host_info
        if not h[slot.ERROR]:
            return None
        window = h[slot.ERROR_WINDOW]
        waited = WAITED_FOR.get(enums.error_kind.name_of(h[slot.ERROR_KIND]), "it").format(
            window=window, kernel=_kernel_name(window, enums))
        seen = "nothing yet" if h[slot.ERROR_SEEN] < 0 else f"call {h[slot.ERROR_SEEN]}"
        return TimeoutError(
            f"moe_ep: rank {h[slot.ERROR_PEER]} did not arrive within {self.timeout_s:g} s: rank {self.rank} waited "
            f"for {waited} (call {h[slot.ERROR_CALL]}; its flag announced {seen}).{peer_progress(h, enums)} Raise "
            "MOE_EP_TIMEOUT_S if the peer is only slow; the Buffer's ranks are out of step now: create a new Buffer."
        )

    def close(self) -> None:
        """Collective: once no peer touches this rank's buffer, the finalizer unmaps and frees (NvshmemBuffers
        overrides it: NVSHMEM frees collectively)."""
        dist.barrier(group=self.group)  # no peer touches this rank's buffer any more
        self._finalizer()


class VmmBuffers(MappedBuffers):
    """The driver's virtual-memory API: each rank allocates and exports a file descriptor, which every
    peer (processes of this host) receives over a Unix socket, imports and maps."""

    memory = "vmm"

    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_bytes: int, call: str):
        """Collective: every rank of `group` makes it in the same call (named `call` in a timeout)."""
        self._start(group)
        ops = self.ops
        own, size, handle, fd = ops.vmm_alloc(num_bytes)  # zeroed before its descriptor is handed out
        releases = [functools.partial(ops.vmm_release, own, size, handle)]  # grows with each peer mapped
        self._finalizer = weakref.finalize(self, _release, releases)
        try:
            payloads, fds = exchange_descriptors(
                gate, f"{call} (mapping the peers' buffers)", fd, size.to_bytes(8, "little") + self.device_id
            )
        except DescriptorsUnavailable:
            self._finalizer()  # now, not at the next collection: the caller maps other memory instead
            raise
        finally:
            os.close(fd)
        pointers = []
        try:
            for r in range(self.num_ranks):
                if r == self.rank:
                    pointers.append(own)
                    continue
                peer_size = int.from_bytes(payloads[r][:8], "little")
                address, peer_handle = ops.vmm_import(fds[r], peer_size)
                releases.append(functools.partial(ops.vmm_release, address, peer_size, peer_handle))
                pointers.append(address)
        finally:
            for peer_fd in fds.values():
                os.close(peer_fd)
        # No rank's kernels may start waiting on a peer that is still mapping (see PeerBuffers).
        gate.exchange(f"{call} (peers' buffers mapped)", b"")
        self._finish(group, gate, pointers, [p[8:] for p in payloads])


class PeerBuffers(MappedBuffers):
    """CUDA IPC: each rank allocates, every peer opens the handle."""

    memory = "ipc"

    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_bytes: int, call: str):
        """Collective: every rank of `group` makes it in the same call (named `call` in a timeout)."""
        self._start(group)
        ops = self.ops
        own, handle = ops.ipc_alloc(num_bytes)  # zeroed before its handle is published
        # Through the store with a deadline: a rank that never makes this call is named.
        payloads = gate.exchange(f"{call} (mapping the peers' buffers)", handle + self.device_id)
        handles = [p[: len(handle)] for p in payloads]
        opened = [ops.ipc_open(h) for r, h in enumerate(handles) if r != self.rank]
        steps = [functools.partial(ops.ipc_close, ptr) for ptr in opened] + [functools.partial(ops.device_free, own)]
        self._finalizer = weakref.finalize(self, _release, steps)
        # Opening large buffers takes a while (about a second for several GB): no rank's kernels may
        # start waiting on a peer that is still mapping, or the wait's deadline runs out on it.
        gate.exchange(f"{call} (peers' buffers mapped)", b"")
        device_ids = [p[len(handle) :] for p in payloads]
        self._finish(group, gate, opened[: self.rank] + [own] + opened[self.rank :], device_ids)


# NVSHMEM has one world per process: the ranks of the group it was started for.
_nvshmem_world: Optional[List[int]] = None


def nvshmem_world() -> Optional[List[int]]:
    """The group ranks NVSHMEM was started for in this process, or None before it starts."""
    return _nvshmem_world


def bootstrap_nvshmem(group: dist.ProcessGroup, gate: ArrivalGate, symmetric_bytes: int, call: str) -> None:
    """Starts NVSHMEM once per process with one PE per rank of `group`: rank 0's unique id reaches the
    others through the process group's store (bounded wait). The symmetric heap is sized for the
    first Buffer unless NVSHMEM_SYMMETRIC_SIZE says otherwise."""
    global _nvshmem_world
    ops = _native.ops()
    ranks = dist.get_process_group_ranks(group)
    if _nvshmem_world is not None:
        if ranks != _nvshmem_world:
            raise RuntimeError(
                f"NVSHMEM runs for ranks {_nvshmem_world} in this process; a Buffer over ranks {ranks} cannot use "
                "it (one NVSHMEM world per process)"
            )
        return
    if not getattr(ops, "WITH_NVSHMEM", False):
        raise RuntimeError(f"NVSHMEM buffers: {getattr(ops, 'NVSHMEM_REASON', 'built without NVSHMEM')}")
    # Room for two Buffers of this size plus NVSHMEM's own bookkeeping, and at least 1 GiB (the heap's
    # memory is mapped as it is used, so the reservation costs address space only).
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(2 * symmetric_bytes + (256 << 20), 1 << 30)))
    unique_id = ops.nvshmem_unique_id() if dist.get_rank(group) == 0 else b""
    payloads = gate.exchange(f"{call} (NVSHMEM bootstrap)", unique_id)
    # The internode module's device calls need its own copy of NVSHMEM's device state, which only its
    # initialisation sets up; the host library behind both modules is one.
    starter = _native.internode_ops() if _native.internode_unavailable_reason() is None else ops
    starter.nvshmem_init_with_unique_id(payloads[0], dist.get_rank(group), len(ranks))
    if ops.nvshmem_pe() != dist.get_rank(group) or ops.nvshmem_num_pes() != len(ranks):
        raise RuntimeError("NVSHMEM started with PE numbers that differ from the process group's ranks")
    _nvshmem_world = ranks


class NvshmemBuffers(MappedBuffers):
    """NVSHMEM's symmetric heap: one collective allocation, peers' copies through nvshmem_ptr. The
    allocation is freed by close() (collective); a Buffer that is garbage-collected instead keeps it
    until the process ends (nvshmem_free must be called by every rank at once)."""

    memory = "nvshmem"

    def __init__(self, group: dist.ProcessGroup, gate: ArrivalGate, num_bytes: int, call: str,
                 puts_reach_all: bool = False):
        """puts_reach_all: the caller's kernels put to the peers that loads and stores cannot reach (the
        internode kernels); otherwise those peers need the low-latency kernels that put (moe_ep._internode)."""
        self._start(group)
        bootstrap_nvshmem(group, gate, num_bytes, call)
        own = self.ops.nvshmem_alloc(num_bytes)
        self.ops.device_zero(own, num_bytes)
        pointers = [own if r == self.rank else self.ops.nvshmem_peer_pointer(own, r) for r in range(self.num_ranks)]
        if kernel_choices.low_latency_puts:  # every peer through puts: the put path runs on one GPU
            pointers = [own if r == self.rank else 0 for r in range(self.num_ranks)]
        # Peers without a mapping (another host without NVLink) are reached through NVSHMEM puts, which
        # need the device library in the build.
        self.unreachable = [r for r, p in enumerate(pointers) if p == 0]
        # Whether rows are pulled or pushed is the group's choice, not a rank's: every rank learns whether
        # any rank puts (a rank that reaches all its peers may still be put to by one that does not), and
        # then every rank's kernels must put, so all learn too whose build cannot (and all raise alike).
        can_put = puts_reach_all or _native.has_nvshmem_device()
        word = (b"1" if self.unreachable else b"0") + \
            (b"1" if can_put else b"0" + str(_native.internode_unavailable_reason()).encode())
        said = gate.exchange(f"{call} (peers reached through puts)", word)
        putting = [r for r, w in enumerate(said) if w[:1] == b"1"]
        cannot = [r for r, w in enumerate(said) if w[1:2] == b"0"]
        if putting and cannot:
            self.ops.nvshmem_release(own)  # collective, like the allocation: every rank is here
            raise RuntimeError(
                f"{call}: rank(s) {putting} reach some peers only through NVSHMEM puts, so every rank's "
                f"low-latency kernels must put, and the build of rank(s) {cannot} cannot: "
                f"{said[cannot[0]][2:].decode(errors='replace')}"
            )
        self.puts_anywhere = bool(putting)
        # Every rank zeroed its part before any kernel may write to it; the GPU of each rank comes along.
        payloads = gate.exchange(f"{call} (NVSHMEM buffers ready)", self.device_id)
        self._own = own
        self._finish(group, gate, pointers, list(payloads))

    def close(self) -> None:
        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        self.ops.nvshmem_release(self._own)  # collective, like the allocation


def map_peer_buffers(group: dist.ProcessGroup, gate: ArrivalGate, num_bytes: int, call: str, memory: str):
    """Collective. memory: "vmm", "ipc", "nvshmem" or "auto", which is "vmm" where this GPU can export
    memory as file descriptors and every rank can fetch every peer's, else "ipc"; the result's `memory`
    says which one it is."""
    if memory == "auto":
        # Every rank sees the same GPUs and driver on one host, so every rank takes the same branch.
        if not _native.ops().vmm_supported():
            return PeerBuffers(group, gate, num_bytes, call)
        try:
            return VmmBuffers(group, gate, num_bytes, call)
        except DescriptorsUnavailable as e:  # raised on every rank alike
            warnings.warn(f"{e}; mapping the peers' buffers through CUDA IPC handles instead", stacklevel=2)
            return PeerBuffers(group, gate, num_bytes, call)
    if memory == "vmm" and not _native.ops().vmm_supported():
        raise RuntimeError("peer memory vmm: this GPU or driver cannot export memory as file descriptors")
    kind = {"vmm": VmmBuffers, "ipc": PeerBuffers, "nvshmem": NvshmemBuffers}[memory]
    return kind(group, gate, num_bytes, call)
