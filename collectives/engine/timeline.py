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
file starts with an ``hvdrun_rank`` metadata event (the rank, its host and the monotonic
clock's reading at the file's time 0), and each NEGOTIATE phase ends with the round that made
the op ready (``args.round``: process set and cycle, alike on every rank): the rounds every
rank left together align the ranks' clocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

from rendezvous.worker_env import timeline_file

__all__ = ["Timeline", "TimelineSlot", "open_for_rank"]

_CLOSE = b"\n]\n"
#: Rows (op names) a timeline keeps in memory. Beyond it, the older half of the rows with no
#: phase open (by their latest event) is forgotten, and a forgotten name seen again gets a new
#: row: names made per step (``loss.{step}``) and unnamed ops (``allreduce.noname.N``) each
#: take a row, which otherwise held about 270 bytes per op for as long as the job ran.
MAX_ROWS = 4096
_DATA_OPS = {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"}


class Timeline:
    """An open timeline file.

    Every row keeps a stack of its open phases: ``end`` closes only the phase on top, and
    ``close`` ends whatever is still open, so the file has balanced begin/end events per row
    even when recording starts or stops while ops are in flight. Thread-safe (the engine
    records, any thread may stop the recording).
    """

    def __init__(
        self, path: str, mark_cycles: bool = False, rank: int | None = None, host: str = ""
    ) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._rank = rank
        # Open while recording: None once closed, or once a write failed (see _give_up).
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._end = 0  # where the next events go: over the closing bracket
        try:
            self._write(b"[" + _CLOSE)
        except OSError:
            os.close(self._fd)
            raise
        self._end = 1
        self._first = True
        self._start = time.monotonic()
        self._rows: dict[str, int] = {}
        self._next_row = 0
        self._open: dict[int, list[str]] = {}
        self._last: dict[int, float] = {}  # per row: events never go back in time
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        if rank is not None:
            origin = round(self._start * 1e6, 3)
            args = {"rank": rank, "host": host, "monotonic_us": origin}
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
                with contextlib.suppress(OSError):
                    os.close(fd)


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
    """The timeline this rank writes, if any: rank 0 writes it, as in Horovod; a ``{rank}``
    in the path, or ``all_ranks``, makes every rank write its own file (see
    ``worker_env.timeline_file``)."""
    own = timeline_file(path, rank, all_ranks)
    return Timeline(own, mark_cycles, rank, host) if own is not None else None
