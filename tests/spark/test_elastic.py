"""collectives.spark.run_elastic on the test cluster: an executor lost mid-job shrinks the
job, Spark's retry of its task on the executor that replaces it grows it back, and the
training state survives both (hvd.elastic.run inside the function, unchanged)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'hvdrun[spark]')")

import collectives.spark as hvd_spark
from tests.spark_cluster import (
    SparkCluster,
    eventually,
    in_thread,
    no_worker_left,
    worker_pids,
)

MIN_STEPS = 30
MAX_STEPS = 2000


def elastic_training(pid_dir: str) -> dict[str, Any]:
    """Counts the workers at every step; trains until MIN_STEPS are done and two workers
    are back (at most MAX_STEPS)."""
    import torch

    import collectives.torch as hvd
    from collectives.torch import elastic

    hvd.init()
    worker = os.environ["HVDRUN_WORKER"]
    Path(pid_dir, f"{worker}.pid").write_text(f"{os.getpid()} {os.environ['HVDRUN_HOSTNAME']}")
    state = elastic.ObjectState(step=0, sizes=[])

    @elastic.run
    def train(state: Any) -> None:
        while state.step < MAX_STEPS and (state.step < MIN_STEPS or hvd.size() < 2):
            state.sizes = [*state.sizes, int(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())]
            state.step += 1
            if hvd.rank() == 0:
                Path(pid_dir, "progress").write_text(str(state.step))
            time.sleep(0.1)
            state.commit()

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "sizes": state.sizes}


def _progress(pid_dir: Path) -> int:
    try:
        return int((pid_dir / "progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_an_elastic_job_survives_a_lost_executor(
    spark: Any, spark_cluster: SparkCluster, tmp_path: Path
) -> None:
    runner, outcome = in_thread(
        lambda: hvd_spark.run_elastic(
            elastic_training,
            args=(str(tmp_path),),
            num_proc=2,
            min_num_proc=1,
            max_num_proc=2,
            elastic_timeout=120,
            stdout=io.StringIO(),
            stderr=io.StringIO(),
        )
    )
    started = worker_pids(tmp_path, 2, within=120)
    eventually(lambda: _progress(tmp_path) >= 5, "the job does not train", within=60)
    victim_pid, victim_host = started[1][0], started[1][1].split("-task")[0]
    executors = dict(spark_cluster.executors(spark.sparkContext.applicationId))
    executors[victim_host].kill()  # worker 1's executor, with its task
    runner.join(240)
    assert not runner.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], list), outcome
    results = outcome[0]
    # The job grew back to two workers: the new one runs Spark's retry of the lost task.
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    # The state went on through the loss (no step lost or done twice) and was synced to
    # the worker that came back.
    sizes = results[0]["sizes"]
    assert all(r["sizes"] == sizes and r["step"] == len(sizes) for r in results)
    assert len(sizes) >= MIN_STEPS and sizes[0] == 2 and 1 in sizes
    lost_at = sizes.index(1)
    assert all(size == 2 for size in sizes[:lost_at]) and lost_at >= 5, sizes
    assert sizes[lost_at:] == sorted(sizes[lost_at:]), sizes  # one worker, then two again
    assert (tmp_path / "2.pid").exists()  # Spark's retry of the lost task: worker 2
    no_worker_left([int(started[0][0]), int(victim_pid)])
    spark_cluster.wait_for_executors(spark.sparkContext, 2)
