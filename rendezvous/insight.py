"""Job insight: which rank holds the job back, from the figures every worker publishes.

Each worker's engine accounts for its rounds (``collectives/engine/insight.py``): how long
it waited in them for the rank that arrived last, how often it was that last rank, what its
lateness cost the others, and its time in collectives. The worker publishes those figures
(:class:`RankFigures`, JSON) in the job's rendezvous store every few seconds and at shutdown
(``worker_env.INSIGHT_KEY_PREFIX``); hvdrun reads them for its status line, its warning and
its end-of-job table, and ``hvd.report()`` reads them for jobs of other launchers. Both
sides share this module, which imports neither torch nor gRPC:

* :func:`analyse` turns every rank's figures into a :class:`JobReport`: a short table, the
  straggler named in one sentence when one rank stands out (:func:`stands_out`), and the
  full figures as a JSON document;
* :class:`LiveWatch` looks at the figures as they come and says when one rank made the
  others wait for longer than a threshold within a window.

Every figure is a duration on one rank's own clock; none compares clocks across hosts.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import shutil
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FULL_TABLE_RANKS",
    "JobReport",
    "LiveWatch",
    "RankFigures",
    "analyse",
    "decode_all",
    "stands_out",
]

#: Up to this many ranks the table lists every rank; beyond, the ranks that caused most.
FULL_TABLE_RANKS = 32
#: Ops listed in a rank's figures and in the report (those waited at most).
TOP_OPS = 16
#: A rank stands out when it caused at least this share of all the waiting...
STANDOUT_SHARE = 0.5
#: ... at least this many times as much as any other rank...
STANDOUT_RATIO = 3.0
#: ... and the others waited for it, on average, at least this long and this share of
#: their time (end of job; a loaded machine makes balanced ranks wait for each other for a
#: few percent of their time, one of them more by chance). All three leave out each rank's
#: longest late arrival (one wait, however many rounds it took): one late start (loading
#: data, a first compilation) does not make a straggler. The live watch leaves out the
#: longest late arrival in its window alike.
STANDOUT_SECONDS = 0.1
STANDOUT_FRACTION = 0.1
#: Live: the window looked at, and how long the others must have waited for one rank in it
#: on average.
LIVE_WINDOW_SECONDS = 10.0
LIVE_WAIT_SECONDS = 1.0
#: Live: the shortest stretch of figures that is judged.
LIVE_MIN_SPAN = 2.0
#: Live: the same rank is warned about again after this long at the earliest.
LIVE_REPEAT_SECONDS = 300.0
#: Live: the rank was last in at least this many of the window's collectives that waited,
#: and at least half of them (one late start is not a straggler: it counts once).
LIVE_MIN_LAST = 3


#: Said of a rank named as holding the job back that writes a timeline where the others do
#: not: the timeline's cost may be all its lateness.
TIMELINE_CAVEAT = (
    "It writes a timeline and the others do not, which slows its collectives (the engine's "
    "fast paths stay off while a timeline is open): run with --timeline-all-ranks, or "
    "without the timeline, to tell the two apart."
)


@dataclass
class RankFigures:
    """One worker's figures, as it publishes them (every duration in seconds)."""

    rank: int
    host: str = ""
    size: int = 0
    generation: int = 0
    elapsed_s: float = 0.0  # since its engine started
    in_collectives_s: float = 0.0  # in the engine's rounds and collectives
    waited_s: float = 0.0  # waiting for the rank that arrived last
    wait_caused_s: float = 0.0  # what the others waited while it was the last
    largest_wait_caused_s: float = 0.0  # the most in one late arrival (however many rounds)
    times_last: int = 0  # its late arrivals that held the job back
    held_rounds: int = 0  # late arrivals that held the job back (alike on every rank)
    rounds: int = 0
    flushes: int = 0  # comparisons so far (alike on every rank of a generation)
    final: bool = False  # published at shutdown
    timeline: bool = False  # it wrote a timeline (which slows its collectives) at some point
    #: op: {"waited_s": s, "for": {rank: s}} (the ops it waited at most)
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def between_s(self) -> float:
        return max(0.0, self.elapsed_s - self.in_collectives_s)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> RankFigures:
        raw = json.loads(data)
        known = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
        return cls(**known)


