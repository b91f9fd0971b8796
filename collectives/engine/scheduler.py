"""When a process set's next cycle is due: a pure function of two snapshots and a clock.

A rank enters a cycle, so that the lockstep costs no CPU while nothing happens:

* when it has newly submitted ops: once they were gathered for the cycle time
  (``HVDRUN_CYCLE_TIME``, 1 ms) and submissions paused (a burst goes out in one round, up to
  ``BURST_MAX`` cycle times), or at once when a thread blocks on one of them (a flush);
* when an announced op waits for some *other* rank: at once while announcements flow, at the
  cycle-time pace after a round that brought nothing new (the round blocks until the late
  rank announces; the late rank itself never spins);
* otherwise every second (keepalive), counted from the end of the last round so that the
  ranks' keepalive rounds coincide; it bounds how long a peer waits for this rank and paces
  the stall inspector;
* at once when it leaves (shutdown) or the stall inspector gave up.

The facts come from their owners as immutable snapshots: :class:`Due` from the set's queue
(read under its condition), :class:`Pace` from its cycle runner (published after every
cycle). :func:`seconds_until_cycle` reads nothing else, so it is tested with a fake clock.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BURST_MAX", "BURST_PAUSE", "KEEPALIVE_SECONDS", "Due", "Pace", "seconds_until_cycle"]

KEEPALIVE_SECONDS = 1.0
#: A burst of submissions is gathered until it pauses for this many cycle times...
BURST_PAUSE = 1.0
#: ... but for at most this many.
BURST_MAX = 20.0


class Due(NamedTuple):
    """The queue's side: what was submitted and what was asked for."""

    urgent: bool = False  # this rank leaves, or its stall inspector gave up
    pending: bool = False  # ops were submitted since the last cycle took them
    flush: bool = False  # a thread waits on one of them
    first_new: float = 0.0  # when the oldest of them was submitted
    last_submit: float = 0.0  # when the newest was


class Pace(NamedTuple):
    """The cycle runner's side: how the last cycle went."""

    awaiting: bool = False  # an announced op waits for another rank
    quiet: bool = True  # the last round carried no announcements
    last_cycle: float = 0.0  # when the last cycle started
    last_round: float = 0.0  # when the last round ended (every rank saw it about then)
    cycle_time: float = 0.001  # seconds


def seconds_until_cycle(due: Due, pace: Pace, now: float) -> float:
    """Seconds until the next cycle is due (<= 0: now)."""
    if due.urgent:
        return 0.0
    cycle = pace.cycle_time
    if due.pending:
        if due.flush:
            return 0.0
        # Gather for the cycle time; while submissions keep coming (a burst), wait until
        # they pause, up to a few cycle times: the submitting thread would otherwise fight
        # the engine's thread for the GIL on every torch call.
        paused = min(due.last_submit + cycle * BURST_PAUSE, due.first_new + cycle * BURST_MAX)
        return max(due.first_new + cycle, paused) - now
    if pace.awaiting:
        # Right away while announcements flow; at the cycle-time pace once a round brought
        # nothing new (ranks waiting on each other must not spin).
        return pace.last_cycle + cycle - now if pace.quiet else 0.0
    return pace.last_round + KEEPALIVE_SECONDS - now
