"""The DeepEP peer: DeepEP V1's Buffer timed on every rank with the inputs, the SM budget and the timing
moe_ep's benchmarks use (rank functions for a RankPool of its own, so that DeepEP's state and failures
stay out of moe_ep's ranks). DeepEP's own chunk configs for the rank count are kept, at moe_ep's budget.
"""
from __future__ import annotations

import torch.distributed as dist

from .inputs import intranode_inputs, low_latency_inputs, row_bytes
from .timing import cuda_kernel_us, device_sync, wall_seconds_per_call

BACKEND = "deep_ep"


def release(buffer) -> None:
    """Destroys a DeepEP Buffer once every rank is done with the peers' memory it maps. After a failure
    nothing is released here: the peer's ranks are stopped instead, and a barrier could wait forever."""
    device_sync()
    dist.barrier()
    buffer.destroy()


def intranode_rank(args, operations: list) -> list:
    """Rows (as moe_ep's intranode rows: GB/s of received bytes per call) of each DeepEP operation asked
    ("dispatch_fp8", "dispatch_bf16", their "_cached" forms from the first call's handle, "combine") at
    each SM budget of args.sms."""
    import deep_ep

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    x, x_fp8, topk_idx, topk_weights = intranode_inputs(args, "cpu" if args.cpu else "cuda")
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    results = []
    for num_sms in args.sms:
        deep_ep.Buffer.set_num_sms(num_sms)  # its recommended configs take the budget from here
        dispatch_config = deep_ep.Buffer.get_dispatch_config(num_ranks)
        combine_config = deep_ep.Buffer.get_combine_config(num_ranks)
        nvl = max(c.get_nvl_buffer_size_hint(args.hidden * 2, num_ranks) for c in (dispatch_config, combine_config))
        buffer = deep_ep.Buffer(dist.group.WORLD, nvl, 0, explicitly_destroy=True)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
        layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                      is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                      topk_weights=topk_weights)
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, config=dispatch_config, **layout)
        rows = recv_x.shape[0]
        y = recv_x.clone()
        calls = {
            "dispatch_fp8": lambda: buffer.dispatch(x_fp8, config=dispatch_config, **layout),
            "dispatch_bf16": lambda: buffer.dispatch(x, config=dispatch_config, **layout),
            "dispatch_fp8_cached": lambda: buffer.dispatch(x_fp8, handle=handle, config=dispatch_config),
            "dispatch_bf16_cached": lambda: buffer.dispatch(x, handle=handle, config=dispatch_config),
            "combine": lambda: buffer.combine(y, handle, topk_weights=recv_weights, config=combine_config),
        }
        for operation in operations:
            seconds = wall_seconds_per_call(calls[operation], args.warmup, args.iters)
            moved = rows * row_bytes(operation, args.hidden)
            results.append(dict(rank=rank, backend=BACKEND, sms=num_sms, mode=operation, us=seconds * 1e6,
                                rows=rows, bytes=moved, gbps=moved / seconds / 1e9))
        release(buffer)
    return results


def low_latency_rank(args, num_experts: int, seed: int) -> dict:
    """Wall time per call (us) of DeepEP's low-latency dispatch (fp8), combine and zero-copy combine, and
    with args.graph their device time from CUDA-graph replays, as moe_ep's low-latency benchmark times them."""
    import deep_ep

    num_ranks = dist.get_world_size()
    device = "cpu" if args.cpu else "cuda"
    x, topk_idx, topk_weights, y = low_latency_inputs(args, num_experts, seed, device)
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True)
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, args.tokens, num_experts, use_fp8=True)

    def dispatch():
        return buffer.low_latency_dispatch(x, topk_idx, args.tokens, num_experts, use_fp8=True)

    def combine():
        return buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

    def combine_in_place():  # the rows are read where get_next_low_latency_combine_buffer put them
        return buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=True)

    results = dict(dispatch_us=wall_seconds_per_call(dispatch, args.warmup, args.iters) * 1e6,
                   combine_us=wall_seconds_per_call(combine, args.warmup, args.iters) * 1e6)
    for _ in range(2):  # both zero-copy slots hold the expert outputs
        buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
        combine_in_place()
    results["combine_zero_copy_us"] = wall_seconds_per_call(combine_in_place, args.warmup, args.iters) * 1e6
    if args.graph and not args.cpu:
        dist.barrier()
        results["dispatch_graph_us"] = cuda_kernel_us(dispatch, calls=args.iters, replays=5)
        results["combine_graph_us"] = cuda_kernel_us(combine, calls=args.iters, replays=5)
        results["combine_zero_copy_graph_us"] = cuda_kernel_us(combine_in_place, calls=args.iters, replays=5)
    release(buffer)
    return results
