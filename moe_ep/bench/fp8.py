"""The 1x128 FP8 cast kernels against a device-to-device copy of the same bytes, in one run: moe_ep's own
cast (deep_ep's rule) and transformer-engine's blockwise rule (moe_ep.fp8_blockwise, the megatron
dispatcher's fp8 cast), with power-of-two and with float32 scales.

Bandwidth counts bytes read plus bytes written. Several input sets are rotated so the timing does not
measure the L2 cache (an H200 has 60 MB of it).

    python -m moe_ep.bench.fp8 --tokens 4096 --hidden 7168
"""
from __future__ import annotations

import json

import torch

from moe_ep import fp8
from moe_ep.fp8_blockwise import blockwise_cast_to_fp8

from . import command_parser
from .timing import cuda_kernel_us

NUM_SETS = 6


def main():
    parser = command_parser(__spec__, __doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--json")
    args = parser.parse_args()
    n, h = args.tokens, args.hidden
    xs = [torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(NUM_SETS)]
    copies = [torch.empty_like(x) for x in xs]
    state = {"i": 0}

    def rotate():
        # Advances at capture time: the captured graph walks through all input sets in turn.
        state["i"] = (state["i"] + 1) % NUM_SETS
        return state["i"]

    results = {}
    for name, fn, nbytes in [
        ("cast", lambda: fp8.per_token_cast_to_fp8(xs[rotate()]), n * h * 2 + n * h + n * h // 128 * 4),
        ("cast round_scale", lambda: fp8.per_token_cast_to_fp8(xs[rotate()], round_scale=True),
         n * h * 2 + n * h + n * h // 128 * 4),
        ("blockwise pow2", lambda: blockwise_cast_to_fp8(xs[rotate()]), n * h * 2 + n * h + n * h // 128 * 4),
        ("blockwise fp32", lambda: blockwise_cast_to_fp8(xs[rotate()], pow2_scales=False),
         n * h * 2 + n * h + n * h // 128 * 4),
        ("cast back", None, n * h + n * h // 128 * 4 + n * h * 2),
        ("copy of the input", lambda: copies[rotate()].copy_(xs[state["i"]]), 2 * n * h * 2),
    ]:
        if name == "cast back":
            pairs = [fp8.per_token_cast_to_fp8(x) for x in xs]
            fn = lambda: fp8.per_token_cast_back(*pairs[rotate()])  # noqa: E731
        us = cuda_kernel_us(fn)
        results[name] = dict(us=us, gbps=nbytes / us / 1e3)
    copy_bw = results["copy of the input"]["gbps"]
    print(f"{'op':<20} {'us':>8} {'GB/s':>8} {'of copy':>8}   ({n}x{h} bf16, {torch.cuda.get_device_name()})")
    for name, r in results.items():
        print(f"{name:<20} {r['us']:>8.1f} {r['gbps']:>8.0f} {r['gbps'] / copy_bw:>7.0%}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(dict(bench="fp8", tokens=n, hidden=h, results=results,
                                    device=torch.cuda.get_device_name())) + "\n")


if __name__ == "__main__":
    main()
