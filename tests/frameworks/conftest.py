"""The TensorFlow and Keras frontends' tests: real TensorFlow and Keras, real jobs.

``make test`` installs TensorFlow, Keras and tf_keras (the ``tensorflow`` and ``keras``
extras); where they are missing, these tests are skipped with the reason."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

MISSING = [
    name for name in ("tensorflow", "keras", "tf_keras") if importlib.util.find_spec(name) is None
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not MISSING:
        return
    skip = pytest.mark.skip(
        reason=f"{', '.join(MISSING)} not installed (pip install -e '.[tensorflow,keras]')"
    )
    for item in items:
        if "tests/frameworks/" in str(item.fspath):
            item.add_marker(skip)


def run_alone(script: str, done: str) -> None:
    """Runs ``script`` in a Python of its own as a job of size 1 (TensorFlow stays out of
    pytest's process) and checks that it exited 0 and printed ``done``."""
    env = {**os.environ, "HVDRUN_LAUNCHER": "none", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("HVDRUN_RENDEZVOUS_ADDR", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert done in result.stdout
