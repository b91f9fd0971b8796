"""Arrival accounting: which member each round of a process set waited for, and how long.

Every round of a set (the full negotiation, the response cache's round, a predicted round, a
lane's round) is one collective on the set's Gloo group that no member leaves before the last
one has entered it. The member that arrived last therefore spends the least time inside it,
and every other member spends, in excess of that, as long as it arrived earlier. So each
member measures how long it was inside each round on its own clock (no clock is compared
with another host's) and the members compare those durations afterwards:

* the *last* member of a round is the one with the shortest duration;
* a member's *wait* in a round is its duration minus that shortest one, if it had an op in
  the round (a member with none, in a keepalive round or leaving the set, waited for
  nothing it needed); a round's wait is the sum of its members' waits, and the last member
  *caused* it;
* a *stuck* round, one that made no op ready although its last member had an op of its own,
  has no wait: each member waited on ops that others had not submitted (ops submitted in
  different orders, or a deadlock, which the stall inspector reports), and which member
  came last was the engines' pacing, not a late rank (a round whose last member had no op
  keeps its wait: that member is late, it brings nothing the others wait for);
* a round *held* the set back when its wait reached :data:`HELD_SECONDS`: only those count
  when members are said to have been last (in a balanced job every member is last by a
  hair in turn, which says nothing);
* one *late arrival* may take several rounds: while the last member has no op of its own
  (it runs keepalive rounds, sleeping or loading data), the others' ops stay pending and
  they wait on in the next round. A round in which others waited for a last member that
  had no op, followed by a round with the same last member (rounds in which nobody waited
  aside), is one late arrival: it counts once among the collectives that held the set back
  (if any of its rounds did) and the times that member was last, and its waits add up to
  one wait (the largest of which a member's figures keep: one late start is not a
  straggler, however many rounds it took).

Comparing costs nothing per round: a member keeps its durations (and what each round
waited on, its *label*) in a buffer and the members compare them in a *flush* of up to
:data:`CAPACITY` rounds at a time, two small collectives on the set's Gloo group (the
shortest duration per round, then per round the waits' sum, who was last and whether it
had an op of its own). Every member flushes right after the same round, so after:

* a round in which the buffer became full (every member counts the same rounds);
* a round in which a member raised its flag, because its oldest unflushed round is
  :data:`INTERVAL` old (or ``hvd.report()`` asked): a header bit of the full negotiation,
  a share of the cache round's first slot, the predicted round's NaN slot when it carries no
  data, or one more element when its data has three or more (an allreduce of one or two
  elements would take Gloo one more step with it: those rounds leave the flag to others, or
  to the full buffer);
* the round in which a member leaves the set, so that the figures of a job that ends are
  complete.

Besides, each member adds up the time it spends in the set's cycles and lanes (*busy*):
time in collectives, as against time between them. A flush runs inside a cycle, whose time
is added after it: a snapshot's busy time is at least the rounds' durations so far, so that
it covers the waits of the round just compared (the last flush, in the round in which a
member leaves the set, has no later one to catch up).

Ownership: an :class:`Arrivals` belongs to its set's cycle runner, so to whoever holds the
set's cycle lock. Two fields are read or written from other threads, each a single
reference: ``snapshot`` (an immutable :class:`Snapshot` replaced whole after every flush,
read by whoever publishes the figures) and ``want`` (set by :meth:`Arrivals.ask` to make
the next round flush: a bool written whole).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy
import torch
import torch.distributed as dist

__all__ = [
    "CAPACITY",
    "HELD_SECONDS",
    "IDLE",
    "INTERVAL",
    "Arrivals",
    "Snapshot",
    "Summary",
    "add_ops",
    "op_label",
    "summarize",
]

logger = logging.getLogger(__name__)

#: Rounds one flush compares at most.
CAPACITY = 1024
#: Seconds after which a member's oldest unflushed round makes it ask for a flush.
INTERVAL = 1.0
#: A round in which the members waited this long in all held the set back.
HELD_SECONDS = 0.001
#: Op labels a member keeps figures for (the first ones that waited; later ones go to
#: :data:`OTHER_OPS`).
MAX_OPS = 256
OTHER_OPS = "(other ops)"
#: The label of a round in which this member had no op of its own (a keepalive), and how
#: the figures name it.
IDLE = ""
NO_OP = "(no op of its own)"

_MIN = dist.ReduceOp.MIN
_SUM = dist.ReduceOp.SUM


class Snapshot(NamedTuple):
    """One member's figures of one process set as of its latest flush (immutable)."""

    flushes: int  # flushes so far (alike on every member)
    rounds: int  # rounds compared
    held: int  # late arrivals that held the set back (alike on every member)
    waited: float  # seconds this member waited for the last member of a round, in all
    busy: float  # seconds this member spent in the set's cycles and lanes
    elapsed: float  # seconds since the accounting started
    caused: tuple[float, ...]  # by member index: the rounds' waits it caused as their last
    peak: tuple[float, ...]  # by member index: the largest of those waits (one late arrival)
    last: tuple[int, ...]  # by member index: late arrivals of it that held the set back
    ops: dict[str, tuple[float, dict[int, float]]]  # label: (waited at it, {member: waited for})


