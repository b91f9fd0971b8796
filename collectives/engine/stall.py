"""The stall inspector: ops that some ranks submitted and others never did.

Such an op can never run, and its submitters wait forever: the classic Horovod deadlock of
ranks submitting different names, or of one rank skipping a step. Every member of a process
set holds the same negotiation table, so the set's first member alone inspects it (as
Horovod's coordinator does): after
``HVDRUN_STALL_CHECK_TIME_SECONDS`` (60) it logs which ops wait for which ranks, again every
such period; after ``HVDRUN_STALL_SHUTDOWN_TIME_SECONDS`` (0 = never; as in Horovod, a
time below the check time is never too) it asks the engine to stop the job's collectives,
which every rank then does in the same cycle.

One stall is certain to be a deadlock: unnamed ops whose counters diverged across ranks
(:func:`diverged`). An unnamed op that waits for a rank which has already submitted a later
unnamed op of the same kind and set can never run: that rank drew this op's counter for
another op, and never draws it again. Once such an op has waited the stall check time,
the inspector stops the job's collectives instead of warning, and every rank's pending ops
fail with an error that names the ops and says what happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import NamedTuple

from collectives.engine.config import EngineConfig
from collectives.engine.names import unnamed_counter
from collectives.engine.negotiation import Entry, Table
from collectives.engine.requests import Kind, label, script_name

__all__ = ["Divergence", "StallInspector", "diverged", "joined_note", "name_clashes"]

logger = logging.getLogger("collectives.engine")

#: How often (seconds) rank 0 looks at the table at most.
CHECK_INTERVAL = 0.25


class Divergence(NamedTuple):
    """An unnamed op (``entry``) that waits for ``rank``, which has already submitted the
    later unnamed op ``later`` of the same kind and process set."""

    entry: Entry
    rank: int
    later: Entry


def diverged(table: Table, members: Callable[[Entry], list[int]]) -> list[Divergence]:
    """The pending unnamed ops that can never run because the ranks they wait for have
    counted past them (see the module docstring), in the order they were announced."""
    by_counter: dict[tuple[int, Kind], list[tuple[int, Entry]]] = {}
    for entry in table.entries.values():
        unnamed = unnamed_counter(entry.kind, entry.name)
        if unnamed is not None:
            kind, counter = unnamed
            by_counter.setdefault((entry.process_set_id, kind), []).append((counter, entry))
    found = []
    for pending in by_counter.values():
        if len(pending) < 2:
            continue
        pending.sort(key=lambda item: item[0])
        for position, (_, entry) in enumerate(pending):
            for rank in table.waiting_for(entry, members(entry)):
                later = next((e for _, e in pending[position + 1 :] if rank in e.sigs), None)
                if later is not None:
                    found.append(Divergence(entry, rank, later))
    return sorted(found, key=lambda d: (d.entry.order, d.rank))


def name_clashes(table: Table) -> list[list[Entry]]:
    """Named ops that ranks submitted under one name as different ops (an allreduce on some
    ranks, an allgather or an ``op=Adasum`` allreduce on others), each rank one of them: the
    engine keys ops by kind and name, so they never meet (Horovod refuses them as mismatched
    operations). Unnamed ops are left out: an allreduce and an allgather may both be number
    0 of their own kinds and still meet their peers."""
    by_name: dict[tuple[int, str], list[Entry]] = {}
    for entry in sorted(table.entries.values(), key=lambda e: e.order):
        if not entry.kind.moves_data:  # (a join, barrier or process set call: no user name)
            continue
        key = (entry.process_set_id, script_name(entry.kind, entry.name))
        by_name.setdefault(key, []).append(entry)
    return [
        entries
        for entries in by_name.values()
        if len(entries) > 1 and _disjoint([set(e.sigs) for e in entries])
    ]


def _disjoint(ranks: list[set[int]]) -> bool:
    return sum(map(len, ranks)) == len(set().union(*ranks))


def joined_note(ranks: list[int]) -> str:
    """What the report says of missing members that wait in hvd.join() (none: nothing)."""
    if not ranks:
        return ""
    who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {ranks} have"
    return (
        f" ({who} joined: called hvd.join(), and a joined rank takes part in no ops of "
        "other process sets until every rank has joined; run a set's ops before its "
        "members call hvd.join())"
    )


class StallInspector:
    """Watches the negotiation table for ops that wait too long."""

    def __init__(
        self, config: EngineConfig, rank: int, inspects: bool, process_set_id: int = 0
    ) -> None:
        self._config = config
        # What a shutdown stops: the set's own collectives (the global set's: the job's).
        self._stops = (
            "the job's collectives"
            if process_set_id == 0
            else f"process set {process_set_id}'s collectives (the job's other sets go on)"
        )
        self._active = (
            config.stall_check
            and inspects
            and (config.stall_warning_seconds > 0 or config.stall_shutdown_seconds > 0)
        )
        self._rank = rank
        self._last_check = 0.0
        # As in Horovod, a shutdown time below the check time means no shutdown (a job that
        # ran under Horovod with one must not be stopped here).
        self._shutdown = config.stall_shutdown_seconds
        if 0 < self._shutdown < config.stall_warning_seconds:
            if self._active and process_set_id == 0:
                logger.warning(
                    "HVDRUN_STALL_SHUTDOWN_TIME_SECONDS=%g is less than "
                    "HVDRUN_STALL_CHECK_TIME_SECONDS=%g: as in Horovod, a stall will not "
                    "shut the job down (set it above %g s)",
                    self._shutdown,
                    config.stall_warning_seconds,
                    config.stall_warning_seconds,
                )
            self._shutdown = 0.0
        # The ranks waiting in hvd.join() (the global set's, which the engine sets for
        # the inspectors of other sets): an op of another set waits for such a member.
        self.joined: Callable[[], Collection[int]] = frozenset

    def check(self, table: Table, members: Callable[[Entry], list[int]], now: float) -> bool:
        """Warns about stalled ops; returns True when the job's collectives must stop: after
        the shutdown time, or at the stall check time for unnamed ops that diverged."""
        if not self._active or now - self._last_check < CHECK_INTERVAL:
            return False
        self._last_check = now
        cfg = self._config
        # A rank waiting in hvd.join() for the others to finish their data is no stall
        # (as in Horovod): the others run on, their own ops are inspected.
        waited = [
            (now - entry.first_seen, entry)
            for entry in table.entries.values()
            if entry.kind != Kind.JOIN
        ]
        warning, shutdown = cfg.stall_warning_seconds, self._shutdown
        limit = min(t for t in (warning, shutdown) if t > 0)
        old = {id(entry) for w, entry in waited if w >= limit}
        if old and (
            any(id(d.entry) in old for d in diverged(table, members))
            or any(
                id(e) in old and unnamed_counter(e.kind, e.name) is None
                for clash in name_clashes(table)
                for e in clash
            )
        ):
            logger.error("%s", self.report(table, members, now, aborting=True))
            return True
        stalled = [entry for w, entry in waited if warning > 0 and w >= warning]
        if any(now - entry.warned_at >= warning for entry in stalled):
            logger.warning("%s", self.report(table, members, now))
            for entry in stalled:
                entry.warned_at = now
        return shutdown > 0 and any(w >= shutdown for w, _ in waited)

    def holdup(self, table: Table, members: Callable[[Entry], list[int]]) -> tuple[int, str] | None:
        """After a stall shutdown, the rank that held this rank up, and the op it never
        submitted: the first rank missing from the oldest op this rank submitted. None when
        this rank is among the missing, or ranks submitted different ops (unnamed ops that
        diverged, one name for two ops): there every rank's script is at fault alike."""
        if diverged(table, members) or name_clashes(table):
            return None
        for entry in sorted(table.entries.values(), key=lambda e: e.order):
            if entry.kind == Kind.JOIN or self._rank not in entry.sigs:
                continue
            missing = table.waiting_for(entry, members(entry))
            if missing:
                return (
                    (missing[0], label(entry.kind, entry.name))
                    if self._rank not in missing
                    else None
                )
        return None

    def report(
        self,
        table: Table,
        members: Callable[[Entry], list[int]],
        now: float,
        aborting: bool = False,
    ) -> str:
        """Which ops wait, since when, submitted by whom and missing whom; when stopping the
        job over unnamed ops that diverged, which ones and why."""
        cfg = self._config
        if aborting:
            divergences = diverged(table, members)
            if divergences:
                return self._divergence_report(divergences, now)
        lines = []
        shown = set()
        joined = self.joined()
        for entry in sorted(table.entries.values(), key=lambda e: e.order):
            waited = now - entry.first_seen
            if waited < cfg.stall_warning_seconds and not aborting:
                continue
            shown.add(id(entry))
            missing = table.waiting_for(entry, members(entry))
            lines.append(
                f"  {label(entry.kind, entry.name)} (process set {entry.process_set_id}, "
                f"waiting {waited:.0f} s): submitted by ranks {sorted(entry.sigs)}, "
                f"missing ranks {missing}{joined_note([r for r in missing if r in joined])}"
            )
        clashes = [c for c in name_clashes(table) if all(id(e) in shown for e in c)]
        for clash in clashes:
            ops = "; ".join(f"{label(e.kind, e.name)} on ranks {sorted(e.sigs)}" for e in clash)
            if unnamed_counter(clash[0].kind, clash[0].name) is None:
                lines.append(
                    f"  one name, different ops: {ops}; these never meet (give different "
                    "ops different names)"
                )
            else:  # (each rank's unnamed op number N of its own kind: they may yet meet)
                lines.append(
                    f"  different unnamed ops, each rank one of them: {ops}; each waits until "
                    "every rank submits it too, so ranks whose scripts run different "
                    "collectives at this point wait for each other for good"
                )
        if aborting and any(unnamed_counter(c[0].kind, c[0].name) is None for c in clashes):
            head = (
                f"rank {self._rank}: ranks submitted different ops under one name, so these "
                "ops can never run (the engine pairs ops by kind and name; Horovod refuses "
                "them as mismatched operations); the stall inspector stopped "
                f"{self._stops}. Give different ops different names"
            )
        elif aborting:
            head = (
                f"rank {self._rank}: the stall inspector stopped {self._stops} after "
                f"ops waited more than HVDRUN_STALL_SHUTDOWN_TIME_SECONDS="
                f"{cfg.stall_shutdown_seconds:g} s for ranks that never submitted them"
            )
        else:
            head = (
                f"hvdrun stall inspector: ops have waited more than "
                f"{cfg.stall_warning_seconds:g} s for some ranks. Ranks may be submitting "
                "different ops (names), or some ranks stopped submitting; this will deadlock"
            )
        return "\n".join([head + ":", *lines]) if lines else head

    def _divergence_report(self, divergences: list[Divergence], now: float) -> str:
        lines = [
            f"  {label(d.entry.kind, d.entry.name)} (process set {d.entry.process_set_id}, "
            f"waiting {now - d.entry.first_seen:.0f} s, submitted by ranks "
            f"{sorted(d.entry.sigs)}) waits for rank {d.rank}, which has already submitted "
            f"{label(d.later.kind, d.later.name)}"
            for d in divergences
        ]
        head = (
            f"rank {self._rank}: unnamed op counters diverged across ranks, so these ops can "
            "never run: ranks submitted different unnamed ops (an unnamed op is called "
            "<kind>.noname.<counter>, counted per kind and process set on each rank, so an "
            "unnamed op run on some ranks only shifts the names of all later ones there); the "
            f"stall inspector stopped {self._stops}. Give the ops names (name=...) "
            "so that ranks match them by name, or make every rank submit the same unnamed "
            "ops in the same order"
        )
        return "\n".join([head + ":", *lines])
