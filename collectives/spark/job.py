"""What :func:`~collectives.spark.run` and :func:`~collectives.spark.run_elastic` share on the
driver: the Spark job that runs the tasks, the tasks' streams, their output, their failures.

* :class:`SparkJob` submits the tasks from a thread of its own (``collect()`` blocks), in the
  caller's job group if it has one, so that ``sc.cancelJobGroup(group)`` cancels it, and
  under a job tag of its own, by which the driver cancels it alone. Its end is an event.
* :class:`Driver` owns one job's servers (the task channel, then the rendezvous) and its
  event queue; subclasses run the loop. Its ``close()`` always cancels the Spark job if it
  still runs, stops every worker, waits (boundedly) for Spark to finish the tasks and stops
  the servers: whatever ended the run, an exception, a failure, Ctrl-C, nothing is left.
* :class:`Failure` and :func:`first_cause` pick the failure to report: the first by arrival
  that is not a peer's collective failing because of it (``HorovodInternalError``).

Threads: a driver's fields belong to the thread that called ``run``/``run_elastic``; the
channel's and the Spark thread's reports reach it through ``events`` only.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from collectives.spark.channel import (
    EXIT,
    HELLO,
    OUTPUT,
    START,
    STOP,
    Closed,
    Received,
    TaskChannelServer,
    decode_exit,
    json_frame,
    read_json,
)
from collectives.spark.placement import TaskReport, plan_server
from collectives.spark.task import GPUS_VARIABLE, TaskArgs, run_task
from rendezvous import worker_env
from rendezvous.addresses import join_addr
from rendezvous.tls import certificate_for

__all__ = [
    "PEER_FAILURE_GRACE_SECONDS",
    "RESERVED_VARIABLES",
    "Driver",
    "Failure",
    "SparkFinished",
    "SparkJob",
    "SparkJobError",
    "TaskState",
    "active_context",
    "call_payload",
    "first_cause",
    "horovod_options",
    "num_proc_of",
    "positive_integer",
    "python_error_of",
    "spark_reason",
]

logger = logging.getLogger(__name__)

#: After a failure, how long the driver gathers more before it names the cause: a peer
#: whose collective broke because of it may report first.
PEER_FAILURE_GRACE_SECONDS = 2.0
#: How long closing waits for Spark to end the tasks of a cancelled job.
CANCEL_WAIT_SECONDS = 30.0
#: Exceptions that are the consequence of another rank's failure, not a cause.
CONSEQUENCES = frozenset(["HorovodInternalError"])
TIMESTAMP_FORMAT = "%a %b %d %H:%M:%S %Y"  # Horovod's --prefix-timestamp format

#: The variables the driver sets on every worker; ``env`` may not set them.
RESERVED_VARIABLES = worker_env.LAUNCHER_SET | {
    worker_env.GENERATION,
    worker_env.WORKER,
    GPUS_VARIABLE,
}


class SparkJobError(RuntimeError):
    """A worker of a Spark job failed, or its task or executor was lost; the job has
    stopped. ``rank`` (None where no rank had been given yet), ``executor`` and ``host``
    name where; ``error_type`` and ``remote_traceback`` describe the first exception."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        partition: int | None = None,
        executor: str | None = None,
        host: str | None = None,
        error_type: str | None = None,
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.partition = partition
        self.executor = executor
        self.host = host
        self.error_type = error_type
        self.remote_traceback = remote_traceback


def horovod_options(
    what: str,
    env: Mapping[str, Any] | None,
    use_mpi: bool | None,
    extra_mpi_args: str | None,
    nics: Any,
) -> dict[str, Any]:
    """Horovod's MPI and network arguments: there is no MPI here (Gloo on CPU, NCCL on GPU,
    as ``use_gloo`` asks), and ``nics`` become ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``
    in ``env`` (returned)."""
    if use_mpi or extra_mpi_args:
        raise ValueError(
            f"{what}: use_mpi and extra_mpi_args are not supported: hvdrun's workers meet "
            "through its rendezvous and run Gloo (CPU) or NCCL (GPU), not MPI"
        )
    merged = dict(env or {})
    if nics:
        names = ",".join(sorted({nics} if isinstance(nics, str) else set(nics)))
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            merged.setdefault(variable, names)
    return merged


