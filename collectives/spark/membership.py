"""Who is in an elastic Spark job: the decisions of :func:`~collectives.spark.run_elastic`,
free of Spark and I/O.

The same rules as ``hvdrun``'s elastic driver (docs/elastic.md), for hosts that are Spark
task attempts: each attempt that reaches the driver is a host of one slot, hosts keep the
order in which they came (older ones get the low ranks), and a task whose worker fails or
whose executor is lost is gone for good (Spark may retry it: the retry is a new host).

* The first generation waits for ``num_proc`` tasks (and takes every task that came, up to
  ``max_num_proc``); after ``start_timeout`` it starts with what came if that is at least
  ``min_num_proc``, and otherwise the job fails.
* Later generations are published when a member is lost (the survivors' collectives fail
  and they wait for it) and when a task arrives while the job runs (the running workers
  switch at their next ``state.commit()``), never beyond ``max_num_proc`` (the job's Spark
  stage has that many tasks).
* It fails at once, checked in Horovod's order, when no worker runs any more, when more
  than ``reset_limit`` generations would have replaced ones that trained, and when no member
  holds the training state any more (the state would be lost); with fewer than
  ``min_num_proc`` members the job waits ``elastic_timeout`` for tasks to come back, then
  fails.
* Rank 0, from which every rank syncs the state, goes to the oldest member that holds it.

Threads: nothing here locks; a :class:`Membership` belongs to the driver's thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from rendezvous.slots import SlotInfo, assign_slots

__all__ = ["Member", "Membership", "Publish", "Stop", "Wait"]

#: The words hvdrun's elastic driver says for the same ends (docs/elastic.md).
EVERY_WORKER_FAILED = (
    "every worker of the elastic job has failed or left, and its training state with them"
)
STATE_LOST = (
    "the training state is lost: every worker that held it is gone, and the workers left "
    "({hosts}) never received it; stopping the job rather than training on from the "
    "initial state"
)
RESET_LIMIT_EXCEEDED = (
    "the elastic job would need reset {resets}, more than reset_limit {limit}; stopping the job"
)


@dataclass
class Member:
    """One task attempt: a host of one slot."""

    stream: int
    host: str
    order: int
    state: str = "ready"  # ready, running, exited (0), failed, stopped
    worker: int | None = None  # its worker's number, once started
    rank: int | None = None  # its rank in the newest generation it belongs to


@dataclass
class Publish:
    """Publish these slots (by rank) as the next generation; start the ``ready`` members."""

    members: list[Member]
    slots: list[SlotInfo]


@dataclass
class Wait:
    """Too few members: say ``message`` once, and wait."""

    message: str | None


@dataclass
class Stop:
    """The job cannot go on."""

    message: str


Decision = Publish | Wait | Stop | None


@dataclass
class Membership:
    num_proc: int
    min_np: int
    max_np: int
    elastic_timeout: float
    reset_limit: int | None
    start_timeout: float
    started_at: float
    members: dict[int, Member] = field(default_factory=dict)  # by stream
    generation: int = 0
    resets: int = 0
    need_publish: bool = False
    holders: dict[int, int] = field(default_factory=dict)  # worker -> generation synced in
    trained: bool = False
    _short_since: float | None = None
    _orders: itertools.count[int] = field(default_factory=itertools.count)

    def join(self, stream: int, host: str) -> Member:
        member = Member(stream, host, next(self._orders))
        self.members[stream] = member
        if self.generation > 0:
            self.need_publish = True
        return member

    def lose(self, member: Member) -> None:
        """The member's worker failed, or its task or executor was lost."""
        if member.state in ("ready", "running"):
            self.need_publish = self.need_publish or self.generation > 0
            member.state = "failed"

    def active(self) -> list[Member]:
        return sorted(
            (m for m in self.members.values() if m.state in ("ready", "running")),
            key=lambda m: m.order,
        )

    def running(self) -> list[Member]:
        return [m for m in self.active() if m.state == "running"]

    def note_holders(self, holders: dict[int, int]) -> None:
        self.holders = holders
        self.trained = self.trained or bool(holders)

    def holds(self, member: Member) -> bool:
        return member.state == "running" and member.worker in self.holders

    def decide(self, now: float) -> Decision:
        members = self.active()[: self.max_np]
        total = len(members)
        if self.generation == 0:
            if total >= self.num_proc:
                return self._publish(members)
            if now - self.started_at < self.start_timeout:
                return None
            if total >= self.min_np:
                return self._publish(members)
            return Stop(
                f"only {total} of {self.num_proc} Spark tasks started within "
                f"{self.start_timeout:g} s (start_timeout), fewer than min_num_proc "
                f"{self.min_np}"
            )
        if not self.need_publish:
            return None
        # Horovod's order: every worker gone, the reset limit, the training state.
        if not any(m.state == "running" for m in members):
            return Stop(EVERY_WORKER_FAILED)
        # (only a generation that replaces one that trained counts as a reset)
        trained_in_last = any(synced >= self.generation for synced in self.holders.values())
        resets = self.resets + trained_in_last
        if self.reset_limit is not None and resets > self.reset_limit:
            return Stop(RESET_LIMIT_EXCEEDED.format(resets=resets, limit=self.reset_limit))
        if self.trained and not any(self.holds(m) for m in members):
            return Stop(STATE_LOST.format(hosts=", ".join(m.host for m in members)))
        if total < self.min_np:
            return self._wait(now, total)
        self._short_since = None
        self.resets = resets
        if self.trained and not self.holds(members[0]):
            first = next(m for m in members if self.holds(m))
            members = [first, *(m for m in members if m is not first)]
        return self._publish(members)

    def _publish(self, members: list[Member]) -> Publish:
        slots = assign_slots([(m.host, 1) for m in members], len(members))
        for member, slot in zip(members, slots, strict=True):
            member.rank = slot.rank
        return Publish(members, slots)

    def published(self, generation: int) -> None:
        self.generation = generation
        self.need_publish = False

    def _wait(self, now: float, total: int) -> Decision:
        if self._short_since is None:
            self._short_since = now
            return Wait(
                f"{total} worker(s) left, min_num_proc is {self.min_np}: waiting up to "
                f"{self.elastic_timeout:g} s (elastic_timeout) for Spark to run more tasks"
            )
        if now - self._short_since > self.elastic_timeout:
            return Stop(
                f"only {total} worker(s) were available for longer than the elastic timeout "
                f"({self.elastic_timeout:g} s), fewer than min_num_proc {self.min_np}"
            )
        return Wait(None)
