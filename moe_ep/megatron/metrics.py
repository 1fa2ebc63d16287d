"""Per-layer metrics of the "deepep" dispatcher (option moe_ep_log_metrics), logged where megatron-core
logs its MoE metrics: entries of its layer-wise logging tracker (`moe_utils.get_moe_layer_wise_logging_tracker`),
which `track_moe_metrics` (Megatron-LM's training loop calls it every step) writes to tensorboard, wandb
and the log line, per layer with `--moe-per-layer-logging`.

Entries, each a value per layer (megatron's layer numbers), summed over the training forward passes (a
training layer, autograd on: megatron's rule for its router's losses; not evaluation, not a recomputed
layer's first no-grad pass) and their backwards since the last logging (track_moe_metrics multiplies them by its loss_scale: 1 / micro-batches in Megatron-LM, so per
micro-batch):

- `moe_ep/expert_<e>_tokens`: the tokens routed to expert e (megatron's expert id) that reached it, as its
  rank's dispatch counted them; with several expert-parallel groups, the mean over them.
- `moe_ep/comm_ms`: the time of the layer's dispatches and combines, forward and backward: from the
  caller's stream reaching a call to the end of its work (on the Buffer's communication stream for the
  asynchronous calls: the forward's, and the backward's in chunks), as `Buffer.profile()` times it. Mean
  over the ranks.
- `moe_ep/exposed_comm_ms`: the part of it the computation waited for: the time the caller's stream
  waits for an asynchronous call's event (from reaching the wait to passing it), and all of every call
  that cannot overlap it (the unchunked backward's synchronous calls; CPU tensors; the portable backend,
  whose calls end before they return), at most comm_ms. `moe_ep/hidden_comm_ms`: comm_ms - exposed_comm_ms.

How they are counted: the token counts are the ones each dispatch already returns on the host (tokens
received per local expert), added on the host (under a capacity, where the dispatch leaves them on the
device, added there and read at logging time); the times are CUDA events (host clock for CPU tensors) read
only at logging time. When megatron reports its tracker (`MoEMetricsTracker.report` from megatron-core 0.17,
`reduce_aux_losses_tracker_across_ranks` before; registration wraps it) every rank publishes its layers: one all-reduce over the expert-parallel group (each
rank holds its own experts' counts: the sum is every expert's) and one over the data-parallel group
(the mean over the expert-parallel groups). Both groups lie within one pipeline stage; the entries of a
stage hold its own layers (Megatron-LM writes the last stage's). Off, nothing is recorded or timed.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..profiling import Profile

PREFIX = "moe_ep/"
COMM_MS, EXPOSED_MS, HIDDEN_MS = PREFIX + "comm_ms", PREFIX + "exposed_comm_ms", PREFIX + "hidden_comm_ms"
# Phases Buffer.profile() times that move data between ranks (the layout is computed locally).
COMMUNICATION_PHASES = ("dispatch", "cached dispatch", "combine")
EXPOSED_PHASE = "exposed communication"


def expert_tokens_name(expert: int) -> str:
    return f"{PREFIX}expert_{expert}_tokens"


def metric_names(num_experts: int) -> List[str]:
    """The tracker entries, in the order of publish()'s columns."""
    return [expert_tokens_name(e) for e in range(num_experts)] + [COMM_MS, EXPOSED_MS, HIDDEN_MS]


_LIVE: "weakref.WeakSet[LayerMetrics]" = weakref.WeakSet()


