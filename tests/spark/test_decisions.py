"""The Spark frontend's decisions without a cluster: ranks and GPUs from the tasks' reports,
where the driver listens, the start timeout, the elastic membership, the failure to name,
and the task channel (a real gRPC stream on loopback, with a wrong secret refused)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'hvdrun[spark]')")

from collectives.spark.channel import (
    HELLO,
    START,
    Closed,
    Received,
    TaskChannelClient,
    TaskChannelServer,
    decode_exit,
    encode_exit,
    json_frame,
    read_json,
)
from collectives.spark.job import Failure, TaskState, first_cause, horovod_options
from collectives.spark.membership import Membership, Publish, Stop, Wait
from collectives.spark.placement import (
    ServerPlan,
    TaskReport,
    elastic_host,
    executor_of,
    plan_server,
    resolve_start_timeout,
    slot_table,
    visible_devices,
)


def _report(partition: int, host: str, gpus: tuple[str, ...] = ()) -> TaskReport:
    return TaskReport(partition, 0, str(partition), host, gpus)


def test_ranks_fill_hosts_in_the_order_of_their_lowest_partition() -> None:
    # Partitions 0 and 2 on host a, 1 and 3 on host b: a's tasks take ranks 0 and 1.
    reports = [_report(0, "a"), _report(1, "b"), _report(2, "a"), _report(3, "b")]
    slots = slot_table(reports)
    assert [slot.rank for slot in slots] == [0, 2, 1, 3]
    assert [(s.hostname, s.local_rank, s.cross_rank) for s in slots] == [
        ("a", 0, 0),
        ("b", 0, 1),
        ("a", 1, 0),
        ("b", 1, 1),
    ]
    assert all(slot.size == 4 and slot.local_size == 2 for slot in slots)


def test_gpus_are_listed_per_host_in_local_rank_order() -> None:
    reports = [_report(0, "a", ("3",)), _report(1, "a", ("1",)), _report(2, "b", ("0",))]
    slots = slot_table(reports)
    assert visible_devices(reports, slots) == ["3,1", "3,1", "0"]
    # A task without GPUs: CUDA_VISIBLE_DEVICES is left alone everywhere.
    without = [_report(0, "a", ("0",)), _report(1, "a")]
    assert visible_devices(without, slot_table(without)) == [None, None]


def test_the_executor_comes_from_the_ancestor_jvm() -> None:
    daemon = ["python3", "-m", "pyspark.daemon"]
    jvm = ["java", "-cp", "x", "org.apache.spark.executor.CoarseGrainedExecutorBackend"]
    jvm += ["--driver-url", "spark://x", "--executor-id", "7", "--hostname", "10.0.0.5"]
    assert executor_of([daemon, jvm]) == ("7", "10.0.0.5")
    assert executor_of([daemon, ["java", "org.apache.spark.deploy.SparkSubmit"]]) == (
        "driver",
        None,
    )


def test_the_driver_listens_on_loopback_only_for_a_local_master() -> None:
    assert plan_server("local[2]", "10.0.0.1") == ServerPlan("127.0.0.1", "127.0.0.1")
    assert plan_server("local", "10.0.0.1") == ServerPlan("127.0.0.1", "127.0.0.1")
    assert plan_server("spark://m:7077", "10.0.0.1") == ServerPlan("0.0.0.0", "10.0.0.1")
    assert plan_server("yarn", "10.0.0.1", "10.0.0.1") == ServerPlan("10.0.0.1", "10.0.0.1")
    assert plan_server("k8s://x", "fd00::1") == ServerPlan("::", "fd00::1")


def test_start_timeout_defaults_to_horovods_variable_then_600_s() -> None:
    assert resolve_start_timeout(None, {}) == 600
    assert resolve_start_timeout(None, {"HOROVOD_SPARK_START_TIMEOUT": "30"}) == 30
    assert resolve_start_timeout(5, {"HOROVOD_SPARK_START_TIMEOUT": "30"}) == 5
    with pytest.raises(ValueError, match="HOROVOD_SPARK_START_TIMEOUT must be a positive"):
        resolve_start_timeout(None, {"HOROVOD_SPARK_START_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="start_timeout must be a positive"):
        resolve_start_timeout(0, {})


def _membership(**options: Any) -> Membership:
    settings: dict[str, Any] = dict(
        num_proc=2, min_np=1, max_np=3, elastic_timeout=10.0, reset_limit=None
    )
    settings.update(options)
    return Membership(start_timeout=30.0, started_at=0.0, **settings)


def _start(members: Membership, decision: Any, generation: int) -> None:
    assert isinstance(decision, Publish)
    for member in decision.members:
        member.state = "running"
        if member.worker is None:
            member.worker = member.stream
    members.published(generation)


def test_elastic_generations_follow_the_tasks_that_come_and_go() -> None:
    members = _membership()
    first = members.join(0, elastic_host(_report(0, "a")))
    assert first.host == "a-task0.0"
    assert members.decide(1.0) is None  # waits for num_proc tasks
    second = members.join(1, "b-task1.0")
    decision = members.decide(2.0)
    assert isinstance(decision, Publish) and [s.rank for s in decision.slots] == [0, 1]
    _start(members, decision, 1)
    members.note_holders({0: 1, 1: 1})
    # The task of rank 0 is lost: the survivor, which holds the state, becomes rank 0.
    members.lose(first)
    decision = members.decide(3.0)
    assert isinstance(decision, Publish) and decision.members == [second]
    assert members.resets == 1
    _start(members, decision, 2)
    # Spark's retry arrives: a new host, appended after the older one.
    retry = members.join(2, "a-task0.1")
    decision = members.decide(4.0)
    assert isinstance(decision, Publish) and decision.members == [second, retry]
    _start(members, decision, 3)
    assert members.decide(5.0) is None  # nothing changed since


def test_elastic_jobs_stop_as_hvdrun_does() -> None:
    # Too few tasks after the start timeout.
    members = _membership(num_proc=3, min_np=2)
    members.join(0, "a")
    assert members.decide(10.0) is None
    stop = members.decide(31.0)
    assert isinstance(stop, Stop) and "only 1 of 3 Spark tasks started" in stop.message
    # Fewer than min_num_proc for longer than elastic_timeout.
    members = _membership(num_proc=2, min_np=2)
    one, two = members.join(0, "a"), members.join(1, "b")
    _start(members, members.decide(1.0), 1)
    members.lose(two)
    wait = members.decide(2.0)
    assert isinstance(wait, Wait) and "min_num_proc is 2" in (wait.message or "")
    stop = members.decide(13.0)
    assert isinstance(stop, Stop) and "elastic timeout (10 s)" in stop.message
    # Every holder of the trained state gone.
    members = _membership()
    one, two = members.join(0, "a"), members.join(1, "b")
    _start(members, members.decide(1.0), 1)
    members.note_holders({0: 1})
    members.lose(one)
    stop = members.decide(2.0)
    assert isinstance(stop, Stop) and "training state is lost" in stop.message
    # More resets than reset_limit.
    members = _membership(reset_limit=0)
    one, two = members.join(0, "a"), members.join(1, "b")
    _start(members, members.decide(1.0), 1)
    members.note_holders({0: 1, 1: 1})
    members.lose(two)
    stop = members.decide(2.0)
    assert isinstance(stop, Stop) and "more than reset_limit 0" in stop.message
    # Horovod's order: the reset limit before the state, and before waiting for min_num_proc.
    members = _membership(num_proc=3, min_np=3, reset_limit=0)
    one = members.join(0, "a")
    members.join(1, "b"), members.join(2, "c")
    _start(members, members.decide(1.0), 1)
    members.note_holders({0: 1})
    members.lose(one)
    stop = members.decide(2.0)
    assert isinstance(stop, Stop) and "more than reset_limit 0" in stop.message, stop
    # A generation that never trained does not count as a reset.
    members = _membership(num_proc=2, min_np=1, reset_limit=0)
    one, two = members.join(0, "a"), members.join(1, "b")
    _start(members, members.decide(1.0), 1)
    members.lose(two)
    assert isinstance(members.decide(2.0), Publish) and members.resets == 0


def _state(partition: int, rank: int) -> TaskState:
    return TaskState(partition, _report(partition, "h"), rank=rank)


def test_the_first_cause_is_named_not_a_peers_broken_collective() -> None:
    peer = Failure(_state(0, 0), "exit code 1", {"type": "HorovodInternalError"}, at=1.0)
    lost = Failure(_state(1, 1), "its task was lost", None, at=2.0)
    assert first_cause([peer, lost]) is lost
    raised = Failure(_state(1, 1), "exit code 1", {"type": "ValueError", "message": "x"}, 3.0)
    killed = Failure(_state(0, 0), "its task was lost", None, at=4.0)
    assert first_cause([killed, raised]) is raised
    error = raised.describe("collectives.spark.run()")
    assert str(error).startswith("collectives.spark.run(): rank 1 (task 1, executor 1 on h)")
    assert error.rank == 1 and error.executor == "1" and error.error_type == "ValueError"


def test_frames_round_trip() -> None:
    assert read_json(json_frame(HELLO, {"a": [1]})) == {"a": [1]}
    header, result = decode_exit(encode_exit({"code": 0, "error": None}, b"\x00pickled"))
    assert header == {"code": 0, "error": None} and result == b"\x00pickled"


def test_the_channel_carries_frames_both_ways_and_refuses_a_wrong_secret() -> None:
    events: queue.Queue[Any] = queue.Queue()
    server = TaskChannelServer("the-secret", "job-1", events)
    port = server.start()
    try:
        client = TaskChannelClient(f"127.0.0.1:{port}", "the-secret", "job-1")
        client.send(json_frame(HELLO, {"partition": 0}))
        event = events.get(timeout=10)
        assert isinstance(event, Received) and read_json(event.frame) == {"partition": 0}
        server.send(event.stream, json_frame(START, {"env": {"X": "1"}}))
        assert client.receive(10) == json_frame(START, {"env": {"X": "1"}})
        client.close()
        closed = events.get(timeout=10)
        assert isinstance(closed, Closed) and closed.stream == event.stream

        intruder = TaskChannelClient(f"127.0.0.1:{port}", "not-the-secret", "job-1")
        intruder.send(json_frame(HELLO, {"partition": 1}))
        assert intruder.receive(10) is None and "invalid job token" in intruder.ended
        intruder.close()
        with pytest.raises(queue.Empty):  # nothing of the intruder reached the driver
            events.get(timeout=0.5)
    finally:
        server.stop()


def test_horovods_network_arguments_map_onto_the_workers_environment() -> None:
    env = horovod_options("run()", {"A": "1"}, None, None, ["eth1", "eth0"])
    assert env == {"A": "1", "GLOO_SOCKET_IFNAME": "eth0,eth1", "NCCL_SOCKET_IFNAME": "eth0,eth1"}
    assert horovod_options("run()", None, False, None, None) == {}
    with pytest.raises(ValueError, match="use_mpi and extra_mpi_args are not supported"):
        horovod_options("run()", None, True, None, None)


def test_run_and_run_elastic_take_horovods_arguments_in_horovods_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A positional call written for horovod.spark means the same here."""
    import inspect

    from collectives import spark as hvd_spark
    from collectives.spark import elastic as spark_elastic

    def positional(fn: Any) -> list[str]:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]

    assert positional(hvd_spark.run) == [
        "fn", "args", "kwargs", "num_proc", "start_timeout", "use_mpi", "use_gloo",
        "extra_mpi_args", "env", "stdout", "stderr", "verbose", "nics",
        "prefix_output_with_timestamp", "executable",
    ]  # fmt: skip
    assert positional(hvd_spark.run_elastic) == [
        "fn", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "start_timeout",
        "elastic_timeout", "reset_limit", "env", "stdout", "stderr", "verbose", "nics",
        "prefix_output_with_timestamp", "min_np", "max_np",
    ]  # fmt: skip
    # Horovod's deprecated names still work, with its warning, and mean the new ones.
    monkeypatch.setattr(spark_elastic, "active_context", lambda what: None)
    monkeypatch.setattr(spark_elastic, "num_proc_of", lambda *args: 2)
    with (
        pytest.warns(DeprecationWarning, match="min_np is deprecated, use min_num_proc"),
        pytest.raises(ValueError, match="need min_num_proc <= num_proc <= max_num_proc, got 3"),
    ):
        hvd_spark.run_elastic(print, num_proc=2, min_np=3)