def decode_all(values: Mapping[str, bytes]) -> dict[str, RankFigures]:
    """The figures under each key (a store's values under the insight prefix); values that
    do not parse are left out."""
    found = {}
    for key, value in values.items():
        try:
            found[key] = RankFigures.from_json(value)
        except (ValueError, TypeError):
            continue
    return found


def top_ops(ops: Mapping[str, tuple[float, Mapping[int, float]]]) -> dict[str, dict[str, Any]]:
    """The ops waited at most, as :attr:`RankFigures.ops` holds them."""
    chosen = sorted(ops.items(), key=lambda item: -item[1][0])[:TOP_OPS]
    return {
        label: {"waited_s": seconds, "for": {str(rank): value for rank, value in whom.items()}}
        for label, (seconds, whom) in chosen
    }


def stands_out(caused: Mapping[int, float]) -> int | None:
    """The rank that caused most of the waiting, if it caused enough more than every other
    (the share and the ratio above); the size of the waits is the caller's to judge."""
    if not caused:
        return None
    ranked = sorted(caused.items(), key=lambda item: -item[1])
    rank, top = ranked[0]
    total = sum(caused.values())
    second = ranked[1][1] if len(ranked) > 1 else 0.0
    if top <= 0 or top < STANDOUT_SHARE * total or top < STANDOUT_RATIO * second:
        return None
    return rank


def seconds(value: float) -> str:
    """A duration for a person: ``850 ms``, ``2.31 s``, ``41.7 s``, ``1234 s``."""
    if value < 1.0:
        return f"{value * 1000:.0f} ms"
    if value < 10.0:
        return f"{value:.2f} s"
    if value < 100.0:
        return f"{value:.1f} s"
    return f"{value:.0f} s"


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "-"


@dataclass
class Straggler:
    """The rank that held the job back, and by how much."""

    rank: int
    host: str
    wait_caused_s: float  # what all the others waited for it, in all
    share: float  # of all the job's waiting
    times_last: int
    held_rounds: int
    per_time_s: float  # the others' wait per round it was last in
    others_fraction: float  # of the others' run time, on average
    op: str | None  # the op the others waited for it at most
    timeline: bool = False  # it wrote a timeline and the others did not

    def sentence(self) -> str:
        where = f"rank {self.rank}" + (f" on {self.host}" if self.host else "")
        last = (
            f"it arrived last at {self.times_last} of the {self.held_rounds} collectives that "
            f"waited ({_percent(self.times_last, self.held_rounds)})"
            if self.held_rounds
            else "it arrived last"
        )
        text = (
            f"{where} held the job back: {last}, and the others waited "
            f"{seconds(self.wait_caused_s)} for it ({seconds(self.per_time_s)} each time, "
            f"{self.others_fraction * 100:.0f}% of their time)"
        )
        if self.op:
            text += f", mostly at {self.op}"
        return text + "." + (f" {TIMELINE_CAVEAT}" if self.timeline else "")


