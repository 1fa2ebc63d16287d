"""Rank functions for the megatron-core integration tests (CPU ranks with gloo; moe_forward_backward and
chunked_moe_layer also on CUDA ranks, where moe_ep's kernels move the tokens)."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from moe_ep.megatron.cpu_support import enable_cpu_execution


def _setup(num_experts: int, topk: int, hidden: int, dispatcher_type: str, tp: int = 1, cuda: bool = False,
           **config_kw):
    """Groups laid out as megatron does: rank = ep_rank * tp + tp_rank (expert TP fastest)."""
    if not cuda:
        enable_cpu_execution(force=True)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from moe_ep.megatron.seeded_layer import moe_layer_config
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = world // tp
    tp_groups = [dist.new_group([e * tp + t for t in range(tp)]) for e in range(ep)]
    ep_groups = [dist.new_group([e * tp + t for e in range(ep)]) for t in range(tp)]
    pg = ProcessGroupCollection()
    pg.tp_ep = dist.group.WORLD
    pg.ep, pg.expt_tp, pg.tp = ep_groups[rank % tp], tp_groups[rank // tp], tp_groups[rank // tp]
    config = moe_layer_config(num_experts, topk, hidden, dispatcher_type, ep, **config_kw)
    return config, pg


def _dispatcher(config, pg, num_experts, tp: int = 1):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher
    from moe_ep.megatron import MoEEPTokenDispatcher
    ep_rank = dist.get_rank() // tp
    local = num_experts // (dist.get_world_size() // tp)
    cls = {"deepep": MoEEPTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher,
           "flex": MoEFlexTokenDispatcher}[config.moe_token_dispatcher_type]
    return cls(local, [ep_rank * local + i for i in range(local)], config=config, pg_collection=pg)


def moe_forward_backward(seed: int, num_experts: int, topk: int, hidden: int, dispatcher_type: str,
                         num_tokens: int, tp: int = 1, pad_for_fp8: bool = False, drop: float = 0.0,
                         cuda: bool = False, moe_ep_options: dict = None, blockwise_fp8: bool = False,
                         dtype: torch.dtype = torch.float32, **config_kw):
    """Router -> dispatcher phases -> toy experts -> combine; returns output and gradients (on the CPU, in
    float32; the tokens and expert weights in `dtype`, the dense reference in float32 from the same values).
    With tp > 1 each rank of an expert's TP group holds a share of its weight (shares sum to the weight),
    so the combined output is the whole expert's. cuda: the tensors live on this rank's GPU.
    moe_ep_options: moe_ep's options (moe_ep.megatron.options) set on the config as attributes, which
    TransformerConfig's constructor does not take. blockwise_fp8: the config says fp8 with the blockwise
    recipe (set after construction, which would need transformer-engine), so "auto" sends fp8."""
    config, pg = _setup(num_experts, topk, hidden, dispatcher_type, tp=tp, cuda=cuda, **config_kw)
    for name, value in (moe_ep_options or {}).items():
        setattr(config, name, value)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if blockwise_fp8:
        config.fp8, config.fp8_recipe = "e4m3", "blockwise"
    if pad_for_fp8:   # set after construction: fp8 itself would need transformer-engine
        config.fp8, config.moe_router_padding_for_quantization = "e4m3", True
        config.fp8_recipe = "blockwise" if blockwise_fp8 else "delayed"
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_rank, tp_rank = rank // tp, rank % tp
    local = num_experts // (world // tp)
    share = (tp_rank + 1) / (tp * (tp + 1) / 2)
    dispatcher = _dispatcher(config, pg, num_experts, tp)
    g = torch.Generator().manual_seed(seed)
    weights = (torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    g.manual_seed(seed * 31 + rank + 1)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype).requires_grad_(True)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(device).requires_grad_(True)
    upstream = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    scores = torch.softmax(logits, dim=-1)
    top_p, top_i = scores.topk(topk, dim=-1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=device).scatter(1, top_i, True)
    probs = torch.zeros(num_tokens, num_experts, device=device).scatter(1, top_i, top_p)
    if drop:   # what capacity limits do: some routed (token, expert) pairs are dropped
        kept = (torch.rand(num_tokens, num_experts, generator=g) >= drop).to(device)
        routing_map, probs = routing_map & kept, probs * kept

    h, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    h, tokens_per_expert, p = dispatcher.dispatch_postprocess(h, p)
    outs, start = [], 0
    for j, count in enumerate(tokens_per_expert.tolist()):
        rows = slice(start, start + count)
        expert = ep_rank * local + j
        outs.append((h[rows] @ (weights[expert] * share)) * p[rows].unsqueeze(1).to(h.dtype))
        start += count
    y = torch.cat(outs) if outs else h[:0]
    y = dispatcher.combine_preprocess(y)
    y = dispatcher.token_combine(y)
    out = dispatcher.combine_postprocess(y)
    (out * upstream).sum().backward()

    # The same layer, dense, on this rank alone.
    x_ref = x.detach().float().requires_grad_(True)
    logits_ref = logits.detach().clone().requires_grad_(True)
    p_ref = torch.softmax(logits_ref, dim=-1)
    mask = routing_map.float()
    dense = torch.einsum("th,ehk,te->tk", x_ref, weights.float(), p_ref * mask)
    (dense * upstream.float()).sum().backward()
    result = dict(out=out.detach(), grad_x=x.grad, grad_logits=logits.grad, ref_out=dense.detach(),
                  ref_grad_x=x_ref.grad, ref_grad_logits=logits_ref.grad)
    return dict({k: v.float().cpu() for k, v in result.items()}, tokens_per_expert=tokens_per_expert.tolist())


def flex_on_moe_ep(seed: int, num_experts: int, topk: int, hidden: int, num_tokens: int):
    """megatron's own flex dispatcher with backend "deepep", running on moe_ep via install_as_deep_ep."""
    enable_cpu_execution(force=True)
    from moe_ep.megatron import install_as_deep_ep
    install_as_deep_ep()
    return moe_forward_backward(seed, num_experts, topk, hidden, "flex", num_tokens,
                                moe_flex_dispatcher_backend="deepep")


