"""Horovod's Spark integration: ``collectives.spark.run`` and ``run_elastic``.

Each process of the job runs in a Spark task of its own, and the processes join through
hvdrun's own rendezvous, which the driver serves: ``hvd.init()`` (:mod:`collectives.torch`)
inside the function works as under ``hvdrun``. The parts:

* :mod:`.runner` -- :func:`run`: a fixed number of processes in one barrier stage;
* :mod:`.elastic` -- :func:`run_elastic`: hvdrun's elastic jobs, one task attempt per host;
* :mod:`.job` -- what both share on the driver: the Spark job, the tasks' streams, output,
  failures (:class:`SparkJobError`);
* :mod:`.channel` -- the stream between the driver and each task;
* :mod:`.task` and :mod:`.worker` -- what runs in a task: the task supervises one worker
  process, which runs the function;
* :mod:`.placement` -- the pure decisions: ranks, GPUs, where the driver listens.

PySpark's ``TorchDistributor`` needs none of this: ``hvd.init()`` in its training function
joins the job torchrun started (docs/spark.md).

This frontend imports no other frontend; it needs PySpark (``pip install 'hvdrun[spark]'``).
"""

from __future__ import annotations

try:
    import pyspark as _pyspark  # noqa: F401  (only to say what is missing)
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "collectives.spark needs PySpark: pip install 'hvdrun[spark]' (or pip install pyspark)"
    ) from error

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collectives.spark.elastic import run_elastic
    from collectives.spark.job import SparkJobError
    from collectives.spark.runner import run

__all__ = ["SparkJobError", "run", "run_elastic"]


def __getattr__(name: str) -> Any:
    # Imported on first use: ``python -m collectives.spark.worker`` imports this package
    # first, and each worker must not pay for (nor pre-import) the driver's modules.
    if name == "run":
        from collectives.spark.runner import run

        return run
    if name == "run_elastic":
        from collectives.spark.elastic import run_elastic

        return run_elastic
    if name == "SparkJobError":
        from collectives.spark.job import SparkJobError

        return SparkJobError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