def positive_integer(what: str, name: str, value: Any) -> int:
    """``value``; ValueError naming ``name`` unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: {name} must be a positive integer, got {value!r}")
    return value


def num_proc_of(num_proc: int | None, context: Any, what: str) -> int:
    """``num_proc``, by default ``spark.default.parallelism``."""
    if num_proc is None:
        num_proc = int(context.defaultParallelism)
    return positive_integer(what, "num_proc", num_proc)


def call_payload(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> bytes:
    """What each worker runs, as it unpickles it (:mod:`.worker`): ``(fn, args, kwargs)``
    pickled by cloudpickle, as PySpark pickles what it runs."""
    from pyspark import cloudpickle

    return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))


def active_context(what: str) -> Any:
    """The active SparkContext; a clear error without one."""
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ImportError(
            f"{what} needs PySpark: pip install 'hvdrun[spark]' (or pip install pyspark)"
        ) from None
    context = SparkContext._active_spark_context
    if context is None:
        raise RuntimeError(
            f"{what} needs an active SparkContext: create a SparkSession first "
            "(SparkSession.builder.getOrCreate()), or call it from a PySpark shell or notebook "
            "(a Spark Connect session has none)"
        )
    return context


@dataclass(frozen=True)
class SparkFinished:
    """The Spark job ended: ``error`` is why it failed (None: every task returned)."""

    error: BaseException | None


class SparkJob:
    """The tasks' Spark job, run from a thread of its own (see the module docstring)."""

    def __init__(self, context: Any, tag: str, description: str, events: queue.Queue[Any]):
        self.context = context
        self.tag = tag
        self._description = description
        self._events = events
        self.finished = threading.Event()

    def start(self, submit: Callable[[], Any]) -> None:
        from pyspark import InheritableThread

        def body() -> None:
            error: BaseException | None = None
            try:
                self.context.addJobTag(self.tag)
                self.context.setInterruptOnCancel(True)
                if not self.context.getLocalProperty("spark.job.description"):
                    self.context.setJobDescription(self._description)
                submit()
            except BaseException as failure:
                error = failure
            finally:
                self.finished.set()
                self._events.put(SparkFinished(error))

        InheritableThread(target=body, name="hvdrun-spark-job", daemon=True).start()

    def cancel(self) -> None:
        if not self.finished.is_set():
            with contextlib.suppress(Exception):
                self.context.cancelJobsWithTag(self.tag)

    def wait(self, timeout: float) -> bool:
        return self.finished.wait(timeout)


def spark_reason(error: BaseException, *, cause: bool = True) -> str:
    """What Spark said: the first line of its message (a Java exception's, not its stack)
    and, with ``cause``, the Python exception that failed the task when the message carries
    its traceback (Spark's first line is generic: "Could not recover from a failed barrier
    ResultStage..."), such as ``ModuleNotFoundError: No module named 'psutil'``."""
    texts = []
    java = getattr(error, "java_exception", None)
    if java is not None:
        with contextlib.suppress(Exception):
            texts.append(str(java.getMessage() or ""))
    texts.append(str(error))
    headline = next(
        (line.strip() for text in texts for line in text.splitlines() if line.strip()),
        type(error).__name__,
    )
    if not cause:
        return headline
    python_error = next(filter(None, map(python_error_of, texts)), None)
    if python_error is None or python_error in headline:
        return headline
    end = "" if headline.endswith(".") else "."
    return f"{headline}{end} The task's Python error: {python_error}"


#: The longest a Python exception named in a message may be (a message can be a page).
MAX_CAUSE_CHARS = 500
_TRACEBACK = "Traceback (most recent call last):"


def python_error_of(text: str) -> str | None:
    """The exception line (``SomeError: message``, with the lines its message goes on for)
    of the last Python traceback in ``text``, at most :data:`MAX_CAUSE_CHARS` long; None
    without a traceback."""
    lines = text.splitlines()
    starts = [index for index, line in enumerate(lines) if _TRACEBACK in line]
    if not starts:
        return None
    found: list[str] = []
    for line in lines[starts[-1] + 1 :]:
        unindented = bool(line.strip()) and not line[:1].isspace()
        if found and not unindented:
            break  # the message's end: Spark's " SQLSTATE", the Java stack's "\tat ..."
        if unindented:
            found.append(line.strip())
    if not found:
        return None
    message = " ".join(found)
    if len(message) > MAX_CAUSE_CHARS:
        message = message[: MAX_CAUSE_CHARS - 3] + "..."
    return message