def test_a_binary_output_stream_is_refused_before_the_job_starts() -> None:
    import io

    from collectives.spark.job import Driver

    for name in ("stdout", "stderr"):
        streams: dict[str, Any] = {"stdout": None, "stderr": None, name: io.BytesIO()}
        with pytest.raises(TypeError, match=f"{name} must be a text stream"):
            Driver(None, env=None, prefix_output_with_timestamp=False, verbose=1, **streams)


#: What Spark 4.3 says when a barrier task fails before it reaches the driver (here: the
#: executors' Python lacks psutil), shortened: the cause is only on later lines.
SPARK_TASK_FAILURE = """\
Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. \
Most recent failure reason: Stage failed because barrier task ResultTask(0, 1) finished \
unsuccessfully.
org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown \
from the Python worker: Traceback (most recent call last):
  File "/x/pyspark.zip/pyspark/worker.py", line 4197, in invoke_udf
    func, profiler, deserializer, serializer = read_command(pickleSer, init_info.udf_info)
                                               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/collectives/spark/task.py", line 37, in <module>
    import psutil
ModuleNotFoundError: No module named 'psutil'
 SQLSTATE: 38000
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(...)
\tat org.apache.spark.scheduler.ResultTask.runTask(ResultTask.scala:93)
\tat java.base/java.lang.Thread.run(Thread.java:840)
"""


