"""Bounded waiting for peers on the host side.

Before the portable backend starts a collective, every rank records its arrival at the phase in the
process group's key-value store and waits, with a deadline, for all the others. A rank that does not
arrive in time is then named in a TimeoutError on every rank that did, instead of a collective that
hangs for the process group's timeout (30 minutes by default) and reports nothing useful.

Each meeting has one verdict, set by the first rank to decide: a rank that arrives after a peer gave up
raises TimeoutError too, instead of passing into a collective that peer will never join. A rank whose own
arguments were refused still takes its part (refuse), so its peers raise naming it at once and the ranks
stay in step. Buffer construction meets the same way, at a gate of its group (construction_gate).

A call's arrival also carries its form (enter's `form`: which dtype, sizes, flags and handle the call was
made with), compared on every rank against every other's in the same exchange: ranks that made the same
call in different forms all raise the same ValueError, naming the fields and the ranks, before any data
moves, and stay in step.

In shrink mode (enter_survivors) a meeting waits for the unmasked ranks only, and a rank that does not
come in time is masked rather than named in a TimeoutError: the meeting's one verdict names the ranks it
masks, so every rank that came masks the same ones; post and collect then move bytes between those ranks
through the store, bounded by the same timeout.

A rank that waited at a meeting longer than its SlowRanks threshold (a Buffer's gate has one) records
the peer that arrived last, found by the wall-clock stamp every arrival carries: across hosts, clocks
that differ by more than the gap between the last two arrivals can name the other of those two.
"""

from __future__ import annotations

import datetime
import itertools
import os
import struct
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from .slow_ranks import SlowRanks

DEFAULT_TIMEOUT_S = 100.0
# A call's form: (field, phrase) pairs such as ("x dtype", "bf16 x"), in a fixed order per kind of call.
Form = Sequence[Tuple[str, str]]
_buffer_serials = itertools.count()


def next_buffer_serial() -> int:
    """A number that tells this process's Buffers apart (a handle names the Buffer that made it)."""
    return next(_buffer_serials)


