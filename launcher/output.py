"""Worker output: split byte streams into lines, print them with Horovod's rank prefixes.

Splitting happens where the worker runs (in its host's agent), so a line always travels
whole and two ranks can never interleave inside one line. ``\\n``, ``\\r\\n`` and a bare
``\\r`` (progress bars) each end a line; an unterminated tail is flushed at end of stream,
and a line longer than ``max_line`` bytes is cut into pieces rather than buffered forever.
"""

from __future__ import annotations

import collections
import threading
from typing import BinaryIO

MAX_LINE = 64 * 1024


class LineSplitter:
    """Incremental splitter: ``feed(chunk)`` returns the complete lines, without terminators."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self._max_line = max_line
        self._skip_lf = False  # the last chunk ended in '\r'; a leading '\n' belongs to it

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._skip_lf = False
        lines: list[bytes] = []
        start = 0
        n = len(chunk)
        while start < n:
            lf = chunk.find(b"\n", start)
            cr = chunk.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            end = lf if cr < 0 or (0 <= lf < cr) else cr
            self._buf += chunk[start:end]
            lines.append(bytes(self._buf))
            self._buf.clear()
            start = end + 1
            if chunk[end] == ord("\r"):
                if start < n and chunk[start] == ord("\n"):
                    start += 1
                elif start == n:
                    self._skip_lf = True
        self._buf += chunk[start:]
        while len(self._buf) >= self._max_line:
            lines.append(bytes(self._buf[: self._max_line]))
            del self._buf[: self._max_line]
        return lines

    def flush(self) -> list[bytes]:
        """The unterminated tail at end of stream, if any."""
        if not self._buf:
            return []
        tail = bytes(self._buf)
        self._buf.clear()
        return [tail]


class OutputSink:
    """Writes prefixed worker lines to hvdrun's stdout/stderr; remembers each rank's stderr tail."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO, tail_lines: int = 10) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._lock = threading.Lock()
        self._tails: dict[int, collections.deque[str]] = {}
        self._tail_lines = tail_lines

    def line(self, rank: int, stream: str, text: bytes) -> None:
        out = self._streams["stderr" if stream == "stderr" else "stdout"]
        data = b"[%d]<%s>:%s\n" % (rank, stream.encode(), text)
        if stream == "stderr":
            tail = self._tails.setdefault(rank, collections.deque(maxlen=self._tail_lines))
            tail.append(text.decode("utf-8", "replace"))
        with self._lock:
            out.write(data)
            out.flush()

    def message(self, text: str) -> None:
        """One of hvdrun's own messages, on stderr."""
        with self._lock:
            self._streams["stderr"].write(f"hvdrun: {text}\n".encode())
            self._streams["stderr"].flush()

    def stderr_tail(self, rank: int) -> list[str]:
        return list(self._tails.get(rank, ()))
