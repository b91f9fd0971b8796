"""Registering and removing process sets (Horovod's dynamic process sets).

Registration is itself a collective: every rank must call ``add_process_set`` /
``remove_process_set`` for the same sets in the same order. It is negotiated like any op,
so all ranks assign the same id and create the set's torch process group in the same engine
cycle; a rank that passes different ranks gets a TensorMismatchError like any mismatched op.

A public API module (Horovod's ``horovod.torch`` process-set functions), on top of the
submission layer (:mod:`collectives.ops`) and the runtime. ``hvd.init(process_sets=...)``
(:func:`collectives.torch.mpi_ops.init`) registers its sets through :func:`add_process_set`
once the runtime is up; the runtime itself never imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from collectives import ops, runtime
from collectives.common import ProcessSet, global_process_set
from collectives.engine.requests import Kind

__all__ = ["add_process_set", "remove_process_set"]


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set on every rank (call it on all ranks, in the same order);
    returns it with its ``process_set_id`` set."""
    engine = runtime.engine("hvd.add_process_set()")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = process_set.ranks
    set_id = process_set.process_set_id
    known = engine.groups.get(set_id) if set_id is not None else None
    if known is not None and known.ranks == ranks:
        raise ValueError(f"{process_set!r} is already registered")
    process_set.process_set_id = None  # from before a shutdown(): registered anew
    bad = [r for r in ranks if not 0 <= r < engine.size]
    if bad:
        raise ValueError(f"process set ranks {bad} are not ranks of this job (size {engine.size})")
    for group in list(engine.groups.values()):
        if group.ranks == ranks:
            raise ValueError(
                f"a process set with ranks {ranks} is already registered "
                f"(process_set_id {group.process_set_id})"
            )
    common = (",".join(map(str, ranks)),)
    new_id: int = ops.submit(
        Kind.ADD_PROCESS_SET, None, global_process_set, [], [], common=common
    ).wait()
    process_set.process_set_id = new_id
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set on every rank (call it on all ranks, in the same order).
    Returns False for the global set or a set that is not registered."""
    engine = runtime.engine("hvd.remove_process_set()")
    set_id = process_set.process_set_id if isinstance(process_set, ProcessSet) else None
    if set_id is None or set_id == 0 or set_id not in engine.groups:
        return False
    removed: bool = ops.submit(
        Kind.REMOVE_PROCESS_SET, None, global_process_set, [], [], common=(set_id,)
    ).wait()
    process_set.process_set_id = None
    return removed
