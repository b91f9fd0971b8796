"""Who is in the job: registration, the slot table and its membership generations.

Why it looks the way it does:

* A worker registers with its ``(host, local_rank)`` and learns its place (its
  :class:`~rendezvous.slots.SlotInfo`) from the slot table the launcher gave the server. A
  host's relay registers all of its workers in one call.
* Elastic jobs change membership while they run: the launcher publishes generation after
  generation of the table (:meth:`Membership.publish`). A Register names the oldest
  generation it accepts and waits for it, so survivors of a failure simply re-register and
  wait for the launcher's next table; meanwhile their slots count as *waiting*, which is how
  the elastic driver tells survivors from hung workers (:meth:`Membership.waiting_slots`).
* Jobs another launcher placed (``placed_size``: srun, mpirun, a batch system) have no
  table in advance: each worker registers with the rank that launcher gave it, and once every
  rank has come, the table is derived from the hosts they came from and every waiting
  Register is answered at once (or told why the hosts did not add up).
* Blocked Register calls wait on one event that a publish, a derived table and the shutdown
  set and replace; each waiter then checks its own condition again. Those are rare events, so
  waking every waiter for each costs nothing worth a finer scheme.

Threads: every field of :class:`Membership` belongs to the server's asyncio loop. Register
calls, publish and shutdown all run there, so no lock guards them, and the launcher's threads
ask for :meth:`~Membership.registered_count` and :meth:`~Membership.waiting_slots` through the
loop (:class:`rendezvous.server.serving.RendezvousServer` does). By group:

* the table: ``_slots``, ``_generation`` -- loop-only; ``_elastic`` never changes;
* who registered: ``_registered``, ``_registered_generation``, ``_waiting`` -- loop-only;
* placed jobs: ``_placed``, ``_placed_since``, ``_placed_by``, ``_placed_calls``,
  ``_placed_slots``, ``_placed_error`` -- loop-only; ``_placed_size`` never changes;
* waking: ``_wake``, ``_shutdown`` -- loop-only; ``_on_table`` (a loop callback) never
  changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, NoReturn

import grpc

from rendezvous.server.common import (
    LOGGER_NAME,
    Refusal,
    ShuttingDown,
    check_timeout,
    list_ranks,
    quote,
    quote_keys,
    seconds,
)
from rendezvous.slots import SlotInfo, derive_slots

logger = logging.getLogger(LOGGER_NAME)

Slot = tuple[str, int]  # (host, local_rank)


class Place(NamedTuple):
    """A registered worker's place: its slot, in generation ``generation``."""

    slot: SlotInfo
    generation: int


def _table(slots: Sequence[SlotInfo]) -> dict[Slot, SlotInfo]:
    return {(slot.hostname, slot.local_rank): slot for slot in slots}