def _moe_layer(config, num_experts: int):
    """megatron's MoELayer for config, made after the same seeds every time (moe_ep.megatron.seeded_layer)."""
    from moe_ep.megatron.seeded_layer import seeded_moe_layer
    return seeded_moe_layer(config, num_experts)


def build_moe_layer(num_experts: int, topk: int, hidden: int, dispatcher_type: str = "deepep",
                    shared_experts: bool = False):
    """TransformerConfig(moe_token_dispatcher_type=...) -> an MoELayer; its output and input gradient
    on fixed data (the same parameters for every dispatcher type: same seeds, same construction order)."""
    extra = dict(moe_shared_expert_intermediate_size=hidden, add_bias_linear=False) if shared_experts else {}
    config, _ = _setup(num_experts, topk, hidden, dispatcher_type, ffn_hidden_size=2 * hidden, **extra)
    layer = _moe_layer(config, num_experts)
    g = torch.Generator().manual_seed(99 + dist.get_rank())
    x = torch.randn(6, 2, hidden, generator=g, requires_grad=True)
    out, _ = layer(x)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return type(layer.token_dispatcher).__name__, out.detach(), x.grad


def group_limited_layout(seed: int, num_experts: int, topk: int, ranks_per_node: int, group_topk: int):
    """megatron's group-limited routing with groups = nodes, then moe_ep's layout of the result."""
    enable_cpu_execution(force=True)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from moe_ep import Buffer
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    logits = torch.randn(64, num_experts, generator=g)
    probs, routing_map = topk_routing_with_score_function(
        logits, topk, num_groups=world // ranks_per_node, group_topk=group_topk, score_function="sigmoid")
    topk_idx = routing_map.float().topk(topk, dim=1).indices
    buffer = Buffer(dist.group.WORLD, ranks_per_node=ranks_per_node)
    _, per_node, _, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    nodes_per_token = in_rank.view(-1, world // ranks_per_node, ranks_per_node).any(-1).sum(-1)
    return int(nodes_per_token.max()), int(per_node.sum()), int(nodes_per_token.sum())


def group_limited_network_bytes(seed: int, num_experts: int, topk: int, hidden: int, ranks_per_node: int,
                                group_topk: int):
    """megatron's group-limited routing (groups = nodes), one dispatch and combine of bf16 rows on a
    Buffer over those nodes: (Buffer.stats' network_bytes, the rows that leave this rank's node once per
    destination node, once per destination rank, once per top-k pick)."""
    from .rank_fns import device
    if device().type == "cpu":  # it stands in for CUDA calls, which CUDA ranks make for real
        enable_cpu_execution(force=True)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from moe_ep import Buffer
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = world // ranks_per_node
    g = torch.Generator().manual_seed(seed + rank)
    logits = torch.randn(64, num_experts, generator=g)
    _, routing_map = topk_routing_with_score_function(
        logits, topk, num_groups=nodes, group_topk=group_topk, score_function="sigmoid")
    topk_idx = routing_map.float().topk(topk, dim=1).indices.to(device())
    rdma = 0
    if device().type == "cuda":
        rdma = Buffer.get_internode_rdma_size_hint(64, hidden, world, ranks_per_node, topk)
    buffer = Buffer(dist.group.WORLD, 1 << 26, rdma, ranks_per_node=ranks_per_node, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    x = torch.randn(64, hidden, generator=g).to(torch.bfloat16).to(device())
    weights = torch.rand(64, topk, generator=g).to(device())
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                 topk_weights=weights)
    network = buffer.stats()["network_bytes"]
    buffer.destroy()
    mine = rank // ranks_per_node
    other_nodes = torch.arange(nodes) != mine
    in_node = in_rank.cpu().view(64, nodes, ranks_per_node).any(-1)
    pick_node = topk_idx.cpu() // (num_experts // world) // ranks_per_node
    return (network, int(in_node[:, other_nodes].sum()),
            int(in_rank.cpu()[:, (torch.arange(world) // ranks_per_node) != mine].sum()),
            int(((topk_idx.cpu() >= 0) & (pick_node != mine)).sum()))


def layers_share_a_buffer(seed: int, num_experts: int, topk: int, hidden: int, num_tokens: int) -> bool:
    """Two MoE layers' dispatchers over one group dispatch and combine in turn: whether they used one Buffer,
    and whether moe_ep.megatron.shared_buffers() lists it."""
    from moe_ep.megatron import shared_buffers
    config, pg = _setup(num_experts, topk, hidden, "deepep")
    layers = [_dispatcher(config, pg, num_experts) for _ in range(2)]
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    buffers = []
    for dispatcher in layers:
        x = torch.randn(num_tokens, hidden, generator=g)
        top_i = torch.rand(num_tokens, num_experts, generator=g).topk(topk, dim=-1).indices
        routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, top_i, True)
        probs = torch.rand(num_tokens, num_experts, generator=g) * routing_map
        h, p = dispatcher.token_dispatch(*dispatcher.dispatch_preprocess(x, routing_map, probs))
        h, _, p = dispatcher.dispatch_postprocess(h, p)
        dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(h * p.unsqueeze(1))))
        buffers.append(dispatcher._state.buffer)
    return buffers[0] is buffers[1] and any(buffer is buffers[0] for buffer in shared_buffers())


def shared_expert_layer(num_experts: int, topk: int, hidden: int, dispatcher_type: str, overlap: bool,
                        gate: bool = False):
    """An MoELayer with shared experts (moe_shared_expert_overlap as asked): its output, the input's
    gradient and every parameter's gradient on fixed data (same seeds, same parameters either way)."""
    config, _ = _setup(num_experts, topk, hidden, dispatcher_type, ffn_hidden_size=2 * hidden,
                       moe_shared_expert_intermediate_size=hidden, add_bias_linear=False,
                       moe_shared_expert_overlap=overlap, moe_shared_expert_gate=gate)
    layer = _moe_layer(config, num_experts)
    assert (layer.token_dispatcher.shared_experts is not None) == overlap
    g = torch.Generator().manual_seed(77 + dist.get_rank())
    x = torch.randn(6, 2, hidden, generator=g, requires_grad=True)
    out, _ = layer(x)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


class _ElementwiseExperts(torch.nn.Module):
    """Experts computing each row elementwise (tanh(row * the expert's scale) * prob): a row's result is
    the same bits whatever other rows come with it, unlike a CPU GEMM's, whose blocking follows the rows."""

    def __init__(self, num_local_experts: int, hidden: int):
        super().__init__()
        g = torch.Generator().manual_seed(4321 + dist.get_rank())
        self.scale = torch.nn.Parameter(torch.randn(num_local_experts, hidden, generator=g))

    def forward(self, rows, tokens_per_expert, probs):
        scale = self.scale.repeat_interleave(tokens_per_expert.to(rows.device), dim=0, output_size=rows.shape[0])
        return torch.tanh(rows * scale) * probs.unsqueeze(1), None


def chunked_moe_layer(num_experts: int, topk: int, hidden: int, chunks: int, tokens_per_rank, seed: int,
                      capacity_factor=None, elementwise_experts: bool = False, moe_ep_options: dict = None,
                      late_delivery: bool = False, cuda: bool = False, **config_kw):
    """An MoELayer on "deepep" with moe_ep_overlap_chunks=chunks (same seeds, same parameters for every
    chunk count): its output, the input's gradient and every parameter's gradient on tokens_per_rank[rank]
    random tokens, the Buffer calls it made, and with late_delivery the forward's and the backward's
    logs of asynchronous calls (late_delivery.LateDelivery). capacity_factor: megatron drops routes past
    each expert's capacity (-1 slots). elementwise_experts: _ElementwiseExperts instead of megatron's
    expert MLPs. moe_ep_options: more of moe_ep's options, set on the config. cuda: the layer and the
    tokens live on this rank's GPU. config_kw: more TransformerConfig fields."""
    from .late_delivery import LateDelivery
    capacity = {} if capacity_factor is None else dict(moe_expert_capacity_factor=capacity_factor,
                                                       moe_token_drop_policy="probs")
    config, _ = _setup(num_experts, topk, hidden, "deepep", ffn_hidden_size=2 * hidden, cuda=cuda, **capacity,
                       **config_kw)
    for name, value in dict(moe_ep_options or {}, moe_ep_overlap_chunks=chunks).items():
        setattr(config, name, value)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    layer = _moe_layer(config, num_experts)
    if elementwise_experts:
        layer.experts = _ElementwiseExperts(layer.num_local_experts, hidden)
    layer = layer.to(device)
    if tokens_per_rank[dist.get_rank()] == 0:
        layer.router.gating = functools.partial(_gating_without_tokens, layer.router)
    assert layer.token_dispatcher.runs_in_chunks == (chunks > 1)
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = torch.randn(tokens_per_rank[dist.get_rank()], 1, hidden, generator=g).to(device).requires_grad_(True)
    upstream = torch.randn(x.shape, generator=g).to(device)
    buffer_before, before = _buffer_calls(layer.token_dispatcher.group)
    late = LateDelivery() if late_delivery else contextlib.nullcontext()
    with late:
        out, _ = layer(x)
        forward_log = list(late.log) if late_delivery else None
        (out * upstream).sum().backward()
    buffer_after, after = _buffer_calls(layer.token_dispatcher.group)
    if buffer_after is not buffer_before:  # replaced by a larger one before this step's first call
        before = {}
    calls = {kind: n - before.get(kind, 0) for kind, n in after.items() if n != before.get(kind, 0)}
    grads = {name: p.grad.cpu() for name, p in layer.named_parameters() if p.grad is not None}
    return dict(out=out.detach().cpu(), grad_x=x.grad.cpu(), grads=grads, calls=calls, forward_log=forward_log,
                backward_log=late.log[len(forward_log):] if late_delivery else None)


def _gating_without_tokens(router, input):
    """megatron-core's router gating (fp32, no bias) on a rank without tokens, which its own refuses (it
    reshapes 0 logits to [..., -1])."""
    logits = torch.mm(input.reshape(-1, input.shape[-1]).float(), router.weight.float().t())
    return logits.view(*input.shape[:-1], router.weight.shape[0])


def _buffer_calls(group):
    """The group's shared Buffer (None before it exists) and the calls it counted so far."""
    from moe_ep.megatron import dispatcher
    buffer = dispatcher._buffers.get(group)
    return buffer, {} if buffer is None else dict(buffer.stats()["calls"])


class _RecordingWriter:
    """A tensorboard SummaryWriter's add_scalar, kept in a dict: what megatron's track_moe_metrics writes."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = float(value)


def logged_expert_load(seed: int, num_experts: int, topk: int, hidden: int, micro_batches: int,
                       moe_ep_options: dict, cuda: bool = False):
    """Two MoE layers on "deepep" (layer numbers 1 and 2) run `micro_batches` forward and backward passes,
    then megatron's track_moe_metrics logs (per layer, loss_scale 1): what it wrote of moe_ep's entries,
    what its router routed (every rank's routing_map summed, per layer), and whether each layer's dispatcher
    records metrics. cuda: the layers and tokens live on this rank's GPU."""
    import gc
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics
    from moe_ep.megatron.metrics import is_metric
    gc.collect()  # layers of earlier calls in this process must not log here
    tracker = get_moe_layer_wise_logging_tracker()
    for name in [name for name in tracker if is_metric(name)]:
        del tracker[name]
    config, _ = _setup(num_experts, topk, hidden, "deepep", cuda=cuda, ffn_hidden_size=2 * hidden)
    config.num_layers = 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    for name, value in moe_ep_options.items():
        setattr(config, name, value)
    layers = [_moe_layer(config, num_experts).to(device) for _ in range(2)]
    for number, layer in enumerate(layers, start=1):
        layer.set_layer_number(number)
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    routed = torch.zeros(2, num_experts, dtype=torch.long)
    for _ in range(micro_batches):
        h = torch.randn(5, 2, hidden, generator=g).to(device).requires_grad_(True)
        for index, layer in enumerate(layers):
            with torch.no_grad():
                probs, routing_map = layer.router(h.detach().view(-1, hidden))
            # Routes of a probability: capacity padding adds entries of probability 0 to megatron's map.
            routed[index] += (routing_map & (probs > 0)).sum(0).cpu()
            h, _ = layer(h)
        (h * torch.randn(h.shape, generator=g).to(device)).sum().backward()
    # An evaluation pass between two loggings adds nothing, as megatron's own MoE metrics.
    with torch.no_grad():
        h = torch.randn(5, 2, hidden, generator=g).to(device)
        for layer in layers:
            layer.eval()
            h, _ = layer(h)
            layer.train()
    dist.all_reduce(routed)
    writer = _RecordingWriter()
    track_moe_metrics(loss_scale=1.0, iteration=1, writer=writer, total_loss_dict={}, per_layer_logging=True,
                      track_names=[], num_layers=2)
    logged = {name: value for name, value in writer.scalars.items() if "moe_ep/" in name}
    return logged, routed, [layer.token_dispatcher.metrics is not None for layer in layers]
