"""Worker output: split byte streams into lines, print them with Horovod's rank prefixes.

Splitting happens where the worker runs (in its host's agent), so a line always travels
whole and two ranks can never interleave inside one line. ``\\n``, ``\\r\\n`` and a bare
``\\r`` (progress bars) each end a line; an unterminated tail is flushed at end of stream,
and the part of a line that stays buffered across reads is cut every ``max_line`` bytes
rather than buffered forever (a line within one read may be longer).

:class:`OutputSink` prints ``[rank]<stream>:line`` (optionally after Horovod's timestamp,
with the prefix coloured per rank), copies each rank's lines, without prefix and with the
terminators they had, to ``DIR/rank.N/stdout|stderr`` with ``--output-filename DIR`` (a
byte-exact copy of the rank's stream, as mpirun's; ``N`` zero-padded to the width
of the largest rank, as Horovod does, so that the directories sort in rank order), and
keeps hvdrun's one-line status ("connected 3/4 hosts, 12/16 workers registered") at the
bottom of a terminal.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

MAX_LINE = 64 * 1024


class Piece(NamedTuple):
    """A piece of a stream: a line's ``text``, and the ``end`` that followed it there
    (``\\n``, ``\\r\\n``, ``\\r``, or nothing for a cut or unterminated line), so that the
    pieces put back together are the stream's bytes. A ``\\n`` that completes the ``\\r``
    ending the previous chunk comes alone, not ``shown`` (it ends no line of its own)."""

    text: bytes
    end: bytes = b"\n"
    shown: bool = True


class LineSplitter:
    """Incremental splitter: ``feed(chunk)`` returns the complete lines, without terminators
    (``split(chunk)`` the pieces, terminators kept apart)."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self._max_line = max_line
        self._skip_lf = False  # the last chunk ended in '\r'; a leading '\n' belongs to it

    def feed(self, chunk: bytes) -> list[bytes]:
        return [piece.text for piece in self.split(chunk) if piece.shown]

    def flush(self) -> list[bytes]:
        """The unterminated tail at end of stream, if any."""
        return [piece.text for piece in self.tail()]

    def split(self, chunk: bytes) -> list[Piece]:
        pieces: list[Piece] = []
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]
            pieces.append(Piece(b"", b"\n", shown=False))
        self._skip_lf = False
        start = 0
        n = len(chunk)
        while start < n:
            lf = chunk.find(b"\n", start)
            cr = chunk.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            end = lf if cr < 0 or (0 <= lf < cr) else cr
            self._buf += chunk[start:end]
            start = end + 1
            terminator = b"\n"
            if chunk[end] == ord("\r"):
                terminator = b"\r"
                if start < n and chunk[start] == ord("\n"):
                    start += 1
                    terminator = b"\r\n"
                elif start == n:
                    self._skip_lf = True
            pieces.append(Piece(bytes(self._buf), terminator))
            self._buf.clear()
        self._buf += chunk[start:]
        while len(self._buf) >= self._max_line:
            pieces.append(Piece(bytes(self._buf[: self._max_line]), b""))
            del self._buf[: self._max_line]
        return pieces

    def tail(self) -> list[Piece]:
        """The unterminated tail at end of stream, if any, as a piece."""
        if not self._buf:
            return []
        tail = bytes(self._buf)
        self._buf.clear()
        return [Piece(tail, b"")]


#: Prefix colours (ANSI), one per rank in turn; red is left for hvdrun's own errors.
RANK_COLOURS = (36, 32, 33, 35, 34, 96, 92, 93, 95, 94)
CLEAR_LINE = b"\r\x1b[K"
TIMESTAMP_FORMAT = "%a %b %d %H:%M:%S %Y"  # Horovod's --prefix-timestamp format


@dataclass(frozen=True)
class OutputOptions:
    prefix_timestamp: bool = False
    colour_stdout: bool = False
    colour_stderr: bool = False
    output_dir: str | None = None
    status_line: bool = False  # hvdrun's stderr is a terminal
    num_ranks: int = 0  # the most ranks the job has at once: the width of rank.N


def rank_dir_name(rank: int, num_ranks: int) -> str:
    """``rank.N`` with N padded like Horovod's, to the digits of the highest rank: ``rank.07``
    in a job of 11 to 100 ranks, ``rank.7`` in one of 8."""
    width = len(str(max(num_ranks - 1, 0)))
    return f"rank.{rank:0{width}d}"


def use_colour(stream: BinaryIO | None, env: dict[str, str] | os._Environ[str]) -> bool:
    """Colour only on a terminal that can show it (not ``TERM=dumb``), and never when
    NO_COLOR is set (no-color.org)."""
    return not env.get("NO_COLOR") and env.get("TERM") != "dumb" and is_terminal(stream)