class Membership:
    """The job's slot table, its generations and who registered; see the module docstring.

    ``on_table`` is called on the loop when a placed job's table has been derived (the
    servicer wakes the Watch streams with it).
    """

    def __init__(
        self,
        slots: Sequence[SlotInfo],
        elastic: bool = False,
        placed_size: int | None = None,
        on_table: Callable[[], None] = lambda: None,
    ) -> None:
        self._slots = _table(slots)
        self._elastic = elastic
        self._generation = 0
        self._registered: set[Slot] = set()
        self._registered_generation: set[Slot] = set()  # of the newest generation
        self._waiting: dict[Slot, list[int]] = {}  # slot -> generations its Registers wait for
        # Jobs another launcher placed: their size, each rank's (host, local rank) as it
        # registered, and the table derived from those once every rank has.
        self._placed_size = placed_size
        self._placed: dict[int, tuple[str, int | None]] = {}
        # (when each rank first registered: a rank asks again while it waits, see
        # collectives.runtime.launched.join, and is told how long it has waited in all)
        self._placed_since: dict[int, float] = {}
        # (the process holding each rank, and how many of its Registers are open: another
        # process may take a rank over only from one that is neither in the job nor waiting)
        self._placed_by: dict[int, str] = {}
        self._placed_calls: dict[int, int] = {}
        self._placed_slots: list[SlotInfo] | None = None
        self._placed_error = ""
        self._wake: asyncio.Event | None = None  # set (and replaced) by _wake_all()
        self._shutdown: str | None = None  # what blocked Registers are told, once stopping
        self._on_table = on_table

    # ---- what the servicer and the launcher ask ------------------------------------------

    @property
    def generation(self) -> int:
        """The newest published generation (0 before the first, and in fixed jobs)."""
        return self._generation

    def size(self) -> int:
        return self._placed_size if self._placed_size is not None else len(self._slots)

    def check_ranks(self, ranks: Sequence[int]) -> None:
        """Refuses ranks outside the job (elastic jobs: only negative ones; the job grows)."""
        size = self.size()
        for rank in ranks:
            if rank < 0 or (not self._elastic and rank >= size):
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"rank {rank} is outside this job's ranks [0, {size})",
                )

    def registered_count(self) -> int:
        """How many distinct slots have registered (elastic: in the newest generation)."""
        # Only elastic jobs publish generations: otherwise this is every slot that registered.
        return len(self._registered_generation)

    def registered_slots(self) -> frozenset[Slot]:
        """The (host, local rank) slots that registered (elastic: in the newest generation)."""
        return frozenset(self._registered_generation)

    def waiting_slots(self) -> set[Slot]:
        """Slots whose Register waits for a generation newer than the newest."""
        newest = self._generation
        return {key for key, waits in self._waiting.items() if max(waits) > newest}

    # ---- changes -----------------------------------------------------------------------

    def publish(self, slots: Sequence[SlotInfo]) -> int:
        """Makes ``slots`` the newest generation and wakes the Registers waiting for it;
        returns its number."""
        self._generation += 1
        self._slots = _table(slots)
        self._registered_generation = set()
        self._wake_all()
        return self._generation

    def shut_down(self, message: str) -> None:
        """Fails every blocked Register, and every later one that would block, with
        UNAVAILABLE ``message``."""
        self._shutdown = message
        self._wake_all()

    # ---- registration ------------------------------------------------------------------

    async def register(
        self,
        host: str,
        local_rank: int,
        rank: int | None,
        min_generation: int,
        timeout_ms: int,
        size: int | None = None,
        process: str = "",
    ) -> Place:
        """One worker's Register: ``rank`` (and ``size``) are what another launcher gave it
        (placed jobs; ``process`` says which process registers); else it waits up to
        ``timeout_ms`` for ``min_generation`` to be published."""
        check_timeout(timeout_ms)
        if rank is not None or self._placed_size is not None:
            with self._holding(rank, process):
                slot = await self._register_placed(host, local_rank, rank, timeout_ms, size)
            return Place(slot, self._generation)
        if self._generation < min_generation:
            await self._wait_for_generation([(host, local_rank)], min_generation, timeout_ms)
        return self._register_slot(host, local_rank)

    async def register_host(
        self, host: str, local_ranks: list[int], min_generation: int, timeout_ms: int
    ) -> list[Place]:
        """A host's relay registers all of its workers at once."""
        check_timeout(timeout_ms)
        if self._placed_size is not None:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this job's ranks are assigned by the launcher that started the workers; "
                "they register one by one, with their ranks",
            )
        if len(set(local_ranks)) != len(local_ranks):
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"host {quote(host)}: a local rank is listed twice",
            )
        if self._generation < min_generation:
            keys = [(host, local_rank) for local_rank in local_ranks]
            await self._wait_for_generation(keys, min_generation, timeout_ms)
        return [self._register_slot(host, local_rank) for local_rank in local_ranks]

    def _register_slot(self, host: str, local_rank: int) -> Place:
        """Registers one slot of the newest generation and returns its place."""
        slot = self._slots.get((host, local_rank))
        if slot is None:
            if self._elastic:
                raise Refusal(
                    grpc.StatusCode.NOT_FOUND,
                    f"host {quote(host)} local_rank {local_rank} is not part "
                    f"of generation {self._generation} of this job (its host was removed)",
                )
            known = sorted({host for host, _ in self._slots})
            raise Refusal(
                grpc.StatusCode.NOT_FOUND,
                f"no slot for host {quote(host)} local_rank {local_rank} "
                f"in this job (hosts: {quote_keys(known)})",
            )
        first = (slot.hostname, slot.local_rank) not in self._registered
        self._registered.add((slot.hostname, slot.local_rank))
        self._registered_generation.add((slot.hostname, slot.local_rank))
        logger.debug(
            "%s rank %d (host %s, local_rank %d, generation %d)",
            "registered" if first else "re-registered",
            slot.rank,
            slot.hostname,
            slot.local_rank,
            self._generation,
        )
        return Place(slot, self._generation)

    async def _wait_for_generation(
        self, keys: Sequence[Slot], min_generation: int, timeout_ms: int
    ) -> None:
        """Blocks a Register until its generation is published; the slots count as waiting
        meanwhile (the elastic driver watches for survivors that wait)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        for key in keys:
            self._waiting.setdefault(key, []).append(min_generation)
        try:
            while self._generation < min_generation:
                if self._shutdown is not None:
                    raise ShuttingDown(self._shutdown)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise Refusal(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no membership generation {min_generation} was published "
                        f"within {seconds(timeout_ms)} (newest: {self._generation})",
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake_event().wait(), remaining)
        finally:
            for key in keys:
                waits = self._waiting.get(key, [])
                waits.remove(min_generation)
                if not waits:
                    self._waiting.pop(key, None)

    # ---- jobs another launcher placed --------------------------------------------------

    async def _register_placed(
        self, host: str, local_rank: int, rank: int | None, timeout_ms: int, size: int | None
    ) -> SlotInfo:
        """Register of a worker another launcher placed: waits until every rank has come,
        then answers with the slot derived from the hosts they came from. A rank given
        another job size than rank 0's fails the set-up on every rank."""
        given, size = size, self._placed_size
        if size is None or rank is None:
            who = "hvdrun" if size is None else "the launcher that started the workers"
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this job's ranks are assigned by {who}; this worker registered "
                + ("with a rank of its own" if size is None else "without its rank"),
            )
        if given is not None and given != size:
            self._refuse_sizes(host, rank, given, size)
        if not 0 <= rank < size:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {rank} is outside this job's ranks [0, {size})",
            )
        earlier = self._placed.get(rank)
        if earlier is not None and earlier[0] != host:
            raise Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"rank {rank} registered from host {quote(earlier[0])} and again from "
                f"{quote(host)}: the launcher started two processes with that rank",
            )
        loop = asyncio.get_running_loop()
        since = self._placed_since.setdefault(rank, loop.time())
        if self._placed_slots is None:
            self._placed[rank] = (host, local_rank if local_rank >= 0 else None)
            if len(self._placed) == size:
                self._complete_placed()
        deadline = loop.time() + timeout_ms / 1000
        while self._placed_slots is None:
            if self._shutdown is not None:
                raise ShuttingDown(self._shutdown)
            remaining = deadline - loop.time()
            if remaining <= 0:
                missing = [r for r in range(size) if r not in self._placed]
                raise Refusal(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{len(missing)} of {size} ranks did not register within "
                    f"{loop.time() - since:.3g} s: rank{'s' if len(missing) > 1 else ''} "
                    f"{list_ranks(missing)} (started late, or exited before hvd.init(): "
                    "the launcher's output says which)",
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_event().wait(), remaining)
        slots = self._placed_slots
        if not slots:  # the hosts' local ranks did not add up: every rank is told why
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, self._placed_error)
        self._registered.add((slots[rank].hostname, slots[rank].local_rank))
        self._registered_generation.add((slots[rank].hostname, slots[rank].local_rank))
        return slots[rank]

    @contextlib.contextmanager
    def _holding(self, rank: int | None, process: str) -> Iterator[None]:
        """A Register of ``rank`` by ``process``, open while inside: refused while another
        process holds the rank, one whose Register is open or that is in the job already
        (the table is made). A rank whose holder gave up (it died while waiting, a
        restarted pod) goes to the newcomer."""
        if rank is None:
            yield
            return
        holder = self._placed_by.get(rank, "")
        in_job = self._placed_slots is not None
        taken = in_job or self._placed_calls.get(rank, 0) > 0
        if process and holder not in ("", process) and taken:
            raise Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"rank {rank} is held by another process ({holder}), which "
                f"{'is in the job' if in_job else 'waits for it'}; this one ({process}) "
                "was started with the same rank: two jobs meet at one rendezvous address "
                "(give each its own MASTER_PORT or HVDRUN_RENDEZVOUS_PORT), or the launcher "
                "started two processes with that rank",
            )
        if process:
            self._placed_by[rank] = process
        self._placed_calls[rank] = self._placed_calls.get(rank, 0) + 1
        try:
            yield
        finally:
            self._placed_calls[rank] -= 1

    def _refuse_sizes(self, host: str, rank: int, given: int, size: int) -> NoReturn:
        """Ranks that disagree on the job's size cannot make one job: unless the table is
        already made (then only this Register is refused), every rank is told why."""
        message = (
            f"rank {rank} (host {quote(host)}) was started as one of {given} processes, but "
            f"rank 0 as one of {size}: the launcher gave the job's processes different job "
            "sizes (WORLD_SIZE or the like); start them all with the same size"
        )
        if self._placed_slots is None:
            self._placed_error = message
            self._placed_slots = []
            self._wake_all()
            logger.info("%s", message)
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, message)

    def _complete_placed(self) -> None:
        ranks = sorted(self._placed)
        try:
            slots = derive_slots(
                [self._placed[r][0] for r in ranks], [self._placed[r][1] for r in ranks]
            )
        except ValueError as error:
            self._placed_error = str(error)
            slots = []
        self._slots = _table(slots)
        self._placed_slots = slots
        self._wake_all()
        self._on_table()
        logger.info("every rank of %d registered; slot table derived", len(ranks))

    # ---- waking ------------------------------------------------------------------------

    def _wake_event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def _wake_all(self) -> None:
        """Wakes every blocked Register to check its condition again."""
        old, self._wake = self._wake, asyncio.Event()
        if old is not None:
            old.set()
