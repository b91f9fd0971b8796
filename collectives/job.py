"""What every frontend's ``hvd.*`` job API shares: ``init`` with process sets, Horovod's
deprecated ``average=`` flag, ``join`` and ``barrier``.

Framework-neutral: a frontend (``collectives.torch``, ``collectives.tensorflow``, ...)
re-exports these, so that a process that uses two frameworks joins one job and runs one
engine whichever frontend called ``hvd.init()`` first.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from collectives import ops, runtime
from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.engine.requests import Kind
from collectives.process_sets import add_process_set

__all__ = ["barrier", "handle_average_backwards_compatibility", "init", "join"]

logger = logging.getLogger(__name__)


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initializes the runtime: joins the job started by ``hvdrun`` (or by another launcher,
    or runs as a job of size 1). Calling it again while initialized does nothing.

    ``process_sets``: a list of :class:`ProcessSet` to register right away (the same on
    every rank), or ``"dynamic"`` (accepted for Horovod compatibility; sets can always be
    added later with ``hvd.add_process_set``). A set that cannot be registered fails the
    whole call: the rank is not initialized afterwards (the other ranks' registration of
    that set then fails, saying it left).
    """
    sets = [] if process_sets is None or process_sets == "dynamic" else list(process_sets)
    if not runtime.init(comm):
        unregistered = [s for s in sets if getattr(s, "process_set_id", None) is None]
        if unregistered:
            logger.warning(
                "hvd.init() was called again while initialized: it registers none of its "
                "process_sets (%s); register them with hvd.add_process_set()",
                ", ".join(map(repr, unregistered)),
            )
        return
    try:
        for process_set in sets:
            add_process_set(process_set)
    except BaseException:
        runtime.shutdown()
        raise


def handle_average_backwards_compatibility(op: Any, average: Any) -> ReduceOp:
    """Resolves Horovod's deprecated ``average=`` flag against ``op`` (default Average)."""
    if type(op) is ReduceOp and average is None:
        return op
    if op is not None:
        if average is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        return ReduceOp(op)
    if average is not None:
        warnings.warn(
            # Horovod's words first: users filter the warning by its start.
            "Parameter `average` has been replaced with `op` and will be removed; use "
            "op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=3,
        )
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every rank of the process set has called barrier()."""
    ops.barrier(process_set)


def join(device: Any = -1) -> int:
    """Declares this rank done: until every rank has joined, it takes part in the others'
    allreduces with neutral values (zeros for Sum/Average) and lets their barriers pass.
    As in Horovod, an allgather, broadcast, alltoall or reducescatter that involves a
    joined rank raises :class:`NotSupportedWithJoinError` on the ranks that called it.
    Returns the last rank to join. (``device`` is accepted for Horovod compatibility.)"""
    runtime.engine("hvd.join()")
    result: int = ops.submit(Kind.JOIN, "join", global_process_set, [], []).wait()
    return result
