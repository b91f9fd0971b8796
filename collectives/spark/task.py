"""What each Spark task of a job runs: it starts one worker process and supervises it.

A task is a small agent, like ``hvdrun``'s per-host agent: it reaches the driver over its
stream (:mod:`.channel`), says which partition, attempt, executor and GPUs it has, and waits
for the environment its worker needs (the job's rendezvous address, secret and TLS
certificate, its rank and local rank). It then starts ``python -m collectives.spark.worker``
(:mod:`.worker`) in a session of its own, hands it the pickled function on its standard
input, forwards its output line by line (:func:`output_lines`), and reports its exit and
result. The worker's environment names the GPUs Spark gave the task
(:data:`GPUS_VARIABLE`), for :func:`get_available_devices` in the function: Spark's
``TaskContext`` is the task's, not the worker's.

Nothing outlives the task's reason to exist. The worker is stopped (SIGTERM to its process
group, SIGKILL after :data:`STOP_GRACE_SECONDS`) when the driver says so, or when the
stream breaks because the driver is gone; and when Spark kills the task's own process (a
cancelled job, a failed barrier stage, a lost executor), the worker sees its standard input
close and kills its process group itself. A worker that has joined the job also exits when
the driver's rendezvous goes away (``hvd.init()``'s heartbeat).

The secret travels inside the task's pickled closure, as every Spark task's code does (turn
on ``spark.network.crypto.enabled`` where the cluster's network is not trusted), then in
the worker's environment, as under ``hvdrun``: never on a command line, never in a Spark
property or job description that the UI shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import psutil

from collectives.spark.channel import (
    HELLO,
    OUTPUT,
    STOP,
    TaskChannelClient,
    encode_exit,
    json_frame,
    read_json,
)
from collectives.spark.placement import TaskReport, executor_of, worker_devices
from collectives.spark.worker import FAILED, OK, RESULT_FD_VARIABLE
from rendezvous import worker_env
from rendezvous.addresses import interface_facing

__all__ = [
    "GPUS_VARIABLE",
    "STOP_GRACE_SECONDS",
    "TaskArgs",
    "get_available_devices",
    "output_lines",
    "run_task",
]

#: How long a worker has between SIGTERM and SIGKILL when its task stops it.
STOP_GRACE_SECONDS = 3.0
MAX_LINE = 64 * 1024
#: Gloo's and NCCL's choice of network interface; the rendezvous's when the job set none.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
STREAMS = {"stdout": b"1", "stderr": b"2"}
#: The GPU addresses Spark gave a worker's task, comma-separated (empty: none), set by the
#: task in its worker's environment for :func:`get_available_devices`.
GPUS_VARIABLE = "HVDRUN_SPARK_TASK_GPUS"


def get_available_devices() -> list[str]:
    """Horovod's ``horovod.spark.task.get_available_devices()``, called in ``fn``: the GPUs
    that Spark gave this worker's task (``spark.task.resource.gpu.amount``), as CUDA
    indices in this process (strings, as Horovod's are): the driver sets each worker's
    ``CUDA_VISIBLE_DEVICES`` to its host's GPUs in local-rank order, so Spark's address
    ``"3"`` is index ``"1"`` when ``CUDA_VISIBLE_DEVICES`` is ``"2,3"``
    (``torch.cuda.set_device(int(get_available_devices()[0]))`` pins the task's own GPU).
    An empty list where Spark gave the task no GPUs, or outside a worker of
    :func:`collectives.spark.run`/:func:`~collectives.spark.run_elastic`."""
    assigned = [gpu for gpu in os.environ.get(GPUS_VARIABLE, "").split(",") if gpu]
    return worker_devices(assigned, os.environ.get("CUDA_VISIBLE_DEVICES"))


@dataclass(frozen=True)
class TaskArgs:
    """What the driver gives every task (pickled into the task's closure)."""

    addr: str  # the driver's task channel
    job_id: str
    secret: str = field(repr=False)
    cert_pem: str = field(default="", repr=False)
    payload: bytes = field(default=b"", repr=False)  # cloudpickle of (fn, args, kwargs)
    #: the user's extra variables (None: unset the variable)
    env: Mapping[str, str | None] = field(default_factory=dict)
    executable: str | None = None
    barrier: bool = True


def _report(barrier: bool, addr: str) -> TaskReport:
    from pyspark import BarrierTaskContext, TaskContext

    context: Any = BarrierTaskContext.get() if barrier else TaskContext.get()
    if context is None:
        raise RuntimeError("collectives.spark: a task function ran outside a Spark task")
    ancestors = []
    with contextlib.suppress(psutil.Error):
        ancestors = [parent.cmdline() for parent in psutil.Process().parents()]
    executor, host = executor_of(ancestors)
    if not host:
        host = interface_facing(addr)[1] or "localhost"
    gpu = context.resources().get("gpu")
    gpus = tuple(str(address) for address in gpu.addresses) if gpu is not None else ()
    return TaskReport(
        context.partitionId(), context.attemptNumber(), executor, host, gpus, os.getpid()
    )


def run_task(args: TaskArgs, _rows: Iterator[Any]) -> Iterator[Any]:
    """The body of every task (``mapPartitions``); yields nothing: results travel over
    the task's stream. Raises when the worker fails, so that Spark sees the task fail."""
    report = _report(args.barrier, args.addr)
    client = TaskChannelClient(args.addr, args.secret, args.job_id, args.cert_pem)
    try:
        client.send(json_frame(HELLO, asdict(report)))
        frame = client.receive()
        if frame is None:
            raise RuntimeError(f"collectives.spark: task {report.partition}: {client.ended}")
        if frame[:1] == STOP:
            return iter(())  # the driver does not need this task (a late or extra attempt)
        _Supervisor(args, report, client, read_json(frame)).run()
        return iter(())
    finally:
        client.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE_SECONDS)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class _Supervisor:
    """One worker process: started, relayed, stopped, reported."""

    def __init__(
        self, args: TaskArgs, report: TaskReport, client: TaskChannelClient, start: dict[str, Any]
    ) -> None:
        self.args = args
        self.report = report
        self.client = client
        self.start = start
        self.stopped: dict[str, Any] | None = None  # the driver's STOP, or the stream's end
        self.reported = threading.Event()  # the exit report is on its way
        self.result = bytearray()

    def _environment(self, result_fd: int) -> dict[str, str]:
        env = dict(os.environ)
        for name, value in self.args.env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        env.update(self.start["env"])
        env.setdefault("PYTHONUNBUFFERED", "1")
        env[GPUS_VARIABLE] = ",".join(self.report.gpus)
        env[RESULT_FD_VARIABLE] = str(result_fd)
        ifname, _ = interface_facing(env[worker_env.RENDEZVOUS_ADDR])
        for name in IFNAME_VARIABLES:
            if ifname is not None and not env.get(name):
                env[name] = ifname
        return env

    def run(self) -> None:
        read_end, write_end = os.pipe()
        executable = self.args.executable or sys.executable
        try:
            proc = subprocess.Popen(
                [executable, "-m", "collectives.spark.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._environment(write_end),
                pass_fds=(write_end,),
                start_new_session=True,
            )
        except OSError as error:
            os.close(read_end)
            message = f"cannot start {executable}: {error}"
            self._exit(127, {"type": "OSError", "message": message})
            raise RuntimeError(f"collectives.spark: {message}") from None
        finally:
            os.close(write_end)
        threads = [
            threading.Thread(target=self._relay, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._relay, args=(proc.stderr, "stderr"), daemon=True),
            threading.Thread(target=self._collect, args=(read_end,), daemon=True),
            threading.Thread(target=self._listen, args=(proc,), daemon=True),
        ]
        for thread in threads:
            thread.start()
        self._hand_over(proc)
        code = proc.wait()
        # What the worker started and left behind in its session goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for thread in threads[:3]:
            thread.join()
        self._finish(code)

    def _hand_over(self, proc: subprocess.Popen[bytes]) -> None:
        """Writes the function to the worker and keeps the pipe open (see :mod:`.worker`)."""
        assert proc.stdin is not None
        try:
            proc.stdin.write(struct.pack(">Q", len(self.args.payload)) + self.args.payload)
            proc.stdin.flush()
        except OSError:
            pass  # the worker died at once: its exit says why

    def _relay(self, pipe: IO[bytes], stream: str) -> None:
        tag = OUTPUT + STREAMS[stream]
        read = getattr(pipe, "read1", pipe.read)  # what is there, without waiting for more
        for line in output_lines(iter(lambda: read(MAX_LINE), b"")):
            self.client.send(tag + line)
        pipe.close()

    def _collect(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for chunk in iter(lambda: pipe.read(1 << 20), b""):
                self.result += chunk

    def _listen(self, proc: subprocess.Popen[bytes]) -> None:
        """Waits for the driver's STOP or the stream's end: either stops the worker, unless
        it has ended and reported already."""
        while True:
            frame = self.client.receive()
            if frame is None:
                if not self.reported.is_set() and self.stopped is None:
                    self.stopped = {"reason": self.client.ended, "fail": True}
                    _kill_group(proc)
                return
            if frame[:1] == STOP and self.stopped is None and not self.reported.is_set():
                self.stopped = read_json(frame)
                _kill_group(proc)

    def _exit(self, code: int, error: dict[str, str] | None, result: bytes = b"") -> None:
        """Reports the worker's exit and result, and keeps the stream until the driver ends
        it, which it does once it has the whole report: a result of up to 1 GiB may take
        minutes on a slow link, and closing the stream earlier would cancel it. No time
        limit: a driver that is gone breaks the stream (a closed socket at once, a vanished
        host within the keepalive's 10 s), and Spark kills the task of a cancelled job."""
        self.reported.set()
        self.client.send(encode_exit({"code": code, "error": error}, result))
        self.client.finish()
        self.client.wait_ended()

    def _finish(self, returncode: int) -> None:
        code = 128 - returncode if returncode < 0 else returncode
        outcome = bytes(self.result)
        error: dict[str, str] | None = None
        result = b""
        if outcome[:1] == OK and code == 0:
            result = outcome[1:]
        elif outcome[:1] == FAILED:
            error = _error_of(outcome[1:])
        elif code == 0:
            code = 1
            error = {"type": "RuntimeError", "message": "the worker exited without a result"}
        else:
            error = {"type": "WorkerExit", "message": _describe_exit(returncode)}
        stopped = self.stopped
        if stopped is not None:
            self.client.finish()
            if stopped.get("fail", True):
                raise RuntimeError(
                    f"collectives.spark: task {self.report.partition} stopped its worker: "
                    f"{stopped.get('reason', '')}"
                )
            return
        self._exit(code, error, result)
        if code != 0:
            assert error is not None
            raise RuntimeError(
                f"collectives.spark: the worker of task {self.report.partition} failed "
                f"({_describe_exit(returncode)}): {error['type']}: {error['message']}"
            )


_LINE_END = re.compile(rb"\r\n|\r|\n")


def output_lines(chunks: Iterable[bytes], limit: int = MAX_LINE) -> Iterator[bytes]:
    """A worker's output, as it comes in ``chunks``, cut into lines without their ends, each
    yielded as soon as its end has come: a line ends at ``\\n``, ``\\r\\n`` or a lone
    ``\\r``, so that each redraw of a progress bar (tqdm starts each with ``\\r``) reaches
    the driver as a line of its own once the next begins, not the whole bar at its end. A
    lone ``\\r`` that ends nothing (tqdm's first) makes no line. A longer line is cut every
    ``limit`` bytes; the last one may have no end."""
    buffer = bytearray()
    skip_newline = False  # a chunk ended with "\r": a "\n" that starts the next one is its end
    empty = False  # ... a "\r" that ended nothing: with that "\n", an empty line
    for chunk in chunks:
        if skip_newline and chunk[:1] == b"\n":
            chunk = chunk[1:]
            if empty:
                yield b""
        buffer += chunk
        data = bytes(buffer)
        start = 0
        for match in _LINE_END.finditer(data):
            empty = match.start() == start and match.group() == b"\r"
            if not empty:
                yield data[start : match.start()]
            start = match.end()
        skip_newline = data.endswith(b"\r")
        del buffer[:start]
        while len(buffer) >= limit:
            yield bytes(buffer[:limit])
            del buffer[:limit]
    if buffer:
        yield bytes(buffer)


def _error_of(data: bytes) -> dict[str, str]:
    import json

    try:
        error = json.loads(data.decode("utf-8"))
    except ValueError:
        return {"type": "RuntimeError", "message": "the worker's error report did not parse"}
    return {str(key): str(value) for key, value in error.items()}


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit code {returncode}"
