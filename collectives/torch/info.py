"""``python -m collectives.torch.info``: what ``hvd.init()`` would do in this process.

Run it the way the training script runs (``srun python -m collectives.torch.info``,
``mpirun ... python -m collectives.torch.info``) to see which launcher it detects, this
process's place, and where and how the ranks would meet, without joining anything: no
rendezvous is served or dialled and MPI is not initialised.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from collectives.runtime import launched
from rendezvous import launchers, worker_env


def report() -> list[str]:
    lines = [f"launcher: {launchers.describe()}"]
    if os.environ.get(worker_env.RENDEZVOUS_ADDR):
        lines.append(f"rendezvous: served by hvdrun at {os.environ[worker_env.RENDEZVOUS_ADDR]}")
        return lines
    try:
        placement = launched.detect_placement()
    except launched.JoinError as error:
        return [*lines, f"hvd.init() would fail: {error}"]
    if placement is None or placement.size == 1:
        return [*lines, "rendezvous: none (a job of size 1 needs none)"]
    try:
        meeting = launched.plan_meeting(placement)
    except launched.JoinError as error:
        return [*lines, f"hvd.init() would fail: {error}"]
    if placement.launcher == "mpi" and not meeting.addr:
        usable = importlib.util.find_spec("mpi4py") is not None
        how = "rank 0 sends its address over MPI" + ("" if usable else ", but mpi4py is missing")
        lines.append(f"rendezvous: {how}")
    else:
        lines.append(f"rendezvous: served by rank 0; the ranks meet at {meeting.how}")
    if placement.launcher == "mpi" and meeting.unauthenticated:
        lines.append("authentication: a fresh secret from rank 0, sent over MPI")
    elif meeting.unauthenticated:
        lines.append(
            "authentication: none beyond a token derived from the job id (no HVDRUN_SECRET)"
        )
    else:
        lines.append("authentication: HVDRUN_SECRET")
    lines.append(f"encryption: {_encryption(placement, meeting)}")
    return lines


def _encryption(placement: launchers.Placement, meeting: launched.Meeting) -> str:
    if placement.launcher == "mpi" and not meeting.addr:
        return "TLS unless every rank runs on rank 0's host (the address rank 0 sends decides)"
    if meeting.unauthenticated:
        return "none (TLS needs HVDRUN_SECRET)"
    if not meeting.encrypted:
        return "none (the ranks meet on loopback)"
    return "TLS, with a certificate authority every rank derives from HVDRUN_SECRET"


def main() -> int:
    for line in report():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
