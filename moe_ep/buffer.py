"""Buffer: the public entry point, call-compatible with deep_ep.Buffer (V1).

The Buffer checks every argument where the user's data enters, keeps the handles honest, and hands
each stage to a backend: CPU tensors run on the portable backend (torch.distributed); CUDA tensors run
on the compiled kernels where they are built, and on the portable backend otherwise.
"""

from __future__ import annotations

import atexit
import difflib
import functools
import inspect
import json
import os
import socket
import warnings
import weakref
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _native, diagnostics, ib_traffic
from .backends import forms
from .backends.base import (Backend, CombineCall, DispatchCall, LowLatencyCombineCall, LowLatencyDispatchCall,
                            refuse_capture_on_the_kernels)
from .backends.choices import kernel_choices
from .backends.internode import InternodeBackend, InternodeDispatchState
from .backends.internode import rdma_size_hint as internode_rdma_size_hint
from .backends.intranode import IntranodeBackend, IntranodeDispatchState
from .backends.low_latency import LowLatencyBackend, LowLatencyKernelState
from .backends.portable import PortableBackend, dispatch_layout
from .checks import (FP8_BLOCK, check_distinct_expert_ids, check_expert_ids, check_fp8_pair, check_int, check_num_sms,
                     check_tensor, debug_checks_enabled)
from .config import NUM_MAX_NVL_PEERS, NUM_MAX_TOPK, Config, combine_config, dispatch_config, low_latency_rdma_size_hint
from .events import EventOverlap, capture_current_stream, finish_event, wait_previous
from .handles import DispatchHandle, LowLatencyHandle
from .profiling import Profile, profiling_requested
from .shrink import RankMask, SurvivorExchange
from .slow_ranks import SlowRanks, slow_rank_settings
from .sync import ArrivalGate, check_timeout, construction_gate, next_buffer_serial, timeout_seconds

topk_idx_t = torch.int64
_CONSTRUCTION = "Buffer construction (host names)"
INT32_MAX = 2**31 - 1
_NO_SHRINK = ("{call} needs a Buffer created with enable_shrink=True (without it there is no mask of ranks: every "
              "rank of the group takes part in every call)")
HIDDEN_DTYPES = (torch.bfloat16, torch.float32)
XLike = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# Every Buffer alive, for _let_go_of_destroyed_groups.
_buffers = weakref.WeakSet()


@atexit.register
def _let_go_of_destroyed_groups() -> None:
    """At exit, once the process groups were destroyed, the Buffers still alive (a script's globals) let go
    of what they hold, their group among it: a gloo group that outlived destroy_process_group() and met
    its end in the interpreter's own teardown aborted the process now and then (4 runs in 25 of a
    two-rank script; a bare reference to the group does the same without moe_ep)."""
    if dist.is_available() and not dist.is_initialized():
        for buffer in list(_buffers):
            buffer.__dict__.clear()


