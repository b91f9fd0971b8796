"""``collectives.spark.run``: Horovod's ``horovod.spark.run`` on hvdrun's own rendezvous.

How a job runs:

1. The driver serves the task channel (:mod:`.channel`) with a fresh secret and job id and,
   unless the master is ``local[...]``, TLS with a certificate made for the job.
2. One Spark job of ``num_proc`` tasks in barrier execution mode, so that Spark starts them
   all at once or not at all; each task reaches the driver and says where it runs.
3. Once all have (within ``start_timeout``), the driver numbers the ranks
   (:func:`.placement.slot_table`), serves the job's
   :class:`~rendezvous.server.RendezvousServer` with that slot table, and sends each task
   its worker's environment; each task starts its worker (:mod:`.task`, :mod:`.worker`).
4. ``hvd.init()`` in the function registers with the rendezvous as under ``hvdrun``; the
   workers' output reaches the driver's stdout and stderr with rank prefixes, their results
   come back over the channel, and ``run`` returns them in rank order.

The first failure ends the job: a worker whose function raised or that exited, a task or
executor lost, the Spark job cancelled, Ctrl-C. The driver cancels the Spark job, stops every
worker, stops its servers, and raises :class:`~.job.SparkJobError` naming the rank, the task
and executor, and the first exception (a peer's collective that broke because of it is not
the cause). Tasks of a retried barrier stage that arrive before the workers start replace
those that were lost; after that, Spark's retries are refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from collectives.spark.channel import HELLO, Closed, Received
from collectives.spark.job import (
    CANCEL_WAIT_SECONDS,
    PEER_FAILURE_GRACE_SECONDS,
    Driver,
    SparkJobError,
    TaskState,
    active_context,
    call_payload,
    horovod_options,
    num_proc_of,
    spark_reason,
)
from collectives.spark.placement import resolve_start_timeout, slot_table, visible_devices
from rendezvous import worker_env
from rendezvous.server import RendezvousServer

__all__ = ["START_ADVICE", "run"]

#: What to check when the tasks do not all start (Horovod gives the same advice).
START_ADVICE = (
    "Every process runs in a Spark task of its own, and all of them must run at the same "
    "time: check that the cluster has {num_proc} free task slots (executors x "
    "spark.executor.cores / spark.task.cpus), or give a larger start_timeout (or "
    "HOROVOD_SPARK_START_TIMEOUT) where executors are allocated on demand"
)


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, Any] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Any = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` in ``num_proc`` processes, one per Spark task, as one
    hvdrun job; returns their results in rank order.

    ``num_proc`` defaults to ``spark.default.parallelism``; ``start_timeout`` (default
    ``HOROVOD_SPARK_START_TIMEOUT``, else 600 s) bounds the wait for all tasks to start;
    ``env`` adds variables to every worker's environment (the executor's own); ``stdout``
    and ``stderr`` receive the workers' output (default: the driver's); ``executable`` is
    the Python that runs each worker (default: the executor's). Horovod's ``nics`` name the
    workers' network interfaces; ``use_gloo`` is accepted (Gloo is what runs on CPUs), MPI
    is refused. Raises :class:`~collectives.spark.SparkJobError` when a worker fails or its
    task is lost.
    """
    what = FixedDriver.WHAT
    env = horovod_options(what, env, use_mpi, extra_mpi_args, nics)
    context = active_context(what)
    size = num_proc_of(num_proc, context, what)
    timeout = resolve_start_timeout(start_timeout)
    payload = call_payload(fn, args, kwargs)
    driver = FixedDriver(
        context,
        env=env,
        stdout=stdout,
        stderr=stderr,
        prefix_output_with_timestamp=prefix_output_with_timestamp,
        verbose=verbose,
    )
    return driver.run(size, payload, executable, timeout)


