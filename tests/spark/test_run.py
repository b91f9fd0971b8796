"""collectives.spark.run on a real standalone Spark cluster (two executors, each on a host of
its own): results by rank, a training that matches one process, and every failure ending
every worker (checked by pid) with an error naming the rank and the executor."""

from __future__ import annotations

import io
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'hvdrun[spark]')")

import collectives.spark as hvd_spark
from rendezvous.addresses import split_addr
from tests.spark_cluster import SparkCluster, in_thread, no_worker_left, worker_pids

STEPS = 5
LEARNING_RATE = 0.1


def _batch() -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(7)
    features = torch.randn(8, 4, generator=generator)
    return features, features @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.25


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


# ---- what the workers run --------------------------------------------------------------


def rank_report_and_training(values: list[list[float]]) -> dict[str, Any]:
    """Allreduces this rank's values, then trains on its half of the batch."""
    import torch

    import collectives.torch as hvd
    from collectives.spark.task import GPUS_VARIABLE, get_available_devices

    hvd.init()
    total = hvd.allreduce(torch.tensor(values[hvd.rank()]), op=hvd.Sum)
    print(f"rank {hvd.rank()} of {hvd.size()} says hello")
    print(f"rank {hvd.rank()} on stderr", file=sys.stderr)
    for percent in (50, 100):  # a progress bar's redraws, as tqdm draws them
        print(f"\rrank {hvd.rank()} {percent}%", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    features, targets = _batch()
    mine = slice(hvd.rank() * 4, hvd.rank() * 4 + 4)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features[mine]), targets[mine])
        loss.backward()
        optimizer.step()
    argv = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in (os.getpid(), os.getppid())]
    secret = os.environ["HVDRUN_SECRET"].encode()
    task_env = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "cross_rank": hvd.cross_rank(),
        "sum": total.tolist(),
        "weights": _flat(model),
        "pid": os.getpid(),
        "host": os.environ["HVDRUN_HOSTNAME"],
        "tls": bool(os.environ.get("HVDRUN_RENDEZVOUS_CERT")),
        "secret_in_argv": any(secret in line for line in argv),
        "rendezvous": os.environ["HVDRUN_RENDEZVOUS_ADDR"],
        "extra": os.environ.get("EXTRA"),
        "devices": (get_available_devices(), os.environ.get(GPUS_VARIABLE)),  # no GPUs here
        # env=None values: unset here, whether the task's environment had them or not.
        "unset": {
            name: (f"\0{name}=".encode() in b"\0" + task_env, os.environ.get(name))
            for name in ("PYSPARK_PYTHON", "NOT_THERE")
        },
    }


def train_on_everything() -> list[Any]:
    """The same training in one process, on the whole batch."""
    import torch

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    features, targets = _batch()
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(features), targets).backward()
        optimizer.step()
    return _flat(model)


def _flat(model: Any) -> list[float]:
    return [value for p in model.parameters() for value in p.detach().flatten().tolist()]


def rank_1_raises(pid_dir: str) -> int:
    import torch

    import collectives.torch as hvd

    hvd.init()
    Path(pid_dir, f"{hvd.rank()}.pid").write_text(f"{os.getpid()}")
    if hvd.rank() == 1:
        raise ValueError("rank 1 gives up")
    for _ in range(600):  # rank 0 waits in collectives until the job ends
        hvd.allreduce(torch.ones(1))
        time.sleep(0.1)
    return 0


def train_until_stopped(pid_dir: str) -> int:
    """Writes its pid and host, then allreduces until the job is ended from outside."""
    import torch

    import collectives.torch as hvd

    hvd.init()
    Path(pid_dir, f"{hvd.rank()}.pid").write_text(f"{os.getpid()} {os.environ['HVDRUN_HOSTNAME']}")
    for _ in range(1200):
        hvd.allreduce(torch.ones(1))
        time.sleep(0.05)
    return 0


# ---- checks ----------------------------------------------------------------------------


def _closed(addr: str) -> bool:
    host, port = split_addr(addr)
    try:
        with socket.create_connection((host, port), 2):
            return False
    except OSError:
        return True


# ---- tests -----------------------------------------------------------------------------