@dataclass
class TaskState:
    """One task's stream as the driver sees it."""

    stream: int
    report: TaskReport
    label: str = ""  # the output prefix: the rank (fixed jobs) or worker number (elastic)
    rank: int | None = None
    started: bool = False
    exited: bool = False
    closed: bool = False
    code: int | None = None
    result: bytes = b""


@dataclass
class Failure:
    """A worker that failed, or a task that was lost, as the driver heard it."""

    task: TaskState
    reason: str  # "exit code 1", "lost: ...", ...
    error: dict[str, str] | None = None
    at: float = field(default_factory=time.monotonic)

    @property
    def consequence(self) -> bool:
        return self.error is not None and self.error.get("type") in CONSEQUENCES

    def describe(self, what: str) -> SparkJobError:
        task = self.task
        who = f"rank {task.rank}" if task.rank is not None else f"task {task.report.partition}"
        place = f"task {task.report.partition}, {task.report.where()}"
        if self.error is not None:
            cause = f"{self.error.get('type', 'Error')}: {self.error.get('message', '')}"
        else:
            cause = self.reason
        message = f"{what}: {who} ({place}) failed: {cause}"
        trace = (self.error or {}).get("traceback", "")
        if trace:
            message += "\nThe worker's traceback:\n" + trace.rstrip()
        return SparkJobError(
            message,
            rank=task.rank,
            partition=task.report.partition,
            executor=task.report.executor,
            host=task.report.host,
            error_type=(self.error or {}).get("type"),
            remote_traceback=trace,
        )


def first_cause(failures: list[Failure]) -> Failure:
    """The failure to report: the first that is not a consequence of another's."""
    causes = [failure for failure in failures if not failure.consequence]
    return min(causes or failures, key=lambda failure: failure.at)


class _Output:
    """Prints workers' lines with Horovod's prefixes: ``[1]<stdout>:text``."""

    def __init__(self, stdout: TextIO | None, stderr: TextIO | None, timestamps: bool) -> None:
        self._streams = {b"1": stdout, b"2": stderr}
        self._timestamps = timestamps

    def line(self, label: str, frame: bytes) -> None:
        kind = frame[1:2]
        target = self._streams.get(kind)
        if target is None:
            target = sys.stdout if kind == b"1" else sys.stderr
        name = "stdout" if kind == b"1" else "stderr"
        text = frame[2:].decode("utf-8", "replace")
        stamp = time.strftime(TIMESTAMP_FORMAT) + " " if self._timestamps else ""
        with contextlib.suppress(Exception):  # a closed stream must not stop the job
            target.write(f"{stamp}[{label}]<{name}>:{text}\n")
            target.flush()