class FixedDriver(Driver):
    """One :func:`run`: a fixed number of ranks in one barrier stage."""

    def run(self, size: int, payload: bytes, executable: str | None, timeout: float) -> list[Any]:
        self.open()
        self.say("running %d processes in Spark tasks (Spark job tag %s)", size, self.spark.tag)
        try:
            self.submit(size, payload, executable, barrier=True)
            tasks = self._wait_for_tasks(size, timeout)
            self._start_workers(tasks)
            return self._supervise(tasks)
        finally:
            self.close()

    def _wait_for_tasks(self, size: int, timeout: float) -> list[TaskState]:
        """Every partition's task, once all have said hello; a task of a retried stage
        takes the place of one that was lost."""
        deadline = time.monotonic() + timeout
        by_partition: dict[int, TaskState] = {}
        while len(by_partition) < size:
            if self.spark_error is not None:
                reason = spark_reason(self.spark_error)
                message = f"{self.WHAT}: Spark could not run the {size} tasks: {reason}"
                headline = spark_reason(self.spark_error, cause=False).lower()
                if "slot" in headline or "resource" in headline:
                    message += ". " + START_ADVICE.format(num_proc=size)
                raise SparkJobError(message) from self.spark_error
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.WHAT}: only {len(by_partition)} of {size} Spark tasks started "
                    f"within {timeout:g} s (start_timeout). " + START_ADVICE.format(num_proc=size)
                )
            event = self.next_event(min(left, 1.0))
            if isinstance(event, Received) and event.frame[:1] == HELLO:
                task = self.tasks[event.stream]
                by_partition[task.report.partition] = task
            elif isinstance(event, Closed):
                for partition, task in list(by_partition.items()):
                    if task.stream == event.stream:
                        del by_partition[partition]
        return [by_partition[partition] for partition in range(size)]

    def _start_workers(self, tasks: list[TaskState]) -> None:
        reports = [task.report for task in tasks]
        slots = slot_table(reports)
        devices = visible_devices(reports, slots)
        server = RendezvousServer(
            sorted(slots, key=lambda slot: slot.rank),
            self.secret,
            self.job_id,
            bind_host=self.plan.bind_host,
            tls=self.tls,
        )
        self.serve_rendezvous(server)
        common = self.connection_env()
        for task, slot, device in zip(tasks, slots, devices, strict=True):
            task.rank = slot.rank
            task.label = str(slot.rank)
            env = {**common, **worker_env.slot_env(slot)}
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = device
            self.start_task(task, env)
        hosts = sorted({slot.hostname for slot in slots})
        self.say(
            "%d workers on %d host(s) (%s); rendezvous at %s",
            len(slots),
            len(hosts),
            ", ".join(hosts),
            self.rendezvous_addr,
        )
        # Tasks of a later (retried) stage attempt are not needed any more.
        started = {task.stream for task in tasks}
        for task in self.tasks.values():
            if task.stream not in started:
                self.stop_task(task, "the job's workers have started", fail=False)

    def _supervise(self, tasks: list[TaskState]) -> list[Any]:
        while not all(task.exited and task.code == 0 for task in tasks):
            if self.failures:
                raise self.gather_failures().describe(self.WHAT)
            if self.spark_error is not None:
                self.drain(PEER_FAILURE_GRACE_SECONDS)  # the workers' reports may be on the way
                if self.failures:
                    continue
                raise SparkJobError(
                    f"{self.WHAT}: the Spark job ended before its workers did: "
                    f"{spark_reason(self.spark_error)}"
                ) from self.spark_error
            event = self.next_event(1.0)
            if isinstance(event, Received) and event.frame[:1] == HELLO:
                task = self.tasks[event.stream]
                self.stop_task(task, "the job's workers have started", fail=False)
        from pyspark import cloudpickle

        results = [cloudpickle.loads(task.result) for task in sorted(tasks, key=_rank)]
        self.spark.wait(CANCEL_WAIT_SECONDS)
        return results


def _rank(task: TaskState) -> int:
    assert task.rank is not None
    return task.rank
