"""Merging the timelines of all ranks into one trace: ``hvdrun --merge-timelines OUT FILE...``.

With ``--timeline-all-ranks`` (or a ``{rank}`` in ``--timeline-filename``) every rank writes
its own Chrome trace, on its own clock. The merged trace has one process per rank (named
``rank N (host)``) and one thread per op within it, so chrome://tracing or Perfetto shows
the ranks one above the other, and who was late for what.

Aligning the clocks: a rank's file records its times from its own start. Ranks on one host
share the host's monotonic clock, which each file records (its ``hvdrun_rank`` event), so
they align exactly. Across hosts the ranks' clocks are compared on the rounds that they left
together: every op's NEGOTIATE phase ends when the round that made it ready ends, at nearly
the same moment on every rank (within the round's own latency), and names that round. A line
fitted through those ends (the offset and the drift of one host's clock against the
reference rank's, outliers dropped) maps the host's times onto the reference's.

Each NEGOTIATE phase of the merged trace then says which rank submitted the op last
(``args.last_rank``) and how long this rank waited for it (``args.waited_ms``): from its own
submission to the last rank's, on the aligned clocks (at most the phase itself; 0 on the
last rank). The rest of the phase is the round's own time, which every rank spends.

A file that a process wrote on after opening it again in the job (see
:mod:`collectives.engine.timeline`) may name a round twice: an elastic job's generations
qualify their rounds (``2/0:17``), a script's ``hvd.init()`` after ``hvd.shutdown()`` does
not. The occurrences of a round on a row count in order: the n-th in every rank's file are
one op occurrence.

This module reads and writes JSON only: the CLI imports it without torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rendezvous import worker_env

__all__ = [
    "Origin",
    "TimelineError",
    "merge",
    "merge_files",
    "merged_path",
    "rank_files",
    "start_time",
]

#: Keys of an op occurrence: (op row name, round, how many times the row had that round
#: before in the file: 0 but in a file written on after an ``hvd.init()`` again).
Key = tuple[str, str, int]


class TimelineError(Exception):
    """A timeline that cannot be read or merged (the message says which and why)."""


@dataclass
class _Rank:
    path: str
    rank: int
    host: str
    origin_us: float | None  # the host's monotonic clock at the file's time 0
    first_ts: float | None = None  # its earliest event's time (its own clock)
    rows: dict[int, str] = field(default_factory=dict)  # file pid -> op name
    ends: dict[Key, float] = field(default_factory=dict)  # NEGOTIATE end, by round
    begins: dict[Key, float] = field(default_factory=dict)  # its NEGOTIATE begin
    keys: dict[int, Key] = field(default_factory=dict)  # NEGOTIATE end's index in events -> key
    # Its times on the reference rank's clock: (ts + local - offset) / (1 + slope), with
    # ``local`` onto its host's first rank's clock, then that clock's fit onto the reference.
    local: float = 0.0
    offset: float = 0.0
    slope: float = 0.0

    def time(self, ts: float) -> float:
        return (ts + self.local - self.offset) / (1.0 + self.slope)


def rank_files(path: str, size: int) -> list[str]:
    """The files ranks 0..size-1 write for ``--timeline-filename path`` with every rank
    writing its own."""
    files = [worker_env.timeline_file(path, rank, all_ranks=True) for rank in range(size)]
    return [name for name in files if name is not None]


def merged_path(path: str) -> str:
    """Where hvdrun writes the merged trace of ``--timeline-filename path``: the path itself,
    or with ``{rank}`` as ``all``."""
    return path.replace("{rank}", "all")


#: How much of a timeline is read at a time: a long job's files need not fit in memory as
#: Python objects (each event takes ten times its bytes there), so they are read twice, as
#: streams: once to index their rounds, once to write the merged trace.
_CHUNK_BYTES = 1 << 20


class _Reader:
    """A file's text, read a chunk at a time as its JSON values are taken."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.text = ""
        self.at = 0

    def more(self) -> bool:
        """Reads the next chunk (False at the end of the file)."""
        chunk = self.source.read(_CHUNK_BYTES)
        self.text, self.at = self.text[self.at :] + chunk, 0
        return bool(chunk)

    def next_char(self) -> str:
        """The next character that is not white space, left unread; "" at the end."""
        while True:
            while self.at < len(self.text) and self.text[self.at].isspace():
                self.at += 1
            if self.at < len(self.text):
                return self.text[self.at]
            if not self.more():
                return ""

    def value(self, decoder: json.JSONDecoder) -> Any:
        """The JSON value that starts here (ValueError where none does)."""
        while True:
            try:
                value, self.at = decoder.raw_decode(self.text, self.at)
                return value
            except ValueError:
                if not self.more():  # (the whole rest of the file: a real error)
                    raise


