"""TCP reachability as ``hvdrun --check-hosts`` tries it: a listener that accepts and drops
connections (on hvdrun's machine for the agents to connect back to; on each host's Gloo
address for the other hosts), and connection tries that say why they failed. Shared by
hvdrun and the agents, which import neither torch nor grpc.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Mapping

from rendezvous.addresses import connect_error, listening_socket, split_addr

#: How long an agent's connection back to hvdrun's machine may take.
CONNECT_BACK_TIMEOUT = 5.0
#: How long a host's connection to another host's Gloo address may take (the job's own
#: check, collectives/runtime/reach.py, gives it 15 s; hosts that answer take milliseconds).
PEER_TIMEOUT = 10.0


def connect_problem(addr: str, timeout: float) -> str | None:
    """None when a TCP connection to ``addr`` works within ``timeout`` s, else why not."""
    try:
        host, port = split_addr(addr)
    except ValueError as exc:
        return f"cannot connect to {addr}: {exc}"
    start = time.monotonic()
    error = connect_error(host, port, timeout)
    if isinstance(error, TimeoutError):
        return f"timed out after {time.monotonic() - start:.0f} s connecting to {addr}"
    if error is not None:
        return f"cannot connect to {addr}: {error.strerror or error}"
    return None


def reach_peers(targets: Mapping[str, str]) -> dict[str, str | None]:
    """Per host, :func:`connect_problem` for its address in ``targets`` (all at once, each
    within :data:`PEER_TIMEOUT`)."""
    results: dict[str, str | None] = {}

    def reach(host: str, addr: str) -> None:
        results[host] = connect_problem(addr, PEER_TIMEOUT)

    threads = [threading.Thread(target=reach, args=item) for item in targets.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


class Listener:
    """Accepts (and drops) TCP connections on ``bind_host``, at a free port: what hvdrun's
    machine and the hosts' Gloo addresses are tried with (accepted, so that any number of
    hosts can connect)."""

    def __init__(self, bind_host: str) -> None:
        self.sock = listening_socket(bind_host)
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
