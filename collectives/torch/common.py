"""Reduction ops and process sets shared by the public API and the op execution layer.

They live apart from both so that the execution layer (``ops``) can be swapped for the
background negotiation engine later without the public module or the optimizer changing.
The numeric values of the reduction ops are Horovod's, so code that stores or compares
them keeps working.
"""

from __future__ import annotations

import enum

__all__ = ["ProcessSet", "ReduceOp", "global_process_set"]


class ReduceOp(enum.IntEnum):
    """How an allreduce combines the tensors of the ranks (values as in Horovod)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


class ProcessSet:
    """A subset of the job's ranks that a collective runs over.

    Only the global process set (all ranks) is supported in this version; the class exists
    so that code passing ``process_set=hvd.global_process_set`` works unchanged.
    """

    def __init__(self, ranks: list[int] | None = None, process_set_id: int = 0) -> None:
        self.ranks = None if ranks is None else sorted(ranks)
        self.process_set_id = process_set_id

    def is_global(self) -> bool:
        """Whether this is the process set of all ranks."""
        return self.ranks is None and self.process_set_id == 0

    def size(self) -> int:
        """Number of ranks in the process set."""
        from collectives.torch import runtime

        return runtime.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the process set (-1 if it is not a member)."""
        from collectives.torch import runtime

        if self.ranks is None:
            return runtime.rank()
        own = runtime.rank()
        return self.ranks.index(own) if own in self.ranks else -1

    def included(self) -> bool:
        """Whether this process is a member of the process set."""
        return self.rank() >= 0

    def __repr__(self) -> str:
        if self.is_global():
            return "ProcessSet(global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
