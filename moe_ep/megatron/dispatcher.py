"""A megatron-core token dispatcher on moe_ep.Buffer (`moe_token_dispatcher_type="deepep"`).

The six phases follow megatron's MoETokenDispatcher contract, so its overlap schedulers can interleave
one micro-batch's communication with another's compute: token_dispatch and token_combine start the
exchange on the Buffer's communication stream and return, and the post-processing phase that reads
the result first waits for it (on the portable backend, calls complete before they return and the
waits are free). Communication state lives in one small object (`CommState`, exchange.py) per
dispatch, which its backward keeps (megatron's micro-batch overlap runs it after the next micro-batch's
forward); the Buffer is one per process group, shared by every layer's dispatcher (`_buffer_for`).
Autograd: the backward of dispatch is a combine over the same handle, the backward of combine is a
cached dispatch. By default (options.moe_ep_arena) the Buffer keeps its arena: dispatches store their
rows once into regions recv_x owns, and the local unpermute writes into Buffer.empty_combine_input, a
region the combine reads where it lies (both one pass, both ordinary tensors).
FP8 dispatch (options.moe_ep_fp8_dispatch): token_dispatch casts the tokens once with transformer-engine's
1x128 quantizer and sends (e4m3, scales); autograd follows a zero-stride stand-in for the received
rows, and dispatch_postprocess permutes the fp8 rows with their scales (_PermuteFp8) and dequantises
them (exactly, with the recipe's power-of-two scales) for the experts: TE's grouped GEMM (2.20) takes no
quantised input, and its own cast of those rows gives back the same fp8 values. Gradients travel in bf16.
Chunks (options.moe_ep_overlap_chunks > 1): token_dispatch splits the tokens and starts the first chunk's
dispatch, MoELayer hands its experts to experts_in_chunks (register.py), which runs each chunk's experts
between that chunk's dispatch and combine, and combine_postprocess waits for every chunk's combine. The
backward is pipelined the same way (chunks.py).
Capacity (megatron's moe_expert_capacity_factor with moe_pad_expert_input_to_capacity): every size is
known on the host beforehand (capacity.py), so the dispatch runs with num_worst_tokens and each local
expert gets a fixed block of rows: the forward and backward never wait for the device on the host.
Otherwise the dispatch's per-expert counts reach the host (the one synchronisation a dispatch makes),
as megatron's experts read them there.
Metrics (options.moe_ep_log_metrics): each dispatcher counts its tokens per expert and times its calls and
waits into a LayerMetrics (metrics.py), which megatron's MoE logging publishes.
"""

from __future__ import annotations

import functools
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization, pad_routing_map, permute, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from ..buffer import Buffer, default_config_size_hints
from ..checks import FP8_BLOCK, debug_checks_enabled
from ..fp8_blockwise import blockwise_cast_to_fp8, blockwise_dequantize
from ..mps import bf16_share_warning, missing_sm_share
from ..te import check_te_blockwise_format, recipe_scaling
from .capacity import FixedRows, capacity_padded, fixed_rows, layer_capacity
from .chunks import ChunkedBackward, Chunks, JoinChunks, split_into_chunks
from .exchange import CommState, async_args, timed_call
from .metrics import LayerMetrics, check_megatron_publishes
from .options import check_fp8_dispatch_recipe, fp8_dispatch_wanted, options_for


def phase_range(name: str, prefix: str = "moe_ep"):
    """Names a method's time `<prefix>.<name>` in profiler traces (torch.profiler, and nsys with
    --pytorch=autograd-nvtx), so a step's profile shows where a dispatcher's time goes
    (examples/train_moe.py --profile also labels megatron's alltoall dispatcher with it)."""

    def wrap(method):
        label = f"{prefix}.{name}"

        @functools.wraps(method)
        def traced(*args, **kwargs):
            if not torch.autograd._profiler_enabled():  # a range costs ~7 us of host time even unrecorded
                return method(*args, **kwargs)
            with torch.profiler.record_function(label):
                return method(*args, **kwargs)

        return traced

    return wrap


# One Buffer per process group, shared by every MoE layer's dispatcher (DeepEP's megatron integration
# shares one too): one communication stream orders all layers' calls, and the peers' memory is mapped
# once instead of once a layer.
_buffers: Dict[dist.ProcessGroup, Buffer] = {}


