"""The rejoin window of an elastic job: which members fail for not rejoining the others.

When a collective fails, the survivors restore their last commit and wait (in Register) for
the next generation. A member that does not join them is either hung (stopped, stuck where
not even its threads run, cut off) or busy in its own code (a long step, a checkpoint, an
evaluation) and will come once its next collective fails. The launcher tells them apart by
calling the roll on the members' watch streams: every worker answers from its watch thread,
which runs while its script works (``worker_env.PRESENT_KEY_PREFIX``).

* A member that does not answer fails at the end of the window (``timeout``, twice the Gloo
  timeout): hung.
* A member that answers gets until ``long_timeout`` (the elastic timeout) from the window's
  start; the roll is called again at each check, so one that stops answering fails at the
  next.
* When every member waits, nobody is hung: the next generation is due (a transient error).

Both elastic drivers use it (hvdrun's, ``launcher.supervision``, and Spark's,
``collectives.spark``); a caller says what its members are and lets the window call the
roll when due (:meth:`RejoinWindow.call_roll_if_due`). Not thread-safe: its driver's
thread owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

__all__ = ["RejoinWindow"]

M = TypeVar("M")


class RejoinWindow(Generic[M]):
    """See the module docstring."""

    def __init__(self, timeout: float, long_timeout: float) -> None:
        self.timeout = timeout
        self.long_timeout = long_timeout
        #: The latest roll call's number, and whether the next is due (see
        #: :meth:`call_roll_if_due`).
        self.roll = 0
        self.roll_due = False
        self._since: float | None = None  # when some member began to wait for the others
        self._checked_at = 0.0

    def call_roll_if_due(self, call_roll: Callable[[], int]) -> None:
        """Calls the roll (``call_roll``: the server's, which returns its number) where
        :meth:`late` said it is due: workers busy in their own code answer it."""
        if self.roll_due:
            self.roll, self.roll_due = call_roll(), False

    def close(self) -> None:
        """Nobody waits for the others (any more): the window closes."""
        self._since = None

    def late(
        self,
        now: float,
        waiting: bool,
        members: Sequence[M],
        rejoined: Callable[[M], bool],
        workers: Callable[[M], Iterable[int]],
        present: Callable[[int], set[int]],
    ) -> list[tuple[M, bool]] | None:
        """The members that fail for not rejoining the others (``waiting``: some worker
        waits for the next generation; ``rejoined``: all of a member's do), each with
        whether its ``workers`` answer the roll (``present``: the workers that answered
        roll call N); None when every member waits."""
        if not waiting:
            self._since = None
            return []
        absent = [member for member in members if not rejoined(member)]
        if not absent:
            self._since = None
            return None
        if self._since is None:
            self._since = self._checked_at = now
            self.roll_due = True
        if now - self._checked_at < self.timeout:
            return []
        answered = present(self.roll)
        over = now - self._since >= self.long_timeout
        late = [(member, all(w in answered for w in workers(member))) for member in absent]
        failed = [(member, answers) for member, answers in late if over or not answers]
        self._checked_at, self.roll_due = now, True
        if failed:
            self._since = None
        return failed

    def failure(self, answered: bool, stopped: int | None = None) -> str:
        """Why a member that did not rejoin fails; ``stopped``: its worker seen stopped."""
        if answered:
            return (
                f"its workers did not rejoin within {self.long_timeout:g} s (the elastic "
                "timeout) after the others' collectives failed, though they answer: a step "
                "of their own that long, or a script stuck in its own code"
            )
        return (
            f"its workers did not rejoin within {self.timeout:g} s after the others' "
            "collectives failed: "
            + ("hung or cut off" if stopped is None else f"worker {stopped} is stopped")
        )
