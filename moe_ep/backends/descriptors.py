"""Passing file descriptors between the ranks of one host.

Memory exported through the driver's virtual-memory API is named by a file descriptor, which only the
kernel can carry from one process to another: over a Unix socket (SCM_RIGHTS). Every rank listens on an
abstract socket (no file to clean up), publishes its name through the Buffer's ArrivalGate (bounded
wait: a rank that never arrives is named), serves its descriptor to each peer that connects, and
fetches each peer's. Only processes of the same user get the descriptor. Ranks that cannot reach each
other's sockets (another network namespace, another host) make every rank raise DescriptorsUnavailable
together, so that the caller can fall back to another mapping collectively.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import uuid
from typing import Dict, List, Tuple

from ..sync import ArrivalGate

_NAME = struct.Struct("<H")  # length of the socket name in a payload


class DescriptorsUnavailable(RuntimeError):
    """Some rank could not fetch a peer's descriptor; raised on every rank of the exchange alike."""


def _serve(server: socket.socket, fd: int, peers: int, failure: List[BaseException]) -> None:
    try:
        served = 0
        while served < peers:
            conn, _ = server.accept()
            with conn:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _, uid, _ = struct.unpack("3i", creds)
                if uid != os.getuid():  # not one of ours: it gets nothing and does not count as a peer
                    continue
                socket.send_fds(conn, [b"m"], [fd])
                served += 1
    except BaseException as e:  # noqa: B902 (re-raised in the caller's thread)
        failure.append(e)


def exchange_descriptors(
    gate: ArrivalGate, phase: str, fd: int, payload: bytes
) -> Tuple[List[bytes], Dict[int, int]]:
    """Collective over the gate's group, every rank on this host: every rank's `payload` in rank order,
    and from each other rank a descriptor of what it exported (rank -> fd, the caller's to close)."""
    rank, num_ranks = gate.rank, gate.num_ranks
    name = f"\0moe_ep/{os.getpid()}/{uuid.uuid4().hex}".encode()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.settimeout(gate.timeout_s)
    failure: List[BaseException] = []
    received: Dict[int, int] = {}
    try:
        server.bind(name)
        server.listen(num_ranks)
        serving = threading.Thread(target=_serve, args=(server, fd, num_ranks - 1, failure), daemon=True)
        serving.start()
        payloads = gate.exchange(phase, _NAME.pack(len(name)) + name + payload)
        names, own_payloads = [], []
        for p in payloads:
            (n,) = _NAME.unpack_from(p)
            names.append(p[_NAME.size : _NAME.size + n])
            own_payloads.append(p[_NAME.size + n :])
        problem = b""
        for peer in range(num_ranks):
            if peer == rank:
                continue
            try:
                received[peer] = _fetch(names[peer], peer, gate.timeout_s)
            except RuntimeError as e:
                problem = str(e).encode()
                break
        # Every rank learns whether every other got all its descriptors before anyone waits on its server
        # (a peer that could not connect would leave it waiting until the deadline).
        outcomes = gate.exchange(f"{phase} (descriptors received)", problem)
        failed = {r: o.decode() for r, o in enumerate(outcomes) if o}
        if failed:
            raise DescriptorsUnavailable(f"moe_ep: {phase}: " + "; ".join(f"rank {r} {why}" for r, why in failed.items()))
        serving.join(gate.timeout_s)
        if serving.is_alive():
            raise TimeoutError(
                f"moe_ep: {phase}: not every peer fetched rank {rank}'s descriptor within {gate.timeout_s:g} s"
            )
        if failure:
            reason = failure[0]
            raise RuntimeError(f"moe_ep: {phase}: rank {rank} could not hand out its descriptor: {reason}") from reason
        return own_payloads, received
    except BaseException:
        for got in received.values():
            os.close(got)
        raise
    finally:
        server.close()


def _fetch(name: bytes, peer: int, timeout_s: float) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            conn.connect(name)
            _, fds, _, _ = socket.recv_fds(conn, 1, 1)
        except OSError as e:
            raise RuntimeError(
                f"could not fetch rank {peer}'s memory descriptor over a Unix socket ({e}): the ranks are not in "
                "one network namespace of one host"
            ) from e
        if len(fds) != 1:
            raise RuntimeError(f"rank {peer} sent no memory descriptor")
        return fds[0]
