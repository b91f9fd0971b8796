"""A TCP relay for tests that watch or steer a client's connections to a server.

Each connection it accepts goes to the next of its target ports (the last one takes every
connection after that), bytes passed on unchanged both ways and recorded as they pass: a
test can send a client's first connection somewhere else, or check what crossed the wire
(the secret must not, where the rendezvous speaks TLS).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Sequence


class Forwarder:
    """Listens on ``host`` (any free port: :attr:`port`); connection ``i`` goes to
    ``targets[min(i, len(targets) - 1)]`` on the same host."""

    def __init__(self, targets: Sequence[int], host: str = "127.0.0.1") -> None:
        self.targets = list(targets)
        self.host = host
        #: Every byte forwarded, both ways, in the order it passed.
        self.captured = bytearray()
        #: What each connection's client sent first (its first read), in connection order.
        self.openings: list[bytes] = []
        self.connections = 0
        self._lock = threading.Lock()
        self.listener = socket.create_server((host, 0))
        self.port: int = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            target = self.targets[min(self.connections, len(self.targets) - 1)]
            self.connections += 1
            try:
                upstream = socket.create_connection((self.host, target))
            except OSError:
                conn.close()
                continue
            self._sockets += [conn, upstream]
            opening = len(self.openings)
            self.openings.append(b"")
            threading.Thread(target=self._pipe, args=(conn, upstream, opening), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn, None), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, opening: int | None) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.captured += data
                    if opening is not None and not self.openings[opening]:
                        self.openings[opening] = bytes(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def cut(self) -> None:
        """Closes every connection made so far (a reset network), and goes on listening."""
        for sock in self._sockets[1:]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        del self._sockets[1:]

    def close(self) -> None:
        """Stops listening (a thread blocked in accept() would keep a closed listener
        accepting: shutdown() wakes it) and closes every connection."""
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
