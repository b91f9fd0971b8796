"""Handles of submitted operations, and Horovod's integer handles around them.

Every op submitted to the engine gets a :class:`Handle`: the engine completes it with a result
or an exception, from its own thread. The public ``*_async`` functions return an ``int``, as
Horovod's do; ``poll()``/``synchronize()`` look it up in a process-wide table.

An op on CUDA tensors finishes, for its waiter, in stream order, as torch's own
``Work.wait()`` does for NCCL: ``wait()`` returns once the engine is done with the op and
the caller's current stream waits for its kernels (the host does not), so the GPU runs on
through a training step. ``wait(host=True)`` blocks the host until the kernels finished, for
a reader outside torch's streams (TensorFlow through DLPack).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from collectives.engine import streams

__all__ = ["Handle", "lookup", "register", "release"]


class Handle:
    """The completion of one submitted operation."""

    __slots__ = ("_done", "_finished", "_flush", "cuda_event", "error", "result")

    def __init__(self, flush: Callable[[], None] | None = None) -> None:
        # A lock held until completion: far cheaper to create than a threading.Event, and
        # a handle is created for every op.
        self._done = threading.Lock()
        self._done.acquire()
        self._finished = False
        self._flush = flush
        self.result: Any = None
        self.error: BaseException | None = None
        # For ops on CUDA tensors: recorded after the last kernel that writes the output.
        self.cuda_event: Any = None

    @classmethod
    def finished(cls, result: Any) -> Handle:
        """A handle of an op that already finished (no lock to create)."""
        handle = cls.__new__(cls)
        handle._done = _RELEASED
        handle._finished = True
        handle._flush = None
        handle.result = result
        handle.error = None
        handle.cuda_event = None
        return handle

    def complete(self, result: Any = None, cuda_event: Any = None) -> None:
        if self._finished:
            return
        self.result = result
        self.cuda_event = cuda_event
        self._flush = None  # (a handle kept unsynchronized must not keep its engine alive)
        self._finished = True
        self._done.release()

    def fail(self, error: BaseException) -> None:
        """Completes the handle with an error (ignored if it already completed)."""
        if self._finished:
            return
        self.error = error
        self._flush = None
        self._finished = True
        self._done.release()

    def done(self) -> bool:
        """Whether the op finished (for CUDA: including its kernels). Never blocks.

        While the op runs, it gives up the GIL for a moment (``time.sleep(0)``): a thread
        that polls in a loop (``while not hvd.poll(h): pass``) would otherwise keep the GIL
        that the engine's thread needs to run the op, giving it up only at each switch
        interval (5 ms) for every one of the cycle's GIL-free calls (2-rank allreduces took
        50 ms each instead of 2-3 ms)."""
        if not self._finished:
            time.sleep(0)
            if not self._finished:
                return False
        event = self.cuda_event
        return event is None or bool(event.query())

    def wait(self, host: bool = False) -> Any:
        """Blocks until the op finished; returns its result or raises its error. A CUDA
        op's kernels are then ordered before the caller's current stream (``host``: finished
        on the device too)."""
        if not self._finished:
            if self._flush is not None:
                self._flush()  # the caller is blocked: negotiate now, not after the cycle time
            with self._done:  # released by the engine once the op finished
                pass
        if self.error is not None:
            raise self.error
        event = self.cuda_event
        if event is not None:
            if host:
                event.synchronize()
            else:
                streams.wait(event)
        return self.result


_RELEASED = threading.Lock()  # (never acquired: finished handles do not wait)
_table: dict[int, Handle] = {}
_ids = itertools.count(1)


def register(handle: Handle) -> int:
    """The integer Horovod-style id for a handle."""
    number = next(_ids)  # atomic under the GIL, as is the dict assignment
    _table[number] = handle
    return number


def lookup(number: int) -> Handle | None:
    return _table.get(number)


def release(number: int) -> Handle | None:
    """Removes and returns the handle (dict operations are atomic under the GIL)."""
    return _table.pop(number, None)
