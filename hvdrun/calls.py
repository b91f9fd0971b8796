"""What ``hvdrun.run`` hands the CLI for one job, and what it gets back.

``hvdrun.run(fn, ...)`` (:mod:`hvdrun.api`) runs the same command line a user would type,
through the same CLI, with a :class:`FunctionCall` as the click context's object: the
rendezvous store entries its workers read (the pickled function), the prefix of those they
leave (their results), the streams their output goes to, and, once the job has ended, the
launcher's :class:`~launcher.supervision.core.JobResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from launcher.supervision.core import JobResult


@dataclass
class FunctionCall:
    preset: dict[str, bytes] = field(repr=False)
    collect: str
    stdout: BinaryIO | None
    stderr: BinaryIO | None
    result: JobResult | None = None
    interrupted_by: int | None = None  # (the signal that stopped the job while it started)
    elastic: bool = False  # (its ranks change: only the results say how many there were)
