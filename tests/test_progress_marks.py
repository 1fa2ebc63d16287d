"""The progress marks the intranode kernels leave in the host record (csrc/kernels/reports.cuh) in words:
where a rank's stream stood when a host wait ran out, and where a timed-out wait's peer was. The record's
slots and the kernels' ids are the header's as Python reads it where no extension is built (the
kernel_enums fixture); the tests at the end check that reading against the compiler and the extension."""
import types

import pytest

from moe_ep import _native
from moe_ep.backends.peers import (
    KERNEL_NAMES, PHASE_NAMES, WAIT_NAMES, WAITED_FOR, KernelEnums, MappedBuffers, kernel_progress,
)


def _mark(enums: KernelEnums, kernel: str, call: int) -> int:
    """A progress mark as the kernels write it (intranode::ProgressMark): `kernel` names its KernelId."""
    bits = enums.progress_mark.CALL_BITS
    return getattr(enums.kernel_id, kernel) << bits | call & ((1 << bits) - 1)


def _failed_wait(enums: KernelEnums, call: int, peer_mark: int, peer_ms: int) -> str:
    host, slot = [0] * 32, enums.host_info
    host[slot.ERROR], host[slot.ERROR_KIND], host[slot.ERROR_PEER] = 1, enums.error_kind.PUSHED, 2  # rows of rank 2
    host[slot.ERROR_CALL], host[slot.ERROR_SEEN] = call, call - 3
    host[slot.ERROR_PEER_STARTED], host[slot.ERROR_PEER_STARTED_MS] = peer_mark, peer_ms
    host[slot.ERROR_PEER_BLOCKS], host[slot.ERROR_BLOCKS] = 7, 16
    buffers = types.SimpleNamespace(host=host, timeout_s=10.0, rank=0, enums=enums)
    return str(MappedBuffers.timeout_error(buffers))


def test_a_peer_that_never_reached_the_call_is_told_from_one_inside_it(kernel_enums):
    behind = _failed_wait(kernel_enums, 288, _mark(kernel_enums, "DISPATCH", 287), 10250)
    assert "rank 2 did not arrive within 10 s" in behind and "(call 288; its flag announced call 285)" in behind
    assert "Its last kernel to start was the dispatch of call 287, 10.2 s before the wait gave up: it had not " \
           "started this call's kernel" in behind, behind
    inside = _failed_wait(kernel_enums, 288, _mark(kernel_enums, "COMBINE", 288), 9999)
    assert "the combine of call 288, 10.0 s before the wait gave up: it was inside this call's kernel, 7 of its " \
           "16 blocks started" in inside, inside
    assert "(the rest found no free SM; where ranks share a GPU, cap each rank's SMs: moe_ep.launch --sm-share" \
        in inside, inside
    assert "It had started no kernel of this Buffer." in _failed_wait(kernel_enums, 2, 0, 0)
    # Call numbers wrap in the mark (at 24 bits), at 31 in the failed wait's record.
    wrapped = (1 << kernel_enums.progress_mark.CALL_BITS) + 5
    assert "inside this call's kernel" in _failed_wait(kernel_enums, wrapped, _mark(kernel_enums, "COMBINE", 5), 0)


def test_low_latency_failures_carry_no_peer_mark(kernel_enums):
    message = _failed_wait(kernel_enums, 7, -1, 0)
    assert "did not arrive" in message and "last kernel" not in message


def test_kernel_progress_names_the_last_kernels_started_and_finished(kernel_enums):
    host, slot = [0] * 32, kernel_enums.host_info
    assert kernel_progress(host, kernel_enums) == "last kernel to start: none; last to finish: none"
    host[slot.KERNEL_STARTED] = _mark(kernel_enums, "DISPATCH", 17)
    host[slot.KERNEL_FINISHED] = _mark(kernel_enums, "NOTIFY", 16)
    assert kernel_progress(host, kernel_enums) == ("last kernel to start: the dispatch of call 17; "
                                                   "last to finish: the notify (count exchange) of call 16")


