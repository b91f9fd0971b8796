"""One process set's submitted ops: the queue between the callers and the set's cycles.

Any thread submits (:meth:`Submissions.add`) and gets the op's handle at once; the set's
cycle runner takes what was submitted at the start of each cycle (:meth:`Submissions.take`)
and removes ops from the in-flight table as they finish. The set's thread sleeps on the
queue's condition until the scheduler says a cycle is due.

Ownership: every field is read and written only with ``cond``'s lock held, by any thread:

* ``_new``: ops submitted since the last cycle took them (announced in the next round);
* ``_held``: ops a cache round held back because not every member had submitted them yet
  (see :mod:`.rounds`): the next cycle takes them again, before ``_new``;
* ``_local``: every op of this rank in flight, by (process set, name): submitted and not
  finished (ops in flight at the same time need different names);
* ``_first_new``, ``_last_submit``: when the oldest and the newest of ``_new`` came;
* ``_flush``: a thread waits on an op: the next cycle is due now;
* ``_woken``: the set's thread was notified of ops not yet in a cycle (notify once);
* ``_leaving``: this rank stops after its next cycle (shutdown, or its set was removed),
  and ``_leave_message``: why, when another set's end decided it (what its ops then say);
  ``_failure``: how its script failed, when it did (its last round tells the others);
* ``_abort``: the stall inspector gave up: the next round tells every rank;
* ``_error``: why this rank's collectives stopped; every later submission raises it;
* ``_running``: False once the set's negotiation stopped (failure, shutdown, removal).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from collectives.engine.handles import Handle
from collectives.engine.negotiation import FLAG_ABORT, FLAG_FAILED, FLAG_LEAVING
from collectives.engine.requests import Request
from collectives.engine.scheduler import Due, Pace, seconds_until_cycle
from collectives.errors import HorovodInternalError

__all__ = ["Submissions"]


class Submissions:
    """The queue of one process set on this rank (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # Critical sections take the lock itself (a C-level context manager: a lane checks
        # the queue on every op); waits and notifications go through the condition on it.
        self._lock = threading.Lock()
        self.cond = threading.Condition(self._lock)
        self._new: list[Request] = []
        self._held: list[Request] = []
        self._local: dict[tuple[int, str], Request] = {}
        self._first_new = 0.0
        self._last_submit = 0.0
        self._flush = False
        self._woken = False
        self._leaving = False
        self._leave_message = ""
        self._failure = ""
        self._abort = False
        self._error: HorovodInternalError | None = None
        self._running = True

    # ---- callers ---------------------------------------------------------------------

    def add(self, request: Request, blocking: bool) -> Handle:
        """Queues a request for the next cycle; raises if this rank cannot run ops any more.

        ``blocking``: the caller waits on the handle right away, and that wait runs the cycle
        (see ``Controller.flush``), so the set's thread is not woken: waking it costs a
        thread switch and a fight for the GIL on every synchronous op."""
        key = (request.process_set_id, request.name)
        with self._lock:
            if self._error is not None:
                raise HorovodInternalError(str(self._error))
            if self._leaving or not self._running:
                raise HorovodInternalError(
                    self._leave_message
                    or f"rank {self.rank}: hvdrun's collectives have been shut down; "
                    f"{request.label} cannot run"
                )
            if key in self._local:
                raise ValueError(
                    f"{request.label} is already in flight on rank {self.rank}: names of "
                    "ops that run at the same time must be unique (synchronize the first "
                    "one, or give this one another name)"
                )
            self._local[key] = request
            if not self._new:
                self._first_new = request.submitted
            if not blocking and not self._woken:
                self._woken = True
                self.cond.notify()
            self._new.append(request)
            self._last_submit = request.submitted
        return request.handle

    def runnable(self) -> bool:
        """Whether there are new ops and the set still runs (a waiting thread may cycle)."""
        with self._lock:
            return bool(self._new) and self._running

    def request_flush(self) -> None:
        """Someone waits for a result: the set's thread cycles now."""
        with self._lock:
            if not self._flush:
                self._flush = True
                self.cond.notify()

    def wake(self) -> None:
        """The set's thread must look at the schedule again (it is due sooner than planned)."""
        with self._lock:
            self.cond.notify_all()

    # ---- the cycle runner ------------------------------------------------------------

    def take(self) -> tuple[list[Request], list[Request], int]:
        """The ops held back by the last cycle, what was submitted since, and this cycle's
        flags."""
        with self._lock:
            held, self._held = self._held, []
            new, self._new = self._new, []
            self._flush = False
            self._woken = False
            flags = (FLAG_LEAVING if self._leaving else 0) | (FLAG_ABORT if self._abort else 0)
            if self._leaving and self._failure:
                flags |= FLAG_FAILED
        return held, new, flags

    def hold(self, requests: list[Request]) -> None:
        """Ops the cycle took but did not run (not every member had them yet): the next
        cycle takes them again. They stay in flight; the scheduler's pace for ops that wait
        on another member decides when that cycle comes (see :class:`Pace`)."""
        with self._lock:
            local = self._local  # (not those failed meanwhile)
            self._held = [r for r in requests if local.get((r.process_set_id, r.name)) is r]

    def idle(self) -> bool:
        """Nothing submitted, nothing in flight, running as usual (a lane may run)."""
        with self._lock:
            return not (
                self._new or self._local or not self._running or self._leaving or self._abort
            )

    def finished(self, requests: Iterable[Request]) -> None:
        """Ops that ran (or are about to complete) leave the in-flight table."""
        with self._lock:
            local = self._local
            for request in requests:
                local.pop((request.process_set_id, request.name), None)

    def pop(self, keys: Iterable[tuple[int, str]]) -> list[Request | None]:
        """This rank's requests of ops that became ready (None where it has none)."""
        with self._lock:
            local = self._local
            return [local.pop(key, None) for key in keys]

    def announce(self, request: Request) -> None:
        """A lane's op goes on through the full negotiation: it is in flight like any."""
        with self._lock:
            self._local[(request.process_set_id, request.name)] = request

    def request_abort(self) -> None:
        with self._lock:
            self._abort = True

    # ---- lifetime --------------------------------------------------------------------

    @property
    def running(self) -> bool:
        with self._lock:
            return self._running

    @property
    def error(self) -> HorovodInternalError | None:
        with self._lock:
            return self._error

    def leave(self, message: str = "", failure: str = "") -> None:
        """This rank's last cycle of the set announces that it leaves (``message``: why,
        for the set's ops, when it is not this rank's shutdown; ``failure``: how its
        script failed, when it did, which the others are told)."""
        with self._lock:
            self._leaving = True
            self._failure = self._failure or failure
            self._leave_message = self._leave_message or message
            self.cond.notify_all()

    @property
    def leave_message(self) -> str:
        with self._lock:
            return self._leave_message

    @property
    def failure(self) -> str:
        """How this rank's script failed, when it leaves because it did ("" otherwise)."""
        with self._lock:
            return self._failure

    def fail(
        self,
        message: str,
        also: Iterable[Request] = (),
        error_for: Callable[[Request], BaseException] | None = None,
    ) -> None:
        """Stops the set: every op in flight (and ``also``) fails, with a
        HorovodInternalError saying ``message`` unless ``error_for`` makes another; later
        submissions raise that HorovodInternalError."""
        with self._lock:
            if self._error is None:
                self._error = HorovodInternalError(message)
            self._running = False
            pending = [*self._local.values(), *self._new]
            self._local.clear()
            self._new = []
            self._held = []
            self.cond.notify_all()
        for request in (*pending, *also):
            error = HorovodInternalError(message) if error_for is None else error_for(request)
            request.handle.fail(error)

    def fail_pending(self, error_for: Callable[[Request], BaseException]) -> None:
        """Fails every op in flight (``error_for`` makes each one's error) without
        stopping the set."""
        with self._lock:
            pending = [*self._local.values(), *self._new]
            self._local.clear()
            self._new = []
            self._held = []
        for request in pending:
            request.handle.fail(error_for(request))

    # ---- the set's thread ------------------------------------------------------------

    def _due(self) -> Due:
        return Due(
            self._leaving or self._abort,
            bool(self._new),
            self._flush,
            self._first_new,
            self._last_submit,
        )

    def wait_until_due(self, pace: Callable[[], Pace]) -> bool:
        """Blocks until a cycle is due (``pace``: the runner's latest snapshot); False once
        the set stopped."""
        with self._lock:
            while self._running:
                remaining = seconds_until_cycle(self._due(), pace(), time.monotonic())
                if remaining <= 0:
                    return True
                self.cond.wait(remaining)
            return False

    def due_now(self, pace: Pace) -> bool:
        """Whether a cycle is still due (checked again once the cycle lock is held)."""
        with self._lock:
            return self._running and seconds_until_cycle(self._due(), pace, time.monotonic()) <= 0