class Arrivals:
    """One member's accounting of one process set's rounds (see the module docstring)."""

    def __init__(self, index: int, size: int) -> None:
        self.index = index  # this member's place in the set
        self.size = size
        self.want = False  # raise the flag in the next round
        self.busy = 0.0
        self.n = 0  # unflushed rounds
        self._first = 0.0  # when the oldest unflushed round ended
        # The unflushed rounds' durations (written from Python), and the two vectors the
        # members compare them in: each a bytearray the allreduce sees as a tensor and the
        # arithmetic as a numpy array (a dozen torch ops touched for the first time would
        # add megabytes of code to the process's memory; numpy's, loaded with torch, add
        # next to none, and are faster on vectors this small).
        raw = bytearray(CAPACITY * 8)
        self._write = memoryview(raw).cast("d")
        self._durations = numpy.frombuffer(raw, dtype=numpy.float64)
        raw = bytearray((CAPACITY + 1) * 8)
        self._shortest_t = torch.frombuffer(raw, dtype=torch.float64)
        self._shortest = numpy.frombuffer(raw, dtype=numpy.float64)
        raw = bytearray(4 * CAPACITY * 8)
        self._sums_t = torch.frombuffer(raw, dtype=torch.float64)
        self._sums = numpy.frombuffer(raw, dtype=numpy.float64)
        self._labels: list[str | None] = [None] * CAPACITY
        self._stuck = numpy.zeros(CAPACITY, dtype=bool)  # rounds that made no op ready
        self._started = time.perf_counter()
        self._rounds = 0
        self._held = 0
        self._waited = 0.0
        self._inside = 0.0  # the rounds' durations, in all
        # A late arrival that goes on into the next round: the member (-1: none) and the
        # others' wait for it so far.
        self._open = -1
        self._open_wait = 0.0
        self._caused = numpy.zeros(size)
        self._peak = numpy.zeros(size)
        self._last = numpy.zeros(size, dtype=numpy.int64)
        self._ops: dict[str, list[Any]] = {}
        self._warned = False
        self.snapshot = Snapshot(
            0, 0, 0, 0.0, 0.0, 0.0, (0.0,) * size, (0.0,) * size, (0,) * size, {}
        )

    # ---- every round (the hot path: a few attribute operations) ------------------------

    def note(self, started: float, ended: float, label: str | None) -> None:
        """A round this member was in from ``started`` to ``ended`` (``time.perf_counter``),
        waiting on the op ``label`` (None: the hot lane's unnamed allreduce). The round then
        calls :meth:`after`."""
        n = self.n
        self._write[n] = ended - started
        self._labels[n] = label
        self.n = n + 1
        if n == 0:
            self._first = ended
        elif ended - self._first >= INTERVAL:
            self.want = True

    def after(
        self, group: Any, flagged: bool, timeout: float | None = None, progress: bool = True
    ) -> None:
        """After a noted round: flushes when a member raised its flag in it (``flagged``)
        or the buffer is full, alike on every member. ``progress``: the round made an op
        ready (alike on every member); one that made none is *stuck* (see :meth:`flush`)."""
        if not progress and self.n:
            self._stuck[self.n - 1] = True
        if flagged or self.n == CAPACITY:
            self.flush(group, timeout)

    def ask(self) -> None:
        """Makes the set's next round flush (any thread: ``hvd.report()``)."""
        self.want = True

    def close(self) -> None:
        """The set stopped (this member left it, or a round failed): the snapshot's figures
        of this member's own clock (time in the set's rounds, time since the start) are
        brought up to date. Rounds no flush compared (a peer died before the next one) add
        no waits: those need every member's durations."""
        self.snapshot = self.snapshot._replace(
            busy=max(self.busy, self._inside), elapsed=time.perf_counter() - self._started
        )

    # ---- the flush (after a round whose flag was raised) -------------------------------

    def flush(self, group: Any, timeout: float | None = None) -> None:
        """Compares the unflushed rounds with the other members (every member calls this
        after the same round) and adds them to the figures."""
        n = self.n
        self.n = 0
        self.want = False
        shortest = self._shortest
        shortest[0] = n
        mine = self._durations[:n]
        shortest[1 : n + 1] = mine
        alone = self.size == 1  # (a set of one: its vectors are their own MIN and SUM)
        if not alone:
            _allreduce(group, self._shortest_t, _MIN, timeout)
        low = shortest[1 : n + 1]
        excess = numpy.maximum(mine - low, 0.0)
        labels = self._labels
        idle = [k for k in range(n) if labels[k] == IDLE]
        if idle:
            excess[idle] = 0.0
        last = mine <= low
        sums = self._sums
        sums.fill(0.0)
        sums[:n] = excess
        sums[CAPACITY : CAPACITY + n] = last
        sums[2 * CAPACITY : 2 * CAPACITY + n] = last * float(self.index)
        if idle:
            sums[3 * CAPACITY + numpy.asarray(idle)] = last[idle]
        if not alone:
            _allreduce(group, self._sums_t, _SUM, timeout)
        stuck = self._stuck[:n]
        if stuck.any():
            # A stuck round whose last member had an op of its own: every member waited on
            # ops some others had not submitted (ops in different orders, a deadlock), and
            # who came last was the engines' pacing, not a late rank. Nobody waited in it.
            noise = stuck & (sums[3 * CAPACITY : 3 * CAPACITY + n] < 0.5)
            sums[:n][noise] = 0.0
            excess[noise] = 0.0
            stuck[:] = False
        if int(shortest[0]) != n:
            # Members counted different rounds: nothing to compare (never expected).
            if not self._warned:
                self._warned = True
                logger.warning("arrival accounting: members counted different rounds; skipped")
            return
        self._inside += float(mine.sum())
        self._add(n, excess, sums)

    def _add(self, n: int, excess: numpy.ndarray, sums: numpy.ndarray) -> None:
        if n == 0:
            return
        size = self.size
        waits = sums[:n]
        lasts = sums[CAPACITY : CAPACITY + n]
        # Who was last, where exactly one member was (ties: nobody); -1 otherwise.
        who = numpy.where(lasts == 1.0, sums[2 * CAPACITY : 2 * CAPACITY + n], -1.0)
        who = who.astype(numpy.int64)
        held = waits >= HELD_SECONDS
        known = who >= 0
        self._caused += numpy.bincount(who[known], weights=waits[known], minlength=size)
        # Late arrivals (see the module docstring): a round in which others waited for a
        # last member that had no op of its own leaves its arrival open; the next round in
        # which anyone waited goes on with it if that member is last again (a round in which
        # nobody waited changes nothing). Segment 0 is the arrival the previous flush left
        # open (if any).
        waited = waits > 0.0
        opens = known & waited & (sums[3 * CAPACITY : 3 * CAPACITY + n] > 0.5)
        after = numpy.where(opens, who, -1)  # the arrival each round leaves open
        latest = numpy.maximum.accumulate(numpy.where(waited, numpy.arange(n), -1))
        before = numpy.empty(n, dtype=numpy.int64)
        before[0] = self._open
        before[1:] = numpy.where(latest[:-1] >= 0, after[latest[:-1]], self._open)
        goes_on = ~waited | (known & (who == before))
        segment = numpy.cumsum(~goes_on)
        count = int(segment[-1]) + 1
        wait = numpy.bincount(segment, weights=numpy.where(known, waits, 0.0), minlength=count)
        owner = numpy.full(count, -1, dtype=numpy.int64)
        owner[segment[~goes_on]] = who[~goes_on]
        if self._open >= 0:
            owner[0] = self._open
            wait[0] += self._open_wait
        # (an open arrival counted when it began; it does not count again)
        counted = numpy.bincount(segment, weights=held, minlength=count) > 0
        counted[0] = False
        someone = owner >= 0
        numpy.maximum.at(self._peak, owner[someone], wait[someone])
        self._last += numpy.bincount(owner[counted & someone], minlength=size)
        self._held += int(counted.sum())
        if latest[-1] >= 0:
            self._open = int(after[latest[-1]])
        self._open_wait = float(wait[-1]) if self._open >= 0 else 0.0
        self._rounds += n
        self._waited += float(excess.sum())
        rows = numpy.flatnonzero(held & (excess > 0)).tolist()
        if rows:
            mine = excess.tolist()
            whom = who.tolist()
            ops = self._ops
            for k in rows:
                label = op_label(self._labels[k])
                entry = ops.get(label)
                if entry is None:
                    if len(ops) >= MAX_OPS:
                        label = OTHER_OPS
                        entry = ops.get(label)
                    if entry is None:
                        entry = ops[label] = [0.0, {}]
                entry[0] += mine[k]
                per = entry[1]
                per[whom[k]] = per.get(whom[k], 0.0) + mine[k]
        self.snapshot = Snapshot(
            self.snapshot.flushes + 1,
            self._rounds,
            self._held,
            self._waited,
            max(self.busy, self._inside),
            time.perf_counter() - self._started,
            tuple(self._caused.tolist()),
            tuple(self._peak.tolist()),
            tuple(self._last.tolist()),
            {label: (entry[0], dict(entry[1])) for label, entry in self._ops.items()},
        )


