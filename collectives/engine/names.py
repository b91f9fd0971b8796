"""The names of unnamed ops: one counter per (process set, kind) on every rank.

An op submitted without a name is called ``<kind>.noname.<counter>`` (``allreduce.noname.0``,
``allreduce.noname.1``, ...), as in Horovod, and ranks match it with the others' op of the
same name. That works as long as every rank draws the same counters for the same ops, so:

* a rank draws a counter only once nothing on this rank can refuse the op any more (the
  submission layer checks its arguments first): an op refused on one rank before it was
  announced draws nothing;
* an op refused or run after the negotiation drew the same counter on every rank that
  submitted it; the ranks that took part without submitting it (ranks that called
  ``hvd.join()``: they add neutral values to an allreduce and let a barrier or a refused
  allgather pass) catch up with it (:meth:`UnnamedCounters.catch_up`), so that after
  ``hvd.join()`` returns every rank counts on from the same values.

Where ranks still diverge (user code that runs an unnamed op on some ranks only), the stall
inspector recognises the pattern and stops the job with an error that says so
(see :func:`collectives.engine.stall.diverged`).

Ownership: the counts are ``itertools.count`` objects, created with ``setdefault`` and
advanced with ``next()``, both atomic under the GIL, from any thread.
"""

from __future__ import annotations

import itertools

from collectives.engine.requests import NONAME_PREFIXES, Kind, adasum_name

__all__ = ["UnnamedCounters", "unnamed_counter"]


def unnamed_counter(kind: Kind, name: str) -> tuple[Kind, int] | None:
    """The kind whose counter an unnamed op drew, and that counter (``allgather.noname.7``
    -> (ALLGATHER, 7)); None for a named op. An unnamed Adasum allreduce travels as the
    allgather ``adasum.allreduce.noname.N`` (see ``collectives.ops``): it drew the
    allreduce counter N."""
    adasum = adasum_name(kind, name)
    if adasum is not None:
        kind, name = Kind.ALLREDUCE, adasum
    prefix = NONAME_PREFIXES[kind]
    if name.startswith(prefix):
        digits = name[len(prefix) :]
        if digits.isdigit():
            return kind, int(digits)
    return None


class UnnamedCounters:
    """This process's unnamed-op counters, one per (process set, kind)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, Kind], itertools.count[int]] = {}

    def count(self, kind: Kind, process_set_id: int) -> itertools.count[int]:
        """The count itself (the hot lane binds its ``__next__``)."""
        key = (process_set_id, kind)
        found = self._counts.get(key)
        return found if found is not None else self._counts.setdefault(key, itertools.count())

    def draw(self, kind: Kind, process_set_id: int) -> int:
        """The counter of the next unnamed op of this kind in this process set."""
        found = self._counts.get((process_set_id, kind))
        return next(found if found is not None else self.count(kind, process_set_id))

    def forget(self, process_set_id: int) -> None:
        """A removed set's counters go (set ids are never used again)."""
        self._counts = {key: c for key, c in self._counts.items() if key[0] != process_set_id}

    def catch_up(self, kind: Kind, process_set_id: int, counter: int) -> None:
        """An unnamed op with ``counter`` ran (or was refused) among the set's members while
        this rank, which had joined, did not submit it: this rank counts it too. Draws up to
        ``counter`` (usually exactly it: a joined rank submits nothing in between)."""
        count = self.count(kind, process_set_id)
        while next(count) < counter:
            pass
