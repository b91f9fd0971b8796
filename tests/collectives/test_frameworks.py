"""Frameworks that own the job: Lightning and Accelerate train with their own DDP on 2 CPU
processes, and ``hvd.init()`` joins their default group for hvd's metric collectives.

Each test runs the framework's own multi-process start (Lightning's ``Trainer`` re-running
the script, ``accelerate launch`` with torchrun underneath) and checks real values against
the framework's own reductions (workers/lightning_worker.py, workers/accelerate_worker.py).
They skip where the framework is not installed (``pip install -e '.[lightning]'`` /
``'.[accelerate]'``).
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys

import pytest
import torch

from tests.collectives.conftest import REPO, WORKERS, clean_env
from tests.collectives.test_other_launchers import free_port, identities


def installed(*names: str) -> bool:
    return any(importlib.util.find_spec(name) is not None for name in names)


def run(command: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env or clean_env(), cwd=REPO
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    host = socket.gethostname()
    assert identities(output) == {0: (2, 0, 2, 0, 1, host), 1: (2, 1, 2, 0, 1, host)}, output
    assert "FAIL" not in output, output
    for rank in range(2):
        assert f"ALL OK rank {rank}:" in output, output
    return output


@pytest.mark.slow
@pytest.mark.skipif(
    not installed("lightning", "pytorch_lightning"),
    reason="Lightning is not installed (pip install -e '.[lightning]')",
)
def test_lightning_ddp_with_hvd_metrics() -> None:
    output = run([sys.executable, str(WORKERS / "lightning_worker.py")])
    assert output.count("OK epoch 1: hvd.allreduce") == 2, output


@pytest.mark.slow
@pytest.mark.skipif(
    not installed("accelerate"),
    reason="Accelerate is not installed (pip install -e '.[accelerate]')",
)
def test_accelerate_ddp_with_hvd_metrics() -> None:
    # Accelerate gives each process the GPU of its local rank: with fewer than 2 GPUs the
    # two processes train on the CPU (no GPU visible).
    env = clean_env()
    if torch.cuda.device_count() < 2:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(WORKERS / "accelerate_worker.py"),
    ]  # fmt: skip
    output = run(command, env)
    assert output.count("OK step 3: hvd.allreduce") == 2, output
