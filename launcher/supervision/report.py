"""What hvdrun says after a failed job: who failed first, a table of every rank, the tail.

The table has one row per rank (rank, host, exit code, status, last stderr line). In big
jobs the ranks hvdrun merely stopped, or that finished cleanly, are counted in one line
instead, so that the ranks that matter stay on screen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Sequence

from launcher.output import OutputSink
from launcher.spec.job import is_python
from launcher.supervision.core import JobResult, rank_list

#: What a worker that hvdrun stopped exits with: SIGTERM, or SIGKILL after the grace period.
STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGKILL)
#: What horovodrun says when a worker failed (users match on it); hvdrun's details follow.
HOROVOD_FAILED = (
    "Horovod detected that one or more processes exited with non-zero status, thus causing "
    "the job to be terminated."
)
#: Its first words, where the rank that failed first exited 0 (never joining the job).
HOROVOD_FAILED_AT_ZERO = (
    "Horovod detected that one or more processes exited (with status 0) while the others "
    "still needed them, thus causing the job to be terminated."
)
#: Up to this many ranks the table lists every rank.
FULL_TABLE_RANKS = 32
LAST_LINE_WIDTH = 60


def exit_signal(code: int) -> signal.Signals | None:
    """The signal that ended a process which exited with ``code`` (128+N), if any."""
    if code > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(code - 128)
    return None


def describe_exit(code: int) -> str:
    killed = exit_signal(code)
    return f"killed by {killed.name} (exit code {code})" if killed else f"exit code {code}"


def rank_status(result: JobResult, rank: int) -> str:
    failure = result.failure
    if failure is not None and failure.rank == rank:
        # (a stopped rank's own exit code is hvdrun's stop of it: say what stopped it)
        if failure.stop is not None:
            return f"FAILED FIRST ({failure.stop.by()})"
        return "FAILED FIRST (stalled)" if failure.stalled else "FAILED FIRST"
    if rank in result.lost:
        return "lost"
    if rank not in result.exits:
        return "not reported"
    code = result.exits[rank]
    if code == 0:
        return "ok"
    if rank in result.stopped and code in STOP_CODES:
        return "stopped"
    return "failed"


def _short(text: str, width: int = LAST_LINE_WIDTH) -> str:
    text = text.strip()
    return text if len(text) <= width else text[: width - 3] + "..."


def summary_table(result: JobResult, sink: OutputSink, hosts: dict[int, str]) -> list[str]:
    rows = [("RANK", "HOST", "EXIT", "STATUS", "LAST STDERR LINE")]
    hidden: dict[str, int] = {}
    for rank in sorted(hosts):
        status = rank_status(result, rank)
        if len(hosts) > FULL_TABLE_RANKS and status in ("stopped", "ok"):
            hidden[status] = hidden.get(status, 0) + 1
            continue
        code = result.exits.get(rank)
        tail = sink.stderr_tail(rank)
        # (the last line that says something: TensorFlow ends a traceback with a blank one)
        last = next((line for line in reversed(tail) if line.strip()), result.lost.get(rank, ""))
        failure = result.failure
        if not tail and failure is not None and failure.stop is not None and failure.rank == rank:
            last = "(stopped, never continued)" if failure.stop.until is None else "(stopped)"
        rows.append((str(rank), hosts[rank], "-" if code is None else str(code), status, last))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
        + "  "
        + _short(row[4])
        for row in rows
    ]
    lines = [line.rstrip() for line in lines]
    for status, count in hidden.items():
        lines.append(f"... and {count} more rank(s) {status}")
    return lines


def python_hint(tail: Sequence[str], command: Sequence[str]) -> str | None:
    """Where a worker failed for a missing module and the command's ``python`` is another
    than the one hvdrun runs on (a virtualenv not activated): which to use."""
    if not command or not any("No module named" in line for line in tail):
        return None
    program = command[0]
    if not is_python(program):
        return None
    found = shutil.which(program)
    # (the same bin directory: the same virtualenv, python3 beside python)
    if found is None or os.path.dirname(os.path.abspath(found)) == os.path.dirname(
        os.path.abspath(sys.executable)
    ):
        return None
    return (
        f"hint: the workers ran {found} (the command's {program}), not the Python hvdrun runs "
        f"on ({sys.executable}), whose packages they may need: give {sys.executable}, or "
        "activate its virtualenv"
    )


def _exited_before(result: JobResult, rank: int) -> list[int]:
    """The ranks that exited 0 before ``rank`` did (``exits`` holds them in the order they
    were reported)."""
    early: list[int] = []
    for other, code in result.exits.items():
        if other == rank:
            return sorted(early)
        if code == 0 and other not in result.stopped:
            early.append(other)
    return []


def report_failure(
    result: JobResult, sink: OutputSink, command: Sequence[str] = (), elastic: bool = False
) -> None:
    """Who failed first, with what; who exited 0 before it (fixed jobs: in elastic ones,
    workers of removed hosts end so); the ranks' table; the stderr of the rank that failed."""
    failure = result.failure
    if failure is None:
        return
    what = describe_exit(failure.code)
    exited_zero = result.exits.get(failure.rank) == 0  # (a rank that never joined the job)
    if failure.error and (exited_zero or failure.code in STOP_CODES):
        what = failure.error  # (a rank that never joined; one its host's agent stopped)
    if failure.rank in result.lost:
        # (a lost rank has no exit code of its own: the table shows "-")
        what = f"{result.lost[failure.rank]} (hvdrun exits with code {failure.code})"
    if failure.peer is not None and failure.error:  # (stopped or stalled: why, not its exit)
        what = failure.error
    # Horovod's sentence first: scripts and CI logs match on it.
    sink.message(HOROVOD_FAILED_AT_ZERO if exited_zero else HOROVOD_FAILED)
    sink.message(f"rank {failure.rank} on host {failure.hostname} failed first: {what}")
    if result.own_stall:  # (its workers give the job up when it is silent that long)
        sink.message(
            f"hvdrun itself was stopped or starved of CPU for {result.own_stall:.1f} s while "
            "the job ran (Ctrl-Z stops hvdrun, not the job): workers that hear nothing from "
            "it for --heartbeat-timeout give the job up, saying they lost its rendezvous"
        )
    early = [] if elastic else _exited_before(result, failure.rank)
    if failure.ended_by is not None and failure.ended_by not in early:
        early = sorted([*early, failure.ended_by])  # (it left first, and exited after)
    if early:  # (a peer that left unannounced fails the others' next collective: os._exit)
        sink.message(f"before it, rank(s) {rank_list(early)} had exited with code 0")
    others = sorted(r for r, c in result.exits.items() if c != 0 and r != failure.rank)
    if others:
        sink.message(f"stopped or failed afterwards: rank(s) {rank_list(others)}")
    if result.hosts:
        sink.message("summary:")
        for line in summary_table(result, sink, result.hosts):
            sink.message(f"  {line}")
    tail = sink.stderr_tail(failure.rank)
    if tail:
        sink.message(f"last lines of rank {failure.rank}'s stderr:")
        for line in tail:
            sink.message(f"    {line}")
    if failure.peer is not None:  # (the rank that exited first, while failure's was stopped)
        peer_tail = sink.stderr_tail(failure.peer.rank)
        if peer_tail:
            sink.message(f"last lines of rank {failure.peer.rank}'s stderr (it exited first):")
            for line in peer_tail:
                sink.message(f"    {line}")
        tail = tail or peer_tail
    hint = python_hint(tail, command)
    if hint:
        sink.message(hint)
