"""Runs a RendezvousServer in its own process, for tests that kill or stop the server.

Usage: python rdzv_server_process.py JOB_ID NUM_PROC HEARTBEAT_INTERVAL
The secret comes on stdin's first line (never argv). Prints the bound port on stdout, then
serves until stdin closes (or the process is killed).
"""

from __future__ import annotations

import sys

from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots


def main() -> None:
    job_id, num_proc, heartbeat = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    secret = sys.stdin.readline().strip()
    slots = assign_slots([("localhost", num_proc)], num_proc)
    with RendezvousServer(
        slots, secret, job_id, bind_host="127.0.0.1", heartbeat_interval=heartbeat
    ) as server:
        print(server.port, flush=True)
        sys.stdin.read()  # until the test closes stdin


if __name__ == "__main__":
    main()
