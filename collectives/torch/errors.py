"""Exceptions of the worker runtime, named as Horovod names them.

Training scripts (and Horovod's elastic mode) catch ``HorovodInternalError`` to tell "a peer
died or the network broke" apart from their own bugs, so every failure of a collective that
comes from the communication layer (a dead or hung peer, a rank that shut down, a stall
shutdown) is raised as that type. Mistakes in the program stay ``ValueError``/``TypeError``
so they are never mistaken for a recoverable peer failure: bad arguments raise at the call,
and ranks that submit the same named op with different shapes, dtypes, ops, roots, splits or
devices all get a :class:`TensorMismatchError` (a ``ValueError``) from ``synchronize()``.

A leaf: every layer raises these, so this module imports nothing of the package.
"""

from __future__ import annotations

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "NotInitializedError",
    "TensorMismatchError",
]


class HorovodInternalError(RuntimeError):
    """A collective failed inside the communication layer (typically: a peer went away)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by elastic jobs when the set of hosts changed (reserved for elastic mode)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts of this elastic job changed")
        self.skip_sync = skip_sync


class TensorMismatchError(ValueError):
    """Ranks submitted the same named operation with different arguments.

    Raised on every member rank of the operation; the message names the operation, the
    ranks and what differs. The job stays usable: later operations run normally.
    """


class NotInitializedError(ValueError):
    """An API that needs the runtime was called before ``hvd.init()``.

    A ``ValueError`` subclass because Horovod raises ``ValueError`` in this situation.
    """

    def __init__(self, what: str = "this function") -> None:
        super().__init__(
            f"hvdrun collectives are not initialized: call hvd.init() before using {what}"
        )