def timeout_seconds() -> float:
    """MOE_EP_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get("MOE_EP_TIMEOUT_S", "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"MOE_EP_TIMEOUT_S: expected a number of seconds, got {raw!r}") from None
    return check_timeout("MOE_EP_TIMEOUT_S", value)


# The store waits in whole milliseconds, and a wait of 0 ms is one without a deadline; the upper bound is
# what a millisecond count of the store's C++ side can hold (about 24 days).
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, (2**31 - 1) / 1e3


def check_timeout(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise ValueError(f"{name}: expected a number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}, "
                         f"got {value!r}")
    return float(value)


class ArrivalGate:
    """One per Buffer, keyed by the Buffer's place in its group's sequence of Buffers; one more per
    group for the constructions themselves (construction_gate)."""

    def __init__(self, group: dist.ProcessGroup, serial, timeout_s: float, *, stays_usable: bool = False,
                 slow_ranks: Optional[SlowRanks] = None):
        """stays_usable: a failed meeting leaves later ones usable (the construction gate: every Buffer
        meets there once, and a rank that missed a meeting raises when it comes, which puts it back in step).
        slow_ranks: where this rank's long waits for a late peer are counted (None: not watched)."""
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self._store = dist.PrefixStore(
            f"moe_ep/{group.group_name}/{serial}", dist.distributed_c10d._get_default_store()
        )
        self.calls = 0  # meetings this rank has entered (or refused)
        self.stays_usable = stays_usable
        # (exception type, message) of the meeting that put this rank out of step with its peers.
        self.broken: Optional[Tuple[type, str]] = None
        self.slow_ranks = slow_ranks
        # Meetings whose verdict masked ranks (enter_survivors): their verdicts are kept for those ranks.
        self._masking_calls: Set[int] = set()

    def check_usable(self) -> None:
        """Raises again what put the ranks out of step, on every call after it."""
        if self.broken is not None:
            exc_type, message = self.broken
            raise exc_type(f"moe_ep: this Buffer can no longer be used, an earlier call left its ranks out of "
                           f"step: {message}")

    def enter(self, phase: str, form: Form = ()) -> int:
        """Returns once every rank of the group has entered the same call in the same form, with the
        meeting's number (the same on every rank); raises TimeoutError naming the missing ranks after
        the deadline, RuntimeError if ranks are in different calls, and ValueError naming the fields
        and ranks where the forms differ (the call then ran on no rank, and the ranks stay in step)."""
        call = self.calls
        payloads = self.exchange(phase, _encode_form(form))
        if any(p != payloads[0] for p in payloads):
            raise ValueError(_form_mismatch(phase, [_decode_form(p) for p in payloads]))
        return call

    def refuse(self, phase: str, reason: str) -> None:
        """This rank's part of the meeting `phase` when its own arguments were refused: the peers raise
        naming this rank and `reason` instead of waiting out the timeout, and every rank stays in step.
        Returns at once."""
        call = self.calls
        self.calls += 1
        self._store.set(f"{call}/{self.rank}", _REFUSED + _stamp() + phase.encode() + b"\0" + reason.encode())

    def exchange(self, phase: str, payload: bytes, timeout_s: Optional[float] = None) -> List[bytes]:
        """enter(), and every rank's payload comes back in rank order (a bounded all-gather).
        timeout_s: this meeting's deadline (default: the gate's)."""
        call = self.calls
        self.calls += 1
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        verdict_key = f"{call}/verdict"
        arrived = time.perf_counter()
        self._store.set(f"{call}/{self.rank}", _ARRIVED + _stamp() + phase.encode() + b"\0" + payload)
        waited_out = self._wait_for(call, list(range(self.num_ranks)), timeout_s)
        waited_ms = (time.perf_counter() - arrived) * 1e3
        # One verdict per meeting, the first rank's to decide: a rank arriving after a peer gave up must
        # not go on into a collective the peer will never join.
        verdict = bytes(self._store.compare_set(verdict_key, "", f"timeout {self.rank}" if waited_out else "ok"))
        if verdict != b"ok":
            if waited_out:
                message = (f"moe_ep: rank(s) {_fmt_ranks(waited_out)} did not arrive at {phase} (call #{call} of "
                           f"this {self._what()}) within {timeout_s:g} s; rank {self.rank} waited.")
            else:
                gave_up = verdict.split(b" ", 1)[1].decode()
                message = (f"moe_ep: rank {self.rank} arrived at {phase} (call #{call} of this {self._what()}) "
                           f"after rank {gave_up} had stopped waiting for it (timeout {timeout_s:g} s), so the "
                           "call ran on no rank.")
            message += (" Raise MOE_EP_TIMEOUT_S if the peer is only slow;"
                        + (" this Buffer was not made." if self.stays_usable else
                           " after this error the Buffer's ranks are out of step: create a new Buffer."))
            self._fail(TimeoutError, message)
        return self._read_arrivals(call, phase, list(range(self.num_ranks)), waited_ms)

    def enter_survivors(self, phase: str, form: Form, masked: Set[int]) -> List[int]:
        """enter() among the ranks not in `masked` (shrink mode): a rank that has not arrived by the
        deadline is added to `masked` instead of failing the meeting. Returns the ranks that took part,
        ascending: the meeting's one verdict decides which ranks it masks, so every one of them gets the same
        list. A rank that comes after its peers masked it adds them (itself among them) and raises
        MaskedByPeers (the meeting still counts: its later meetings keep their numbers)."""
        call = self.calls
        self.calls += 1
        expected = [r for r in range(self.num_ranks) if r not in masked]
        arrived = time.perf_counter()
        self._store.set(f"{call}/{self.rank}", _ARRIVED + _stamp() + phase.encode() + b"\0" + _encode_form(form))
        missing = self._wait_for(call, expected, self.timeout_s)
        waited_ms = (time.perf_counter() - arrived) * 1e3
        proposal = f"mask {_fmt_ranks(missing)}" if missing else "ok"
        verdict = bytes(self._store.compare_set(f"{call}/verdict", "", proposal)).decode()
        newly_masked = [] if verdict == "ok" else [int(r) for r in verdict[len("mask "):].split(", ")]
        if newly_masked:
            self._masking_calls.add(call)
            masked.update(newly_masked)
        if self.rank in newly_masked:
            raise MaskedByPeers(
                f"moe_ep: rank {self.rank} arrived at {phase} (call #{call} of this Buffer) after its peers had "
                f"stopped waiting (timeout {self.timeout_s:g} s) and masked rank(s) {_fmt_ranks(newly_masked)}; "
                "this rank is masked now: its low-latency calls run alone (receiving nothing, their tokens "
                "reaching no expert) until every rank unmasks it (low_latency_clean_mask_buffer).")
        present = [r for r in expected if r not in newly_masked]
        payloads = self._read_arrivals(call, phase, present, waited_ms)
        if any(p != payloads[0] for p in payloads):
            raise ValueError(_form_mismatch(phase, [_decode_form(p) for p in payloads], present))
        return present

    def pass_alone(self) -> int:
        """A masked rank's part in a meeting it does not attend: it keeps count, so that its meetings stay
        numbered like its peers' for when it is unmasked."""
        call = self.calls
        self.calls += 1
        return call

    def _wait_for(self, call: int, ranks: List[int], timeout_s: float) -> List[int]:
        """Waits for `ranks` to arrive at meeting `call`; -> those that had not by the deadline."""
        return self._wait_for_keys([f"{call}/{r}" for r in ranks], ranks, timeout_s)

    def post(self, call: int, tag: str, to_rank: int, payload: bytes) -> None:
        """Leaves `payload` for `to_rank` at meeting `call` (collect takes it)."""
        self._store.set(f"{call}/{tag}/{self.rank}>{to_rank}", _MAIL + payload)

    def collect(self, call: int, tag: str, from_ranks: List[int]) -> List[bytes]:
        """What each of `from_ranks` posted to this rank at meeting `call` under `tag`, in their order,
        waiting at most the gate's timeout; a peer that posted nothing by then puts the ranks out of step."""
        keys = [f"{call}/{tag}/{r}>{self.rank}" for r in from_ranks]
        if not keys:
            return []
        missing = self._wait_for_keys(keys, from_ranks, self.timeout_s)
        if missing:
            self._fail(TimeoutError,
                f"moe_ep: rank(s) {_fmt_ranks(missing)} passed call #{call} of this Buffer but sent rank "
                f"{self.rank} no {tag} rows within {self.timeout_s:g} s; after this error the Buffer's ranks are "
                "out of step: create a new Buffer.")
        payloads = [bytes(v)[len(_MAIL):] for v in self._store.multi_get(keys)]
        for key in keys:
            self._store.delete_key(key)
        return payloads

    def _wait_for_keys(self, keys: List[str], ranks: List[int], timeout_s: float) -> List[int]:
        """Waits for `keys` (one per rank of `ranks`); -> the ranks whose key had not come by the deadline."""
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return []
        except RuntimeError:  # DistStoreError on timeout
            return [r for r, key in zip(ranks, keys) if not self._store.check([key])]

    def _read_arrivals(self, call: int, phase: str, ranks: List[int], waited_ms: float) -> List[bytes]:
        """The payloads `ranks` left at meeting `call` (every one of them has arrived), after checking that
        they all made the same call and refused nothing."""
        keys = [f"{call}/{r}" for r in ranks]
        entries = [bytes(v) for v in self._store.multi_get(keys)]
        if self.slow_ranks is not None and waited_ms > self.slow_ranks.threshold_ms:
            self._record_last_arrival(dict(zip(ranks, entries)), waited_ms, phase)
        parsed = [(v[:1], *v[1 + _STAMP.size:].split(b"\0", 1)) for v in entries]
        others = {r: p.decode() for r, (_, p, _) in zip(ranks, parsed) if p.decode() != phase}
        refused = {r: (p.decode(), reason.decode()) for r, (kind, p, reason) in zip(ranks, parsed) if kind == _REFUSED}
        if others:
            self._fail(RuntimeError,
                f"moe_ep: ranks disagree on the call: rank {self.rank} is in {phase}, but "
                + ", ".join(f"rank {r} is in {p}" + (" (and refused it)" if r in refused else "")
                            for r, p in others.items())
                + ". Every rank of the group must make the same sequence of Buffer calls."
            )
        self._forget(call - 2, tidies_verdicts=self.rank == ranks[0])
        if refused:
            # The ranks are still in step: every one of them has passed this meeting.
            raise RuntimeError(
                f"moe_ep: {phase} ran on no rank: "
                + "; ".join(f"rank {r} refused its arguments ({reason})" for r, (_, reason) in refused.items())
                + (". This rank's Buffer is still usable." if not self.stays_usable else ".")
            )
        return [v for _, _, v in parsed]

    def _forget(self, call: int, tidies_verdicts: bool) -> None:
        """Every rank set its key for a meeting only after passing the one before, so nobody reads the one
        before that any more; a verdict that masked ranks stays, for those ranks to read when they come."""
        if call < 0:
            return
        self._store.delete_key(f"{call}/{self.rank}")
        if tidies_verdicts and call not in self._masking_calls:
            self._store.delete_key(f"{call}/verdict")

    def _record_last_arrival(self, entries: Dict[int, bytes], waited_ms: float, phase: str) -> None:
        """The peer whose arrival stamp is latest kept this rank waiting, unless this rank came last (its
        wait was the store's)."""
        stamps = {r: _STAMP.unpack_from(entry, 1)[0] for r, entry in entries.items()}
        last = max((r for r in stamps if r != self.rank), key=stamps.__getitem__, default=None)
        if last is not None and stamps[last] > stamps[self.rank]:
            self.slow_ranks.record(last, waited_ms, phase)

    def _fail(self, exc_type: type, message: str) -> None:
        if not self.stays_usable:
            self.broken = (exc_type, message)
        raise exc_type(message)

    def _what(self) -> str:
        return "group's Buffer constructions" if self.stays_usable else "Buffer"