def _events(path: str) -> Iterator[dict[str, Any]]:
    """The trace events of the timeline in ``path`` (a JSON array of objects), one at a time.
    Raises :class:`TimelineError` for a file that cannot be read or is not such an array."""
    decoder = json.JSONDecoder()
    try:
        with open(path, encoding="utf-8") as source:
            reader = _Reader(source)
            if reader.next_char() != "[":
                raise ValueError("it does not start with '['")
            reader.at += 1
            char = reader.next_char()
            while char != "]":
                if not char:
                    raise ValueError("the array is not closed")
                event = reader.value(decoder)
                if not isinstance(event, dict):
                    raise TimelineError(
                        f"{path} is not a timeline: not a JSON array of trace events"
                    )
                yield event
                char = reader.next_char()
                if char == ",":
                    reader.at += 1
                    char = reader.next_char()
                elif char and char != "]":
                    raise ValueError(f"expected ',' or ']' at {char!r}")
    except OSError as error:
        raise TimelineError(f"cannot read {path}: {error.strerror or error}") from None
    except ValueError as error:
        raise TimelineError(f"{path} is not a timeline (JSON): {error}") from None


def _load(path: str, index: int) -> _Rank:
    """A rank's file, indexed (see :func:`_index`) without keeping its events."""
    number = re.findall(r"\d+", os.path.basename(path))
    found = _Rank(path, int(number[-1]) if number else index, "", None)
    named = False
    note = _indexer(found)
    for position, event in enumerate(_events(path)):
        if not named and event.get("name") == "hvdrun_rank" and event.get("ph") == "M":
            named = True
            args = event.get("args", {})
            found.rank = int(args.get("rank", found.rank))
            found.host = str(args.get("host", ""))
            origin = args.get("monotonic_us")
            found.origin_us = float(origin) if origin is not None else None
        if "ts" in event:
            ts = float(event["ts"])
            found.first_ts = ts if found.first_ts is None else min(found.first_ts, ts)
        note(position, event)
    return found


#: What :func:`start_time` reads of a file: its ``hvdrun_rank`` event, with room for a long host.
_HEAD_BYTES = 4096


class Origin(NamedTuple):
    """Where a timeline file came from, as its first event says."""

    started: float  # by the wall clock (its unix_s, else the file's last modification)
    job: str | None  # the id of the job whose own timeline it is; None: it does not say


def start_time(path: str) -> float | None:
    """When the timeline in ``path`` began, by the wall clock (``time.time()``); None when
    the file cannot be read."""
    found = origin(path)
    return found.started if found is not None else None


def origin(path: str) -> Origin | None:
    """The :class:`Origin` of the timeline in ``path``, from its ``hvdrun_rank`` event (the
    first event of a file a rank writes); None when the file cannot be read."""
    try:
        with open(path, "rb") as source:
            head = source.read(_HEAD_BYTES).decode("utf-8", errors="replace")
            modified = os.fstat(source.fileno()).st_mtime
    except OSError:
        return None
    first: Any = None
    start = head.find("{")
    if start >= 0:
        with contextlib.suppress(ValueError):
            first, _ = json.JSONDecoder().raw_decode(head, start)
    args = (
        first.get("args")
        if isinstance(first, dict) and first.get("name") == "hvdrun_rank"
        else None
    )
    args = args if isinstance(args, dict) else {}
    unix, job = args.get("unix_s"), args.get("job")
    return Origin(
        float(unix) if isinstance(unix, (int, float)) else modified,
        job if isinstance(job, str) and job else None,
    )


