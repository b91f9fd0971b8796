"""Worker output: split byte streams into lines, print them with Horovod's rank prefixes.

Splitting happens where the worker runs (in its host's agent), so a line always travels
whole and two ranks can never interleave inside one line. ``\\n``, ``\\r\\n`` and a bare
``\\r`` (progress bars) each end a line (a bare ``\\r`` that ends nothing, as a progress
bar's first, shows no empty line); an unterminated tail is flushed at end of stream,
and the part of a line that stays buffered across reads is cut every ``max_line`` bytes
rather than buffered forever (a line within one read may be longer).

:class:`OutputSink` prints ``[rank]<stream>:line`` (optionally after Horovod's timestamp,
with the prefix coloured per rank), copies each rank's lines, without prefix and with the
terminators they had, to ``DIR/rank.N/stdout|stderr`` with ``--output-filename DIR`` (a
byte-exact copy of the rank's stream, as mpirun's; ``N`` zero-padded to the width
of the largest rank, as Horovod does, so that the directories sort in rank order), and
keeps hvdrun's one-line status ("connected 3/4 hosts, 12/16 workers registered") at the
bottom of a terminal.

**hvdrun never waits for its own output** (``OutputSink(background=True)``, as hvdrun runs
it): a reader that is slow or stopped reading (``| less``, a paused pipe) must not hold off a
Ctrl-C, a failure or the agents' reports. Every write runs, in order, on a thread of its own,
and the supervising thread only queues. Worker lines may wait there up to
``BACKLOG_BYTES``; beyond that the agents' readers wait for room before they pass on a
worker's line (:meth:`OutputSink.wait_for_room`), and so the agents, and the workers'
own writes, as with a plain pipe: hvdrun's memory stays bounded. Once the job is being
stopped, lines over that budget are dropped instead (and counted), so that the agents'
reports get through. At the end, what is queued is written, however long the reader takes,
as through a plain pipe or mpirun (``| (sleep 60; cat)`` gets every line); only once hvdrun
was signalled (a Ctrl-C, also one while it waits there) is what could not be written for
``STUCK_SECONDS`` dropped, and hvdrun says so and exits.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

MAX_LINE = 64 * 1024
#: The bytes of worker lines that may wait to be written before the agents' readers wait.
BACKLOG_BYTES = 8 * 1024 * 1024
#: At the end of a job hvdrun was signalled to stop, how long the queued output may go without
#: a byte written before it is dropped.
STUCK_SECONDS = 5.0
#: What a queued line costs besides its bytes (its objects), counted against BACKLOG_BYTES.
LINE_COST = 512


class Piece(NamedTuple):
    """A piece of a stream: a line's ``text``, and the ``end`` that followed it there
    (``\\n``, ``\\r\\n``, ``\\r``, or nothing for a cut or unterminated line), so that the
    pieces put back together are the stream's bytes. A ``\\n`` that completes the ``\\r``
    ending the previous chunk comes alone, not ``shown`` (it ends no line of its own);
    nor is an empty piece that a bare ``\\r`` ends."""

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
        self._skipped_cr = False  # and that '\r' ended nothing, so was not shown

    def feed(self, chunk: bytes) -> list[bytes]:
        return [piece.text for piece in self.split(chunk) if piece.shown]

    def flush(self) -> list[bytes]:
        """The unterminated tail at end of stream, if any."""
        return [piece.text for piece in self.tail()]

    def split(self, chunk: bytes) -> list[Piece]:
        pieces: list[Piece] = []
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]
            # (an empty line's CR LF, cut between two chunks, is a line after all)
            pieces.append(Piece(b"", b"\n", shown=self._skipped_cr))
        self._skip_lf = self._skipped_cr = False
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
            # A bare '\r' that ends nothing (a progress bar's first '\r', or one after a
            # line's end) is no line of its own to show.
            shown = bool(self._buf) or terminator != b"\r"
            self._skipped_cr = not shown
            pieces.append(Piece(bytes(self._buf), terminator, shown))
            self._buf.clear()
        self._buf += chunk[start:]
        while len(self._buf) >= self._max_line:
            pieces.append(Piece(bytes(self._buf[: self._max_line]), b""))
            del self._buf[: self._max_line]
        return pieces

    def split_run(self, chunk: bytes) -> tuple[bytes, list[Piece]]:
        """:meth:`split` where the chunk's whole lines may travel as they are: the bytes of
        its ``\n``-ended lines (the first completing the line pending from earlier chunks)
        in one run, when the chunk holds no ``\r``; and the pieces of the rest."""
        cut = chunk.rfind(b"\n") + 1
        if not cut or self._skip_lf or b"\r" in chunk:
            return b"", self.split(chunk)
        run = bytes(self._buf) + chunk[:cut]
        self._buf.clear()
        return run, self.split(chunk[cut:]) if cut < len(chunk) else []

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


def fitted(line: str, fd: int | None) -> str:
    """``line`` cut to fit one row of the terminal at ``fd`` (else ``COLUMNS``, else 80):
    the status line is cleared by :data:`CLEAR_LINE`, which clears one row, so a line that
    wrapped left its first row behind at every redraw."""
    try:
        columns = os.get_terminal_size(fd).columns if fd is not None else 0
    except OSError:
        columns = 0
    columns = columns or shutil.get_terminal_size().columns
    if len(line) < columns:
        return line
    return line[: max(columns - 4, 1)] + "..."


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
    a descriptor closed before hvdrun started (``stream`` None). The job runs on;
    ``on_fail`` says so once.

    A stream with a file descriptor is written with ``os.write`` on it, past Python's
    buffered writer: a write that blocks for good (a reader that stopped reading) then holds
    no lock of the interpreter's, which would abort hvdrun's exit."""

    def __init__(self, stream: BinaryIO | None, what: str, on_fail: Callable[[str], None]):
        self.stream = stream
        self._what = what
        self._on_fail = on_fail
        self._fd: int | None = None
        self._missing = stream is None
        self.busy = False  # a write is under way
        #: What the stream writes to (its file's device and inode; for an in-memory stream
        #: the object): stdout and stderr may be one pipe.
        self.identity: object = id(stream)
        if stream is not None:
            try:
                stream.flush()
                self._fd = stream.fileno()
                status = os.fstat(self._fd)
                self.identity = (status.st_dev, status.st_ino)
            except (OSError, ValueError, AttributeError):
                self._fd = None  # (an in-memory stream)

    @property
    def fd(self) -> int | None:
        """The stream's file descriptor (None: an in-memory stream, or none)."""
        return self._fd

    def give_up(self) -> None:
        """Drops the stream without a word (it blocks for good: nobody would read it)."""
        self.stream = None
        self._missing = False

    def write(self, data: bytes) -> None:
        if self.stream is None:
            if self._missing:
                self._missing = False
                self._on_fail(
                    f"cannot write {self._what} (the descriptor was closed when hvdrun "
                    "started): it is dropped"
                )
            return
        try:
            fd = self._fd
            if fd is None:
                self.stream.write(data)
                self.stream.flush()
                return
            view = memoryview(data)
            self.busy = True
            try:
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                self.busy = False
        except (OSError, ValueError) as exc:
            self.stream = None
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._on_fail(f"cannot write {self._what} ({reason}): it is dropped from now on")


