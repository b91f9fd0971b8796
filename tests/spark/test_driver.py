"""A driver of its own on the test cluster (tests/spark/driver_process.py): Ctrl-C stops its
job, and when the driver itself is killed every worker, its JVM and its executors end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'hvdrun[spark]')")

from tests.processes import with_repo_on_path
from tests.spark_cluster import REPO, SparkCluster, alive, eventually, no_worker_left, worker_pids


def _wait_for_line(proc: subprocess.Popen[str], text: str, within: float) -> str:
    deadline = time.monotonic() + within
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return line
        assert line or proc.poll() is None, f"the driver exited ({proc.returncode})"
    raise AssertionError(f"the driver did not print {text!r}")


def test_ctrl_c_and_a_killed_driver_leave_nothing_running(
    spark: Any, spark_cluster: SparkCluster, tmp_path: Path
) -> None:
    ours = {proc.pid for _, proc in spark_cluster.executors()}
    env = {**os.environ, "PYTHONPATH": with_repo_on_path()}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.spark.driver_process"),
            *(spark_cluster.master_url, spark_cluster.driver_host, str(tmp_path)),
        ],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        jvm = int(_wait_for_line(proc, "driver jvm", 120).split()[-1])
        first = worker_pids(tmp_path / "1", 2, within=120)
        theirs = [p.pid for _, p in spark_cluster.executors() if p.pid not in ours]
        assert len(theirs) == 2, theirs
        proc.send_signal(signal.SIGINT)  # as Ctrl-C does
        _wait_for_line(proc, "job 1 interrupted", 60)
        no_worker_left([int(words[0]) for words in first.values()])

        second = worker_pids(tmp_path / "2", 2, within=120)
        proc.kill()
        proc.wait(10)
        no_worker_left([int(words[0]) for words in second.values()])
        eventually(lambda: not alive(jvm), "the driver's JVM still runs")
        eventually(lambda: not any(alive(pid) for pid in theirs), "its executors still run")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # The tests' own application keeps its executors.
    assert all(alive(pid) for pid in ours)