class Buffer:
    """Communication buffers of one expert-parallel group.

    Arguments are deep_ep's. `allow_nvlink_for_low_latency_mode`, `allow_mnnvl`, `use_fabric` and
    `num_qps_per_rank` tune transports moe_ep chooses by itself; they are accepted and checked for type
    only. `enable_shrink=True`: low-latency calls mask a rank that does not arrive within the timeout instead
    of raising, and go on without it (docs/RELIABILITY.md); they then run on the portable backend.
    `comm` (an mpi4py communicator in deep_ep) is ignored beside a `group`, and without one raises
    NotImplementedError: moe_ep bootstraps through a torch.distributed group. deep_ep's `runtime`
    (its C++ object) has no counterpart.
    (ext) `ranks_per_node`: ranks that share a host's NVLink domain; default: env MOE_EP_RANKS_PER_NODE,
    else the group's ranks on this host, found by host names.
    (ext) `num_arena_bytes`: the arena the intranode kernels map on every rank of one host. A dispatch
    stores each received row once, at its final place in a region of the receiver's arena that recv_x
    owns like any tensor, and a combine sums the expert outputs where they lie in the arenas (write them
    into `empty_combine_input(handle, hidden)`): one pass over memory instead of two. A call takes the
    one-pass path where every rank has room for it (the kernels find out on the device, without a host
    round trip), else the two-pass path through the num_nvl_bytes buffer, as under CUDA-graph capture.
    None (default): an arena of num_nvl_bytes that grows after a dispatch finds no room; 0: none (every
    call two-pass); a size: that arena, fixed (moe_ep.config.arena_bytes sizes one; the same on every
    rank).
    (ext) `timeout_s`: seconds to wait for a peer before TimeoutError; default: env MOE_EP_TIMEOUT_S,
    else 100.
    (ext) `ib_service_level` (0-15), `ib_traffic_class` (0-255): the InfiniBand service level and RoCE
    traffic class of NVSHMEM's traffic between nodes (NVSHMEM_IB_SL, NVSHMEM_IB_TRAFFIC_CLASS, set at
    construction for NVSHMEM to read when it starts); default: env MOE_EP_IB_SL / MOE_EP_IB_TRAFFIC_CLASS,
    else NVSHMEM's own. A conflicting NVSHMEM_* variable raises ValueError (moe_ep.ib_traffic).
    """

    num_sms = 20

    def __new__(cls, *args, **kwargs):
        """Arguments that bind to no parameter of __init__ (an unknown keyword, one too many) fail before
        __init__ runs, so they are refused here, at the construction meeting as a bad value is: the peers
        raise naming this rank at once, and every rank's count of the group's Buffers stays the same.
        copy and pickle call it without arguments: nothing to bind then."""
        try:
            if args or kwargs:
                _init_signature(cls).bind(None, *args, **kwargs)
        except TypeError as exc:
            message = _unbound_message(cls, exc, kwargs)
            group = args[0] if args else kwargs.get("group")
            if isinstance(group, dist.ProcessGroup):
                construction_gate(group).refuse(_CONSTRUCTION, f"TypeError: {message}")
            raise TypeError(message) from None
        return super().__new__(cls)

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
        *,
        ranks_per_node: Optional[int] = None,
        num_arena_bytes: Optional[int] = None,
        timeout_s: Optional[float] = None,
        ib_service_level: Optional[int] = None,
        ib_traffic_class: Optional[int] = None,
    ):
        if group is None and comm is not None:
            raise NotImplementedError(
                "comm: moe_ep bootstraps through a torch.distributed ProcessGroup, not an mpi4py communicator; "
                "pass group= (a group over the same ranks, e.g. dist.new_group) instead"
            )
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}"
                + (
                    " (moe_ep bootstraps through a process group; comm= is accepted but unused)"
                    if comm is not None
                    else ""
                )
            )
        self.group = group
        _buffers.add(self)
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        meeting = construction_gate(group)
        try:
            timeout_s, requested_ranks_per_node, self._backend, profiled, slow_ranks = self._check_construction(
                num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, num_arena_bytes, timeout_s, ranks_per_node,
                dict(low_latency_mode=low_latency_mode, explicitly_destroy=explicitly_destroy,
                     allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode, allow_mnnvl=allow_mnnvl,
                     use_fabric=use_fabric, enable_shrink=enable_shrink))
            # NVSHMEM's network variables, checked before any rank communicates.
            self.ib_traffic = ib_traffic.resolve(dict(ib_service_level=ib_service_level,
                                                      ib_traffic_class=ib_traffic_class),
                                                 os.environ, ib_traffic.nvshmem_started())
        except Exception as exc:
            # The peers raise naming this rank at once, and the group's Buffers stay in step.
            meeting.refuse(_CONSTRUCTION, f"{type(exc).__name__}: {exc}")
            raise
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.num_arena_bytes = num_arena_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        index = meeting.calls  # this Buffer's place among the group's Buffers, the same on every rank
        self.debug_checks = debug_checks_enabled()
        self.ranks_per_node = self._agree_on_construction(meeting, timeout_s, requested_ranks_per_node)
        ib_traffic.apply(self.ib_traffic, os.environ)  # the ranks agree on them: NVSHMEM reads them when it starts
        self.serial = next_buffer_serial()
        self.timeout_s = timeout_s
        self._gate = ArrivalGate(group, f"buffer{index}", self.timeout_s, slow_ranks=SlowRanks(self.rank, *slow_ranks))
        self._mask = RankMask(self.group_size) if enable_shrink else None
        survivors = SurvivorExchange(self._gate, self._mask) if enable_shrink else None
        self._portable = PortableBackend(group, self._gate, self.ranks_per_node, survivors)
        self._intranode: Optional[IntranodeBackend] = None  # made at the first dispatch of CUDA tensors
        self._internode: Optional[InternodeBackend] = None  # ... where the group spans several nodes
        self._kernels = self._kernels_serve(low_latency=False) if not low_latency_mode or num_nvl_bytes else False
        self._low_latency: Optional[LowLatencyBackend] = None  # made at the first low-latency CUDA dispatch
        self._ll_kernels = self._low_latency_kernels_serve() if low_latency_mode else False
        self._comm_stream: Optional[torch.cuda.Stream] = None  # made when first needed: CPU-only ranks
        # on a GPU machine must not start a CUDA context
        # Host time per call (the 2-rank dispatch is bound by it): the default Configs, made once per SM
        # budget (a Config checks its fields when made), and the (row bytes, Config sizes) found to fit.
        self._default_configs: Dict[Tuple[str, int], Config] = {}
        self._sizes_that_fit: Dict[tuple, Tuple[int, int]] = {}  # -> the (nvl, rdma) bytes they need
        self._destroyed = False
        self._local_buffers = {}
        # (tokens, hidden, experts) the low-latency buffer was checked for -> the bytes they need
        self._ll_shapes_that_fit: Dict[Tuple[int, int, int], int] = {}
        self._calls = diagnostics.call_counts()  # calls by kind, for stats()
        self._traffic = diagnostics.Traffic(self.rank, self.group_size)  # tokens and bytes, for stats()
        # The Profile recording this Buffer's calls (None: none records, and a call checks only this).
        self._profile: Optional[Profile] = Profile(self) if profiled else None

    # ------------------------------------------------------------------ construction helpers
    def _check_construction(self, num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, num_arena_bytes, timeout_s,
                            ranks_per_node, flags: Dict[str, object]):
        """This rank's own checks of the construction arguments and of the environment they default
        to -> (timeout_s, ranks_per_node or None to find from host names, MOE_EP_BACKEND, MOE_EP_PROFILE,
        MOE_EP_SLOW_RANK_MS's threshold and whether to log)."""
        check_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
        check_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
        check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
        if num_arena_bytes is not None:
            check_int("num_arena_bytes", num_arena_bytes, minimum=0)
        timeout_s = timeout_seconds() if timeout_s is None else check_timeout("timeout_s", timeout_s)
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        if ranks_per_node is None and os.environ.get("MOE_EP_RANKS_PER_NODE"):
            raw = os.environ["MOE_EP_RANKS_PER_NODE"]
            if not raw.isdigit():
                raise ValueError(f"MOE_EP_RANKS_PER_NODE: expected a positive integer, got {raw!r}")
            ranks_per_node = int(raw)
        if ranks_per_node is not None:
            check_int("ranks_per_node", ranks_per_node, minimum=1)
            if self.group_size % ranks_per_node != 0:
                raise ValueError(f"ranks_per_node: must divide the group size {self.group_size}, got {ranks_per_node}")
        return timeout_s, ranks_per_node, _native.requested_backend(), profiling_requested(), slow_rank_settings()

    def _agree_on_construction(self, meeting: ArrivalGate, timeout_s: float, ranks_per_node: Optional[int]) -> int:
        """The construction's meeting, bounded by timeout_s: every rank's host name and the arguments
        the ranks must share -> ranks_per_node. Every rank decides from the same answers, so all raise
        alike where they disagree."""
        shared = dict(num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=self.num_rdma_bytes,
                      num_arena_bytes=self.num_arena_bytes, low_latency_mode=self.low_latency_mode,
                      enable_shrink=self.enable_shrink,
                      # Under MOE_EP_DEBUG=1 the kernel calls meet at the arrival gate: on every rank or none.
                      MOE_EP_DEBUG=self.debug_checks,
                      **{setting.argument: self.ib_traffic.get(setting.nvshmem_variable)
                         for setting in ib_traffic.SETTINGS},
                      # Calls without config= use these, and every rank's kernels must run alike: a config
                      # cache (moe-ep-bench tune) present on some hosts only would split them.
                      default_configs=[repr(Buffer.get_dispatch_config(self.group_size)),
                                       repr(Buffer.get_combine_config(self.group_size))])
        mine = json.dumps(dict(host=socket.gethostname(), ranks_per_node=ranks_per_node, **shared)).encode()
        everyone = [json.loads(p) for p in meeting.exchange(_CONSTRUCTION, mine, timeout_s)]
        hosts = [e["host"] for e in everyone]
        # ranks_per_node as each rank resolves it: its given value, else its host's count of ranks.
        resolved = [hosts.count(hosts[r]) if e["ranks_per_node"] is None else e["ranks_per_node"]
                    for r, e in enumerate(everyone)]
        for name, values in (("ranks_per_node", resolved), *((n, [e[n] for e in everyone]) for n in shared)):
            if len(set(map(json.dumps, values))) > 1:
                if name == "default_configs":
                    raise ValueError(
                        f"config: the ranks' default dispatch / combine configs disagree ({_by_rank(values)}): "
                        "the config cache (MOE_EP_CONFIG_CACHE, written by moe-ep-bench tune) or Buffer.set_num_sms "
                        "differs between ranks; give every host the same cache, or none")
                raise ValueError(f"{name}: the ranks disagree ({_by_rank(values)}); every rank of the group must "
                                 "make its Buffer with the same value")
        per_node = resolved[0]
        contiguous = all(hosts[r] == hosts[r - r % per_node] for r in range(self.group_size))
        if any(e["ranks_per_node"] is None for e in everyone) and not (self.group_size % per_node == 0 and contiguous):
            raise ValueError(
                "ranks_per_node: the group's ranks are not spread evenly and contiguously over hosts "
                f"(hosts by rank: {hosts}); pass ranks_per_node explicitly"
            )
        return per_node

    def _kernels_unusable(self, low_latency: bool) -> Optional[str]:
        """Why the kernels cannot serve this Buffer's normal (or low-latency) calls of CUDA tensors, or
        None: they need the extension and a GPU, for a group that spans nodes the internode module (NVSHMEM's
        device library), for the normal calls of one node no more ranks than the kernels take (the
        extension's INTRANODE_MAX_RANKS), and the buffer the call uses."""
        if self._backend == "portable":
            return "MOE_EP_BACKEND=portable"
        reason = _native.unavailable_reason()
        if reason is not None:
            return reason
        if self._spans_nodes:
            nodes = f"the group spans {self.group_size // self.ranks_per_node} nodes of {self.ranks_per_node} ranks"
            reason = _native.internode_unavailable_reason()
            if reason is not None:
                return f"{nodes} and {reason}"
            if not low_latency:
                return None
        if low_latency:
            if not self.low_latency_mode or self.num_rdma_bytes == 0:
                return "low-latency calls need low_latency_mode=True and num_rdma_bytes > 0"
        else:
            max_ranks = _native.ops().INTRANODE_MAX_RANKS  # the extension is loaded: reason is None
            if self.group_size > max_ranks or self.num_nvl_bytes == 0:
                return f"normal calls need num_nvl_bytes > 0 and at most {max_ranks} ranks"
        return None

    def _kernels_serve(self, low_latency: bool) -> bool:
        """Whether CUDA tensors of normal (low-latency) calls run on the kernels; under MOE_EP_BACKEND=kernels
        a RuntimeError names why they cannot."""
        reason = self._kernels_unusable(low_latency)
        if reason is not None and self._backend == "kernels":
            raise RuntimeError(f"MOE_EP_BACKEND=kernels: the kernels cannot serve this Buffer's "
                               f"{'low-latency' if low_latency else 'normal'} calls: {reason}")
        return reason is None

    def _low_latency_kernels_serve(self) -> bool:
        """Whether CUDA tensors of low-latency calls run on the kernels: not in shrink mode, whose masking
        only the portable backend does (a warning says so where the kernels would have served)."""
        serve = self._kernels_serve(low_latency=True)
        if not (serve and self.enable_shrink):
            return serve
        if self._backend == "kernels":
            raise RuntimeError("MOE_EP_BACKEND=kernels: the low-latency kernels have no shrink mode; pass "
                               "enable_shrink=False, or let low-latency calls run on the portable backend")
        warnings.warn("moe_ep: enable_shrink=True: low-latency calls of CUDA tensors run on the portable backend "
                      "(the low-latency kernels have no shrink mode), which is slower", RuntimeWarning, stacklevel=3)
        return False

    @property
    def _spans_nodes(self) -> bool:
        """Whether the group's ranks sit on several nodes (its normal calls then run the internode kernels)."""
        return self.ranks_per_node != self.group_size

    def _normal_backend(self, x: torch.Tensor) -> Backend:
        """The backend that moves x in normal calls; the first time the kernels do, maps the peers'
        buffers (every rank of the group makes the same call with tensors of the same kind, so this is
        collective)."""
        if not (x.is_cuda and self._kernels):
            return self._portable
        if self._spans_nodes:
            if self._internode is None:
                self._internode = InternodeBackend(self.group, self._gate, self.num_rdma_bytes, self.ranks_per_node,
                                                   self.get_comm_stream())
            return self._internode
        if self._intranode is None:
            auto = self.num_arena_bytes is None
            self._intranode = IntranodeBackend(self.group, self._gate, self.num_nvl_bytes, self.get_comm_stream(),
                                               self.num_nvl_bytes if auto else self.num_arena_bytes, arena_grows=auto)
        return self._intranode

    def _low_latency_backend(self, x: torch.Tensor) -> Backend:
        """The backend that moves x in low-latency calls (collective the first time, as _normal_backend)."""
        if not (x.is_cuda and self._ll_kernels):
            return self._portable
        if self._low_latency is None:
            memory = kernel_choices.low_latency_memory
            if memory == "auto" and self._spans_nodes:
                memory = "nvshmem"  # the one mapping that spans hosts, and puts to the peers it cannot map
            self._low_latency = LowLatencyBackend(self.group, self._gate, self.num_rdma_bytes, memory)
        return self._low_latency

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        check_num_sms("new_num_sms", new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return capture_current_stream()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The dispatch config at Buffer.num_sms: the config cache's for this machine where `moe-ep-bench tune`
        wrote one (moe_ep.tuning; its own SM budget unless set_num_sms chose another), else the built-in one."""
        check_int("num_ranks", num_ranks, minimum=1)
        return dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The combine config at Buffer.num_sms: the config cache's for this machine where `moe-ep-bench tune`
        wrote one (moe_ep.tuning; its own SM budget unless set_num_sms chose another), else the built-in one."""
        check_int("num_ranks", num_ranks, minimum=1)
        return combine_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_internode_rdma_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, ranks_per_node: int,
                                     num_topk: int) -> int:
        """(ext) num_rdma_bytes for normal calls across nodes of up to num_max_tokens_per_rank tokens a rank
        (needs the internode extension)."""
        return internode_rdma_size_hint(num_max_tokens_per_rank, hidden, num_ranks, ranks_per_node, num_topk)

    @staticmethod
    def is_sm90_compiled() -> bool:
        return _native.is_sm90_compiled()

    # ------------------------------------------------------------------ lifetime and raw buffers
    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise RuntimeError(
                "destroy() is for Buffers created with explicitly_destroy=True; others are freed by the GC"
            )
        if self._destroyed:  # a Buffer whose ranks are out of step can still be freed
            raise RuntimeError("this Buffer was destroyed; create a new one")
        for backend in (self._intranode, self._internode, self._low_latency):
            if backend is not None:
                backend.close()
        self._intranode = self._internode = self._low_latency = None
        self._local_buffers.clear()
        self._destroyed = True

    @property
    def ranks_on_this_gpu(self) -> int:
        """(ext) How many ranks of the group share this rank's GPU: known once a call ran on the
        intranode kernels (1 before that, and on the portable backend)."""
        return self._intranode.peers.ranks_on_device if self._intranode is not None else 1

    def progress_report(self) -> str:
        """(ext) Where this rank's intranode calls stand, one line for a stalled program's report (safe to
        call from another thread while a call waits): when the host launched its last calls, whether the
        caller's stream had reached each, which kernels the device started and finished last, and whether
        the communication stream is idle. Empty before the first call on the kernels."""
        return self._intranode.progress_report() if self._intranode is not None else ""

    # ------------------------------------------------------------------ diagnostics (moe_ep.diagnostics)
    def check_errors(self) -> None:
        """(ext) Waits for this Buffer's kernels and raises what they reported since its last call (a peer
        that never arrived: TimeoutError naming it; a num_worst_tokens dispatch that received more rows
        than it had: ValueError), which its next call would raise otherwise. Nothing on the portable
        backend, whose errors are raised in the call."""
        diagnostics.check_errors(self)

    def stats(self) -> dict:
        """(ext) Counters since the Buffer was made or reset_stats(): "calls" {kind: n}, "one_pass_calls"
        {"dispatch": n, "combine": m}, "arena" {"capacity", "in_use", "high_water", "regions"},
        "expert_tokens" / "expert_tokens_last" (tokens received per local expert), "sent_bytes" /
        "recv_bytes" (payload bytes per peer), "buffer_capacity" / "buffer_high_water" ({"nvl", "rdma",
        "arena"}), "collecting", "uncounted_calls" and "slow_ranks" ({peer: {"count", "max_ms",
        "total_ms"}}: the peers this rank waited for longer than MOE_EP_SLOW_RANK_MS at the portable
        backend's host meetings; the kernels wait on the device and add nothing) (moe_ep.diagnostics.stats
        says what each counts).
        Counts the host knows cost a call next to nothing; those only the device has are collected
        after reset_stats()."""
        return diagnostics.stats(self)

    def reset_stats(self, collect: bool = True) -> None:
        """(ext) stats()' counters back to 0, the arena's high-water mark to the bytes in use now, and
        starts collecting the device-side counters (collect=False: stops): the received tokens and bytes
        that only the device knows (num_worst_tokens dispatches on the kernels, their cached dispatches
        and combines, low-latency calls on CUDA tensors), at a few small device ops per such call (one
        kernel per low-latency call on the kernels). It waits for the device where device-side counters
        were collected."""
        diagnostics.reset_stats(self, collect)

    def topology(self) -> dict:
        """(ext) This rank, its node, which backend serves each kind of call and why, and per peer how this
        rank reaches it ("same_gpu", "nvlink", "portable", ...) with the memory its buffers were mapped
        with; the peers are mapped at the first call of CUDA tensors, and entries that need the mapping
        are None before it (moe_ep.diagnostics.topology lists the keys)."""
        return diagnostics.topology(self)

    def profile(self) -> Profile:
        """(ext) `with buffer.profile() as prof:` times each phase of this Buffer's calls made inside it:
        "layout", "count exchange" (a fresh dispatch's exchange of counts: the portable backend's
        all-gather; on the kernels from the call's start until the host holds the counts), "dispatch",
        "cached dispatch", "combine", "low-latency dispatch", "low-latency combine" and "hook wait" (a
        receive hook's call). prof.summary() gives this rank's {phase: {"calls", "total_ms", "mean_ms",
        "max_ms"}}, prof.gather() (collective) every rank's on rank 0. CUDA phases are timed by events
        read only when asked for (moe_ep.profiling says where they are recorded); outside a profile a
        call pays one attribute check. MOE_EP_PROFILE=1 profiles every call from construction (profiler)."""
        self._check_alive()
        return Profile(self)

    @property
    def profiler(self) -> Optional[Profile]:
        """(ext) The Profile recording this Buffer's calls now: the innermost profile() being run, or
        under MOE_EP_PROFILE=1 the one made with the Buffer; None when none records."""
        return self._profile

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed; create a new one")
        self._gate.check_usable()

    def _arguments(self, call: str, x, kernels: bool) -> "_Arguments":
        """The argument checks of a call that meets its peers at the arrival gate (the portable backend
        serves it: x is not a CUDA tensor bound for the kernels; or MOE_EP_DEBUG=1): an exception there is
        this rank's refusal, which the peers raise naming this rank, so every rank leaves the call in step
        and the Buffer stays usable."""
        return _Arguments(self._gate, call, x, kernels and not self.debug_checks)

    def _meet_on_kernels(self, kernels: bool, phase: str, form, call) -> Optional[int]:
        """Under MOE_EP_DEBUG=1 a call the kernels serve (kernels) first meets its peers at the arrival gate,
        as the portable backend's calls do, before the kernels' first call maps the peers' buffers: the
        ranks compare the call's form (forms.py, and that the kernels serve it, which a rank on the portable
        backend does not say) and all raise the same ValueError where one differs, before any data moves
        (a store round trip a call). -> the meeting's number, which a dispatch's handle keeps for the forms
        of its cached dispatches and combine; None where no meeting was held."""
        if not (self.debug_checks and kernels):
            return None
        return self._gate.enter(phase, (*form(call), ("backend", "the kernels")))

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> torch.Tensor:
        """A typed view of this rank's own communication buffer (raw bytes, for tests and tools)."""
        self._check_alive()
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        check_int("offset", offset, minimum=0)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
        element = dtype.itemsize
        count = (num_bytes - offset) // element if size is None else int(torch.Size(size).numel())
        if offset + count * element > num_bytes:
            raise ValueError(
                f"size/offset: {count} elements of {dtype} at byte {offset} exceed the "
                f"{'rdma' if use_rdma_buffer else 'nvl'} buffer of {num_bytes} bytes"
            )
        key = bool(use_rdma_buffer)
        if key not in self._local_buffers:
            self._local_buffers[key] = torch.zeros(num_bytes, dtype=torch.uint8, device=self._device())
        view = self._local_buffers[key][offset : offset + count * element].view(dtype)
        return view if size is None else view.view(size)

    def get_comm_stream(self):
        """The stream communication runs on: a CUDA stream where CUDA is used, else None."""
        if self._kernels:
            if self._comm_stream is None:
                self._comm_stream = torch.cuda.Stream()
            return self._comm_stream
        if torch.cuda.is_available():
            return torch.cuda.current_stream()
        return None

    # ------------------------------------------------------------------ shared checks
    def _check_events(self, previous_event, async_finish, allocate_on_comm_stream) -> None:
        if not isinstance(async_finish, bool):
            raise TypeError(f"async_finish: expected a bool, got {type(async_finish).__name__}")
        if not (previous_event is None or isinstance(previous_event, EventOverlap)):
            raise TypeError(f"previous_event: expected an EventOverlap or None, got {type(previous_event).__name__}")
        if previous_event is not None and not (previous_event.event is None
                                               or isinstance(previous_event.event, torch.cuda.Event)):
            raise TypeError(f"previous_event: expected an EventOverlap of a torch.cuda.Event (or of None), got one "
                            f"of {type(previous_event.event).__name__}")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError(
                "allocate_on_comm_stream=True needs previous_event (an EventOverlap) and async_finish=True"
            )

    def _check_data(self, x: torch.Tensor, kernels: Optional[bool] = None) -> bool:
        """Data-dependent checks ride on the host synchronisation of the portable backend and of CPU
        tensors; the kernels' no-sync paths run them only under MOE_EP_DEBUG=1 (read when the Buffer
        is created). kernels: whether the kernels serve this call's CUDA tensors (default: where built)."""
        kernels = _native.has_kernels() if kernels is None else kernels
        return not (x.is_cuda and kernels) or self.debug_checks

    def _check_num_experts(self, num_experts, name: str = "num_experts", unit: str = "") -> int:
        """name: the argument that gives the number; unit: how (num_tokens_per_expert by its length)."""
        check_int(name, num_experts, minimum=1)
        if num_experts > INT32_MAX:
            raise ValueError(f"{name}: expected at most {INT32_MAX}{unit} (experts are counted and indexed with "
                             f"32-bit integers), got {num_experts}")
        if num_experts % self.group_size != 0:
            raise ValueError(f"{name}: must be a multiple of the group size {self.group_size}{unit}, got {num_experts}")
        return num_experts

    def _default_config(self, call: str) -> Config:
        """get_dispatch_config / get_combine_config (call "dispatch" / "combine") of this group at the
        current SM budget, made once per budget. Not handed out: no caller can change it."""
        key = (call, Buffer.num_sms)
        config = self._default_configs.get(key)
        if config is None:
            make = dispatch_config if call == "dispatch" else combine_config
            config = self._default_configs[key] = make(self.group_size, Buffer.num_sms)
        return config

    def _check_nvl_size(self, hidden_bytes: int, config: Config, call: str,
                        default: bool = False) -> Tuple[int, int]:
        """-> the (nvl, rdma) bytes the call needs. default: config is the call's default (none was
        passed), which the message then names."""
        # What the size hints depend on: a call that fits once fits again.
        key = (hidden_bytes, config.num_sms, config.num_max_nvl_chunked_recv_tokens,
               config.num_max_rdma_chunked_recv_tokens)
        needed = self._sizes_that_fit.get(key)
        if needed is not None:
            return needed
        hint = f"Buffer.get_{call}_config({self.group_size})" if default else "Config"
        nvl_needed = config.get_nvl_buffer_size_hint(hidden_bytes, self.group_size)
        rdma_needed = config.get_rdma_buffer_size_hint(hidden_bytes, self.group_size) \
            if self.group_size > NUM_MAX_NVL_PEERS else 0
        # A Buffer sized for one call's config (or for Config()'s) can be too small for another's.
        advice = (f"; without config= the {call} uses {hint}: size the Buffer with the larger of "
                  f"Buffer.get_dispatch_config({self.group_size}) and Buffer.get_combine_config({self.group_size})'s "
                  "hints (moe_ep.buffer.default_config_size_hints gives them), or pass config=") if default else ""
        for kind, have, needed in (("nvl", self.num_nvl_bytes, nvl_needed),
                                   ("rdma", self.num_rdma_bytes, rdma_needed)):
            if have < needed:
                raise ValueError(
                    f"num_{kind}_bytes={have} is too small for {call} with {hidden_bytes} bytes per row on "
                    f"{self.group_size} ranks: need >= {needed} ({hint}.get_{kind}_buffer_size_hint){advice}"
                )
        needed = self._sizes_that_fit[key] = (nvl_needed, rdma_needed)
        return needed

    def _check_handle(self, handle, kind: type, call: str):
        if not isinstance(handle, kind):
            raise TypeError(f"handle: expected the handle returned by {call}, got {type(handle).__name__}")
        if handle.buffer_serial != self.serial:
            raise ValueError("handle: it was made by another Buffer; pass the handle this Buffer returned")
        return handle

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._check_alive()
        check_tensor("topk_idx", topk_idx, dtype=topk_idx_t, ndim=2)
        _check_num_tokens("topk_idx", topk_idx.shape[0])
        self._check_num_experts(num_experts)
        self._check_events(previous_event, async_finish, allocate_on_comm_stream)
        if self._check_data(topk_idx):
            check_expert_ids("topk_idx", topk_idx, num_experts)
        wait_previous(previous_event)
        self._calls["get_dispatch_layout"] += 1
        profile = self._profile
        mark = profile.start(topk_idx.device) if profile is not None else None
        if topk_idx.is_cuda and _native.has_kernels():
            outs = _native.ops().get_dispatch_layout(
                topk_idx.contiguous(), num_experts, self.group_size, self.ranks_per_node
            )
        else:
            outs = dispatch_layout(topk_idx, num_experts, self.group_size, self.ranks_per_node)
        if profile is not None:
            profile.stop("layout", mark)
        return (*outs, finish_event(async_finish, [topk_idx, *outs]))

    # ------------------------------------------------------------------ normal dispatch / combine
    def _split_x(self, x: XLike) -> List[torch.Tensor]:
        if isinstance(x, (tuple, list)):
            return list(check_fp8_pair("x", x))
        check_tensor("x", x, dtypes=HIDDEN_DTYPES, ndim=2)
        return [x]

    def dispatch(
        self,
        x: XLike,
        handle: Optional[DispatchHandle] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """-> (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)"""
        self._check_alive()
        with self._arguments("dispatch", x, self._kernels):
            x_parts = self._split_x(x)
            num_tokens, hidden = x_parts[0].shape
            _check_num_tokens("x", num_tokens)
            device = x_parts[0].device
            check_int("expert_alignment", expert_alignment, minimum=1)
            check_int("num_worst_tokens", num_worst_tokens, minimum=0)
            if num_worst_tokens > INT32_MAX:
                raise ValueError(f"num_worst_tokens: expected at most {INT32_MAX} (received rows are counted with "
                                 f"32-bit integers), got {num_worst_tokens}")
            self._check_events(previous_event, async_finish, allocate_on_comm_stream)
            default = config is None
            config = self._default_config("dispatch") if default else config
            if not isinstance(config, Config):
                raise TypeError(f"config: expected a moe_ep.Config, got {type(config).__name__}")
            needed = self._check_nvl_size(hidden * max(x_parts[0].element_size(), 2), config, "dispatch", default)
            on_kernels = x_parts[0].is_cuda and self._kernels
            if handle is not None:
                self._check_handle(handle, DispatchHandle, "dispatch")
                # Before any check that waits on the device, which a capture refuses.
                if on_kernels:
                    refuse_capture_on_the_kernels("dispatch", self._spans_nodes,
                                                  waits_for_counts=not handle.num_worst_tokens)
                for name, value in (
                    ("num_tokens_per_rank", num_tokens_per_rank),
                    ("is_token_in_rank", is_token_in_rank),
                    ("num_tokens_per_expert", num_tokens_per_expert),
                    ("topk_idx", topk_idx),
                    ("topk_weights", topk_weights),
                ):
                    if value is not None:
                        raise ValueError(
                            f"{name}: must be None for a cached dispatch (handle given): the handle fixes the layout"
                        )
                if num_tokens != handle.num_tokens:
                    raise ValueError(f"x: the handle's layout is for {handle.num_tokens} tokens, got {num_tokens}")
                self._check_handle_backend(handle, x_parts[0], _KERNEL_STATES, self._kernels, "dispatch")
            else:
                if on_kernels:
                    refuse_capture_on_the_kernels("dispatch", self._spans_nodes, waits_for_counts=not num_worst_tokens)
                self._check_layout_args(
                    num_tokens,
                    device,
                    num_tokens_per_rank,
                    num_tokens_per_rdma_rank,
                    is_token_in_rank,
                    num_tokens_per_expert,
                    topk_idx,
                    topk_weights,
                )

        def make_handle(**fields) -> DispatchHandle:
            return DispatchHandle(buffer_serial=self.serial, **fields)

        call = DispatchCall(x_parts, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                            topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                            allocate_on_comm_stream, make_handle, self._profile)
        self._calls["dispatch" if handle is None else "cached_dispatch"] += 1
        self._traffic.need(*needed)
        meeting = self._meet_on_kernels(x_parts[0].is_cuda and self._kernels, "dispatch", forms.dispatch_form, call)
        backend = self._normal_backend(x_parts[0])
        profile = call.profile
        mark = profile.start(device) if profile is not None else None
        recv_x, recv_idx, recv_weights, counts, new_handle, event = backend.dispatch(call)
        if meeting is not None and new_handle is not None:
            new_handle.gate_call = meeting
        if profile is not None:
            profile.stop("dispatch" if handle is None else "cached dispatch", mark,
                         self._work_stream(backend, async_finish))
        self._traffic.dispatch(call, handle if new_handle is None else new_handle, recv_idx, event,
                               self._async_comm_stream(backend, async_finish))
        recv = tuple(recv_x) if len(recv_x) == 2 else recv_x[0]
        return recv, recv_idx, recv_weights, counts, new_handle, event

    def _check_layout_args(
        self,
        num_tokens,
        device,
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        is_token_in_rank,
        num_tokens_per_expert,
        topk_idx,
        topk_weights,
    ) -> None:
        for name, value in (
            ("num_tokens_per_rank", num_tokens_per_rank),
            ("is_token_in_rank", is_token_in_rank),
            ("num_tokens_per_expert", num_tokens_per_expert),
        ):
            if value is None:
                raise ValueError(f"{name}: required when no handle is given (take it from get_dispatch_layout)")
        check_tensor(
            "num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(self.group_size,), device=device
        )
        # The layout tensors come from one get_dispatch_layout: an x whose rows match none of them is the wrong one.
        layout_rows = [t.shape[0] for t in (is_token_in_rank, topk_idx) if isinstance(t, torch.Tensor) and t.dim() == 2]
        if layout_rows and num_tokens not in layout_rows:
            raise ValueError(f"x: expected {layout_rows[0]} rows, one per row of is_token_in_rank / topk_idx, "
                             f"got {num_tokens}")
        check_tensor(
            "is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, self.group_size), device=device
        )
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, ndim=1, device=device)
        num_experts = self._check_num_experts(num_tokens_per_expert.shape[0], "num_tokens_per_expert",
                                              " in length (one count per expert)")
        if num_tokens_per_rdma_rank is not None:
            check_tensor(
                "num_tokens_per_rdma_rank",
                num_tokens_per_rdma_rank,
                dtype=torch.int32,
                shape=(self.group_size // self.ranks_per_node,),
                device=device,
            )
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx, topk_weights: pass both or neither")
        if topk_idx is not None:
            check_tensor("topk_idx", topk_idx, dtype=topk_idx_t, ndim=2, device=device)
            num_topk = topk_idx.shape[1]
            if topk_idx.shape[0] != num_tokens:
                raise ValueError(f"topk_idx: expected {num_tokens} rows (one per token of x), got {topk_idx.shape[0]}")
            if not (1 <= num_topk <= NUM_MAX_TOPK):
                raise ValueError(f"topk_idx: top-k must be in [1, {NUM_MAX_TOPK}], got {num_topk}")
            check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, num_topk), device=device)
        if self._check_data(is_token_in_rank, self._kernels):
            self._check_layout_values(num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                      num_tokens_per_expert, topk_idx)

    def _check_layout_values(self, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx) -> None:
        """The layout tensors must say what topk_idx says (they come from one get_dispatch_layout):
        otherwise tokens reach ranks that hold none of their experts or miss ranks that do."""
        num_experts = num_tokens_per_expert.shape[0]
        if topk_idx is not None:
            check_expert_ids("topk_idx", topk_idx, num_experts,
                             hint=f" (num_tokens_per_expert has {num_experts} entries, one per expert)")
            per_rank, per_rdma_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size,
                                                                           self.ranks_per_node)
            if not torch.equal(is_token_in_rank, in_rank):
                token, rank = (is_token_in_rank != in_rank).nonzero()[0].tolist()
                experts = [e for e in topk_idx[token].tolist() if e >= 0]
                local = num_experts // self.group_size
                if is_token_in_rank[token, rank]:
                    why = (f"token {token} is marked for rank {rank}, which holds none of its experts {experts}"
                           if experts else
                           f"token {token} is marked for rank {rank}, but topk_idx sends it to no expert")
                else:
                    why = f"token {token} is not marked for rank {rank}, which holds some of its experts {experts}"
                # A num_tokens_per_expert of the wrong length moves the experts between ranks.
                why += (f"; rank {rank} holds experts [{rank * local}, {(rank + 1) * local}) of the {num_experts} "
                        "that num_tokens_per_expert counts")
                raise ValueError(f"is_token_in_rank: disagrees with topk_idx ({why}); pass both from the same "
                                 "get_dispatch_layout")
            if not torch.equal(num_tokens_per_expert, per_expert):
                expert = int((num_tokens_per_expert != per_expert).nonzero()[0, 0])
                raise ValueError(
                    f"num_tokens_per_expert: disagrees with topk_idx (expert {expert}: topk_idx sends it "
                    f"{int(per_expert[expert])} tokens, got {int(num_tokens_per_expert[expert])}); pass both from "
                    "the same get_dispatch_layout"
                )
        else:
            # Without top-k only the counts' bounds tell: an expert takes at most the tokens sent to its rank.
            bound = num_tokens_per_rank.repeat_interleave(num_experts // self.group_size)
            wrong = (num_tokens_per_expert < 0) | (num_tokens_per_expert > bound)
            if bool(wrong.any()):
                expert = int(wrong.nonzero()[0, 0])
                raise ValueError(
                    f"num_tokens_per_expert: expert {expert} counts {int(num_tokens_per_expert[expert])} tokens, "
                    f"expected 0 to the {int(bound[expert])} that num_tokens_per_rank sends to its rank"
                )
        sent = is_token_in_rank.sum(0, dtype=torch.int32)
        if not torch.equal(sent, num_tokens_per_rank):
            raise ValueError(
                f"num_tokens_per_rank: disagrees with is_token_in_rank (whose column sums are {sent.tolist()}, "
                f"got {num_tokens_per_rank.tolist()}); pass both from the same get_dispatch_layout"
            )
        if num_tokens_per_rdma_rank is not None:
            num_nodes = self.group_size // self.ranks_per_node
            in_node = is_token_in_rank.view(-1, num_nodes, self.ranks_per_node).any(-1).sum(0, dtype=torch.int32)
            if not torch.equal(in_node, num_tokens_per_rdma_rank):
                raise ValueError(
                    f"num_tokens_per_rdma_rank: disagrees with is_token_in_rank (which sends {in_node.tolist()} tokens "
                    f"to each node, got {num_tokens_per_rdma_rank.tolist()}); pass both from the same "
                    "get_dispatch_layout"
                )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor] = None,
        bias: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """-> (combined_x [N, H], combined_topk_weights or None, event). With the kernels and an arena
        (num_arena_bytes), an x from empty_combine_input is read where it lies, where every rank has
        room; from 4 ranks up any other x is copied into the arena first, below it takes two passes."""
        self._check_alive()
        with self._arguments("combine", x, self._kernels):
            self._check_handle(handle, DispatchHandle, "dispatch")
            check_tensor("x", x, dtypes=HIDDEN_DTYPES, shape=(handle.num_recv_rows, None))
            self._check_events(previous_event, async_finish, allocate_on_comm_stream)
            default = config is None
            config = self._default_config("combine") if default else config
            if not isinstance(config, Config):
                raise TypeError(f"config: expected a moe_ep.Config, got {type(config).__name__}")
            needed = self._check_nvl_size(x.shape[1] * max(x.element_size(), 2), config, "combine", default)
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=x.device)
                if topk_weights.shape[0] != x.shape[0]:
                    raise ValueError(
                        f"topk_weights: expected {x.shape[0]} rows (one per row of x), got {topk_weights.shape[0]}"
                    )
            biases = self._split_bias(bias, handle.num_tokens, x)
            self._check_handle_backend(handle, x, _KERNEL_STATES, self._kernels, "dispatch")
            if x.is_cuda and self._kernels:
                refuse_capture_on_the_kernels("combine", self._spans_nodes)
        call = CombineCall(x, handle, topk_weights, biases, config, previous_event, async_finish,
                           allocate_on_comm_stream)
        self._calls["combine"] += 1
        self._traffic.need(*needed)
        self._meet_on_kernels(x.is_cuda and self._kernels, "combine", forms.combine_form, call)
        backend = self._normal_backend(x)
        profile = self._profile
        mark = profile.start(x.device) if profile is not None else None
        combined_x, combined_w, event = backend.combine(call)
        if profile is not None:
            profile.stop("combine", mark, self._work_stream(backend, async_finish))
        self._traffic.combine(call, event, self._async_comm_stream(backend, async_finish))
        return combined_x, combined_w, event

    @staticmethod
    def _work_stream(backend: Backend, async_finish: bool) -> Optional[torch.cuda.Stream]:
        """The stream whose queue ends a normal call's work: the kernels' communication stream for an
        async_finish call (the caller's stream waits for it otherwise), else None: the caller's."""
        return getattr(backend, "comm_stream", None) if async_finish else None

    @staticmethod
    def _async_comm_stream(backend: Backend, async_finish: bool) -> Optional[torch.cuda.Stream]:
        """Where an async_finish call on the intranode kernels ran (its event covers what runs there), else None."""
        return backend.comm_stream if async_finish and isinstance(backend, IntranodeBackend) else None

    # deep_ep's multi-node entry points take dispatch's and combine's arguments; here the same calls pick
    # the transport for the group by themselves.
    internode_dispatch = dispatch
    internode_combine = combine

    def empty_combine_input(self, handle: DispatchHandle, hidden: int,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """(ext) An uninitialised [received rows, hidden] tensor for the expert outputs that combine(x=...)
        of `handle` sends back. It owns its memory like any tensor; with the kernels and an arena
        (num_arena_bytes) that memory is a region of this rank's arena, so the combine reads its rows where
        they lie (one pass; an x elsewhere is first copied into the arena). Otherwise a plain tensor."""
        self._check_combine_rows(handle, hidden, dtype)
        if isinstance(handle.backend_state, IntranodeDispatchState):
            return self._intranode.combine_input(handle, hidden, dtype)
        return self._portable.combine_input(handle, hidden, dtype)  # a plain tensor

    def _check_combine_rows(self, handle: DispatchHandle, hidden: int, dtype: torch.dtype) -> None:
        """The arguments of the tensor a combine of `handle` reads (empty_combine_input)."""
        self._check_alive()
        self._check_handle(handle, DispatchHandle, "dispatch")
        check_int("hidden", hidden, minimum=1)
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")

    @staticmethod
    def _check_handle_backend(handle, x: torch.Tensor, kernel_state: type, kernels_on: bool, call: str) -> bool:
        """Whether the kernels made `handle` (and so move x); ValueError where handle and x disagree."""
        made_by_kernels = isinstance(handle.backend_state, kernel_state)
        if made_by_kernels != (x.is_cuda and kernels_on):
            raise ValueError(
                f"handle: its {call} ran on the "
                + ("kernels (CUDA tensors)" if made_by_kernels else "portable backend")
                + f", but x is a {'CUDA' if x.is_cuda else 'CPU'} tensor; keep a handle's tensors on one device"
            )
        return made_by_kernels

    @staticmethod
    def _split_bias(bias, num_tokens: int, x: torch.Tensor) -> List[torch.Tensor]:
        if bias is None:
            return []
        biases = list(bias) if isinstance(bias, (tuple, list)) else [bias]
        if len(biases) > 2:
            raise ValueError(f"bias: expected None, one tensor or two, got {len(biases)}")
        for i, b in enumerate(biases):
            check_tensor(f"bias[{i}]", b, dtype=x.dtype, shape=(num_tokens, x.shape[1]), device=x.device)
        return biases

    # ------------------------------------------------------------------ low-latency mode
    def _check_low_latency(self, call: str, num_max_tokens: int, hidden: int, num_experts: int) -> int:
        """-> the num_rdma_bytes calls of this shape need; ValueError where the Buffer has less."""
        if not self.low_latency_mode:
            raise RuntimeError(f"{call} needs a Buffer created with low_latency_mode=True")
        shape = (num_max_tokens, hidden, num_experts)
        needed = self._ll_shapes_that_fit.get(shape)
        if needed is not None:  # a decode loop asks the same every step (microseconds)
            return needed
        needed = low_latency_rdma_size_hint(num_max_tokens, hidden, self.group_size, num_experts)
        if self.num_rdma_bytes < needed:
            raise ValueError(
                f"num_rdma_bytes={self.num_rdma_bytes} is too small for {call} with {num_max_tokens} tokens per "
                f"rank, hidden {hidden}, {self.group_size} ranks and {num_experts} experts: need >= {needed} "
                "(Buffer.get_low_latency_rdma_size_hint)"
            )
        self._ll_shapes_that_fit[shape] = needed
        return needed

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """-> (recv_x, recv_count, handle, event, hook)"""
        self._check_alive()
        with self._arguments("low_latency_dispatch", x, self._ll_kernels):
            _refuse_wait_cost_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
            check_tensor("x", x, dtype=torch.bfloat16, ndim=2)
            num_tokens, hidden = x.shape
            check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
            self._check_num_experts(num_experts)
            needed = self._check_low_latency("low_latency_dispatch", num_max_dispatch_tokens_per_rank, hidden,
                                             num_experts)
            if num_tokens > num_max_dispatch_tokens_per_rank:
                raise ValueError(
                    f"x: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}"
                )
            if hidden % (FP8_BLOCK if use_fp8 else 8) != 0:
                raise ValueError(
                    f"x: hidden must be a multiple of {FP8_BLOCK if use_fp8 else 8} "
                    f"{'for fp8 dispatch' if use_fp8 else '(16-byte rows)'}, got {hidden}"
                )
            check_tensor("topk_idx", topk_idx, dtype=topk_idx_t, ndim=2, device=x.device)
            if topk_idx.shape[0] != num_tokens:
                raise ValueError(f"topk_idx: expected {num_tokens} rows (one per token of x), got {topk_idx.shape[0]}")
            if not (1 <= topk_idx.shape[1] <= NUM_MAX_TOPK):
                raise ValueError(f"topk_idx: top-k must be in [1, {NUM_MAX_TOPK}], got {topk_idx.shape[1]}")
            local = num_experts // self.group_size
            if cumulative_local_expert_recv_stats is not None:
                check_tensor(
                    "cumulative_local_expert_recv_stats",
                    cumulative_local_expert_recv_stats,
                    dtype=torch.int32,
                    shape=(local,),
                    device=x.device,
                )
            if use_ue8m0 and not (use_fp8 and round_scale):
                raise ValueError(
                    "use_ue8m0=True needs use_fp8=True and round_scale=True (UE8M0 holds power-of-two scales)"
                )
            for name, flag in (
                ("use_fp8", use_fp8),
                ("round_scale", round_scale),
                ("use_ue8m0", use_ue8m0),
                ("async_finish", async_finish),
                ("return_recv_hook", return_recv_hook),
            ):
                if not isinstance(flag, bool):
                    raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
            if async_finish and return_recv_hook:
                raise ValueError("async_finish and return_recv_hook: choose one (the hook already defers the receive)")
            check_data = self._check_data(x, self._ll_kernels)
            if check_data:
                check_expert_ids("topk_idx", topk_idx, num_experts)
                check_distinct_expert_ids("topk_idx", topk_idx)
            handle = LowLatencyHandle(self.serial, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_tokens,
                                      topk_idx.shape[1], x.device)
            if x.is_cuda and self._low_latency is not None:
                self._low_latency.check_call("low_latency_dispatch", handle)
        if check_data:  # its combine must be given the same top-k
            handle.dispatch_topk_idx = topk_idx.clone()
        call = LowLatencyDispatchCall(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                      cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0, async_finish,
                                      return_recv_hook, handle)
        self._calls["low_latency_dispatch"] += 1
        self._traffic.need(0, needed)
        profile = self._profile
        meeting = self._meet_on_kernels(x.is_cuda and self._ll_kernels, "low_latency_dispatch",
                                        forms.low_latency_dispatch_form, call)
        backend = self._low_latency_backend(x)
        if meeting is not None:
            handle.gate_call = meeting
        mark = profile.start(x.device) if profile is not None else None
        recv_x, recv_count, event, hook = backend.low_latency_dispatch(call)
        if profile is not None:
            profile.stop("low-latency dispatch", mark)
            hook = profile.timed_hook(hook, x.device)
        hook = self._traffic.low_latency_dispatch(call, recv_x, recv_count, hook)
        return recv_x, recv_count, handle, event, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[torch.Tensor] = None,
        combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
    ):
        """-> (combined_x [N, H] bf16, event, hook)"""
        self._check_alive()
        with self._arguments("low_latency_combine", x, self._ll_kernels):
            if not isinstance(use_logfmt, bool):
                raise TypeError(f"use_logfmt: expected a bool, got {type(use_logfmt).__name__}")
            if use_logfmt:
                raise NotImplementedError(
                    "use_logfmt: moe_ep sends combine rows as bf16 and has no LogFMT encoding (which would change "
                    "the result); pass use_logfmt=False"
                )
            _refuse_wait_cost_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
            self._check_handle(handle, LowLatencyHandle, "low_latency_dispatch")
            local = handle.num_experts // self.group_size
            rows = self.group_size * handle.num_max_dispatch_tokens_per_rank
            needed = self._check_low_latency(
                "low_latency_combine", handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
            )
            check_tensor("x", x, dtype=torch.bfloat16, shape=(local, rows, handle.hidden))
            check_tensor(
                "topk_idx", topk_idx, dtype=topk_idx_t, shape=(handle.num_tokens, handle.num_topk), device=x.device
            )
            check_tensor(
                "topk_weights",
                topk_weights,
                dtype=torch.float32,
                shape=(handle.num_tokens, handle.num_topk),
                device=x.device,
            )
            if out is not None:
                check_tensor("out", out, dtype=torch.bfloat16, shape=(handle.num_tokens, handle.hidden),
                             device=x.device)
            if async_finish and return_recv_hook:
                raise ValueError("async_finish and return_recv_hook: choose one (the hook already defers the receive)")
            if not isinstance(zero_copy, bool):
                raise TypeError(f"zero_copy: expected a bool, got {type(zero_copy).__name__}")
            on_kernels = self._check_handle_backend(handle, x, LowLatencyKernelState, self._ll_kernels,
                                                    "low_latency_dispatch")
            if handle.dispatch_topk_idx is not None and self._check_data(x, self._ll_kernels):
                _check_same_topk(topk_idx, handle.dispatch_topk_idx)
            if on_kernels:
                self._low_latency.check_call("low_latency_combine", handle, dispatched=True)
        backend = self._low_latency_backend(x)
        if zero_copy:
            x = backend.low_latency_combine_buffer(handle)
        call = LowLatencyCombineCall(x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out)
        self._calls["low_latency_combine"] += 1
        self._traffic.need(0, needed)
        self._meet_on_kernels(x.is_cuda and self._ll_kernels, "low_latency_combine", forms.low_latency_combine_form,
                              call)
        profile = self._profile
        mark = profile.start(x.device) if profile is not None else None
        result = backend.low_latency_combine(call)
        if profile is not None:
            profile.stop("low-latency combine", mark)
            result = (*result[:2], profile.timed_hook(result[2], x.device))
        self._traffic.low_latency_combine(call)
        return result

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The [L, R*max, H] bf16 tensor the next low_latency_combine(zero_copy=True) reads: write the
        expert outputs here (on the current stream, after the handle's dispatch has received) and no
        row is copied: with the kernels it lies in this rank's mapped buffer, where the ranks that own
        the tokens read the rows (where the group reaches a peer through NVSHMEM puts, the rows are put
        from there instead). Two such tensors alternate between combines; they are valid while the
        Buffer lives."""
        self._check_alive()
        self._check_handle(handle, LowLatencyHandle, "low_latency_dispatch")
        self._check_low_latency(  # the view must lie inside the buffer
            "get_next_low_latency_combine_buffer", handle.num_max_dispatch_tokens_per_rank, handle.hidden,
            handle.num_experts,
        )
        # With the kernels the rows live in this rank's mapped buffer and the peers read them there.
        kernels = isinstance(handle.backend_state, LowLatencyKernelState) and self._low_latency is not None
        return (self._low_latency if kernels else self._portable).low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Clears the low-latency buffer for calls of this shape: the kernels' flags of both halves on
        every rank (collective: every rank calls it; the kernels also do it by themselves at the first
        call of a shape that differs from the last one) and the portable backend's staging rows. The
        normal calls use a buffer of their own, so mixing them with low-latency calls needs nothing."""
        self._check_alive()
        check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
        check_int("hidden", hidden, minimum=1)
        self._check_num_experts(num_experts)
        self._check_low_latency("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden, num_experts)
        shape = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        for backend in (self._low_latency, self._portable):
            if backend is not None:
                backend.clean_low_latency_buffer(shape)


    # Shrink mode's mask of ranks (docs/API.md): every rank must update and clean it alike, as in deep_ep.
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (mask=True) or unmasks a rank: its peers' low-latency calls skip it; its own run alone."""
        self._check_alive()
        rank_mask = self._shrink_mask("low_latency_update_mask_buffer")
        check_int("rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask: expected a rank < {self.group_size}, got {rank_to_mask}")
        if not isinstance(mask, bool):
            raise TypeError(f"mask: expected a bool, got {type(mask).__name__}")
        rank_mask.update(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes the mask into mask_status (int32 [R]): 1 where a rank is masked."""
        self._check_alive()
        rank_mask = self._shrink_mask("low_latency_query_mask_buffer")
        check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,))
        mask_status.copy_(rank_mask.as_tensor())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank."""
        self._check_alive()
        self._shrink_mask("low_latency_clean_mask_buffer").clean()

    def _shrink_mask(self, call: str) -> RankMask:
        if self._mask is None:
            raise RuntimeError(_NO_SHRINK.format(call=call))
        return self._mask


# The device state of a handle whose dispatch ran on the kernels (on one node, across nodes).
_KERNEL_STATES = (IntranodeDispatchState, InternodeDispatchState)


def _check_num_tokens(name: str, num_tokens: int) -> None:
    """A rank's tokens are counted and indexed with 32-bit integers (the handle's source indices, the
    kernels' counts): more rows than that fit no Buffer, whatever their strides."""
    if num_tokens > INT32_MAX:
        raise ValueError(f"{name}: expected at most {INT32_MAX} rows (a rank's tokens are counted and indexed with "
                         f"32-bit integers), got {num_tokens}; dispatch them in several calls")


@functools.lru_cache(maxsize=None)
def _init_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.__init__)


def _unbound_message(cls: type, exc: TypeError, kwargs: dict) -> str:
    """What Buffer(...) says where its arguments bind to no parameter: an unknown keyword by name, with
    the closest parameter where one is near."""
    names = [name for name in _init_signature(cls).parameters if name != "self"]
    unknown = [name for name in kwargs if name not in names]
    if not unknown:
        return f"{cls.__name__}(): {exc}"
    close = difflib.get_close_matches(unknown[0], names, n=1)
    hint = f"did you mean {close[0]}?" if close else f"its arguments are {', '.join(names)}"
    return f"{unknown[0]}: not an argument of {cls.__name__}() ({hint})"


class _Arguments:
    """Buffer._arguments' context (a class: a generator-based one costs the hot path more)."""

    __slots__ = ("gate", "call", "x", "kernels")

    def __init__(self, gate: ArrivalGate, call: str, x, kernels: bool):
        self.gate, self.call, self.x, self.kernels = gate, call, x, kernels

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, Exception):
            first = self.x[0] if isinstance(self.x, (tuple, list)) and self.x else self.x
            if not (isinstance(first, torch.Tensor) and first.is_cuda and self.kernels):
                self.gate.refuse(self.call, f"{exc_type.__name__}: {exc}")
        return False


def _check_same_topk(topk_idx: torch.Tensor, dispatched: torch.Tensor) -> None:
    """A low-latency combine sums the rows of the experts its dispatch sent each token to."""
    if torch.equal(topk_idx, dispatched):
        return
    token, slot = (topk_idx != dispatched).nonzero()[0].tolist()
    raise ValueError(
        f"topk_idx: differs from the topk_idx given to this handle's low_latency_dispatch (token {token}, slot "
        f"{slot}: {int(topk_idx[token, slot])}, the dispatch had {int(dispatched[token, slot])}); pass the "
        "dispatch's topk_idx"
    )


def _by_rank(values) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _refuse_wait_cost_stats(name: str, stats: Optional[torch.Tensor]) -> None:
    """A statistics tensor moe_ep would leave unwritten is refused rather than silently left stale."""
    if stats is not None:
        raise NotImplementedError(
            f"{name}: moe_ep does not measure the time each rank waits for each source rank's rows; "
            f"pass {name}=None (cumulative_local_expert_recv_stats of low_latency_dispatch counts the "
            "received tokens per local expert)"
        )

def default_config_size_hints(hidden_bytes: int, num_ranks: int) -> Tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) for a Buffer whose dispatches and combines of rows of hidden_bytes
    run on their default configs (Buffer.get_dispatch_config / get_combine_config at Buffer.num_sms): each
    call has its own window sizes, so the larger of the two configs' hints (2 ranks' combine needs ~4x
    Config()'s)."""
    configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
    return (max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for c in configs),
            max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for c in configs))