def _allreduce(group: Any, tensor: torch.Tensor, op: Any, timeout: float | None) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if timeout is not None:
        opts.timeout = datetime.timedelta(seconds=timeout)
    group.allreduce([tensor], opts).wait()


def op_label(label: str | None) -> str:
    """The op a round waited on, with an unnamed op's counter left out
    (``allreduce.noname.7`` -> ``allreduce.noname``), so that a loop's ops add up, and a
    kind named twice once (TensorFlow's graph names an unnamed op after its kind and input:
    ``allreduce.allreduce.gradient_tape/...`` -> ``allreduce.gradient_tape/...``)."""
    if label is None:
        return "allreduce.noname"
    if not label:
        return NO_OP
    head, dot, tail = label.rpartition(".")
    if dot and tail.isdigit() and head.endswith(".noname"):
        return head
    kind, _, rest = label.partition(".")
    return rest if rest.startswith(f"{kind}.") else label


class Summary(NamedTuple):
    """This rank's figures over every process set it belongs to (see :func:`summarize`)."""

    flushes: int  # of the global set
    rounds: int
    held: int  # late arrivals that held a set back
    waited: float
    busy: float
    elapsed: float
    caused: float  # the waits this rank caused as the last member of a round
    peak: float  # the largest of them (one late arrival, however many rounds it took)
    last: int  # its late arrivals that held a set back
    ops: dict[str, tuple[float, dict[int, float]]]  # label: (waited, {global rank: waited for})
    caused_by: dict[int, float]  # the global set's figures of every rank, by global rank
    last_by: dict[int, int]


