"""collectives.spark.run against PySpark's TorchDistributor: start-up and a short training.

One standalone Spark cluster (tests/spark_cluster.py: a master here, a worker with one
executor in each of two network-namespace hosts; not timed) and one driver session serve
every round; the two ways of running the same 2-process job alternate, round after round:

* ``collectives.spark.run(fn, num_proc=2)``;
* ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)``, with
  ``hvd.init()`` inside (the job torchrun started).

``fn`` imports torch and ``collectives.torch``, calls ``hvd.init()`` and one allreduce, and
notes the time; then it trains a small MLP with ``hvd.DistributedOptimizer`` for
``--steps`` steps (after 5 steps of warm-up) and measures its steps per second. Prints, for
each way, the median and range of: the time from the call to rank 0's first collective
returned, the whole call, and the training's steps/s; and the ratios of the medians.

Needs root (network namespaces), PySpark and Java (``pip install 'hvdrun[spark]'``,
``apt-get install openjdk-17-jre-headless``); without them it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster import unavailable_reason
from tests.spark_cluster import spark_cluster_for_tests, spark_unavailable_reason

WARMUP_STEPS = 5


def job(steps: int) -> dict[str, float]:
    """What both ways run in each process: join, one collective, then a short training."""
    import torch

    import collectives.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce(torch.ones(1), name="first")
    first = time.time()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    features, targets = torch.randn(32, 64), torch.randn(32, 1)
    started = 0.0
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(features), targets).backward()
        optimizer.step()
    rate = steps / (time.perf_counter() - started)
    hvd.shutdown()
    return {"first": first, "steps_per_s": rate}


def timed(call: Callable[[], Any]) -> dict[str, float]:
    """One round: ``call()`` returns rank 0's :func:`job` figures."""
    called = time.time()
    result = call()
    done = time.time()
    assert result is not None
    return {
        "first": result["first"] - called,
        "whole": done - called,
        "steps_per_s": result["steps_per_s"],
    }


def run_round(steps: int) -> dict[str, float]:
    import collectives.spark as hvd_spark

    return timed(lambda: hvd_spark.run(job, args=(steps,), num_proc=2, verbose=0)[0])


def distributor_round(steps: int) -> dict[str, float]:
    from pyspark.ml.torch.distributor import TorchDistributor

    return timed(
        lambda: TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(job, steps)
    )


def summary(name: str, values: list[float]) -> str:
    middle = statistics.median(values)
    return f"{name:<48}{middle:>9.2f}{min(values):>9.2f} .. {max(values):<7.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    options = parser.parse_args()
    reason = spark_unavailable_reason() or unavailable_reason()
    if reason is not None:
        print(f"spark_startup: skipped: {reason}")
        return 0
    import logging

    logging.getLogger("py4j").setLevel(logging.WARNING)
    for cluster in spark_cluster_for_tests(hosts=2):
        session = cluster.session("hvdrun-bench")
        cluster.wait_for_executors(session.sparkContext, 2)
        logging.getLogger("TorchDistributor").setLevel(logging.WARNING)
        run_round(options.steps)  # warm-up: the executors' Python daemons, imports
        distributor_round(options.steps)
        ours: list[dict[str, float]] = []
        theirs: list[dict[str, float]] = []
        for index in range(options.rounds):
            ours.append(run_round(options.steps))
            theirs.append(distributor_round(options.steps))
            print(f"round {index + 1}: run {ours[-1]}, TorchDistributor {theirs[-1]}", flush=True)
        print(f"{'':<48}{'median':>9}{'range':>11}")
        for key, label in (
            ("first", "s to rank 0's first collective"),
            ("whole", "s for the whole call"),
            ("steps_per_s", f"training steps/s ({options.steps} steps)"),
        ):
            print(summary(f"collectives.spark.run: {label}", [r[key] for r in ours]))
            print(summary(f"TorchDistributor + hvd: {label}", [r[key] for r in theirs]))
        for key in ("first", "whole", "steps_per_s"):
            ratio = statistics.median(r[key] for r in theirs) / statistics.median(
                r[key] for r in ours
            )
            print(f"TorchDistributor / run, {key}: {ratio:.2f}x")
        cluster.stop_driver()
    return 0


if __name__ == "__main__":
    sys.exit(main())