def is_terminal(stream: BinaryIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Guarded:
    """One of hvdrun's output streams (or an ``--output-filename`` file) that a failed write
    closes for good instead of raising into the job: a full disk, a reader gone (``| head``),
    a descriptor closed before hvdrun started. The job runs on; ``on_fail`` says so once."""

    def __init__(self, stream: BinaryIO | None, what: str, on_fail: Callable[[str], None]):
        self.stream = stream
        self._what = what
        self._on_fail = on_fail

    def write(self, data: bytes) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(data)
            self.stream.flush()
        except (OSError, ValueError) as exc:
            self.stream = None
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._on_fail(f"cannot write {self._what} ({reason}): it is dropped from now on")


class OutputSink:
    """Writes prefixed worker lines to hvdrun's stdout/stderr; remembers each rank's stderr tail.
    A stream that cannot be written (see :class:`_Guarded`) is dropped, said once on
    stderr; the job runs on."""

    def __init__(
        self,
        stdout: BinaryIO | None,
        stderr: BinaryIO | None,
        tail_lines: int = 10,
        options: OutputOptions | None = None,
    ) -> None:
        self._streams = {
            "stdout": _Guarded(stdout, "the job's output to stdout", self._dropped),
            "stderr": _Guarded(stderr, "to stderr", lambda _: None),
        }
        self._options = options or OutputOptions()
        self._lock = threading.Lock()
        self._tails: dict[int, collections.deque[str]] = {}
        self._tail_lines = tail_lines
        self._files: dict[tuple[int, str], _Guarded] = {}
        self._status = b""

    def open_files(self, ranks: Iterable[int]) -> None:
        """``--output-filename``: creates DIR/rank.N/{stdout,stderr} for every rank."""
        directory = self._options.output_dir
        if directory is None:
            return
        for rank in ranks:
            name = rank_dir_name(rank, max(self._options.num_ranks, rank + 1))
            rank_dir = os.path.join(directory, name)
            os.makedirs(rank_dir, exist_ok=True)
            for stream in ("stdout", "stderr"):
                path = os.path.join(rank_dir, stream)
                handle = open(path, "wb")  # noqa: SIM115
                self._files[(rank, stream)] = _Guarded(handle, path, self._dropped)

    def close(self) -> None:
        with self._lock:
            self._clear_status()
            self._status = b""
            for handle in self._files.values():
                if handle.stream is not None:
                    with contextlib.suppress(OSError):
                        handle.stream.close()
            self._files.clear()

    def line(
        self, rank: int, stream: str, text: bytes, end: bytes = b"\n", shown: bool = True
    ) -> None:
        """A worker's line (a :class:`Piece` of its stream): printed with its prefix unless
        not ``shown``; copied to the rank's ``--output-filename`` file with its own ``end``."""
        stream = "stderr" if stream == "stderr" else "stdout"
        if not shown:
            with self._lock:
                handle = self._files.get((rank, stream))
                if handle is not None:
                    handle.write(end)
            return
        out = self._streams[stream]
        prefix = b"[%d]<%s>:" % (rank, stream.encode())
        colour = self._options.colour_stderr if stream == "stderr" else self._options.colour_stdout
        if colour:
            code = RANK_COLOURS[rank % len(RANK_COLOURS)]
            prefix = b"\x1b[%dm%s\x1b[0m" % (code, prefix)
        if self._options.prefix_timestamp:
            prefix = time.strftime(TIMESTAMP_FORMAT).encode() + prefix
        if stream == "stderr":
            tail = self._tails.setdefault(rank, collections.deque(maxlen=self._tail_lines))
            tail.append(text.decode("utf-8", "replace"))
        with self._lock:
            self._clear_status()
            out.write(prefix + text + b"\n")
            handle = self._files.get((rank, stream))
            if handle is not None:
                handle.write(text + end)
            self._draw_status()

    def message(self, text: str) -> None:
        """One of hvdrun's own messages, on stderr."""
        with self._lock:
            self._clear_status()
            self._streams["stderr"].write(f"hvdrun: {text}\n".encode())
            self._draw_status()

    def status(self, text: str | None) -> None:
        """Shows (or with None removes) the status line; only when stderr is a terminal."""
        if not self._options.status_line:
            return
        status = f"hvdrun: {text}".encode() if text else b""
        with self._lock:
            if status == self._status:
                return
            self._clear_status()
            self._status = status
            self._draw_status()

    def _clear_status(self) -> None:
        if self._status:
            self._streams["stderr"].write(CLEAR_LINE)

    def _draw_status(self) -> None:
        if self._status:
            self._streams["stderr"].write(self._status)

    def _dropped(self, why: str) -> None:
        """A stream failed (under the lock): said once on stderr."""
        self._streams["stderr"].write(f"hvdrun: {why}\n".encode())

    def stderr_tail(self, rank: int) -> list[str]:
        return list(self._tails.get(rank, ()))
