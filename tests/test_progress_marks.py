"""The progress marks the intranode kernels leave in the host record (csrc/kernels/api.cuh) in words:
where a rank's stream stood when a host wait ran out, and where a timed-out wait's peer was."""
import types

from moe_ep.backends.peers import (
    HOST_ERROR, HOST_ERROR_BLOCKS, HOST_ERROR_CALL, HOST_ERROR_KIND, HOST_ERROR_PEER, HOST_ERROR_PEER_BLOCKS,
    HOST_ERROR_PEER_STARTED, HOST_ERROR_PEER_STARTED_MS, HOST_ERROR_SEEN, HOST_ERROR_WINDOW, HOST_KERNEL_FINISHED,
    HOST_KERNEL_STARTED, MappedBuffers, kernel_progress,
)

_DISPATCH, _NOTIFY, _COMBINE = 2, 1, 3  # intranode::KernelId


def _failed_wait(call: int, peer_mark: int, peer_ms: int) -> str:
    host = [0] * 32
    host[HOST_ERROR], host[HOST_ERROR_KIND], host[HOST_ERROR_PEER] = 1, 5, 2  # combine rows from rank 2
    host[HOST_ERROR_CALL], host[HOST_ERROR_SEEN] = call, call - 3
    host[HOST_ERROR_PEER_STARTED], host[HOST_ERROR_PEER_STARTED_MS] = peer_mark, peer_ms
    host[HOST_ERROR_PEER_BLOCKS], host[HOST_ERROR_BLOCKS] = 7, 16
    buffers = types.SimpleNamespace(host=host, timeout_s=10.0, rank=0)
    return str(MappedBuffers.timeout_error(buffers))


def test_a_peer_that_never_reached_the_call_is_told_from_one_inside_it():
    behind = _failed_wait(288, _DISPATCH << 24 | 287, 10250)
    assert "rank 2 did not arrive within 10 s" in behind and "(call 288; its flag announced call 285)" in behind
    assert "Its last kernel to start was the dispatch of call 287, 10.2 s before the wait gave up: it had not " \
           "started this call's kernel" in behind, behind
    inside = _failed_wait(288, _COMBINE << 24 | 288, 9999)
    assert "the combine of call 288, 10.0 s before the wait gave up: it was inside this call's kernel, 7 of its " \
           "16 blocks started" in inside, inside
    assert "(the rest found no free SM; where ranks share a GPU, cap each rank's SMs: moe_ep.launch --sm-share" \
        in inside, inside
    assert "It had started no kernel of this Buffer." in _failed_wait(2, 0, 0)
    # Call numbers wrap at 24 bits in the mark, at 31 in the failed wait's record.
    assert "inside this call's kernel" in _failed_wait((1 << 24) + 5, _COMBINE << 24 | 5, 0)


def test_low_latency_failures_carry_no_peer_mark():
    message = _failed_wait(7, -1, 0)
    assert "did not arrive" in message and "last kernel" not in message


def test_kernel_progress_names_the_last_kernels_started_and_finished():
    host = [0] * 32
    assert kernel_progress(host) == "last kernel to start: none; last to finish: none"
    host[HOST_KERNEL_STARTED], host[HOST_KERNEL_FINISHED] = _DISPATCH << 24 | 17, _NOTIFY << 24 | 16
    assert kernel_progress(host) == ("last kernel to start: the dispatch of call 17; "
                                     "last to finish: the notify (count exchange) of call 16")


class _Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_progress_report_tells_a_call_held_by_the_device_from_one_its_caller_never_reached(monkeypatch):
    from collections import deque

    from moe_ep.backends import intranode
    from moe_ep.backends.intranode import IntranodeBackend

    now = 1000.0
    monkeypatch.setattr(intranode.time, "monotonic", lambda: now)

    host = [0] * 32
    host[HOST_KERNEL_STARTED] = host[HOST_KERNEL_FINISHED] = _DISPATCH << 24 | 244
    shared = _Event(False)
    backend = types.SimpleNamespace(
        rank=1, _host=host, comm_stream=_Event(False),
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


def _enum(name: str) -> dict:
    """{enumerator: value} of csrc/kernels/api.cuh's `enum name` (implicit values count on)."""
    import os
    import re

    header = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "kernels",
                               "api.cuh")).read()
    body = re.search(r"enum %s : int \{(.*?)\};" % name, header, re.S).group(1)
    values, next_value = {}, 0
    for entry in re.sub(r"//[^\n]*", "", body).split(","):
        if entry.strip():
            enumerator, _, value = entry.partition("=")
            next_value = int(value) if value.strip() else next_value
            values[enumerator.strip()] = next_value
            next_value += 1
    return values


def test_the_host_record_and_kernel_ids_mirror_the_kernels():
    from moe_ep.backends import peers

    host_info = _enum("HostInfo")
    assert len(host_info) == 19
    for enumerator, value in host_info.items():  # kHostErrorPeerStartedMs -> HOST_ERROR_PEER_STARTED_MS
        python_name = "HOST" + "".join("_" + c if c.isupper() else c.upper() for c in enumerator[len("kHost"):])
        assert getattr(peers, python_name) == value, enumerator
    kernel_ids = _enum("KernelId")
    assert sorted(kernel_ids.values()) == sorted(peers.KERNEL_NAMES) == list(range(1, 8))
    assert peers.KERNEL_NAMES[kernel_ids["kKernelZeroCopyCombine"]] == "zero-copy combine"
    assert peers.KERNEL_NAMES[kernel_ids["kKernelNotify"]] == "notify (count exchange)"
    assert peers.KERNEL_NAMES[kernel_ids["kKernelRendezvous"]] == "rendezvous"
    # Every kind a failed intranode wait reports has its words (the low-latency kinds included).
    error_kinds = _enum("ErrorKind")
    assert sorted(peers.WAITED_FOR) == sorted(v for k, v in error_kinds.items() if k != "kErrNone")
    assert "reach this call" in peers.WAITED_FOR[error_kinds["kErrRendezvous"]]


def test_a_peer_missing_at_a_rendezvous_names_the_kernel_it_opens():
    host = [0] * 32
    host[HOST_ERROR], host[HOST_ERROR_KIND], host[HOST_ERROR_PEER] = 1, 10, 5  # kErrRendezvous, rank 5
    host[HOST_ERROR_WINDOW], host[HOST_ERROR_CALL], host[HOST_ERROR_SEEN] = _COMBINE, 42, 39
    host[HOST_ERROR_PEER_STARTED], host[HOST_ERROR_PEER_STARTED_MS] = _DISPATCH << 24 | 41, 20100
    message = str(MappedBuffers.timeout_error(types.SimpleNamespace(host=host, timeout_s=20.0, rank=1)))
    assert "rank 1 waited for it to reach this call's combine (ranks sharing a GPU start it together) (call 42" \
        in message, message
    assert "it had not started this call's kernel" in message, message
