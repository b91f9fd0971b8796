"""``python -m collectives.spark.worker``: the process that runs one rank's function.

Its Spark task (:mod:`collectives.spark.task`) starts it in a session of its own, with the
environment an ``hvdrun`` worker gets, so ``hvd.init()`` inside the function joins the job
through the driver's rendezvous exactly as under ``hvdrun``. What passes between the two:

* standard input: the function, its arguments and keyword arguments, pickled by
  cloudpickle as PySpark pickles what it runs, after their length (8 bytes, big-endian).
  The pipe then stays open without another byte: its end means the task's process is gone
  (Spark killed it, or its executor died), and this process then kills its own process
  group, itself and whatever the function started included. Nothing else can leave a
  training process behind a task that Spark has given up on.
* the file descriptor named by ``HVDRUN_SPARK_RESULT_FD``: ``R`` and the pickled result, or
  ``E`` and a JSON description of the exception (its type, message and traceback).
* standard output and error: the function's own output, which the task forwards to the
  driver line by line.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import threading
import traceback

from collectives.errors import describe, exit_code

#: The descriptor this process writes its result to (set by the task, then removed).
RESULT_FD_VARIABLE = "HVDRUN_SPARK_RESULT_FD"
OK = b"R"
FAILED = b"E"


def _read_exact(fd: int, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError(f"the task sent {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def _watch_task(fd: int) -> None:
    """Ends this process group when the task's end of standard input closes. (Reads the
    descriptor itself: a buffered reader's lock would trouble the interpreter's exit.)"""
    while os.read(fd, 4096):
        pass
    try:
        sys.stderr.write("hvdrun: the Spark task of this worker is gone; exiting\n")
        sys.stderr.flush()
    except Exception:  # stderr may be gone with the task
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)  # this process leads its group


def main() -> int:
    stdin = os.dup(0)
    (length,) = struct.unpack(">Q", _read_exact(stdin, 8))
    payload = _read_exact(stdin, length)
    result_fd = int(os.environ.pop(RESULT_FD_VARIABLE))
    threading.Thread(
        target=_watch_task, args=(stdin,), name="hvdrun-task-watch", daemon=True
    ).start()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the function, and what it starts, must not read the task's pipe
    os.close(devnull)

    from pyspark import cloudpickle

    code = 0
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        outcome = OK + cloudpickle.dumps(fn(*args, **kwargs))
    except SystemExit as leaving:  # the function ended the process: its code counts
        code = exit_code(leaving)
        outcome = (
            OK + cloudpickle.dumps(None)
            if code == 0
            else FAILED + json.dumps(describe(leaving)).encode("utf-8")
        )
    except BaseException as error:
        code = 1
        traceback.print_exc()
        outcome = FAILED + json.dumps(describe(error)).encode("utf-8")
    with os.fdopen(result_fd, "wb") as result:
        result.write(outcome)
    return code


if __name__ == "__main__":
    sys.exit(main())