# A mail payload gets a first byte too, so that an empty one is not an empty store value.
_ARRIVED, _REFUSED, _MAIL = b"A", b"R", b"M"
_STAMP = struct.Struct("<d")  # an arrival's wall-clock time, after its kind


def _stamp() -> bytes:
    return _STAMP.pack(time.time())

_construction_gates: Dict[str, ArrivalGate] = {}


class MaskedByPeers(TimeoutError):
    """Raised on a rank that reached a shrink-mode meeting after its peers had masked it."""


def construction_gate(group: dist.ProcessGroup) -> ArrivalGate:
    """The gate every Buffer of `group` meets at while it is made; its meetings count the group's
    Buffers, so the count names the same Buffer on every rank."""
    gate = _construction_gates.get(group.group_name)
    if gate is None:
        gate = _construction_gates[group.group_name] = ArrivalGate(group, "constructions", DEFAULT_TIMEOUT_S,
                                                                   stays_usable=True)
    return gate


def _fmt_ranks(ranks: List[int]) -> str:
    return ", ".join(str(r) for r in ranks)


_FIELD_END, _ENTRY_END = "\x1f", "\x1e"


def _encode_form(form: Form) -> bytes:
    return "".join(field + _FIELD_END + phrase + _ENTRY_END for field, phrase in form).encode()