@dataclass
class JobReport:
    """Every rank's figures and what they say (see :func:`analyse`)."""

    ranks: list[RankFigures]
    size: int
    missing: list[int]
    total_wait_s: float
    held_rounds: int
    straggler: Straggler | None
    ops: list[dict[str, Any]]

    @property
    def summary(self) -> str:
        if self.straggler is not None:
            return self.straggler.sentence()
        if not self.ranks:
            return "no rank reported its figures."
        return (
            f"no rank stood out: the ranks waited {seconds(self.total_wait_s)} for each other "
            "in all."
        )

    def table(self, at_end: bool = False) -> list[str]:
        """The short table and the sentence, one line each (hvdrun prefixes them).
        ``at_end``: the job has ended, and a rank whose figures are not its last (it was
        stopped or killed before it published them) is marked."""
        if not self.ranks:
            return []
        generations = len({f.generation for f in self.ranks}) > 1
        rows = [("RANK", *(("GEN",) if generations else ()), "HOST", "IN COLLECTIVES", "BETWEEN",
                 "WAITED FOR OTHERS", "LAST", "WAIT CAUSED")]  # fmt: skip
        shown = sorted(self.ranks, key=_by_rank)
        hidden = 0
        if len(shown) > FULL_TABLE_RANKS:
            keep = sorted(shown, key=lambda f: -f.wait_caused_s)[: FULL_TABLE_RANKS // 2]
            hidden = len(shown) - len(keep)
            shown = sorted(keep, key=_by_rank)
        stale = at_end and any(not f.final for f in shown)  # (marked *)
        for f in shown:
            rows.append(
                (
                    f"{f.rank}{'*' if at_end and not f.final else ''}",
                    *((str(f.generation),) if generations else ()),
                    f.host or "-",
                    f"{seconds(f.in_collectives_s)} ({_percent(f.in_collectives_s, f.elapsed_s)})",
                    seconds(f.between_s),
                    f"{seconds(f.waited_s)} ({_percent(f.waited_s, f.elapsed_s)})",
                    f"{f.times_last} ({_percent(f.times_last, self.held_rounds)})"
                    if self.held_rounds
                    else str(f.times_last),
                    seconds(f.wait_caused_s),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
        if hidden:
            lines.append(f"... and {hidden} more rank(s) that caused less waiting")
        if stale:
            lines.append(
                "* its figures as of its last comparison with the others (about once a "
                "second): it was stopped or killed before it published its last ones"
            )
        if self.missing:
            which = " of the last generation" if generations else ""
            lines.append(f"no figures from rank(s) {', '.join(map(str, self.missing))}{which}")
        if generations:
            lines.append(
                "(elastic: a row per worker, under its rank in the last generation it was in "
                "(GEN); its figures cover all its generations)"
            )
        return [
            f"time in collectives of {self.size} rank(s) (each rank's own clock; LAST: "
            f"collectives that waited at least 1 ms, {self.held_rounds} in all):",
            *[f"  {line}" for line in lines],
            self.summary,
        ]

    def document(self) -> dict[str, Any]:
        """The full figures, as ``--report-file`` and ``hvd.report(file=...)`` write them."""
        straggler = None
        if self.straggler is not None:
            straggler = {**asdict(self.straggler), "sentence": self.straggler.sentence()}
        return {
            "version": 1,
            "size": self.size,
            "summary": self.summary,
            "straggler": straggler,
            "total_wait_s": self.total_wait_s,
            "held_rounds": self.held_rounds,
            "missing_ranks": self.missing,
            "ranks": [
                {**asdict(f), "between_s": f.between_s} for f in sorted(self.ranks, key=_by_rank)
            ],
            "ops": self.ops,
        }

    def write(self, path: str) -> None:
        """Writes the report as JSON to ``path``: a regular file (or a new one) whole or not at
        all, through a file beside it renamed over it, so that a full disk leaves an earlier
        report as it was rather than empty; anything else (``/dev/stdout``) directly."""
        text = json.dumps(self.document(), indent=1) + "\n"
        path = os.path.realpath(path)  # (a link's target is the report, not the link)
        if os.path.exists(path) and not os.path.isfile(path):
            with open(path, "w", encoding="utf-8") as out:
                out.write(text)
            return
        partial = f"{path}.{os.getpid()}.partial"
        try:
            out = open(partial, "w", encoding="utf-8")  # noqa: SIM115
        except OSError:  # (a directory this user cannot write in: the file written in place)
            with open(path, "w", encoding="utf-8") as direct:
                direct.write(text)
            return
        done = False
        try:
            with out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            if os.path.exists(path):
                shutil.copymode(path, partial)  # (the earlier report's permissions kept)
            os.replace(partial, path)
            done = True
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(partial)

    def __str__(self) -> str:
        return "\n".join(self.table()) if self.ranks else self.summary


def _by_rank(figures: RankFigures) -> int:
    return figures.rank


def analyse(figures: Iterable[RankFigures], size: int | None = None) -> JobReport:
    """What every rank's figures say. Where several workers reported the same rank (the
    generations of an elastic job) each counts as a row of its own, and a rank is missing
    when no worker of the last generation reported it (``size``, else that generation's
    size)."""
    ranks = sorted(figures, key=_by_rank)
    newest = max((f.generation for f in ranks), default=0)
    current = [f for f in ranks if f.generation == newest]
    if size is None:
        size = max([f.size for f in current] + [f.rank + 1 for f in current], default=0)
    reported = {f.rank for f in current}
    missing = [rank for rank in range(size) if rank not in reported]
    total = sum(f.waited_s for f in ranks)
    held = max((f.held_rounds for f in ranks), default=0)
    ops = _job_ops(ranks)
    # By row: a worker's own figures (two workers of one rank number are two rows).
    repeated = {  # (without the longest late arrival)
        row: max(0.0, f.wait_caused_s - f.largest_wait_caused_s) for row, f in enumerate(ranks)
    }
    straggler = None
    row = stands_out(repeated)
    if row is not None and len(ranks) > 1:
        mine = ranks[row]
        others = [f for f in ranks if f is not mine]
        per_other = repeated[row] / len(others)
        elapsed = statistics.median([f.elapsed_s for f in others])
        if per_other >= STANDOUT_SECONDS and per_other >= STANDOUT_FRACTION * elapsed:
            waited_for = [
                (op["waited_s"] * op["share"], op["op"])
                for op in ops
                if op["mostly_for"] == mine.rank
            ]
            caused = mine.wait_caused_s
            straggler = Straggler(
                rank=mine.rank,
                host=mine.host,
                wait_caused_s=caused,
                share=caused / total if total > 0 else 1.0,
                times_last=mine.times_last,
                held_rounds=held,
                per_time_s=caused / max(1, mine.times_last) / len(others),
                others_fraction=caused / len(others) / elapsed if elapsed else 0.0,
                op=max(waited_for)[1] if waited_for else None,
                timeline=mine.timeline and not any(f.timeline for f in others),
            )
    return JobReport(ranks, size, missing, total, held, straggler, ops)


def _job_ops(ranks: list[RankFigures]) -> list[dict[str, Any]]:
    """The ops the job waited at most: how long all ranks waited at each, and for whom."""
    waited: dict[str, float] = collections.defaultdict(float)
    whom: dict[str, dict[int, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    for f in ranks:
        for label, entry in f.ops.items():
            waited[label] += float(entry.get("waited_s", 0.0))
            for rank, value in entry.get("for", {}).items():
                whom[label][int(rank)] += float(value)
    found = []
    for label in sorted(waited, key=lambda name: -waited[name])[:TOP_OPS]:
        per = whom[label]
        rank, most = max(per.items(), key=lambda item: item[1]) if per else (-1, 0.0)
        found.append(
            {
                "op": label,
                "waited_s": waited[label],
                "mostly_for": rank,
                "share": most / waited[label] if waited[label] > 0 else 0.0,
            }
        )
    return found


@dataclass(frozen=True)
class LiveNews:
    """What :meth:`LiveWatch.update` has to say: a status line (None: nothing to show) and
    a warning to print once (None: none now)."""

    status: str | None = None
    warning: str | None = None


class LiveWatch:
    """Watches the figures as they come (every second or so) for a rank that makes the
    others wait: within the last ``window`` seconds, the others waited for it
    ``wait_seconds`` or more on average and it :func:`stands_out`, both without its longest
    late arrival in the window (as at the end of the job: one late start is no straggler).
    Says so in a status line while it lasts, and in a warning at most once per ``repeat``
    seconds for the same rank. The times are the watcher's own clock (when it read the
    figures). Only the workers of the newest generation (elastic jobs) are judged, each
    against its own figures of that generation: a rank number is a generation's."""

    def __init__(
        self,
        details: str = "",
        window: float = LIVE_WINDOW_SECONDS,
        wait_seconds: float = LIVE_WAIT_SECONDS,
        repeat: float = LIVE_REPEAT_SECONDS,
    ) -> None:
        self.details = details  # where the warning says the details are ("": nowhere)
        self.window = window
        self.wait_seconds = wait_seconds
        self.repeat = repeat
        # (when, the figures then, the workers whose figures then were below earlier ones)
        self._samples: collections.deque[tuple[float, dict[str, RankFigures], set[str]]] = (
            collections.deque()
        )
        self._warned: dict[int, float] = {}
        self._high: dict[str, RankFigures] = {}  # each worker's highest figures so far

    def _history(self, key: str, now: RankFigures) -> list[tuple[float, RankFigures]]:
        """A worker's figures in the window, oldest first: those of its current generation
        and rank, but for figures lower than earlier ones (a worker's figures only grow; an
        elastic worker's dip while its stopped engine's are carried over to the next)."""
        found: list[tuple[float, RankFigures]] = []
        for when, sample, dipped in self._samples:
            f = sample.get(key)
            if f is None or key in dipped:
                continue
            if f.generation != now.generation or f.rank != now.rank:
                found = []
            else:
                found.append((when, f))
        return found

    def _dipped(self, figures: Mapping[str, RankFigures]) -> set[str]:
        """The workers whose figures are below their highest so far (same generation and
        rank); the others' are their highest now."""
        dipped = set()
        for key, f in figures.items():
            high = self._high.get(key)
            if (
                high is not None
                and (high.generation, high.rank) == (f.generation, f.rank)
                and (f.wait_caused_s < high.wait_caused_s or f.times_last < high.times_last)
            ):
                dipped.add(key)
            else:
                self._high[key] = f
        return dipped

    def update(self, now: float, figures: Mapping[str, RankFigures]) -> LiveNews:
        samples = self._samples
        dipped = self._dipped(figures)
        samples.append((now, dict(figures), dipped))
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()
        newest = max((f.generation for f in figures.values()), default=0)
        caused: dict[int, float] = collections.defaultdict(float)
        repeated: dict[int, float] = collections.defaultdict(float)  # less the longest
        last: dict[int, int] = collections.defaultdict(int)
        held: dict[int, int] = collections.defaultdict(int)  # over the rank's own stretch
        since: dict[int, float] = {}
        covered: dict[int, float] = {}  # the stretch on the worker's own clock
        hosts: dict[int, str] = {}
        timelines = set()  # the ranks that write a timeline
        for key, f in figures.items():
            if f.generation != newest:
                continue  # (a worker gone with its generation, or not in the new one yet)
            # Each worker's figures against its oldest in the window (workers publish at
            # their own pace: a worker first seen now has nothing to compare yet).
            if key in dipped:
                continue
            history = self._history(key, f)
            when, before = history[0]
            if when == now:
                continue
            mine = max(0.0, f.wait_caused_s - before.wait_caused_s)
            caused[f.rank] += mine
            repeated[f.rank] += max(0.0, mine - _longest_arrival(history))
            last[f.rank] += max(0, f.times_last - before.times_last)
            held[f.rank] = max(held[f.rank], f.held_rounds - before.held_rounds)
            since[f.rank] = min(since.get(f.rank, now), when)
            covered[f.rank] = max(covered.get(f.rank, 0.0), f.elapsed_s - before.elapsed_s)
            hosts[f.rank] = f.host
            if f.timeline:
                timelines.add(f.rank)
        rank = stands_out(repeated)
        if rank is None or len(caused) < 2:
            return LiveNews()
        span, rounds = now - since[rank], held[rank]
        if span < LIVE_MIN_SPAN or last[rank] < max(LIVE_MIN_LAST, rounds / 2):
            return LiveNews()
        others = len(caused) - 1
        if repeated[rank] / others < self.wait_seconds * min(1.0, span / self.window):
            return LiveNews()
        # The figures cover the workers' stretch between two comparisons, which may be
        # longer than the watcher's; each other rank waited no longer than that.
        span = max(1.0, round(max(span, covered[rank])))
        per_other = min(caused[rank] / others, span)
        where = f"rank {rank}" + (f" on {hosts[rank]}" if hosts.get(rank) else "")
        share = f", last at {_percent(last[rank], rounds)} of them" if rounds else ""
        status = (
            f"{where} holds the others back: they waited {seconds(per_other)} for it "
            f"in the last {span:.0f} s"
        )
        warning = None
        if now - self._warned.get(rank, -self.repeat) >= self.repeat:
            self._warned[rank] = now
            warning = (
                f"{where} is holding the job back: in the last {span:.0f} s the other ranks "
                f"waited {seconds(per_other)} each for it in {rounds} collectives{share}"
                + (f" ({self.details})" if self.details else "")
            )
            if timelines == {rank}:
                warning += f". {TIMELINE_CAVEAT}"
        return LiveNews(status, warning)


def _longest_arrival(history: list[tuple[float, RankFigures]]) -> float:
    """At most how much of a worker's waiting caused in the window (``history``, its
    figures in it, oldest first) one late arrival of it made: no more than its longest one
    so far (figures without it: nothing is left out, as at the end of the job), and, as a
    late arrival counts among its times last when it begins, no more than the waiting from
    one reading in which a late arrival began to the next such reading (or from the
    window's start)."""
    peak = history[-1][1].largest_wait_caused_s
    if peak <= 0:
        return 0.0
    longest = 0.0
    stretch = 0.0
    for (_, before), (_, after) in itertools.pairwise(history):
        caused = max(0.0, after.wait_caused_s - before.wait_caused_s)
        if after.times_last > before.times_last:
            longest = max(longest, stretch + caused)  # (the one that ends here, at most)
            stretch = 0.0
        stretch += caused
    longest = max(longest, stretch)
    return min(longest, peak)
