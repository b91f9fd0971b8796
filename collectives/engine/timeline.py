"""Horovod's timeline: a Chrome-trace file (``chrome://tracing``, Perfetto) of every op.

Each op name gets its own row (a trace "process" named after the tensor; in a process set
other than the global one, ``name (process set N)``), on which the engine records the phases
an op goes through::

    NEGOTIATE_ALLREDUCE   from submission until every rank has submitted it, with a tick
                          for each rank's announcement (when this rank learned of it)
    ALLREDUCE             from then until the result is ready, containing
      QUEUE                 waiting for earlier ops of the same cycle
      MEMCPY_IN_FUSION_BUFFER
      GLOO_ALLREDUCE        the collective itself (NCCL_ALLREDUCE on CUDA tensors)
      MEMCPY_OUT_FUSION_BUFFER

The file is a JSON array that stays valid while it is written: the engine appends a cycle's
events in one write over the closing bracket, which it writes again behind them, so a file
copied off a running job always parses. Only the engine thread writes; events are buffered
during a cycle and written at its end. A write that fails (a full disk, a file size limit)
ends the recording, as in Horovod: the rank says so once, the file is cut back to the events
written whole and closed, and the job runs on without it.

For merging the timelines of all ranks into one trace (``hvdrun --merge-timelines``), each
file starts with an ``hvdrun_rank`` metadata event (the rank, its host, and the monotonic
clock's and the wall clock's readings at the file's time 0: ``monotonic_us``, ``unix_s``,
by which hvdrun tells the files a job wrote from an earlier job's), and each NEGOTIATE phase
ends with the round that made the op ready (``args.round``: process set and cycle, alike on
every rank; in an elastic job behind the membership generation, ``2/0:17``): the rounds
every rank left together align the ranks' clocks.

The job's own timeline (``--timeline-filename``, which ``hvd.init()`` opens: see
:func:`open_for_job`) is one file per process for the whole job: a process that opens it
again later in the job (an elastic job's next generation, a script's ``hvd.init()`` after
``hvd.shutdown()``) writes on where it left it, on the same clock and rows, provided the file
is as it left it (else, and the first time, the file starts afresh). A recording the script
starts (``hvd.start_timeline()``: :func:`open_for_rank`) always starts its file afresh.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from rendezvous import worker_env

__all__ = ["Timeline", "TimelineSlot", "open_for_job", "open_for_rank"]

_CLOSE = b"\n]\n"
#: Rows (op names) a timeline keeps in memory. Beyond it, the older half of the rows with no
#: phase open (by their latest event) is forgotten, and a forgotten name seen again gets a new
#: row: names made per step (``loss.{step}``) and unnamed ops (``allreduce.noname.N``) each
#: take a row, which otherwise held about 270 bytes per op for as long as the job ran.
MAX_ROWS = 4096
_DATA_OPS = {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"}


@dataclass(frozen=True)
class _Left:
    """How a process left its job's timeline when it closed it: the file then (device, inode,
    size and modification time: one that changed since starts afresh), and what writing on
    needs (the time 0, the rows and their last events)."""

    file: tuple[int, int, int, int]
    start: float
    rows: dict[str, int]
    next_row: int
    last: dict[int, float]


#: The job timelines this process closed, by (job id, real path): where the next opening of
#: one in this process writes on (see :func:`open_for_job`).
_LEFT: dict[tuple[str, str], _Left] = {}
_LEFT_LOCK = threading.Lock()


def _file_state(path_or_fd: str | int) -> tuple[int, int, int, int]:
    """What tells a file that changed: its device, inode, size and modification time."""
    found = os.stat(path_or_fd)
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


def _left_as_it_was(key: tuple[str, str] | None) -> _Left | None:
    """Where this process left the job's timeline ``key`` when it last closed it, if the
    file is still as it left it (nothing wrote it since); None: the file starts afresh."""
    if key is None:
        return None
    with _LEFT_LOCK:
        left = _LEFT.pop(key, None)
    if left is None:
        return None
    try:
        unchanged = _file_state(key[1]) == left.file
    except OSError:
        return None
    return left if unchanged else None


class Timeline:
    """An open timeline file.

    Every row keeps a stack of its open phases: ``end`` closes only the phase on top, and
    ``close`` ends whatever is still open, so the file has balanced begin/end events per row
    even when recording starts or stops while ops are in flight. Thread-safe (the engine
    records, any thread may stop the recording).
    """

    def __init__(
        self,
        path: str,
        mark_cycles: bool = False,
        rank: int | None = None,
        host: str = "",
        *,
        job: str | None = None,
        generation: int = 0,
    ) -> None:
        """``job``: the id of the job whose own timeline this is (:func:`open_for_job`): this
        process writes on where it left the file when it opened it before in the job; None:
        a recording of its own, the file written afresh. ``generation``: the elastic job's
        membership generation (0: none), which qualifies the rounds."""
        self.path = path
        self.mark_cycles = mark_cycles
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._rank = rank
        self._key = (job, os.path.realpath(path)) if job is not None else None
        self._round_prefix = f"{generation}/" if generation else ""
        left = _left_as_it_was(self._key)
        flags = os.O_WRONLY | os.O_CREAT | (0 if left is not None else os.O_TRUNC)
        # Open while recording: None once closed, or once a write failed (see _give_up).
        self._fd: int | None = os.open(path, flags, 0o644)
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        if left is not None:  # (the file ends with the closing bracket this process wrote)
            self._end = left.file[2] - len(_CLOSE)
            self._first = False
            self._start = left.start
            self._rows = dict(left.rows)
            self._next_row = left.next_row
            self._open: dict[int, list[str]] = {row: [] for row in self._rows.values()}
            self._last = dict(left.last)
            return
        self._end = 0  # where the next events go: over the closing bracket
        try:
            self._write(b"[" + _CLOSE)
        except OSError as error:  # (a full disk: no empty file left, the file named)
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.fstat(self._fd).st_mode):
                    os.unlink(path)
            os.close(self._fd)
            raise OSError(error.errno, error.strerror, path) from None
        self._end = 1
        self._first = True
        self._start = time.monotonic()
        self._rows = {}
        self._next_row = 0
        self._open = {}
        self._last = {}  # per row: events never go back in time
        if rank is not None:
            args = {
                "rank": rank,
                "host": host,
                "monotonic_us": round(self._start * 1e6, 3),
                "unix_s": round(time.time(), 6),
            }
            if job:  # (which job wrote it: hvdrun merges its own job's files alone)
                args["job"] = job
            self._pending.append({"name": "hvdrun_rank", "ph": "M", "pid": 0, "args": args})
        self._row(".cycles")

    def _ts(self, when: float) -> float:
        return round((when - self._start) * 1e6, 3)

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            if len(self._rows) >= MAX_ROWS:
                self._forget_rows()
            row = self._next_row
            self._next_row += 1
            self._rows[name] = row
            self._open[row] = []
            label = "negotiation cycles" if name == ".cycles" else name
            self._pending.append(
                {"name": "process_name", "ph": "M", "pid": row, "args": {"name": label}}
            )
            self._pending.append(
                {"name": "process_sort_index", "ph": "M", "pid": row, "args": {"sort_index": row}}
            )
        return row

    def _forget_rows(self) -> None:
        """Forgets the older half of the rows with no phase open (see :data:`MAX_ROWS`)."""
        idle = [
            (self._last.get(row, 0.0), row, name)
            for name, row in self._rows.items()
            if row != 0 and not self._open[row]  # (row 0: the cycles')
        ]
        idle.sort()
        for _, row, name in idle[: len(self._rows) // 2]:
            del self._rows[name]
            del self._open[row]
            self._last.pop(row, None)

    def _event(self, phase: str, kind: str, when: float, row: int, **extra: Any) -> None:
        ts = max(self._ts(when), self._last.get(row, 0.0))
        self._last[row] = ts
        self._pending.append({"name": phase, "ph": kind, "ts": ts, "pid": row, "tid": 0, **extra})

    def begin(self, name: str, phase: str, when: float) -> None:
        with self._lock:
            if self._fd is None:
                return
            row = self._row(name)
            self._open[row].append(phase)
            self._event(phase, "B", when, row)

    def end(self, name: str, phase: str, when: float, **extra: Any) -> None:
        with self._lock:
            if self._fd is None:
                return
            row = self._rows.get(name)
            if row is None:
                return  # (nothing open on it)
            stack = self._open[row]
            if stack and stack[-1] == phase:
                stack.pop()
                self._event(phase, "E", when, row, **extra)

    def tick(self, name: str, label: str, when: float) -> None:
        """An instant mark on a row (a rank's announcement under NEGOTIATE_*)."""
        with self._lock:
            if self._fd is not None:
                self._event(label, "i", when, self._row(name), s="t")

    def negotiated(
        self, name: str, op: str, seen: dict[int, float], now: float, round_id: str = ""
    ) -> None:
        """An op became ready in round ``round_id``: a tick per rank's announcement under
        NEGOTIATE_<OP>, which ends, and the op's own phase begins, with QUEUE until its
        collective starts."""
        for rank, when in sorted(seen.items(), key=lambda item: item[1]):
            self.tick(name, str(rank), when)
        if round_id:
            round_id = self._round_prefix + round_id
        self.end(name, "NEGOTIATE_" + op, now, args={"round": round_id})
        self.begin(name, op, now)
        if op in _DATA_OPS:
            self.begin(name, "QUEUE", now)

    def cycle(self, when: float) -> None:
        if self.mark_cycles:
            with self._lock:
                if self._fd is not None:
                    self._event("CYCLE_START", "i", when, 0, s="p")

    def _write(self, data: bytes) -> None:
        """Writes ``data`` at :attr:`_end` (over the closing bracket), whole or raising."""
        assert self._fd is not None
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], self._end + done)

    def _flush_locked(self) -> None:
        if not self._pending or self._fd is None:
            return
        chunk = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self._pending)
        self._pending = []
        data = (b"\n" if self._first else b",\n") + chunk.encode() + _CLOSE
        try:
            self._write(data)
        except OSError as error:
            self._give_up(error)
            return
        self._first = False
        self._end += len(data) - len(_CLOSE)

    def _give_up(self, error: OSError) -> None:
        """A write failed: the file keeps the events written whole (a valid array, where
        the bracket still fits; cutting the rest frees room for it) and recording ends."""
        fd, self._fd = self._fd, None
        self._pending = []
        assert fd is not None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, self._end)
            os.pwrite(fd, _CLOSE, self._end)
        with contextlib.suppress(OSError):
            os.close(fd)
        who = f"rank {self._rank}" if self._rank is not None else "this rank"
        with contextlib.suppress(Exception):  # (stderr may be closed)
            sys.stderr.write(
                f"hvdrun: {who} stops writing its timeline {self.path}: "
                f"{error.strerror or error}; the job runs on without it\n"
            )

    def flush(self) -> None:
        """Writes the buffered events, keeping the file a complete JSON array."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Ends every open phase, writes everything and closes the file."""
        with self._lock:
            if self._fd is None:
                return
            now = time.monotonic()
            for row, stack in self._open.items():
                while stack:
                    self._event(stack.pop(), "E", now, row)
            self._flush_locked()
            fd, self._fd = self._fd, None
            if fd is not None:
                self._note_left(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _note_left(self, fd: int) -> None:
        """Notes how the job's timeline leaves its file, for the next opening of it in this
        process (see :func:`open_for_job`)."""
        if self._key is None:
            return
        try:
            file = _file_state(fd)
        except OSError:
            return
        left = _Left(file, self._start, dict(self._rows), self._next_row, dict(self._last))
        with _LEFT_LOCK:
            _LEFT[self._key] = left


class TimelineSlot:
    """Where the engine's timeline is, if one is being written: the reference is replaced
    whole by the thread that starts or stops recording (``hvd.start_timeline()``) and read
    by the engine once per cycle (reading or replacing a reference is atomic)."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: Timeline | None = None


def open_for_rank(
    path: str, mark_cycles: bool, rank: int, all_ranks: bool = False, host: str = ""
) -> Timeline | None:
    """The timeline this rank writes, if any, started afresh (``hvd.start_timeline()``): rank
    0 writes it, as in Horovod; a ``{rank}`` in the path, or ``all_ranks``, makes every rank
    write its own file (see ``worker_env.timeline_file``). OSError where every rank's own
    file would be made beside a device or a pipe (``/dev/null.1``)."""
    own = _own_file(path, rank, all_ranks)
    return Timeline(own, mark_cycles, rank, host) if own is not None else None


def open_for_job(
    path: str, mark_cycles: bool, rank: int, all_ranks: bool, host: str, generation: int
) -> Timeline | None:
    """The job's own timeline (``--timeline-filename``), which ``hvd.init()`` opens in the
    elastic membership generation ``generation`` (0: none): as :func:`open_for_rank`, but
    where this process wrote the file earlier in the job (``HVDRUN_JOB_ID``) it writes on
    (see the module docstring)."""
    own = _own_file(path, rank, all_ranks)
    if own is None:
        return None
    job = os.environ.get(worker_env.JOB_ID, "")
    return Timeline(own, mark_cycles, rank, host, job=job, generation=generation)


def _own_file(path: str, rank: int, all_ranks: bool) -> str | None:
    """This rank's timeline file, if any; OSError where it would be named after a device or
    a pipe (``/dev/null`` with every rank writing its own: ``/dev/null.1``, a regular file
    made in ``/dev``)."""
    own = worker_env.timeline_file(path, rank, all_ranks)
    if own is not None and own != path and worker_env.device_or_pipe(path):
        raise OSError(
            errno.EINVAL,
            "every rank's own timeline would be a new file named after this device or pipe",
            path,
        )
    return own
