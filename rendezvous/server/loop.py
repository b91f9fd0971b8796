"""The process's one asyncio loop for gRPC servers, in a daemon thread.

Why one loop for the whole process: grpc.aio binds its completion-queue poller to the loops
it serves and assumes they live as long as the process; a loop per server that is closed on
stop() leaves the poller dispatching late events to a closed loop. So every
:class:`~rendezvous.server.serving.RendezvousServer` in a process shares this loop, which is
started on first use and never closed.

It is also the one owner of every server's job state (see :mod:`rendezvous.server`): other
threads never touch that state, they hand a coroutine to :meth:`LoopThread.run` and wait
for its answer.

Threads: ``LoopThread._current`` (the process's loop thread) is touched only under
``LoopThread._lock``. An instance's ``pid``, ``loop`` and ``thread`` are set when it is made
and never change.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """The process's one asyncio loop for gRPC servers, in a daemon thread (see the module
    docstring): :meth:`get` it, then :meth:`run` coroutines on it from other threads."""

    _lock = threading.Lock()
    _current: LoopThread | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="hvdrun-rendezvous", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> LoopThread:
        with cls._lock:
            current = cls._current
            # A forked child inherits the object but not the thread: start a new one.
            if current is None or current.pid != os.getpid() or not current.thread.is_alive():
                current = cls._current = LoopThread()
            return current

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs ``coroutine`` on the loop and waits for its result (from another thread)."""
        if threading.current_thread() is self.thread:
            coroutine.close()
            raise RuntimeError("must not be called from the rendezvous server's own thread")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)
