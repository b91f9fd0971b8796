"""Exceptions of the worker runtime, named as Horovod names them.

Two families, which a training script (and elastic mode) must be able to tell apart:

* :class:`HorovodInternalError`: the communication layer failed (a peer died or hung, a rank
  shut down, the stall inspector gave up). Elastic mode restores the last commit and carries
  on with the surviving ranks.
* :class:`CollectiveError`: the ranks' *program* is at fault, so retrying cannot help and
  elastic mode lets it propagate: ranks submitted the same named op with different shapes,
  dtypes, ops, roots, splits or devices (:class:`TensorMismatchError`); an op that
  ``hvd.join()`` does not support was called while a rank had joined
  (:class:`NotSupportedWithJoinError`); alltoall splits that are not integers
  (:class:`InvalidSplitsError`). Negotiation raises the first two on every member rank that
  submitted the op, from ``synchronize()``; the job stays usable.

Both derive from ``RuntimeError``: Horovod raises ``RuntimeError`` (its
``HorovodInternalError``) for mismatches and join conflicts, and scripts catch that. Mistakes
one rank can see alone (a bad argument, a root that is not in the process set) raise
``ValueError``/``TypeError`` at the call, as Horovod's argument checks do.

A leaf: every layer raises these, so this module imports nothing of the package.
"""

from __future__ import annotations

import traceback

__all__ = [
    "CollectiveError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "InvalidArgumentsError",
    "InvalidSplitsError",
    "JobSetupError",
    "NotInitializedError",
    "NotSupportedWithJoinError",
    "SettingsMismatchError",
    "SharedGpuError",
    "TensorMismatchError",
]


class HorovodInternalError(RuntimeError):
    """A collective failed inside the communication layer (typically: a peer went away)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by elastic jobs when the set of hosts changed (reserved for elastic mode)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts of this elastic job changed")
        self.skip_sync = skip_sync


class CollectiveError(RuntimeError):
    """An op that cannot run as the ranks submitted it: a bug in the program, not a lost
    peer (never a :class:`HorovodInternalError`). Later ops run normally."""


class TensorMismatchError(CollectiveError, ValueError):
    """Ranks submitted the same named operation with different arguments.

    Raised on every member rank that submitted the operation; the message names the
    operation, the ranks and what differs. Also a ``ValueError``, as it was in earlier
    hvdrun releases.
    """


class InvalidArgumentsError(TensorMismatchError):
    """An op whose arguments cannot run as a rank passed them, found when the ranks
    negotiate it (so that every member raises it rather than waits): alltoall splits that
    do not sum to the rank's rows or do not give one count per rank, rows that do not split
    evenly without splits, a broadcast root outside the process set. A
    :class:`TensorMismatchError`, as these were before; the TensorFlow frontend raises it
    as ``tf.errors.InvalidArgumentError``, Horovod's type for them."""


class NotSupportedWithJoinError(CollectiveError):
    """An allgather, broadcast, alltoall or reducescatter (or an op built on them, such as
    ``broadcast_object`` or a sparse allreduce) ran while a member rank had called
    ``hvd.join()``: as in Horovod, only allreduce (and barrier) go on with joined ranks."""


class InvalidSplitsError(CollectiveError, TypeError, ValueError):
    """Alltoall splits that are not integers. Horovod raises ``ValueError`` here; earlier
    hvdrun releases ``TypeError``: both still catch it."""


class JobSetupError(RuntimeError):
    """``hvd.init()`` found the job set up in a way no retry can mend; raised on every rank
    alike, so elastic jobs do not retry it."""


class SharedGpuError(JobSetupError):
    """``hvd.init()`` found two ranks on one host that would run NCCL on the same GPU, which
    NCCL refuses. Raised on every rank, naming the host, the ranks and the ways out."""


class SettingsMismatchError(JobSetupError):
    """``hvd.init()`` found ranks running with different engine settings that must agree
    (fusion thresholds, the response cache, autotune): their collectives would not match.
    Raised on every rank, naming the setting and each rank's value."""


class NotInitializedError(ValueError):
    """An API that needs the runtime was called before ``hvd.init()`` (or after
    ``hvd.shutdown()``, which ``shut_down`` says).

    A ``ValueError`` subclass because Horovod raises ``ValueError`` in this situation.
    """

    def __init__(self, what: str = "this function", shut_down: bool = False) -> None:
        if shut_down:  # (an op of a thread the script left running after it, say)
            super().__init__(
                f"hvdrun collectives are not initialized: hvd.shutdown() was called; call "
                f"hvd.init() again before using {what}"
            )
        else:
            super().__init__(
                f"hvdrun collectives are not initialized: call hvd.init() before using {what}"
            )


def describe(error: BaseException) -> dict[str, str]:
    """An exception as a launcher reports it from a worker that ran a function
    (``hvdrun.run``, ``collectives.spark.run``): its type, message and traceback."""
    return {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


def exit_code(leaving: SystemExit) -> int:
    """The exit code a ``SystemExit`` gives its process, by Python's rule: None is 0, an int
    itself, anything else (a message) 1."""
    code = leaving.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1