def summarize(sets: Sequence[tuple[list[int], int, Snapshot]]) -> Summary:
    """This rank's summary from each set's (members, this rank's index, snapshot); the
    global set first."""
    ranks, _, first = sets[0]
    ops: dict[str, tuple[float, dict[int, float]]] = {}
    rounds = held = last = 0
    waited = busy = caused = peak = 0.0
    for members, index, snap in sets:
        rounds += snap.rounds
        held += snap.held
        waited += snap.waited
        busy += snap.busy
        caused += snap.caused[index]
        peak = max(peak, snap.peak[index])
        last += snap.last[index]
        add_ops(ops, snap.ops, members)
    return Summary(
        first.flushes,
        rounds,
        held,
        waited,
        busy,
        first.elapsed,
        caused,
        peak,
        last,
        ops,
        dict(zip(ranks, first.caused, strict=True)),
        dict(zip(ranks, first.last, strict=True)),
    )


def add_ops(
    ops: dict[str, tuple[float, dict[int, float]]],
    more: Mapping[str, tuple[float, Mapping[int, float]]],
    ranks: Sequence[int] | None = None,
) -> None:
    """Adds ``more``'s figures per op (label: (waited, {whom: waited for})) to ``ops``,
    ``whom`` a member index into ``ranks`` where given (-1, nobody, stays -1). The dicts in
    ``ops`` are replaced, never changed: they may be a snapshot's."""
    for label, (seconds, per) in more.items():
        total, before = ops.get(label, (0.0, {}))
        whom = dict(before)
        for who, value in per.items():
            rank = ranks[who] if ranks is not None and who >= 0 else who
            whom[rank] = whom.get(rank, 0.0) + value
        ops[label] = (total + seconds, whom)
