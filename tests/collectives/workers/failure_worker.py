"""Worker for the failure tests, started by the tests' own rendezvous harness.

Modes:
  peer-death  rank 1 dies after one allreduce; rank 0 must get HorovodInternalError.
  kill-pending  (3 ranks) ranks 0 and 1 wait on async ops that need rank 2, which is killed:
              every pending op and every later op must raise HorovodInternalError.
  stranded    (4 ranks) the last rank stops itself (SIGSTOP) and is killed (SIGKILL) 1.5 s
              later, while the others wait for it inside a negotiation round. Gloo's ring
              connects it to two of them only: the third waits on one of those, which must not
              leave it waiting until the collective timeout (argv[2]: a directory where each
              survivor marks its failure; it stays alive until all of them did, as a worker
              of an elastic job would).
  hung-peer   rank 1 stops itself (SIGSTOP); rank 0's op fails after the collective timeout.
  stall       rank 1 never submits an op rank 0 waits for: the stall inspector warns, then
              shuts the collectives down on both ranks.
  leave       rank 1 shuts down while rank 0 waits for an op it will never submit.
  lost        the worker starts a child in its process group, reports both pids and waits;
              the test then stops the rendezvous server.
  bad-secret  hvd.init() must fail with a clear error.
  local-error rank 0 resizes a tensor while its op is in flight: its engine fails on its own
              (and says so), rank 1's because rank 0 went away (and says that). argv[2]:
              'fused' (a new burst: fused after the full negotiation), 'predicted' or
              'grown' (a burst repeated until the response cache predicts it; the tensor
              shrinks or grows).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import collectives.torch as hvd
from collectives import runtime

_alone: list[hvd.ProcessSet] = []


def alone() -> hvd.ProcessSet:
    """A process set of rank 1 alone (registered on both ranks at start-up)."""
    return _alone[0]


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
    if mode == "stall":
        _alone.append(hvd.add_process_set([1]))
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
            figures = runtime.engine().arrivals()  # (the failed set's, up to its stop)
            print(f"time in collectives {figures.busy:.3f} s of {figures.elapsed:.3f} s")
            sys.exit(3)
        sys.exit("no error although the peer died")
    if mode == "kill-pending":
        hvd.allreduce(torch.ones(4))
        if hvd.rank() == 2:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        handles = [hvd.allreduce_async(torch.ones(4), name=f"pending.{i}") for i in range(3)]
        started = time.monotonic()
        failures = 0
        for handle in handles:
            try:
                hvd.synchronize(handle)
            except hvd.HorovodInternalError:
                failures += 1
        elapsed = time.monotonic() - started
        try:
            hvd.allreduce(torch.ones(4), name="later")
        except hvd.HorovodInternalError as error:
            print(f"later op raised: {error}", flush=True)
            failures += 1
        print(f"{failures} ops raised HorovodInternalError within {elapsed:.2f} s", flush=True)
        sys.exit(3)
    if mode == "stranded":
        hvd.allreduce(torch.ones(4))
        if hvd.rank() == hvd.size() - 1:
            # Killed by a child while stopped: the survivors are blocked in a round with it.
            subprocess.Popen(["sh", "-c", f"sleep 1.5; kill -KILL {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(30)
            sys.exit("the last rank outlived its SIGKILL")
        started = time.monotonic()
        try:
            hvd.allreduce(torch.ones(4), name="stranded")
        except hvd.HorovodInternalError as error:
            elapsed = time.monotonic() - started
            print(f"caught HorovodInternalError after {elapsed:.2f} s: {error}", flush=True)
            # Stay alive (an exiting process closes its connections anyway) until the other
            # survivors failed as well.
            markers = Path(sys.argv[2])
            (markers / f"failed.{hvd.rank()}").touch()
            while (
                time.monotonic() - started < 40
                and len(list(markers.glob("failed.*"))) < hvd.size() - 1
            ):
                time.sleep(0.05)
            sys.exit(3)
        sys.exit("no error although a peer died")
    if mode == "hung-peer":
        hvd.allreduce(torch.ones(4))
        if hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        started = time.monotonic()
        try:
            hvd.allreduce(torch.ones(4), name="hung")
        except hvd.HorovodInternalError as error:
            elapsed = time.monotonic() - started
            print(f"caught HorovodInternalError after {elapsed:.2f} s: {error}", flush=True)
            sys.exit(3)
        sys.exit("no error although the peer hung")
    if mode == "stall":
        hvd.allreduce(torch.ones(4))
        started = time.monotonic()
        try:
            if hvd.rank() == 0:
                hvd.allreduce(torch.ones(4), name="stuck")
            else:
                while time.monotonic() - started < 30:
                    time.sleep(0.1)
                    hvd.allreduce(torch.ones(1), name="unrelated", process_set=alone())
        except hvd.HorovodInternalError as error:
            elapsed = time.monotonic() - started
            print(f"caught HorovodInternalError after {elapsed:.2f} s: {error}", flush=True)
            sys.exit(3)
        sys.exit("no error although the job stalled")
    if mode == "leave":
        hvd.allreduce(torch.ones(4))
        if hvd.rank() == 1:
            time.sleep(0.5)
            hvd.shutdown()
            print("rank 1 shut down", flush=True)
            sys.exit(0)
        started = time.monotonic()
        try:
            hvd.allreduce(torch.ones(4), name="never")
        except hvd.HorovodInternalError as error:
            elapsed = time.monotonic() - started
            print(f"caught HorovodInternalError after {elapsed:.2f} s: {error}", flush=True)
            sys.exit(3)
        sys.exit("no error although the peer left")
    if mode == "local-error":
        hvd.allreduce(torch.ones(4))
        tensors = [torch.ones(3) for _ in range(4)]
        started = time.monotonic()
        last = 0 if sys.argv[2] == "fused" else 7
        resized = {"fused": 0, "predicted": 1, "grown": 5}[sys.argv[2]]
        try:
            for step in range(last + 1):
                handles = [hvd.allreduce_async_(t, name="abcd"[i]) for i, t in enumerate(tensors)]
                if step == last:
                    stats = runtime.engine().stats
                    print(f"predicted rounds before: {stats['predicted_rounds']}", flush=True)
                    if hvd.rank() == 0:
                        # (long before the cycle: the job's cycle time is long)
                        tensors[0].resize_(resized)
                for handle in handles:
                    hvd.synchronize(handle)
                torch._foreach_mul_(tensors, 0.5)
        except hvd.HorovodInternalError as error:
            elapsed = time.monotonic() - started
            print(f"caught HorovodInternalError after {elapsed:.2f} s: {error}", flush=True)
            sys.exit(3)
        sys.exit("no error although a tensor was resized in flight")
    if mode == "lost":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(f"ready {os.getpid()} {child.pid}", flush=True)
        time.sleep(120)
        sys.exit("still running although the rendezvous is gone")
    sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