class Driver:
    """One job's driver-side state: servers, tasks, output (see the module docstring)."""

    WHAT = "collectives.spark.run()"

    def __init__(
        self,
        context: Any,
        *,
        env: Mapping[str, Any] | None,
        stdout: TextIO | None,
        stderr: TextIO | None,
        prefix_output_with_timestamp: bool,
        verbose: int,
    ) -> None:
        self.context = context
        # None unsets the variable in the workers, as in Horovod's task service.
        self.env: dict[str, str | None] = {
            name: None if value is None else str(value) for name, value in (env or {}).items()
        }
        clash = sorted(RESERVED_VARIABLES & set(self.env))
        if clash:
            raise ValueError(
                f"{self.WHAT}: env may not set {', '.join(clash)}: the driver sets them for "
                "each worker"
            )
        self.verbose = verbose
        for name, stream in (("stdout", stdout), ("stderr", stderr)):
            if isinstance(stream, io.RawIOBase | io.BufferedIOBase):
                raise TypeError(
                    f"{self.WHAT}: {name} must be a text stream (such as sys.stdout or "
                    f"io.StringIO()), got a binary one ({type(stream).__name__}): the workers' "
                    "lines are text"
                )
        self.output = _Output(stdout, stderr, prefix_output_with_timestamp)
        self.events: queue.Queue[Any] = queue.Queue()
        self.secret = worker_env.new_secret()
        self.job_id = worker_env.new_job_id()
        conf = context.getConf()
        self.plan = plan_server(
            context.master,
            conf.get("spark.driver.host", "127.0.0.1"),
            conf.get("spark.driver.bindAddress", None),
        )
        self.tls = certificate_for(self.plan.bind_host, self.job_id)
        self.cert_pem = self.tls.cert_pem.decode("ascii") if self.tls is not None else ""
        self.channel = TaskChannelServer(
            self.secret, self.job_id, self.events, bind_host=self.plan.bind_host, tls=self.tls
        )
        self.channel_addr = ""
        self.server: Any = None  # the job's RendezvousServer, once made
        self.rendezvous_addr = ""
        self.tasks: dict[int, TaskState] = {}
        self.spark = SparkJob(
            context, f"hvdrun-spark-{self.job_id}", f"hvdrun: {self.WHAT}", self.events
        )
        self.spark_error: BaseException | None = None
        self.failures: list[Failure] = []

    def say(self, message: str, *args: Any) -> None:
        if self.verbose >= 1:
            logger.info(message, *args)

    # ---- lifetime -------------------------------------------------------------------

    def open(self) -> None:
        self.channel_addr = join_addr(self.plan.dial_host, self.channel.start())

    def submit(self, count: int, payload: bytes, executable: str | None, *, barrier: bool) -> None:
        """Starts the Spark job: one stage of ``count`` tasks (in barrier execution mode with
        ``barrier``), each of which dials the driver's channel and runs one worker."""
        args = TaskArgs(
            addr=self.channel_addr,
            job_id=self.job_id,
            secret=self.secret,
            cert_pem=self.cert_pem,
            payload=payload,
            env=self.env,
            executable=executable,
            barrier=barrier,
        )
        task = functools.partial(run_task, args)
        context = self.context

        def collect() -> Any:
            tasks = context.parallelize(range(count), count)
            return (tasks.barrier() if barrier else tasks).mapPartitions(task).collect()

        self.spark.start(collect)

    def serve_rendezvous(self, server: Any) -> None:
        self.server = server
        self.rendezvous_addr = join_addr(self.plan.dial_host, server.start())

    def connection_env(self) -> dict[str, str]:
        return worker_env.connection_env(
            self.rendezvous_addr, self.job_id, self.secret, self.cert_pem
        )

    def close(self) -> None:
        """Cancels the Spark job if it runs, stops every worker, stops the servers."""
        self.spark.cancel()
        for task in self.tasks.values():
            self.stop_task(task, "the job has ended", fail=True)
        if not self.spark.wait(CANCEL_WAIT_SECONDS):
            logger.warning("Spark did not end the job's tasks within %g s", CANCEL_WAIT_SECONDS)
        self.channel.stop()
        if self.server is not None:
            self.server.stop()

    # ---- tasks ----------------------------------------------------------------------

    def stop_task(self, task: TaskState, reason: str, *, fail: bool) -> None:
        if not task.closed:
            self.channel.send(task.stream, json_frame(STOP, {"reason": reason, "fail": fail}))
            self.channel.end(task.stream)

    def start_task(self, task: TaskState, env: dict[str, str]) -> None:
        task.started = True
        self.channel.send(task.stream, json_frame(START, {"env": env}))

    def next_event(self, timeout: float) -> Any:
        """The next event, after the driver's own bookkeeping (output, exits, ends); None
        after ``timeout`` seconds without one."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, SparkFinished):
            self.spark_error = event.error
        elif isinstance(event, Received):
            return self._received(event)
        elif isinstance(event, Closed):
            task = self.tasks.get(event.stream)
            if task is not None and not task.closed:
                task.closed = True
                if task.started and not task.exited:
                    self.failures.append(Failure(task, f"its task was lost ({event.reason})"))
        return event

    def _received(self, event: Received) -> Any:
        kind = event.frame[:1]
        task = self.tasks.get(event.stream)
        if kind == HELLO:
            fields = read_json(event.frame)
            fields["gpus"] = tuple(fields.get("gpus", ()))
            self.tasks[event.stream] = TaskState(event.stream, TaskReport(**fields))
        elif task is None:
            logger.warning("a frame from a task that did not say hello; ignored")
        elif kind == OUTPUT:
            self.output.line(task.label or f"task {task.report.partition}", event.frame)
        elif kind == EXIT:
            header, result = decode_exit(event.frame)
            task.exited = True
            task.code = int(header.get("code", 1))
            task.result = result
            self.channel.end(task.stream)
            if task.code != 0:
                error = header.get("error")
                self.failures.append(Failure(task, f"exit code {task.code}", error))
        return event

    def drain(self, seconds: float) -> None:
        """Handles the events of the next ``seconds``."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            self.next_event(left)

    def gather_failures(self) -> Failure:
        """After a failure: waits the grace period for its consequences, then names the
        cause."""
        self.drain(PEER_FAILURE_GRACE_SECONDS)
        return first_cause(self.failures)