class LayerMetrics:
    """One dispatcher's counts and times since the last publish()."""

    def __init__(self, local_expert_ids: Sequence[int], num_experts: int, num_layers: int, ep_group):
        self.local_expert_ids = list(local_expert_ids)
        self.num_experts, self.num_layers, self.ep_group = num_experts, num_layers, ep_group
        # The MoELayer whose layer_number the entries go to (set by registration; None: nothing published).
        self.layer: Optional[weakref.ref] = None
        self._tokens = [0] * len(self.local_expert_ids)
        self._device_tokens: Optional[torch.Tensor] = None  # counts a dispatch left on the device
        self._profiles: List[Tuple[weakref.ref, Profile]] = []
        self._overlapping: Dict[int, bool] = {}  # Buffer serial -> its calls of CUDA tensors run beside the caller
        _LIVE.add(self)

    def layer_number(self) -> Optional[int]:
        layer = self.layer() if self.layer is not None else None
        return getattr(layer, "layer_number", None)

    # ------------------------------------------------------------ recording (the dispatcher calls these)
    def records_now(self) -> bool:
        """Whether this forward (and its backward) is recorded: as megatron records its router's losses, a
        training forward under autograd, so neither an evaluation nor a recomputed layer's first (no-grad)
        forward adds to the next logging."""
        layer = self.layer() if self.layer is not None else None
        return layer is not None and layer.training and torch.is_grad_enabled()

    def count_tokens(self, tokens_per_local_expert) -> None:
        """Host counts (a list), or counts on the device (a tensor), added there and read at logging time."""
        if isinstance(tokens_per_local_expert, torch.Tensor):
            counts = tokens_per_local_expert.to(torch.int64)
            self._device_tokens = counts if self._device_tokens is None else self._device_tokens + counts
            return
        for index, count in enumerate(tokens_per_local_expert):
            self._tokens[index] += count

    @contextlib.contextmanager
    def call(self, buffer, device: torch.device, asynchronous: bool):
        """Times one Buffer call made inside; yields whether the caller should time its wait for the call's
        event (an asynchronous call that runs beside the caller's stream), else all of it is exposed."""
        profile = self._profile_for(buffer)
        overlaps = asynchronous and self._overlaps(buffer, device)
        mark = None if overlaps else Profile.start(device)
        with profile:
            yield overlaps
        if not overlaps:
            profile.stop(EXPOSED_PHASE, mark)

    def wait(self, pending, buffer, device: torch.device) -> None:
        """The caller's stream waits for an asynchronous call's event: that wait is the exposed time."""
        mark = Profile.start(device)
        pending.current_stream_wait()
        self._profile_for(buffer).stop(EXPOSED_PHASE, mark)

    def _profile_for(self, buffer) -> Profile:
        if not self._profiles or self._profiles[-1][0]() is not buffer:  # the group's Buffer was replaced
            self._profiles.append((weakref.ref(buffer), buffer.profile()))
        return self._profiles[-1][1]

    def _overlaps(self, buffer, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        if buffer.serial not in self._overlapping:
            self._overlapping[buffer.serial] = buffer.topology()["normal_backend"] != "portable"
        return self._overlapping[buffer.serial]

    # ------------------------------------------------------------ publishing
    def take(self) -> Tuple[List[int], float, float]:
        """(tokens per local expert, communication ms, exposed ms) since the last take; starts afresh.
        Waits for the device to pass the events recorded."""
        tokens, self._tokens = self._tokens, [0] * len(self.local_expert_ids)
        if self._device_tokens is not None:
            tokens = [a + b for a, b in zip(tokens, self._device_tokens.tolist())]
            self._device_tokens = None
        comm = exposed = 0.0
        for _, profile in self._profiles:
            summary = profile.summary(COMMUNICATION_PHASES + (EXPOSED_PHASE,))
            comm += sum(summary[phase]["total_ms"] for phase in COMMUNICATION_PHASES if phase in summary)
            exposed += summary.get(EXPOSED_PHASE, {"total_ms": 0.0})["total_ms"]
        self._profiles = []  # the next call starts a new Profile
        return tokens, comm, min(exposed, comm)


def _data_parallel_group(pg_collection):
    """The group megatron averages its MoE metrics over (its dense data-parallel group), or None."""
    if pg_collection is not None:
        return getattr(pg_collection, "dp", None)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)


def _collective_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def publish(pg_collection=None) -> List[str]:
    """Writes this rank's layers' metrics since the last publish into megatron's tracker, reduced over the
    expert-parallel and data-parallel groups (collective over them: every rank with a layer that logs
    metrics calls it, as megatron's training loop does when it logs). Returns the entries' names."""
    live = [metrics for metrics in list(_LIVE) if metrics.layer_number() is not None]
    if not live:
        return []
    first = live[0]
    experts = first.num_experts
    # Rows: layers; columns: every expert's tokens, then communication, exposed and hidden ms.
    block = torch.zeros(first.num_layers, experts + 3, dtype=torch.float64)
    for metrics in live:
        row = block[metrics.layer_number() - 1]
        tokens, comm, exposed = metrics.take()
        for expert, count in zip(metrics.local_expert_ids, tokens):
            row[expert] += count
        row[experts:] += torch.tensor([comm, exposed, comm - exposed], dtype=torch.float64)
    block = block.to(_collective_device(first.ep_group))
    dist.all_reduce(block, group=first.ep_group)
    block[:, experts:] /= dist.get_world_size(first.ep_group)  # times: the mean over the ranks
    dp_group = _data_parallel_group(pg_collection)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(block, group=dp_group)
        block /= dist.get_world_size(dp_group)
    columns = block.float().t().contiguous()
    names = metric_names(experts)
    tracker = _metrics_tracker()
    if tracker is None:  # megatron-core before 0.17: a dict of dicts, reduced by the function registration wraps
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        entries = get_moe_layer_wise_logging_tracker()
        for column, name in zip(columns, names):
            entries[name] = dict(values=column, reduce_group=None, avg_group=None, reduce_group_has_dp=False)
        return names
    from megatron.core.transformer.moe.moe_logging import MetricEntry

    for name in [name for name in tracker.metrics if is_metric(name)]:  # a replaced layer's entries
        del tracker.metrics[name]
    for column, name in zip(columns.to(block.device), names):
        # Already reduced over the data-parallel ranks; megatron still sums over the pipeline stages, each of
        # which holds the rows of its own layers.
        tracker.metrics[name] = MetricEntry(values=column.clone(), needs_dp_avg=False)
    return names


def _metrics_tracker():
    """megatron-core's MoEMetricsTracker (0.17 and later), or None where it keeps the older dict."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return None
    return get_moe_metrics_tracker()


def is_metric(name: str) -> bool:
    return name.startswith(PREFIX)


def check_megatron_publishes() -> None:
    """moe_ep_log_metrics needs megatron-core's MoE metrics tracker (MoEMetricsTracker.report, or before 0.17
    reduce_aux_losses_tracker_across_ranks), which registration wraps."""
    tracker = _metrics_tracker()
    if tracker is not None:
        wrapped = getattr(type(tracker).report, "_moe_ep_wrapped", False)
    else:
        from megatron.core.transformer.moe import moe_utils

        wrapped = getattr(getattr(moe_utils, "reduce_aux_losses_tracker_across_ranks", None), "_moe_ep_wrapped", False)
    if not wrapped:
        raise RuntimeError("moe_ep_log_metrics: this megatron-core has neither MoEMetricsTracker.report nor "
                           "reduce_aux_losses_tracker_across_ranks (its MoE logging) to publish the metrics "
                           "through; set it to False")