def _indexer(rank: _Rank) -> Callable[[int, dict[str, Any]], None]:
    """What notes, event by event (with its position in the file), the rows' names and each
    op occurrence's NEGOTIATE begin and end (by round) into ``rank``."""
    open_negotiations: dict[int, list[float]] = defaultdict(list)
    seen: dict[tuple[str, str], int] = defaultdict(int)  # how often a row had a round

    def note(index: int, event: dict[str, Any]) -> None:
        pid = event.get("pid", 0)
        phase = event.get("ph")
        name = str(event.get("name", ""))
        if phase == "M" and name == "process_name":
            rank.rows[pid] = str(event.get("args", {}).get("name", pid))
            return
        if not name.startswith("NEGOTIATE_") or "ts" not in event:
            return
        if phase == "B":
            open_negotiations[pid].append(float(event["ts"]))
        elif phase == "E" and open_negotiations[pid]:
            began = open_negotiations[pid].pop()
            round_id = event.get("args", {}).get("round")
            if round_id:
                row_round = (rank.rows.get(pid, str(pid)), str(round_id))
                key = (*row_round, seen[row_round])
                seen[row_round] += 1
                rank.ends[key] = float(event["ts"])
                rank.begins[key] = began
                rank.keys[index] = key

    return note


def _fit(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(offset, slope) of ``mine - reference`` against ``reference``, fitted by least squares
    after dropping outliers (a round one rank left late: it was busy, not the clock)."""
    diffs = [mine - ref for ref, mine in pairs]
    middle = statistics.median(diffs)
    spread = statistics.median([abs(d - middle) for d in diffs]) or 1.0
    kept = [(ref, mine - ref) for ref, mine in pairs if abs(mine - ref - middle) <= 5 * spread]
    if len(kept) < 3:
        return middle, 0.0
    mean_x = statistics.fmean(x for x, _ in kept)
    mean_y = statistics.fmean(y for _, y in kept)
    var = sum((x - mean_x) ** 2 for x, _ in kept)
    if var <= 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in kept) / var
    return mean_y - slope * mean_x, slope


def _align(ranks: list[_Rank]) -> list[str]:
    """Puts every rank on the first rank's clock (see the module docstring); returns notes
    for the user."""
    notes = []
    reference = ranks[0]
    clocks: dict[str, list[_Rank]] = defaultdict(list)  # the ranks that share a clock
    for rank in ranks:
        shared = rank.host and rank.origin_us is not None
        clocks[rank.host if shared else f"?{rank.rank}"].append(rank)
    for members in clocks.values():
        head = members[0]
        for other in members[1:]:
            assert other.origin_us is not None and head.origin_us is not None
            other.local = other.origin_us - head.origin_us
        if reference in members:
            offset, slope = -reference.local, 0.0
        else:
            common = [key for key in head.ends if key in reference.ends]
            if not common:
                notes.append(
                    f"rank {head.rank} ({head.path}) shares no round with rank "
                    f"{reference.rank}: its clock is left as it is"
                )
                offset, slope = 0.0, 0.0
            else:
                pairs = [(reference.time(reference.ends[key]), head.ends[key]) for key in common]
                offset, slope = _fit(pairs)
        for member in members:
            member.offset, member.slope = offset, slope
    return notes


def merge(ranks: list[_Rank]) -> tuple[Iterator[dict[str, Any]], list[str]]:
    """The merged trace's events (read from the ranks' files again as they are taken), and
    notes for the user."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    notes = _align(ranks)
    lasts = _last_submitters(ranks)
    # (a rank's clock maps onto the reference's by an increasing line: its first event
    # stays its first)
    starts = [r.time(r.first_ts) for r in ranks if r.first_ts is not None]
    start = min(starts, default=0.0)
    return (event for rank in ranks for event in _merged_events(rank, lasts, start)), notes


