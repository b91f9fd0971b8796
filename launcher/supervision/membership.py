"""Who is in an elastic job: the decisions of the elastic driver, free of processes and I/O.

:class:`Membership` keeps one :class:`HostRecord` per host incarnation (an agent started on
a host, until it is gone) and decides, from discovery's latest answer, the blacklist and the
survivors waiting at the rendezvous, which hosts to start, which to drop, and when the next
membership generation is due (see :mod:`launcher.supervision.elastic` for how the driver
carries that out). Hosts keep the order in which they joined, so older hosts get the low ranks.
A host runs as many of the slots discovery lists for it as ``--max-np`` leaves, settled when
its workers start (its agent starts them once): until then a host capped by ``--max-np``
takes more of its slots as others free them, oldest first; from then on its count is fixed.

A record's state: ``starting`` (its agent is being started), ``ready`` (agent up, no workers
yet), ``running`` (its workers belong to the job), then ``removed`` (discovery dropped it),
``failed`` or ``done``.

The training state lives in the workers' memory only. A worker *holds* it once it synced it
in a generation (``hvd.elastic.run`` reports that right after the sync, see
``worker_env.STATE_KEY_PREFIX``; the driver reads the reports afresh before every decision);
brand-new workers hold nothing until then. So a generation never starts without a holder
(rank 0, from which every other rank syncs, is put on a holder's host). The workers of a
removed host leave only at the commit that switches generations, so they still hold the
state until the next generation is published: when a removal would leave the members without
a holder while the current generation's sync is under way (the new members are receiving
the state from the removed host's workers), the decision waits for that sync, up to
:data:`SYNC_WAIT`. Only when no worker that ever held the state is alive does the job stop
as *lost*; when the only holders are leaving and the members left did not receive the state,
it stops saying so. Either way it never trains on from the initial state.

Only a generation that replaces one in which the state was synced counts as a reset: a
generation that never trained cost nothing. The checks come in Horovod's order: every
worker gone, then the reset limit, then the state. The first generation waits a short start
window for every host discovery listed, so that hosts that come up a moment apart start
together; a later generation, once due, waits as long for a host still starting that would
join it (a spare started in place of a failed host), so that a failure and the host that
fills its slots cost one reset, as in Horovod, which starts the spare's workers in that
reset. Where no host is starting, nothing waits.

Threads: nothing here locks. :class:`Membership` and every :class:`HostRecord` belong to the
elastic driver's main loop, which alone reads and writes them; the driver's other threads
(discovery, agent start-up) report through its event queue instead (see
:mod:`launcher.supervision.elastic`). A record's ``agent`` is set by the main loop too, when
it hears that the agent was made, so it stays None while the agent is being created.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from launcher.spec.hosts import HostSpec
from launcher.spec.options import ElasticOptions
from launcher.supervision.discovery import Blacklist
from launcher.supervision.report import HOROVOD_FAILED
from rendezvous.rejoin import RejoinWindow
from rendezvous.slots import SlotInfo, assign_slots

ACTIVE = ("starting", "ready", "running")
UNLAUNCHED = ("starting", "ready")  # active, and its workers not started yet
#: A generation that is due waits this long (from when it has enough slots) for the hosts
#: still starting that would join it, so that they start together (the first generation) or
#: join in the same reset (a later one).
START_WINDOW = 5.0
#: Horovod's words where users match on them, then hvdrun's own.
EVERY_WORKER_FAILED = (
    f"{HOROVOD_FAILED}\n"
    "every worker of the elastic job has failed or left, and its training state with them; "
    "stopping the job"
)
EVERY_HOST_REMOVED = (
    "discovery has listed none of the elastic job's hosts for longer than --elastic-timeout "
    "({timeout:g} s): its workers are gone, and its training state with them; stopping the job"
)
RESET_LIMIT_EXCEEDED = (
    "Horovod was shutdown because number of resets during elastic job exceeded limit: "
    "{limit}\n"
    "the elastic job would need reset {resets}, more than --reset-limit {limit}; stopping "
    "the job"
)
STATE_LOST = (
    "the training state is lost: every worker that held it is gone, and the workers left "
    "({hosts}) never received it; stopping the job rather than training on from the "
    "initial state"
)
#: A removal that would leave the members without a holder of the training state waits this
#: long for the sync under way (new workers start, import their framework, bootstrap and
#: receive the state from the removed host's workers, which stay until it is done).
SYNC_WAIT = 60.0
SYNC_WAITING = (
    "the workers on {hosts} are still receiving the training state from {leaving}, which "
    "discovery removed: the removal waits for them to hold it (up to {wait:g} s)"
)
#: How long the workers of a host that discovery removed get to leave by themselves (their
#: engine's last cycle, then a registration that tells them to exit 0) once a generation
#: without them is complete or the job has finished, before their agent stops them.
LEAVE_GRACE = 10.0
STATE_NOT_HANDED_ON = (
    "No hosts from previous set remaining, unable to broadcast state.\n"
    "only the workers on {leaving}, which discovery removed, hold the training state, and the "
    "hosts left ({hosts}) {received}; stopping the job rather than training on from the "
    "initial state"
)


@dataclass
class HostRecord:
    name: str
    slots: int  # its workers: as many of ``offered`` as --max-np leaves it
    order: int  # when it joined: older hosts get the lower ranks
    state: str = "starting"
    agent: Any = None  # its AgentConnection, from when the main loop hears it was made
    workers: dict[int, int] = field(default_factory=dict)  # worker number -> local rank
    exits: dict[int, int] = field(default_factory=dict)
    agent_finished: bool = False
    terminated: bool = False
    removed_in: int | None = None  # the last generation it was a member of, once removed
    leave_by: float | None = None  # removed: when its agent is stopped if workers still run
    #: The slots discovery lists for it (0: ``slots``), followed until its workers start.
    offered: int = 0

    def __post_init__(self) -> None:
        self.offered = self.offered or self.slots

    @property
    def agent_alive(self) -> bool:
        """Its agent was started and has not finished (or been given up on)."""
        return self.agent is not None and not self.agent_finished

    def stop_agent(self) -> None:
        """Asks its agent to stop its workers. An agent that was never launched has none,
        and what it says would reach no one (a connection hands on events once launched):
        it is closed (it exits at the end of its input) and counted finished at once."""
        if not self.agent_alive:
            return
        if self.workers:
            self.agent.terminate()
        else:
            self.agent.close()
            self.agent_finished = True

    def all_exited(self) -> bool:
        return bool(self.workers) and len(self.exits) == len(self.workers)

    def slot_keys(self) -> set[tuple[str, int]]:
        return {(self.name, local) for local in range(self.slots)}

    def live_workers(self) -> list[int]:
        """The numbers of its workers that have not exited."""
        return [worker for worker in self.workers if worker not in self.exits]


@dataclass
class Publish:
    """Publish these slots as the next generation; start workers on the ``ready`` members."""

    members: list[HostRecord]
    slots: list[SlotInfo]


@dataclass
class Wait:
    """Not yet: too few slots (wait for discovery), or a removal waits for the sync under way
    (``message`` is said once, when waiting starts)."""

    message: str | None


@dataclass
class Stop:
    """The job cannot go on."""

    message: str


Decision = Publish | Wait | Stop | None


class Membership:
    """The elastic job's hosts, and what to do next about them."""

    def __init__(self, options: ElasticOptions, num_proc: int, rejoin_timeout: float) -> None:
        self.options = options
        self.num_proc = num_proc
        self.hosts: dict[str, HostRecord] = {}
        self.retired: list[HostRecord] = []  # earlier incarnations whose agents may still run
        self.blacklist = Blacklist(options.cooldown)
        self.discovered: list[HostSpec] = []
        self.generation = 0
        self.resets = 0
        self.need_publish = False
        #: worker number -> the generation it last synced the training state in (reports)
        self.holders: dict[int, int] = {}
        self.trained = False  # some worker has held the training state
        self._enough_since: float | None = None  # the generation due had enough slots
        self._short_since: float | None = None
        self.rejoin: RejoinWindow[HostRecord] = RejoinWindow(
            rejoin_timeout, options.elastic_timeout
        )
        self._sync_since: float | None = None  # a removal waits for the sync under way
        #: Since when discovery has listed none of the job's hosts while they hold the state.
        self.unlisted_since: float | None = None
        self._replace_since: float | None = None  # unlisted holders wait for replacements
        self._slots_said: dict[str, int] = {}  # host -> the changed slot count noted
        self._said_short = False  # the wait for --min-np slots was announced
        self._lost_to_removal = False  # the last running host went by discovery, not failure
        self._orders = itertools.count()

    def all_hosts(self) -> list[HostRecord]:
        return [*self.retired, *self.hosts.values()]

    def running(self) -> list[HostRecord]:
        return [h for h in self.hosts.values() if h.state == "running"]

    def find(self, name: str, order: int | None) -> HostRecord | None:
        """The record an event of host ``name`` (incarnation ``order``, if known) is about."""
        for host in [*self.hosts.values(), *self.retired]:
            if host.name == name and (order is None or order == host.order):
                return host
        return None

    def find_agent(self, name: str, agent: Any) -> HostRecord | None:
        """The record of host ``name`` whose agent is ``agent`` (the connection an event came
        from), None where none is: a removed host's agent that reports its end after the
        host was started again must not end the new one's agent. (No ``agent``: the record
        of that name.)"""
        if agent is None:
            return self.find(name, None)
        for host in [*self.hosts.values(), *self.retired]:
            if host.name == name and host.agent is agent:
                return host
        return None

    def note_holders(self, holders: dict[int, int]) -> None:
        """The workers' latest reports of holding the training state."""
        self.holders = holders
        self.trained = self.trained or bool(holders)

    def holds(self, host: HostRecord) -> bool:
        """Whether a live worker of the host holds the training state."""
        return any(worker in self.holders for worker in host.live_workers())

    def trained_in(self, generation: int) -> bool:
        """Whether the state was synced in ``generation`` (or later): it trained."""
        return any(synced >= generation for synced in self.holders.values())

    def leaving_holders(self) -> list[HostRecord]:
        """Removed hosts still in the current generation whose live workers hold the state:
        they leave at the commit that switches generations, so a member can still sync
        from them until the next one is published."""
        return [
            h
            for h in self.all_hosts()
            if h.state == "removed"
            and h.removed_in == self.generation
            and h.agent_alive
            and self.holds(h)
        ]

    def ready(self, host: HostRecord) -> None:
        """The host's agent is up: it joins with the next generation."""
        host.state = "ready"
        self.need_publish = True

    def fail(self, host: HostRecord, now: float) -> float | None:
        """Marks the host failed and blacklists it; returns the cooldown in seconds, or None
        for good."""
        if host.state in ("ready", "running"):
            self.need_publish = True
            self._lost_to_removal = False
        host.state = "failed"
        return self.blacklist.add(host.name, now)

    def drop_undiscovered(self, now: float) -> list[HostRecord]:
        """Hosts discovery no longer lists: removed (gracefully, for running ones)."""
        listed = {spec.hostname for spec in self.discovered}
        unlisted = [h for h in self.hosts.values() if h.state in ACTIVE and h.name not in listed]
        if self._keeps(unlisted, now):
            return []
        for host in unlisted:
            if host.state == "running":
                self.need_publish = True
                self._lost_to_removal = True
                host.removed_in = self.generation
            host.state = "removed"
        return unlisted

    def _replacing(self, staying: list[HostRecord], now: float) -> bool:
        """Whether hosts that can take over from the unlisted ones are on their way (started
        and not running yet, or listed and free to start under --max-np), for up to
        :data:`SYNC_WAIT` seconds."""
        coming = any(h.state in UNLAUNCHED for h in staying)
        if not (coming or (self._capacity() > 0 and self._startable(now))):
            self._replace_since = None
            return False
        if self._replace_since is None:
            self._replace_since = now
        return now - self._replace_since < SYNC_WAIT

    def notices(self, before: float | None, dropped: list[HostRecord]) -> list[str]:
        """What to say after :meth:`drop_undiscovered` (``before``: ``unlisted_since``
        before it): that the job's hosts stay although discovery lists none, or that it lists
        them again; and, once per count, that a running host is listed with other slots than
        when its workers started."""
        said = []
        if before is None and self.unlisted_since is not None:
            said.append(
                "discovery lists none of the job's hosts: they keep running, with the training "
                "state, until it lists hosts again (for up to --elastic-timeout "
                f"{self.options.elastic_timeout:g} s)"
            )
        elif before is not None and self.unlisted_since is None and not dropped:
            said.append("discovery lists hosts again; the job goes on")
        for spec in self.discovered:
            host = self.hosts.get(spec.hostname)
            if host is None or host.state != "running" or spec.slots == host.offered:
                self._slots_said.pop(spec.hostname, None)
            elif self._slots_said.get(spec.hostname) != spec.slots:
                self._slots_said[spec.hostname] = spec.slots
                said.append(
                    f"discovery lists host {spec.hostname} with {spec.slots} slot(s); it keeps "
                    f"the {host.slots} it started with while its workers run (a changed count "
                    "applies when the host joins again)"
                )
        return said

    def _keeps(self, unlisted: list[HostRecord], now: float) -> bool:
        """Whether the unlisted hosts stay for now. Where discovery lists none of the job's
        hosts, and none that could take their place, removing them would end the job and
        its training state, so its running hosts stay until discovery lists a host again
        (a discovery script that failed for a moment) or --elastic-timeout has passed. Where
        the hosts that replace them are still starting, they stay until those run."""
        active = [h for h in self.hosts.values() if h.state in ACTIVE]
        running = any(h.state == "running" for h in unlisted)
        staying = [h for h in active if h not in unlisted]
        if running and not any(self.holds(h) for h in staying):
            # The unlisted hosts hold the state and nobody else does: where hosts to replace
            # them are on their way (a node swapped for another in one go), they stay until
            # those run, so that the state can reach them.
            if self._replacing(staying, now):
                self.unlisted_since = None
                return True
        else:
            self._replace_since = None
        if not running or staying or self._startable(now):
            self.unlisted_since = None
            return False
        if self.unlisted_since is None:
            self.unlisted_since = now
        return now - self.unlisted_since <= self.options.elastic_timeout

    def retire_finished(self) -> None:
        for name, host in list(self.hosts.items()):
            if host.state not in ACTIVE:
                del self.hosts[name]
                self.retired.append(host)
        self.retired = [h for h in self.retired if h.agent_alive]

    def _startable(self, now: float) -> list[HostSpec]:
        """Discovered hosts that are not in the job and not blacklisted (in discovery's order)."""
        return [
            spec
            for spec in self.discovered
            if spec.hostname not in self.hosts and not self.blacklist.blocked(spec.hostname, now)
        ]

    def _capacity(self) -> int:
        """The slots --max-np leaves for more hosts."""
        limit = self.options.max_np
        used = sum(h.slots for h in self.hosts.values() if h.state in ACTIVE)
        return (limit if limit is not None else 1 << 30) - used

    def hosts_to_start(self, now: float) -> list[HostRecord]:
        """New records for discovered hosts that fit under --max-np (in discovery's order),
        once the hosts already started have had their share (:meth:`_refit_unlaunched`)."""
        capacity = self._refit_unlaunched()
        started = []
        for spec in self._startable(now):
            if capacity <= 0:
                break
            name = spec.hostname
            if any(h.name == name for h in self.retired):
                continue  # its previous agent is still shutting down
            slots = min(spec.slots, capacity)
            host = HostRecord(name, slots, next(self._orders), offered=spec.slots)
            capacity -= host.slots
            self.hosts[name] = host
            started.append(host)
        return started

    def _refit_unlaunched(self) -> int:
        """Fits the hosts whose workers have not started yet, oldest first, to the slots
        discovery lists for them now and to what --max-np leaves: one that --max-np capped
        takes more of its slots once others freed them. (A running host keeps its workers:
        its agent starts them once.) Returns the slots --max-np still leaves."""
        listed = {spec.hostname: spec.slots for spec in self.discovered}
        capacity = self._capacity()
        for host in sorted(self.hosts.values(), key=lambda h: h.order):
            if host.state in UNLAUNCHED:
                host.offered = listed.get(host.name, host.offered)
                fitted = min(host.offered, host.slots + capacity)
                capacity -= fitted - host.slots
                host.slots = fitted
        return capacity

    def rejoin_failures(
        self, now: float, waiting: Iterable[tuple[str, int]], present: Callable[[int], set[int]]
    ) -> list[tuple[HostRecord, bool]]:
        """Members that fail for not joining the survivors of a failed collective (waiting
        for the next generation), each with whether its workers answer the roll call (see
        :class:`rendezvous.rejoin.RejoinWindow`). When every member waits (a transient
        error), the next generation is simply due."""
        if self.generation == 0 or self.need_publish:
            self.rejoin.close()
            return []
        running = self.running()
        waits = set(waiting)
        late = self.rejoin.late(
            now,
            any(key in waits for host in running for key in host.slot_keys()),
            running,
            lambda host: host.slot_keys() <= waits,
            HostRecord.live_workers,
            present,
        )
        if late is None:
            self.need_publish = True
            return []
        return late

    def decide(self, now: float) -> Decision:
        """Whether the next generation is due, must wait for slots, or cannot come."""
        members = sorted(
            (h for h in self.hosts.values() if h.state in ("ready", "running")),
            key=lambda h: h.order,
        )
        total = sum(h.slots for h in members)
        starting = any(h.state == "starting" for h in self.hosts.values())
        min_np = self.options.min_np
        if self.generation == 0:
            # The first one: -np slots, or every host discovery offered (at least --min-np);
            # hosts still starting get a short window to join it.
            if total < min_np or (starting and (total < self.num_proc or self._window(now))):
                return self._wait(now, total, starting)
        elif not self.need_publish:
            return None
        else:
            judged = self._judge(now, members)
            if judged is not None:
                return judged
            if total < min_np:
                return self._wait(now, total, starting)
            if starting and self._window(now):
                return Wait(None)  # (it joins this generation if it is up in time)
        self._short_since = self._sync_since = self._enough_since = None
        self.resets = self._resets_with_next()
        if self.trained and not self.holds(members[0]):
            # Every rank syncs from rank 0, on the first member: the oldest holder.
            first = next(h for h in members if self.holds(h))
            members = [first, *(h for h in members if h is not first)]
        return Publish(members, slot_table(members))

    def _resets_with_next(self) -> int:
        """The resets once the next generation is published: it is one if it replaces a
        generation that trained."""
        return self.resets + (self.generation > 0 and self.trained_in(self.generation))

    def _judge(self, now: float, members: list[HostRecord]) -> Decision:
        """Whether a later generation can come at all, in Horovod's order: every worker gone,
        then the reset limit, then the training state (None: it can)."""
        running = [h for h in members if h.state == "running"]
        left = [h for h in self.hosts.values() if h.state in ACTIVE]  # starting ones too
        leaving = self.leaving_holders() if self.trained and left else []
        if not running and not leaving:
            if self._lost_to_removal:
                return Stop(EVERY_HOST_REMOVED.format(timeout=self.options.elastic_timeout))
            return Stop(EVERY_WORKER_FAILED)
        limit = self.options.reset_limit
        resets = self._resets_with_next()
        if limit is not None and resets > limit:
            return Stop(RESET_LIMIT_EXCEEDED.format(limit=limit, resets=resets))
        if not self.trained or any(self.holds(h) for h in members):
            self._sync_since = None
            return None
        if not leaving:
            return Stop(STATE_LOST.format(hosts=", ".join(h.name for h in members)))
        # No member holds the state, but the leaving holders are still in the current
        # generation: its running members are receiving the state from them (or will, once
        # the generation has bootstrapped).
        names = ", ".join(h.name for h in leaving)
        if running:
            if self._sync_since is None:
                self._sync_since = now
                syncing = ", ".join(h.name for h in running)
                return Wait(SYNC_WAITING.format(hosts=syncing, leaving=names, wait=SYNC_WAIT))
            if now - self._sync_since < SYNC_WAIT:
                return Wait(None)
            received = f"did not receive it within {SYNC_WAIT:g} s"
        else:
            received = "had no worker running yet to receive it"
        hosts = ", ".join(h.name for h in left)
        return Stop(STATE_NOT_HANDED_ON.format(leaving=names, hosts=hosts, received=received))

    def _window(self, now: float) -> bool:
        """Whether the start window of the generation that is due (from when it had enough
        slots) is still open."""
        if self._enough_since is None:
            self._enough_since = now
        return now - self._enough_since < START_WINDOW

    def published(self, generation: int) -> None:
        self.generation = generation
        self.need_publish = False

    def _wait(self, now: float, total: int, starting: bool) -> Decision:
        timeout = self.options.elastic_timeout
        if self._short_since is None:
            self._short_since = now
            self._said_short = False
        waited = now - self._short_since
        if waited > timeout:
            return Stop(
                f"only {total} slot(s) were available for longer than the elastic timeout "
                f"({timeout:g} s), fewer than --min-np {self.options.min_np}; stopping the job"
            )
        if starting or self._said_short:  # (hosts still starting may bring the slots)
            return Wait(None)
        self._said_short = True
        return Wait(
            f"{total} slot(s) available, --min-np is {self.options.min_np}: waiting up "
            f"to {timeout - waited:.3g} s for more hosts"
        )

    def removed_to_stop(self, registered: int | None, now: float) -> list[HostRecord]:
        """Removed hosts whose agents are to be stopped now. Once a generation without them
        is published and complete (``registered`` workers of it have registered; None: the
        job has finished), their workers have passed the commit that switched generations
        and leave by themselves (exit 0 at their next registration): each such host gets
        :data:`LEAVE_GRACE` seconds for that, and its agent is stopped when its workers
        have all exited or the grace is over. (Until that generation is published they still
        train, and may still hand the state on.)"""
        complete = registered is None or registered >= sum(h.slots for h in self.running())
        stop = []
        for host in self.retired:
            if host.state != "removed" or host.terminated:
                continue
            if host.leave_by is None and complete:
                passed = host.removed_in is None or host.removed_in < self.generation
                if registered is None or passed:
                    host.leave_by = now + LEAVE_GRACE
            if host.leave_by is not None and (
                now >= host.leave_by or host.all_exited() or not host.workers
            ):
                host.terminated = True
                if host.agent is not None:
                    stop.append(host)
        return stop

    def still_leaving(self) -> bool:
        """Whether a removed host's workers are still leaving within their grace."""
        return any(
            h.state == "removed" and not h.terminated and h.agent_alive for h in self.retired
        )


def slot_table(hosts: list[HostRecord]) -> list[SlotInfo]:
    """The ranks of a generation of ``hosts`` (in that order), each with its slots."""
    total = sum(h.slots for h in hosts)
    return assign_slots([(h.name, h.slots) for h in hosts], total) if total else []


def first_generation(
    options: ElasticOptions, num_proc: int, discovered: list[HostSpec]
) -> list[SlotInfo]:
    """The ranks of an elastic job's first generation when every host of discovery's answer
    comes up in time (what ``--dry-run`` shows): the driver's own decisions, taken on a
    membership of their own. Where those hosts offer fewer than --min-np slots, the job waits
    for more; these are the slots it has meanwhile."""
    members = Membership(options, num_proc, rejoin_timeout=0.0)
    members.discovered = discovered
    started = members.hosts_to_start(0.0)
    for host in started:
        members.ready(host)
    decision = members.decide(0.0)
    return decision.slots if isinstance(decision, Publish) else slot_table(started)