class _JavaError(Exception):
    """A py4j error as PySpark raises it: the Java exception's message is the whole story."""

    def __init__(self, message: str) -> None:
        super().__init__("An error occurred while calling collectAndServe.\n: " + message)
        self.java_exception = self
        self._message = message

    def getMessage(self) -> str:  # Java's name
        return self._message


def test_a_task_that_fails_before_its_worker_names_the_python_error() -> None:
    from collectives.spark.job import SparkJobError, python_error_of, spark_reason
    from collectives.spark.runner import FixedDriver

    error = _JavaError(SPARK_TASK_FAILURE)
    reason = spark_reason(error)
    assert reason.startswith("Job aborted due to stage failure: Could not recover"), reason
    assert reason.endswith(
        "finished unsuccessfully. The task's Python error: "
        "ModuleNotFoundError: No module named 'psutil'"
    ), reason
    assert "SQLSTATE" not in reason and "\n" not in reason
    assert spark_reason(error, cause=False).endswith("finished unsuccessfully.")
    # The last traceback's exception, its message's lines too, boundedly; none without one.
    chained = "Traceback (most recent call last):\n  x\nKeyError: 1\n\nDuring handling...\n"
    chained += "Traceback (most recent call last):\n  y\nRuntimeError: task 0: the connection"
    chained += "\nto the driver broke\n\tat Java"
    expected = "RuntimeError: task 0: the connection to the driver broke"
    assert python_error_of(chained) == expected
    assert len(python_error_of("Traceback (most recent call last):\nE: " + "x" * 9999)) == 500
    assert python_error_of("Job aborted: executor lost") is None
    assert spark_reason(RuntimeError("Job aborted: executor lost\nat ...")) == (
        "Job aborted: executor lost"
    )
    # run() says it, and chains Spark's exception.
    driver = FixedDriver.__new__(FixedDriver)
    driver.spark_error = error
    with pytest.raises(SparkJobError, match="No module named 'psutil'") as info:
        driver._wait_for_tasks(2, 10.0)
    assert info.value.__cause__ is error


