"""Where the host time of one get_dispatch_layout call goes (one process, 8-rank layout, no peers).

    python -m moe_ep.bench.profile_layout_call
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_ep import Buffer, _native
from moe_ep.launch import free_port

from .timing import host_call_us


def main():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    idx = torch.rand(4096, 256, dtype=torch.float32, device="cpu").topk(8, dim=1).indices.cuda()
    buffer = Buffer(dist.group.WORLD)
    ops = _native.ops()
    sync = torch.cuda.synchronize
    rows = [
        ("torch.cuda.synchronize", lambda: None, sync),
        ("torch.empty (device)", lambda: torch.empty(4096, 8, dtype=torch.bool, device="cuda"), None),
        ("extension call (no sync)", lambda: ops.get_dispatch_layout(idx, 256, 8, 8), None),
        ("extension call + sync", lambda: ops.get_dispatch_layout(idx, 256, 8, 8), sync),
        ("Buffer call (1 rank) + sync", lambda: buffer.get_dispatch_layout(idx, 256), sync),
        ("Buffer call (1 rank), no sync", lambda: buffer.get_dispatch_layout(idx, 256), None),
    ]
    for name, fn, s in rows:
        print(f"{name:<32} {host_call_us(fn, iters=2000, warmup=100, sync=s):8.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
