"""A worker's behaviour when its job breaks: a dead peer, a lost rendezvous, a bad secret.

These use a small rendezvous harness instead of hvdrun, because hvdrun stops the other
workers as soon as one fails and would hide the survivor's own exit code and stderr.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

from tests.collectives.conftest import Harness


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_dead_peer_raises_horovod_internal_error(make_harness: Callable[[int], Harness]) -> None:
    harness = make_harness(2)
    workers = [harness.spawn(rank, "peer-death") for rank in range(2)]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    assert workers[1].returncode == 7, outputs[1]
    assert workers[0].returncode == 3, outputs[0]
    assert "caught HorovodInternalError" in outputs[0][0]
    elapsed = float(outputs[0][0].split("after ")[1].split(" s")[0])
    assert elapsed < 10


def test_lost_rendezvous_ends_worker_and_its_group(
    make_harness: Callable[[int], Harness],
) -> None:
    harness = make_harness(1)
    worker = harness.spawn(0, "lost")
    assert worker.stdout is not None
    line = worker.stdout.readline()
    assert line.startswith("ready "), line + worker.communicate(timeout=30)[1]
    child = int(line.split()[2])
    harness.stop()
    _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 1, stderr
    assert f"hvdrun: rank 0 lost its job's rendezvous at {harness.addr} (" in stderr
    assert stderr.rstrip().endswith("; exiting"), stderr
    assert harness.secret not in stderr
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the worker's child survived"


def test_bad_secret_fails_init_clearly(make_harness: Callable[[int], Harness]) -> None:
    harness = make_harness(1)
    worker = harness.spawn(0, "bad-secret", secret="not-the-secret")
    stdout, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stdout + stderr
    assert "init failed: hvd.init() could not register with the rendezvous" in stdout
    assert "not-the-secret" not in stdout + stderr
    assert harness.secret not in stdout + stderr