def _buffer_for(group, hidden_bytes: int, arena: bool = True, timeout_s: Optional[float] = None) -> Buffer:
    """The group's shared Buffer, replaced (collectively: every rank asks for the same sizes) by a larger
    one when it lacks room for rows of hidden_bytes, or by one with (the Buffer's own, growing) or
    without an arena, as asked."""
    nvl, rdma = default_config_size_hints(hidden_bytes, group.size())
    current = _buffers.get(group)
    if (
        current is not None
        and current.num_nvl_bytes >= nvl
        and current.num_rdma_bytes >= rdma
        and (current.num_arena_bytes != 0) == arena
    ):
        return current
    if current is not None:  # a dispatcher's handles keep it alive while their calls need it
        nvl, rdma = max(nvl, current.num_nvl_bytes), max(rdma, current.num_rdma_bytes)
    _buffers[group] = Buffer(group, nvl, rdma, num_arena_bytes=None if arena else 0, timeout_s=timeout_s)
    return _buffers[group]


@functools.lru_cache(maxsize=None)
def _warn_once_if_sharing_without_sm_share(ranks_on_gpu: int) -> None:
    """Training beside the kernels on ranks that share a GPU needs each rank's SMs capped (moe_ep.mps)."""
    message = missing_sm_share(ranks_on_gpu)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=2)


@functools.lru_cache(maxsize=None)
def _warn_once_if_bf16_under_sm_share(bf16_on_gpu: bool) -> None:
    """bf16 GEMMs under an MPS SM share computed wrong values on an H200 (moe_ep.mps.BF16_UNDER_SHARE)."""
    message = bf16_share_warning(bf16_on_gpu)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=2)


@functools.lru_cache(maxsize=None)
def _warn_once_bf16(hidden: int) -> None:
    warnings.warn(f"moe_ep_fp8_dispatch='auto': the hidden size {hidden} is not a multiple of {FP8_BLOCK}; "
                  "the tokens are sent in their own dtype", RuntimeWarning, stacklevel=3)


def shared_buffers() -> List[Buffer]:
    """The Buffers the dispatchers share, one per process group, each made at its group's first dispatch:
    their topology() says which backend serves the calls, their stats() what the calls moved."""
    return list(_buffers.values())


def progress_reports() -> List[str]:
    """Every shared Buffer's progress_report(): where this rank's calls stand, for a stalled step's dump."""
    return [report for report in (buffer.progress_report() for buffer in list(_buffers.values())) if report]


def _start_dispatch(state: CommState, x, topk_weights, topk_idx, num_experts: int) -> None:
    """Starts the dispatch of x's rows on the Buffer's communication stream, leaving the received rows in
    `state` for _Dispatch; dispatch_postprocess waits for state.pending before reading them."""
    buffer = state.buffer
    # Under a capacity the received rows are sized beforehand: no host synchronisation.
    num_worst_tokens = state.fixed.received if state.fixed is not None else 0
    with torch.no_grad():  # autograd's node for the exchange is _Dispatch's
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        payload = x if state.fp8_scaling is None else blockwise_cast_to_fp8(x, *state.fp8_scaling)
        with timed_call(state.metrics, buffer, x.device, asynchronous=True) as time_the_wait:
            recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
                payload,
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=topk_idx,
                topk_weights=topk_weights,
                num_worst_tokens=num_worst_tokens,
                **async_args(),
            )
    state.timed_wait = x.device if time_the_wait else None
    state.handle, state.recv_topk_idx, state.tokens_per_expert = handle, recv_idx, counts
    state.received = (recv_x, recv_w)
    bf16 = x.is_cuda and x.dtype == torch.bfloat16
    if not bf16:  # bf16 runs without a share (moe_ep.mps.BF16_UNDER_SHARE)
        _warn_once_if_sharing_without_sm_share(buffer.ranks_on_this_gpu)
    _warn_once_if_bf16_under_sm_share(bf16)
    state.pending = event  # dispatch_postprocess waits for it before reading the received rows