def test_a_task_keeps_its_stream_until_the_driver_has_taken_a_large_result() -> None:
    """A result still on its way is not lost: the task waits for the driver to end the
    stream (here a 64 MiB result, and a driver that answers 0.3 s after the result
    arrived)."""
    import threading
    import time

    from collectives.spark import task as spark_task
    from collectives.spark.channel import EXIT

    result = bytes(range(256)) * (1 << 18)
    events: queue.Queue[Any] = queue.Queue()
    server = TaskChannelServer("the-secret", "job-1", events)
    port = server.start()
    received: list[bytes] = []

    def driver() -> None:
        while not isinstance(event := events.get(timeout=30), Closed):
            if event.frame[:1] == EXIT:
                received.append(decode_exit(event.frame)[1])
                time.sleep(0.3)
                server.end(event.stream)

    thread = threading.Thread(target=driver)
    thread.start()
    client = TaskChannelClient(f"127.0.0.1:{port}", "the-secret", "job-1")
    try:
        args = spark_task.TaskArgs(addr="", job_id="job-1", secret="the-secret")
        supervisor = spark_task._Supervisor(args, _report(0, "h"), client, {"env": {}})
        supervisor._exit(0, None, result)
    finally:
        client.close()  # as run_task does once the report is out
        thread.join(30)
        server.stop()
    assert len(received) == 1 and received[0] == result


