"""Host time of one low-latency call (128 tokens, hidden 7168, top-8 of 256 experts, fp8), one process.

A decode step's dispatch and combine are short enough on the GPU that the Python call around them
counts. On a GPU: a one-rank Buffer with the kernels (send to itself), with and without waiting for
the device. With --stub-kernels (any machine): the Python layer alone, CPU tensors, the extension's
launches replaced by no-ops, data checks off as for CUDA tensors.

    python -m moe_ep.bench.profile_low_latency_call [--python-profile 15]
    python -m moe_ep.bench.profile_low_latency_call --stub-kernels

--python-profile N: then each call's N functions (Python and C, the extension's entry points and torch's
calls included) of the largest own time per call under cProfile, the device idle before each call.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

from moe_ep import Buffer
from moe_ep.backends.low_latency import LowLatencyBackend
from moe_ep.launch import free_port

from . import command_parser
from .timing import host_call_us, own_time_per_call, print_own_times

TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 256, 8


class _NoLaunches:
    """The extension's low-latency entry points, doing nothing; the send hands back the same outputs
    every call (the extension allocates them, outside the Python layer timed here)."""

    class LowLatencyCtx:
        def __init__(self, *args):
            pass

    def __init__(self):
        local, rows = EXPERTS, TOKENS
        self._outputs = (torch.empty(local, rows, HIDDEN, dtype=torch.float8_e4m3fn, device="cpu"),
                         torch.empty(local, rows, HIDDEN // 128, dtype=torch.float32, device="cpu"),
                         torch.zeros(local, dtype=torch.int32, device="cpu"),
                         torch.empty(local, rows, dtype=torch.int32, device="cpu"))
        self._combined = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device="cpu")

    def ll_dispatch_send(self, *args):
        return self._outputs

    COMBINE_IN_SLOT, COMBINE_STAGE, COMBINE_PUSH = "in_slot", "stage", "push"

    def ll_combine_send(self, ctx, x, recv_count, recv_src_info, num_topk, num_tokens, out, slot, how):
        return out if out is not None else self._combined

    def __getattr__(self, name):
        return lambda *args: None


def stub_kernels(buffer: Buffer) -> None:
    backend = LowLatencyBackend.__new__(LowLatencyBackend)
    backend.peers = types.SimpleNamespace(pointers=torch.zeros(1, dtype=torch.int64, device="cpu"), ranks_on_device=1,
                                          host_info=None, timeout_s=buffer.timeout_s, timeout_error=lambda: None, unreachable=[],
                                          puts_anywhere=False)
    backend.ops, backend.rank, backend.num_ranks, backend._pending, backend._contexts = _NoLaunches(), 0, 1, None, {}
    backend._shape, backend._combine_next, backend._combine_rows = None, 0, [None, None]
    buffer._low_latency = backend
    buffer._low_latency_backend = lambda x: backend
    buffer._check_data = lambda *a: False
    buffer._check_handle_backend = lambda *args: True


def main():
    parser = command_parser(__spec__, __doc__)
    parser.add_argument("--stub-kernels", action="store_true")
    parser.add_argument("--python-profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    device = "cpu" if args.stub_kernels else "cuda"
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.float32, device=device).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, EXPERTS, dtype=torch.float32, device=device).topk(TOPK, dim=1).indices
    topk_weights = torch.rand(TOKENS, TOPK, dtype=torch.float32, device=device)
    size = Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, 1, EXPERTS)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=EXPERTS)
    if args.stub_kernels:
        stub_kernels(buffer)
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS, use_fp8=True)
    if args.stub_kernels:
        handle.backend_state.received = True
    y = torch.randn(EXPERTS, TOKENS, HIDDEN, dtype=torch.float32, device=device).to(torch.bfloat16)
    sync = None if args.stub_kernels else torch.cuda.synchronize

    def dispatch():
        return buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS)

    def combine():
        return buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

    # (name, call, timed sync after it, untimed settle before it). Back to back, thousands of calls fill
    # the launch queue and then each launch waits for the device: "device idle" is the host's
    # own time.
    rows = [("low_latency_dispatch, no sync", dispatch, None, None),
            ("low_latency_combine, no sync", combine, None, None)]
    if sync is not None:
        rows += [
            ("low_latency_dispatch, device idle", dispatch, None, sync),
            ("low_latency_combine, device idle", combine, None, sync),
            ("low_latency_dispatch + sync", dispatch, sync, None),
            ("low_latency_combine + sync", combine, sync, None),
        ]
    what = "Python layer, launches stubbed" if args.stub_kernels else torch.cuda.get_device_name()
    print(f"low-latency call host time ({what}), median of 2000")
    for name, fn, after, before in rows:
        print(f"  {name:<34} {host_call_us(fn, iters=2000, warmup=100, sync=after, settle=before):8.1f} us")
    profiled = (("low_latency_dispatch", dispatch), ("low_latency_combine", combine)) if args.python_profile else ()
    for name, fn in profiled:
        # With the device idle before each call (its synchronize shows as a row of its own).
        settled = fn if sync is None else (lambda fn=fn: (sync(), fn()))
        print_own_times(name, own_time_per_call(settled, 2000, args.python_profile))
        if sync is not None:
            sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