def _merged_events(
    rank: _Rank, lasts: dict[Key, tuple[int, float]], start: float
) -> Iterator[dict[str, Any]]:
    """One rank's events in the merged trace: on the reference clock, from ``start``, as a
    process of its own whose threads are its op rows."""
    label = f"rank {rank.rank}" + (f" ({rank.host})" if rank.host else "")
    yield {"name": "process_name", "ph": "M", "pid": rank.rank, "args": {"name": label}}
    yield {"name": "process_sort_index", "ph": "M", "pid": rank.rank,
           "args": {"sort_index": rank.rank}}  # fmt: skip
    for index, event in enumerate(_events(rank.path)):
        pid = event.get("pid", 0)
        if event.get("ph") == "M":
            if event.get("name") == "process_name":
                yield {"name": "thread_name", "ph": "M", "pid": rank.rank, "tid": pid,
                       "args": event.get("args", {})}  # fmt: skip
                yield {"name": "thread_sort_index", "ph": "M", "pid": rank.rank, "tid": pid,
                       "args": {"sort_index": pid}}  # fmt: skip
            continue
        out = {**event, "pid": rank.rank, "tid": pid}
        if "ts" in out:
            out["ts"] = round(rank.time(float(out["ts"])) - start, 3)
        key = rank.keys.get(index)  # (a NEGOTIATE end with its round)
        if key is not None and key in lasts:
            last_rank, last_began = lasts[key]
            began = rank.time(rank.begins[key])
            waited = min(max(last_began - began, 0.0), rank.time(rank.ends[key]) - began)
            out["args"] = {
                **out.get("args", {}),
                "last_rank": last_rank,
                "waited_ms": round(waited / 1000.0, 3),
            }
        yield out


def _last_submitters(ranks: Sequence[_Rank]) -> dict[Key, tuple[int, float]]:
    """For every op occurrence that several ranks recorded: the rank that submitted it last,
    and when (on the aligned clocks)."""
    begins: dict[Key, list[tuple[float, int]]] = defaultdict(list)
    for rank in ranks:
        for key, began in rank.begins.items():
            begins[key].append((rank.time(began), rank.rank))
    lasts = {}
    for key, found in begins.items():
        if len(found) > 1:
            when, last = max(found)
            lasts[key] = (last, when)
    return lasts


def _write_whole(output: str, parts: Iterable[str]) -> None:
    """Writes ``output`` whole or not at all: a regular file (or a new one) is written beside
    it and replaces it; anything else (a pipe, ``/dev/stdout``) is written as it is."""
    target = os.path.realpath(output)
    if os.path.exists(target) and not os.path.isfile(target):
        with open(output, "w", encoding="utf-8") as out:
            out.writelines(parts)
        return
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as out:
            out.writelines(parts)
        os.replace(partial, target)
    except BaseException:  # (a file that cannot be read midway too: no partial file left)
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _trace_text(events: Iterable[dict[str, Any]]) -> Iterator[str]:
    """A JSON array of ``events``, one per line."""
    yield "["
    separator = "\n"
    for event in events:
        yield separator + json.dumps(event, separators=(",", ":"))
        separator = ",\n"
    yield "\n]\n"


def merge_files(output: str, inputs: Iterable[str]) -> list[str]:
    """Merges the timeline files ``inputs`` into ``output``; returns notes for the user.
    Raises :class:`TimelineError` naming a file that cannot be read or written. ``output``
    appears whole or not at all (a file written beside it replaces it)."""
    paths = list(inputs)
    if not paths:
        raise TimelineError("no timeline files to merge")
    if os.path.exists(output) and any(
        os.path.exists(path) and os.path.samefile(output, path) for path in paths
    ):
        raise TimelineError(
            f"the output {output} is one of the timelines to merge: name a new file"
        )
    try:
        ranks = [_load(path, index) for index, path in enumerate(paths)]
        seen: dict[int, str] = {}
        for rank in ranks:
            if rank.rank in seen:
                raise TimelineError(
                    f"{seen[rank.rank]} and {rank.path} are both rank {rank.rank}'s"
                )
            seen[rank.rank] = rank.path
        events, notes = merge(ranks)
        _write_whole(output, _trace_text(events))
    except OSError as error:
        raise TimelineError(f"cannot write {output}: {error.strerror or error}") from None
    except MemoryError:  # (the index of every op occurrence: see _CHUNK_BYTES)
        raise TimelineError(
            f"not enough memory to merge {len(paths)} timelines into {output}: merge fewer "
            "at a time, or on a machine with more (hvdrun --merge-timelines OUTPUT FILE...)"
        ) from None
    return notes