class _Lines:
    """Worker lines to write to one of a sink's streams, in one write (with the status
    line cleared and drawn again around it)."""

    def __init__(self, sink: OutputSink, out: _Guarded, parts: list[bytes], count: int) -> None:
        self.sink, self.out, self.parts = sink, out, parts
        self.count = count  # the lines in parts

    def __call__(self) -> None:
        sink = self.sink
        with sink._lock:
            sink._clear_status()
            self.out.write(b"".join(self.parts))
            sink._draw_status()


class _Backlog:
    """The writes of a sink in the background: run in order on a thread of their own (see
    the module docstring). ``pending``: the bytes of worker lines queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0
        self.dropped = 0  # worker lines dropped over the limit while the job stopped
        self.overflow = False  # drop lines over the limit instead of waiting for room
        self._cond = threading.Condition()
        # (a job, its bytes of worker lines, and the text of hvdrun's message it writes)
        self._jobs: collections.deque[tuple[Callable[[], None], int, str | None]] = (
            collections.deque()
        )
        self._busy = False
        self._done = False
        self._progress = time.monotonic()
        threading.Thread(target=self._run, name="hvdrun-output", daemon=True).start()

    def put(self, job: Callable[[], None], size: int = 0, said: str | None = None) -> bool:
        """Queues ``job`` (``size``: what the worker's line it writes counts, 0 for hvdrun's
        own writes; ``said``: the text of the hvdrun message it writes); False once the
        backlog finished (the caller writes itself). Worker lines (:class:`_Lines`) for the
        stream of the job queued last join it: a flood of lines goes out in few writes."""
        with self._cond:
            if self._done:
                return False
            if size and self.overflow and self.pending + size > self.limit:
                self.dropped += job.count if isinstance(job, _Lines) else 1
                return True
            self.pending += size
            if self._jobs and isinstance(job, _Lines):
                last, last_size, _ = self._jobs[-1]
                if isinstance(last, _Lines) and last.out is job.out:
                    last.parts += job.parts
                    last.count += job.count
                    self._jobs[-1] = (last, last_size + size, None)
                    return True
            self._jobs.append((job, size, said))
            self._cond.notify_all()
        return True

    def wait_for_room(self) -> None:
        with self._cond:
            while self.pending > self.limit and not (self.overflow or self._done):
                self._cond.wait(0.2)

    def backed_up(self) -> bool:
        return self.pending > self.limit

    def stop_waiting(self) -> None:
        with self._cond:
            self.overflow = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._done:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, size, _ = self._jobs.popleft()
                self._busy = True
                self._progress = time.monotonic()
            try:
                job()
            finally:
                with self._cond:
                    self._busy = False
                    self.pending -= size
                    self._progress = time.monotonic()
                    self._cond.notify_all()

    def finish(
        self, stuck: float, interrupted: Callable[[], object] | None
    ) -> tuple[int, list[str], bool]:
        """Waits until everything queued is written, or, once ``interrupted()`` holds (at
        once without it), until nothing was for ``stuck`` seconds; returns the worker lines
        left unwritten, the messages left unwritten, and whether a write is still under way
        (blocked)."""
        with self._cond:
            self.overflow = True
            limited = False
            while self._jobs or self._busy:
                if not limited and (interrupted is None or interrupted()):
                    limited = True  # (a reader stuck since long ago gets stuck / 2 from now)
                    self._progress = max(self._progress, time.monotonic() - stuck / 2)
                if limited and time.monotonic() - self._progress >= stuck:
                    break
                self._cond.wait(0.2)
            said = [text for _, _, text in self._jobs if text is not None]
            left = sum(job.count for job, _, _ in self._jobs if isinstance(job, _Lines))
            self._jobs.clear()
            self._done = True
            self._cond.notify_all()
            return left, said, self._busy


class OutputSink:
    """Writes prefixed worker lines to hvdrun's stdout/stderr; remembers each rank's stderr tail.
    A stream that cannot be written (see :class:`_Guarded`) is dropped, said once on
    stderr; the job runs on. ``background``: the writes run on a thread of their own, and
    no caller waits for them but a reader that passes on worker lines while too many wait
    (see the module docstring); otherwise each call writes before it returns."""

    def __init__(
        self,
        stdout: BinaryIO | None,
        stderr: BinaryIO | None,
        tail_lines: int = 10,
        options: OutputOptions | None = None,
        background: bool = False,
        backlog_bytes: int = BACKLOG_BYTES,
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
        self._unkept: set[int] = set()  # ranks whose files could not be made (said once)
        self._files_lock = threading.Lock()
        self._status = b""
        self._backlog = _Backlog(backlog_bytes) if background else None

    def _run(self, job: Callable[[], None], size: int = 0, said: str | None = None) -> None:
        """Runs a write now, or queues it on the backlog (see :meth:`_Backlog.put`)."""
        backlog = self._backlog
        if backlog is None or not backlog.put(job, size, said):
            job()

    def wait_for_room(self) -> None:
        """Blocks while the worker lines queued pass the backlog's limit (the agents' readers
        call it before they pass on a worker's line); returns at once without a backlog, and
        once the job is being stopped (:meth:`stop_waiting`)."""
        if self._backlog is not None:
            self._backlog.wait_for_room()

    def backed_up(self) -> bool:
        """Whether the worker lines queued pass the limit: the agents' readers may be
        waiting, so their silence says nothing about the agents."""
        return self._backlog is not None and self._backlog.backed_up()

    def stop_waiting(self) -> None:
        """The job is being stopped: from now on, worker lines over the backlog's limit are
        dropped (and counted) rather than waited for, so that the agents' reports get
        through."""
        if self._backlog is not None:
            self._backlog.stop_waiting()

    def open_files(self, ranks: Iterable[int]) -> None:
        """``--output-filename``: creates DIR/rank.N/{stdout,stderr} for every rank. One that
        cannot be made (a full disk, a file in the way; an elastic job's rank that joins
        later too) is said once and left out: the rank's output still shows here, and the
        job runs on."""
        directory = self._options.output_dir
        if directory is None:
            return
        for rank in ranks:
            name = rank_dir_name(rank, max(self._options.num_ranks, rank + 1))
            rank_dir = os.path.join(directory, name)
            path = rank_dir
            try:
                os.makedirs(rank_dir, exist_ok=True)
                for stream in ("stdout", "stderr"):
                    path = os.path.join(rank_dir, stream)
                    handle = open(path, "wb")  # noqa: SIM115
                    # (a failure is said as hvdrun's messages are: never waiting on stderr)
                    self._files[(rank, stream)] = _Guarded(handle, path, self.message)
            except OSError as error:
                for stream in ("stdout", "stderr"):  # (none of the rank's, not half of them)
                    opened = self._files.pop((rank, stream), None)
                    if opened is not None and opened.stream is not None:
                        opened.stream.close()
                if rank not in self._unkept:  # (an elastic rank comes back each generation)
                    self._unkept.add(rank)
                    self.message(
                        f"cannot write {path} ({error.strerror or error}): rank {rank}'s "
                        "output is not kept in files"
                    )

    def close(
        self, interrupted: Callable[[], object] | None = None, stuck: float = STUCK_SECONDS
    ) -> None:
        """Writes what is queued, removes the status line and closes the
        ``--output-filename`` files; later calls write at once. Given ``interrupted``
        (whether hvdrun was signalled), it waits for the reader as long as that is false;
        once it holds (at once without it), what could not be written for ``stuck`` seconds
        is dropped, said on stderr."""
        backlog, self._backlog = self._backlog, None
        blocked = False
        if backlog is not None:
            left, said, blocked = backlog.finish(stuck, interrupted)
            if blocked:
                # The write under way holds the lock for good; the status line's state is
                # unknown; and what it writes to (stderr too, where both go to one pipe) takes
                # nothing more: a later write there would block hvdrun's exit.
                self._lock = threading.Lock()
                self._status = b""
                stuck_on = {g.identity for g in self._streams.values() if g.busy}
                for guarded in self._streams.values():
                    if guarded.identity in stuck_on:
                        guarded.give_up()
            for text in said:  # (hvdrun's own messages go to stderr, which may still work)
                self.message(text)
            if left or blocked:
                self.message(
                    f"the job's output could not be written for {stuck:g} s (a reader that "
                    f"stopped reading): {left + blocked} line(s) of it dropped"
                )
            if backlog.dropped:
                self.message(
                    f"{backlog.dropped} line(s) of the job's output dropped while it stopped: "
                    f"more than {backlog.limit // 1024} KiB waited to be written"
                )
        with self._lock:
            self._clear_status()  # (none left to clear where a write was blocked)
            self._status = b""
        with self._files_lock:
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
        # The copy is written at once (a file, not the reader of hvdrun's output: every byte
        # goes there, whatever happens to the terminal's line).
        self._copy(rank, stream, text + end)
        if shown:
            self._show(rank, stream, text)

    def lines(self, rank: int, stream: str, data: bytes) -> None:
        """A worker's whole lines (a :class:`~launcher.transport.protocol.Lines` run: each
        ends in ``\\n``), as :meth:`line` would show each, in one go."""
        stream = "stderr" if stream == "stderr" else "stdout"
        self._copy(rank, stream, data)
        self._show(rank, stream, data[:-1])

    def _show(self, rank: int, stream: str, body: bytes) -> None:
        """Prints ``body``'s lines (joined by ``\\n``, the last without it) with their
        prefix, and keeps the last of stderr's as the rank's tail."""
        if stream == "stderr":
            last = body.rsplit(b"\n", self._tail_lines)[-self._tail_lines :]
            self._tail(rank).extend(text.decode("utf-8", "replace") for text in last)
        prefix = self._prefix(rank, stream)
        shown = prefix + body.replace(b"\n", b"\n" + prefix) + b"\n"
        count = body.count(b"\n") + 1
        self._run(
            _Lines(self, self._streams[stream], [shown], count), len(shown) + LINE_COST * count
        )

    def _prefix(self, rank: int, stream: str) -> bytes:
        prefix = b"[%d]<%s>:" % (rank, stream.encode())
        colour = self._options.colour_stderr if stream == "stderr" else self._options.colour_stdout
        if colour:
            code = RANK_COLOURS[rank % len(RANK_COLOURS)]
            prefix = b"\x1b[%dm%s\x1b[0m" % (code, prefix)
        if self._options.prefix_timestamp:
            prefix = time.strftime(TIMESTAMP_FORMAT).encode() + prefix
        return prefix

    def _tail(self, rank: int) -> collections.deque[str]:
        return self._tails.setdefault(rank, collections.deque(maxlen=self._tail_lines))

    def _copy(self, rank: int, stream: str, data: bytes) -> None:
        with self._files_lock:
            handle = self._files.get((rank, stream))
            if handle is not None:
                handle.write(data)

    def message(self, text: str) -> None:
        """One of hvdrun's own messages, on stderr."""
        self._run(lambda: self._message(text), said=text)

    def _message(self, text: str) -> None:
        with self._lock:
            self._clear_status()
            self._streams["stderr"].write(f"hvdrun: {text}\n".encode())
            self._draw_status()

    def status(self, text: str | None) -> None:
        """Shows (or with None removes) the status line; only when stderr is a terminal."""
        if self._options.status_line:
            self._run(lambda: self._show_status(text))

    def _show_status(self, text: str | None) -> None:
        status = fitted(f"hvdrun: {text}", self._streams["stderr"].fd).encode() if text else b""
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
