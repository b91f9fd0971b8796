"""What the members of a set are told when a rank leaves the job.

A rank that leaves (``hvd.shutdown()``, or the end of its script, which shuts down at exit)
says so in its last round (``FLAG_LEAVING``), and every member stops after that round: the
ops still pending on the others fail with a :class:`~collectives.errors.HorovodInternalError`
that says who left and how. A rank whose script failed (an uncaught exception: see
:mod:`collectives.runtime.exits`) adds ``FLAG_FAILED``, and its last payload carries how,
after its records (where the data of small allreduces rides in other rounds: a leaving
round sends none, see :func:`payload`).
"""

from __future__ import annotations

from collectives.engine import eager

__all__ = [
    "MAX_FAILURE_BYTES",
    "NEXT_GENERATION",
    "culprit",
    "failure_of",
    "left_message",
    "payload",
]

#: How a rank of an elastic job that leaves for the next membership generation (a reset)
#: starts its description: it left the generation, not the job.
NEXT_GENERATION = "it left for the job's next membership generation"
#: At most this many bytes of a failure's description travel (a description is short: see
#: :mod:`collectives.runtime.exits`; this bounds what a peer must hold).
MAX_FAILURE_BYTES = 1024


def payload(records: bytes, room: int, failure: str) -> eager.Riders:
    """The last round's payload of a rank whose script failed: its records, then how it
    failed (no riders: their data would take that place)."""
    riders = eager.select(records, [], room, 0)
    described = failure.encode("utf-8", "replace")[:MAX_FAILURE_BYTES]
    return eager.Riders(riders.payload + described, [], 0, room)


def failure_of(data: bytes | memoryview) -> str:
    """How a leaving member's script failed, from what followed its records."""
    return bytes(data[:MAX_FAILURE_BYTES]).decode("utf-8", "replace")


def left_message(rank: int, leavers: list[int], failures: dict[int, str]) -> str:
    """Why no more collectives can run on ``rank``: ``leavers`` left the job, ``failures``
    (by rank) said how their scripts failed (an empty description: how is not known)."""
    others = [peer for peer in leavers if peer != rank]
    if not others:
        cause = "this rank shut down hvdrun's collectives (hvd.shutdown() or the end of its script)"
    else:
        peer = culprit(rank, leavers, failures)
        if peer in failures:
            how = failures[peer] or "its script failed"
        else:
            how = "it called hvd.shutdown() or its script ended (its last line or sys.exit)"
        if how.startswith(NEXT_GENERATION):
            return (
                f"rank {rank}: rank {peer} left this membership generation: {how}, which "
                "ended the generation's collectives"
            )
        cause = f"rank {peer} left the job: {how}, which ended hvdrun's collectives"
    return f"rank {rank}: {cause}, so no more collectives can run in this job"


def culprit(rank: int, leavers: list[int], failures: dict[int, str]) -> int:
    """The leaver that ended ``rank``'s collectives: the first whose script failed, else
    the first other than ``rank`` (``rank`` itself when it left alone)."""
    others = [peer for peer in leavers if peer != rank] or leavers
    return next((peer for peer in others if peer in failures), others[0])