def _decode_form(payload: bytes) -> Dict[str, str]:
    entries = payload.decode().split(_ENTRY_END)[:-1]
    return dict(entry.split(_FIELD_END, 1) for entry in entries)


def _form_mismatch(phase: str, forms: List[Dict[str, str]], ranks: Optional[List[int]] = None) -> str:
    """The message every rank raises where the ranks' forms of `phase` differ; built from every
    rank's form alike, so it reads the same on every rank."""
    clauses = [f"{field}: {_ranks_by_phrase(phase, phrases, ranks)}" for field, phrases in _differing_fields(forms)]
    return (f"moe_ep: the ranks called {phase} in different forms, so it ran on no rank: " + "; ".join(clauses)
            + ". Every rank must make each call with the same dtypes, sizes, flags and handle; this Buffer is "
            "still usable.")


def _differing_fields(forms: List[Dict[str, str]]) -> List[Tuple[str, List[str]]]:
    """(field, every rank's phrase) of each field whose phrases differ: the fields every rank's form has,
    else (forms of different kinds, none of whose shared fields differ) every field, missing ones as none."""
    shared = [field for field in forms[0] if all(field in form for form in forms)]
    every = list(dict.fromkeys(field for form in forms for field in form))
    for fields in (shared, every):
        differing = [(field, [form.get(field, f"no {field}") for form in forms]) for field in fields]
        differing = [(field, phrases) for field, phrases in differing if len(set(phrases)) > 1]
        if differing:
            return differing
    return []


def _ranks_by_phrase(phase: str, phrases: List[str], phrase_ranks: Optional[List[int]] = None) -> str:
    """e.g. "rank 1 called dispatch with fp8 x, ranks 0, 2, 3 with bf16 x": the smallest group first."""
    groups: Dict[str, List[int]] = {}
    for rank, phrase in zip(range(len(phrases)) if phrase_ranks is None else phrase_ranks, phrases):
        groups.setdefault(phrase, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
    return ", ".join(f"{_ranks_word(ranks)}{f' called {phase}' if i == 0 else ''} with {phrase}"
                     for i, (phrase, ranks) in enumerate(ordered))


def _ranks_word(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_fmt_ranks(ranks)}"
