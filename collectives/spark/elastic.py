"""``collectives.spark.run_elastic``: Horovod's ``horovod.spark.run_elastic``, with
``hvdrun``'s elastic semantics (docs/elastic.md) over Spark tasks.

A barrier stage is all or nothing, so an elastic job runs in an ordinary one, as
Horovod's does: ``max_num_proc`` tasks, each of which becomes a host of one slot when it
reaches the driver (:mod:`.membership` decides). Spark runs as many of them as the cluster
has room for and retries a task whose worker failed or whose executor was lost
(``spark.task.maxFailures``); the retry is a new host, so executors lost and added while
the job runs shrink and grow it. The driver serves an elastic
:class:`~rendezvous.server.RendezvousServer` and publishes a membership generation on every
change: ``hvd.elastic.run`` inside the function restores the last commit after a lost peer,
syncs new workers from rank 0 and carries on, exactly as under ``hvdrun --min-np/--max-np``.

The job ends when a worker returns (exit 0) and every other has ended: ``run_elastic``
returns the results of the workers of the last generation in rank order, and cancels the
tasks Spark has not run. It fails with :class:`~.job.SparkJobError` when fewer than
``min_num_proc`` workers are left for longer than ``elastic_timeout``, when the training
state is lost, after more than ``reset_limit`` resets, when a worker fails once another has
finished, and when Spark gives up on the stage (a task failed ``spark.task.maxFailures``
times, or the job was cancelled).
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from collectives.spark.channel import EXIT, HELLO, Closed, Received
from collectives.spark.job import (
    Driver,
    Failure,
    SparkJobError,
    TaskState,
    active_context,
    call_payload,
    horovod_options,
    num_proc_of,
    positive_integer,
    spark_reason,
)
from collectives.spark.membership import Member, Membership, Publish, Stop, Wait
from collectives.spark.placement import elastic_host, resolve_start_timeout, resolve_timeout
from rendezvous import worker_env
from rendezvous.rejoin import RejoinWindow
from rendezvous.server import RendezvousServer

__all__ = ["run_elastic"]

#: Horovod's variable and default for how long an elastic job waits for enough workers.
ELASTIC_TIMEOUT_VARIABLE = worker_env.HOROVOD_PREFIX + worker_env.ELASTIC_TIMEOUT
DEFAULT_ELASTIC_TIMEOUT = worker_env.NUMBERS[worker_env.ELASTIC_TIMEOUT].default
#: The Gloo timeout of elastic workers (hvdrun's --failure-timeout default): a hung peer
#: fails the others' collectives after this long; twice it is the rejoin deadline.
FAILURE_TIMEOUT = 5.0


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, Any] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Any = None,
    prefix_output_with_timestamp: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    executable: str | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` as an elastic job of ``num_proc`` workers (at least
    ``min_num_proc``, at most ``max_num_proc``; both default to ``num_proc``, which defaults
    to ``spark.default.parallelism``), one per Spark task; ``fn`` uses ``hvd.elastic.run``.
    Returns the results of the last generation's workers in rank order."""
    what = ElasticDriver.WHAT
    if min_np is not None:  # (Horovod's older names, deprecated there too)
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, 2)
        min_num_proc = min_np if min_num_proc is None else min_num_proc
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, 2)
        max_num_proc = max_np if max_num_proc is None else max_num_proc
    env = horovod_options(what, env, None, None, nics)
    context = active_context(what)
    size = num_proc_of(num_proc, context, what)
    low = positive_integer(what, "min_num_proc", size if min_num_proc is None else min_num_proc)
    high = positive_integer(what, "max_num_proc", size if max_num_proc is None else max_num_proc)
    if not low <= size <= high:
        raise ValueError(
            f"{what}: need min_num_proc <= num_proc <= max_num_proc, got {low}, {size}, {high}"
        )
    if reset_limit is not None and (not isinstance(reset_limit, int) or reset_limit < 0):
        raise ValueError(f"{what}: reset_limit must be a non-negative integer, got {reset_limit!r}")
    waited = resolve_timeout(
        "elastic_timeout", elastic_timeout, ELASTIC_TIMEOUT_VARIABLE, DEFAULT_ELASTIC_TIMEOUT
    )
    started = resolve_start_timeout(start_timeout)
    payload = call_payload(fn, args, kwargs)
    driver = ElasticDriver(
        context,
        env=env,
        stdout=stdout,
        stderr=stderr,
        prefix_output_with_timestamp=prefix_output_with_timestamp,
        verbose=verbose,
    )
    membership = Membership(
        num_proc=size,
        min_np=low,
        max_np=high,
        elastic_timeout=waited,
        reset_limit=reset_limit,
        start_timeout=started,
        started_at=time.monotonic(),
    )
    return driver.run(membership, payload, executable)


