"""Helpers for the collectives tests: running jobs through the hvdrun CLI, and a minimal
rendezvous harness for the failure tests that must see a worker's own exit code and stderr."""

from __future__ import annotations

import functools
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest

from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
_JOB_ENV = re.compile(r"^(HVDRUN_|HOROVOD_)|^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE)$")


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No trace of a launcher in the environment: hvd.init() makes a job of one."""
    for name in ("HVDRUN_RENDEZVOUS_ADDR", "HVDRUN_SECRET", "HVDRUN_JOB_ID", "HVDRUN_ELASTIC"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hvd(alone: None) -> Iterator[ModuleType]:
    """collectives.torch, initialized alone in this process (shut down after the test)."""
    import collectives.torch as hvd_module

    hvd_module.init()
    try:
        yield hvd_module
    finally:
        hvd_module.shutdown()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: runs a training job (several seconds)")


def clean_env() -> dict[str, str]:
    """The test runner's environment minus anything that says "you are a worker of a job".

    On a machine with fewer GPUs than the suite's largest jobs (4 ranks), CUDA tensors go
    through Gloo: frameworks that put tensors on the GPU by themselves (Keras on torch)
    would otherwise have ranks share a GPU under NCCL, which refuses that (tests/gpu tests
    both backends on purpose)."""
    env = {k: v for k, v in os.environ.items() if not _JOB_ENV.search(k)}
    env["PYTHONUNBUFFERED"] = "1"
    if 0 < _visible_gpus() < 4:
        env["HVDRUN_CUDA_BACKEND"] = "gloo"
    return env


@functools.cache
def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_hvdrun(
    num_proc: int,
    script: Path,
    *args: str,
    options: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 180,
) -> tuple[int, str]:
    """Runs ``python -m hvdrun -np N [options] python script args``; returns exit code and
    output (stdout and stderr together)."""
    command = [sys.executable, "-m", "hvdrun", "-np", str(num_proc), *options]
    result = subprocess.run(
        [*command, sys.executable, str(script), *args],
        cwd=REPO,
        env={**clean_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout


def assert_all_ok(code: int, output: str, num_proc: int, expected: list[str]) -> None:
    """A job of worker scripts (see workers/checks.py) passed: exit 0, no FAIL, every rank's
    ALL OK and every expected check on every rank."""
    assert code == 0, output
    assert "FAIL" not in output, output
    for rank in range(num_proc):
        assert f"[{rank}]<stdout>:ALL OK rank {rank}:" in output, output
        for name in expected:
            assert f"[{rank}]<stdout>:OK {name}\n" in output, f"rank {rank} lacks {name}\n{output}"


def spawn_worker(script: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """Starts a worker script of tests/collectives/workers as its own process group, with
    its output captured."""
    return subprocess.Popen(
        [sys.executable, str(WORKERS / script), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


class Harness:
    """A rendezvous server of a local job and its workers, started without hvdrun."""

    def __init__(self, num_proc: int) -> None:
        self.num_proc = num_proc
        self.secret = secrets.token_hex(16)
        self.job_id = "collectives-test"
        self.server = RendezvousServer(
            assign_slots([("localhost", num_proc)], num_proc),
            self.secret,
            self.job_id,
            bind_host="127.0.0.1",
            heartbeat_interval=0.2,
        )
        self.addr = ""

    def start(self) -> None:
        self.addr = f"127.0.0.1:{self.server.start()}"

    def spawn(
        self,
        rank: int,
        *args: str,
        secret: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        env = clean_env()
        env.update(
            HVDRUN_RANK=str(rank),
            HVDRUN_SIZE=str(self.num_proc),
            HVDRUN_LOCAL_RANK=str(rank),
            HVDRUN_LOCAL_SIZE=str(self.num_proc),
            HVDRUN_CROSS_RANK="0",
            HVDRUN_CROSS_SIZE="1",
            HVDRUN_HOSTNAME="localhost",
            HVDRUN_RENDEZVOUS_ADDR=self.addr,
            HVDRUN_JOB_ID=self.job_id,
            HVDRUN_SECRET=self.secret if secret is None else secret,
            HVDRUN_RENDEZVOUS_LOST_AFTER_SECONDS="2",
        )
        env.update(extra_env or {})
        return spawn_worker("failure_worker.py", env, *args)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def make_harness() -> Iterator[Callable[[int], Harness]]:
    """Starts harnesses of the given job size on demand; stops them after the test."""
    made: list[Harness] = []

    def make(num_proc: int) -> Harness:
        harness = Harness(num_proc)
        harness.start()
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.stop()
