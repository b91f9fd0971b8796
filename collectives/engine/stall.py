"""The stall inspector: ops that some ranks submitted and others never did.

Such an op can never run, and its submitters wait forever: the classic Horovod deadlock of
ranks submitting different names, or of one rank skipping a step. Every member of a process
set holds the same negotiation table, so the set's first member alone inspects it (as
Horovod's coordinator does): after
``HVDRUN_STALL_CHECK_TIME_SECONDS`` (60) it logs which ops wait for which ranks, again every
such period; after ``HVDRUN_STALL_SHUTDOWN_TIME_SECONDS`` (0 = never) it asks the engine to
stop the job's collectives, which every rank then does in the same cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from collectives.engine.config import EngineConfig
from collectives.engine.negotiation import Entry, Table
from collectives.engine.requests import label

__all__ = ["StallInspector"]

logger = logging.getLogger("collectives.engine")

#: How often (seconds) rank 0 looks at the table at most.
CHECK_INTERVAL = 0.25


class StallInspector:
    """Watches the negotiation table for ops that wait too long."""

    def __init__(self, config: EngineConfig, rank: int, inspects: bool) -> None:
        self._config = config
        self._active = (
            config.stall_check
            and inspects
            and (config.stall_warning_seconds > 0 or config.stall_shutdown_seconds > 0)
        )
        self._rank = rank
        self._last_check = 0.0

    def check(self, table: Table, members: Callable[[Entry], list[int]], now: float) -> bool:
        """Warns about stalled ops; returns True when the job's collectives must stop."""
        if not self._active or now - self._last_check < CHECK_INTERVAL:
            return False
        self._last_check = now
        cfg = self._config
        waited = [(now - entry.first_seen, entry) for entry in table.entries.values()]
        warning = cfg.stall_warning_seconds
        stalled = [entry for w, entry in waited if warning > 0 and w >= warning]
        if any(now - entry.warned_at >= warning for entry in stalled):
            logger.warning("%s", self.report(table, members, now))
            for entry in stalled:
                entry.warned_at = now
        shutdown = cfg.stall_shutdown_seconds
        return shutdown > 0 and any(w >= shutdown for w, _ in waited)

    def report(
        self,
        table: Table,
        members: Callable[[Entry], list[int]],
        now: float,
        aborting: bool = False,
    ) -> str:
        """Which ops wait, since when, submitted by whom and missing whom."""
        cfg = self._config
        lines = []
        for entry in sorted(table.entries.values(), key=lambda e: e.order):
            waited = now - entry.first_seen
            if waited < cfg.stall_warning_seconds and not aborting:
                continue
            missing = table.waiting_for(entry, members(entry))
            lines.append(
                f"  {label(entry.kind, entry.name)} (process set {entry.process_set_id}, "
                f"waiting {waited:.0f} s): submitted by ranks {sorted(entry.sigs)}, "
                f"missing ranks {missing}"
            )
        if aborting:
            head = (
                f"rank {self._rank}: the stall inspector stopped the job's collectives after "
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
