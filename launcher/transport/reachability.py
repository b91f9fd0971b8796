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

from rendezvous.addresses import split_addr

#: How long an agent's connection back to hvdrun's machine may take.
CONNECT_BACK_TIMEOUT = 5.0
#: How long a host's connection to another host's Gloo address may take (the job's own
#: check, collectives/runtime/reach.py, gives it 15 s; hosts that answer take milliseconds).
PEER_TIMEOUT = 10.0


def connect_error(addr: str, timeout: float) -> str | None:
    """None when a TCP connection to ``addr`` works within ``timeout`` s, else why not."""
    start = time.monotonic()
    try:
        host, port = split_addr(addr)
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        return f"timed out after {time.monotonic() - start:.0f} s connecting to {addr}"
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"cannot connect to {addr}: {reason}"
    return None


def reach_peers(targets: Mapping[str, str]) -> dict[str, str | None]:
    """Per host, :func:`connect_error` for its address in ``targets`` (all at once, each
    within :data:`PEER_TIMEOUT`)."""
    results: dict[str, str | None] = {}

    def reach(host: str, addr: str) -> None:
        results[host] = connect_error(addr, PEER_TIMEOUT)

    threads = [threading.Thread(target=reach, args=item) for item in targets.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


class Listener:
    """Accepts (and drops) TCP connections on ``bind_host`` (port ``port``, any free one by
    default): what hvdrun's machine and the hosts' Gloo addresses are tried with."""

    def __init__(self, bind_host: str, port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind_host, port))
        self.sock.listen(128)
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
