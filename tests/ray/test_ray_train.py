"""Ray Train: ``TorchTrainer`` creates the process group, ``hvd.init()`` in the training
function joins it (examples/ray_train_digits.py, on a local Ray instance of 2 CPUs):
hvd's ranks are Ray Train's, hvd.DistributedOptimizer keeps the 2 workers' weights
identical, and the model learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (hvdrun[ray])")
pytest.importorskip("sklearn", reason="the example's data ships with scikit-learn")

from tests.collectives.conftest import REPO, clean_env


def test_torch_trainer_with_hvd_init_inside(tmp_path: Path) -> None:
    script = REPO / "examples" / "ray_train_digits.py"
    command = [sys.executable, str(script), "--num-workers", "2", "--epochs", "3"]
    result = subprocess.run(
        [*command, "--storage-path", str(tmp_path)],
        cwd=REPO,
        env={**clean_env(), "RAY_DEDUP_LOGS": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=280,
    )
    output = result.stdout
    assert result.returncode == 0, output[-6000:]
    assert "hvd (rank, size, local rank) (0, 2, 0), Ray Train's (0, 2, 0)" in output, output
    assert "hvd (rank, size, local rank) (1, 2, 1), Ray Train's (1, 2, 1)" in output, output
    assert "weights identical on every rank: True" in output, output
    found = re.search(r"final test accuracy: ([0-9.]+)", output)
    assert found is not None and float(found.group(1)) >= 0.8, output