def test_a_worker_finds_its_tasks_gpus_by_their_cuda_index_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from collectives.spark import task as spark_task
    from collectives.spark.placement import worker_devices

    # Spark's addresses, by their position in the worker's CUDA_VISIBLE_DEVICES.
    assert worker_devices(["3"], "0,3") == ["1"]
    assert worker_devices(["1", "2"], "3,1, 2,0") == ["1", "2"]
    assert worker_devices(["5"], None) == ["5"] and worker_devices(["5"], "") == ["5"]
    assert worker_devices(["7"], "0,1") == ["7"] and worker_devices([], "0,1") == []

    # The task tells its worker what Spark gave it; the worker translates it.
    def worker_env(report: TaskReport, devices: str | None) -> dict[str, str]:
        start = {"env": {"HVDRUN_RENDEZVOUS_ADDR": "127.0.0.1:1"}}
        if devices is not None:
            start["env"]["CUDA_VISIBLE_DEVICES"] = devices
        args = spark_task.TaskArgs(addr="", job_id="job-1", secret="s")
        client: Any = None
        return spark_task._Supervisor(args, report, client, start)._environment(99)

    reports = [_report(0, "a", ("3",)), _report(1, "a", ("1",))]
    devices = visible_devices(reports, slot_table(reports))
    for report, visible, index in zip(reports, devices, ("0", "1"), strict=True):
        env = worker_env(report, visible)
        for name in (spark_task.GPUS_VARIABLE, "CUDA_VISIBLE_DEVICES"):
            monkeypatch.setenv(name, env[name])
        assert spark_task.get_available_devices() == [index]
    monkeypatch.setenv(
        spark_task.GPUS_VARIABLE, worker_env(_report(0, "a"), None)[spark_task.GPUS_VARIABLE]
    )
    assert spark_task.get_available_devices() == []
    monkeypatch.delenv(spark_task.GPUS_VARIABLE)
    assert spark_task.get_available_devices() == []  # not in a worker


def test_output_is_cut_into_lines_at_each_newline_and_carriage_return_as_it_comes() -> None:
    from collectives.spark.task import output_lines

    def lines(*chunks: bytes, limit: int = 64) -> list[bytes]:
        return list(output_lines(iter(chunks), limit))

    # tqdm: each redraw starts with "\r"; the first ends nothing.
    assert lines(b"\r 0%|", b"\r 50%|#", b"\r100%|##|\n") == [b" 0%|", b" 50%|#", b"100%|##|"]
    assert lines(b"a\r\nb\n\nc\r", b"\nd") == [b"a", b"b", b"", b"c", b"d"]  # \r\n split too
    # an empty line's "\r\n" split between two reads is still a line
    assert lines(b"x\n\r", b"\ny\n") == lines(b"x\n\r\ny\n") == [b"x", b"", b"y"]
    assert lines(b"x" * 10, b"y\n", limit=4) == [b"xxxx", b"xxxx", b"xxy"]
    # A redraw is forwarded when the next one starts, without waiting for the bar's end.
    read: list[bytes] = []

    def worker() -> Iterator[bytes]:
        for chunk in (b"\r 10%|", b"\r 20%|", b"\r 30%|"):
            read.append(chunk)
            yield chunk

    relayed = output_lines(worker())
    assert next(relayed) == b" 10%|" and len(read) == 2
    assert next(relayed) == b" 20%|" and len(read) == 3
    assert list(relayed) == [b" 30%|"]