class _Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_progress_report_tells_a_call_held_by_the_device_from_one_its_caller_never_reached(monkeypatch, kernel_enums):
    from collections import deque

    from moe_ep.backends import intranode
    from moe_ep.backends.intranode import IntranodeBackend

    now = 1000.0
    monkeypatch.setattr(intranode.time, "monotonic", lambda: now)

    host, slot = [0] * 32, kernel_enums.host_info
    host[slot.KERNEL_STARTED] = host[slot.KERNEL_FINISHED] = _mark(kernel_enums, "DISPATCH", 244)
    shared = _Event(False)
    backend = types.SimpleNamespace(
        rank=1, _host=host, enums=kernel_enums, comm_stream=_Event(False),
        _recent_calls=deque([["dispatch", now - 8.3, None], ["combine", now - 8.1, _Event(True)],
                             ["dispatch", now - 8.0, shared], ["combine", now - 7.9, shared]]),
    )
    report = IntranodeBackend.progress_report(backend)
    assert report.startswith("rank 1: calls launched by the host, oldest first: dispatch 8.30 s ago (ordered "
                             "inside the extension), combine 8.10 s ago (its caller's stream had reached it), "
                             "dispatch 8.00 s ago (unknown whether"), report
    assert "combine 7.90 s ago (its caller's stream had NOT reached it)" in report, report
    assert report.endswith("device: last kernel to start: the dispatch of call 244; last to finish: the dispatch "
                           "of call 244; communication stream busy"), report


def test_every_kernel_and_kind_the_kernels_report_has_its_words(report_tables):
    """The words Python keeps by enumerator name cover every KernelId, every ErrorKind a failed wait
    reports (the low-latency kinds included) and every phase of the wait profile."""
    assert sorted(KERNEL_NAMES) == sorted(report_tables["KERNEL_IDS"])
    assert sorted(WAITED_FOR) == sorted(kind for kind in report_tables["ERROR_KINDS"] if kind != "NONE")
    assert "reach this call" in WAITED_FOR["RENDEZVOUS"]
    assert set(WAIT_NAMES) <= set(report_tables["ERROR_KINDS"])
    assert sorted(PHASE_NAMES) == sorted(report_tables["PROFILE_PHASES"])


def test_the_header_read_in_python_is_the_header_compiled(report_tables, tmp_path):
    """moe_ep.backends.reports reads csrc/kernels/reports.cuh as the compiler does (the compiled tables
    pass the header's static_asserts: every enumerator named once, in order)."""
    from .host_headers import report_tables as compiled

    assert compiled(tmp_path) == report_tables
    assert set(report_tables) == {"HOST_INFO", "KERNEL_IDS", "PROGRESS_MARK", "ERROR_KINDS",
                                  "PROFILE_PHASES", "TIMELINE_COLUMNS", "TIMELINE_CALL_KINDS"}


def test_the_header_reader_refuses_what_it_cannot_value():
    """Implicit values count on from a sum of literals and earlier enumerators; any other expression raises."""
    from moe_ep.backends.reports import parse

    table = 'constexpr NamedValue kNames[] = {{"A", ns::kA}, {"B", kB}};\nnamed_table("T", kNames)'
    assert parse("enum E : int { kA = 2 + 1, kB };\n" + table) == {"T": {"A": 3, "B": 4}}
    with pytest.raises(ValueError, match="cannot read"):
        parse("enum E : int { kA = 1 << 2, kB };\n" + table)


def test_the_extension_exports_the_header_s_tables(report_tables):
    """Where the extension is built (a GPU or not), its tables are the header's."""
    try:
        ops = _native.ops()
    except RuntimeError as missing:
        pytest.skip(str(missing))
    assert {table: dict(getattr(ops, table)) for table in report_tables} == report_tables


def test_without_the_extension_the_stubs_read_the_header(report_tables, monkeypatch):
    """kernel_enums (the --stub-kernels tools' numbers) falls back to the header where no extension loads."""
    from moe_ep.backends.peers import kernel_enums

    def missing():
        raise RuntimeError("no extension")

    monkeypatch.setattr(_native, "ops", missing)
    enums = kernel_enums.__wrapped__()
    assert enums.host_info.COUNTS == report_tables["HOST_INFO"]["COUNTS"]
    assert enums.kernel_id.names() == tuple(report_tables["KERNEL_IDS"])


def test_a_peer_missing_at_a_rendezvous_names_the_kernel_it_opens(kernel_enums):
    host, slot = [0] * 32, kernel_enums.host_info
    host[slot.ERROR], host[slot.ERROR_KIND], host[slot.ERROR_PEER] = 1, kernel_enums.error_kind.RENDEZVOUS, 5
    host[slot.ERROR_WINDOW], host[slot.ERROR_CALL], host[slot.ERROR_SEEN] = kernel_enums.kernel_id.COMBINE, 42, 39
    host[slot.ERROR_PEER_STARTED] = _mark(kernel_enums, "DISPATCH", 41)
    host[slot.ERROR_PEER_STARTED_MS] = 20100
    message = str(MappedBuffers.timeout_error(types.SimpleNamespace(host=host, timeout_s=20.0, rank=1,
                                                                    enums=kernel_enums)))
    assert "rank 1 waited for it to reach this call's combine (ranks sharing a GPU start it together) (call 42" \
        in message, message
    assert "it had not started this call's kernel" in message, message
