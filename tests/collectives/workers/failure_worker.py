"""Worker for the failure tests, started by the tests' own rendezvous harness.

Modes:
  peer-death  rank 1 dies after one allreduce; rank 0 must get HorovodInternalError.
  lost        the worker starts a child in its process group, reports both pids and waits;
              the test then stops the rendezvous server.
  bad-secret  hvd.init() must fail with a clear error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

import collectives.torch as hvd


def main() -> None:
    mode = sys.argv[1]
    if mode == "bad-secret":
        try:
            hvd.init()
        except RuntimeError as error:
            print(f"init failed: {error}", flush=True)
            sys.exit(0)
        sys.exit("init unexpectedly succeeded")
    hvd.init()
    if mode == "peer-death":
        hvd.allreduce(torch.ones(4))
        if hvd.rank() == 1:
            os._exit(7)
        started = time.monotonic()
        try:
            while time.monotonic() - started < 60:
                hvd.allreduce(torch.ones(4))
        except hvd.HorovodInternalError as error:
            elapsed = time.monotonic() - started
            print(f"caught HorovodInternalError after {elapsed:.2f} s: {error}", flush=True)
            sys.exit(3)
        sys.exit("no error although the peer died")
    if mode == "lost":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(f"ready {os.getpid()} {child.pid}", flush=True)
        time.sleep(120)
        sys.exit("still running although the rendezvous is gone")
    sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