class _Dispatch(torch.autograd.Function):
    """The rows a dispatch started by _start_dispatch receives, as a function of the rows and weights
    sent. Applied where the rows are read, so that autograd runs its backward right after the backward
    of the experts that read them. Backward: the gradient's combine over the same handle, synchronous,
    or in chunks started for ChunkedBackward to wait for."""

    @staticmethod
    def forward(ctx, x, topk_weights, state: CommState, chunked: Optional[ChunkedBackward]):
        recv_x, recv_w = state.received
        state.received = None
        if state.fp8_scaling is not None:
            state.recv_fp8 = recv_x
            # Autograd's stand-in for the received rows (no memory): their gradient comes back through it.
            recv_x = x.new_zeros(()).expand(recv_x[0].shape)
        ctx.state, ctx.handle, ctx.chunked = state, state.handle, chunked
        return recv_x, recv_w

    @staticmethod
    @phase_range("dispatch_backward")
    def backward(ctx, grad_recv_x, grad_recv_w):
        state = ctx.state
        # Entries of other ranks' experts were constants (0) in the forward: no gradient flows there.
        grad_recv_w = torch.where(state.recv_topk_idx >= 0, grad_recv_w, 0).float()
        device = grad_recv_x.device
        if ctx.chunked is None:
            with timed_call(state.metrics, state.buffer, device, asynchronous=False):
                grad_x, grad_w, _ = state.buffer.combine(grad_recv_x.contiguous(), ctx.handle, topk_weights=grad_recv_w)
        else:
            with timed_call(state.metrics, state.buffer, device, asynchronous=True) as time_the_wait:
                grad_x, grad_w, event = state.buffer.combine(grad_recv_x.contiguous(), ctx.handle,
                                                             topk_weights=grad_recv_w, **async_args())
            ctx.chunked.combine_started(event, state, device if time_the_wait else None)
        return grad_x, grad_w, None, None


class _PermuteFp8(torch.autograd.Function):
    """megatron's permute of the received rows, on the fp8 rows and their scales together, dequantised into
    the stand-in's dtype. Backward: the gradient rows summed back into the received rows (megatron's
    unpermute), in the gradient's dtype."""

    @staticmethod
    def forward(ctx, stand_in, state: CommState, sorted_indices):
        data, scales = state.recv_fp8
        state.recv_fp8 = None
        fp8_dtype = data.dtype
        data = data.view(torch.uint8).index_select(0, sorted_indices)
        scales = scales.index_select(0, sorted_indices)
        ctx.routed_rows = state.routed_rows
        if state.routed_rows is not None:  # padding rows may be taken from unwritten rows: zero, not garbage
            data = data.masked_fill(~state.routed_rows.unsqueeze(1), 0)
            scales = scales.masked_fill(~state.routed_rows.unsqueeze(1), 0)
        data = data.view(fp8_dtype)
        ctx.save_for_backward(sorted_indices)
        ctx.num_rows = stand_in.shape[0]
        return blockwise_dequantize(data, scales, stand_in.dtype)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        if ctx.routed_rows is not None:  # padding rows are constants (zeros): no gradient flows from them
            grad = grad.masked_fill(~ctx.routed_rows.unsqueeze(1), 0)
        rows = grad.new_zeros(ctx.num_rows, grad.shape[-1])
        return rows.index_add_(0, sorted_indices, grad), None, None


class _Into:
    """A tensor handed to an autograd Function as a plain argument (not an input it differentiates)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _UnpermuteInto(torch.autograd.Function):
    """megatron's unpermute without probs (each received token's rows of the local experts summed back
    into its row), written into `into` (a tensor in the Buffer's arena) instead of a new tensor."""

    @staticmethod
    def forward(ctx, permuted, sorted_indices, into: _Into):
        rows = into.tensor
        rows.zero_()
        rows.index_add_(0, sorted_indices, permuted)  # scatter_add's sums, in the same order
        ctx.save_for_backward(sorted_indices)
        return rows.as_strided(rows.shape, rows.stride())  # an alias: autograd's output, the Buffer's memory

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None


class _Combine(torch.autograd.Function):
    """Backward: the gradient's cached dispatch, synchronous, or in chunks (chunk = (ChunkedBackward, its
    index)) started ahead by ChunkedBackward."""

    @staticmethod
    def forward(ctx, x, state: CommState, chunk: Optional[Tuple[ChunkedBackward, int]] = None):
        with timed_call(state.metrics, state.buffer, x.device, asynchronous=True) as time_the_wait:
            combined, _, event = state.buffer.combine(x.contiguous(), state.handle, **async_args())
        state.pending = event  # combine_postprocess waits for it before the result is read
        state.timed_wait = x.device if time_the_wait else None
        ctx.buffer, ctx.handle, ctx.chunk, ctx.metrics = state.buffer, state.handle, chunk, state.metrics
        return combined

    @staticmethod
    @phase_range("combine_backward")
    def backward(ctx, grad):
        if ctx.chunk is not None:
            chunked, index = ctx.chunk
            return chunked.received_gradient(index), None, None
        with timed_call(ctx.metrics, ctx.buffer, grad.device, asynchronous=False):
            recv_grad = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)[0]
        return recv_grad, None, None


class MoEEPTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher for `moe_token_dispatcher_type="deepep"`: one moe_ep.Buffer over the TPxEP
    group; tokens routed to the experts of a TP group go to every rank of that group."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.group = self.tp_ep_group
        self.num_experts = self.tp_size * config.num_moe_experts
        self.router_topk = self.tp_size * config.moe_router_topk
        self.options = options_for(config)
        # megatron's drop-and-pad mode: the experts' inputs have fixed sizes, so nothing waits for counts.
        self.capacity_padded = capacity_padded(config)
        check_fp8_dispatch_recipe(self.options, config)
        if fp8_dispatch_wanted(self.options, config):
            check_te_blockwise_format()  # the rows TE's experts get are its own cast's, or nothing runs
        if self.options.moe_ep_num_sms:
            Buffer.set_num_sms(self.options.moe_ep_num_sms)
        self.metrics: Optional[LayerMetrics] = None
        if self.options.moe_ep_log_metrics:
            check_megatron_publishes()
            num_layers = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
            self.metrics = LayerMetrics(local_expert_indices, config.num_moe_experts, num_layers, self.ep_group)
        self._state = CommState()
        self._chunks: Optional[Chunks] = None

    @property
    def runs_in_chunks(self) -> bool:
        """moe_ep_overlap_chunks > 1: the MoE layer hands its experts to experts_in_chunks (register.py)."""
        return self.options.moe_ep_overlap_chunks > 1

    def set_shared_experts(self, shared_experts):
        """moe_shared_expert_overlap: the MoE layer hands its SharedExpertMLP over, and its stages run
        between this dispatcher's phases as in megatron's alltoall dispatcher (pre_forward_comm, fc1
        while the dispatch is under way, fc2 while the combine is, the output added after it). They run
        on SharedExpertMLP's own stream, the exchanges on the Buffer's communication stream, so on a
        GPU both overlap the shared expert; on CPU ranks megatron's stream calls meet cpu_support's
        stand-ins."""
        super().set_shared_experts(shared_experts)

    # ---------------------------------------------------------------- dispatch
    @phase_range("dispatch_preprocess")
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        num_tokens = hidden_states.shape[0]
        world = self.tp_size * self.ep_size
        # Expand [tokens, experts] to the TPxEP group: every TP rank of an expert's group gets the token.
        routing_map = (
            routing_map.reshape(num_tokens, self.ep_size, 1, self.num_local_experts)
            .expand(-1, -1, self.tp_size, -1)
            .reshape(num_tokens, world * self.num_local_experts)
        )
        probs = (
            probs.reshape(num_tokens, self.ep_size, 1, self.num_local_experts)
            .expand(-1, -1, self.tp_size, -1)
            .reshape(num_tokens, world * self.num_local_experts)
        )
        # Routed entries first: the k largest of the masked probabilities; unrouted slots (dropped by
        # capacity) become -1 with weight 0.
        masked = probs.masked_fill(~routing_map, -1.0)
        token_probs, token_idx = torch.topk(masked, min(self.router_topk, masked.shape[1]), dim=-1)
        routed = token_probs >= 0
        self._topk_idx = torch.where(routed, token_idx, -1)
        token_probs = torch.where(routed, token_probs, 0.0)
        self._probs_dtype = probs.dtype
        return hidden_states, token_probs.float()

    @phase_range("token_dispatch")
    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.runs_in_chunks:
            self._chunks = self._split_into_chunks(hidden_states, probs)
            self._dispatch_chunk(0)
            return hidden_states, probs
        # A new state for every dispatch: autograd keeps this one for the backward, which megatron's
        # micro-batch overlap (and any pipeline schedule) runs after the next micro-batch's forward.
        self._state = CommState()
        self._prepare(self._state, hidden_states)
        self._state.fixed = self._fixed_rows(hidden_states.shape[0], hidden_states.shape[0])
        _start_dispatch(self._state, hidden_states, probs, self._topk_idx, self.num_experts)
        return _Dispatch.apply(hidden_states, probs, self._state, None)

    def _prepare(self, state: CommState, hidden_states: torch.Tensor) -> None:
        """The group's Buffer, sized for these rows, and the fp8 recipe's scaling if they travel as fp8."""
        hidden_bytes = hidden_states.shape[1] * max(hidden_states.element_size(), 2)
        state.buffer = _buffer_for(self.group, hidden_bytes, self.options.moe_ep_arena, self.options.moe_ep_timeout_s)
        state.fp8_scaling = recipe_scaling() if self._fp8_dispatch(hidden_states.shape[1]) else None
        state.metrics = self.metrics if self.metrics is not None and self.metrics.records_now() else None

    def _split_into_chunks(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Chunks:
        states = [CommState() for _ in range(self.options.moe_ep_overlap_chunks)]
        for state in states:
            self._prepare(state, hidden_states)
        chunks = split_into_chunks(hidden_states, probs, self._topk_idx, states)
        for state, part in zip(states, chunks.hidden_states):
            state.fixed = self._fixed_rows(hidden_states.shape[0], part.shape[0])
        return chunks

    def _fixed_rows(self, num_tokens: int, chunk_tokens: int) -> Optional[FixedRows]:
        """Under a capacity, the sizes of a dispatch of chunk_tokens of the layer's num_tokens tokens (the
        capacity is the layer's: megatron's router applied it to all of them); else None."""
        if not self.capacity_padded:
            return None
        alignment = 1
        if self.config.moe_router_padding_for_quantization:
            alignment = get_align_size_for_quantization(self.config)
        return fixed_rows(layer_capacity(self.config, num_tokens), chunk_tokens, self.num_local_experts,
                          self.group.size(), alignment)

    def _dispatch_chunk(self, index: int) -> None:
        chunks = self._chunks
        _start_dispatch(chunks.states[index], chunks.hidden_states[index], chunks.probs[index], chunks.topk_idx[index],
                        self.num_experts)

    def _fp8_dispatch(self, hidden: int) -> bool:
        if not fp8_dispatch_wanted(self.options, self.config):
            return False
        if self.options.moe_ep_fp8_dispatch == "auto" and self.group.size() == 1:
            return False  # no token leaves the rank: the cast would save no byte and cost its passes
        if hidden % FP8_BLOCK == 0:
            return True
        if self.options.moe_ep_fp8_dispatch == "on":
            raise ValueError(f"moe_ep_fp8_dispatch='on': the hidden size must be a multiple of {FP8_BLOCK}, "
                             f"got {hidden}")
        _warn_once_bf16(hidden)
        return False

    @phase_range("dispatch_postprocess")
    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.runs_in_chunks:
            raise RuntimeError("moe_ep_overlap_chunks > 1: each chunk's experts run in experts_in_chunks, "
                               "which MoELayer.routed_experts_compute calls instead of dispatch_postprocess")
        if self.shared_experts is not None:
            # Queued before the wait: the shared expert's fc1 runs while the dispatch is under way.
            self.shared_experts.linear_fc1_forward_and_act(hidden_states)
        return self._permute(self._state, hidden_states, probs)

    def _permute(self, state: CommState, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The received rows (once the dispatch is done), grouped by local expert as megatron's experts take them."""
        state.wait()
        routing_map, expert_probs = self._local_multihot(state.recv_topk_idx, probs)
        if state.fixed is not None:
            tokens_per_expert = self._fixed_blocks(state, routing_map, expert_probs)
            counts = [state.fixed.per_expert] * self.num_local_experts
        else:
            # Host counts, as megatron's alltoall dispatcher returns them (its experts read them on the host).
            tokens_per_expert = torch.tensor(state.tokens_per_expert, dtype=torch.long, device="cpu")
            if state.metrics is not None:
                state.metrics.count_tokens(state.tokens_per_expert)
            if self.config.moe_router_padding_for_quantization:
                routing_map, tokens_per_expert = self._pad_for_quantization(routing_map, tokens_per_expert)
            counts = tokens_per_expert.tolist()
        state.received_shape = hidden_states.shape
        state.local_routing_map = routing_map
        num_out = sum(counts)
        # Fixed blocks: megatron's drop-and-pad permute (each expert's rows, then padding rows; no sync).
        fixed = dict(drop_and_pad=True) if state.fixed is not None else {}
        if state.recv_fp8 is not None:
            # megatron's permute on rows of no width gives the order and the probabilities; the fp8 rows follow.
            no_rows = torch.empty(hidden_states.shape[0], 0, device=hidden_states.device)
            _, permuted_probs, state.reversed_mapping = permute(no_rows, routing_map, probs=expert_probs,
                                                                num_out_tokens=num_out, **fixed)[:3]
            self._mark_routed_rows(state)
            permuted = _PermuteFp8.apply(hidden_states, state, state.reversed_mapping)
        else:
            # megatron-core 0.16 returns three values, 0.19 five (with padding info we do not use).
            permuted, permuted_probs, state.reversed_mapping = permute(
                hidden_states, routing_map, probs=expert_probs, num_out_tokens=num_out, **fixed
            )[:3]
            if self._mark_routed_rows(state):
                # Padding rows may come from rows no rank wrote (past the received ones): zeros instead.
                permuted = torch.where(state.routed_rows.unsqueeze(1), permuted, 0)
        if self.config.moe_router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        return permuted, tokens_per_expert, permuted_probs

    def _fixed_blocks(self, state: CommState, routing_map: torch.Tensor, expert_probs: torch.Tensor) -> torch.Tensor:
        """tokens_per_expert under a capacity: every local expert's block of rows, on the host as megatron's
        experts read it, known without the counts."""
        rows = state.fixed.per_expert
        if state.metrics is not None:
            # megatron's padded routing map adds entries of probability 0 (some of which travel): the load
            # is the routes of a probability, as without padding. On the device; read when megatron logs.
            state.metrics.count_tokens((routing_map & (expert_probs > 0)).sum(0))
        received = routing_map.sum(0) if debug_checks_enabled() else None
        if received is not None and bool((received > rows).any()):
            raise ValueError(
                f"moe_expert_capacity_factor: a local expert received {received.tolist()} rows, more than its "
                f"{rows} (every rank's router must apply the capacity, and every rank pass the same "
                "number of tokens)")
        return torch.full((self.num_local_experts,), rows, dtype=torch.long, device="cpu")

    def _mark_routed_rows(self, state: CommState) -> bool:
        """Under a capacity, which rows of the fixed blocks hold their expert's received rows (state.routed_rows);
        whether there are blocks."""
        if state.fixed is None:
            state.routed_rows = None
            return False
        blocks = state.reversed_mapping.view(self.num_local_experts, state.fixed.per_expert)
        state.routed_rows = state.local_routing_map.t().gather(1, blocks).reshape(-1)
        return True

    def _pad_for_quantization(self, routing_map: torch.Tensor, tokens_per_expert: torch.Tensor):
        """Rounds every expert's rows up to the fp8/fp4 GEMM alignment by routing extra received tokens
        to it with probability 0 (they add nothing to the output). Where too few tokens arrived for
        that, the map is left as it is and megatron's expert MLP pads explicitly."""
        multiple = get_align_size_for_quantization(self.config)
        target = (tokens_per_expert + multiple - 1) // multiple * multiple
        if not bool((target <= routing_map.shape[0]).all()):
            return routing_map, tokens_per_expert
        return pad_routing_map(routing_map, multiple), target

    def _local_multihot(self, recv_topk_idx: torch.Tensor, recv_probs: torch.Tensor):
        """[rows, K] local ids (-1 elsewhere) and weights -> [rows, L] routing map and probabilities."""
        rows = recv_topk_idx.shape[0]
        valid = recv_topk_idx >= 0
        slot = recv_topk_idx.clamp(min=0)
        # Adds, not plain scatters: the -1 entries land on slot 0 too and must not overwrite a real one.
        hits = torch.zeros(rows, self.num_local_experts, dtype=torch.int32, device=recv_topk_idx.device)
        routing_map = hits.scatter_add(1, slot, valid.to(torch.int32)) > 0
        # Scatter-add also keeps the autograd path from the dispatched weights to the expert probabilities.
        expert_probs = torch.zeros(rows, self.num_local_experts, dtype=recv_probs.dtype, device=recv_probs.device)
        expert_probs = expert_probs.scatter_add(1, slot, torch.where(valid, recv_probs, 0))
        return routing_map, expert_probs

    # ---------------------------------------------------------------- combine
    @phase_range("combine_preprocess")
    def combine_preprocess(self, hidden_states: torch.Tensor):
        return self._unpermute(self._state, hidden_states)

    def _unpermute(self, state: CommState, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' rows summed back into the received rows' order: the combine's input."""
        if state.routed_rows is not None:  # padding rows add nothing (experts with biases make them nonzero)
            hidden_states = torch.where(state.routed_rows.unsqueeze(1), hidden_states, 0)
        if hidden_states.dtype in (torch.bfloat16, torch.float32) and state.buffer.num_arena_bytes != 0:
            # The combine's x, in the arena: read where it lies.
            rows = state.buffer.empty_combine_input(state.handle, hidden_states.shape[-1], hidden_states.dtype)
            return _UnpermuteInto.apply(hidden_states, state.reversed_mapping, _Into(rows))
        return unpermute(
            hidden_states,
            state.reversed_mapping,
            restore_shape=state.received_shape,
            routing_map=state.local_routing_map,
        )

    @phase_range("token_combine")
    def token_combine(self, hidden_states):
        if self.runs_in_chunks:
            return hidden_states  # experts_in_chunks started every chunk's combine
        return _Combine.apply(hidden_states, self._state)

    # ---------------------------------------------------------------- chunks
    @phase_range("experts_in_chunks")
    def experts_in_chunks(self, experts) -> List[torch.Tensor]:
        """moe_ep_overlap_chunks: the experts run once a chunk, between that chunk's dispatch and combine.
        Chunk i+1's dispatch is started before chunk i's experts and chunk i's combine after them, so on a
        GPU chunk i's GEMMs overlap the next chunk's dispatch and the previous chunk's combine (in the
        backward too: chunks.ChunkedBackward). Returns the chunks' combined rows, which
        combine_postprocess waits for."""
        chunks = self._chunks
        for index, state in enumerate(chunks.states):
            if index + 1 < len(chunks.states):
                self._dispatch_chunk(index + 1)
            if index == 0 and self.shared_experts is not None:
                # Queued before the first wait: the shared expert's fc1 runs while the dispatches are under way.
                self.shared_experts.linear_fc1_forward_and_act()
            received, received_probs = _Dispatch.apply(chunks.hidden_states[index], chunks.probs[index], state,
                                                       chunks.backward)
            permuted, tokens_per_expert, permuted_probs = self._permute(state, received, received_probs)
            output, bias = experts(permuted, tokens_per_expert, permuted_probs)
            if bias is not None:
                raise ValueError("moe_ep_overlap_chunks: the experts' bias is not supported (add_bias_linear)")
            chunks.combined.append(_Combine.apply(self._unpermute(state, output), state, (chunks.backward, index)))
        return chunks.combined

    @phase_range("combine_postprocess")
    def combine_postprocess(self, hidden_states):
        if self.shared_experts is not None:
            # Queued before the wait: the shared expert's fc2 runs while the combine is under way (in
            # chunks, the last chunk's, whose rows megatron's overlap orders first in the backward).
            self.shared_experts.linear_fc2_forward(hidden_states[-1] if self.runs_in_chunks else hidden_states)
            self.shared_experts.post_forward_comm()
        output = self._finish_combines(hidden_states).view(self.hidden_shape)
        if self.shared_experts is not None:
            # Out of place, and routed + shared as MoELayer adds them without the overlap: the same bits.
            output = output + self.shared_experts.get_output()
        return output

    def _finish_combines(self, combined) -> torch.Tensor:
        """The layer's combined rows, once its combine (every chunk's, in chunks) is done."""
        if not self.runs_in_chunks:
            self._state.wait()
            return combined
        chunks, self._chunks = self._chunks, None
        for state in chunks.states:
            state.wait()
        return JoinChunks.apply(chunks.backward, *combined)