class ElasticDriver(Driver):
    """One :func:`run_elastic`: membership generations over Spark task attempts."""

    WHAT = "collectives.spark.run_elastic()"

    def run(self, membership: Membership, payload: bytes, executable: str | None) -> list[Any]:
        self.members = membership
        self.finishing = False
        self._numbers = itertools.count()
        given = {name: value for name, value in self.env.items() if value is not None}
        gloo = worker_env.setting(worker_env.GLOO_TIMEOUT_SECONDS, given)
        self._rejoin: RejoinWindow[Member] = RejoinWindow(
            2 * float(gloo or FAILURE_TIMEOUT), membership.elastic_timeout
        )
        self._elastic_env = worker_env.elastic_env(
            given, membership.elastic_timeout, FAILURE_TIMEOUT
        )
        self.open()
        tasks = membership.max_np
        self.say(
            "running an elastic job of %d (%d to %d) processes in Spark tasks (Spark job tag %s)",
            membership.num_proc,
            membership.min_np,
            tasks,
            self.spark.tag,
        )
        try:
            server = RendezvousServer(
                [],
                self.secret,
                self.job_id,
                bind_host=self.plan.bind_host,
                elastic=True,
                tls=self.tls,
            )
            self.serve_rendezvous(server)
            self.submit(tasks, payload, executable, barrier=False)
            return self._loop()
        finally:
            self.close()

    # ---- the loop -------------------------------------------------------------------

    def _loop(self) -> list[Any]:
        while True:
            event = self.next_event(0.5)
            if isinstance(event, Received):
                self._on_frame(event)
            elif isinstance(event, Closed):
                self._on_closed(event.stream, event.reason)
            self.failures.clear()  # a loss changes the membership here; it ends nothing
            if self.spark_error is not None and not self._done():
                raise SparkJobError(
                    f"{self.WHAT}: the Spark job ended before the workers did: "
                    f"{spark_reason(self.spark_error)}"
                ) from self.spark_error
            if self.finishing:
                self._stop_stranded()
                if self._done():
                    return self._results()
            else:
                self._reconcile(time.monotonic())

    def _member(self, stream: int) -> Member | None:
        return self.members.members.get(stream)

    def _on_frame(self, event: Received) -> None:
        kind = event.frame[:1]
        task = self.tasks.get(event.stream)
        if task is None:
            return
        if kind == HELLO:
            if self.finishing:
                self.stop_task(task, "the job has finished", fail=False)
                return
            host = elastic_host(task.report)
            self.members.join(event.stream, host)
            self.say("task %d (%s) joins as %s", task.report.partition, task.report.where(), host)
        elif kind == EXIT:
            member = self._member(event.stream)
            if member is None or member.state != "running":
                return
            if task.code == 0:
                member.state = "exited"
                self.finishing = True
                return
            self._lost(member, task, f"exited with code {task.code}")

    def _on_closed(self, stream: int, reason: str) -> None:
        member = self._member(stream)
        task = self.tasks.get(stream)
        if member is None or task is None or member.state not in ("ready", "running"):
            return
        self._lost(member, task, f"its task was lost ({reason})")

    def _lost(self, member: Member, task: TaskState, why: str) -> None:
        running = member.state == "running"
        self.members.lose(member)
        if running and self.finishing:
            failure = next((f for f in self.failures if f.task is task), Failure(task, why))
            raise failure.describe(f"{self.WHAT} (after another worker had finished)")
        label = f"worker {member.worker}" if member.worker is not None else "a task"
        self.say("%s on %s failed: %s; the job goes on without it", label, member.host, why)
        self.stop_task(task, why, fail=True)

    # ---- generations ----------------------------------------------------------------

    def _reconcile(self, now: float) -> None:
        members = self.members
        if members.need_publish:
            members.note_holders(self.server.state_holders())
        self._fail_hung(now)
        decision = members.decide(now)
        if isinstance(decision, Stop):
            raise SparkJobError(f"{self.WHAT}: {decision.message}")
        if isinstance(decision, Wait):
            if decision.message:
                self.say("%s", decision.message)
        elif isinstance(decision, Publish):
            self._publish(decision)

    def _publish(self, decision: Publish) -> None:
        generation = self.server.publish(decision.slots)
        self.members.published(generation)
        common = {**self.connection_env(), **self._elastic_env}
        for member, slot in zip(decision.members, decision.slots, strict=True):
            task = self.tasks[member.stream]
            task.rank = slot.rank
            if member.state != "ready":
                continue
            number = next(self._numbers)
            member.worker = number
            member.state = "running"
            task.label = str(number)
            env = {**common, **worker_env.slot_env(slot)}
            env[worker_env.GENERATION] = str(generation)
            env[worker_env.WORKER] = str(number)
            if task.report.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(task.report.gpus)
            self.start_task(task, env)
        self.say(
            "generation %d: %d worker(s): %s",
            generation,
            len(decision.slots),
            ", ".join(m.host for m in decision.members),
        )

    def _fail_hung(self, now: float) -> None:
        """Members that do not rejoin the survivors of a failed collective (who wait for
        the next generation): see :class:`rendezvous.rejoin.RejoinWindow`."""
        members, rejoin = self.members, self._rejoin
        running = members.running()
        if members.generation == 0 or members.need_publish or not running:
            rejoin.close()
            return
        waiting = {host for host, _ in self.server.waiting_slots()}
        late = rejoin.late(
            now,
            bool(waiting & {m.host for m in running}),
            running,
            lambda member: member.host in waiting,
            lambda member: [] if member.worker is None else [member.worker],
            self.server.present_workers,
        )
        rejoin.call_roll_if_due(self.server.call_roll)
        if late is None:
            members.need_publish = True
        for member, answered in late or []:
            self._lost(member, self.tasks[member.stream], rejoin.failure(answered))

    # ---- the end --------------------------------------------------------------------

    def _stop_stranded(self) -> None:
        """Once a worker has finished no generation comes any more: workers that wait for
        one, and tasks not yet started, are stopped (without failing their tasks)."""
        waiting = {host for host, _ in self.server.waiting_slots()}
        for member in self.members.members.values():
            stranded = member.state == "ready" or (
                member.state == "running" and member.host in waiting
            )
            if stranded:
                member.state = "stopped"
                self.stop_task(
                    self.tasks[member.stream], "another worker has finished the job", fail=False
                )

    def _done(self) -> bool:
        return self.finishing and not any(
            m.state in ("ready", "running") for m in self.members.members.values()
        )

    def _results(self) -> list[Any]:
        from pyspark import cloudpickle

        finished = [m for m in self.members.members.values() if m.state == "exited"]
        finished.sort(key=lambda m: (m.rank if m.rank is not None else 1 << 30, m.order))
        return [cloudpickle.loads(self.tasks[m.stream].result) for m in finished]