def test_results_by_rank_and_a_training_that_matches_one_process(spark: Any) -> None:
    values = [[1.0, 2.0], [10.0, 20.0]]
    out, err = io.StringIO(), io.StringIO()
    results = hvd_spark.run(
        rank_report_and_training,
        args=(values,),
        env={"EXTRA": "x", "PYSPARK_PYTHON": None, "NOT_THERE": None},
        stdout=out,
        stderr=err,
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == [11.0, 22.0] for r in results)
    # Two executors on two hosts: one rank per host, cross ranks by host.
    assert len({r["host"] for r in results}) == 2
    assert [(r["local_rank"], r["cross_rank"]) for r in results] == [(0, 0), (0, 1)]
    assert all(r["tls"] and not r["secret_in_argv"] and r["extra"] == "x" for r in results)
    unset = {"PYSPARK_PYTHON": (True, None), "NOT_THERE": (False, None)}
    assert all(r["unset"] == unset for r in results), results[0]["unset"]
    assert all(r["devices"] == ([], "") for r in results), results[0]["devices"]
    expected = train_on_everything()
    for result in results:
        assert result["weights"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 says hello\n" in out.getvalue()
        assert f"[{rank}]<stderr>:rank {rank} on stderr\n" in err.getvalue()
        bar = [f"[{rank}]<stderr>:rank {rank} {percent}%" for percent in (50, 100)]
        assert [
            line for line in err.getvalue().splitlines() if "%" in line and f"[{rank}]" in line
        ] == bar, err.getvalue()
    no_worker_left([r["pid"] for r in results])
    assert _closed(results[0]["rendezvous"])


def test_a_failing_rank_is_named_and_every_worker_ends(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(hvd_spark.SparkJobError) as info:
        hvd_spark.run(rank_1_raises, args=(str(tmp_path),), stderr=io.StringIO())
    error = info.value
    message = str(error)
    assert message.startswith("collectives.spark.run(): rank 1 (task "), message
    assert f"executor {error.executor} on {error.host}" in message, message
    assert "ValueError: rank 1 gives up" in message and error.rank == 1, message
    assert error.executor not in (None, "driver") and "Traceback" in error.remote_traceback
    no_worker_left([int(words[0]) for words in worker_pids(tmp_path, 2).values()])


def test_a_lost_executor_fails_the_job_naming_it(
    spark: Any, spark_cluster: SparkCluster, tmp_path: Path
) -> None:
    runner, failure = in_thread(
        lambda: hvd_spark.run(train_until_stopped, args=(str(tmp_path),), stderr=io.StringIO())
    )
    started = worker_pids(tmp_path, 2)
    victim_host = started[1][1]
    executors = dict(spark_cluster.executors(spark.sparkContext.applicationId))
    executors[victim_host].kill()  # the executor's JVM, with its tasks
    runner.join(60)
    assert not runner.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], hvd_spark.SparkJobError), failure
    error = failure[0]
    assert error.rank == 1 and error.host == victim_host, str(error)
    assert "task was lost" in str(error), str(error)
    no_worker_left([int(words[0]) for words in started.values()])
    # The cluster starts another executor for the application, for the tests that follow.
    spark_cluster.wait_for_executors(spark.sparkContext, 2)


def test_cancelling_the_job_group_ends_every_worker(spark: Any, tmp_path: Path) -> None:
    context = spark.sparkContext

    def run() -> Any:
        context.setJobGroup("my-training", "a user's job group", interruptOnCancel=True)
        return hvd_spark.run(train_until_stopped, args=(str(tmp_path),), stderr=io.StringIO())

    runner, failure = in_thread(run)
    started = worker_pids(tmp_path, 2)
    context.cancelJobGroup("my-training")
    runner.join(60)
    assert not runner.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], hvd_spark.SparkJobError), failure
    assert "cancel" in str(failure[0]).lower(), str(failure[0])
    no_worker_left([int(words[0]) for words in started.values()])


def test_too_few_slots_time_out_with_advice(spark: Any) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        hvd_spark.run(train_until_stopped, args=("/nonexistent",), num_proc=3, start_timeout=3)
    message = str(info.value)
    assert "of 3 Spark tasks started within 3 s (start_timeout)" in message, message
    assert "3 free task slots" in message and "HOROVOD_SPARK_START_TIMEOUT" in message
    assert time.monotonic() - started < 60


def test_without_a_spark_context_run_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark import SparkContext

    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    with pytest.raises(RuntimeError, match="needs an active SparkContext"):
        hvd_spark.run(train_on_everything)
