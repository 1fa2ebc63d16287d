"""Late delivery on CPU ranks: every asynchronous Buffer call (async_finish=True) returns rows that hold
NaN until its event is waited for, as rows still in flight on a GPU's communication stream hold stale
memory; a caller that reads them early gets NaN in its results. It also logs when each call started and
when its event was first waited for, so a test can check what was in flight while the experts computed."""
from __future__ import annotations

import inspect
from typing import List, Tuple

import torch

from moe_ep import Buffer
from moe_ep.events import EventOverlap


def _floating(outputs) -> List[torch.Tensor]:
    found = []
    for value in outputs:
        if isinstance(value, (tuple, list)):
            found += _floating(value)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            found.append(value)
    return found


class _LateEvent(EventOverlap):
    """Writes a call's true rows back into its outputs when first waited for."""

    def __init__(self, delivery: "LateDelivery", entry: Tuple[str, int], outputs: List[torch.Tensor]):
        super().__init__()
        self._delivery, self._entry = delivery, entry
        self._rows = [(tensor, tensor.detach().clone()) for tensor in outputs]
        for tensor in outputs:
            tensor.data.fill_(float("nan"))  # .data: autograd's version counter is not the test's business

    def current_stream_wait(self) -> None:
        if self._rows is None:
            return
        for tensor, rows in self._rows:
            tensor.data.copy_(rows)
        self._rows = None
        self._delivery.log.append(("wait", *self._entry))


class LateDelivery:
    """`with LateDelivery() as late:` patches Buffer.dispatch and Buffer.combine in this process.
    late.log: ("start" | "wait" | "call", kind, exchange) in order, kind one of "dispatch",
    "cached_dispatch", "combine"; exchange: which fresh dispatch's handle the call used, numbered from 0
    in the order they ran ("call": a synchronous one)."""

    def __init__(self):
        self.log: List[Tuple[str, str, int]] = []
        self._exchanges = {}  # id(handle) -> (handle, number); the handle is held so its id is not reused
        self._originals = {}

    def __enter__(self) -> "LateDelivery":
        for name in ("dispatch", "combine"):
            self._originals[name] = getattr(Buffer, name)
            setattr(Buffer, name, self._late(name, self._originals[name]))
        return self

    def __exit__(self, *exc) -> bool:
        for name, original in self._originals.items():
            setattr(Buffer, name, original)
        return False

    def _exchange(self, handle) -> int:
        if id(handle) not in self._exchanges:
            self._exchanges[id(handle)] = (handle, len(self._exchanges))
        return self._exchanges[id(handle)][1]

    def _late(self, name: str, original):
        signature = inspect.signature(original)

        def call(buffer, *args, **kwargs):
            bound = signature.bind(buffer, *args, **kwargs)
            handle = bound.arguments.get("handle")
            async_finish = bound.arguments.get("async_finish", False)
            outputs = original(buffer, *args, **kwargs)
            if name == "dispatch":
                kind = "dispatch" if handle is None else "cached_dispatch"
                exchange = self._exchange(outputs[4] if handle is None else handle)
            else:
                kind, exchange = "combine", self._exchange(handle)
            if not async_finish:
                self.log.append(("call", kind, exchange))
                return outputs
            self.log.append(("start", kind, exchange))
            event = _LateEvent(self, (kind, exchange), _floating(outputs[:-1]))
            return (*outputs[:-1], event)

        return call
