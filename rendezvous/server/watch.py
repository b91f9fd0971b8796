"""Watch streams: how running workers hear the server's heartbeat, new generations and the end.

Why it looks the way it does:

* A worker (or a host's relay, for all its ranks) holds one Watch stream open while it runs.
  It gets a HEARTBEAT at once and then every heartbeat interval, HOSTS_UPDATED with the
  number of each newly published generation, and SHUTDOWN with a message when the server
  stops. A client that hears nothing for a while knows the launcher is gone, even when the
  network was cut without closing anything.
* All streams beat together on one pulse: an event that one timer sets (and replaces) every
  interval, and that a publish or the shutdown sets at once. Thousands of streams cost one
  timer, not thousands; the timer runs only while some stream is open.
* The server's stop waits (boundedly) until every stream has sent its SHUTDOWN, so workers
  learn why the job ended instead of seeing a broken connection.
* Elastic jobs: every event carries the launcher's latest roll call (:meth:`Watches.call_roll`),
  which each worker answers once, so the launcher can tell a worker busy in its own code
  from a stopped one.

Threads: every field of :class:`Watches` belongs to the server's asyncio loop (the streams,
the timer's callback, publish and shutdown all run there), so no lock guards them:
``_pulse``, ``_timer``, ``_watching`` (rank -> its open streams), ``_left`` (the ranks whose
last stream ended), ``_open``, ``_closed``, ``_generation`` (the newest generation announced),
``_roll`` (the latest roll call) and ``_shutdown``. ``_interval`` never changes. Other
threads ask for :meth:`Watches.watching_ranks` and :meth:`Watches.left_ranks` through the
loop (:class:`rendezvous.server.serving.RendezvousServer` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence

from rendezvous import rendezvous_pb2
from rendezvous.server.common import LOGGER_NAME, list_ranks

logger = logging.getLogger(LOGGER_NAME)


class Watches:
    """The open Watch streams and the pulse they share; see the module docstring."""

    def __init__(self, heartbeat_interval: float) -> None:
        self._interval = heartbeat_interval
        # Set (and replaced) every heartbeat interval by the timer, and by beat(): all
        # streams wait for the same event, with no timer of their own.
        self._pulse: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watching: dict[int, int] = {}  # rank -> number of open streams
        self._left: set[int] = set()  # ranks whose last stream has ended
        self._open = 0  # sum(_watching.values()), kept so the timer need not add it up
        self._closed: asyncio.Event | None = None  # set while no stream is open
        self._generation = 0
        self._roll = 0
        self._shutdown: str | None = None  # the SHUTDOWN event's message, once stopping

    def beat(self) -> None:
        """Wakes every stream for its next event now."""
        old, self._pulse = self._pulse, None
        if old is not None:
            old.set()

    def announce(self, generation: int) -> None:
        """Generation ``generation`` is published: every stream sends HOSTS_UPDATED now."""
        self._generation = generation
        self.beat()

    def call_roll(self) -> int:
        """Every stream carries a new roll call now; returns its number."""
        self._roll += 1
        self.beat()
        return self._roll

    def shut_down(self, message: str) -> None:
        """Every stream sends SHUTDOWN with ``message`` and ends; later ones do at once."""
        self._shutdown = message
        self.beat()

    def watching_ranks(self) -> set[int]:
        """The ranks with an open stream."""
        return set(self._watching)

    def left_ranks(self) -> set[int]:
        """The ranks that held a stream and hold none now."""
        return self._left - self._watching.keys()

    async def wait_closed(self, timeout: float) -> None:
        """Waits (up to ``timeout``) until every stream has ended, i.e. sent SHUTDOWN."""
        if self._open == 0 or self._closed is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closed.wait(), timeout)

    async def events(self, ranks: Sequence[int]) -> AsyncGenerator[rendezvous_pb2.WatchEvent, None]:
        """The events of one stream for ``ranks``: a heartbeat at once and then every
        heartbeat interval, HOSTS_UPDATED after a publish, SHUTDOWN at the end."""
        for rank in ranks:
            self._watching[rank] = self._watching.get(rank, 0) + 1
        self._open += 1
        if self._closed is None:
            self._closed = asyncio.Event()
        self._closed.clear()
        logger.debug("rank(s) %s watching", list_ranks(ranks))
        kinds = rendezvous_pb2.WatchEvent
        try:
            sent = self._generation
            while self._shutdown is None:
                pulse = self._next_pulse()
                generation = self._generation
                kind = kinds.HOSTS_UPDATED if generation != sent else kinds.HEARTBEAT
                sent = generation
                yield rendezvous_pb2.WatchEvent(
                    kind=kind, generation=generation, roll_call=self._roll
                )
                await pulse.wait()
            yield rendezvous_pb2.WatchEvent(
                kind=kinds.SHUTDOWN, message=self._shutdown, generation=self._generation
            )
        finally:
            for rank in ranks:
                count = self._watching.get(rank, 0) - 1
                if count > 0:
                    self._watching[rank] = count
                else:
                    self._watching.pop(rank, None)
                    self._left.add(rank)
            self._open -= 1
            if self._open == 0:
                self._closed.set()
            logger.debug("rank(s) %s stopped watching", list_ranks(ranks))

    def _next_pulse(self) -> asyncio.Event:
        if self._pulse is None:
            self._pulse = asyncio.Event()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._interval, self._on_timer)
        return self._pulse

    def _on_timer(self) -> None:
        self._timer = None
        self.beat()
        if self._open > 0 and self._shutdown is None:
            self._timer = asyncio.get_running_loop().call_later(self._interval, self._on_timer)
